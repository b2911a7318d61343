"""Error classes of the tray, arranged by who must act on them (docs/design.md section 10).

Every message says what was expected, what was seen, and what to do.
"""

from __future__ import annotations

import re


class TrayError(Exception):
    """Base of every error the tray raises on purpose."""


class UsageError(TrayError):
    """The person at the keyboard must act: a wrong flag, a call out of order."""


class SetupError(UsageError):
    """The jobs root, a job dir, a socket in it or the watchdog cannot be made or trusted (exit 2)."""


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


class WaitedForRanks(PeerFailure):
    """A device-side wait of `rank` on the members of `group` passed its timeout at `epoch`; `missing` never
    arrived. The message reads "<where>: rank R waited S s for rank M,.. (<why>)", which `BarrierTimeout.
    missing_in` parses back."""

    def __init__(self, where: str, group: str, epoch: int, rank: int, missing: list[int], waited_s: float,
                 why: str) -> None:
        self.group = group
        self.epoch = epoch
        self.rank = rank
        self.missing = list(missing)
        self.waited_s = waited_s
        who = ",".join(str(m) for m in self.missing)
        super().__init__(f"{where}: rank {rank} waited {waited_s:.2f} s for rank {who} ({why.format(who=who)})")


class BarrierTimeout(WaitedForRanks):
    """A barrier waited past its timeout; names the group, epoch, waiting and missing ranks."""

    def __init__(
        self, group: str, epoch: int, rank: int, missing: list[int], waited_s: float, also: str = ""
    ) -> None:
        why = ("this rank came after the others had waited that long for it and gone on: it was late" if rank in missing
               else "rank {who} missing: it died, hangs, or never entered this barrier" if len(missing) == 1
               else "ranks {who} missing: each died, hangs, or never entered this barrier")
        # `also`: what the waiting rank knows of a missing rank beyond that (a node leader's place in a spanning one)
        self.also = also
        self.repeated = False
        super().__init__(f"barrier {group} epoch {epoch}", group, epoch, rank, missing, waited_s,
                         why + (f"; {also}" if also else ""))

    def again(self) -> BarrierTimeout:
        """This timeout raised again by a later call of the barrier, saying so: after a timeout the barrier stays
        failed on this rank, since its count of barriers no longer matches its peers'."""
        if self.repeated:
            return self
        note = ("raised again by a later call: after a timeout this barrier stays failed on this rank (its count of "
                "barriers no longer matches its peers'); a rank that catches BarrierTimeout should end, or close its "
                "tray")
        copy = BarrierTimeout(self.group, self.epoch, self.rank, self.missing, self.waited_s,
                              f"{self.also}; {note}" if self.also else note)
        copy.repeated = True
        return copy

    @staticmethod
    def missing_in(message: str) -> list[int]:
        """The missing ranks a BarrierTimeout's message names (the head reads them from an error report);
        [] when `message` is not one."""
        found = _WAITED_FOR.search(message)
        return [int(r) for r in found.group(2).split(",")] if found else []

    @staticmethod
    def waited_in(message: str) -> float | None:
        """How long the wait a WaitedForRanks message tells of lasted, s; None when `message` is not one."""
        found = _WAITED_FOR.search(message)
        return float(found.group(1)) if found else None


# NOTE: a rank's number has at most 18 digits (int() refuses thousands); its message may be anything a rank sent
_WAITED_FOR = re.compile(r"waited ([0-9]+(?:\.[0-9]*)?) s for rank ([0-9]{1,18}(?:,[0-9]{1,18})*)(?![0-9])")


class SyncTimeout(PeerFailure):
    """A host wait for the device (a stream or event) passed its deadline. Names what was waited for,
    the last work enqueued before it (program, op, collective), and how long it waited.

    Almost always a collective whose partner never came: a peer rank made different NCCL calls, stopped,
    or is blocked itself. The stream is left as it is (its work may still be running): the rank should
    report and exit."""

    def __init__(self, what: str, pending: str, waited_s: float, setting: str) -> None:
        self.what = what
        self.pending = pending
        self.waited_s = waited_s
        super().__init__(
            f"{what} was not done after {waited_s:.1f} s; last work enqueued before it: {pending}. "
            "A peer may have diverged (made other collective calls or barriers than this rank, in another "
            "order, or stopped): compare the other ranks' messages. If the work is merely that long, raise "
            f"{setting}"
        )


class DeviceError(TrayError):
    """Operations must act: the driver, the GPU or NCCL returned an error."""


class NoRoom(TrayError):
    """The caller must act (evict something, retry): a host pool has too few free pages."""
