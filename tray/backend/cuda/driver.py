"""The one checked facade over `cuda.bindings` (driver and NVRTC); nothing else in tray calls them.

Every binding call returns `(err, *values)` and never raises; here each becomes its values or a
`CudaError` (a `DeviceError`) naming the call, its arguments and the device, e.g.
`cuMemCreate(2 MiB, device 1): CUDA_ERROR_OUT_OF_MEMORY: out of memory`.
Opaque handles (contexts, streams, modules, functions, events, graphs, allocation handles) stay binding
objects; addresses are plain ints; sizes are bytes. Enum arguments are built here, as enum members.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from tray.backend.wait import Pending, wait_until
from tray.errors import DeviceError, UsageError

try:
    from cuda.bindings import driver as cu
    from cuda.bindings import nvrtc as nv
except ImportError as exc:  # a CPU install without the gpu extra: the pure helpers still import
    cu = nv = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None


def _load_errors() -> tuple[type[BaseException], ...]:
    """Exceptions the bindings raise (instead of returning a code) when libcuda/libnvrtc is absent."""
    found: list[type[BaseException]] = [OSError]
    try:
        from cuda import pathfinder
    except ImportError:
        return tuple(found)
    for name in ("DynamicLibNotFoundError", "DynamicLibNotAvailableError", "DynamicLibUnknownError"):
        cls = getattr(pathfinder, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


_LOAD_ERRORS = _load_errors()

# Bit values of CUmemAllocationHandleType; a mask of several (POSIX | FABRIC) is legal for the driver.
HANDLE_POSIX = 0x1
HANDLE_FABRIC = 0x8

# The device named in errors of calls that take none (launches, copies): the last one made current.
_current_ordinal: int | None = None


class CudaError(DeviceError):
    """A driver or NVRTC call failed. `code` is the status name (`CUDA_ERROR_NOT_PERMITTED`)."""

    def __init__(self, call: str, args_text: str, code: str, description: str = "") -> None:
        self.call = call
        self.args_text = args_text
        self.code = code
        self.description = description
        super().__init__(format_error(call, args_text, code, description))


class CompileError(UsageError):
    """NVRTC refused a kernel source; `log` is NVRTC's own log."""

    def __init__(self, name: str, options: Sequence[str], log: str) -> None:
        self.log = log
        opts = " ".join(options)
        super().__init__(f"{name}: NVRTC could not compile it (options: {opts}); fix the source:\n{log}")


# --- error formatting ---------------------------------------------------------------------------------


def fmt_bytes(nbytes: int) -> str:
    """`2 MiB`, `1 GiB`, `24 B`: exact binary units where they fit, bytes otherwise."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def format_error(call: str, args_text: str, code: str, description: str = "") -> str:
    """`call(args): CODE: description`; the device is appended to `args_text` when it names none."""
    if _current_ordinal is not None and "device" not in args_text:
        args_text = f"{args_text}, device {_current_ordinal}" if args_text else f"device {_current_ordinal}"
    text = f"{call}({args_text}): {code}"
    return f"{text}: {description}" if description else text


def _describe(err: Any) -> str:
    """The driver's (or NVRTC's) sentence for a status; empty if it cannot be had."""
    try:
        if cu is not None and isinstance(err, cu.CUresult):
            got, text = cu.cuGetErrorString(err)
            return text.decode() if got == 0 and text else ""
        if nv is not None and isinstance(err, nv.nvrtcResult):
            got, text = nv.nvrtcGetErrorString(err)
            return text.decode() if got == 0 and text else ""
    except Exception:
        return ""
    return ""


def check(call: str, result: tuple[Any, ...], args_text: str = "") -> Any:
    """Values of a binding result: None, the one value, or a tuple; raises CudaError on a bad status."""
    err, *values = result
    if err != 0:
        raise CudaError(call, args_text, getattr(err, "name", str(err)), _describe(err))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _call(lib: Any, call: str, *args: Any, what: str = "") -> Any:
    """Invoke `lib.call(*args)` and check it; a missing CUDA library also becomes a CudaError."""
    if lib is None:
        raise CudaError(call, what, "NO_BINDINGS", f"cuda-bindings is not installed ({_IMPORT_ERROR})")
    try:
        result = getattr(lib, call)(*args)
    except _LOAD_ERRORS as exc:
        raise CudaError(call, what, "LIBRARY_NOT_FOUND", str(exc).splitlines()[0]) from exc
    return check(call, result, what)


def _drv(call: str, *args: Any, what: str = "") -> Any:
    return _call(cu, call, *args, what=what)


# --- init, devices, contexts ----------------------------------------------------------------------------


def init() -> None:
    _drv("cuInit", 0)


def driver_version() -> int:
    """The driver's CUDA version as an int: 13000 for 13.0."""
    return int(_drv("cuDriverGetVersion"))


