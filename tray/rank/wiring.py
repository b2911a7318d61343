"""What a rank's start-up built (`Wiring`, frozen), and the values its public face hands out."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tray.backend.base import Backend, Barrier, Collectives, DeviceBuffer, GroupInfo, PeerMapping, PtrTable
from tray.collectives.base import GroupJoin, Joiner
from tray.errors import DeviceError, UsageError
from tray.handshake.client import RendezvousClient
from tray.handshake.fdpass import FdServer
from tray.handshake.steps import JOIN_TOPIC
from tray.manifest import Manifest, ResolvedBuffer, ResolvedManifest
from tray.manifest.builtin import BUILTIN_PATH
from tray.manifest.expr import did_you_mean, known_list
from tray.rank.env import RankEnv
from tray.rank.phases import PhaseClock

if TYPE_CHECKING:
    from tray.collectives.early import EarlyJoin

# Buffers the tray itself allocates and exports per group (named "tray:<role>:<group>"); users never
# see them through `buffer()` or `peers()`.
INTERNAL_PREFIX = "tray:"
FLAGS_PREFIX = "tray:barrier:"
GROUP_BUFFER_PREFIX = "tray:collectives:"
# a group that spans nodes (tray/collectives/span.py): the flags of its node-local barrier, the span buffer
# (error words gathered across nodes), both mapped within the node only; and the join info of its leaders
SPAN_FLAGS_PREFIX = "tray:span-barrier:"
SPAN_BUFFER_PREFIX = "tray:span:"
LEADERS_PREFIX = "tray:leaders:"


@dataclass(frozen=True)
class Buffer:
    """A manifest buffer on this rank: `ptr` is its device address (host: process address)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    ptr: int
    export: bool


@dataclass(frozen=True)
class PeerTable:
    """Every member's address of one buffer, in member order; `table_ptr` is the device `u64[G]`."""

    buffer: str
    group: GroupInfo
    ptrs: tuple[int, ...]
    table_ptr: int


# The topic of the tray-wide step that joins the collectives (every rank votes its groups' join info).
Exchange = Callable[[str, Any, float], list[Any]]


