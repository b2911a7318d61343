"""TRAY_* settings that the head and the ranks both read from the environment, the environment of the head's
own helper processes, and the signals that stop a tray. Light (no numpy, no zmq): the head checks them before
it spawns anything, and importing `tray.rank` for that would cost the head ~50 ms of imports before its first
rank starts."""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path

from tray.errors import UsageError


def barrier_timeout(text: str | None) -> float | None:
    """TRAY_BARRIER_TIMEOUT_S as seconds (None when unset or empty). Raises UsageError unless a number > 0."""
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"TRAY_BARRIER_TIMEOUT_S must be a number of seconds > 0, got {text!r}")
    return value


JOIN_MODES = ("auto", "early", "lazy")


def join_collectives(flag: str | None, text: str | None) -> str:
    """When the ranks join NCCL: `flag` (--join-collectives) if given, else TRAY_JOIN_COLLECTIVES (`text`), else
    "auto". Raises UsageError naming the choices."""
    value = flag if flag is not None else (text or "auto")
    if value not in JOIN_MODES:
        where = "--join-collectives" if flag is not None else "TRAY_JOIN_COLLECTIVES"
        raise UsageError(f"{where} must be one of {', '.join(JOIN_MODES)}, got {value!r}")
    return value


def share_gpus(flag: bool | None, text: str | None) -> bool:
    """Whether ranks may share GPUs (`--share-gpus`, else TRAY_SHARE_GPUS: 1/true/yes or 0/false/no/empty).
    Raises UsageError for any other value."""
    if flag is not None:
        return flag
    value = (text or "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise UsageError(f"TRAY_SHARE_GPUS must be 1 (ranks may share GPUs) or 0, got {text!r}")


def own_module(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run `python -P -m <module> <args>` of this very tray (its package first on
    PYTHONPATH; -P: no tray/ in the working directory shadows it): the head's watchdog and NCCL id process."""
    python, path = own_python()
    return [*python, "-m", module, *args], {**os.environ, "PYTHONPATH": path}


def own_python() -> tuple[list[str], str]:
    """`python -P` and the PYTHONPATH (this tray's package first) under which a `-m tray...` module is this very
    tray's, whatever the working directory holds (a folder named tray/, the parent of a checkout): the commands of
    `tray gate` and `tray bench` ranks, and of the heads a bench starts."""
    # NOTE: no empty entry (PYTHONPATH unset or ending in ':'): an empty entry is the working directory, which -P
    # keeps off sys.path for a reason
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [sys.executable, "-P"], os.pathsep.join([str(Path(__file__).resolve().parents[1]), *rest])


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a tray as Ctrl-C does: SIGINT, SIGTERM (kill, scancel, a time limit) and SIGHUP (its
    terminal closed) where SIGHUP would end this process anyway: its handler is the default, or tray's own. Not
    under nohup (SIGHUP ignored: it asked to outlive its terminal), nor in a program that handles SIGHUP itself
    (a reload, say) and calls run_tray(). SIGINT and SIGTERM unless the process ignores them, or a handler installed
    outside Python (by a C program embedding it) handles them."""
    # NOTE: SIGINT and SIGTERM unless ignored (a program started in the background of a script ignores SIGINT), or
    # handled by a handler installed outside Python (getsignal says None: it could not be put back)
    sigs = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) not in (signal.SIG_IGN, None)]
    handler = signal.getsignal(signal.SIGHUP)
    if handler is signal.SIG_DFL or getattr(handler, "stops_tray", False):
        sigs.append(signal.SIGHUP)
    # SIGQUIT (Ctrl-\, kill -QUIT) as torchrun takes it: a stop with the ranks' grace, where it would end this
    # process anyway (its default dumped the head's core and the ranks died at once of the head's death)
    handler = signal.getsignal(signal.SIGQUIT)
    if handler is signal.SIG_DFL or getattr(handler, "stops_tray", False):
        sigs.append(signal.SIGQUIT)
    return tuple(sigs)