def device_count() -> int:
    return int(_drv("cuDeviceGetCount"))


def device_get(ordinal: int) -> Any:
    return _drv("cuDeviceGet", ordinal, what=f"device {ordinal}")


def device_name(dev: Any) -> str:
    raw = _drv("cuDeviceGetName", 256, dev, what=f"device {int(dev)}")
    return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")


def format_uuid(raw: bytes) -> str:
    """16 bytes as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, the form nvidia-smi prints."""
    h = bytes(raw)[:16].hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def device_uuid(dev: Any) -> str:
    return format_uuid(_drv("cuDeviceGetUuid", dev, what=f"device {int(dev)}").bytes)


def device_pci_bus_id(dev: Any) -> str:
    """Lowercase `dddd:bb:dd.f`, e.g. `0000:1b:00.0`."""
    raw = _drv("cuDeviceGetPCIBusId", 32, dev, what=f"device {int(dev)}")
    return bytes(raw).split(b"\0", 1)[0].decode().lower()


def device_attribute(dev: Any, name: str) -> int:
    """An attribute by its name without the `CU_DEVICE_ATTRIBUTE_` prefix (`COMPUTE_CAPABILITY_MAJOR`)."""
    full = f"CU_DEVICE_ATTRIBUTE_{name}"
    attr = getattr(cu.CUdevice_attribute, full, None) if cu is not None else None
    if attr is None:
        raise CudaError("cuDeviceGetAttribute", f"{full}, device {int(dev)}", "UNKNOWN_ATTRIBUTE",
                        "this cuda-bindings version does not know the attribute")
    return int(_drv("cuDeviceGetAttribute", attr, dev, what=f"{full}, device {int(dev)}"))


def device_total_mem(dev: Any) -> int:
    return int(_drv("cuDeviceTotalMem", dev, what=f"device {int(dev)}"))


def device_can_access_peer(dev: Any, peer: Any) -> bool:
    return bool(_drv("cuDeviceCanAccessPeer", dev, peer, what=f"device {int(dev)}, peer {int(peer)}"))


def device_p2p_attribute(name: str, src: Any, dst: Any) -> int:
    """`name` without its prefix: `ACCESS_SUPPORTED`, `NATIVE_ATOMIC_SUPPORTED`."""
    attr = getattr(cu.CUdevice_P2PAttribute, f"CU_DEVICE_P2P_ATTRIBUTE_{name}")
    return int(_drv("cuDeviceGetP2PAttribute", attr, src, dst,
                    what=f"{name}, device {int(src)} -> device {int(dst)}"))


def primary_ctx_retain(dev: Any) -> Any:
    return _drv("cuDevicePrimaryCtxRetain", dev, what=f"device {int(dev)}")


def primary_ctx_release(dev: Any) -> None:
    _drv("cuDevicePrimaryCtxRelease", dev, what=f"device {int(dev)}")


def ctx_get_current() -> Any:
    """The calling thread's current context (a null CUcontext if none)."""
    return _drv("cuCtxGetCurrent")


