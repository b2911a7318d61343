"""Create this process's GPU context in the background while the rank's program is still importing.

`tray launch` starts Python ranks as `python -m tray.rank.prewarm PROGRAM...`: a thread retains the
primary context of TRAY_DEVICE (cuInit + context creation: ~0.7 s on an H200) while the main thread
imports the program. `CudaBackend.open` then waits for that thread and finds the context made.
"""

from __future__ import annotations

import threading
from typing import Any

_thread: threading.Thread | None = None
_state: dict[str, Any] = {}


def start(ordinal: int) -> None:
    """Begin retaining device `ordinal`'s primary context on a daemon thread (once per process)."""
    global _thread
    if _thread is not None:
        return
    _thread = threading.Thread(target=_warm, args=(ordinal,), name="tray-prewarm", daemon=True)
    _thread.start()


def _warm(ordinal: int) -> None:
    try:
        from tray.backend.cuda import driver as drv

        drv.init()
        dev = drv.device_get(ordinal)
        _state["device"] = dev
        _state["context"] = drv.primary_ctx_retain(dev)
    except Exception as exc:
        _state["error"] = exc


def wait(timeout_s: float = 120.0) -> None:
    """Wait for a started prewarm (no-op when none was started). Failures are left to the caller's
    own attempt, which names them properly."""
    if _thread is not None:
        _thread.join(timeout_s)


def release() -> None:
    """Drop the prewarm's reference to the primary context (the backend holds its own)."""
    dev = _state.pop("device", None)
    if _state.pop("context", None) is not None and dev is not None:
        from tray.backend.cuda import driver as drv

        drv.primary_ctx_release(dev)
