"""Buffers as tensors: `rank.buffer(name)` and `rank.peer_view(name, member)` return a `BufferView`.

A view is zero-copy: DLPack (`torch.from_dlpack`, `numpy.from_dlpack`, `cupy.from_dlpack`) and, on cuda,
`__cuda_array_interface__` v3 (host: `__array_interface__` v3, and `__array__` for bf16, which has no
typestr). It is typed and shaped as the manifest says and reports the LOCAL device, for a peer's buffer
too (the mapping is this GPU's to use, as torch's symmetric memory reports it). NOTE: the CUDA array
interface carries no device: consumers ask the driver, which may name the GPU that owns a peer's memory;
for peer views use DLPack. Make views before a CUDA graph capture: `__dlpack__` orders the consumer's
stream after tray's with an event recorded outside that capture.

Lifetime: the first time a view hands out its memory it takes a lease on what backs it (the own buffer or
the imported peer mapping); every consumer keeps the view object alive (DLPack's deleter, numpy's `base`,
torch's reference to a CUDA-array-interface object), and the lease ends when the view object does.
`rank.close()` with leases still held does not fail and does not wait: it releases everything else, and
the memory of each leased buffer or mapping stays mapped until its last view is gone, then is released
(on cuda with the primary context held until then). At interpreter exit nothing is released: the
process's end returns it all.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from tray import dlpack
from tray.backend.base import Backend, numpy_dtype
from tray.errors import UsageError


class Leases:
    """Counts live views per backing resource (a DeviceBuffer or PeerMapping) of one rank."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._resources: dict[int, Any] = {}
        self._release: dict[int, Callable[[], None]] = {}  # detached at close, released at count 0
        self._closed = False
        # NOTE: kept here: `drop` may run while the interpreter shuts down, after module globals are cleared
        self._finalizing = sys.is_finalizing
        # a view's finalizer runs on whichever thread drops its last reference; reentrant: the collector may run one
        # on this thread while it holds the lock
        self._lock = threading.RLock()

    def take(self, resource: Any, what: str) -> None:
        """One more live view of `resource` (the caller ties `drop` to its view's life). After the rank
        closed, only memory a live view still holds can be viewed again; else UsageError naming `what`."""
        key = id(resource)
        with self._lock:
            if self._closed and key not in self._release:
                raise UsageError(f"{what}: the rank is closed and this memory was released; take views "
                                 "(from_dlpack, np.asarray) before rank.close()")
            self._counts[key] = self._counts.get(key, 0) + 1
            self._resources[key] = resource

    def drop(self, key: int) -> None:
        with self._lock:
            count = self._counts.get(key, 0) - 1
            if count > 0:
                self._counts[key] = count
                return
            self._counts.pop(key, None)
            self._resources.pop(key, None)
            release = self._release.pop(key, None)
        if release is not None and not self._finalizing():
            release()

    def live(self) -> int:
        """Views holding a lease now."""
        return sum(self._counts.values())

    def close(self, backend: Backend) -> int:
        """At `rank.close()`: detach every leased resource from the backend (so its close leaves them
        mapped); each is released when its last view goes. Returns how many resources stay mapped."""
        with self._lock:
            self._closed = True
            # a copy: a view's last drop may come while a resource is detached (the collector, another thread)
            for key, resource in list(self._resources.items()):
                if key in self._resources and key not in self._release:
                    release = backend.detach(resource)
                    if key in self._resources:
                        self._release[key] = release
                    elif not self._finalizing():  # its last view went during its own detach
                        release()
            return len(self._release)


