"""The cuda backend: VMM buffers shared between ranks, NVRTC kernels, the peer barrier, graphs, NCCL.

Only this package imports `cuda.bindings` (through `driver.py`, the checked facade). Importing it is
cheap and works without a GPU or without cuda-bindings: `CudaBackend` loads on first use, and
`visible_gpu_count()` answers 0 where there is no driver or device.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from tray.text import is_digits

__all__ = ["CudaBackend", "DriverWarmup", "gpu_count", "pci_bus_ids", "proc_gpu_count", "visible_gpu_count"]

_PROC_GPUS = "/proc/driver/nvidia/gpus"  # one directory per GPU, named by its PCI bus id
_PROC_CAPS = "/proc/driver/nvidia/capabilities"  # gpu<minor>/mig/gi<N>: a GPU's MIG instances
_DEV = "/dev"  # nvidiactl and nvidia<minor>: the device nodes a CUDA process opens


def _proc_infos() -> dict[str, dict[str, str]] | None:
    """Every GPU's /proc/driver/nvidia/gpus/<bus>/information as {bus (lowercase): {key: value}}; None when
    any cannot be read."""
    try:
        out = {}
        for name in os.listdir(_PROC_GPUS):
            with open(os.path.join(_PROC_GPUS, name, "information")) as f:
                out[name.lower()] = {k.strip(): v.strip() for k, sep, v in (line.partition(":") for line in f) if sep}
        return out
    except OSError:
        return None


def _identical_gpus() -> bool:
    """All GPUs the driver lists share one model (then FASTEST_FIRST is PCI order)."""
    infos = _proc_infos()
    return infos is not None and len({i["Model"] for i in infos.values() if "Model" in i}) == 1


class DriverWarmup:
    """cuInit and device `ordinal`'s primary context, made on a thread while the rank still imports its
    Python modules: ~0.4 s of driver work (measured on the target: cuInit 265 ms, context 129 ms) overlaps the
    imports instead of following them. The context stays retained until `release()`, called once the
    backend retained its own, so the driver never tears it down in between. A failure here is kept
    quiet: the backend's own open meets it again and reports it with its context."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.seconds: float | None = None  # how long the warm-up took on its thread
        self._device: Any = None
        self._thread = threading.Thread(target=self._run, name="tray-driver-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            from tray.backend.cuda import driver as drv

            drv.init()
            device = drv.device_get(self.ordinal)
            drv.primary_ctx_retain(device)
            self._device = device
        except Exception:  # NOTE: reported by CudaBackend.open, which meets the same failure
            pass
        finally:
            self.seconds = time.perf_counter() - t0

    def release(self, timeout_s: float = 30.0) -> None:
        """Wait (at most `timeout_s`) for the warm-up, then drop its reference to the context."""
        self._thread.join(timeout_s)
        device, self._device = self._device, None
        if device is not None:
            from tray.backend.cuda import driver as drv

            drv.primary_ctx_release(device)


def visible_gpu_count() -> int:
    """GPUs this process can use; 0 on any failure (no bindings, no driver, no device). Never raises."""
    try:
        from tray.backend.cuda import driver as drv

        drv.init()
        return drv.device_count()
    except Exception:
        return 0


def _proc_bus_ids() -> list[str] | None:
    """Bus ids from /proc/driver/nvidia/gpus in CUDA's order, without initialising CUDA in the head;
    None when that order cannot be known (no /proc entry, UUIDs in CUDA_VISIBLE_DEVICES, MIG)."""
    root = _PROC_GPUS
    try:
        buses = sorted(d.lower() for d in os.listdir(root))
    except OSError:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return buses
    picked = []
    for item in visible.split(","):
        item = item.strip()
        if not is_digits(item):
            return None if item else picked
        if int(item) >= len(buses):
            break  # CUDA stops at the first invalid ordinal
        picked.append(buses[int(item)])
    return picked


def proc_gpu_count() -> int | None:
    """The GPUs CUDA will see, counted from /proc/driver/nvidia/gpus with CUDA_VISIBLE_DEVICES applied,
    without initialising CUDA (the head counts before it spawns, and a cuInit there would delay every rank).
    None when that count cannot be trusted, and the driver must answer: no /proc entries, UUIDs or MIG
    names in CUDA_VISIBLE_DEVICES, a GPU excluded by the driver, in MIG mode, or whose device node (or
    nvidiactl) this process cannot open for reading and writing (a container given fewer GPUs than
    the host has)."""
    buses = _proc_bus_ids()
    if buses is None or len(set(buses)) != len(buses):  # an ordinal named twice: the driver's rules decide
        return None
    infos = _proc_infos()
    if infos is None or not os.access(os.path.join(_DEV, "nvidiactl"), os.R_OK | os.W_OK):
        return None
    for bus in buses:
        info = infos.get(bus, {})
        minor = info.get("Device Minor", "")
        if not is_digits(minor) or info.get("GPU Excluded", "No") != "No":
            return None
        if not os.access(os.path.join(_DEV, f"nvidia{minor}"), os.R_OK | os.W_OK):
            return None
        try:
            if any(e.startswith("gi") for e in os.listdir(os.path.join(_PROC_CAPS, f"gpu{minor}", "mig"))):
                return None
        except OSError:
            pass  # no MIG capability entries: not in MIG mode
    return len(buses)


def gpu_count() -> int:
    """The GPUs this process can use: from /proc when that is certain (`proc_gpu_count`), else from the
    driver (`visible_gpu_count`, which initialises CUDA in this process)."""
    counted = proc_gpu_count()
    return visible_gpu_count() if counted is None else counted


def pci_bus_ids() -> list[str]:
    """PCI bus ids (`0000:1b:00.0`, lowercase) of ordinals 0..n-1; [] when no GPU is visible.

    NOTE: read from /proc when it gives CUDA's order for identical GPUs (PCI order), so the head does
    not pay a CUDA initialisation just to bind its ranks."""
    if os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") == "PCI_BUS_ID" or _identical_gpus():
        buses = _proc_bus_ids()
        if buses is not None:
            return buses
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
