"""The peer barrier on the host: the GPU kernel's epoch protocol over memfd-mapped flags."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from tray.backend.base import DEFAULT_BARRIER_TIMEOUT_S, Barrier, GroupInfo
from tray.errors import BarrierTimeout, UsageError

# NOTE: spin this many polls before yielding the CPU, then sleep briefly: a laptop or a 2-core CI
# box runs more ranks than cores, and a pure spin would starve the rank being waited for.
_SPIN_POLLS = 200
_YIELD_UNTIL_S = 0.002
_SLEEP_S = 50e-6


def spin_until(done: Callable[[], bool], timeout_s: float) -> float | None:
    """Poll `done` until it holds (None) or `timeout_s` passed (the seconds waited): spin, then yield the CPU,
    then sleep briefly between polls. A last poll after the deadline: what arrived meanwhile counts."""
    polls = 0
    t0 = time.perf_counter()
    while not done():
        polls += 1
        if polls < _SPIN_POLLS:
            continue
        waited = time.perf_counter() - t0
        if waited >= timeout_s:
            return None if done() else waited
        if waited < _YIELD_UNTIL_S:
            os.sched_yield()
        else:
            time.sleep(_SLEEP_S)
    return None


def u64_view(ptr: int, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(ptr))


class HostBarrier(Barrier):
    """Member t's flags hold, at slot `me`, the last epoch `me` reached. Each barrier writes its
    epoch into every member's flags, then waits until its own flags show that epoch from all.

    x86 stores are seen in program order (TSO), so data written before the flag store is visible
    to a peer that sees the flag.
    """

    def __init__(self, group: GroupInfo, own_flags_ptr: int, peer_flags_ptrs: Sequence[int]) -> None:
        self.group = group
        self.epoch = 0
        self._me = group.index
        self._own = u64_view(own_flags_ptr, group.size)
        self._peers = [u64_view(p, group.size) for p in peer_flags_ptrs]
        self._broken: BarrierTimeout | None = None

    def launch(self, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S, stream: int | None = None) -> None:
        # `stream` orders device work; the host barrier runs now, in program order
        if self._broken is not None:
            raise self._broken.again()
        if not timeout_s > 0:
            raise UsageError(f"barrier {self.group.name}: timeout_s must be > 0, got {timeout_s}")
        self.epoch += 1
        epoch, me, own = self.epoch, self._me, self._own
        for peer in self._peers:
            peer[me] = epoch
        waited = spin_until(lambda: bool(own.min() >= epoch), timeout_s)
        if waited is not None:
            missing = [self.group.members[i] for i in range(self.group.size) if own[i] < epoch]
            if not missing:  # the last flag landed after the wait's final poll, before this count: every member came
                return
            self._broken = BarrierTimeout(self.group.name, epoch, self.group.members[me], missing, waited)
            raise self._broken

    def check(self) -> None:
        if self._broken is not None:
            raise self._broken.again()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self._peers = []
