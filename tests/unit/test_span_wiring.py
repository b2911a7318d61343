"""How a rank wires the barrier of a group that spans nodes when its collectives cross nodes (cuda: NCCL),
driven with fakes of the backend, the joiner and the table (the host tests run the other wiring for real):
member 0 offers the leaders' join info, leaders join the leaders' group, every member gets the device
barrier; without that join info every member keeps the relayed barrier."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

from tray.backend.base import GroupInfo
from tray.collectives.span import DeviceSpanBarrier
from tray.handshake import wire
from tray.rank import lifecycle
from tray.rank.env import RankEnv
from tray.rank.phases import PhaseClock
from tray.rank.wiring import LEADERS_PREFIX, SPAN_BUFFER_PREFIX, SPAN_FLAGS_PREFIX, Parts

UID = b"u" * 128


class FakeBuffer:
    def __init__(self, nbytes: int) -> None:
        self.arr = np.zeros(nbytes, np.uint8)
        self.ptr, self.nbytes = self.arr.ctypes.data, nbytes


class FakeBackend:
    name = "cuda"
    cuda_stream = 0x1234

    def __init__(self) -> None:
        self.barriers: list = []

    def allocate(self, name: str, nbytes: int, export: bool) -> FakeBuffer:
        return FakeBuffer(nbytes)

    def barrier(self, group, flags, peer_flags):
        local = SimpleNamespace(group=group, err_ptr=0xE0 + len(self.barriers), closed=False)
        local.close = lambda: setattr(local, "closed", True)
        self.barriers.append(local)
        return local

    def pinned_host(self, nbytes: int) -> FakeBuffer:
        return FakeBuffer(nbytes)

    def is_capturing(self, stream: int) -> bool:
        return False

    def synchronize(self) -> None:
        pass

    def joined(self, stream):
        return contextlib.nullcontext()


class FakeJoiner:
    crosses_nodes = True

    def __init__(self) -> None:
        self.infos: list[GroupInfo] = []
        self.joins: list = []

    def join_info(self, group: GroupInfo) -> bytes:
        self.infos.append(group)
        return UID

    def join(self, joins):
        self.joins.extend(joins)
        return {j.group.name: SimpleNamespace(group=j.group, close=lambda: None) for j in joins}


def _offer(rank: int, groups: dict[str, bytes]) -> wire.Offer:
    return wire.Offer(token="t", rank=rank, world_size=4, host="boot", pid=100 + rank, uid=0,
                      device=wire.DeviceIdentity(ordinal=rank % 2, uuid=f"GPU-{rank}", pci_bus="", numa_node=-1),
                      backend="cuda", manifest="a" * 64, fd_socket=f"/j/rank-{rank}.fds", buffers=(), groups=groups,
                      timings={})


def wired(rank: int, offered: bytes | None = UID):
    """Rank `rank` of 2 nodes x 2 ranks, groups world (spans) and pairs (within a node), through
    _allocate_spanning, _leaders_join_info and _join; (parts, joiner, join info it offered)."""
    env = RankEnv(rank=rank, world_size=4, local_rank=rank % 2, device=0, endpoint="", job_dir="", token="t",
                  manifest="", backend="cuda", vars=(), t_spawn=None, node_rank=rank // 2, nnodes=2,
                  local_world_size=2)
    parts = Parts(env, PhaseClock())
    backend, joiner = FakeBackend(), FakeJoiner()
    world = GroupInfo("world", (0, 1, 2, 3), rank)
    parts.groups = {"world": world}
    parts.spanning = {"world"}
    parts.buffers = {}
    parts.client = SimpleNamespace()
    lifecycle._allocate_spanning(parts, backend, world, 2)
    offered_info = lifecycle._leaders_join_info(parts, joiner)
    node = parts.span_local["world"].members
    parts.ptr_tables = {name: SimpleNamespace(ptrs=tuple(0x1000 * (m + 1) for m in node), ptr=0)
                        for name in (SPAN_FLAGS_PREFIX + "world", SPAN_BUFFER_PREFIX + "world")}
    # member 0's join info as a node's table holds it: in rank 0's offer on node 0, in `joins` on node 1
    info = {LEADERS_PREFIX + "world": offered} if offered else {}
    if rank < 2:
        table = wire.Table(token="t", offers=tuple(_offer(r, info if r == 0 else {}) for r in (0, 1)))
    else:
        table = wire.Table(token="t", offers=tuple(_offer(r, {}) for r in (2, 3)), joins={0: info} if info else {})
    lifecycle._join(parts, backend, joiner, table, 60.0)
    return parts, joiner, offered_info, backend


def test_member_0_offers_the_leaders_join_info_and_only_it():
    _, joiner, offered, _ = wired(0)
    assert offered == {LEADERS_PREFIX + "world": UID}
    assert [g.members for g in joiner.infos] == [(0, 2)]
    assert wired(2)[2] == {} and wired(1)[2] == {}


@pytest.mark.parametrize("rank, leads", [(0, True), (1, False), (2, True), (3, False)])
def test_every_member_gets_the_device_barrier_and_leaders_join_the_leaders_group(rank, leads):
    parts, joiner, _, backend = wired(rank)
    barrier = parts.barriers["world"]
    assert isinstance(barrier, DeviceSpanBarrier) and barrier.path == "hierarchical"
    assert barrier.is_leader == leads and barrier.relayed.path == "relayed"
    assert barrier.local_group.members == ((0, 1) if rank < 2 else (2, 3))
    assert barrier.parts == ((0, 1), (2, 3))
    assert barrier._err_ptr == backend.barriers[0].err_ptr  # the local barrier's own error word is sent
    sizes = [parts.buffers[prefix + "world"].nbytes for prefix in (SPAN_FLAGS_PREFIX, SPAN_BUFFER_PREFIX)]
    assert sizes == [8 * 4, 16 * 5]  # sized for the whole group: every rank exports the same bytes
    if leads:
        assert [(j.group.name, j.group.members, j.group.index, j.join_info) for j in joiner.joins] == \
            [(LEADERS_PREFIX + "world", (0, 2), rank // 2, UID)]
    else:
        assert joiner.joins == []
    # the leader's span buffer is read through the node's peer table (its member 0)
    assert barrier._leader_span_ptr == parts.ptr_tables[SPAN_BUFFER_PREFIX + "world"].ptrs[0]


def test_without_the_leaders_join_info_every_member_keeps_the_relayed_barrier():
    for rank in range(4):
        parts, joiner, _, backend = wired(rank, offered=None)
        assert parts.barriers["world"].path == "relayed" and joiner.joins == []
        assert backend.barriers[0].closed
