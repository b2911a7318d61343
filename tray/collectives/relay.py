"""A barrier and collectives over a group that spans nodes, relayed through the heads and the root.

Used where a group has no peer mappings (its members sit on different nodes) and no NCCL id (the
host backend). Each call is one group step at the root: every member's contribution goes up, one
decision with all of them comes back, in member order, so every member computes the same bytes. The
root bounds the step by the caller's timeout and names the members that never arrived.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tray.backend.base import DEFAULT_BARRIER_TIMEOUT_S, Barrier, Collectives, GroupInfo, numpy_dtype
from tray.backend.host import view
from tray.errors import BarrierTimeout, UsageError
from tray.handshake import wire
from tray.handshake.steps import group_topic, pair_step
from tray.handshake.wire import MAX_MESSAGE_NBYTES
from tray.twins import check_range

# NOTE: the rank waits this much longer than the step's timeout, so that the root's verdict (which
# names who is missing) arrives before the rank gives up on its own.
VERDICT_MARGIN_S = 5.0
# NOTE: a decision carries every member's bytes in one control message (1 MiB, more only in a job of over 256
# ranks: wire.job_message_limit); kept within 1 MiB whatever the job, with room for the envelope.
RELAY_NBYTES = MAX_MESSAGE_NBYTES - 16 * 1024

# step(topic, value, wait_s) -> every member's value, in member order (None: never arrived)
Step = Callable[[str, Any, float], list[Any]]


class VoteStep:
    """A Step over the rank's connection to its head: one Vote per call, rounds counted per topic, the
    matching Decision returned (the head answers through the root in a job of several trays).
    HandshakeError after `wait_s` without an answer, naming the step."""

    def __init__(self, client: Any, token: str, rank: int) -> None:
        self._client = client
        self._token = token
        self._rank = rank
        # NOTE: every topic kept for the tray's life: they are the manifest's, not the program's (a barrier and a gather
        # step per spanning group instance, a sendrecv step per pair of its members), and the root answers a late vote
        # of a group step it gave up by (topic, round): a round number never reused
        self._rounds: dict[str, int] = {}

    def __call__(self, topic: str, value: Any, wait_s: float) -> list[Any]:
        wait_s = wire.step_wait(wait_s, f"step {topic!r}")
        with self._client.step("step", topic):
            rnd = self._rounds.get(topic, 0) + 1
            self._rounds[topic] = rnd
            self._client.send(wire.Vote(token=self._token, rank=self._rank, topic=topic, round=rnd, value=value,
                                        wait_s=wait_s))
            since = time.monotonic()  # one deadline: a stale decision skipped does not restart the wait
            while True:
                d = self._client.receive(wire.Decision, wait_s, f"decision on {topic!r}", since)
                if d.topic == topic and d.round == rnd:
                    return list(d.values)


class RelayBarrier(Barrier):
    """A barrier over a spanning group; `before` runs first (the device's stream synchronised).
    `capturing(stream)` says whether the stream (None: the rank's) is being captured: a relayed barrier is
    host work, so it refuses to be captured (UsageError) instead of breaking the capture."""

    path = "relayed"

    def __init__(self, group: GroupInfo, step: Step, before: Callable[[], None] = lambda: None,
                 capturing: Callable[[int | None], bool] = lambda stream: False) -> None:
        self.group = group
        self.epoch = 0
        self._step = step
        self._before = before
        self._capturing = capturing
        self._topic = group_topic(group.name, group.members, "barrier")
        self._broken: BarrierTimeout | None = None

    def launch(self, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S, stream: int | None = None) -> None:
        if self._broken is not None:
            raise self._broken.again()
        if self._capturing(stream):
            raise UsageError(f"barrier over group {self.group.name!r}: the group spans nodes and its barrier is "
                             "relayed through the job's root (no NCCL among the node leaders), which is host work "
                             "and cannot be captured into a graph: barrier outside the capture, drop \"graph\" "
                             "from the program, or make NCCL available on every node (nccl4py)")
        self.epoch += 1
        self._before()
        values = self._step(self._topic, {"timeout_s": float(timeout_s)}, timeout_s + VERDICT_MARGIN_S)
        missing = [m for m, v in zip(self.group.members, values) if v is None]
        if missing:
            self._broken = BarrierTimeout(self.group.name, self.epoch, self.group.members[self.group.index], missing,
                                          timeout_s)
            raise self._broken

    def check(self) -> None:
        if self._broken is not None:
            raise self._broken.again()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


class RelayCollectives(Collectives):
    """Collectives over a spanning group on the host backend: one relayed gather per call, then each
    member combines in member order (so all get the same bytes). At most RELAY_NBYTES per call in all."""

    def __init__(self, group: GroupInfo, step: Step, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S) -> None:
        self.group = group
        self._step = step
        self._timeout_s = timeout_s
        self._topic = group_topic(group.name, group.members, "gather")

    def _gather(self, what: str, count: int, dtype: str, send: tuple[int, int], recv: tuple[int, int],
                topic: str | None = None, voters: Sequence[int] | None = None) -> list[bytes]:
        """Every voter's send bytes (the group's members, or `voters` of `topic`), in voter order, after checking
        this member's ranges and, once gathered, that every voter made the same call (kind, count, dtype)."""
        members = self.group.members if voters is None else voters
        send_ptr, nbytes = send
        if nbytes * len(members) > RELAY_NBYTES:
            total = nbytes * len(members)
            raise UsageError(f"group {self.group.name!r} spans nodes: a relayed collective carries at most "
                             f"{RELAY_NBYTES} B for all {len(members)} members, this one {total} B; split the "
                             "call, or use a group within one node")
        for (ptr, n), side in ((send, "send"), (recv, "receive")):
            check_range(ptr, n, f"{what} of {count} {dtype} over group {self.group.name!r}: its {side} range")
        data = view(send_ptr, nbytes).tobytes()
        call = [what, count, dtype]
        values = self._step(topic or self._topic, {"timeout_s": self._timeout_s, "data": data, "call": call},
                            self._timeout_s + VERDICT_MARGIN_S)
        missing = [m for m, v in zip(members, values) if v is None]
        if missing:
            me = self.group.members[self.group.index]
            raise BarrierTimeout(f"{self.group.name} (in {what})", 0, me, missing, self._timeout_s)
        calls = [tuple(v.get("call") or ()) for v in values]
        if any(c != calls[0] for c in calls):
            said = "; ".join(f"rank {m}: {c[0]} of {c[1]} {c[2]}" if len(c) == 3 else f"rank {m}: ?"
                             for m, c in zip(members, calls))
            raise UsageError(f"group {self.group.name!r}: its members called different collectives: {said}. Every "
                             "member must make the same collective calls (kind, count, dtype) in the same order")
        return [v["data"] for v in values]

    def _typed(self, raw: bytes, dtype: str) -> np.ndarray:
        return np.frombuffer(raw, dtype=numpy_dtype(dtype))

    def _out(self, recv_ptr: int, result: np.ndarray) -> None:
        view(recv_ptr, result.nbytes)[:] = result.view(np.uint8).reshape(-1)

    def _sum(self, parts: list[bytes], dtype: str) -> np.ndarray:
        acc = self._typed(parts[0], dtype).copy()
        for raw in parts[1:]:
            acc += self._typed(raw, dtype)
        return acc

    def allreduce(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                  stream: int | None = None) -> None:
        nbytes = count * numpy_dtype(dtype).itemsize
        parts = self._gather("allreduce", count, dtype, (send_ptr, nbytes), (recv_ptr, nbytes))
        self._out(recv_ptr, self._sum(parts, dtype))

    def allgather(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                  stream: int | None = None) -> None:
        nbytes = count * numpy_dtype(dtype).itemsize
        parts = self._gather("allgather", count, dtype, (send_ptr, nbytes), (recv_ptr, nbytes * self.group.size))
        self._out(recv_ptr, np.concatenate([self._typed(p, dtype) for p in parts]))

    def reducescatter(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                      stream: int | None = None) -> None:
        chunk = count * numpy_dtype(dtype).itemsize
        parts = self._gather("reducescatter", count, dtype, (send_ptr, chunk * self.group.size), (recv_ptr, chunk))
        me = self.group.index
        self._out(recv_ptr, self._sum(parts, dtype)[me * count:(me + 1) * count])

    def alltoall(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                 stream: int | None = None) -> None:
        chunk = count * numpy_dtype(dtype).itemsize
        parts = self._gather("alltoall", count, dtype, (send_ptr, chunk * self.group.size),
                             (recv_ptr, chunk * self.group.size))
        me = self.group.index
        self._out(recv_ptr, np.concatenate([self._typed(p, dtype)[me * count:(me + 1) * count] for p in parts]))

    def alltoall_among(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, members: Sequence[int],
                       stream: int | None = None) -> None:
        # NOTE: every member of the group takes part in the relayed step (its voters are the instance), so
        # this rank's whole send buffer travels; only the listed members' blocks are written
        nbytes = count * numpy_dtype(dtype).itemsize
        parts = self._gather("alltoall", count, dtype, (send_ptr, nbytes * self.group.size),
                             (recv_ptr, nbytes * self.group.size))
        me = self.group.index
        for i in members:
            view(recv_ptr + i * nbytes, nbytes)[:] = np.frombuffer(parts[i], np.uint8)[me * nbytes:(me + 1) * nbytes]

    def sendrecv(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, peer_index: int,
                 stream: int | None = None) -> None:
        """A step of the pair alone (as with NCCL): its topic names the two members (steps.pair_step)."""
        nbytes = count * numpy_dtype(dtype).itemsize
        if not 0 <= peer_index < self.group.size:
            raise UsageError(f"group {self.group.name!r}: sendrecv with member {peer_index}; the group has members "
                             f"0..{self.group.size - 1}")
        me, peer = self.group.members[self.group.index], self.group.members[peer_index]
        if me == peer:
            for ptr, side in ((send_ptr, "send"), (recv_ptr, "receive")):
                check_range(ptr, nbytes, f"sendrecv of {count} {dtype} over group {self.group.name!r}: its {side} "
                                         "range")
            view(recv_ptr, nbytes)[:] = view(send_ptr, nbytes)
            return
        pair = (min(me, peer), max(me, peer))
        topic = group_topic(self.group.name, self.group.members, pair_step(*pair))
        parts = self._gather("sendrecv", count, dtype, (send_ptr, nbytes), (recv_ptr, nbytes), topic=topic,
                             voters=pair)
        self._out(recv_ptr, self._typed(parts[pair.index(peer)], dtype))

    def close(self) -> None:
        pass
