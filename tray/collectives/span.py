"""The hierarchical barrier over a group that spans nodes: the peer barrier among the members on this
node, one cross-node step among the nodes' leaders (each node's first member), the peer barrier again.

    every member:  local barrier (timeout T)           -> who on this node is missing: its error word
    leaders:       cross step: gather every node's error word (epoch, missing mask over that node's members)
    every member:  local barrier (timeout 3 T + 1 s)   -> the leader is through the cross step
    every member:  read the leader's gathered words     -> who on any node is missing

On cuda the cross step is an NCCL allgather of 2 u64 among the leaders and every step is device work on
the rank's stream (capturable, no host round trip); on host it is a step relayed through the root among
the leaders only (tray/collectives/relay.py). A member that misses the barrier is named by its node's
leader (the local barrier's mask travels in the cross step); a leader that misses the cross step is named
by the root (host) or, on cuda, by its own node's members (their local barrier times out waiting for it).
A leader is named with what it may be doing instead: still waiting for a member of its node when its
barrier timeout is longer than the others' (host: the root's word for it carries the flag ABSENT), or
still waiting in the cross step for another node (cuda, named by its own members).
The local barrier stays broken after a timeout (its kernel returns at once), so the gathered words are
sticky: once a member was missed, every later barrier of the group reports it, as the peer barrier does.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Sequence

import numpy as np

from tray.backend.base import DEFAULT_BARRIER_TIMEOUT_S, Backend, Barrier, Collectives, DeviceBuffer, GroupInfo
from tray.backend.host import view
from tray.collectives.relay import VERDICT_MARGIN_S, Step
from tray.errors import BarrierTimeout, SyncTimeout, UsageError
from tray.handshake.steps import LEADERS, group_topic

# NOTE: the leaders' step may wait for a remote leader that itself waited the whole local timeout T, and
# the second local barrier may wait for its leader through both: each stage gets the worst case before it.
CROSS_FACTOR = 2.0
RELEASE_FACTOR = 3.0
RELEASE_SLACK_S = 1.0
# NOTE: on cuda `wait()` gives the device this long past the second local barrier's timeout: a leader whose
# cross step waits for a leader that never comes (NCCL has no timeout) is named then instead of hanging.
WAIT_SLACK_S = 1.0
WORD_NBYTES = 16  # one node's error word: (epoch, missing mask over that node's members), u64 each
# the per-rank span buffer: this node's error word to send, then every node's word as gathered
SEND_OFFSET = 0
GATHER_OFFSET = WORD_NBYTES
# a node's word made by the root (host), not by its leader: the leader never took the cross step (epoch's top bit)
ABSENT = 1 << 63


def span_nbytes(nnodes: int) -> int:
    """Bytes of a member's span buffer for a group over `nnodes` nodes."""
    return WORD_NBYTES * (1 + nnodes)


def release_timeout_s(timeout_s: float) -> float:
    """The second local barrier's timeout for a barrier of `timeout_s`, s."""
    return RELEASE_FACTOR * timeout_s + RELEASE_SLACK_S


def span_epoch(local_epoch: int) -> int:
    """The spanning barrier's epoch of its local barrier's epoch (two local barriers per spanning one)."""
    return (local_epoch + 1) // 2


def missing_from_words(words: np.ndarray, parts: Sequence[Sequence[int]]) -> tuple[int, list[int]]:
    """(largest epoch of the spanning barrier, global ranks missing) from gathered words `u64[nnodes, 2]`:
    node j's (local barrier epoch that timed out, mask over the members `parts[j]`, bit i = parts[j][i])."""
    missing = [r for j, part in enumerate(parts) for i, r in enumerate(part) if int(words[j, 1]) >> i & 1]
    return span_epoch(max((int(e) & ~ABSENT for e in words[:, 0]), default=0)), missing