def ctx_set_current(ctx: Any, ordinal: int | None) -> None:
    """Make `ctx` (of device `ordinal`) current on this thread; later errors name that device."""
    global _current_ordinal
    _drv("cuCtxSetCurrent", ctx, what="" if ordinal is None else f"device {ordinal}")
    if ordinal is not None:
        _current_ordinal = ordinal


def ctx_enable_peer_access(peer_ctx: Any, peer_ordinal: int) -> None:
    """Let the current context reach `peer_ctx`'s memory; already enabled is fine."""
    try:
        _drv("cuCtxEnablePeerAccess", peer_ctx, 0, what=f"peer device {peer_ordinal}")
    except CudaError as exc:
        if exc.code != "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED":
            raise


# --- streams, events, graphs ----------------------------------------------------------------------------


def stream_create() -> Any:
    """A non-blocking stream: it never waits on the legacy default stream."""
    return _drv("cuStreamCreate", cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value, what="non-blocking")


def as_stream(handle: int) -> Any:
    """A binding stream for an int handle a caller passed (0 = the NULL stream, 1 = CU_STREAM_LEGACY,
    2 = CU_STREAM_PER_THREAD, else a CUstream's address, e.g. `torch.cuda.current_stream().cuda_stream`)."""
    if not isinstance(handle, int) or handle < 0:
        raise UsageError(f"stream must be an int CUDA stream handle (>= 0), got {handle!r}")
    return cu.CUstream(handle)


def stream_is_capturing(stream: Any) -> bool:
    """Whether `stream` is in an active capture (cuStreamIsCapturing)."""
    status = _drv("cuStreamIsCapturing", stream, what=f"stream {int(stream):#x}")
    return status == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


def stream_destroy(stream: Any) -> None:
    _drv("cuStreamDestroy", stream)


def stream_synchronize(stream: Any) -> None:
    err, = cu.cuStreamSynchronize(stream)
    if err != 0:
        check("cuStreamSynchronize", (err,), f"stream {int(stream):#x}")


def stream_query(stream: Any) -> bool:
    """Whether every operation enqueued on `stream` has completed (cuStreamQuery: NOT_READY is False);
    CudaError for any other failure (e.g. a kernel fault)."""
    err, = cu.cuStreamQuery(stream)
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    if err != 0:
        check("cuStreamQuery", (err,), f"stream {int(stream):#x}")
    return True


def event_query(event: Any) -> bool:
    """Whether the work before `event`'s last record has completed (cuEventQuery: NOT_READY is False)."""
    err, = cu.cuEventQuery(event)
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    if err != 0:
        check("cuEventQuery", (err,))
    return True


def stream_wait(stream: Any, what: str, pending: Pending | None = None, timeout_s: float | None = None) -> None:
    """cuStreamSynchronize with a deadline: polls cuStreamQuery (tray.backend.wait.wait_until); SyncTimeout
    names `what` and `pending.last` when the stream is still busy after `timeout_s` (None: TRAY_SYNC_TIMEOUT_S,
    else 60 s)."""
    wait_until(lambda: stream_query(stream), what, pending, timeout_s)


def event_wait(event: Any, what: str, pending: Pending | None = None, timeout_s: float | None = None) -> None:
    """cuEventSynchronize with a deadline (polls cuEventQuery); SyncTimeout as stream_wait."""
    wait_until(lambda: event_query(event), what, pending, timeout_s)


def stream_wait_event(stream: Any, event: Any) -> None:
    """Work enqueued on `stream` after this waits for `event` (recorded on another stream)."""
    _drv("cuStreamWaitEvent", stream, event, 0)


def event_create(timing: bool = True) -> Any:
    """An event; `timing=False` makes a lighter one for ordering streams only."""
    flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
    return _drv("cuEventCreate", flags.value)


def event_record(event: Any, stream: Any) -> None:
    err, = cu.cuEventRecord(event, stream)
    if err != 0:
        check("cuEventRecord", (err,), f"stream {int(stream):#x}")