class LazyCollectives:
    """Every group's collectives of one rank, joined together on first use, not at start-up: a rank
    whose programs never reduce pays nothing for them (an NCCL join is ~0.5 s per rank).

    The join is a tray-wide step, like `exchange`: the first `of(group, exchange)` on any rank must be
    matched by one on every rank (a program with a collective op does this in lockstep; so does a first
    `rank.collectives()` called by every rank). Member 0 of each group makes the join info then and every
    rank receives it through `exchange`; the time lands in `phases.timings["collectives"]`.

    With an `early` join (tray/collectives/early.py: NCCL joined on a thread while the rank started), the
    first use takes its communicators instead, waiting only for what is left of it, and no tray-wide step is
    made. Where it joined other groups than this rank's manifest gives (every rank then sees the same
    mismatch: the ids come from the head), or the head made no ids, the join is lazy as above.
    """

    def __init__(self, joiner: Joiner, pending: Sequence[GroupJoin], phases: PhaseClock,
                 ready: Mapping[str, Collectives] | None = None, timeout_s: float = 60.0,
                 early: EarlyJoin | None = None) -> None:
        self._joiner = joiner
        self._pending = tuple(pending)
        self._phases = phases
        self._ready = dict(ready or {})  # groups whose collectives need no join (relayed across nodes)
        self._timeout_s = timeout_s
        self._joined: dict[str, Collectives] | None = None
        self._early = early

    @property
    def joined(self) -> bool:
        return self._joined is not None

    def of(self, group: str, exchange: Exchange) -> Collectives:
        """The collectives of `group` (a group of this rank), joining every group first if needed: also when this
        rank's groups are all relayed (ready), so every rank makes the same tray-wide step whatever its groups
        (a rank of a spanning instance and one of a node-local instance of one group, say)."""
        self.ensure_joined(exchange)
        assert self._joined is not None
        return self._ready[group] if group in self._ready else self._joined[group]

    def ensure_joined(self, exchange: Exchange) -> None:
        """Make the tray-wide join step if this rank has not yet: also a rank in no instance of the group whose
        collective op starts it, which takes part in nothing else of it."""
        if self._joined is None:
            self._join(exchange)

    def _join(self, exchange: Exchange) -> None:
        with self._phases.showing("collectives"):
            t0 = time.perf_counter()
            if self._early is not None and self._take_early():
                self._phases.timings["collectives"] = time.perf_counter() - t0
                return
            mine = {j.group.name: self._joiner.join_info(j.group) for j in self._pending if j.group.index == 0}
            votes = exchange(JOIN_TOPIC, mine, self._timeout_s)
            joins = []
            for j in self._pending:
                leader = votes[j.group.members[0]]
                info = leader.get(j.group.name, b"") if isinstance(leader, dict) else b""
                joins.append(replace(j, join_info=bytes(info)))
            self._joined = self._joiner.join(joins)
            self._phases.timings["collectives"] = time.perf_counter() - t0

    def _take_early(self) -> bool:
        """The early join's collectives as this rank's (True), or False when the head made no ids (the join
        is lazy then, on every rank alike)."""
        early = self._early
        assert early is not None
        groups = early.take(self._timeout_s)
        if early.seconds is not None:
            self._phases.timings["nccl_early"] = early.seconds
            self._phases.timings.update({f"nccl_early.{k}": v for k, v in early.steps.items()})
        if groups is None:
            return False
        try:
            differs = early.mismatch(j.group for j in self._pending)
            if differs:
                # NOTE: not a lazy join instead: a rank alone in the tray-wide step would wait for the others
                raise DeviceError(f"the NCCL groups joined at start-up are not this rank's: {differs} (every rank "
                                  "must load the manifest the head loaded)")
            self._joined = self._joiner.adopt(self._pending, groups)
        except BaseException:
            for group in groups.values():
                group.abort()
            early.release()
            raise
        return True

    def abort_early(self) -> None:
        """A start-up that failed after the collectives were made: abort what the early join finished without
        waiting for it or for members that may be gone (close() would wait for both)."""
        early, self._early = self._early, None
        if early is not None:
            _abort_early(early)

    def close(self) -> None:
        """Close every group's collectives at once, each on its own thread: an NCCL communicator's destroy
        takes ~0.5 s (measured on one H200) and is mostly waiting, so a rank of several groups waits for one
        destroy, not their sum; and no order of destroys is imposed across ranks. Raises the first failure
        once every close has returned (each is bounded: see NcclGroup.close)."""
        joined, self._joined = self._joined, {}
        ready, self._ready = self._ready, {}
        comms = [*(joined or {}).values(), *ready.values()]
        early, self._early = self._early, None
        if early is not None:
            comms += early.leftovers().values()
        try:
            self._close_all(comms)
        finally:
            if early is not None:
                early.release()

    @staticmethod
    def _close_all(comms: Sequence[Collectives]) -> None:
        failures: list[BaseException] = []

        def close_one(c: Collectives) -> None:
            try:
                c.close()
            except BaseException as exc:  # NOTE: re-raised below, on the closing thread
                failures.append(exc)

        threads = [threading.Thread(target=close_one, args=(c,), name=f"tray-close-{i}", daemon=True)
                   for i, c in enumerate(comms)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]


def _abort_early(early: EarlyJoin) -> None:
    """Stop an early join's thread if it has not begun, abort the communicators it finished, drop its context."""
    early.cancel()
    try:
        for group in early.leftovers(0.0).values():
            group.abort()
    finally:
        early.release()


def _release(collectives: LazyCollectives | None, barriers: Mapping[str, Barrier],
             ptr_tables: Mapping[str, PtrTable], fd_server: FdServer | None, backend: Backend | None,
             client: RendezvousClient | None, timings: dict[str, float] | None = None) -> None:
    """Dependents first: collectives and barriers use the tables, which use the backend's memory; the
    backend's graphs go before the collectives (NCCL's destroy waits for every graph that captured it).
    `timings` (when given) gets each step's seconds as "close.<step>". Every step runs even when one before
    it raises (a failed NCCL destroy must not leave the memory, the fd server or the socket behind); the first
    failure is raised once all have run."""
    steps: list[tuple[str, Callable[[], None]]] = []
    if backend is not None:
        steps.append(("graphs", backend.close_graphs))
    if collectives is not None:
        steps.append(("collectives", collectives.close))
    steps.append(("barriers", lambda: [b.close() for b in barriers.values()]))
    steps.append(("ptr_tables", lambda: [t.close() for t in ptr_tables.values()]))
    if fd_server is not None:
        steps.append(("fd_server", fd_server.close))
    if backend is not None:
        steps.append(("backend", backend.close))
    if client is not None:
        steps.append(("client", client.close))
    failures: list[BaseException] = []
    for name, step in steps:
        t0 = time.perf_counter()
        try:
            step()
        except BaseException as exc:  # NOTE: re-raised below, once every step has run
            failures.append(exc)
        if timings is not None:
            timings[f"close.{name}"] = time.perf_counter() - t0
    if failures:
        raise failures[0]


