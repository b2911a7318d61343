"""DLPack capsules made with ctypes, and BufferView's protocol choices (device, stream, copy) on a fake device."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys

import ml_dtypes
import numpy as np
import pytest

from tray import dlpack
from tray.rank.views import BufferView, Leases


class _Owner:
    pass


def _struct(cap, name: bytes):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    kind = dlpack.DLManagedTensorVersioned if name == b"dltensor_versioned" else dlpack.DLManagedTensor
    return kind.from_address(get(cap, name))


@pytest.mark.parametrize("versioned", [False, True])
def test_capsule_fields_and_owner_lifetime(versioned):
    backing = np.arange(24, dtype=np.float32)
    owner = _Owner()
    base = sys.getrefcount(owner)
    cap = dlpack.capsule(owner, backing.ctypes.data, (2, 3, 4), "bf16", (dlpack.KDL_CUDA, 3), versioned=versioned)
    name = b"dltensor_versioned" if versioned else b"dltensor"
    managed = _struct(cap, name)
    t = managed.dl_tensor
    assert t.data == backing.ctypes.data
    assert (t.device.device_type, t.device.device_id) == (2, 3)
    assert (t.ndim, t.dtype.code, t.dtype.bits, t.dtype.lanes) == (3, 4, 16, 1)  # kDLBfloat
    assert [t.shape[i] for i in range(3)] == [2, 3, 4] and [t.strides[i] for i in range(3)] == [12, 4, 1]
    if versioned:
        assert (managed.version.major, managed.version.minor) == dlpack.DLPACK_VERSION and managed.flags == 0
    assert sys.getrefcount(owner) == base + 1
    del cap, managed, t  # dropped unconsumed: the capsule's destructor ends the tensor
    gc.collect()
    assert sys.getrefcount(owner) == base


def test_numpy_consumes_and_releases_the_owner():
    backing = np.arange(6, dtype=np.int32)
    owner = _Owner()
    base = sys.getrefcount(owner)

    class Producer:
        def __dlpack__(self, **kw):
            return dlpack.capsule(owner, backing.ctypes.data, (2, 3), "i32", (dlpack.KDL_CPU, 0),
                                  versioned=kw.get("max_version") is not None)

        def __dlpack_device__(self):
            return (dlpack.KDL_CPU, 0)

    view = np.from_dlpack(Producer())
    assert view.shape == (2, 3) and view.flags.writeable and view.ctypes.data == backing.ctypes.data
    view[1, 2] = 99
    assert backing[5] == 99
    assert sys.getrefcount(owner) == base + 1
    del view
    gc.collect()
    assert sys.getrefcount(owner) == base


def test_array_interface_and_unknown_dtypes():
    ai = dlpack.array_interface(4096, (2, 5), "u16")
    assert ai == {"shape": (2, 5), "typestr": "<u2", "data": (4096, False), "strides": None, "version": 3}
    cai = dlpack.array_interface(4096, (7,), "f32", cuda_stream=0x55)
    assert cai["stream"] == 0x55 and cai["typestr"] == "<f4"
    with pytest.raises(AttributeError, match="bf16.*DLPack"):
        dlpack.array_interface(4096, (7,), "bf16")
    with pytest.raises(ValueError, match="no DLPack type"):
        dlpack.capsule(_Owner(), 4096, (1,), "c64", (1, 0), versioned=True)


class _FakeCuda:
    """The backend surface a view uses, as a cuda rank's would look (ordinal 3, a stream, events)."""

    dlpack_device = (2, 3)
    cuda_stream = 0xABC

    def __init__(self):
        self.ordered: list[int] = []

    def order_stream(self, stream: int) -> None:
        self.ordered.append(stream)

    def joined(self, stream):
        return contextlib.nullcontext()


def _view(backend, dtype="f32", shape=(4, 2)):
    nbytes = int(np.prod(shape)) * 4
    return BufferView("x", dtype, shape, nbytes, 0x7F0000000000, True, 1, backend, object(), Leases())


def test_cuda_view_orders_the_consumer_stream_and_reports_the_local_gpu():
    backend = _FakeCuda()
    view = _view(backend)
    assert view.__dlpack_device__() == (2, 3)
    caps = [view.__dlpack__(stream=s, max_version=(1, 0)) for s in (None, 0, 7, -1)]
    assert backend.ordered == [1, 1, 7]  # None and 0 -> the legacy default stream; -1: no ordering
    managed = _struct(caps[0], b"dltensor_versioned")
    assert (managed.dl_tensor.device.device_type, managed.dl_tensor.device.device_id) == (2, 3)
    assert _struct(view.__dlpack__(stream=9), b"dltensor").dl_tensor.data == 0x7F0000000000  # legacy capsule
    cai = view.__cuda_array_interface__
    assert cai["stream"] == 0xABC and cai["shape"] == (4, 2) and cai["data"] == (0x7F0000000000, False)
    assert not hasattr(view, "__array_interface__")  # device memory: numpy must not touch it
    with pytest.raises(BufferError, match="zero-copy"):
        view.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="lives on DLPack device"):
        view.__dlpack__(dl_device=(1, 0))
    with pytest.raises(TypeError, match="device memory"):
        np.asarray(view)
    assert not hasattr(_view(backend, "bf16"), "__cuda_array_interface__")  # bf16: DLPack only
    backend.cuda_stream = None  # the rank closed: its stream is gone, nothing of tray's to wait for
    assert "stream" not in view.__cuda_array_interface__
    del caps, managed


def test_host_view_has_array_interfaces_and_bf16_through_array():
    backing = np.arange(8, dtype=np.float32)

    class Host:
        dlpack_device = (1, 0)
        cuda_stream = None

        def order_stream(self, stream):
            raise AssertionError("a host view orders no stream")

    leases = Leases()
    resource = object()
    view = BufferView("x", "f32", (2, 4), 32, backing.ctypes.data, True, 0, Host(), resource, leases)
    assert not hasattr(view, "__cuda_array_interface__")
    arr = np.asarray(view)
    assert arr.ctypes.data == backing.ctypes.data and arr.shape == (2, 4)
    assert leases.live() == 1
    bf = BufferView("h", "bf16", (2, 4), 16, backing.ctypes.data, True, 0, Host(), resource, leases)
    assert not hasattr(bf, "__array_interface__")
    h = np.asarray(bf)
    assert h.dtype == ml_dtypes.bfloat16 and h.ctypes.data == backing.ctypes.data
    assert np.from_dlpack(view).ctypes.data == backing.ctypes.data
    assert leases.live() == 2
    del view, arr, bf, h
    gc.collect()
    assert leases.live() == 0


def test_a_view_that_goes_while_the_rank_closes_is_released_and_breaks_no_iteration():
    """A view's finalizer may run inside `rank.close()` (the collector runs where the close allocates, or another
    thread drops its last view): the close walked the leased resources while that drop took one out ("dictionary
    changed size during iteration"), and the resource it had just detached stayed mapped with no view left."""
    leases = Leases()
    first, second = object(), object()
    leases.take(first, "view of 'a'")
    leases.take(second, "view of 'b'")
    released = []

    class Backend:
        def detach(self, resource):
            if resource is first:  # the last view of `second` goes meanwhile
                leases.drop(id(second))
            return lambda: released.append(resource)

    assert leases.close(Backend()) == 1  # `first` stays mapped for its view; `second` is gone, nothing to keep
    assert released == []
    leases.drop(id(first))
    assert released == [first] and leases.live() == 0
