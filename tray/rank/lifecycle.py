"""A rank's start-up: the eight steps of docs/design.md section 2, each timed, ending in a frozen `Wiring`.

    manifest -> device -> allocate -> offer -> table -> import_peers -> join -> ready (the head's go)

`start()` unwinds what it built when a step fails; `Parts` keeps the phase the rank was in and the
client, so the caller can report the failure to the head first.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tray import collectives
from tray.backend import open_backend
from tray.backend.base import Backend, Barrier, Collectives, ExportedHandle, GroupInfo
from tray.errors import DeviceError, HandshakeError
from tray.handshake import STACK_DUMP_SIGNAL_OFFSET, raise_fd_soft_limit, wire
from tray.handshake.client import RendezvousClient
from tray.handshake.fdpass import FdServer, fetch_fds
from tray.handshake.steps import node_leaders, node_parts, spans_nodes
from tray.manifest import Manifest, builtin_manifest, load_manifest
from tray.manifest.builtin import BUILTIN_PATH
from tray.manifest.names import resolve_manifest
from tray.rank.wiring import (
    FLAGS_PREFIX,
    GROUP_BUFFER_PREFIX,
    INTERNAL_PREFIX,
    LEADERS_PREFIX,
    SPAN_BUFFER_PREFIX,
    SPAN_FLAGS_PREFIX,
    LazyCollectives,
    Parts,
    PeerTable,
    Wiring,
)
from tray.text import path_text

# The timings the Ready message carries (the head prints them per phase).
READY_TIMINGS = ("offer", "table", "import_peers", "join")
# NOTE: descriptors a rank holds besides buffers' (the interpreter, zmq's sockets and pipes, the program's files)
_FDS_BASE = 256


def boot_id() -> str:
    """This host's boot id (the offers of one host share it); the node name where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return os.uname().nodename


def register_stack_dump() -> bool:
    """Make STACK_DUMP_SIGNAL write every thread's Python stack to stderr (faulthandler); left alone when the
    program handles or ignores that signal itself. Returns whether it registered."""
    import faulthandler
    import signal

    from tray.stdfds import fill_closed_std_fds

    fill_closed_std_fds()  # tray.init() did it first; again for a rank started otherwise
    sig = signal.SIGRTMIN + STACK_DUMP_SIGNAL_OFFSET
    if signal.getsignal(sig) != signal.SIG_DFL:
        return False
    for where in (sys.stderr, 2):  # the stream, or its descriptor when the program replaced it by one without
        try:
            faulthandler.register(sig, file=where, all_threads=True)
            if not faulthandler.is_enabled():  # and a rank that crashes (SIGSEGV, SIGBUS, ...) shows where
                faulthandler.enable(file=where, all_threads=True)
            return True
        except (AttributeError, OSError, RuntimeError, ValueError):
            continue
    signal.signal(sig, signal.SIG_IGN)  # the head's signal must never end the rank (a real-time signal's default)
    return False


