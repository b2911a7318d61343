"""Device memory of the cuda backend: exportable VMM buffers, imported peer mappings, pointer tables.

A buffer is `cuMemCreate` (pinned, on this device, exportable as a POSIX fd and, where the probe said it
works, as a FABRIC handle) + `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess`, zeroed. Each object
keeps its teardown steps in an ExitStack: a step that fails halfway unwinds what was built, and
`close()` runs the same steps (unmap, free the address range, release) in reverse.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, Self

import numpy as np

from tray.backend.base import DeviceBuffer, ExportedHandle, PeerMapping, PtrTable
from tray.backend.cuda import driver as drv
from tray.errors import DeviceError, UsageError


def round_up(nbytes: int, granularity: int) -> int:
    """`nbytes` rounded up to a whole number of `granularity` (at least one)."""
    return max(1, -(-nbytes // granularity)) * granularity


def probe_fabric(ordinal: int) -> bool:
    """Whether FABRIC handles work on `ordinal`: create + export a small allocation once.

    `TRAY_NO_FABRIC=1` answers False without probing. A failed probe prints one warning to stderr.
    """
    if os.environ.get("TRAY_NO_FABRIC") == "1":
        return False
    # NOTE: the probe asks for the same mask the buffers will ask for (POSIX | FABRIC), so that a driver
    # that accepts FABRIC alone but refuses the pair cannot pass the probe and fail every allocation.
    types = drv.HANDLE_POSIX | drv.HANDLE_FABRIC
    try:
        nbytes = drv.allocation_granularity(ordinal, types)
        handle = drv.mem_create(nbytes, ordinal, types)
        try:
            drv.mem_export_fabric(handle)
        finally:
            drv.mem_release(handle)
    except DeviceError as exc:
        print(f"fabric handles unavailable ({exc}); using POSIX fds", file=sys.stderr, flush=True)
        return False
    return True


class VmmBuffer(DeviceBuffer):
    """A zeroed VMM allocation of this rank: `nbytes` as asked, `mapped_nbytes` rounded up to the
    allocation granularity (what is mapped, zeroed and exported)."""

    def __init__(self, name: str, nbytes: int, mapped_nbytes: int, ptr: int, fd: int | None,
                 fabric: bytes | None, teardown: ExitStack) -> None:
        self.name = name
        self.nbytes = nbytes
        self.mapped_nbytes = mapped_nbytes
        self.ptr = ptr
        self._fd = fd
        self._fabric = fabric
        self._teardown: ExitStack | None = teardown

    def handle(self) -> ExportedHandle:
        """The fd (owned by this buffer: receivers get their own copy) and, if any, the fabric handle."""
        if self._fd is None:
            raise UsageError(f"buffer {self.name!r} was allocated with export=False; it has no handle")
        if self._teardown is None:
            raise UsageError(f"buffer {self.name!r} is closed")
        kind = "fabric" if self._fabric is not None else "posix"
        return ExportedHandle(kind=kind, nbytes=self.mapped_nbytes, fd=self._fd, fabric=self._fabric)

    def close(self) -> None:
        teardown, self._teardown = self._teardown, None
        if teardown is not None:
            teardown.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def allocate(name: str, nbytes: int, ordinal: int, stream: Any, export: bool, fabric: bool) -> VmmBuffer:
    """A zeroed buffer of at least `nbytes` on device `ordinal`; exported (fd, + fabric) if `export`.

    Raises CudaError (a DeviceError) naming the failing call; nothing is left allocated then.
    """
    if nbytes < 0:
        raise UsageError(f"buffer {name!r}: nbytes must be >= 0, got {nbytes}")
    # NOTE: local buffers ask for a POSIX handle too, though tray never exports them: NCCL's user-buffer
    # registration (graph capture, ncclCommRegister) exports any cuMem allocation it is handed as a POSIX fd,
    # and an allocation without a shareable type fails that export, after which NCCL 2.28.9's captured
    # alltoall on 2x H200 never completed. No fd is created here unless `export`.
    types = drv.HANDLE_POSIX | (drv.HANDLE_FABRIC if export and fabric else 0)
    granularity = drv.allocation_granularity(ordinal, types)
    size = round_up(nbytes, granularity)
    with ExitStack() as stack:
        handle = drv.mem_create(size, ordinal, types)
        stack.callback(drv.mem_release, handle)
        ptr = drv.mem_address_reserve(size, granularity)
        stack.callback(drv.mem_address_free, ptr, size)
        drv.mem_map(ptr, size, handle)
        stack.callback(drv.mem_unmap, ptr, size)
        drv.mem_set_access(ptr, size, [ordinal])
        drv.memset_d8_async(ptr, 0, size, stream)
        drv.stream_synchronize(stream)
        fd = fabric_bytes = None
        if export:
            fd = drv.mem_export_posix(handle)
            stack.callback(os.close, fd)
            if fabric:
                fabric_bytes = drv.mem_export_fabric(handle)
        teardown = stack.pop_all()
    return VmmBuffer(name, nbytes, size, ptr, fd, fabric_bytes, teardown)


class VmmMapping(PeerMapping):
    """A peer's allocation mapped into this process, readable and writable by this device."""

    def __init__(self, ptr: int, nbytes: int, kind: str, teardown: ExitStack) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.kind = kind
        self._teardown: ExitStack | None = teardown

    def close(self) -> None:
        teardown, self._teardown = self._teardown, None
        if teardown is not None:
            teardown.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def import_peer(handle: ExportedHandle, ordinal: int) -> VmmMapping:
    """Map a peer's buffer for device `ordinal`. A fabric handle is used when present, else `handle.fd`.

    `handle.fd` is a received copy: it is closed here in every case (imported or not).
    Raises UsageError for a handle this backend cannot import, CudaError when the driver refuses.
    """
    fd = handle.fd
    try:
        if handle.kind == "fabric" and handle.fabric is not None:
            kind, alloc = "fabric", drv.mem_import_fabric(handle.fabric)
        elif handle.kind in ("posix", "fabric") and fd is not None:
            kind, alloc = "posix", drv.mem_import_posix(fd)
        else:
            raise UsageError(f"cannot import a {handle.kind!r} handle on the cuda backend "
                             f"(fd={fd}, fabric={'yes' if handle.fabric else 'no'}); "
                             "were the ranks started with different backends?")
    finally:
        if fd is not None:
            os.close(fd)
    with ExitStack() as stack:
        stack.callback(drv.mem_release, alloc)
        granularity = drv.allocation_granularity(ordinal, drv.HANDLE_POSIX)
        if handle.nbytes <= 0 or handle.nbytes % granularity:
            raise UsageError(f"peer buffer of {handle.nbytes} B is not a multiple of the "
                             f"{drv.fmt_bytes(granularity)} granularity: was it exported by a cuda rank?")
        ptr = drv.mem_address_reserve(handle.nbytes, granularity)
        stack.callback(drv.mem_address_free, ptr, handle.nbytes)
        drv.mem_map(ptr, handle.nbytes, alloc)
        stack.callback(drv.mem_unmap, ptr, handle.nbytes)
        drv.mem_set_access(ptr, handle.nbytes, [ordinal])
        teardown = stack.pop_all()
    return VmmMapping(ptr, handle.nbytes, kind, teardown)


class DevicePtrTable(PtrTable):
    """`u64[G]` of addresses in device memory (cuMemAlloc), for kernels that take `T* const*`."""

    def __init__(self, ptrs: Sequence[int], stream: Any) -> None:
        self.ptrs = tuple(int(p) for p in ptrs)
        table = np.asarray(self.ptrs, dtype=np.uint64)
        self.ptr = drv.mem_alloc(max(table.nbytes, 8))
        try:
            if table.nbytes:
                drv.memcpy_htod_async(self.ptr, table.ctypes.data, table.nbytes, stream)
                drv.stream_synchronize(stream)
        except BaseException:
            drv.mem_free(self.ptr)
            raise
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            drv.mem_free(self.ptr)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
