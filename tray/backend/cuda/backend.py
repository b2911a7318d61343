"""The cuda backend: one rank's GPU (primary context, one non-blocking stream) through the facade.

Everything a `CudaBackend` makes (buffers, mappings, tables, barriers, kernels, timers, graphs) is
tracked and released by `close()`, in reverse order of dependence. Calls that create or
move things make the backend's context current first, so two backends in one process (tests, doctor)
stay apart; the hot paths (kernel and barrier launches, graph replays) do not.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Self

import numpy as np

from tray.backend.base import (
    Backend,
    DeviceBuffer,
    DeviceInfo,
    ExportedHandle,
    Graph,
    GroupInfo,
    HostMemory,
    PtrTable,
    Timer,
)
from tray.backend.cuda import driver as drv
from tray.backend.cuda import memory, nvrtc
from tray.backend.cuda.barrier import BARRIER_ENTRY, BARRIER_SOURCE, CudaBarrier, OwnCapture, kernel_dir
from tray.backend.cuda.kernels import CudaKernel
from tray.backend.wait import Pending
from tray.errors import DeviceError, SyncTimeout, UsageError

# NOTE: after a wait timed out the stream is presumed stuck (a collective without its peer): closing waits
# this long for it, not the full TRAY_SYNC_TIMEOUT_S again, so the rank exits and reports promptly.
CLOSE_AFTER_TIMEOUT_S = 2.0


class CudaTimer(Timer):
    """Two events (default flags) recorded on the backend's stream."""

    def __init__(self, stream: Any, pending: Pending | None = None) -> None:
        self._stream = stream
        self._pending = pending
        self._start = drv.event_create()
        try:
            self._stop = drv.event_create()
        except BaseException:
            drv.event_destroy(self._start)
            raise
        self._events: tuple[Any, Any] | None = (self._start, self._stop)
        try:
            # the records are on the timed path: their C arguments are converted once
            self._record_start = drv.event_recorder(self._start, stream)
            self._record_stop = drv.event_recorder(self._stop, stream)
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        self._record_start()

    def stop(self) -> None:
        self._record_stop()

    def elapsed_s(self) -> float:
        """Seconds between the recorded start and stop; waits for the stop event (SyncTimeout past
        TRAY_SYNC_TIMEOUT_S)."""
        drv.event_wait(self._stop, "the timer's stop event", self._pending)
        return drv.event_elapsed_ms(self._start, self._stop) / 1e3

    def close(self) -> None:
        events, self._events = self._events, None
        if events is not None:
            for event in events:
                drv.event_destroy(event)


class CudaGraph(Graph):
    """An instantiated CUDA graph; `replay()` launches it on the backend's stream. `holds` says in words
    what it captured (noted in `pending` at each replay, for the message of a wait that times out)."""

    def __init__(self, graph: Any, graph_exec: Any, stream: Any, pending: Pending | None = None,
                 holds: str = "") -> None:
        self._graph = graph
        self._exec = graph_exec
        self._stream = stream
        self._open = True
        self._launch = drv.graph_launcher(graph_exec, stream)
        self._pending = pending
        self._note = f"a replay of a captured graph of: {holds or 'work tray did not describe'}"

    def replay(self) -> None:
        if not self._open:
            raise UsageError("this graph is closed")
        if self._pending is not None:
            self._pending.note(self._note)
        self._launch()

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                drv.graph_exec_destroy(self._exec)
            finally:
                drv.graph_destroy(self._graph)


def _device_info(ordinal: int, dev: Any) -> DeviceInfo:
    try:
        numa_node = drv.device_attribute(dev, "HOST_NUMA_ID")
    except DeviceError:  # NOTE: older drivers or bindings know no host NUMA id; -1 means "no information"
        numa_node = -1
    return DeviceInfo(
        ordinal=ordinal,
        uuid=drv.device_uuid(dev),
        pci_bus=drv.device_pci_bus_id(dev),
        numa_node=numa_node if numa_node >= 0 else -1,
        name=drv.device_name(dev),
    )