def event_recorder(event: Any, stream: Any) -> Any:
    """A no-argument function that records `event` on `stream` (cuEventRecord, arguments converted once):
    the timer's hot path. A failure raises CudaError naming the call and the stream."""
    c_args = (ctypes.c_void_p(int(event)), ctypes.c_void_p(int(stream)))
    return prepared("cuEventRecord", c_args, f"stream {int(stream):#x}")


def event_synchronize(event: Any) -> None:
    _drv("cuEventSynchronize", event)


def event_elapsed_ms(start: Any, stop: Any) -> float:
    return float(_drv("cuEventElapsedTime", start, stop))


def event_destroy(event: Any) -> None:
    _drv("cuEventDestroy", event)


def stream_begin_capture(stream: Any) -> None:
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    _drv("cuStreamBeginCapture", stream, mode, what="THREAD_LOCAL")


def thread_capture_mode_relaxed() -> Any:
    """Make this thread's stream capture mode RELAXED (cuThreadExchangeStreamCaptureMode): a capture another
    thread began in GLOBAL mode (torch.cuda.graph's default) no longer prohibits this thread's allocations and
    module loads. Returns the previous mode, for `thread_capture_mode_restore`."""
    relaxed = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    return _drv("cuThreadExchangeStreamCaptureMode", relaxed, what="RELAXED")


def thread_capture_mode_restore(previous: Any) -> None:
    """Put back the mode `thread_capture_mode_relaxed` returned."""
    _drv("cuThreadExchangeStreamCaptureMode", previous, what=str(getattr(previous, "name", previous)))


def stream_end_capture(stream: Any) -> Any:
    """The captured graph (None if the capture was invalidated and the driver returned none)."""
    return _drv("cuStreamEndCapture", stream)


def graph_instantiate(graph: Any) -> Any:
    return _drv("cuGraphInstantiate", graph, 0)


def graph_launcher(graph_exec: Any, stream: Any) -> Any:
    """A no-argument function that launches `graph_exec` on `stream`, its C arguments converted once
    (the replay path of a graph launched many times from Python; a failure raises CudaError naming the call)."""
    c_args = (ctypes.c_void_p(int(graph_exec)), ctypes.c_void_p(int(stream)))
    return prepared("cuGraphLaunch", c_args, f"stream {int(stream):#x}")


def graph_exec_destroy(graph_exec: Any) -> None:
    _drv("cuGraphExecDestroy", graph_exec)


def graph_destroy(graph: Any) -> None:
    _drv("cuGraphDestroy", graph)


# --- plain memory and copies -------------------------------------------------------------------------------


def mem_alloc(nbytes: int) -> int:
    return int(_drv("cuMemAlloc", nbytes, what=fmt_bytes(nbytes)))


def mem_free(ptr: int) -> None:
    _drv("cuMemFree", ptr, what=f"{ptr:#x}")


def mem_host_alloc(nbytes: int, portable: bool = False) -> int:
    """Pinned host memory; returns its host address. `portable`: pinned for every context, not only
    the current one (CU_MEMHOSTALLOC_PORTABLE), so copies from any GPU run at pinned speed."""
    flags = 0x1 if portable else 0  # NOTE: CU_MEMHOSTALLOC_PORTABLE
    return int(_drv("cuMemHostAlloc", nbytes, flags, what=f"{fmt_bytes(nbytes)}, flags {flags:#x}"))


def mem_host_alloc_mapped(nbytes: int) -> tuple[int, int]:
    """Pinned host memory mapped into the current context's address space (DEVICEMAP | PORTABLE).

    Returns (host address, device address): a kernel stores through the device address and the host
    reads the host address without a copy or a second synchronisation."""
    flags = 0x1 | 0x2  # NOTE: CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
    host = int(_drv("cuMemHostAlloc", nbytes, flags, what=f"{fmt_bytes(nbytes)}, flags {flags:#x}"))
    try:
        dev = int(_drv("cuMemHostGetDevicePointer", host, 0, what=f"{host:#x}"))
    except BaseException:
        mem_free_host(host)
        raise
    return host, dev