def start(parts: Parts, manifest_path: str | None, timeout_s: float, warmup: Any = None) -> Wiring:
    """Run the eight steps into `parts`; the wiring once the head said go. `warmup` (a started
    DriverWarmup or None) is released once the backend is open, whatever happens. `parts.early` (an
    EarlyJoin started with the rank, or None) goes to the collectives.

    Every wait on the head lasts at most `timeout_s`. Raises what a step raised (HandshakeError,
    ManifestError, DeviceError, ...); `parts` then holds what was built, for the caller to report the
    failure and `close()` it.
    """
    env, phases = parts.env, parts.phases
    if env.t_spawn is not None:
        phases.timings["import"] = time.time() - env.t_spawn
    register_stack_dump()  # before the head can see this rank: it signals only ranks that reached it
    client = parts.client = RendezvousClient(env.endpoint, env.token, env.rank, env.world_size)
    phases.sink = client

    with phases.timed("manifest"):
        # a file, or a built-in's name (`tray.init(manifest="peer_fill")`), as `tray launch --manifest` takes it
        program = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else None
        manifest = parts.manifest = load_manifest(resolve_manifest(manifest_path, program)) if manifest_path \
            else builtin_manifest()
        resolved = parts.resolved = manifest.resolve(env.world_size, dict(env.vars), env.local_world_size or None)
    with phases.timed("device"):
        host = boot_id()
        try:
            backend = parts.backend = open_backend(env.backend, env.device, host)
        finally:
            if warmup is not None:
                warmup.release(timeout_s)
                if warmup.seconds is not None:
                    phases.timings["driver_warmup"] = warmup.seconds
    joiner = collectives.for_backend(backend)
    with phases.timed("allocate"):
        groups = parts.groups = _my_groups(parts)
        _allocate(parts, backend, joiner, groups)
        # the collectives join on first use (LazyCollectives): their join info travels then, not here
        join_info = {g.name: b"" for g in groups.values() if g.index == 0}
        join_info.update(_leaders_join_info(parts, joiner))
    if parts.early is not None:
        parts.early.begin()  # the NCCL join runs from here, beside the offer, table, peers and go (early.py)
    with phases.timed("offer"):
        offer = _offer(parts, backend, host, join_info)
    client.send(offer)
    with phases.timed("table"):
        table = client.receive(wire.Table, timeout_s, "table")
    assert parts.fd_server is not None
    # fds only to ranks of this node: two nodes of a job on one machine never pass fds
    local = env.local_world_size or env.world_size
    parts.fd_server.allow(o.pid for o in table.offers if o.rank // local == env.rank // local)
    with phases.timed("import_peers"):
        _import_peers(parts, backend, table, timeout_s)
    with phases.timed("join"):
        _join(parts, backend, joiner, table, timeout_s)
    with phases.timed("ready"):
        client.send(wire.Ready(token=env.token, rank=env.rank,
                               timings={k: v for k, v in phases.timings.items() if k in READY_TIMINGS}))
        client.receive(wire.Go, timeout_s, "go")
    phases.enter("running")
    assert parts.fd_server is not None and parts.buffers is not None and parts.ptr_tables is not None
    assert parts.peer_tables is not None and parts.barriers is not None and parts.collectives is not None
    return Wiring(env=env, phases=phases, client=client, manifest=manifest, resolved=resolved, backend=backend,
                  fd_server=parts.fd_server, groups=groups, buffers=parts.buffers, ptr_tables=parts.ptr_tables,
                  peer_tables=parts.peer_tables, barriers=parts.barriers, collectives=parts.collectives,
                  mappings=parts.mappings or {},
                  spanning=frozenset(parts.spanning))


def _my_groups(parts: Parts) -> dict[str, GroupInfo]:
    assert parts.resolved is not None
    rank = parts.env.rank
    out = {}
    for name in parts.resolved.groups:
        members = parts.resolved.group_of(name, rank)
        if members is not None:
            out[name] = GroupInfo(name=name, members=tuple(members), index=members.index(rank))
    return out


def _allocate(parts: Parts, backend: Backend, joiner: collectives.Joiner, groups: dict[str, GroupInfo]) -> None:
    """Every manifest buffer, then per group within this node its barrier flags and the collectives'
    buffer (if any); a group that spans nodes has neither (its steps are relayed through the root)."""
    assert parts.resolved is not None
    local = parts.env.local_world_size or parts.env.world_size
    parts.spanning = {g.name for g in groups.values() if spans_nodes(g.members, local)}
    buffers = parts.buffers = {}
    largest = max((b.nbytes for b in parts.resolved.buffers), default=0)
    # a host buffer holds its memfd open for the rank's life, exported or not: room for them before the first
    raise_fd_soft_limit(_FDS_BASE + 2 * len(parts.resolved.buffers))
    for b in parts.resolved.buffers:
        buffers[b.name] = backend.allocate(b.name, b.nbytes, b.export)
    for g in groups.values():
        if g.name in parts.spanning:
            _allocate_spanning(parts, backend, g, local)
            continue
        # Flags are zeroed before the offer goes out: no peer writes into memory zeroed later.
        buffers[FLAGS_PREFIX + g.name] = backend.allocate(FLAGS_PREFIX + g.name, 8 * g.size, True)
        nbytes = joiner.buffer_nbytes(g, largest)
        if nbytes:
            buffers[GROUP_BUFFER_PREFIX + g.name] = backend.allocate(GROUP_BUFFER_PREFIX + g.name, nbytes, True)


def _allocate_spanning(parts: Parts, backend: Backend, g: GroupInfo, local_world_size: int) -> None:
    """A spanning group's node-local part: the flags of its local barrier and its span buffer, both sized
    for the whole group so that every rank exports the same bytes (the table checks)."""
    from tray.collectives.span import span_nbytes

    assert parts.buffers is not None
    mine = next(p for p in node_parts(g.members, local_world_size) if parts.env.rank in p)
    parts.span_local[g.name] = GroupInfo(name=g.name, members=mine, index=mine.index(parts.env.rank))
    for name, nbytes in ((SPAN_FLAGS_PREFIX + g.name, 8 * g.size), (SPAN_BUFFER_PREFIX + g.name, span_nbytes(g.size))):
        parts.buffers[name] = backend.allocate(name, nbytes, True)


def _leaders_join_info(parts: Parts, joiner: collectives.Joiner) -> dict[str, bytes]:
    """For each spanning group this rank leads (its member 0), the join info of the group's node leaders
    (an NCCL id), where the joiner crosses nodes; none where it cannot make one (NCCL missing): then the
    group's barrier is relayed through the root on every member (the table tells them)."""
    if not joiner.crosses_nodes or parts.groups is None:
        return {}
    local = parts.env.local_world_size or parts.env.world_size
    out = {}
    for name in sorted(parts.spanning):
        g = parts.groups[name]
        if g.index != 0:
            continue
        leaders = node_leaders(g.members, local)
        try:
            out[LEADERS_PREFIX + name] = joiner.join_info(GroupInfo(LEADERS_PREFIX + name, leaders, 0))
        except DeviceError as exc:
            print(f"tray: rank {parts.env.rank}: barrier over {name!r} relayed through the root: {exc}",
                  file=sys.stderr, flush=True)
    return out


def _exported(parts: Parts) -> list[str]:
    """The names of the buffers this rank exports: the exported manifest buffers and the tray's own. Those
    of a group that spans nodes are mapped within this node only (peer mappings stay within a node): their
    node tables serve launches that stage the other nodes' members (tray/rank/executor.py)."""
    assert parts.resolved is not None and parts.buffers is not None
    export = {b.name for b in parts.resolved.buffers if b.export}
    return [n for n in parts.buffers if (n.startswith(INTERNAL_PREFIX) or n in export)
            and _mapping_group(parts, n) is not None]


def _group_of_buffer(parts: Parts, name: str) -> str:
    assert parts.resolved is not None
    for prefix in (FLAGS_PREFIX, GROUP_BUFFER_PREFIX, SPAN_FLAGS_PREFIX, SPAN_BUFFER_PREFIX):
        if name.startswith(prefix):
            return name[len(prefix):]
    return parts.resolved.buffer(name).group


def _mapping_group(parts: Parts, name: str) -> GroupInfo | None:
    """The members that map buffer `name`: its group, or the node's part of a group that spans nodes
    (None for groups this rank is not in)."""
    assert parts.groups is not None
    group = _group_of_buffer(parts, name)
    if name.startswith((SPAN_FLAGS_PREFIX, SPAN_BUFFER_PREFIX)) or group in parts.spanning:
        return parts.span_local.get(group)
    return parts.groups.get(group)


def _offer(parts: Parts, backend: Backend, host: str, join_info: dict[str, bytes]) -> wire.Offer:
    env = parts.env
    assert parts.buffers is not None and parts.manifest is not None
    handles = {n: parts.buffers[n].handle() for n in _exported(parts)}
    fd_path = os.path.join(env.job_dir, f"rank-{env.rank}.fds")
    parts.fd_server = FdServer(fd_path, env.token, env.rank,
                               {n: h.fd for n, h in handles.items() if h.fd is not None})
    info = backend.info
    return wire.Offer(
        token=env.token, rank=env.rank, world_size=env.world_size, host=host, pid=os.getpid(), uid=os.getuid(),
        device=wire.DeviceIdentity(ordinal=info.ordinal, uuid=info.uuid, pci_bus=info.pci_bus,
                                   numa_node=info.numa_node),
        backend=backend.name, manifest=parts.manifest.digest, fd_socket=fd_path,
        buffers=tuple(wire.BufferOffer(name=n, nbytes=h.nbytes, handle=h.kind, fabric=h.fabric)
                      for n, h in sorted(handles.items())),
        groups=join_info, timings=dict(parts.phases.timings), manifest_path=_manifest_path(parts.manifest),
    )


def _manifest_path(manifest: Manifest) -> str:
    """Where the rank's manifest came from, absolute; "" for the built-in default (not a file). The wire carries
    UTF-8 text: a path's other bytes go as \\xNN (it still names the file to a reader)."""
    if manifest.path == BUILTIN_PATH:
        return ""
    return path_text(os.path.abspath(manifest.path))


def _import_peers(parts: Parts, backend: Backend, table: wire.Table, timeout_s: float) -> None:
    """Map every group member's exported buffers; one peer table per exported buffer."""
    env = parts.env
    assert parts.buffers is not None and parts.groups is not None
    exported = _exported(parts)
    # its own exported fds stay open (its fd socket serves them), and a peer's are open while they are mapped; short
    # of it, a reply that could not carry its fds says so (fetch_fds)
    raise_fd_soft_limit(_FDS_BASE + 2 * len(exported))
    wanted: dict[int, list[str]] = {}
    for name in exported:
        g = _mapping_group(parts, name)
        for peer in (g.members if g else ()):
            if peer != env.rank:
                wanted.setdefault(peer, []).append(name)
    mapped: dict[tuple[int, str], int] = {}
    mappings = parts.mappings = {}  # (peer, buffer) -> its PeerMapping here (views hold them past close)
    for peer, names in sorted(wanted.items()):
        offer = table.offer(peer)
        kinds = {b.name: b for b in offer.buffers}
        need_fds = [n for n in names if kinds[n].handle != "fabric"]
        fds = fetch_fds(offer.fd_socket, env.token, need_fds, f"rank {peer}", timeout_s) if need_fds else {}
        try:
            for n in names:
                b = kinds[n]
                handle = ExportedHandle(kind=b.handle, nbytes=b.nbytes, fd=fds.pop(n, None), fabric=b.fabric)
                try:
                    mappings[(peer, n)] = backend.import_peer(handle)
                except HandshakeError as exc:
                    raise HandshakeError(f"rank {peer}'s buffer {n!r}: {exc}") from None
                mappings[(peer, n)].holds(parts.buffers[n].nbytes, f"rank {peer}'s buffer {n!r} as mapped here")
                mapped[(peer, n)] = mappings[(peer, n)].ptr
        finally:
            for fd in fds.values():
                os.close(fd)
    ptr_tables = parts.ptr_tables = {}
    peer_tables = parts.peer_tables = {}
    for name in exported:
        g = _mapping_group(parts, name)
        if g is None:
            continue
        ptrs = [parts.buffers[name].ptr if m == env.rank else mapped.get((m, name), 0) for m in g.members]
        holes = [m for m, p in zip(g.members, ptrs) if not p]
        if holes:
            raise HandshakeError(f"peer table of {name!r} has holes for ranks {holes}")
        ptr_tables[name] = backend.ptr_table(ptrs)
        peer_tables[name] = PeerTable(name, g, tuple(ptrs), ptr_tables[name].ptr)


def _join(parts: Parts, backend: Backend, joiner: collectives.Joiner, table: wire.Table, timeout_s: float) -> None:
    """Every group's barrier; its collectives are set up to join on first use (LazyCollectives). The node
    leaders of spanning groups join their cross-node collectives now, all in one call (their barrier
    needs them from the first launch, which may be inside a capture)."""
    assert parts.buffers is not None and parts.groups is not None and parts.ptr_tables is not None
    barriers = parts.barriers = {}
    relayed: dict[str, Collectives] = {}
    joins = []
    pending: list[_SpanPending] = []
    for g in parts.groups.values():
        if g.name in parts.spanning:
            _join_spanning(parts, backend, joiner, table, g, joins, relayed, pending)
            continue
        barriers[g.name] = backend.barrier(g, parts.buffers[FLAGS_PREFIX + g.name],
                                           parts.ptr_tables[FLAGS_PREFIX + g.name])
        joins.append(collectives.GroupJoin(
            group=g, join_info=b"", barrier=barriers[g.name],
            buffer=parts.buffers.get(GROUP_BUFFER_PREFIX + g.name),
            peer_buffers=parts.ptr_tables.get(GROUP_BUFFER_PREFIX + g.name), wait_s=_barrier_wait_s(parts)))
    parts.collectives = LazyCollectives(joiner, joins, parts.phases, ready=relayed, early=parts.early,
                                        timeout_s=timeout_s)
    if pending:
        _join_leaders(parts, backend, joiner, pending)


def _barrier_wait_s(parts: Parts) -> float:
    """The rank's barrier timeout (RankEnv.barrier_wait_s), which collectives that wait on their members use."""
    return parts.env.barrier_wait_s(parts.manifest.barrier_timeout_s if parts.manifest is not None else None)


def _join_spanning(parts: Parts, backend: Backend, joiner: collectives.Joiner, table: wire.Table, g: GroupInfo,
                   joins: list[collectives.GroupJoin], relayed: dict[str, Collectives],
                   pending: list[_SpanPending]) -> None:
    """A group with members on other nodes: its barrier is hierarchical (tray/collectives/span.py) where the
    host backend relays the leaders' step or the group's member 0 offered the leaders' join info (NCCL), and
    relayed through the root otherwise; its collectives joined (on first use, like every group's) where the
    joiner crosses nodes (NCCL), relayed otherwise (host: ready at once)."""
    from tray.collectives.relay import RelayBarrier, RelayCollectives, VoteStep
    from tray.collectives.span import HostSpanBarrier

    assert parts.barriers is not None and parts.client is not None and parts.ptr_tables is not None
    assert parts.buffers is not None
    step = VoteStep(parts.client, parts.env.token, parts.env.rank)

    def capturing(stream: int | None) -> bool:
        handle = backend.cuda_stream if stream is None else stream
        return handle is not None and backend.is_capturing(handle)

    relay = RelayBarrier(g, step, before=backend.synchronize, capturing=capturing)
    parts.barriers[g.name] = relay
    if joiner.crosses_nodes:
        joins.append(collectives.GroupJoin(group=g, join_info=b"", barrier=relay, wait_s=_barrier_wait_s(parts)))
    else:
        relayed[g.name] = RelayCollectives(g, step, _barrier_wait_s(parts))
    local_group = parts.span_local[g.name]
    local = backend.barrier(local_group, parts.buffers[SPAN_FLAGS_PREFIX + g.name],
                            parts.ptr_tables[SPAN_FLAGS_PREFIX + g.name])
    span = parts.buffers[SPAN_BUFFER_PREFIX + g.name]
    leader_span_ptr = parts.ptr_tables[SPAN_BUFFER_PREFIX + g.name].ptrs[0]
    node_of = parts.env.local_world_size or parts.env.world_size
    node_members = node_parts(g.members, node_of)
    if not joiner.crosses_nodes:
        parts.barriers[g.name] = HostSpanBarrier(g, local_group, local, node_members, span, leader_span_ptr, step,
                                                 relayed=relay)
        return
    info = table.join_info(g.members[0], LEADERS_PREFIX + g.name)
    if not info:  # member 0 could not make the leaders' join info: relayed on every member
        local.close()
        return
    # the device barrier is made once the leaders joined (_join_leaders); until then the entry is `relay`
    leaders = node_leaders(g.members, node_of)
    me = parts.env.rank
    pending.append(_SpanPending(
        group=g, local=local, join_info=bytes(info),
        leaders=GroupInfo(LEADERS_PREFIX + g.name, leaders, leaders.index(me)) if me in leaders else None))


@dataclass(frozen=True)
class _SpanPending:
    """A spanning group whose device barrier waits for its leaders' collectives: `leaders` is the leaders'
    group when this rank leads its node (None otherwise), `join_info` member 0's offer for it."""

    group: GroupInfo
    local: Barrier
    join_info: bytes
    leaders: GroupInfo | None


def _join_leaders(parts: Parts, backend: Backend, joiner: collectives.Joiner, pending: list[_SpanPending]) -> None:
    """Join this rank's leaders' collectives at once (one NCCL group call), then make every spanning
    group's device barrier."""
    from tray.collectives.span import DeviceSpanBarrier

    assert parts.barriers is not None and parts.buffers is not None and parts.ptr_tables is not None
    joins = [collectives.GroupJoin(group=p.leaders, join_info=p.join_info, barrier=p.local)
             for p in pending if p.leaders is not None]
    joined = joiner.join(joins) if joins else {}
    node_of = parts.env.local_world_size or parts.env.world_size
    for p in pending:
        name = p.group.name
        parts.barriers[name] = DeviceSpanBarrier(
            p.group, parts.span_local[name], p.local, node_parts(p.group.members, node_of),
            parts.buffers[SPAN_BUFFER_PREFIX + name], parts.ptr_tables[SPAN_BUFFER_PREFIX + name].ptrs[0], backend,
            joined[p.leaders.name] if p.leaders is not None else None, int(p.local.err_ptr),
            relayed=parts.barriers[name])


__all__ = ["READY_TIMINGS", "boot_id", "start"]
