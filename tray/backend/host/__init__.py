"""The host backend: memfd buffers shared by fd, numpy kernels (its collectives: tray/collectives/host.py).

A real implementation, not a mock: real processes map each other's memfds, and the barrier runs
the same epoch protocol as the GPU kernel, polled from Python.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import inspect
import mmap
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tray.backend.base import (
    Backend,
    BoundLaunch,
    DeviceBuffer,
    DeviceInfo,
    ExportedHandle,
    Graph,
    GroupInfo,
    HostMemory,
    Kernel,
    PeerMapping,
    PtrTable,
    Timer,
    kernel_arg,
    launch_dims,
    numpy_dtype,
    remember_bound,
)
from tray.backend.host.barrier import HostBarrier
from tray.errors import DeviceError, HandshakeError, UsageError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE_NBYTES = mmap.PAGESIZE
# A memfd's size is fixed once sized: a peer that shrank it would make every mapper fault (SIGBUS).
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def check_memfd(fd: int, nbytes: int) -> None:
    """Before mapping a received memfd: it holds at least `nbytes` and is sealed against shrinking
    and growing. Raises HandshakeError saying what was seen (the caller names the peer)."""
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise HandshakeError(f"its memfd holds {size} B, the offer says {nbytes} B (truncated or another fd)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise HandshakeError(f"its fd is not a sealable memfd ({exc.strerror})") from None
    if seals & SIZE_SEALS != SIZE_SEALS:
        raise HandshakeError("its memfd is not sealed against shrinking and growing (F_SEAL_SHRINK|F_SEAL_GROW)")


def _track(ptr: int, nbytes: int, name: str, mapped_nbytes: int = 0) -> None:
    """In a rank, memory its twins may touch (tray.twins.check_range); `mapped_nbytes`, what the mapping holding it
    spans (its page rounding). Outside a rank (tests calling the backend directly) nothing is tracked, so twins on
    plain arrays stay unchecked."""
    if _IN_RANK:
        from tray.twins import add_region

        add_region(ptr, nbytes, name, mapped_nbytes)


def _untrack(ptr: int) -> None:
    if _IN_RANK:
        from tray.twins import remove_region

        remove_region(ptr)


# a rank started by `tray launch` (its environment names its rank)
_IN_RANK = "TRAY_RANK" in os.environ


def _round_up(nbytes: int, granule: int) -> int:
    return max(granule, (nbytes + granule - 1) // granule * granule)


def map_fd(fd: int, nbytes: int, what: str) -> int:
    """mmap a shared fd read-write; returns the address. Raises DeviceError naming `what`."""
    addr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise DeviceError(f"mmap({what}, {nbytes} B): {os.strerror(err)}")
    return int(addr)


def unmap(addr: int, nbytes: int) -> None:
    _libc.munmap(addr, nbytes)


def view(ptr: int, nbytes: int) -> np.ndarray:
    """A u8 numpy view of `nbytes` at `ptr` (no copy; valid while the mapping lives)."""
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class HostBuffer(DeviceBuffer):
    """A memfd mapped into this process; exported as the memfd itself."""

    def __init__(self, name: str, nbytes: int, export: bool) -> None:
        self.name = name
        self.nbytes = nbytes
        self.export = export
        self.mapped_nbytes = _round_up(nbytes, PAGE_NBYTES)
        try:
            self.fd = os.memfd_create(f"tray:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            raise DeviceError(f"memfd_create(buffer {name!r}): {exc.strerror}: this rank's open-file limit is {soft} "
                              f"(at most {hard}), and every host buffer holds a descriptor; raise it (ulimit -n) or "
                              "declare fewer buffers") from None
        try:
            os.ftruncate(self.fd, self.mapped_nbytes)
            # sized once for good: no peer (nor this rank) can shrink what others map
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
            self.ptr = map_fd(self.fd, self.mapped_nbytes, name)
        except BaseException:
            os.close(self.fd)
            raise
        _track(self.ptr, nbytes, f"buffer {name!r}", self.mapped_nbytes)

    def handle(self) -> ExportedHandle:
        if not self.export:
            raise UsageError(f"buffer {self.name!r} is not exported; set \"export\": true in the manifest")
        return ExportedHandle(kind="memfd", nbytes=self.mapped_nbytes, fd=self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            _untrack(self.ptr)
            unmap(self.ptr, self.mapped_nbytes)
            os.close(self.fd)
            self.fd = -1


class HostRegion(HostMemory):
    """Anonymous private host memory (the host backend has no pinning to do)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.numa_node = -1
        self._mapped = _round_up(nbytes, PAGE_NBYTES)
        addr = _libc.mmap(None, self._mapped, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr in (None, _MAP_FAILED):
            raise DeviceError(f"mmap(host pool, {nbytes} B): {os.strerror(ctypes.get_errno())}")
        self.ptr = int(addr)
        _track(self.ptr, nbytes, "a host pool", self._mapped)

    def close(self) -> None:
        if self.ptr:
            _untrack(self.ptr)
            unmap(self.ptr, self._mapped)
            self.ptr = 0


class HostMapping(PeerMapping):
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self._open = True
        _track(ptr, nbytes, "a peer's buffer as mapped here", nbytes)

    def holds(self, nbytes: int, what: str) -> None:
        # NOTE: the memfd (and so the mapping) is rounded up to pages; a twin is judged by the buffer's own size, as
        # on the exporting rank, so an overrun within that rounding is named too
        if self._open:
            _track(self.ptr, min(nbytes, self.nbytes), what, self.nbytes)

    def close(self) -> None:
        if self._open:
            _untrack(self.ptr)
            unmap(self.ptr, self.nbytes)
            self._open = False


class HostPtrTable(PtrTable):
    def __init__(self, ptrs: Sequence[int]) -> None:
        self.ptrs = tuple(int(p) for p in ptrs)
        self.array = np.array(self.ptrs, dtype=np.uint64)
        self.ptr = int(self.array.ctypes.data)
        _track(self.ptr, self.array.nbytes, "a pointer table")

    def close(self) -> None:
        _untrack(self.ptr)


class HostTimer(Timer):
    def __init__(self) -> None:
        self._t0 = self._t1 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self._t1 = time.perf_counter()

    def elapsed_s(self) -> float:
        return self._t1 - self._t0


class HostGraph(Graph):
    """Host work runs when it is called, so a captured body is kept and called again on replay."""

    def __init__(self, body: Callable[[], None]) -> None:
        self._body: Callable[[], None] | None = body

    def replay(self) -> None:
        if self._body is None:
            raise UsageError("graph replayed after close()")
        self._body()

    def close(self) -> None:
        self._body = None


class HostBoundLaunch(BoundLaunch):
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def launch(self) -> None:
        self._fn()


class HostKernel(Kernel):
    """A numpy twin of a CUDA kernel, called as twin(backend, grid, block, *args)."""

    def __init__(self, backend: "HostBackend", name: str, twin: Callable[..., None]) -> None:
        self.name = name
        self._backend = backend
        self._twin = twin

    def bind(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: Sequence[Any],
             shmem_nbytes: int = 0, programmatic: bool = False) -> BoundLaunch:
        # as the cuda backend takes them: grid and block checked, a view or table given as its address
        launch_dims(grid, "grid", self.name)
        launch_dims(block, "block", self.name)
        frozen = tuple(kernel_arg(a) for a in args)
        backend, twin = self._backend, self._twin
        try:  # the manifest's arguments against the twin's parameters, now rather than at the first launch
            inspect.signature(twin).bind(backend, grid, block, *frozen)
        except TypeError as exc:
            code = getattr(twin, "__code__", None)
            where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
            raise UsageError(f"kernel {self.name!r}: the manifest passes {len(frozen)} arguments, which its host twin "
                             f"{getattr(twin, '__qualname__', twin)!r}{where} does not take after (backend, grid, "
                             f"block): {exc}; make the launch op's args and the twin's parameters match") from None
        except ValueError:  # no signature to read (a builtin): the call itself will tell
            pass
        return remember_bound(self, HostBoundLaunch(lambda: twin(backend, grid, block, *frozen)))


class HostBackend(Backend):
    """One rank's "device" on the host: memory is memfd-backed shared memory."""

    name = "host"

    def __init__(self, ordinal: int, boot_id: str = "") -> None:
        self.info = DeviceInfo(
            ordinal=ordinal, uuid=f"host-{boot_id[:8] or 'local'}-{ordinal}", pci_bus="", numa_node=-1,
            name="host (numpy)",
        )
        self._owned: list[Any] = []

    @classmethod
    def open(cls, ordinal: int, boot_id: str = "") -> "HostBackend":
        return cls(ordinal, boot_id)

    def allocate(self, name: str, nbytes: int, export: bool) -> HostBuffer:
        buf = HostBuffer(name, nbytes, export)
        self._owned.append(buf)
        return buf

    def import_peer(self, handle: ExportedHandle) -> HostMapping:
        if handle.kind != "memfd" or handle.fd is None:
            raise UsageError(f"host backend imports memfd handles only, got {handle.kind!r}")
        try:
            check_memfd(handle.fd, handle.nbytes)
            ptr = map_fd(handle.fd, handle.nbytes, "peer buffer")
        finally:
            os.close(handle.fd)
        mapping = HostMapping(ptr, handle.nbytes)
        self._owned.append(mapping)
        return mapping

    def ptr_table(self, ptrs: Sequence[int]) -> HostPtrTable:
        return HostPtrTable(ptrs)

    def write(self, ptr: int, data: np.ndarray) -> None:
        src = np.ascontiguousarray(data)
        ctypes.memmove(ptr, src.ctypes.data, src.nbytes)

    def read(self, ptr: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        ctypes.memmove(out.ctypes.data, ptr, nbytes)
        return out

    def synchronize(self) -> None:
        pass

    def copy(self, dst_ptr: int, src_ptr: int, nbytes: int, *, transfer: bool = False) -> None:
        ctypes.memmove(dst_ptr, src_ptr, nbytes)

    def sync_transfer(self) -> None:
        pass

    def pinned_host(self, nbytes: int) -> "HostRegion":
        region = HostRegion(nbytes)
        self._owned.append(region)
        return region

    def gemm(self, a_ptr: int, b_ptr: int, c_ptr: int, m: int, n: int, k: int, dtype: str = "bf16",
             accumulate: bool = False) -> None:
        dt = numpy_dtype(dtype)
        a = view(a_ptr, m * k * dt.itemsize).view(dt).reshape(m, k).astype(np.float32)
        b = view(b_ptr, n * k * dt.itemsize).view(dt).reshape(n, k).astype(np.float32)
        c = view(c_ptr, m * n * dt.itemsize).view(dt).reshape(m, n)
        out = a @ b.T
        if accumulate:
            out += c.astype(np.float32)
        c[...] = out.astype(dt)

    def barrier(self, group: GroupInfo, flags: DeviceBuffer, peer_flags: PtrTable) -> HostBarrier:
        return HostBarrier(group, flags.ptr, peer_flags.ptrs)

    def timer(self) -> HostTimer:
        return HostTimer()

    def capture(self, body: Callable[[], None]) -> HostGraph:
        return HostGraph(body)

    def load_kernel(self, name: str, code: bytes, entry: str, options: Sequence[str], peers: bool,
                    filename: str = "") -> HostKernel:
        import tray.backend.host.twins  # noqa: F401  (registers the generic twins)
        from tray.twins import lookup

        twin = lookup(name)
        return HostKernel(self, name, twin)

    def _disown(self, resource: Any) -> None:
        self._owned[:] = [r for r in self._owned if r is not resource]

    def close(self) -> None:
        while self._owned:
            self._owned.pop().close()