def absent_leaders_note(words: np.ndarray, parts: Sequence[Sequence[int]], waiter_timeout_s: float, mine: int) -> str:
    """What a rank of node `mine` can say of the other nodes' leaders the root named in the gathered `words` (flag
    ABSENT): each never took the cross step, and may still be waiting for a member of its node; "" when none."""
    absent = [part for j, part in enumerate(parts) if int(words[j, 0]) & ABSENT and j != mine]
    if not absent:
        return ""
    return (f"{_leads(absent)}, and never reached the nodes' step: it may instead still be waiting there for one of "
            f"them, when its barrier timeout is longer than this rank's {waiter_timeout_s:g} s (give every rank the "
            "same timeout to have the missing one named)")


def _leads(parts: Sequence[Sequence[int]]) -> str:
    """"rank L leads ranks L,M on its node" for each node's members `parts` (its leader first); node.py reads it."""
    return "; ".join(f"rank {part[0]} leads ranks {','.join(map(str, part))} on its node" for part in parts)


def mask_of(missing: Sequence[int], part: Sequence[int]) -> int:
    """The bit mask over `part` (bit i = part[i]) of the ranks in `missing`."""
    return sum(1 << i for i, r in enumerate(part) if r in missing)


class SpanBarrier(Barrier):
    """A barrier over group `group` that spans nodes (module docstring); `path` says "hierarchical".

    `local` is the peer barrier over `local_group` (this node's members of the group, in member order);
    `parts` every node's members (node order: node_parts); `span` this rank's span buffer
    (`span_nbytes(len(parts))` B, exported to the node) and `leader_span_ptr` the node leader's, mapped
    here (own address on the leader). `relayed` is the group's relayed barrier (kept for comparison and
    benchmarks; not used by `launch`). Subclasses make the cross step and read the result."""

    path = "hierarchical"

    def __init__(self, group: GroupInfo, local_group: GroupInfo, local: Barrier, parts: Sequence[Sequence[int]],
                 span: DeviceBuffer, leader_span_ptr: int, relayed: Barrier | None = None) -> None:
        if span.nbytes < span_nbytes(len(parts)):
            raise UsageError(f"barrier {group.name}: the span buffer needs {span_nbytes(len(parts))} B for "
                             f"{len(parts)} nodes, got {span.nbytes} B")
        self.group = group
        self.local_group = local_group
        self.local = local
        self.parts = tuple(tuple(p) for p in parts)
        self.node_index = next(j for j, p in enumerate(self.parts) if group.members[group.index] in p)
        self.is_leader = local_group.index == 0
        self.relayed = relayed
        self._span = span
        self._leader_span_ptr = leader_span_ptr
        self._last_timeout_s = DEFAULT_BARRIER_TIMEOUT_S
        self.epoch = 0

    @property
    def me(self) -> int:
        return self.group.members[self.group.index]

    def _raise_gathered(self, words: np.ndarray, waited_s: float | None = None) -> None:
        epoch, missing = missing_from_words(words, self.parts)
        if missing:
            raise BarrierTimeout(self.group.name, epoch, self.me, missing,
                                 self._last_timeout_s if waited_s is None else waited_s,
                                 absent_leaders_note(words, self.parts, self._last_timeout_s, self.node_index))

    def _as_span(self, exc: BarrierTimeout, waited_s: float | None = None) -> BarrierTimeout:
        """The local barrier's timeout, told as this barrier's (its epoch; `waited_s` when given)."""
        return BarrierTimeout(self.group.name, span_epoch(exc.epoch), self.me, exc.missing,
                              exc.waited_s if waited_s is None else waited_s)

    def synchronize(self) -> None:
        self.local.synchronize()


