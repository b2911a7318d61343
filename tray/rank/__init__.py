"""The rank: `tray.init()` runs the eight steps of DESIGN section 2 and hands back a `Rank`.

    with tray.init() as rank:
        rank.barrier()
        x = rank.read("x")            # numpy array of the buffer's dtype and shape
        peers = rank.peers("x")       # PeerTable: every member's address, member order

An exception leaving the `with` block is reported to the head (the tray's root cause) and re-raised.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tray.backend import open_backend
from tray.backend.base import (
    DEFAULT_BARRIER_TIMEOUT_S,
    Backend,
    Barrier,
    Collectives,
    DeviceBuffer,
    ExportedHandle,
    GroupInfo,
    GroupJoin,
    Kernel,
    PtrTable,
    numpy_dtype,
)
from tray.errors import HandshakeError, UsageError
from tray.handshake import wire
from tray.handshake.client import RendezvousClient
from tray.handshake.fdpass import FdServer, fetch_fds
from tray.manifest import builtin_manifest, load_manifest
from tray.rank.env import RankEnv

__all__ = ["Buffer", "PeerTable", "Rank", "init"]

FLAGS_PREFIX = "tray:barrier:"
SCRATCH_PREFIX = "tray:scratch:"


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


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return os.uname().nodename


def init(manifest: str | None = None, timeout_s: float = 60.0) -> "Rank":
    """Join the tray this process was launched into. Blocks until every rank is ready (`go`).

    `manifest` overrides TRAY_MANIFEST (every rank must load the same one: the head checks).
    Raises UsageError outside a tray, HandshakeError when the tray cannot form.
    """
    env = RankEnv.from_environ()
    rank = Rank(env)
    try:
        rank._start(manifest or env.manifest or None, timeout_s)
    except BaseException as exc:
        rank._report(exc)
        rank.close()
        raise
    return rank


class Rank:
    """One member of a tray. Build with `tray.init()`; use as a context manager."""

    def __init__(self, env: RankEnv) -> None:
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.timings: dict[str, float] = {}
        self.backend: Backend | None = None
        self._client: RendezvousClient | None = None
        self._fd_server: FdServer | None = None
        self._buffers: dict[str, DeviceBuffer] = {}
        self._specs: dict[str, Any] = {}
        self._peer_tables: dict[str, PeerTable] = {}
        self._ptr_tables: dict[str, PtrTable] = {}
        self._groups: dict[str, GroupInfo] = {}
        self._barriers: dict[str, Barrier] = {}
        self._collectives: dict[str, Collectives] = {}
        self._rounds: dict[str, int] = {}
        self._kernels: dict[str, Kernel] = {}
        self._executor: Any = None
        self._park: Any = None
        self._closed = False
        self._go = False
        self.phase = "start"

    # --- the eight steps --------------------------------------------------------------------------
    def _enter(self, phase: str) -> float:
        self.phase = phase
        if self._client is not None:
            self._client.phase = phase
        return time.perf_counter()

    def _start(self, manifest_path: str | None, timeout_s: float) -> None:
        env = self.env
        if env.t_spawn is not None:
            self.timings["import"] = time.time() - env.t_spawn
        self._client = RendezvousClient(env.endpoint, env.token, env.rank)

        t = self._enter("manifest")
        self.manifest = load_manifest(manifest_path) if manifest_path else builtin_manifest()
        self.resolved = self.manifest.resolve(env.world_size, dict(env.vars))
        self.timings["manifest"] = time.perf_counter() - t

        t = self._enter("device")
        boot_id = _boot_id()
        self.backend = open_backend(env.backend, env.device, boot_id)
        self.timings["device"] = time.perf_counter() - t

        t = self._enter("allocate")
        self._allocate()
        nccl_ids = self._make_nccl_ids()
        self.timings["allocate"] = time.perf_counter() - t

        t = self._enter("offer")
        offer = self._make_offer(boot_id, nccl_ids)
        self.timings["offer"] = time.perf_counter() - t
        self._client.send(offer)

        t = self._enter("table")
        table = self._client.receive(wire.Table, timeout_s, "table")
        self.timings["table"] = time.perf_counter() - t
        assert self._fd_server is not None
        self._fd_server.allow(o.pid for o in table.offers)

        t = self._enter("import_peers")
        self._import_peers(table, timeout_s)
        self.timings["import_peers"] = time.perf_counter() - t

        t = self._enter("nccl")
        self._join(table)
        self.timings["nccl"] = time.perf_counter() - t

        t = self._enter("ready")
        self._client.send(wire.Ready(token=env.token, rank=env.rank, timings={
            k: v for k, v in self.timings.items() if k in ("offer", "table", "import_peers", "nccl")}))
        self._client.receive(wire.Go, timeout_s, "go")
        self.timings["ready"] = time.perf_counter() - t
        self._go = True
        self._enter("run")

    def _my_groups(self) -> dict[str, GroupInfo]:
        out = {}
        for name in self.resolved.groups:
            members = self.resolved.group_of(name, self.rank)
            if members is not None:
                out[name] = GroupInfo(name=name, members=tuple(members), index=members.index(self.rank))
        return out

    def _allocate(self) -> None:
        backend = self.backend
        assert backend is not None
        self._groups = self._my_groups()
        largest = max((b.nbytes for b in self.resolved.buffers), default=0)
        for b in self.resolved.buffers:
            self._buffers[b.name] = backend.allocate(b.name, b.nbytes, b.export)
            self._specs[b.name] = b
        for g in self._groups.values():
            # Flags are zeroed before the offer goes out: no peer writes into memory zeroed later.
            self._buffers[FLAGS_PREFIX + g.name] = backend.allocate(FLAGS_PREFIX + g.name, 8 * g.size, True)
            scratch = backend.scratch_nbytes(g.size, largest)
            if scratch:
                self._buffers[SCRATCH_PREFIX + g.name] = backend.allocate(SCRATCH_PREFIX + g.name, scratch,
                                                                          True)

    def _make_nccl_ids(self) -> dict[str, bytes]:
        assert self.backend is not None
        ids = {}
        for g in self._groups.values():
            if g.index == 0:
                uid = self.backend.nccl_unique_id()
                if uid is not None:
                    ids[g.name] = uid
        return ids

    def _exported(self) -> dict[str, ExportedHandle]:
        return {name: buf.handle() for name, buf in self._buffers.items()
                if name.startswith(("tray:",)) or self._specs[name].export}

    def _make_offer(self, boot_id: str, nccl_ids: dict[str, bytes]) -> wire.Offer:
        assert self.backend is not None
        handles = self._exported()
        fd_path = os.path.join(self.env.job_dir, f"rank-{self.rank}.fds")
        self._fd_server = FdServer(fd_path, self.env.token, self.rank,
                                   {n: h.fd for n, h in handles.items() if h.fd is not None})
        info = self.backend.info
        return wire.Offer(
            token=self.env.token, rank=self.rank, world_size=self.world_size, host=boot_id, pid=os.getpid(),
            uid=os.getuid(),
            device=wire.DeviceIdentity(ordinal=info.ordinal, uuid=info.uuid, pci_bus=info.pci_bus,
                                       numa_node=info.numa_node),
            backend=self.backend.name, manifest=self.manifest.digest, fd_socket=fd_path,
            buffers=tuple(wire.BufferOffer(name=n, nbytes=h.nbytes, handle=h.kind, fabric=h.fabric)
                          for n, h in sorted(handles.items())),
            nccl=nccl_ids, timings=dict(self.timings),
        )

    def _group_of_buffer(self, name: str) -> str:
        if name.startswith(FLAGS_PREFIX):
            return name[len(FLAGS_PREFIX):]
        if name.startswith(SCRATCH_PREFIX):
            return name[len(SCRATCH_PREFIX):]
        return self._specs[name].group

    def _import_peers(self, table: wire.Table, timeout_s: float) -> None:
        backend = self.backend
        assert backend is not None
        exported = [n for n in self._buffers if n.startswith("tray:") or self._specs[n].export]
        wanted: dict[int, list[str]] = {}
        for name in exported:
            g = self._groups.get(self._group_of_buffer(name))
            for peer in (g.members if g else ()):
                if peer != self.rank:
                    wanted.setdefault(peer, []).append(name)
        mapped: dict[tuple[int, str], int] = {}
        for peer, names in sorted(wanted.items()):
            offer = table.offers[peer]
            kinds = {b.name: b for b in offer.buffers}
            need_fds = [n for n in names if kinds[n].handle != "fabric"]
            fds = fetch_fds(offer.fd_socket, self.env.token, need_fds, f"rank {peer}", timeout_s) \
                if need_fds else {}
            try:
                for n in names:
                    b = kinds[n]
                    handle = ExportedHandle(kind=b.handle, nbytes=b.nbytes, fd=fds.pop(n, None), fabric=b.fabric)
                    try:
                        mapped[(peer, n)] = backend.import_peer(handle).ptr
                    except HandshakeError as exc:
                        raise HandshakeError(f"rank {peer}'s buffer {n!r}: {exc}") from None
            finally:
                for fd in fds.values():
                    os.close(fd)
        for name in exported:
            g = self._groups.get(self._group_of_buffer(name))
            if g is None:
                continue
            ptrs = [self._buffers[name].ptr if m == self.rank else mapped.get((m, name), 0) for m in g.members]
            holes = [m for m, p in zip(g.members, ptrs) if not p]
            if holes:
                raise HandshakeError(f"peer table of {name!r} has holes for ranks {holes}")
            table_obj = backend.ptr_table(ptrs)
            self._ptr_tables[name] = table_obj
            self._peer_tables[name] = PeerTable(name, g, tuple(ptrs), table_obj.ptr)

    def _join(self, table: wire.Table) -> None:
        backend = self.backend
        assert backend is not None
        joins = []
        for g in self._groups.values():
            barrier = backend.barrier(g, self._buffers[FLAGS_PREFIX + g.name],
                                      self._ptr_tables[FLAGS_PREFIX + g.name])
            self._barriers[g.name] = barrier
            scratch = self._buffers.get(SCRATCH_PREFIX + g.name)
            peer_scratch = self._ptr_tables.get(SCRATCH_PREFIX + g.name)
            leader = table.offers[g.members[0]]
            joins.append(GroupJoin(group=g, nccl_id=leader.nccl.get(g.name), barrier=barrier, scratch=scratch,
                                   peer_scratch=peer_scratch))
        self._collectives = backend.join_groups(joins)

    # --- the API -----------------------------------------------------------------------------------
    def _require_go(self, what: str) -> None:
        if self._closed:
            raise UsageError(f"rank {self.rank}: {what} after close()")
        if not self._go:
            raise UsageError(f"rank {self.rank}: {what} before the tray is up (phase {self.phase}: "
                             "peer tables or the head's go are missing)")

    def buffer(self, name: str) -> Buffer:
        """The manifest buffer `name` on this rank."""
        spec = self._specs.get(name)
        if spec is None:
            raise UsageError(f"no buffer {name!r}; the manifest declares {sorted(self._specs) or 'none'}")
        return Buffer(name, spec.dtype, tuple(spec.shape), spec.nbytes, self._buffers[name].ptr, spec.export)

    def peers(self, name: str) -> PeerTable:
        """Every member's address of exported buffer `name` (over the buffer's group)."""
        self._require_go("peers()")
        if name not in self._peer_tables or name.startswith("tray:"):
            exported = sorted(n for n in self._peer_tables if not n.startswith("tray:"))
            raise UsageError(f"no peer table for {name!r}; exported buffers with a group containing rank "
                             f"{self.rank}: {exported or 'none'} (set \"export\": true in the manifest)")
        return self._peer_tables[name]

    def group(self, name: str = "world") -> GroupInfo:
        if name not in self._groups:
            raise UsageError(f"rank {self.rank} is in no group {name!r}; its groups: {sorted(self._groups)}")
        return self._groups[name]

    def barrier(self, group: str = "world", timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S) -> None:
        """Wait until every member of `group` arrives; BarrierTimeout names who did not."""
        self._require_go("barrier()")
        self.group(group)
        self._barriers[group].wait(timeout_s)

    def barrier_of(self, group: str = "world") -> Barrier:
        """The group's Barrier object, for launching without synchronising (benchmarks, graphs)."""
        self._require_go("barrier_of()")
        self.group(group)
        return self._barriers[group]

    def kernel(self, name: str) -> Kernel:
        """The manifest kernel `name`, compiled and loaded once (host: its numpy twin)."""
        if name not in self._kernels:
            spec = next((k for k in self.manifest.kernels if k.name == name), None)
            if spec is None:
                known = sorted(k.name for k in self.manifest.kernels)
                raise UsageError(f"no kernel {name!r}; the manifest declares {known or 'none'}")
            assert self.backend is not None
            self._kernels[name] = self.backend.load_kernel(spec.name, spec.source, spec.entry, spec.options,
                                                           spec.peers)
        return self._kernels[name]

    def collectives(self, group: str = "world") -> Collectives:
        self._require_go("collectives()")
        self.group(group)
        return self._collectives[group]

    def read(self, name: str) -> np.ndarray:
        """A host copy of buffer `name`, typed and shaped as the manifest says."""
        b = self.buffer(name)
        assert self.backend is not None
        return self.backend.read(b.ptr, b.nbytes).view(numpy_dtype(b.dtype)).reshape(b.shape)

    def write(self, name: str, data: np.ndarray) -> None:
        """Copy `data` (any dtype; its bytes must fit) into buffer `name` from offset 0."""
        b = self.buffer(name)
        arr = np.ascontiguousarray(data)
        if arr.nbytes > b.nbytes:
            raise UsageError(f"{arr.nbytes} B do not fit buffer {name!r} of {b.nbytes} B")
        assert self.backend is not None
        self.backend.write(b.ptr, arr)

    def exchange(self, topic: str, value: Any, timeout_s: float = 60.0) -> list[Any]:
        """Every rank's `value` (msgpack-able), in rank order, through the head. A tray-wide step:
        every rank must call it with the same topic. Raises UsageError, before sending, when the
        value is larger than wire.vote_limit_nbytes(world_size) (all values travel back in one message)."""
        self._require_go("exchange()")
        assert self._client is not None
        rnd = self._rounds.get(topic, 0) + 1
        data = wire.encode(wire.Vote(token=self.env.token, rank=self.rank, topic=topic, round=rnd, value=value))
        limit = wire.vote_limit_nbytes(self.world_size)
        if len(data) > limit:
            raise UsageError(
                f"exchange({topic!r}): rank {self.rank}'s value takes {len(data)} B; the head sends every "
                f"rank's value back in one message of at most {wire.MAX_MESSAGE_NBYTES} B, so each of the "
                f"{self.world_size} ranks may send at most {limit} B: exchange less (e.g. a digest or a path)")
        self._rounds[topic] = rnd
        self._client.send_bytes(data)
        while True:
            d = self._client.receive(wire.Decision, timeout_s, f"decision on {topic!r}")
            if d.topic == topic and d.round == rnd:
                return list(d.values)

    # --- programs and park/wake (tray/rank/executor.py, tray/park/) ---------------------------------------
    def run(self, program: str, vars: dict[str, int] | None = None) -> None:
        """Run manifest program `program` in lockstep with every rank (arguments resolved once per
        (program, vars), then replayed; `graph: true` programs replay one captured graph)."""
        self._require_go("run()")
        if self._executor is None:
            from tray.rank.executor import Executor

            self._executor = Executor(self)
        self._executor.run(program, vars or {})

    def synchronize(self) -> None:
        """Wait for this rank's stream; raise BarrierTimeout if a barrier it ran timed out."""
        self._require_go("synchronize()")
        assert self.backend is not None
        self.backend.synchronize()
        for barrier in self._barriers.values():
            barrier.check()

    def load_weights(self, **kwargs: Any) -> Any:
        """Fill every buffer whose manifest entry has a `bind` from its safetensors file (pread into
        pinned double buffers, copied while the next read runs). Returns a tray.weights.WeightsReport."""
        self._require_go("load_weights()")
        from tray.weights import load_weights

        return load_weights(self, **kwargs)

    def _parking(self) -> Any:
        self._require_go("park/wake")
        if self._park is None:
            from tray.park import Parking

            self._park = Parking(self)
        return self._park

    def lease(self, pages: int, state: str | None = None) -> Any:
        """Lease `pages` device pages of `state` (default: the manifest's only state) on this rank."""
        return self._parking().lease(pages, state)

    def park(self, session: Any) -> Any:
        """Tray-wide: move every rank's pages of `session` to host memory, all or nothing (NoRoom)."""
        return self._parking().park(session)

    def wake(self, parked: Any) -> Any:
        """Tray-wide: bring a parked session back to device pages on every rank, all or nothing."""
        return self._parking().wake(parked)

    # --- ending --------------------------------------------------------------------------------------
    def _report(self, exc: BaseException) -> None:
        """Tell the head why this rank fails: an error file (survives a dead socket) and a message."""
        tb = "".join(traceback.format_exception(exc))
        # NOTE: control messages are capped at 1 MiB; keep the traceback's end, where the cause is.
        tb = tb if len(tb) <= 64_000 else "...\n" + tb[-64_000:]
        report = {"rank": self.rank, "phase": self.phase, "error_type": type(exc).__name__,
                  "message": str(exc)[:16_000], "traceback": tb}
        try:
            path = Path(self.env.job_dir) / f"rank-{self.rank}.error.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(report))
            tmp.replace(path)
        except OSError:
            pass
        if self._client is not None:
            try:
                self._client.send(wire.ErrorReport(token=self.env.token, **report))
            except Exception:  # the head may be gone; the error file stays
                pass

    def close(self) -> None:
        """Release everything this rank made, in reverse order; say bye to the head."""
        if self._closed:
            return
        self._closed = True
        for owner in (self._executor, self._park):
            if owner is not None:
                owner.close()
        for c in self._collectives.values():
            c.close()
        for b in self._barriers.values():
            b.close()
        for t in self._ptr_tables.values():
            t.close()
        if self._fd_server is not None:
            self._fd_server.close()
        if self.backend is not None:
            self.backend.close()
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> "Rank":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            self._report(exc)
        elif self._client is not None and self._go:
            try:
                self._client.send(wire.Bye(token=self.env.token, rank=self.rank))
            except Exception:
                pass
        self.close()