@dataclass
class Parts:
    """The resources of a rank's start-up as they are made; `close()` releases whatever exists, in
    reverse order, so a start-up that fails part way leaves nothing behind."""

    env: RankEnv
    phases: PhaseClock
    client: RendezvousClient | None = None
    manifest: Manifest | None = None
    resolved: ResolvedManifest | None = None
    backend: Backend | None = None
    fd_server: FdServer | None = None
    groups: dict[str, GroupInfo] | None = None
    buffers: dict[str, DeviceBuffer] | None = None
    ptr_tables: dict[str, PtrTable] | None = None
    peer_tables: dict[str, PeerTable] | None = None
    barriers: dict[str, Barrier] | None = None
    collectives: LazyCollectives | None = None
    mappings: dict[tuple[int, str], PeerMapping] | None = None
    # the NCCL join started with the rank (tray/collectives/early.py); the collectives own it once they exist
    early: EarlyJoin | None = None
    spanning: set[str] = field(default_factory=set)  # groups with members on other nodes
    # per spanning group: its members on this node (named as the group, in member order)
    span_local: dict[str, GroupInfo] = field(default_factory=dict)

    def close(self) -> None:
        # a start-up that failed: abort what the early join finished (no waiting on members that may be gone);
        # a join still running is left to the process's end
        if self.collectives is not None:
            self.collectives.abort_early()
        elif self.early is not None:
            _abort_early(self.early)
        self.early = None
        _release(self.collectives, self.barriers or {}, self.ptr_tables or {}, self.fd_server,
                 self.backend, self.client)


