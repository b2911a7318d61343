"""Backends: the device a rank drives. `host` (memfd + numpy) and `cuda` (VMM + NVRTC + NCCL)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tray.errors import UsageError

if TYPE_CHECKING:  # NOTE: base imports numpy; the driver's warm-up imports this package before numpy
    from tray.backend.base import Backend

BACKENDS = ("host", "cuda")


def open_backend(name: str, ordinal: int, boot_id: str = "") -> Backend:
    """Open the backend `name` on device `ordinal`."""
    if name == "host":
        from tray.backend.host import HostBackend

        return HostBackend.open(ordinal, boot_id)
    if name == "cuda":
        from tray.backend.cuda import CudaBackend

        return CudaBackend.open(ordinal)
    raise UsageError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")


def detect_backend() -> str:
    """"cuda" when a GPU is visible, else "host"."""
    try:
        from tray.backend.cuda import gpu_count
    except ImportError:
        return "host"
    return "cuda" if gpu_count() > 0 else "host"