def mem_free_host(ptr: int) -> None:
    _drv("cuMemFreeHost", ptr, what=f"{ptr:#x}")


def mem_host_register(ptr: int, nbytes: int, portable: bool = False) -> None:
    """Pin `nbytes` of existing host memory at `ptr` (cuMemHostRegister; `portable`: for every context)."""
    flags = 0x1 if portable else 0  # NOTE: CU_MEMHOSTREGISTER_PORTABLE
    _drv("cuMemHostRegister", ptr, nbytes, flags,
         what=f"{ptr:#x}, {fmt_bytes(nbytes)}{', PORTABLE' if portable else ''}")


def mem_host_unregister(ptr: int) -> None:
    """Unpin memory pinned by mem_host_register."""
    _drv("cuMemHostUnregister", ptr, what=f"{ptr:#x}")


def memset_d8_async(ptr: int, value: int, nbytes: int, stream: Any) -> None:
    _drv("cuMemsetD8Async", ptr, value, nbytes, stream, what=f"{ptr:#x}, {value}, {fmt_bytes(nbytes)}")


def memcpy_htod_async(dst: int, src_host: int, nbytes: int, stream: Any) -> None:
    _drv("cuMemcpyHtoDAsync", dst, src_host, nbytes, stream,
         what=f"dst {dst:#x}, src host {src_host:#x}, {fmt_bytes(nbytes)}")


def memcpy_dtoh_async(dst_host: int, src: int, nbytes: int, stream: Any) -> None:
    _drv("cuMemcpyDtoHAsync", dst_host, src, nbytes, stream,
         what=f"dst host {dst_host:#x}, src {src:#x}, {fmt_bytes(nbytes)}")


def memcpy_async(dst: int, src: int, nbytes: int, stream: Any) -> None:
    """A copy between any two addresses the driver knows (device, pinned host, peer-mapped): UVA."""
    err, = cu.cuMemcpyAsync(dst, src, nbytes, stream)
    if err != 0:
        check("cuMemcpyAsync", (err,), f"dst {dst:#x}, src {src:#x}, {fmt_bytes(nbytes)}")


def memcpy_peer_async(dst: int, dst_ctx: Any, src: int, src_ctx: Any, nbytes: int, stream: Any,
                      what: str = "") -> None:
    _drv("cuMemcpyPeerAsync", dst, dst_ctx, src, src_ctx, nbytes, stream,
         what=what or f"dst {dst:#x}, src {src:#x}, {fmt_bytes(nbytes)}")


# --- virtual memory management (VMM) and its shareable handles -------------------------------------------


def _handle_type(bit: int) -> Any:
    return cu.CUmemAllocationHandleType(bit)


