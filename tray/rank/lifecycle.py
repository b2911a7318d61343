"""A rank's start-up: the eight steps of docs/design.md section 2, each timed, ending in a frozen `Wiring`.

    manifest -> device -> allocate -> offer -> table -> import_peers -> join -> ready (the head's go)

`start()` unwinds what it built when a step fails; `Parts` keeps the phase the rank was in and the
client, so the caller can report the failure to the head first.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tray import collectives
from tray.backend import open_backend
from tray.backend.base import Backend, Collectives, ExportedHandle, GroupInfo
from tray.errors import HandshakeError
from tray.handshake import wire
from tray.handshake.client import RendezvousClient
from tray.handshake.fdpass import FdServer, fetch_fds
from tray.handshake.steps import spans_nodes
from tray.manifest import builtin_manifest, load_manifest
from tray.rank.wiring import (
    FLAGS_PREFIX,
    GROUP_BUFFER_PREFIX,
    INTERNAL_PREFIX,
    LazyCollectives,
    Parts,
    PeerTable,
    Wiring,
)

# The timings the Ready message carries (the head prints them per phase).
READY_TIMINGS = ("offer", "table", "import_peers", "join")


def boot_id() -> str:
    """This host's boot id (the offers of one host share it); the node name where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return os.uname().nodename


def start(parts: Parts, manifest_path: str | None, timeout_s: float, warmup: Any = None) -> Wiring:
    """Run the eight steps into `parts`; the wiring once the head said go. `warmup` (a started
    DriverWarmup or None) is released once the backend is open, whatever happens.

    Every wait on the head lasts at most `timeout_s`. Raises what a step raised (HandshakeError,
    ManifestError, DeviceError, ...); `parts` then holds what was built, for the caller to report the
    failure and `close()` it.
    """
    env, phases = parts.env, parts.phases
    if env.t_spawn is not None:
        phases.timings["import"] = time.time() - env.t_spawn
    client = parts.client = RendezvousClient(env.endpoint, env.token, env.rank)
    phases.sink = client

    with phases.timed("manifest"):
        manifest = parts.manifest = load_manifest(manifest_path) if manifest_path else builtin_manifest()
        resolved = parts.resolved = manifest.resolve(env.world_size, dict(env.vars))
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
        _join(parts, backend, joiner, table)
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
    for b in parts.resolved.buffers:
        buffers[b.name] = backend.allocate(b.name, b.nbytes, b.export)
    for g in groups.values():
        if g.name in parts.spanning:
            continue
        # Flags are zeroed before the offer goes out: no peer writes into memory zeroed later.
        buffers[FLAGS_PREFIX + g.name] = backend.allocate(FLAGS_PREFIX + g.name, 8 * g.size, True)
        nbytes = joiner.buffer_nbytes(g, largest)
        if nbytes:
            buffers[GROUP_BUFFER_PREFIX + g.name] = backend.allocate(GROUP_BUFFER_PREFIX + g.name, nbytes, True)


def _exported(parts: Parts) -> list[str]:
    """The names of the buffers this rank exports: the exported manifest buffers and the tray's own,
    less those of groups that span nodes (peer mappings stay within a node)."""
    assert parts.resolved is not None and parts.buffers is not None
    export = {b.name for b in parts.resolved.buffers if b.export}
    return [n for n in parts.buffers if (n.startswith(INTERNAL_PREFIX) or n in export)
            and _group_of_buffer(parts, n) not in parts.spanning]


def _group_of_buffer(parts: Parts, name: str) -> str:
    assert parts.resolved is not None
    for prefix in (FLAGS_PREFIX, GROUP_BUFFER_PREFIX):
        if name.startswith(prefix):
            return name[len(prefix):]
    return parts.resolved.buffer(name).group


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
        groups=join_info, timings=dict(parts.phases.timings),
    )


def _import_peers(parts: Parts, backend: Backend, table: wire.Table, timeout_s: float) -> None:
    """Map every group member's exported buffers; one peer table per exported buffer."""
    env = parts.env
    assert parts.buffers is not None and parts.groups is not None
    exported = _exported(parts)
    wanted: dict[int, list[str]] = {}
    for name in exported:
        g = parts.groups.get(_group_of_buffer(parts, name))
        for peer in (g.members if g else ()):
            if peer != env.rank:
                wanted.setdefault(peer, []).append(name)
    mapped: dict[tuple[int, str], int] = {}
    mappings = parts.mappings = {}  # (peer, buffer) -> its PeerMapping here (views hold them past close)
    for peer, names in sorted(wanted.items()):
        offer = table.offers[peer]
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
                mapped[(peer, n)] = mappings[(peer, n)].ptr
        finally:
            for fd in fds.values():
                os.close(fd)
    ptr_tables = parts.ptr_tables = {}
    peer_tables = parts.peer_tables = {}
    for name in exported:
        g = parts.groups.get(_group_of_buffer(parts, name))
        if g is None:
            continue
        ptrs = [parts.buffers[name].ptr if m == env.rank else mapped.get((m, name), 0) for m in g.members]
        holes = [m for m, p in zip(g.members, ptrs) if not p]
        if holes:
            raise HandshakeError(f"peer table of {name!r} has holes for ranks {holes}")
        ptr_tables[name] = backend.ptr_table(ptrs)
        peer_tables[name] = PeerTable(name, g, tuple(ptrs), ptr_tables[name].ptr)


def _join(parts: Parts, backend: Backend, joiner: collectives.Joiner, table: wire.Table) -> None:
    """Every group's barrier; its collectives are set up to join on first use (LazyCollectives)."""
    assert parts.buffers is not None and parts.groups is not None and parts.ptr_tables is not None
    barriers = parts.barriers = {}
    relayed: dict[str, Collectives] = {}
    joins = []
    for g in parts.groups.values():
        if g.name in parts.spanning:
            _join_spanning(parts, backend, joiner, table, g, joins, relayed)
            continue
        barriers[g.name] = backend.barrier(g, parts.buffers[FLAGS_PREFIX + g.name],
                                           parts.ptr_tables[FLAGS_PREFIX + g.name])
        joins.append(collectives.GroupJoin(
            group=g, join_info=b"", barrier=barriers[g.name],
            buffer=parts.buffers.get(GROUP_BUFFER_PREFIX + g.name),
            peer_buffers=parts.ptr_tables.get(GROUP_BUFFER_PREFIX + g.name)))
    parts.collectives = LazyCollectives(joiner, joins, parts.phases, ready=relayed)


def _join_spanning(parts: Parts, backend: Backend, joiner: collectives.Joiner, table: wire.Table, g: GroupInfo,
                   joins: list[collectives.GroupJoin], relayed: dict[str, Collectives]) -> None:
    """A group with members on other nodes: its barrier relayed through the root; its collectives
    joined (on first use, like every group's) where the joiner crosses nodes (NCCL), relayed otherwise
    (host: ready at once)."""
    from tray.collectives.relay import RelayBarrier, RelayCollectives, VoteStep

    assert parts.barriers is not None and parts.client is not None
    step = VoteStep(parts.client, parts.env.token, parts.env.rank)
    barrier = parts.barriers[g.name] = RelayBarrier(g, step, before=backend.synchronize)
    if joiner.crosses_nodes:
        joins.append(collectives.GroupJoin(group=g, join_info=b"", barrier=barrier))
    else:
        relayed[g.name] = RelayCollectives(g, step)


__all__ = ["READY_TIMINGS", "boot_id", "start"]
