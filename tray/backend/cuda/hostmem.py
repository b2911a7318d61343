"""Pinned host memory for park/wake on the cuda backend: on the GPU's NUMA node, and checked to be there.

Two ways to get page-locked memory on a node:
  alloc  cuMemHostAlloc(PORTABLE). Its pages are faulted in and pinned at the call, under the calling
         thread's memory policy: the launcher binds every rank to its GPU's node (MPOL_PREFERRED), so
         they land there, unless the node is full or the process was not started by `tray launch`.
  bind   an anonymous mmap, mbind(2) MPOL_BIND to the node, then cuMemHostRegister(PORTABLE), which
         faults the pages in under that binding. Exact placement whatever the process policy.
`pinned_host` takes `alloc`, checks where the pages went (move_pages(2), tray/numa/pool.py) and, if
some landed on another node, frees them and takes `bind` instead.

Only `driver.py` imports cuda.bindings; the driver calls here go through its wrappers (mem_host_alloc,
mem_host_register, ...), checked there like every call.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Self

import numpy as np

from tray.backend.base import HostMemory
from tray.backend.cuda import driver as drv
from tray.errors import DeviceError, UsageError
from tray.numa.pool import Placement, check_placement

# NOTE: mbind(2) syscall numbers and MPOL_BIND; libnuma (the usual wrapper) is not always installed.
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
MPOL_BIND = 2
STRATEGIES = ("auto", "alloc", "bind")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.syscall.restype = ctypes.c_long
_MAP_FAILED = ctypes.c_void_p(-1).value


class PinnedHostMemory(HostMemory):
    """Page-locked host memory that any context's copies run at full speed with (PORTABLE).

    `numa_node`: the node it was meant for (-1: none known). `placement`: where its pages were found
    (see tray.numa.pool.Placement). `how`: "alloc" (cuMemHostAlloc) or "bind" (mmap + mbind +
    cuMemHostRegister). Free it with `close()` while the allocating context is alive.
    """

    def __init__(self, ptr: int, nbytes: int, mapped_nbytes: int, numa_node: int, how: str) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.mapped_nbytes = mapped_nbytes
        self.numa_node = numa_node
        self.how = how
        self.placement = Placement(numa_node)

    def view(self) -> np.ndarray:
        """A u8 numpy view of the memory (no copy; valid until close)."""
        if self.ptr == 0:
            raise UsageError("this pinned host memory is closed")
        raw = (ctypes.c_uint8 * max(self.nbytes, 1)).from_address(self.ptr)
        return np.ctypeslib.as_array(raw)[: self.nbytes]

    def close(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if not ptr:
            return
        if self.how == "alloc":
            drv.mem_free_host(ptr)
            return
        try:
            drv.mem_host_unregister(ptr)
        finally:
            _libc.munmap(ptr, self.mapped_nbytes)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PinnedHostMemory({drv.fmt_bytes(self.nbytes)}, {self.how}, {self.placement.describe()})"


def host_numa_node(ordinal: int) -> int:
    """The NUMA node of the host memory nearest GPU `ordinal`: CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID (CUDA
    12.2+; may know a node where sysfs says -1), -1 when the driver gives none."""
    try:
        node = drv.device_attribute(drv.device_get(ordinal), "HOST_NUMA_ID")
    except DeviceError:
        return -1
    return node if node >= 0 else -1


def verify_numa(mem: HostMemory, expected_node: int | None = None) -> Placement:
    """Where `mem`'s pages sit, judged against `expected_node` (default: `mem.numa_node`)."""
    node = mem.numa_node if expected_node is None else expected_node
    return check_placement(mem.ptr, mem.nbytes, node)


def _alloc(nbytes: int, node: int) -> PinnedHostMemory:
    size = max(nbytes, 1)
    return PinnedHostMemory(drv.mem_host_alloc(size, portable=True), nbytes, size, node, "alloc")


def _bind(nbytes: int, node: int) -> PinnedHostMemory:
    nr = _SYS_MBIND.get(os.uname().machine)
    if nr is None:
        raise DeviceError(f"mbind(node {node}): no syscall number for {os.uname().machine}")
    size = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
    addr = _libc.mmap(
        None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
    )
    if addr in (None, _MAP_FAILED):
        raise DeviceError(f"mmap(pinned host pool, {drv.fmt_bytes(size)}): {os.strerror(ctypes.get_errno())}")
    try:
        mask = (ctypes.c_ulong * (node // 64 + 1))()
        mask[node // 64] = 1 << (node % 64)
        # NOTE: the kernel reads maxnode - 1 bits; one more than the mask holds covers every node in it.
        if (
            _libc.syscall(
                ctypes.c_long(nr),
                ctypes.c_void_p(addr),
                ctypes.c_ulong(size),
                ctypes.c_int(MPOL_BIND),
                mask,
                ctypes.c_ulong(64 * len(mask) + 1),
                ctypes.c_uint(0),
            )
            != 0
        ):
            err = ctypes.get_errno()
            raise DeviceError(f"mbind({drv.fmt_bytes(size)}, MPOL_BIND, node {node}): {os.strerror(err)}")
        drv.mem_host_register(int(addr), size, portable=True)
    except BaseException:
        _libc.munmap(addr, size)
        raise
    return PinnedHostMemory(int(addr), nbytes, size, node, "bind")


def pinned_host(
    backend_ordinal: int, nbytes: int, numa_node: int | None = None, strategy: str = "auto"
) -> PinnedHostMemory:
    """`nbytes` of pinned host memory for GPU `backend_ordinal`, whose context must be current.

    `numa_node`: the node to place it on; None or -1 asks the driver (host_numa_node), and when the
    driver knows none either, the memory goes wherever the process policy puts it (unchecked).
    `strategy`: "auto" (alloc, check, bind if misplaced), "alloc" or "bind" (see the module docstring).
    The result's `placement` says where the pages were found. Raises CudaError / DeviceError.
    """
    if strategy not in STRATEGIES:
        raise UsageError(f"pinned_host strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    node = numa_node if numa_node is not None and numa_node >= 0 else host_numa_node(backend_ordinal)
    if strategy == "bind" and node >= 0:
        mem = _bind(nbytes, node)
    else:
        mem = _alloc(nbytes, node)
    try:
        mem.placement = verify_numa(mem)
    except BaseException:
        mem.close()
        raise
    if strategy != "auto" or mem.placement.ok:
        return mem
    first = mem.placement.describe()
    mem.close()
    mem = _bind(nbytes, node)
    try:
        mem.placement = verify_numa(mem)
    except BaseException:
        mem.close()
        raise
    print(
        f"tray: GPU {backend_ordinal}: cuMemHostAlloc put pinned pages off node {node} ({first}); "
        f"re-made them with mbind + cuMemHostRegister: {mem.placement.describe()}",
        file=sys.stderr,
        flush=True,
    )
    return mem
