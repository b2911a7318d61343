"""Error classes of the tray, arranged by who must act on them (docs/design.md section 10).

Every message says what was expected, what was seen, and what to do.
"""

from __future__ import annotations

import re


class TrayError(Exception):
    """Base of every error the tray raises on purpose."""


class UsageError(TrayError):
    """The person at the keyboard must act: a wrong flag, a call out of order."""


class ManifestError(TrayError):
    """The manifest's author must act. `path` is the file, `json_path` the place inside it."""

    def __init__(self, path: str, json_path: str, message: str) -> None:
        self.path = path
        self.json_path = json_path
        self.detail = message
        super().__init__(f"{path}: {json_path}: {message}")


class HandshakeError(TrayError):
    """Whoever set up the tray must act: offers disagree, a rank never offered, bad messages."""


class WireError(HandshakeError):
    """A control message could not be decoded or was refused (kind, version, token, shape)."""

    def __init__(self, reason: str, sender: str | None = None) -> None:
        self.reason = reason
        self.sender = sender
        super().__init__(f"message from {sender}: {reason}" if sender else reason)


class PeerFailure(TrayError):
    """Operations must act: a rank or GPU died or stalled."""


class BarrierTimeout(PeerFailure):
    """A barrier waited past its timeout; names the group, epoch, waiting and missing ranks."""

    def __init__(
        self, group: str, epoch: int, rank: int, missing: list[int], waited_s: float
    ) -> None:
        self.group = group
        self.epoch = epoch
        self.rank = rank
        self.missing = list(missing)
        self.waited_s = waited_s
        who = ",".join(str(m) for m in self.missing)
        super().__init__(
            f"barrier {group} epoch {epoch}: rank {rank} waited {waited_s:.2f} s for rank {who}"
            f" (rank {who} missing: it died, hangs, or never entered this barrier)"
        )

    @staticmethod
    def missing_in(message: str) -> list[int]:
        """The missing ranks a BarrierTimeout's message names (the head reads them from an error report);
        [] when `message` is not one."""
        found = _MISSING.search(message)
        return [int(r) for r in found.group(1).split(",")] if found else []


_MISSING = re.compile(r"waited [0-9.]+ s for rank ([0-9]+(?:,[0-9]+)*)")


class DeviceError(TrayError):
    """Operations must act: the driver, the GPU or NCCL returned an error."""


class NoRoom(TrayError):
    """The caller must act (evict something, retry): a host pool has too few free pages."""
