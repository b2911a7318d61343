"""Collectives on the host backend: stage through each member's mapped scratch, barrier, combine.

Every member sums in member order, so every member gets the same bytes (like a ring that does not
depend on who reduces).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tray.backend.base import DEFAULT_BARRIER_TIMEOUT_S, Collectives, DeviceBuffer, GroupInfo, PtrTable, numpy_dtype
from tray.backend.host import PAGE_NBYTES, view
from tray.backend.host.barrier import HostBarrier, spin_until, u64_view
from tray.collectives.base import GroupJoin, Joiner
from tray.errors import BarrierTimeout, UsageError

# NOTE: a member's scratch ends in a trailer of three u64 words per member: the collectives' own barrier flags
# (so a program's rank.barrier() never pairs with a barrier inside a collective), then per peer the rounds of
# sendrecv this member staged for it ("sent") and read from it ("read")
_TRAILER_WORDS = 3


def _data_nbytes(largest_nbytes: int, size: int) -> int:
    return -(-max(largest_nbytes, 8 * size) // 8) * 8


class HostJoiner(Joiner):
    """Host groups need no join info; each stages through an exported scratch buffer per group."""

    def buffer_nbytes(self, group: GroupInfo, largest_nbytes: int) -> int:
        # NOTE: collectives stage a whole send buffer (alltoall sends G chunks) through scratch.
        nbytes = _data_nbytes(largest_nbytes, group.size) + _TRAILER_WORDS * 8 * group.size
        return -(-nbytes // PAGE_NBYTES) * PAGE_NBYTES

    def join_info(self, group: GroupInfo) -> bytes:
        return b""

    def join(self, joins: Sequence[GroupJoin]) -> dict[str, Collectives]:
        out: dict[str, Collectives] = {}
        for j in joins:
            if j.buffer is None or j.peer_buffers is None:
                raise UsageError(f"group {j.group.name!r}: host collectives need a scratch buffer")
            out[j.group.name] = HostCollectives(j.group, j.buffer, j.peer_buffers,
                                                j.wait_s or DEFAULT_BARRIER_TIMEOUT_S)
        return out


class HostCollectives(Collectives):
    """allreduce, allgather, reducescatter and alltoall are steps of the whole group (stage, barrier, combine,
    barrier); sendrecv is a step of the pair alone, as with NCCL. Each member makes the same calls in the same
    order. A member that does not come is named after `wait_s`."""

    def __init__(self, group: GroupInfo, scratch: DeviceBuffer, peer_scratch: PtrTable,
                 wait_s: float = DEFAULT_BARRIER_TIMEOUT_S) -> None:
        self.group = group
        self._wait_s = wait_s
        self._scratch = scratch
        self._peer_scratch = peer_scratch.ptrs
        trailer = _TRAILER_WORDS * 8 * group.size
        self._data_nbytes = scratch.nbytes - trailer
        if self._data_nbytes < 8 * group.size:
            raise UsageError(f"group {group.name!r}: a host scratch of {scratch.nbytes} B leaves no room for its "
                             f"{trailer} B of flags; size it with HostJoiner.buffer_nbytes")
        flags = [p + self._data_nbytes for p in self._peer_scratch]
        self._barrier = HostBarrier(group, scratch.ptr + self._data_nbytes, flags)
        words = 8 * group.size
        self._sent = [u64_view(p + words, group.size) for p in flags]  # [member][peer]
        self._read = [u64_view(p + 2 * words, group.size) for p in flags]
        self._rounds = [0] * group.size  # sendrecv rounds made with each peer

    def _typed(self, ptr: int, count: int, dtype: str) -> np.ndarray:
        dt = numpy_dtype(dtype)
        return view(ptr, count * dt.itemsize).view(dt)

    def _sync(self, what: str) -> None:
        """The collectives' barrier over the group, bounded by `wait_s`; a timeout names the collective."""
        try:
            self._barrier.launch(self._wait_s)
        except BarrierTimeout as exc:
            raise BarrierTimeout(f"{self.group.name} (in {what})", exc.epoch, exc.rank, exc.missing,
                                 exc.waited_s) from None

    def _stage(self, send_ptr: int, nbytes: int, what: str) -> None:
        self._stage_only(send_ptr, nbytes)
        self._sync(what)

    def _stage_only(self, send_ptr: int, nbytes: int) -> None:
        if nbytes > self._data_nbytes:
            raise UsageError(
                f"group {self.group.name!r}: a collective of {nbytes} B exceeds the host scratch of "
                f"{self._data_nbytes} B (sized from the manifest's largest buffer); "
                "send from a buffer the manifest declares"
            )
        view(self._scratch.ptr, nbytes)[:] = view(send_ptr, nbytes)

    def _peer(self, i: int, offset_nbytes: int, count: int, dtype: str) -> np.ndarray:
        return self._typed(self._peer_scratch[i] + offset_nbytes, count, dtype)

    def _reduce(self, offset_nbytes: int, count: int, dtype: str) -> np.ndarray:
        acc = self._peer(0, offset_nbytes, count, dtype).copy()
        for i in range(1, self.group.size):
            acc += self._peer(i, offset_nbytes, count, dtype)
        return acc

    def allreduce(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                      stream: int | None = None) -> None:
        nbytes = count * numpy_dtype(dtype).itemsize
        self._stage(send_ptr, nbytes, "allreduce")
        result = self._reduce(0, count, dtype)
        self._sync("allreduce")  # nobody restages scratch until every member has read it
        self._typed(recv_ptr, count, dtype)[:] = result

    def allgather(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                      stream: int | None = None) -> None:
        nbytes = count * numpy_dtype(dtype).itemsize
        self._stage(send_ptr, nbytes, "allgather")
        recv = self._typed(recv_ptr, count * self.group.size, dtype)
        for i in range(self.group.size):
            recv[i * count:(i + 1) * count] = self._peer(i, 0, count, dtype)
        self._sync("allgather")

    def reducescatter(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                          stream: int | None = None) -> None:
        chunk = count * numpy_dtype(dtype).itemsize
        self._stage(send_ptr, chunk * self.group.size, "reducescatter")
        result = self._reduce(self.group.index * chunk, count, dtype)
        self._sync("reducescatter")
        self._typed(recv_ptr, count, dtype)[:] = result

    def alltoall(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                     stream: int | None = None) -> None:
        chunk = count * numpy_dtype(dtype).itemsize
        self._stage(send_ptr, chunk * self.group.size, "alltoall")
        recv = self._typed(recv_ptr, count * self.group.size, dtype)
        for i in range(self.group.size):
            recv[i * count:(i + 1) * count] = self._peer(i, self.group.index * chunk, count, dtype)
        self._sync("alltoall")

    def sendrecv(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, peer_index: int,
                 stream: int | None = None) -> None:
        """Exchange with one peer; the other members take no part. Round k with the peer: stage, post "sent" k,
        wait for the peer's "sent" k, copy its rows, post "read" k, wait for the peer's "read" k (so neither
        restages its scratch while the other still reads it)."""
        nbytes = count * numpy_dtype(dtype).itemsize
        me, peer = self.group.index, peer_index
        if not 0 <= peer < self.group.size:
            raise UsageError(f"group {self.group.name!r}: sendrecv with member {peer}; the group has members "
                             f"0..{self.group.size - 1}")
        if peer == me:
            view(recv_ptr, nbytes)[:] = view(send_ptr, nbytes)
            return
        self._rounds[peer] += 1
        k = self._rounds[peer]
        self._stage_only(send_ptr, nbytes)
        self._post(self._sent, peer, k)
        self._await(self._sent, peer, k, "staged its rows")
        view(recv_ptr, nbytes)[:] = view(self._peer_scratch[peer], nbytes)
        self._post(self._read, peer, k)
        self._await(self._read, peer, k, "read this member's rows")

    def _post(self, table: list[np.ndarray], peer: int, k: int) -> None:
        """Write round k into this member's own trailer, slot `peer` (the peer reads it through its mapping)."""
        table[self.group.index][peer] = k

    def _await(self, table: list[np.ndarray], peer: int, k: int, what: str) -> None:
        theirs = table[peer]
        me = self.group.index
        waited = spin_until(lambda: bool(theirs[me] >= k), self._wait_s)
        if waited is not None:
            members = self.group.members
            raise BarrierTimeout(f"{self.group.name} (in sendrecv with rank {members[peer]}: it never {what})", k,
                                 members[me], [members[peer]], waited)

    def close(self) -> None:
        self._barrier.close()
        self._sent = self._read = []