class BufferView:
    """A manifest buffer (own or a peer's) as a zero-copy tensor of this rank's device.

    `ptr` is the address on this rank (device VA on cuda; for a peer view, where the peer's buffer is
    mapped here), `shape` in elements of `dtype` (a manifest dtype name, "bf16" included), `member` the
    global rank whose memory it is.
    """

    __slots__ = ("name", "dtype", "shape", "nbytes", "ptr", "export", "member", "_backend", "_resource",
                 "_leases", "_leased", "__weakref__")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int, ptr: int, export: bool,
                 member: int, backend: Backend, resource: Any, leases: Leases) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.nbytes = nbytes
        self.ptr = ptr
        self.export = export
        self.member = member
        self._backend = backend
        self._resource = resource
        self._leases = leases
        self._leased = False

    def __repr__(self) -> str:
        return (f"BufferView({self.name!r}, member {self.member}, {self.dtype}{list(self.shape)}, "
                f"device {self.__dlpack_device__()})")

    def _lease(self) -> None:
        """Tie the backing memory to this object's life (once per view)."""
        if not self._leased:
            self._leases.take(self._resource, f"view of {self.name!r} (member {self.member})")
            self._leased = True
            fin = weakref.finalize(self, self._leases.drop, id(self._resource))
            fin.atexit = False  # NOTE: at exit the process's end unmaps everything; nothing to release

    def _device_memory(self) -> bool:
        return self._backend.dlpack_device[0] != dlpack.KDL_CPU

    # --- DLPack -------------------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        return self._backend.dlpack_device

    def __dlpack__(self, stream: int | None = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """A DLPack capsule of this view: versioned ("dltensor_versioned") when `max_version >= (1, 0)`,
        else legacy ("dltensor"). On cuda, `stream` (the consumer's; None = the legacy default stream,
        -1 = no ordering) first waits for the work enqueued on the rank's stream. Raises BufferError for a
        copy (`copy=True`) or another device (`dl_device`): views are zero-copy, on this rank's device."""
        if copy:
            raise BufferError("tray views are zero-copy: copy=True is not offered (copy the tensor you get)")
        device = self._backend.dlpack_device
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"buffer {self.name!r} lives on DLPack device {device}, not {tuple(dl_device)}")
        self._lease()
        if self._device_memory() and stream != -1:
            # DLPack: None means the legacy default stream (1); 0 is ambiguous and read as the same
            self._backend.order_stream(1 if stream in (None, 0) else int(stream))
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        return dlpack.capsule(self, self.ptr, self.shape, self.dtype, device, versioned=versioned)

    # --- array interfaces -----------------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA array interface v3 (cuda backend only); "stream" is the rank's stream, which the consumer
        waits on. AttributeError on host and for bf16 (no typestr): use DLPack there."""
        if not self._device_memory():
            raise AttributeError("__cuda_array_interface__: this view is host memory (use __array_interface__)")
        stream = self._backend.cuda_stream  # None once the rank closed: no tray work to wait for then
        out = dlpack.array_interface(self.ptr, self.shape, self.dtype, cuda_stream=stream)
        self._lease()
        return out

    @property
    def __array_interface__(self) -> dict:
        """NumPy array interface v3 (host backend only). AttributeError on cuda (device memory) and for
        bf16 (no typestr; `np.asarray` then uses `__array__`)."""
        if self._device_memory():
            raise AttributeError("__array_interface__: this view is device memory (use DLPack or "
                                 "__cuda_array_interface__)")
        out = dlpack.array_interface(self.ptr, self.shape, self.dtype)
        self._lease()
        return out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """A zero-copy numpy array of host memory (bf16 through ml_dtypes). Raises TypeError on cuda."""
        if self._device_memory():
            raise TypeError(f"buffer {self.name!r} is device memory; use rank.read() for a host copy")
        if copy:
            raise ValueError("tray views are zero-copy: np.array(view, copy=True) is not offered; use .copy()")
        if dtype is not None and np.dtype(dtype) != numpy_dtype(self.dtype):
            raise ValueError(f"buffer {self.name!r} is {self.dtype}; view it as that and convert the copy")
        self._lease()
        dt = numpy_dtype(self.dtype)
        raw = {"shape": self.shape, "typestr": f"|V{dt.itemsize}", "data": (self.ptr, False), "version": 3}
        # numpy keeps `_Interface` (and through it this view) alive as the array's base
        return np.asarray(_Interface(raw, self)).view(dt)


class _Interface:
    """An array-interface dict with the view that leased its memory, for numpy to hold as a base."""

    __slots__ = ("__array_interface__", "_view")

    def __init__(self, interface: dict, view: BufferView) -> None:
        self.__array_interface__ = interface
        self._view = view


def check_member(name: str, member: int, members: tuple[int, ...], group: str) -> None:
    """UsageError unless `member` (a global rank, an int) is in the buffer's group."""
    if member not in members:
        raise UsageError(f"peer_view({name!r}, {member!r}): rank {member!r} is not in group {group!r} of that "
                         f"buffer; its members (global ranks): {list(members)}")