class DeviceSpanBarrier(SpanBarrier):
    """The hierarchical barrier as device work on the rank's stream (cuda): `leaders` are the leaders'
    collectives (an NCCL communicator; None on a non-leader), `err_ptr` the local barrier's error word
    (u64[2] on the device), `result` pinned host memory of `16 * nnodes` B the gathered words land in."""

    def __init__(self, group: GroupInfo, local_group: GroupInfo, local: Barrier, parts: Sequence[Sequence[int]],
                 span: DeviceBuffer, leader_span_ptr: int, backend: Backend, leaders: Collectives | None,
                 err_ptr: int, relayed: Barrier | None = None) -> None:
        super().__init__(group, local_group, local, parts, span, leader_span_ptr, relayed)
        if self.is_leader and leaders is None:
            raise UsageError(f"barrier {group.name}: rank {self.me} leads its node but has no leaders' collectives")
        self._backend = backend
        self._leaders = leaders
        self._err_ptr = err_ptr
        self._result = backend.pinned_host(WORD_NBYTES * len(self.parts))
        self._broken: BarrierTimeout | None = None
        ctypes.memset(self._result.ptr, 0, WORD_NBYTES * len(self.parts))

    def launch(self, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S, stream: int | None = None) -> None:
        """Enqueue the barrier's device work (module docstring) on the rank's stream, ordered after and
        before the work on `stream` when given. No synchronisation, no allocation: capturable."""
        if not timeout_s > 0:
            raise UsageError(f"barrier {self.group.name}: timeout_s must be > 0, got {timeout_s}")
        if self._broken is not None:
            raise self._broken.again()
        self.epoch += 1
        self._last_timeout_s = timeout_s
        nbytes = WORD_NBYTES * len(self.parts)
        with self._backend.joined(stream):
            self.local.launch(timeout_s)
            if self._leaders is not None:
                self._backend.copy(self._span.ptr + SEND_OFFSET, self._err_ptr, WORD_NBYTES)
                self._leaders.allgather(self._span.ptr + SEND_OFFSET, self._span.ptr + GATHER_OFFSET, 2, "u64")
            self.local.launch(release_timeout_s(timeout_s))
            self._backend.copy(self._result.ptr, self._leader_span_ptr + GATHER_OFFSET, nbytes)

    def wait(self, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S) -> None:
        """One barrier, synchronised and checked, bounded: when the stream has not ended `release_timeout_s +
        WAIT_SLACK_S` after the launch, the cross step is waiting for a leader that never came (NCCL waits
        forever): BarrierTimeout names the other nodes' leaders (with two nodes, exactly the missing one),
        and the barrier stays broken (the stream is left as it is: the rank should report and exit)."""
        if self._broken is not None:
            raise self._broken.again()
        self.launch(timeout_s)
        try:
            self.local.synchronize(timeout_s=release_timeout_s(timeout_s) + WAIT_SLACK_S)
        except SyncTimeout as exc:
            if self.is_leader:
                others = [p for j, p in enumerate(self.parts) if j != self.node_index]
                suspects = [p[0] for p in others]
                note = (f"the nodes' step (the leaders' allgather) never ended: {_leads(others)}, and one of them "
                        "never joined it: besides having died or hung, it may still be waiting for a member of its "
                        f"node, when its barrier timeout is longer than this rank's {timeout_s:g} s")
            else:
                suspects, note = [self.local_group.members[0]], self._leader_note()
            self._broken = BarrierTimeout(self.group.name, self.epoch, self.me, suspects, exc.waited_s, note)
            # the leaders' collective waits for a partner that never came: abort it (ncclCommAbort ends the
            # waiting kernel), so that the stream drains and closing the rank does not hang on it
            abort = getattr(self._leaders, "abort", None)
            if abort is not None:
                with contextlib.suppress(Exception):
                    abort()
            raise self._broken from exc
        self.check()

    def _leader_note(self) -> str:
        """What a member can say of its node's leader that never came back from the nodes' step."""
        return (f"rank {self.local_group.members[0]} leads this node in the nodes' step and never came back from it: "
                "besides having died or hung, it may be waiting there for another node's leader (missing, or still "
                "waiting for a member of its node)")

    def check(self) -> None:
        """After a synchronisation: BarrierTimeout naming this node's missing members (the local barrier's
        own word), else any node's (the gathered words)."""
        if self._broken is not None:
            raise self._broken.again()
        try:
            self.local.check()
        except BarrierTimeout as exc:
            # odd local epochs are the first local barrier (timeout T), even ones the second (its own timeout)
            t = self._last_timeout_s
            if exc.epoch % 2 or self.is_leader or exc.missing != [self.local_group.members[0]]:
                self._broken = self._as_span(exc, t if exc.epoch % 2 else release_timeout_s(t))
            else:
                self._broken = BarrierTimeout(self.group.name, span_epoch(exc.epoch), self.me, exc.missing,
                                              release_timeout_s(t), self._leader_note())
            # NOTE: kept, as launch() keeps its own: every later check or launch says it is this timeout again
            raise self._broken from None
        words = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * len(self.parts))).from_address(self._result.ptr))
        try:
            self._raise_gathered(words.reshape(len(self.parts), 2))
        except BarrierTimeout as exc:
            self._broken = exc
            raise

    def close(self) -> None:
        leaders, self._leaders = self._leaders, None
        if leaders is not None:
            leaders.close()
        self.local.close()