def _alloc_prop(ordinal: int, handle_types: int) -> Any:
    """Pinned device memory on `ordinal`, exportable as `handle_types` (a mask of HANDLE_* bits)."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    if handle_types in (0, HANDLE_POSIX, HANDLE_FABRIC):
        prop.requestedHandleTypes = _handle_type(handle_types)
    else:
        # NOTE: the Python property accepts only one enum member, but the driver takes a mask; the field
        # is the u32 after `type` (offset 4 of CUmemAllocationProp). Verified on the target.
        ctypes.c_uint32.from_address(prop.getPtr() + 4).value = handle_types
    return prop


def _types_text(handle_types: int) -> str:
    names = [n for bit, n in ((HANDLE_POSIX, "POSIX_FD"), (HANDLE_FABRIC, "FABRIC")) if handle_types & bit]
    return "|".join(names) or "no handle"


def allocation_granularity(ordinal: int, handle_types: int) -> int:
    """The recommended granularity (bytes) for VMM sizes, addresses and offsets on `ordinal`."""
    prop = _alloc_prop(ordinal, handle_types)
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_drv("cuMemGetAllocationGranularity", prop, flag,
                    what=f"{_types_text(handle_types)}, device {ordinal}"))


def mem_create(nbytes: int, ordinal: int, handle_types: int) -> Any:
    prop = _alloc_prop(ordinal, handle_types)
    return _drv("cuMemCreate", nbytes, prop, 0,
                what=f"{fmt_bytes(nbytes)}, {_types_text(handle_types)}, device {ordinal}")


def mem_release(handle: Any) -> None:
    _drv("cuMemRelease", handle)


def mem_export_posix(handle: Any) -> int:
    """A new POSIX fd for the allocation; the caller owns (and closes) it."""
    return int(_drv("cuMemExportToShareableHandle", handle, _handle_type(HANDLE_POSIX), 0, what="POSIX_FD"))


def mem_export_fabric(handle: Any) -> bytes:
    """The 64-byte fabric handle of the allocation."""
    fabric = _drv("cuMemExportToShareableHandle", handle, _handle_type(HANDLE_FABRIC), 0, what="FABRIC")
    return bytes(fabric.data)


def mem_import_posix(fd: int) -> Any:
    """Import a received fd; the fd is not closed here (the caller closes it)."""
    # NOTE: for POSIX fds the driver takes the fd itself as the `void*` osHandle.
    return _drv("cuMemImportFromShareableHandle", fd, _handle_type(HANDLE_POSIX), what=f"POSIX_FD {fd}")


def mem_import_fabric(data: bytes) -> Any:
    if len(data) != 64:
        raise UsageError(f"a fabric handle has 64 bytes, got {len(data)}")
    # NOTE: for FABRIC the osHandle is a pointer to the 64 bytes; the bindings pass a bytes' buffer address.
    return _drv("cuMemImportFromShareableHandle", bytes(data), _handle_type(HANDLE_FABRIC), what="FABRIC")


def mem_address_reserve(nbytes: int, alignment: int) -> int:
    return int(_drv("cuMemAddressReserve", nbytes, alignment, 0, 0,
                    what=f"{fmt_bytes(nbytes)}, align {fmt_bytes(alignment)}"))


def mem_address_free(ptr: int, nbytes: int) -> None:
    _drv("cuMemAddressFree", ptr, nbytes, what=f"{ptr:#x}, {fmt_bytes(nbytes)}")


def mem_map(ptr: int, nbytes: int, handle: Any) -> None:
    _drv("cuMemMap", ptr, nbytes, 0, handle, 0, what=f"{ptr:#x}, {fmt_bytes(nbytes)}")


def mem_unmap(ptr: int, nbytes: int) -> None:
    _drv("cuMemUnmap", ptr, nbytes, what=f"{ptr:#x}, {fmt_bytes(nbytes)}")


def mem_set_access(ptr: int, nbytes: int, ordinals: Sequence[int]) -> None:
    """Read-write access to [ptr, ptr + nbytes) for each device in `ordinals`."""
    descs = []
    for ordinal in ordinals:
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(desc)
    devices = ",".join(str(o) for o in ordinals)
    _drv("cuMemSetAccess", ptr, nbytes, descs, len(descs),
         what=f"{ptr:#x}, {fmt_bytes(nbytes)}, RW for device {devices}")


# --- modules and launches ---------------------------------------------------------------------------------


def module_load_data(image: bytes, name: str) -> Any:
    return _drv("cuModuleLoadData", image, what=f"{name}, {fmt_bytes(len(image))}")


def module_unload(module: Any) -> None:
    _drv("cuModuleUnload", module)


def module_get_function(module: Any, entry: str) -> Any:
    return _drv("cuModuleGetFunction", module, entry.encode(), what=entry)


def func_param_sizes(func: Any, entry: str) -> list[int]:
    """The byte size of each kernel parameter, in order (cuFuncGetParamInfo until INVALID_VALUE)."""
    sizes: list[int] = []
    while True:
        err, _offset, size = cu.cuFuncGetParamInfo(func, len(sizes))
        if err == cu.CUresult.CUDA_ERROR_INVALID_VALUE:
            return sizes
        check("cuFuncGetParamInfo", (err,), f"{entry}, param {len(sizes)}")
        sizes.append(int(size))


def tensor_map_encode_tiled(args: Any, address: int) -> bytes:
    """cuTensorMapEncodeTiled over global memory at `address` with `args` (a TiledMapArgs of
    tray/programs/ep_moe/tma.py: dims, strides, box, element strides, enum names); the map's 128 opaque
    bytes, to be copied into device memory (64-byte aligned) a kernel reads it from. CudaError naming the
    fields when the driver refuses them."""
    what = (f"{args.dtype} at {address:#x}, dims {list(args.dims)}, strides {list(args.strides)}, box "
            f"{list(args.box)}, element strides {list(args.element_strides)}, swizzle {args.swizzle}")
    if cu is None:
        raise CudaError("cuTensorMapEncodeTiled", what, "NO_BINDINGS",
                        f"cuda-bindings is not installed ({_IMPORT_ERROR})")
    tmap = _drv(
        "cuTensorMapEncodeTiled",
        getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{args.dtype}"),
        args.rank,
        address,
        [cu.cuuint64_t(v) for v in args.dims],  # the bindings take these wrapped, not as plain ints
        [cu.cuuint64_t(v) for v in args.strides],
        [cu.cuuint32_t(v) for v in args.box],
        [cu.cuuint32_t(v) for v in args.element_strides],
        getattr(cu.CUtensorMapInterleave, f"CU_TENSOR_MAP_INTERLEAVE_{args.interleave}"),
        getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{args.swizzle}"),
        getattr(cu.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{args.l2}"),
        getattr(cu.CUtensorMapFloatOOBfill, f"CU_TENSOR_MAP_FLOAT_OOB_FILL_{args.oob_fill}"),
        what=what,
    )
    return b"".join(int(word).to_bytes(8, "little") for word in tmap.opaque)


def func_set_max_dynamic_smem(func: Any, nbytes: int, entry: str) -> None:
    """Let `func` launch with up to `nbytes` of dynamic shared memory (over 48 KiB needs this opt-in)."""
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _drv("cuFuncSetAttribute", func, attr, int(nbytes), what=f"{entry}, {fmt_bytes(nbytes)} of dynamic shared memory")


# NOTE: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h): the next kernel on the stream may
# be scheduled before this one ends and waits in `griddepcontrol.wait` instead (hides launch latency).
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 5

# libcuda's entry points resolved once, by name (`symbol`); a test may fill it with stand-ins.
_symbols: dict[str, Any] = {}


def _libcuda() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def symbol(name: str) -> Any:
    """libcuda's `name` as a ctypes function returning a C int (a CUresult), resolved once.

    Raises CudaError (LIBRARY_NOT_FOUND) when libcuda cannot be loaded or lacks the symbol."""
    fn = _symbols.get(name)
    if fn is None:
        try:
            fn = getattr(_libcuda(), name)
        except (OSError, AttributeError) as exc:
            raise CudaError(name, "", "LIBRARY_NOT_FOUND", str(exc).splitlines()[0]) from exc
        fn.restype = ctypes.c_int
        _symbols[name] = fn
    return fn


def _status(err: int) -> Any:
    """The bindings' CUresult member for a raw status (its name and the driver's sentence), else the int."""
    if cu is None:
        return err
    try:
        return cu.CUresult(err)
    except ValueError:  # a status newer than these bindings: the number is all there is
        return err


def prepared(call: str, c_args: tuple[Any, ...], where: str) -> Any:
    """A no-argument function that calls libcuda's `call` with `c_args` (ctypes values converted once)
    and raises CudaError(`call`, `where`, status name) when it returns anything but CUDA_SUCCESS.

    The hot paths (kernel and graph launches, event records) are built from this: no argument is
    converted and nothing allocated per call. `.keep` holds `c_args`, which C may point into."""
    fn = symbol(call)

    def run() -> None:
        err = fn(*c_args)
        if err != 0:
            check(call, (_status(err),), where)

    run.keep = c_args  # type: ignore[attr-defined]
    return run


def launcher(func: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shmem_nbytes: int,
             stream: Any, params_addr: int, entry: str = "", programmatic: bool = False) -> Any:
    """A no-argument function that launches `func` with every argument converted to C once.

    The one kernel launch path: every kernel launch goes through here. NOTE: measured on 4x H200, a launch
    costs the same through this path and through the bindings' wrapper (5.7 vs 5.6 us of Python per
    barrier launch); this one also launches with attributes (cuLaunchKernelEx) at no extra cost. `programmatic`:
    with programmatic stream serialization (cuLaunchKernelEx); the kernel must `griddepcontrol.wait` before it
    touches memory the previous kernel wrote. `params_addr`: the address of the kernel's `void*[]` (0: none)."""
    where = f"{entry}, grid {grid}, block {block}, shmem {shmem_nbytes} B"
    f = ctypes.c_void_p(int(func))
    params = ctypes.c_void_p(params_addr or None)
    if not programmatic:
        c_args = (f, *(ctypes.c_uint(v) for v in (*grid, *block, shmem_nbytes)),
                  ctypes.c_void_p(int(stream)), params, ctypes.c_void_p(None))
        return prepared("cuLaunchKernel", c_args, where)
    attr = _LaunchAttribute(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    config = _LaunchConfig(*grid, *block, shmem_nbytes, int(stream), ctypes.pointer(attr), 1)
    launch = prepared("cuLaunchKernelEx", (ctypes.byref(config), f, params, ctypes.c_void_p(None)), where)
    launch.structs = (config, attr)  # type: ignore[attr-defined]  # the config points at attr; C reads both
    return launch


def _launch_structs() -> tuple[Any, Any]:
    class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, pad, 64-byte value union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]

    class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                    ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                    ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                    ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]

    return LaunchAttribute, LaunchConfig


