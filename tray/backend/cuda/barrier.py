"""The peer barrier of the cuda backend (docs/design.md section 6): host side of `tray_peer_barrier`.

The kernel (manifests/kernels/peer_barrier.cu) keeps its epoch in a device counter and reports a
timeout in an error word `u64[2]` = (epoch, bitmask of missing members); this class owns both, launches
the kernel with arguments packed once per distinct timeout, and turns the error word into a
BarrierTimeout after a synchronisation.

Eager launches on the rank's own stream go through a graph of one barrier, captured once per timeout and
launched with cuGraphLaunch: measured on 2x H200 the driver takes 1.8 us of host time per graph launch
against 5.7 us per cuLaunchKernelEx of the same kernel, and a barrier issued that way completes in 4.5 us
instead of 5.7 (tray gate peer-barrier: eager_graph vs eager). Launches on a caller's stream, and those
made while the rank's stream may be recording (inside the backend's capture, or joined to a caller's
stream for `rank.run(..., stream=)`), stay kernel launches (a capture records them; a caller's stream may
be capturing at any time). TRAY_BARRIER_LAUNCH=kernel makes every launch a kernel launch.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tray.backend.base import DEFAULT_BARRIER_TIMEOUT_S, Barrier, DeviceBuffer, GroupInfo, PtrTable
from tray.backend.cuda import driver as drv
from tray.backend.cuda.kernels import CudaKernel, CudaLaunch
from tray.backend.wait import Pending
from tray.errors import BarrierTimeout, UsageError

BARRIER_SOURCE = "peer_barrier.cu"
BARRIER_ENTRY = "tray_peer_barrier"
MAX_GROUP_SIZE = 32  # NOTE: one warp; the missing-member mask is one u64 but the block is 32 threads
_THREADS = 32
_STATE_NBYTES = 32  # counter at +0, err[0] (epoch) at +16, err[1] (missing mask) at +24


def kernel_dir() -> Path:
    """`$TRAY_KERNEL_DIR` (a variant under study), else the built-in kernels shipped as package data."""
    override = os.environ.get("TRAY_KERNEL_DIR")
    if override:
        return Path(override)
    from tray.manifest.builtin import kernel_dir as builtin_kernel_dir

    return builtin_kernel_dir()


LAUNCH_MODES = ("graph", "kernel")


def launch_mode(text: str | None) -> str:
    """The eager launch mode from TRAY_BARRIER_LAUNCH's text: `graph` (default, also for empty) or `kernel`."""
    mode = (text or "graph").strip().lower()
    if mode not in LAUNCH_MODES:
        raise UsageError(f"TRAY_BARRIER_LAUNCH must be one of {', '.join(LAUNCH_MODES)}, got {text!r}; "
                         "unset it for the default (graph)")
    return mode


@dataclass
class OwnCapture:
    """Whether the rank's stream may be recording into a capture now: inside CudaBackend.capture(), and
    while joined to a caller's stream (CudaBackend.joined: a capture there pulls the rank's stream in).
    Barriers launched on the rank's stream meanwhile are kernel launches, which a capture records."""

    active: bool = False


@dataclass
class _OneBarrierGraph:
    """A graph of one barrier launch and its instantiation; `launch` replays it (drv.graph_launcher)."""

    graph: Any
    graph_exec: Any
    launch: Callable[[], None]

    def close(self) -> None:
        drv.graph_exec_destroy(self.graph_exec)
        drv.graph_destroy(self.graph)


def missing_members(members: tuple[int, ...], mask: int) -> list[int]:
    """The global ranks whose bit is set in the kernel's missing-member mask (bit i = member i)."""
    return [rank for i, rank in enumerate(members) if mask >> i & 1]


