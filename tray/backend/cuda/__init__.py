"""The cuda backend: VMM buffers shared between ranks, NVRTC kernels, the peer barrier, graphs, NCCL.

Only this package imports `cuda.bindings` (through `driver.py`, the checked facade). Importing it is
cheap and works without a GPU or without cuda-bindings: `CudaBackend` loads on first use, and
`visible_gpu_count()` answers 0 where there is no driver or device.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CudaBackend", "pci_bus_ids", "visible_gpu_count"]


def visible_gpu_count() -> int:
    """GPUs this process can use; 0 on any failure (no bindings, no driver, no device). Never raises."""
    try:
        from tray.backend.cuda import driver as drv

        drv.init()
        return drv.device_count()
    except Exception:  # noqa: BLE001 - "no GPU" is the answer to every way of failing here
        return 0


def pci_bus_ids() -> list[str]:
    """PCI bus ids (`0000:1b:00.0`, lowercase) of ordinals 0..n-1; [] when no GPU is visible."""
    count = visible_gpu_count()
    if count == 0:
        return []
    from tray.backend.cuda import driver as drv

    return [drv.device_pci_bus_id(drv.device_get(i)) for i in range(count)]


def __getattr__(name: str) -> Any:  # lazy: `import tray.backend.cuda` stays light
    if name == "CudaBackend":
        from tray.backend.cuda.backend import CudaBackend

        return CudaBackend
    raise AttributeError(name)