_LaunchAttribute, _LaunchConfig = _launch_structs()


# --- NVRTC ---------------------------------------------------------------------------------------------


def nvrtc_compile(source: str, name: str, options: Sequence[str], output: str) -> bytes:
    """Compile CUDA C `source` and return its `output` ("cubin" or "ptx", NUL stripped).

    Raises CompileError (with NVRTC's log) if the source does not compile, CudaError on other failures.
    """
    prog = _call(nv, "nvrtcCreateProgram", source.encode(), name.encode(), 0, [], [], what=name)
    try:
        encoded = [o.encode() for o in options]
        result = nv.nvrtcCompileProgram(prog, len(encoded), encoded)
        if result[0] in (nv.nvrtcResult.NVRTC_ERROR_COMPILATION, nv.nvrtcResult.NVRTC_ERROR_INVALID_OPTION):
            # the source's or the options' fault, not the device's: the author must act
            raise CompileError(name, options, _program_log(prog) or result[0].name)
        check("nvrtcCompileProgram", result, name)
        getter = {"cubin": "CUBIN", "ptx": "PTX"}[output]
        size = int(_call(nv, f"nvrtcGet{getter}Size", prog, what=name))
        buf = bytearray(size)  # NOTE: bytearray, never `b" " * n`: NVRTC writes into it
        _call(nv, f"nvrtcGet{getter}", prog, buf, what=name)
        return bytes(buf).rstrip(b"\0") if output == "ptx" else bytes(buf)
    finally:
        nv.nvrtcDestroyProgram(prog)


def _program_log(prog: Any) -> str:
    size = int(_call(nv, "nvrtcGetProgramLogSize", prog))
    buf = bytearray(max(size, 1))
    _call(nv, "nvrtcGetProgramLog", prog, buf)
    return bytes(buf).rstrip(b"\0").decode(errors="replace")
