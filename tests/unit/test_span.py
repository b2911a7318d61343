"""The hierarchical barrier over a group that spans nodes (tray/collectives/span.py), without processes:
who votes on the leaders' step, how a node's error word names its members, and the device barrier's
stages as the work it enqueues, driven by fakes of the local barrier, the leaders' allgather and the
stream (copies run at once in host memory)."""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

from tray.backend.base import GroupInfo
from tray.collectives.span import (
    GATHER_OFFSET,
    SEND_OFFSET,
    DeviceSpanBarrier,
    mask_of,
    missing_from_words,
    release_timeout_s,
    span_nbytes,
)
from tray.errors import BarrierTimeout, SyncTimeout
from tray.handshake.steps import group_topic, node_leaders, node_parts, step_voters

GROUPS = {"world": [(0, 1, 2, 3)], "odd": [(0, 2, 1, 3)], "pairs": [(0, 1), (2, 3)]}


def test_node_parts_keep_member_order_and_node_order_of_first_member():
    assert node_parts((0, 1, 2, 3), 2) == ((0, 1), (2, 3))
    assert node_parts((2, 0, 3, 1), 2) == ((2, 3), (0, 1))
    assert node_leaders((2, 0, 3, 1), 2) == (2, 0)
    assert node_leaders((0, 1, 2, 3, 4, 5), 3) == (0, 3)


def test_leaders_step_is_voted_by_the_first_member_on_each_node_only():
    topic = group_topic("world", (0, 1, 2, 3), "leaders")
    assert step_voters(topic, 4, GROUPS, 2) == (0, 2)
    assert step_voters(group_topic("odd", (0, 2, 1, 3), "leaders"), 4, GROUPS, 2) == (0, 2)
    assert step_voters(group_topic("world", (0, 1, 2, 3), "barrier"), 4, GROUPS, 2) == (0, 1, 2, 3)
    assert step_voters(topic, 4, GROUPS) is None  # who leads a node needs the ranks per node


def test_a_nodes_word_names_its_members_by_bit():
    parts = ((0, 1), (2, 3))
    assert mask_of([3], parts[1]) == 2 and mask_of([0, 1], parts[0]) == 3 and mask_of([5], parts[0]) == 0
    words = np.array([[0, 0], [7, 2]], dtype=np.uint64)
    assert missing_from_words(words, parts) == (4, [3])  # local epoch 7: the 4th spanning barrier
    assert missing_from_words(np.zeros((2, 2), np.uint64), parts) == (0, [])
    assert release_timeout_s(2.0) > 2 * 2.0  # covers the local wait and the leaders' step before it


class FakeLocal:
    """The node-local peer barrier: records launches; `err` is its device error word (host memory here)."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.err = np.zeros(2, dtype=np.uint64)
        self.err_ptr = self.err.ctypes.data
        self.missing: list[int] = []
        self.hang = False

    def launch(self, timeout_s: float, stream: int | None = None) -> None:
        self.log.append(("local", timeout_s))

    def synchronize(self, timeout_s: float | None = None) -> None:
        self.log.append(("sync", timeout_s))
        if self.hang:
            raise SyncTimeout("barrier world: the stream", "ncclAllGather", timeout_s or 0.0, "TRAY_SYNC_TIMEOUT_S")

    def check(self) -> None:
        if self.missing:
            raise BarrierTimeout("world", 1, 0, self.missing, 2.0)

    def close(self) -> None:
        self.log.append(("close-local",))


class FakeStream:
    """The backend: copies run now (host addresses), pinned memory is a numpy array, no stream to join."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.kept: list[np.ndarray] = []

    def copy(self, dst: int, src: int, nbytes: int, *, transfer: bool = False) -> None:
        self.log.append(("copy", dst, src, nbytes))
        ctypes.memmove(dst, src, nbytes)

    def pinned_host(self, nbytes: int):
        arr = np.full(nbytes, 0xAB, dtype=np.uint8)  # garbage: the barrier must clear it
        self.kept.append(arr)
        return type("Pinned", (), {"ptr": arr.ctypes.data, "nbytes": nbytes})()

    def joined(self, stream):
        return contextlib.nullcontext()


class FakeLeaders:
    """The leaders' allgather of 2 u64: this node's word from send, the other nodes' from `remote`."""

    def __init__(self, log: list, index: int, remote: dict[int, tuple[int, int]]) -> None:
        self.log, self.index, self.remote = log, index, remote

    def allgather(self, send: int, recv: int, count: int, dtype: str, stream: int | None = None) -> None:
        self.log.append(("allgather", send, recv, count, dtype))
        out = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * (1 + len(self.remote)))).from_address(recv))
        out[2 * self.index:2 * self.index + 2] = np.ctypeslib.as_array((ctypes.c_uint64 * 2).from_address(send))
        for j, word in self.remote.items():
            out[2 * j:2 * j + 2] = word

    def abort(self) -> None:
        self.log.append(("abort-leaders",))

    def close(self) -> None:
        self.log.append(("close-leaders",))


class Span:
    def __init__(self, nbytes: int) -> None:
        self.arr = np.zeros(nbytes, dtype=np.uint8)
        self.ptr, self.nbytes = self.arr.ctypes.data, nbytes