class CudaBackend(Backend):
    """One rank's GPU. Construct with `CudaBackend.open(ordinal)`; `close()` releases what it made.

    `stream` is the binding handle of the rank's non-blocking stream; `stream_handle` its address as an
    int (for NCCL and cuBLAS). `capability` is the device's (major, minor).
    """

    name = "cuda"

    def __init__(self, info: DeviceInfo, device: Any, context: Any, stream: Any,
                 capability: tuple[int, int]) -> None:
        self.info = info
        self.device = device
        self.context = context
        self.stream = stream
        self.stream_handle = int(stream)
        self.capability = capability
        self._fabric: bool | None = None
        self._transfer: Any = None  # the transfer stream, made on first use
        self._transfer_order: Any = None  # an event: transfer copies wait for the rank's stream
        self._gemm: Any = None  # CublasGemm, made on first use
        self._kernels: dict[tuple[Any, ...], CudaKernel] = {}
        self._modules: list[Any] = []
        self._owned: dict[str, list[Any]] = {
            kind: [] for kind in ("graphs", "timers", "barriers", "tables", "mappings", "buffers", "host")
        }
        self._order_events: tuple[Any, Any] | None = None  # (caller -> rank stream, rank -> caller stream)
        self._closed = False
        self._timed_out = False  # a wait raised SyncTimeout
        self._own_capture = OwnCapture()  # shared with the barriers: set inside capture() and joined()

    @classmethod
    def open(cls, ordinal: int) -> CudaBackend:
        """Retain device `ordinal`'s primary context, make it current, create the stream.

        Raises UsageError if no such device is visible, CudaError (a DeviceError) on driver failures.
        """
        drv.init()
        count = drv.device_count()
        if not 0 <= ordinal < count:
            raise UsageError(f"GPU {ordinal} is not visible: this process sees {count} GPU(s) "
                             "(check CUDA_VISIBLE_DEVICES and -n)")
        dev = drv.device_get(ordinal)
        ctx = drv.primary_ctx_retain(dev)
        try:
            drv.ctx_set_current(ctx, ordinal)
            info = _device_info(ordinal, dev)
            capability = (drv.device_attribute(dev, "COMPUTE_CAPABILITY_MAJOR"),
                          drv.device_attribute(dev, "COMPUTE_CAPABILITY_MINOR"))
            stream = drv.stream_create()
        except BaseException:
            drv.primary_ctx_release(dev)
            raise
        backend = cls(info, dev, ctx, stream, capability)
        try:
            # made here, not at first use: a caller's capture may be running by then
            backend._order_events = (drv.event_create(timing=False), drv.event_create(timing=False))
        except BaseException:
            backend.close()
            raise
        return backend

    def make_current(self) -> None:
        """Make this GPU's context current on the calling thread. Only needed with several backends in
        one process before hot-path calls (launches, graph replays), which do not switch contexts."""
        if self._closed:
            raise UsageError(f"the cuda backend of GPU {self.info.ordinal} is closed")
        drv.ctx_set_current(self.context, self.info.ordinal)

    def _track(self, kind: str, obj: Any) -> Any:
        self._owned[kind].append(obj)
        return obj

    # --- memory -------------------------------------------------------------------------------------

    def fabric_supported(self) -> bool:
        """Whether exported buffers also carry a FABRIC handle (probed once; see memory.probe_fabric)."""
        if self._fabric is None:
            self.make_current()
            self._fabric = memory.probe_fabric(self.info.ordinal)
        return self._fabric

    def allocate(self, name: str, nbytes: int, export: bool) -> memory.VmmBuffer:
        """A zeroed VMM buffer of at least `nbytes`; exported as a POSIX fd (+ FABRIC where it works)."""
        fabric = export and self.fabric_supported()
        self.make_current()
        buf = memory.allocate(name, nbytes, self.info.ordinal, self.stream, export, fabric)
        return self._track("buffers", buf)

    def import_peer(self, handle: ExportedHandle) -> memory.VmmMapping:
        """Map a peer's buffer for this GPU; `handle.fd` (a received copy) is closed here."""
        if self._closed:
            if handle.fd is not None:
                os.close(handle.fd)
            raise UsageError(f"the cuda backend of GPU {self.info.ordinal} is closed")
        self.make_current()
        return self._track("mappings", memory.import_peer(handle, self.info.ordinal))

    def ptr_table(self, ptrs: Sequence[int]) -> memory.DevicePtrTable:
        self.make_current()
        return self._track("tables", memory.DevicePtrTable(ptrs, self.stream))

    def write(self, ptr: int, data: np.ndarray) -> None:
        """Copy a C-contiguous host array to device address `ptr`; returns when the bytes landed."""
        if not isinstance(data, np.ndarray) or not data.flags.c_contiguous:
            raise UsageError(f"write needs a C-contiguous numpy array, got {type(data).__name__}"
                             + ("" if not isinstance(data, np.ndarray) else " (not C-contiguous; use "
                                "np.ascontiguousarray)"))
        if data.nbytes == 0:
            return
        self.make_current()
        drv.memcpy_htod_async(ptr, data.ctypes.data, data.nbytes, self.stream)
        self._wait(self.stream, f"a write of {data.nbytes} B to the device (after the stream's earlier work)")

    def read(self, ptr: int, nbytes: int) -> np.ndarray:
        """`nbytes` from device address `ptr` as a new u8 array, after the stream's earlier work."""
        out = np.empty(nbytes, dtype=np.uint8)
        if nbytes:
            self.make_current()
            drv.memcpy_dtoh_async(out.ctypes.data, ptr, nbytes, self.stream)
            self._wait(self.stream, f"a read of {nbytes} B from the device (after the stream's earlier work)")
        return out

    def synchronize(self) -> None:
        """Wait for the rank's stream; SyncTimeout (naming the last work enqueued) when it is still busy after
        TRAY_SYNC_TIMEOUT_S (default 60 s): a collective whose peer never came would otherwise block forever."""
        self.make_current()
        self._wait(self.stream, f"the stream of GPU {self.info.ordinal}")

    def _wait(self, stream: Any, what: str) -> None:
        try:
            drv.stream_wait(stream, what, self.last_work)
        except SyncTimeout:
            self._timed_out = True  # NOTE: close() then waits briefly: the stream may never end
            raise

    # --- copies, pinned host memory, GEMM -------------------------------------------------------------

    def copy(self, dst_ptr: int, src_ptr: int, nbytes: int, *, transfer: bool = False) -> None:
        """Enqueue a copy between device, peer-mapped or pinned-host addresses (UVA: any direction).

        On the rank's stream, or with `transfer` on the transfer stream, which first waits for the work
        already on the rank's stream (so a park copies what the kernels before it wrote).
        """
        if nbytes <= 0:
            return
        stream = self.stream
        if transfer:
            stream = self._transfer_stream()
            drv.event_record(self._transfer_order, self.stream)
            drv.stream_wait_event(stream, self._transfer_order)
        drv.memcpy_async(dst_ptr, src_ptr, nbytes, stream)

    def _transfer_stream(self) -> Any:
        if self._transfer is None:
            self.make_current()
            stream = drv.stream_create()
            try:
                self._transfer_order = drv.event_create()
            except BaseException:
                drv.stream_destroy(stream)
                raise
            self._transfer = stream
        return self._transfer

    def sync_transfer(self) -> None:
        """Wait until every `copy(..., transfer=True)` has landed."""
        if self._transfer is not None:
            self._wait(self._transfer, f"the transfer stream of GPU {self.info.ordinal}")

    def pinned_host(self, nbytes: int) -> HostMemory:
        """`nbytes` of page-locked host memory on this GPU's NUMA node: allocated under the rank's
        binding, its pages checked (move_pages), and re-placed with mbind if they landed elsewhere."""
        from tray.backend.cuda import hostmem

        self.make_current()
        return self._track("host", hostmem.pinned_host(self.info.ordinal, nbytes, self.info.numa_node))

    def gemm(self, a_ptr: int, b_ptr: int, c_ptr: int, m: int, n: int, k: int, dtype: str = "bf16",
             accumulate: bool = False) -> None:
        """Row-major C[m, n] (+)= A[m, k] @ B[n, k]^T on the rank's stream (cuBLAS, f32 accumulation).

        The first call creates the cuBLAS handle and its workspace: make it outside a capture.
        """
        if self._gemm is None:
            from tray.backend.cuda.gemm import CublasGemm

            self.make_current()
            self._gemm = CublasGemm(self.stream_handle)
        self._gemm.gemm(a_ptr, b_ptr, c_ptr, m, n, k, dtype, accumulate)

    # --- barrier, timing, graphs --------------------------------------------------------------------

    def barrier(self, group: GroupInfo, flags: DeviceBuffer, peer_flags: PtrTable) -> CudaBarrier:
        kernel = self.load_kernel("peer_barrier", _barrier_code(), BARRIER_ENTRY, (), peers=True,
                                  filename=BARRIER_SOURCE)
        self.make_current()
        return self._track("barriers", CudaBarrier(group, flags, peer_flags, kernel, self.stream,
                                                    programmatic=self.capability >= (9, 0),
                                                    pending=self.last_work, own_capture=self._own_capture))

    def timer(self) -> CudaTimer:
        self.make_current()
        return self._track("timers", CudaTimer(self.stream, self.last_work))

    def capture(self, body: Callable[[], None]) -> CudaGraph:
        """Capture what `body` enqueues on the stream (THREAD_LOCAL mode) into an instantiated graph.

        If `body` raises, the capture is ended and discarded and the exception propagates.
        """
        self.make_current()
        drv.stream_begin_capture(self.stream)
        self.last_work.start_trail()
        outer, self._own_capture.active = self._own_capture.active, True  # barriers: kernel launches it records
        try:
            body()
        except BaseException:
            self.last_work.end_trail()
            self._abandon_capture()
            raise
        finally:
            self._own_capture.active = outer
        holds = "; ".join(self.last_work.end_trail())
        graph = drv.stream_end_capture(self.stream)
        if graph is None:
            raise DeviceError(f"cuStreamEndCapture(device {self.info.ordinal}): the driver returned no graph")
        try:
            graph_exec = drv.graph_instantiate(graph)
        except BaseException:
            drv.graph_destroy(graph)
            raise
        return self._track("graphs", CudaGraph(graph, graph_exec, self.stream, self.last_work, holds))

    def close_graphs(self) -> None:
        """Destroy the graphs `capture` made (each at most once; close() does the rest)."""
        if self._closed or not self._owned["graphs"]:
            return
        self.make_current()
        while self._owned["graphs"]:
            self._owned["graphs"].pop().close()

    def _abandon_capture(self) -> None:
        try:
            graph = drv.stream_end_capture(self.stream)
        except DeviceError:  # NOTE: an invalidated capture ends with an error; nothing to free then
            return
        if graph is not None:
            drv.graph_destroy(graph)

    # --- kernels ------------------------------------------------------------------------------------

    def load_kernel(self, name: str, code: bytes, entry: str, options: Sequence[str], peers: bool,
                    filename: str = "") -> CudaKernel:
        """Compile (NVRTC, cached on disk) and load `entry` of the kernel's CUDA C source `code`.

        `code` is the source's bytes (UTF-8) exactly as the manifest loader read and digested them;
        `filename` names it in NVRTC's log (default `<name>.cu`). Raises UsageError (source not UTF-8,
        compile error with NVRTC's log, multicast in a peer kernel), CudaError when the driver refuses
        the image.
        """
        try:
            source = code.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"kernel {name!r}: the CUDA source is not UTF-8 text (byte {exc.start}); "
                             "save the .cu file as UTF-8") from None
        key = (hashlib.sha256(code).hexdigest(), name, entry, tuple(options), peers)
        kernel = self._kernels.get(key)
        if kernel is None:
            self.make_current()
            loaded = nvrtc.load_function(source, name, entry, options, self.capability, peers,
                                         filename=filename)
            self._modules.append(loaded.module)
            kernel = CudaKernel(name, entry, loaded.function, self.stream)
            self._kernels[key] = kernel
        return kernel

    # --- the caller's streams and views -------------------------------------------------------------

    @property
    def dlpack_device(self) -> tuple[int, int]:
        """(kDLCUDA = 2, this GPU's ordinal): own buffers and peer mappings alike are this GPU's to use."""
        return (2, self.info.ordinal)

    @property
    def cuda_stream(self) -> int | None:
        return None if self._closed else self.stream_handle

    def _events(self) -> tuple[Any, Any]:
        if self._order_events is None or self._closed:
            raise UsageError(f"the cuda backend of GPU {self.info.ordinal} is closed")
        return self._order_events

    def order_stream(self, stream: int) -> None:
        """`stream` (the caller's int handle) waits for the work enqueued so far on the rank's stream.
        After close() there is nothing to wait for: the rank's stream was drained and destroyed."""
        if self._closed:
            return
        event = self._events()[1]
        drv.event_record(event, self.stream)
        drv.stream_wait_event(drv.as_stream(stream), event)

    @contextlib.contextmanager
    def joined(self, stream: int | None) -> Iterator[None]:
        """Fork the rank's stream from the caller's `stream` and join it back (two events, no sync), so
        the body's work is ordered with the caller's and a capture running on `stream` records it."""
        if stream is None:
            yield
            return
        into, back = self._events()
        caller = drv.as_stream(stream)
        drv.event_record(into, caller)
        drv.stream_wait_event(self.stream, into)
        # a capture on `stream` now records the rank's stream too: barriers must be kernel launches
        outer, self._own_capture.active = self._own_capture.active, True
        try:
            yield
        finally:
            self._own_capture.active = outer
            drv.event_record(back, self.stream)
            drv.stream_wait_event(caller, back)

    def is_capturing(self, stream: int) -> bool:
        return drv.stream_is_capturing(drv.as_stream(stream))

    def _disown(self, resource: Any) -> None:
        for kind in ("buffers", "mappings", "host"):
            self._owned[kind][:] = [r for r in self._owned[kind] if r is not resource]

    def detach(self, resource: Any) -> Callable[[], None]:
        """As Backend.detach; the release also holds the primary context (retained once more here), so the
        mapping outlives this backend's `close()` even when no other library uses the context."""
        self._disown(resource)
        drv.primary_ctx_retain(self.device)
        ctx, ordinal, device = self.context, self.info.ordinal, self.device

        def release() -> None:
            try:
                drv.ctx_set_current(ctx, ordinal)
                resource.close()
            finally:
                drv.primary_ctx_release(device)

        return release

    # --- teardown ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything this backend made, dependents first; raises the first failure at the end."""
        if self._closed:
            return
        errors: list[BaseException] = []

        def attempt(fn: Callable[..., Any], *args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:
                errors.append(exc)

        attempt(drv.ctx_set_current, self.context, self.info.ordinal)
        # nothing in flight may use what is freed next; bounded: a close after a SyncTimeout must not hang
        limit = CLOSE_AFTER_TIMEOUT_S if self._timed_out else None
        attempt(drv.stream_wait, self.stream, f"the stream of GPU {self.info.ordinal} (closing)", self.last_work, limit)
        if self._transfer is not None:
            attempt(drv.stream_wait, self._transfer, f"the transfer stream of GPU {self.info.ordinal} (closing)",
                    None, limit)
        for kind in ("graphs", "timers", "barriers"):
            while self._owned[kind]:
                attempt(self._owned[kind].pop().close)
        if self._gemm is not None:
            attempt(self._gemm.close)
            self._gemm = None
        self._kernels.clear()
        while self._modules:
            attempt(drv.module_unload, self._modules.pop())
        for kind in ("tables", "mappings", "buffers", "host"):
            while self._owned[kind]:
                attempt(self._owned[kind].pop().close)
        if self._transfer is not None:
            attempt(drv.event_destroy, self._transfer_order)
            attempt(drv.stream_destroy, self._transfer)
            self._transfer = None
        if self._order_events is not None:
            for event in self._order_events:
                attempt(drv.event_destroy, event)
            self._order_events = None
        attempt(drv.stream_destroy, self.stream)
        attempt(drv.primary_ctx_release, self.device)
        self._closed = True
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _barrier_code() -> bytes:
    """The production barrier kernel's source bytes; UsageError naming where it looked if missing."""
    path = kernel_dir() / BARRIER_SOURCE
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"kernel 'peer_barrier': cannot read its CUDA source {path}: {exc.strerror or exc}; "
                         "set TRAY_KERNEL_DIR to the folder holding peer_barrier.cu") from None