class CudaBarrier(Barrier):
    """One group's barrier. `flags` is this member's `u64[G]` (exported, zeroed); `peer_flags` holds
    every member's flags as mapped here, in member order (own slot = own address). `own_capture` says when
    `stream` may be recording (None: never); `mode` is the eager launch mode (None: TRAY_BARRIER_LAUNCH)."""

    def __init__(self, group: GroupInfo, flags: DeviceBuffer, peer_flags: PtrTable, kernel: CudaKernel,
                 stream: Any, programmatic: bool = False, pending: Pending | None = None,
                 own_capture: OwnCapture | None = None, mode: str | None = None) -> None:
        if not 1 <= group.size <= MAX_GROUP_SIZE:
            raise UsageError(f"barrier {group.name}: groups of 1 to {MAX_GROUP_SIZE} members are "
                             f"supported, got {group.size}")
        if flags.nbytes < 8 * group.size:
            raise UsageError(f"barrier {group.name}: flags need {8 * group.size} B (u64[{group.size}]), "
                             f"got {flags.nbytes} B")
        if len(peer_flags.ptrs) != group.size:
            raise UsageError(f"barrier {group.name}: peer_flags has {len(peer_flags.ptrs)} entries for "
                             f"{group.size} members")
        self.group = group
        self._pending = pending
        # programmatic launches let barrier k+1 be scheduled while barrier k still waits (the kernel
        # does `griddepcontrol.wait` first); TRAY_BARRIER_PDL=0 turns it off
        self.programmatic = programmatic and os.environ.get("TRAY_BARRIER_PDL", "1") != "0"
        self._flags = flags
        self._peer_flags = peer_flags
        self._kernel = kernel
        self._stream = stream
        self.mode = launch_mode(os.environ.get("TRAY_BARRIER_LAUNCH") if mode is None else mode)
        self._own_capture = own_capture or OwnCapture()
        self._launches: dict[tuple[float, int | None], CudaLaunch] = {}
        self._graphs: dict[float, _OneBarrierGraph] = {}
        self._last_timeout_s = DEFAULT_BARRIER_TIMEOUT_S
        self._raised: BarrierTimeout | None = None
        self._state = drv.mem_alloc(_STATE_NBYTES)
        try:
            drv.memset_d8_async(self._state, 0, _STATE_NBYTES, stream)
            drv.stream_synchronize(stream)
        except BaseException:
            drv.mem_free(self._state)
            raise
        self.counter_ptr = self._state
        self.err_ptr = self._state + 16
        try:
            # the kernel raises this word on a timeout: check() reads it without a copy or a sync
            self._host_flag, self._host_flag_dev = drv.mem_host_alloc_mapped(4)
        except BaseException:
            drv.mem_free(self._state)
            raise
        self._host_word = ctypes.c_uint32.from_address(self._host_flag)
        self._host_word.value = 0

    def launch(self, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S, stream: int | None = None) -> None:
        """Enqueue one barrier on the rank's stream or the caller's `stream` (an int handle); returns before
        it ends. Safe inside a capture (no sync, no device alloc): the epoch counter lives on the device,
        so a captured barrier replays with fresh epochs. On the rank's stream, while it cannot be recording
        (OwnCapture), it is a launch of a one-barrier graph (see the module docstring) unless `mode` is kernel."""
        if stream is None and self.mode == "graph" and not self._own_capture.active:
            one = self._graphs.get(timeout_s)
            if one is None:
                one = self._graph_of(timeout_s)
            self._last_timeout_s = timeout_s
            one.launch()
            return
        self.launch_kernel(timeout_s, stream)

    def launch_kernel(self, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S, stream: int | None = None) -> None:
        """`launch` as a kernel launch (cuLaunchKernel[Ex]) whatever the mode: what a capture records."""
        key = (timeout_s, stream)
        bound = self._launches.get(key)
        if bound is None:
            bound = self._bind(timeout_s, stream)
            self._launches[key] = bound
        self._last_timeout_s = timeout_s
        bound.launch()

    def _bind(self, timeout_s: float, stream: int | None) -> CudaLaunch:
        if self._state is None:
            raise UsageError(f"barrier {self.group.name} is closed")
        if not timeout_s > 0:
            raise UsageError(f"barrier {self.group.name}: timeout_s must be > 0, got {timeout_s}")
        args = [self._flags.ptr, self._peer_flags.ptr, self.counter_ptr, self.err_ptr,
                self._host_flag_dev, self.group.size, self.group.index, int(timeout_s * 1e9)]
        target = self._stream if stream is None else drv.as_stream(stream)
        return self._kernel.bind((1, 1, 1), (_THREADS, 1, 1), args, programmatic=self.programmatic, stream=target)

    def _graph_of(self, timeout_s: float) -> _OneBarrierGraph:
        """Capture one kernel launch of the barrier on the rank's stream and instantiate it (once per timeout).
        Raises UsageError if the rank's stream is being captured by someone other than the backend."""
        bound = self._launches.get((timeout_s, None)) or self._bind(timeout_s, None)
        self._launches[(timeout_s, None)] = bound
        if drv.stream_is_capturing(self._stream):
            raise UsageError(f"barrier {self.group.name}: the rank's stream is being captured outside "
                             "backend.capture(); pass that capture's stream as `stream=` (or set "
                             "TRAY_BARRIER_LAUNCH=kernel)")
        drv.stream_begin_capture(self._stream)
        try:
            bound.launch()
        except BaseException:
            self._end_abandoned_capture()
            raise
        graph = drv.stream_end_capture(self._stream)
        if graph is None:
            raise UsageError(f"barrier {self.group.name}: the capture of one barrier was invalidated (the "
                             "driver returned no graph); set TRAY_BARRIER_LAUNCH=kernel to launch it directly")
        try:
            graph_exec = drv.graph_instantiate(graph)
        except BaseException:
            drv.graph_destroy(graph)
            raise
        try:
            one = _OneBarrierGraph(graph, graph_exec, drv.graph_launcher(graph_exec, self._stream))
        except BaseException:
            drv.graph_exec_destroy(graph_exec)
            drv.graph_destroy(graph)
            raise
        self._graphs[timeout_s] = one
        return one

    def _end_abandoned_capture(self) -> None:
        try:
            graph = drv.stream_end_capture(self._stream)
        except drv.CudaError:  # NOTE: an invalidated capture ends with an error; nothing to free then
            return
        if graph is not None:
            drv.graph_destroy(graph)

    def check(self) -> None:
        """Raise BarrierTimeout if any barrier launched so far timed out (call after a sync)."""
        if self._state is None:
            raise UsageError(f"barrier {self.group.name} is closed")
        if not self._host_word.value:
            return
        if self._raised is not None:  # the word stays raised: every later check says it is the same timeout
            raise self._raised.again()
        err = self._read_err()
        missing = missing_members(self.group.members, int(err[1]))
        if missing:
            self._raised = BarrierTimeout(self.group.name, int(err[0]), self.group.members[self.group.index],
                                          missing, self._last_timeout_s)
            raise self._raised

    def epoch(self) -> int:
        """Barriers this member has entered so far (the device counter; synchronises)."""
        out = np.zeros(1, dtype=np.uint64)
        drv.memcpy_dtoh_async(out.ctypes.data, self.counter_ptr, 8, self._stream)
        drv.stream_wait(self._stream, f"barrier {self.group.name}: a read of its epoch", self._pending)
        return int(out[0])

    def _read_err(self) -> np.ndarray:
        if self._state is None:
            raise UsageError(f"barrier {self.group.name} is closed")
        out = np.zeros(2, dtype=np.uint64)
        drv.memcpy_dtoh_async(out.ctypes.data, self.err_ptr, 16, self._stream)
        drv.stream_wait(self._stream, f"barrier {self.group.name}: a read of its error word", self._pending)
        return out

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait for the rank's stream; SyncTimeout after `timeout_s` (None: TRAY_SYNC_TIMEOUT_S, else 60 s)."""
        drv.stream_wait(self._stream, f"barrier {self.group.name}: the stream it was launched on", self._pending,
                        timeout_s)

    def close(self) -> None:
        state, self._state = self._state, None
        self._launches.clear()
        graphs, self._graphs = list(self._graphs.values()), {}
        for one in graphs:
            one.close()
        if state is not None:
            drv.mem_free(state)
            drv.mem_free_host(self._host_flag)
