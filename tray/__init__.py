"""tray: one SPMD program across the GPUs of one host.

Public API: `init()` (inside a rank started by `tray launch`), `Rank`, `twin` (register a host twin of a
kernel, see `tray.twins`), and the error classes.
Nothing heavy happens at import time.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tray.errors import (
    BarrierTimeout,
    DeviceError,
    HandshakeError,
    ManifestError,
    NoRoom,
    PeerFailure,
    SyncTimeout,
    TrayError,
    UsageError,
)

__all__ = [
    "init",
    "Rank",
    "twin",
    "BarrierTimeout",
    "DeviceError",
    "HandshakeError",
    "ManifestError",
    "NoRoom",
    "PeerFailure",
    "SyncTimeout",
    "TrayError",
    "UsageError",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from tray.rank import Rank


def init(manifest: str | None = None, timeout_s: float = 60.0) -> Rank:
    """Join the tray this process was launched into (by `tray launch`); blocks until every rank is up. `manifest`: a
    file or built-in name, instead of the launch's --manifest (every rank must load the same one). `timeout_s`: how
    long the start-up's waits on the head may take. Returns the Rank (a context manager). Raises UsageError outside a
    tray or on a second call, ManifestError for a manifest it cannot load, HandshakeError when the tray cannot form.
    docs/api.md is the reference."""
    warmup = early = None
    # NOTE: first, before any thread or descriptor of tray's: a descriptor opened meanwhile would take a closed
    # standard one's number (the driver's, NCCL's, ZeroMQ's), and stack dumps and prints would write into it
    from tray.stdfds import fill_closed_std_fds

    fill_closed_std_fds()
    if os.environ.get("TRAY_BACKEND") == "cuda":
        # the driver starts on a thread now, while the rank's modules (numpy, zmq, ...) import below; so does
        # the NCCL join when the head made the ids for it (tray/collectives/early.py)
        try:
            ordinal = int(os.environ.get("TRAY_DEVICE") or os.environ.get("TRAY_RANK") or "")
            rank = int(os.environ.get("TRAY_RANK") or "")
        except ValueError:
            ordinal = rank = -1  # malformed: tray.rank.init reports it
        if ordinal >= 0:
            from tray.backend.cuda import DriverWarmup

            warmup = DriverWarmup(ordinal)
            if rank >= 0:
                from tray.collectives import early as early_join

                early = early_join.from_environ(rank, ordinal, float(timeout_s))
    from tray.rank import init as _init

    return _init(manifest=manifest, timeout_s=timeout_s, warmup=warmup, early=early)


def twin(name: str):
    """Decorator registering a host twin of the manifest kernel `name`; see `tray.twins.twin`."""
    from tray.twins import twin as _twin

    return _twin(name)


def __getattr__(name: str):  # lazy: keeps `import tray` free of numpy/zmq
    if name == "Rank":
        from tray.rank import Rank

        return Rank
    raise AttributeError(name)
