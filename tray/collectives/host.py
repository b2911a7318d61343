"""Collectives on the host backend: stage through each member's mapped scratch, barrier, combine.

Every member sums in member order, so every member gets the same bytes (like a ring that does not
depend on who reduces).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tray.backend.base import Barrier, Collectives, DeviceBuffer, GroupInfo, PtrTable, numpy_dtype
from tray.backend.host import PAGE_NBYTES, view
from tray.collectives.base import GroupJoin, Joiner
from tray.errors import UsageError


class HostJoiner(Joiner):
    """Host groups need no join info; each stages through an exported scratch buffer per group."""

    def buffer_nbytes(self, group: GroupInfo, largest_nbytes: int) -> int:
        # NOTE: collectives stage a whole send buffer (alltoall sends G chunks) through scratch.
        nbytes = max(largest_nbytes, 8 * group.size)
        return -(-nbytes // PAGE_NBYTES) * PAGE_NBYTES

    def join_info(self, group: GroupInfo) -> bytes:
        return b""

    def join(self, joins: Sequence[GroupJoin]) -> dict[str, Collectives]:
        out: dict[str, Collectives] = {}
        for j in joins:
            if j.buffer is None or j.peer_buffers is None:
                raise UsageError(f"group {j.group.name!r}: host collectives need a scratch buffer")
            out[j.group.name] = HostCollectives(j.group, j.barrier, j.buffer, j.peer_buffers)
        return out


class HostCollectives(Collectives):
    def __init__(self, group: GroupInfo, barrier: Barrier, scratch: DeviceBuffer, peer_scratch: PtrTable) -> None:
        self.group = group
        self._barrier = barrier
        self._scratch = scratch
        self._peer_scratch = peer_scratch.ptrs

    def _typed(self, ptr: int, count: int, dtype: str) -> np.ndarray:
        dt = numpy_dtype(dtype)
        return view(ptr, count * dt.itemsize).view(dt)

    def _stage(self, send_ptr: int, nbytes: int) -> None:
        if nbytes > self._scratch.nbytes:
            raise UsageError(
                f"group {self.group.name!r}: a collective of {nbytes} B exceeds the host scratch of "
                f"{self._scratch.nbytes} B (sized from the manifest's largest buffer); "
                "send from a buffer the manifest declares"
            )
        view(self._scratch.ptr, nbytes)[:] = view(send_ptr, nbytes)
        self._barrier.launch()

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
        self._stage(send_ptr, nbytes)
        result = self._reduce(0, count, dtype)
        self._barrier.launch()  # nobody restages scratch until every member has read it
        self._typed(recv_ptr, count, dtype)[:] = result

    def allgather(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                      stream: int | None = None) -> None:
        nbytes = count * numpy_dtype(dtype).itemsize
        self._stage(send_ptr, nbytes)
        recv = self._typed(recv_ptr, count * self.group.size, dtype)
        for i in range(self.group.size):
            recv[i * count:(i + 1) * count] = self._peer(i, 0, count, dtype)
        self._barrier.launch()

    def reducescatter(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                          stream: int | None = None) -> None:
        chunk = count * numpy_dtype(dtype).itemsize
        self._stage(send_ptr, chunk * self.group.size)
        result = self._reduce(self.group.index * chunk, count, dtype)
        self._barrier.launch()
        self._typed(recv_ptr, count, dtype)[:] = result

    def alltoall(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                     stream: int | None = None) -> None:
        chunk = count * numpy_dtype(dtype).itemsize
        self._stage(send_ptr, chunk * self.group.size)
        recv = self._typed(recv_ptr, count * self.group.size, dtype)
        for i in range(self.group.size):
            recv[i * count:(i + 1) * count] = self._peer(i, self.group.index * chunk, count, dtype)
        self._barrier.launch()

    def sendrecv(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, peer_index: int,
                 stream: int | None = None) -> None:
        nbytes = count * numpy_dtype(dtype).itemsize
        self._stage(send_ptr, nbytes)
        self._typed(recv_ptr, count, dtype)[:] = self._peer(peer_index, 0, count, dtype)
        self._barrier.launch()

    def close(self) -> None:
        pass
