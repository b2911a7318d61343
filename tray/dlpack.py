"""DLPack capsules and array-interface dicts for raw memory, in pure ctypes (no compiled extension).

`capsule(owner, ptr, shape, dtype, device, versioned=...)` builds a `DLManagedTensorVersioned`
("dltensor_versioned", DLPack 1.x) or a legacy `DLManagedTensor` ("dltensor") describing `ptr` as a
C-contiguous tensor and returns it in a PyCapsule. `owner` is kept alive until the consumer calls the
tensor's deleter (when its tensor dies) or, for a capsule dropped unconsumed, until the capsule is freed.
The deleter and the capsule destructor are C functions (see `_Release`), so no Python runs when a tensor
dies: not during an exception's unwinding, not during interpreter shutdown.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

# DLDeviceType (dlpack.h)
KDL_CPU = 1
KDL_CUDA = 2

# DLDataTypeCode (dlpack.h)
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT = 0, 1, 2, 4

# manifest dtype -> (DLDataTypeCode, bits)
DL_DTYPES: dict[str, tuple[int, int]] = {
    "i8": (_KDL_INT, 8), "i16": (_KDL_INT, 16), "i32": (_KDL_INT, 32), "i64": (_KDL_INT, 64),
    "u8": (_KDL_UINT, 8), "u16": (_KDL_UINT, 16), "u32": (_KDL_UINT, 32), "u64": (_KDL_UINT, 64),
    "f16": (_KDL_FLOAT, 16), "f32": (_KDL_FLOAT, 32), "f64": (_KDL_FLOAT, 64), "bf16": (_KDL_BFLOAT, 16),
}
# manifest dtype -> array-interface typestr; bf16 has none (no consumer agrees on one): DLPack only.
TYPESTRS: dict[str, str] = {
    "i8": "|i1", "i16": "<i2", "i32": "<i4", "i64": "<i8", "u8": "|u1", "u16": "<u2", "u32": "<u4",
    "u64": "<u8", "f16": "<f2", "f32": "<f4", "f64": "<f8",
}

# The DLPack version this producer speaks (DLManagedTensorVersioned exists since 1.0).
DLPACK_VERSION = (1, 0)
_FLAG_READ_ONLY = 1 << 0


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


_DELETER = ctypes.c_void_p  # void (*deleter)(self): a C function (see _Release)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_NAME_LEGACY = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetDestructor.restype = ctypes.c_void_p
_api.PyCapsule_GetDestructor.argtypes = [ctypes.py_object]
_api.PyMem_Malloc.restype = ctypes.c_void_p
_api.PyMem_Malloc.argtypes = [ctypes.c_size_t]
_api.PyMem_Free.restype = None
_api.PyMem_Free.argtypes = [ctypes.c_void_p]
_api.Py_IncRef.argtypes = [ctypes.py_object]
_api.Py_DecRef.argtypes = [ctypes.py_object]


class _Release:
    """The C functions that end a tensor: (managed deleter, capsule destructor) per capsule kind.

    WHY C and not a ctypes callback: consumers call the deleter when their tensor dies, and a tensor may die
    while an exception is being raised (`torch.from_dlpack(v).bad_op()`); Python code run from a ctypes
    callback then replaces that exception with a SystemError. numpy's exporter has C functions with exactly
    the contract a producer needs: the deleter frees the managed struct with PyMem_Free (shape and strides in
    the same block) and drops one reference to `manager_ctx`, under the GIL, and does nothing after the
    interpreter has finalised; the capsule destructor calls the deleter of a capsule never consumed. They are
    read once from a capsule numpy makes of a 1-element array."""

    def __init__(self) -> None:
        import numpy as np

        probe = np.zeros(1, np.uint8)
        self.kinds: dict[bool, tuple[int, int]] = {}
        for versioned, name, struct in ((False, _NAME_LEGACY, DLManagedTensor),
                                        (True, _NAME_VERSIONED, DLManagedTensorVersioned)):
            try:
                cap = probe.__dlpack__(max_version=(1, 0)) if versioned else probe.__dlpack__()
            except TypeError:  # NOTE: numpy < 2.1 makes no versioned capsules; legacy ones are offered then
                continue
            addr = _api.PyCapsule_GetPointer(cap, name)
            deleter = struct.from_address(addr).deleter
            destructor = _api.PyCapsule_GetDestructor(cap)
            if deleter and destructor:
                self.kinds[versioned] = (deleter, destructor)
            del cap  # numpy's destructor frees the probe's struct


_release: _Release | None = None


def _release_functions(versioned: bool) -> tuple[bool, int, int]:
    """(versioned as offered, deleter, capsule destructor)."""
    global _release
    if _release is None:
        _release = _Release()
    if versioned and True not in _release.kinds:
        versioned = False
    if versioned not in _release.kinds:
        raise BufferError("this numpy exports no DLPack capsules; tray's views need numpy >= 2.2.5")
    return (versioned, *_release.kinds[versioned])


def capsule(owner: object, ptr: int, shape: Sequence[int], dtype: str, device: tuple[int, int], *,
            versioned: bool, read_only: bool = False) -> Any:
    """A DLPack capsule viewing `ptr` as a C-contiguous tensor of `shape` (elements) and manifest `dtype`.

    `device` is (DLDeviceType, ordinal), e.g. (KDL_CUDA, 1). `owner` holds one more reference until the
    consumer's tensor dies (or the capsule is dropped unconsumed). Versioned ("dltensor_versioned") when
    asked and this numpy can end such capsules, else legacy ("dltensor"). Raises ValueError for a dtype
    DLPack cannot name here.
    """
    if dtype not in DL_DTYPES:
        raise ValueError(f"no DLPack type for dtype {dtype!r}; expected one of {', '.join(DL_DTYPES)}")
    code, bits = DL_DTYPES[dtype]
    versioned, deleter, destructor = _release_functions(versioned)
    struct: type[ctypes.Structure] = DLManagedTensorVersioned if versioned else DLManagedTensor
    ndim = len(shape)
    head = ctypes.sizeof(struct)
    addr = _api.PyMem_Malloc(head + 16 * max(ndim, 1))  # the struct, then shape[ndim], then strides[ndim]
    if not addr:
        raise MemoryError("PyMem_Malloc for a DLPack tensor")
    shape_arr = (ctypes.c_int64 * ndim).from_address(addr + head)
    strides_arr = (ctypes.c_int64 * ndim).from_address(addr + head + 8 * ndim)
    stride = 1
    for i in range(ndim - 1, -1, -1):
        shape_arr[i] = int(shape[i])
        strides_arr[i] = stride
        stride *= int(shape[i])
    managed = struct.from_address(addr)
    tensor = managed.dl_tensor
    tensor.data = ptr or None
    tensor.device = DLDevice(*device)
    tensor.ndim = ndim
    tensor.dtype = DLDataType(code, bits, 1)
    tensor.shape = ctypes.cast(addr + head, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(addr + head + 8 * ndim, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = 0
    managed.manager_ctx = id(owner)
    managed.deleter = deleter
    if versioned:
        managed.version = DLPackVersion(*DLPACK_VERSION)
        managed.flags = _FLAG_READ_ONLY if read_only else 0
    _api.Py_IncRef(owner)  # dropped by the deleter
    try:
        return _api.PyCapsule_New(addr, _NAME_VERSIONED if versioned else _NAME_LEGACY, destructor)
    except BaseException:
        _api.Py_DecRef(owner)
        _api.PyMem_Free(addr)
        raise


def array_interface(ptr: int, shape: Sequence[int], dtype: str, *, cuda_stream: int | None = None) -> dict:
    """The `__array_interface__` (v3) dict, or with `cuda_stream` the `__cuda_array_interface__` (v3) one.

    `cuda_stream` is the stream the consumer must wait on (the producer's work on the memory); strides
    None means C-contiguous. Raises AttributeError for bf16 (no typestr): consumers then use DLPack.
    """
    typestr = TYPESTRS.get(dtype)
    if typestr is None:
        raise AttributeError(f"dtype {dtype!r} has no array-interface typestr; use DLPack (from_dlpack)")
    out: dict[str, Any] = {"shape": tuple(int(d) for d in shape), "typestr": typestr, "data": (int(ptr), False),
                           "strides": None, "version": 3}
    if cuda_stream is not None:
        out["stream"] = int(cuda_stream)
    return out