def make(rank: int, remote: dict[int, tuple[int, int]] | None = None, leader_span: Span | None = None):
    members, parts = (0, 1, 2, 3), ((0, 1), (2, 3))
    group = GroupInfo("world", members, members.index(rank))
    part = parts[rank // 2]
    local_group = GroupInfo("world", part, part.index(rank))
    log: list = []
    local, stream, span = FakeLocal(log), FakeStream(log), Span(span_nbytes(4))
    leader = local_group.index == 0
    leaders = FakeLeaders(log, rank // 2, remote or {}) if leader else None
    leader_ptr = span.ptr if leader else (leader_span or Span(span_nbytes(4))).ptr
    barrier = DeviceSpanBarrier(group, local_group, local, parts, span, leader_ptr, stream, leaders, local.err_ptr)
    return barrier, log, local, span


def test_a_leaders_barrier_is_local_allgather_local_copy_with_no_sync():
    barrier, log, local, span = make(0, remote={1: (0, 0)})
    barrier.launch(0.5)
    kinds = [entry[0] for entry in log]
    assert kinds == ["local", "copy", "allgather", "local", "copy"], log
    assert log[0] == ("local", 0.5) and log[3] == ("local", release_timeout_s(0.5))
    assert log[1] == ("copy", span.ptr + SEND_OFFSET, local.err_ptr, 16)
    assert log[2] == ("allgather", span.ptr + SEND_OFFSET, span.ptr + GATHER_OFFSET, 2, "u64")
    assert log[4][2:] == (span.ptr + GATHER_OFFSET, 32)
    barrier.check()  # no node missed anyone (and the pinned garbage was cleared)


def test_a_member_missing_on_another_node_is_named_by_every_rank_here():
    barrier, log, local, span = make(0, remote={1: (5, 0b10)})  # node 1's leader missed member 1: rank 3
    barrier.launch(0.5)
    with pytest.raises(BarrierTimeout) as info:
        barrier.check()
    assert info.value.missing == [3] and info.value.epoch == 3 and info.value.rank == 0
    # rank 1 (a non-leader of node 0) copies its leader's gathered words after the second local barrier
    follower, flog, _, _ = make(1, leader_span=span)
    follower.launch(0.5)
    assert [e[0] for e in flog] == ["local", "local", "copy"] and flog[2][2] == span.ptr + GATHER_OFFSET
    with pytest.raises(BarrierTimeout) as info:
        follower.check()
    assert info.value.missing == [3] and info.value.rank == 1


def test_this_nodes_own_timeout_is_named_first():
    barrier, _, local, _ = make(2, remote={0: (0, 0)})
    local.missing = [3]
    barrier.launch(0.5)
    with pytest.raises(BarrierTimeout) as info:
        barrier.check()
    assert info.value.missing == [3] and info.value.waited_s == 0.5 and info.value.epoch == 1


def test_a_leader_stuck_in_the_cross_step_names_the_other_leaders_and_stays_broken():
    barrier, log, local, _ = make(0, remote={1: (0, 0)})
    local.hang = True
    with pytest.raises(BarrierTimeout) as info:
        barrier.wait(0.5)
    assert info.value.missing == [2], info.value
    said = str(info.value)
    assert "rank 2 leads ranks 2,3 on its node" in said and "longer than this rank's 0.5 s" in said
    assert ("sync", release_timeout_s(0.5) + 1.0) in log and ("abort-leaders",) in log
    with pytest.raises(BarrierTimeout):
        barrier.launch(0.5)
    barrier.close()
    assert ("close-leaders",) in log and ("close-local",) in log


def test_a_follower_stuck_names_its_leader():
    follower, _, local, _ = make(3)
    local.hang = True
    with pytest.raises(BarrierTimeout) as info:
        follower.wait(0.5)
    assert info.value.missing == [2]
    assert "rank 2 leads this node in the nodes' step and never came back" in str(info.value)


def test_a_follower_whose_leader_never_came_back_from_the_nodes_step_says_so():
    """The second local barrier (even local epoch) missed the leader: it is in the nodes' step, not absent."""
    follower, _, local, _ = make(3)
    follower.launch(0.5)
    local.missing = [2]
    local.check = lambda: (_ for _ in ()).throw(BarrierTimeout("world", 2, 3, [2], release_timeout_s(0.5)))
    with pytest.raises(BarrierTimeout) as info:
        follower.check()
    assert info.value.missing == [2] and info.value.epoch == 1 and info.value.waited_s == release_timeout_s(0.5)
    assert "never came back from it" in str(info.value)


def test_a_leader_named_by_the_root_is_told_as_one_that_may_wait_for_its_members():
    from tray.collectives.span import ABSENT, absent_leaders_note
    parts = ((0, 1), (2, 3))
    words = np.array([[0, 0], [ABSENT | 3, 1]], dtype=np.uint64)
    assert missing_from_words(words, parts) == (2, [2])
    assert "rank 2 leads ranks 2,3 on its node" in absent_leaders_note(words, parts, 0.5, mine=0)
    assert absent_leaders_note(words, parts, 0.5, mine=1) == ""  # its own node: its leader knows better


def test_the_relayed_fallback_refuses_to_be_captured_and_names_who_is_missing():
    from tray.collectives.relay import RelayBarrier
    from tray.errors import UsageError

    calls: list = []

    def step(topic, value, wait_s):
        calls.append(topic)
        return [value, value, None, value]

    barrier = RelayBarrier(GroupInfo("world", (0, 1, 2, 3), 0), step, capturing=lambda stream: stream == 7)
    assert barrier.path == "relayed"
    with pytest.raises(UsageError, match="cannot be captured"):
        barrier.launch(1.0, stream=7)
    assert calls == []
    with pytest.raises(BarrierTimeout) as info:
        barrier.launch(1.0)
    assert info.value.missing == [2] and calls == [group_topic("world", (0, 1, 2, 3), "barrier")]