@dataclass(frozen=True)
class Wiring:
    """A rank after the eight steps of docs/design.md section 2: its manifest, device, buffers (manifest
    buffers and the tray's own per-group buffers), peer tables, barriers and joined collectives.

    The lookups raise UsageError naming what exists. `close()` releases everything, in reverse order.
    """

    env: RankEnv
    phases: PhaseClock
    client: RendezvousClient
    manifest: Manifest
    resolved: ResolvedManifest
    backend: Backend
    fd_server: FdServer
    groups: Mapping[str, GroupInfo]
    buffers: Mapping[str, DeviceBuffer]
    ptr_tables: Mapping[str, PtrTable]
    peer_tables: Mapping[str, PeerTable]
    barriers: Mapping[str, Barrier]
    collectives: LazyCollectives
    mappings: Mapping[tuple[int, str], PeerMapping] = field(default_factory=dict)  # (peer, buffer) -> mapping
    # groups with members on other nodes (a job of several trays): their buffers' peer tables hold this node's
    # members only (peers() refuses them; launches that stage the other nodes use them: rank/executor.py)
    spanning: frozenset[str] = frozenset()

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @functools.cached_property
    def _specs(self) -> dict[str, ResolvedBuffer]:
        return {b.name: b for b in self.resolved.buffers}

    def spec(self, name: str) -> ResolvedBuffer:
        """The resolved manifest buffer `name`."""
        if name not in self._specs:
            declared = [b for b in sorted(self._specs) if not b.startswith("tray:")]
            raise UsageError(f"no buffer {name!r} in {self.manifest_said()}; it declares "
                             f"{known_list(declared)}{did_you_mean(name, declared)}")
        return self._specs[name]

    def manifest_said(self) -> str:
        """The rank's manifest as a message names it: its name and file, or the built-in default and how to give
        one (the usual cause of a missing name)."""
        if self.manifest.path == BUILTIN_PATH:
            return ("the built-in default manifest (no --manifest given, no tray.init(manifest=...); tray launch "
                    "--manifest FILE.json gives the ranks yours)")
        return f"manifest {self.manifest.name!r} ({self.manifest.path})"

    def buffer(self, name: str) -> Buffer:
        """The manifest buffer `name` on this rank."""
        spec = self.spec(name)
        return Buffer(name, spec.dtype, tuple(spec.shape), spec.nbytes, self.buffers[name].ptr, spec.export)

    def peers(self, name: str) -> PeerTable:
        """Every member's address of exported buffer `name` (over the buffer's group)."""
        spec = self._specs.get(name)
        if spec is None and not name.startswith(INTERNAL_PREFIX):
            self.spec(name)  # raises: no such buffer in the rank's manifest, naming the manifest
        if spec is not None and spec.group in self.spanning:
            members = self.groups[spec.group].members
            raise UsageError(f"buffer {name!r} has no peer table: its group {spec.group!r} (ranks {members[0]}.."
                             f"{members[-1]}) spans nodes, and peer tables exist only within a node; use the group's "
                             "collectives, or give the buffer a group within one node")
        if name not in self.peer_tables or name.startswith(INTERNAL_PREFIX):
            exported = known_list(sorted(n for n in self.peer_tables if not n.startswith(INTERNAL_PREFIX)))
            why = ""  # the cause as the manifest has it: a table is an exported buffer's, on its group's members
            if spec is not None and not name.startswith(INTERNAL_PREFIX) and not spec.export:
                why = f" (buffer {name!r} is not exported: set \"export\": true on it in {self.manifest_said()})"
            elif spec is not None and not name.startswith(INTERNAL_PREFIX) and spec.group not in self.groups:
                why = (f" (buffer {name!r} is exported over group {spec.group!r}, whose instances "
                       f"{self._instances(spec.group)} leave out rank {self.rank})")
            raise UsageError(f"no peer table for {name!r}{why}; exported buffers with a group containing rank "
                             f"{self.rank}: {exported}")
        return self.peer_tables[name]

    def _instances(self, group: str) -> list[list[int]]:
        """The instances of `group` as the manifest writes them: [[0, 1], [2, 3]]."""
        return [list(m) for m in self.resolved.groups[group]]

    def group(self, name: str) -> GroupInfo:
        if name not in self.groups:
            if name in self.resolved.groups:
                raise UsageError(f"rank {self.rank} is no member of group {name!r} (its instances: "
                                 f"{self._instances(name)}); its groups: {known_list(sorted(self.groups))}")
            raise UsageError(f"no group {name!r} in {self.manifest_said()}; its groups: "
                             f"{known_list(sorted(self.resolved.groups))}{did_you_mean(name, self.resolved.groups)}")
        return self.groups[name]

    def barrier(self, group: str) -> Barrier:
        self.group(group)
        return self.barriers[group]

    def collectives_of(self, group: str, exchange: Exchange) -> Collectives:
        """The collectives of `group`; the first call joins every group (a tray-wide step: see
        LazyCollectives)."""
        self.group(group)
        return self.collectives.of(group, exchange)

    def close(self) -> None:
        _release(self.collectives, self.barriers, self.ptr_tables, self.fd_server, self.backend, self.client,
                 self.phases.timings)


@dataclass(frozen=True)
class RankContext:
    """What the executor, parking and weight loading use of a rank that is up: its wiring, its
    kernels (`kernel(name)`, compiled once), the tray-wide `exchange(topic, value, timeout_s)` and
    its phase clock. They never reach into `Rank`."""

    wiring: Wiring
    kernel: Callable[[str], Any]
    exchange: Callable[[str, Any, float], list[Any]]

    @property
    def rank(self) -> int:
        return self.wiring.rank

    @property
    def world_size(self) -> int:
        return self.wiring.world_size

    @property
    def backend(self) -> Backend:
        return self.wiring.backend

    @property
    def manifest(self) -> Manifest:
        return self.wiring.manifest

    @property
    def resolved(self) -> ResolvedManifest:
        return self.wiring.resolved

    @property
    def phases(self) -> PhaseClock:
        return self.wiring.phases
