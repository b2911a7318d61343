"""Collectives on the host backend: stage through each member's mapped scratch, barrier, combine.

Every member sums in member order, so every member gets the same bytes (like a ring that does not
depend on who reduces).

The host backend is where a program is checked before it meets a GPU, so these collectives also check
what NCCL cannot: every member posts what it called (which collective, how many elements, which dtype,
its call number) and all compare after the first barrier, so members that called different collectives
fail naming who called what (with NCCL that hangs, or reads and writes past the buffers); and a send or
receive range that runs past the end of the buffer it starts in is named before it is touched.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from tray.backend.base import (
    DEFAULT_BARRIER_TIMEOUT_S,
    NUMPY_NAMES,
    Collectives,
    DeviceBuffer,
    GroupInfo,
    PtrTable,
    numpy_dtype,
)
from tray.backend.host import PAGE_NBYTES, view
from tray.backend.host.barrier import HostBarrier, spin_until, u64_view
from tray.collectives.base import GroupJoin, Joiner
from tray.errors import BarrierTimeout, UsageError
from tray.text import int_index, ranks_text
from tray.twins import access_fault, check_range, in_region

# NOTE: a member's scratch ends in a trailer of u64 words: four per member (the collectives' own barrier flags,
# so a program's rank.barrier() never pairs with a barrier inside a collective; then per peer the rounds of
# sendrecv this member staged for it ("sent"), read from it ("read"), and the bytes it sends it), then this
# member's last call (_CALL_WORDS: call number, collective, count, dtype)
_PEER_WORDS = 4
_CALL_WORDS = 4
_COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall")
_DTYPES = ("bf16", *NUMPY_NAMES)


def _data_nbytes(largest_nbytes: int, size: int) -> int:
    return -(-max(largest_nbytes, 8 * size) // 8) * 8


def _trailer_nbytes(size: int) -> int:
    return 8 * (_PEER_WORDS * size + _CALL_WORDS)


class HostJoiner(Joiner):
    """Host groups need no join info; each stages through an exported scratch buffer per group."""

    def buffer_nbytes(self, group: GroupInfo, largest_nbytes: int) -> int:
        # NOTE: collectives stage a whole send buffer (alltoall sends G chunks) through scratch.
        nbytes = _data_nbytes(largest_nbytes, group.size) + _trailer_nbytes(group.size)
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
    """allreduce, allgather, reducescatter and alltoall are steps of the whole group (stage, barrier, check the
    calls, combine, barrier); sendrecv is a step of the pair alone, as with NCCL. Each member makes the same calls
    in the same order. A member that does not come is named after `wait_s`."""

    def __init__(self, group: GroupInfo, scratch: DeviceBuffer, peer_scratch: PtrTable,
                 wait_s: float = DEFAULT_BARRIER_TIMEOUT_S) -> None:
        self.group = group
        self._wait_s = wait_s
        self._scratch = scratch
        self._peer_scratch = peer_scratch.ptrs
        size, trailer = group.size, _trailer_nbytes(group.size)
        self._data_nbytes = scratch.nbytes - trailer
        if self._data_nbytes < 8 * size:
            raise UsageError(f"group {group.name!r}: a host scratch of {scratch.nbytes} B leaves no room for its "
                             f"{trailer} B of flags; size it with HostJoiner.buffer_nbytes")
        tails = [p + self._data_nbytes for p in self._peer_scratch]
        self._barrier = HostBarrier(group, scratch.ptr + self._data_nbytes, tails)
        row = 8 * size
        self._sent = [u64_view(t + row, size) for t in tails]  # [member][peer]
        self._read = [u64_view(t + 2 * row, size) for t in tails]
        self._sends = [u64_view(t + 3 * row, size) for t in tails]
        self._calls = [u64_view(t + 4 * row, _CALL_WORDS) for t in tails]  # [member][word]
        self._rounds = [0] * size  # sendrecv rounds made with each peer
        self._ncalls = 0  # group calls made
        # a member's calls on the group, one at a time: (thread name, call) of the one under way
        self._alone_lock = threading.RLock()
        self._under_way: tuple[str, str] | None = None

    @contextlib.contextmanager
    def _alone(self, what: str) -> Iterator[None]:
        """One collective call of this member at a time: a second thread's call while one is under way would post
        its call into the same slots (the members' calls then paired wrongly, or results read from scratch another
        call restaged), so it is a UsageError naming both threads."""
        if not self._alone_lock.acquire(blocking=False):
            other = self._under_way or ("another thread", "a collective")
            raise UsageError(f"group {self.group.name!r}: {what} called on thread {threading.current_thread().name!r} "
                             f"while thread {other[0]!r} is in its {other[1]} on this group: a member makes its "
                             "collective calls on a group one at a time (from one thread, or one after the other)")
        before = self._under_way
        self._under_way = (threading.current_thread().name, what)
        try:
            yield
        finally:
            self._under_way = before
            self._alone_lock.release()

    def _typed(self, ptr: int, count: int, dtype: str) -> np.ndarray:
        dt = numpy_dtype(dtype)
        return view(ptr, count * dt.itemsize).view(dt)

    def _sync(self, what: str) -> None:
        """The collectives' barrier over the group, bounded by `wait_s`; a timeout names the collective."""
        try:
            self._barrier.launch(self._wait_s)
        except BarrierTimeout as exc:
            members, me = self.group.members, self.group.index
            for m in exc.missing:  # a member that staged a sendrecv for this one called that instead
                i = members.index(m)
                if int(self._sent[i][me]) > self._rounds[i]:
                    raise UsageError(f"group {self.group.name!r}: rank {members[me]} called {what} (its call "
                                     f"{self._ncalls} on the group) while rank {m} called sendrecv with it: every "
                                     "member must make the same collective calls in the same order") from None
            told = BarrierTimeout(f"{self.group.name} (in {what})", exc.epoch, exc.rank, exc.missing, exc.waited_s,
                                  exc.also)
            told.repeated = exc.repeated  # its note (`also`) says so already
            raise told from None

    def _begin(self, what: str, count: int, dtype: str, send: tuple[int, int], recv: tuple[int, int]) -> None:
        """Check this member's ranges, post its call, stage its send range, and meet the group; then every member
        compares the calls posted."""
        self._check_ranges(what, count, dtype, send, recv)
        self._ncalls += 1
        mine = (self._ncalls, _COLLECTIVES.index(what), count, _DTYPES.index(dtype))
        self._calls[self.group.index][:] = mine
        self._stage_only(send[0], send[1])
        self._sync(what)
        posted = [tuple(int(w) for w in c) for c in self._calls]
        if any(p != posted[0] for p in posted):
            self._mismatch(posted)

    def _mismatch(self, posted: list[tuple[int, ...]]) -> None:
        members = self.group.members
        by_call: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(posted):
            by_call.setdefault(p, []).append(members[i])

        def said(call: tuple[int, ...], ranks: list[int]) -> str:
            n, kind, count, dtype = call
            return f"{ranks_text(ranks)}: {_COLLECTIVES[kind]} of {count} {_DTYPES[dtype]} (its call {n} on the group)"

        raise UsageError(f"group {self.group.name!r}: its members called different collectives: "
                         f"{'; '.join(said(c, r) for c, r in by_call.items())}. Every member must make the same "
                         "collective calls (kind, count, dtype) in the same order; with NCCL this hangs or reads and "
                         "writes past the buffers")

    def _check_ranges(self, what: str, count: int, dtype: str, send: tuple[int, int], recv: tuple[int, int]) -> None:
        for (ptr, nbytes), side in ((send, "send"), (recv, "receive")):
            if nbytes > 0 and _NO_MEMORY_BELOW <= ptr < 2**64 < ptr + nbytes:
                raise UsageError(f"{what} of {count} {dtype} over group {self.group.name!r}: its {side} range of "
                                 f"{nbytes} B at {ptr:#x} runs past the end of the address space (2**64): pass a count "
                                 "that fits the memory")
            if nbytes > 0 and not _NO_MEMORY_BELOW <= ptr < 2**64:
                raise UsageError(f"{what} over group {self.group.name!r}: its {side} address {ptr} is no memory (below "
                                 f"{_NO_MEMORY_BELOW} nothing is ever mapped; addresses are < 2**64); pass a buffer's "
                                 "address (rank.buffer(name).ptr), a view, or a tensor or array over tray memory")
            check_range(ptr, nbytes, f"{what} of {count} {dtype} over group {self.group.name!r}: its {side} range")
            if in_region(ptr, nbytes):
                continue
            # the program's own memory, or memory it may not touch, or none at all
            fault = access_fault(ptr, nbytes, write=side == "receive")
            if fault is not None:
                raise UsageError(f"{what} of {count} {dtype} over group {self.group.name!r}: its {side} range of "
                                 f"{nbytes} B at {ptr:#x} {fault}; pass a buffer's address (rank.buffer(name).ptr), a "
                                 "view, or a tensor or array this rank holds")

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
        with self._alone("allreduce"):
            count = _count("allreduce", count)
            nbytes = count * numpy_dtype(dtype).itemsize
            self._begin("allreduce", count, dtype, (send_ptr, nbytes), (recv_ptr, nbytes))
            result = self._reduce(0, count, dtype)
            self._sync("allreduce")  # nobody restages scratch until every member has read it
            self._typed(recv_ptr, count, dtype)[:] = result

    def allgather(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                  stream: int | None = None) -> None:
        with self._alone("allgather"):
            count = _count("allgather", count)
            nbytes = count * numpy_dtype(dtype).itemsize
            self._begin("allgather", count, dtype, (send_ptr, nbytes), (recv_ptr, nbytes * self.group.size))
            recv = self._typed(recv_ptr, count * self.group.size, dtype)
            for i in range(self.group.size):
                recv[i * count:(i + 1) * count] = self._peer(i, 0, count, dtype)
            self._sync("allgather")

    def reducescatter(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                      stream: int | None = None) -> None:
        with self._alone("reducescatter"):
            count = _count("reducescatter", count)
            chunk = count * numpy_dtype(dtype).itemsize
            self._begin("reducescatter", count, dtype, (send_ptr, chunk * self.group.size), (recv_ptr, chunk))
            result = self._reduce(self.group.index * chunk, count, dtype)
            self._sync("reducescatter")
            self._typed(recv_ptr, count, dtype)[:] = result

    def alltoall(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                 stream: int | None = None) -> None:
        with self._alone("alltoall"):
            count = _count("alltoall", count)
            chunk = count * numpy_dtype(dtype).itemsize
            nbytes = chunk * self.group.size
            self._begin("alltoall", count, dtype, (send_ptr, nbytes), (recv_ptr, nbytes))
            recv = self._typed(recv_ptr, count * self.group.size, dtype)
            for i in range(self.group.size):
                recv[i * count:(i + 1) * count] = self._peer(i, self.group.index * chunk, count, dtype)
            self._sync("alltoall")

    def sendrecv(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, peer_index: int,
                 stream: int | None = None) -> None:
        """See _sendrecv."""
        with self._alone("sendrecv"):
            self._sendrecv(send_ptr, recv_ptr, count, dtype, peer_index)

    def _sendrecv(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, peer_index: int) -> None:
        """Exchange with one peer; the other members take no part. Round k with the peer: stage, post the bytes
        sent and "sent" k, wait for the peer's "sent" k, check the two sizes agree, copy its rows, post "read" k,
        wait for the peer's "read" k (so neither restages its scratch while the other still reads it)."""
        count = _count("sendrecv", count)
        nbytes = count * numpy_dtype(dtype).itemsize
        me, peer = self.group.index, peer_index
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise UsageError(f"group {self.group.name!r}: sendrecv's peer_index is a member index (an int), got "
                             f"{type(peer).__name__} {repr(peer)[:60]}")
        if not 0 <= peer < self.group.size:
            raise UsageError(f"group {self.group.name!r}: sendrecv with member {peer}; the group has members "
                             f"0..{self.group.size - 1}")
        self._check_ranges("sendrecv", count, dtype, (send_ptr, nbytes), (recv_ptr, nbytes))
        if peer == me:
            view(recv_ptr, nbytes)[:] = view(send_ptr, nbytes)
            return
        self._rounds[peer] += 1
        k = self._rounds[peer]
        self._stage_only(send_ptr, nbytes)
        self._sends[me][peer] = count * len(_DTYPES) + _DTYPES.index(dtype)  # the call: its count and dtype
        self._post(self._sent, peer, k)
        self._await(self._sent, peer, k, "staged its rows")
        theirs = int(self._sends[peer][me])
        if theirs != int(self._sends[me][peer]):
            said = {self.group.members[me]: f"{count} {dtype}",
                    self.group.members[peer]: f"{theirs // len(_DTYPES)} {_DTYPES[theirs % len(_DTYPES)]}"}
            (a, sa), (b, sb) = sorted(said.items())
            raise UsageError(f"group {self.group.name!r}: sendrecv round {k} between rank {a} and rank {b}: rank {a} "
                             f"sends {sa}, rank {b} {sb}; both must send the same count and dtype")
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
            n, kind, count, dtype = (int(w) for w in self._calls[peer])
            if n > self._ncalls:  # the peer is in a group collective this member never called: it waits there
                raise UsageError(f"group {self.group.name!r}: rank {members[me]} called sendrecv with rank "
                                 f"{members[peer]}, which called {_COLLECTIVES[kind]} of {count} {_DTYPES[dtype]} "
                                 f"(its call {n} on the group): every member must make the same collective calls "
                                 "in the same order")
            raise BarrierTimeout(f"{self.group.name} (in sendrecv with rank {members[peer]}: it never {what})", k,
                                 members[me], [members[peer]], waited)

    def close(self) -> None:
        self._barrier.close()
        self._sent = self._read = self._sends = self._calls = []


# NOTE: the first page of the address space is never mapped (Linux: vm.mmap_min_addr >= 4096): an address below it (0,
# a count or an index passed for an address, a negative int) is refused rather than read, which would kill the process
_NO_MEMORY_BELOW = 4096


def _count(what: str, count: object) -> int:
    """A collective's `count`: an int >= 0 (a numpy integer is the int it holds); UsageError otherwise."""
    if type(count) is not int:
        try:
            count = int_index(count)
        except TypeError:
            raise UsageError(f"{what}: count is a number of elements (an int >= 0), got {type(count).__name__} "
                             f"{repr(count)[:60]}") from None
    if count < 0:  # type: ignore[operator]
        raise UsageError(f"{what}: count is a number of elements (an int >= 0), got {count}")
    return count  # type: ignore[return-value]