class HostSpanBarrier(SpanBarrier):
    """The hierarchical barrier on the host backend: the same stages, run now; the leaders' cross step is a
    step relayed through the root among the leaders only (`step`, tray/collectives/relay.py)."""

    def __init__(self, group: GroupInfo, local_group: GroupInfo, local: Barrier, parts: Sequence[Sequence[int]],
                 span: DeviceBuffer, leader_span_ptr: int, step: Step, relayed: Barrier | None = None) -> None:
        super().__init__(group, local_group, local, parts, span, leader_span_ptr, relayed)
        self._step = step
        self._topic = group_topic(group.name, group.members, LEADERS)
        self._broken: BarrierTimeout | None = None
        self._word = (0, 0)  # this node's error word: (epoch that timed out, missing mask over its members)

    def _gathered(self, ptr: int) -> np.ndarray:
        return view(ptr + GATHER_OFFSET, WORD_NBYTES * len(self.parts)).view(np.uint64).reshape(len(self.parts), 2)

    def launch(self, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S, stream: int | None = None) -> None:
        if self._broken is not None:
            raise self._broken.again()
        self.epoch += 1
        self._last_timeout_s = timeout_s
        t0 = time.perf_counter()
        first: BarrierTimeout | None = None
        try:
            self.local.launch(timeout_s)
        except BarrierTimeout as exc:  # the leader still takes the cross step: it carries who is missing
            first = self._as_span(exc)
            self._word = (exc.epoch, mask_of(exc.missing, self.local_group.members))
            if not self.is_leader:
                self._broken = first
                raise first from None
        if self.is_leader:
            self._cross(timeout_s)
        try:
            self.local.launch(release_timeout_s(timeout_s))
        except BarrierTimeout as exc:
            first = first or self._as_span(exc)
        if first is not None:
            missing, note = set(first.missing), ""
            if self.is_leader:  # the other nodes' missing members too, from the words the cross step gathered
                words = self._gathered(self._span.ptr)
                missing |= set(missing_from_words(words, self.parts)[1])
                note = absent_leaders_note(words, self.parts, timeout_s, self.node_index)
            self._broken = BarrierTimeout(self.group.name, first.epoch, self.me, sorted(missing),
                                          time.perf_counter() - t0, note)
            raise self._broken
        try:
            self._raise_gathered(self._gathered(self._leader_span_ptr), time.perf_counter() - t0)
        except BarrierTimeout as exc:
            self._broken = exc
            raise

    def _cross(self, timeout_s: float) -> None:
        """Every leader's word through the root, written into this rank's span buffer in node order; a
        leader that never arrived is named (bit 0: the leader itself; flag ABSENT). This leader, come after the
        others gave up on it because it waited for a member of its node, keeps its own word: it names that member."""
        wait_s = CROSS_FACTOR * timeout_s
        values = self._step(self._topic, {"timeout_s": wait_s, "err": list(self._word)}, wait_s + VERDICT_MARGIN_S)
        words = self._gathered(self._span.ptr)
        for j, value in enumerate(values):
            if j == self.node_index and self._word[1]:
                words[j] = list(self._word)
            elif isinstance(value, dict) and isinstance(value.get("err"), list) and len(value["err"]) == 2:
                words[j] = [int(value["err"][0]), int(value["err"][1])]
            else:  # the root named this leader: it never took the step (its stage-1 epoch, bit 0: itself)
                words[j] = [ABSENT | (2 * self.epoch - 1), 1]

    def check(self) -> None:
        if self._broken is not None:
            raise self._broken.again()

    def close(self) -> None:
        self.local.close()


__all__ = ["DeviceSpanBarrier", "HostSpanBarrier", "SpanBarrier", "span_nbytes"]
