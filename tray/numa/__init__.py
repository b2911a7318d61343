"""GPU -> NUMA node and CPUs from sysfs, and binding a rank's CPUs and memory policy at exec."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SYSFS = Path(os.environ.get("TRAY_SYSFS", "/sys"))

# NOTE: set_mempolicy(2) mode MPOL_PREFERRED: allocations prefer the node but may fall back,
# so a full node degrades speed instead of killing the rank with OOM.
MPOL_PREFERRED = 1
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


@dataclass(frozen=True)
class NumaPlacement:
    """Where a rank should run: its GPU's node and that node's CPUs. node -1: no information."""

    node: int
    cpus: tuple[int, ...]

    @property
    def bound(self) -> bool:
        return self.node >= 0 and bool(self.cpus)


def gpu_numa_node(pci_bus: str) -> int:
    """The NUMA node of a PCI device (e.g. "0000:1b:00.0"), -1 when sysfs has none."""
    bus = pci_bus.lower()
    # NOTE: CUDA prints an 8-digit domain ("00000000:1B:00.0"); sysfs uses 4 digits.
    if bus.count(":") == 2 and len(bus.split(":")[0]) == 8:
        bus = bus[4:]
    try:
        return int((SYSFS / "bus/pci/devices" / bus / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1


def parse_cpulist(text: str) -> tuple[int, ...]:
    """"0-3,8,10-11" -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def node_cpus(node: int) -> tuple[int, ...]:
    """CPUs of a NUMA node (empty when unknown)."""
    if node < 0:
        return ()
    try:
        return parse_cpulist((SYSFS / f"devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return ()


def placement_for(pci_bus: str | None) -> NumaPlacement:
    """The placement of a GPU's rank; without a bus id (host backend) there is none."""
    node = gpu_numa_node(pci_bus) if pci_bus else -1
    return NumaPlacement(node=node, cpus=node_cpus(node))


def prepare_binding(placement: NumaPlacement) -> Callable[[], None] | None:
    """A function that binds the calling process to `placement` (CPU affinity, preferred node).

    Everything is prepared here, in the parent, so the returned function only makes system calls
    when it runs between fork and exec. None when there is nothing to bind.
    """
    if not placement.bound:
        return None
    cpus = set(placement.cpus)
    nr = _SYS_SET_MEMPOLICY.get(os.uname().machine)
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(1 << placement.node)
    mask_ref = ctypes.byref(mask)

    def bind() -> None:
        os.sched_setaffinity(0, cpus)
        if nr is not None:
            # NOTE: maxnode counts bits; one unsigned long covers nodes 0..63.
            libc.syscall(nr, MPOL_PREFERRED, mask_ref, 64)

    return bind
