"""The head of one node of a job (README.md, "Several nodes"): its own ranks as on one host, plus a link to the
root (node 0's head, which also serves the root in the same loop).

What changes against a head of one host: rank numbers are global (node_rank * L + local rank); the
local offers (the join info in them), ready reports and votes go to the root as one message per node and step,
and the table (the job's join info, beside which each head hands its ranks their own node's offers), go and
decisions come back from it; the first failure on this node is reported to the root, and the
job's root cause (wherever it happened) is what every head prints; heartbeats both ways bound how long
a lost node or a lost root goes unnoticed.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from tray.errors import BarrierTimeout, UsageError, WireError
from tray.handshake import jobwire, wire
from tray.handshake.steps import GROUP_PREFIX, describe_pending, step_voters
from tray.launch.curve import job_keys, make_client
from tray.launch.head import Head
from tray.launch.job import HEARTBEAT_INTERVAL_S, JobSpec, job_rank_env, master_port_of
from tray.launch.ports import PortReservation
from tray.launch.root import (
    FAILED_HANDSHAKE,
    TOKEN_FAILURES,
    Root,
    bind_address,
    host_source,
)
from tray.launch.spawn import say
from tray.launch.spec import EXIT_HANDSHAKE, Failure, RankProcess, TraySpec
from tray.manifest.digest import part_digests
from tray.numa import NumaPlacement

# NOTE: after a local failure the head waits this long for the root's verdict (the job's root cause may
# be an earlier failure elsewhere) before it tears down with its own.
VERDICT_WAIT_S = 2.0
# votes held this long in a tray-wide step (the node's other ranks not there yet) are told the root (NodeHeld)
HELD_SAID_AFTER_S = 0.1
HELD_SAID_MAX = 64  # held votes told the root in one NodeHeld, at most
# after a failure, node 0 keeps the root up this long for nodes not joined yet, to tell them the root cause
LATE_TELL_S = 5.0
# a head that finds the root silent reads what the link still delivers for this long first (sent while it was stopped)
CATCH_UP_S = 0.2
# while a head other than node 0's has heard nothing from the root, it says so this often
WAIT_SAID_EVERY_S = 10.0
RESOLVE_EVERY_S = 2.0  # how often a root host name that does not resolve is asked again (beside ZeroMQ's own dialling)
# plain ints: an operation on pyzmq's enum constants builds an enum
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


def _is_address(host: str) -> bool:
    """Whether `host` is an IP address as written (nothing to resolve)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def node_name(source: str, env: Mapping[str, str]) -> str:
    """How a node is named to the others (its join, a lost node's line): under Slurm its node name (SLURMD_NODENAME, as
    `squeue` and `scontrol` show it), with the host's name beside it when they differ; elsewhere the host's name."""
    host = socket.gethostname()
    slurm = env.get("SLURMD_NODENAME", "") if "slurm" in source.split("+") else ""
    if slurm and slurm != host:
        return f"{slurm} on {host}"
    return slurm or host


class NodeLink:
    """This head's DEALER to the root (CURVE), its monitor, and the heartbeats both ways."""

    def __init__(self, ctx: zmq.Context, job: JobSpec, join: jobwire.NodeJoin, connect_timeout_s: float) -> None:
        self.job = job
        self.connect_timeout_s = connect_timeout_s
        # the root's table and decisions hold an entry per rank of the job
        self.limit = wire.job_message_limit(job.nnodes * join.local_world_size)
        self.sock = make_client(ctx, job_keys(job.token))
        try:
            # unique per head, so a second head given the same node rank is heard (and refused by name), not
            # silently dropped by the ROUTER as a duplicate identity
            self.sock.setsockopt(zmq.IDENTITY, f"node-{job.node_rank}-{os.getpid()}".encode())
            self.sock.setsockopt(zmq.LINGER, 1000)  # a failure report must leave before the head exits
            self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
            self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_CONNECTED)
            try:
                self.sock.connect(f"tcp://{job.root_host}:{job.root_port}")
            except zmq.ZMQError as exc:  # a name ZeroMQ refuses outright (it resolves the others as it dials)
                raise UsageError(f"the root's host {job.root_host!r} (from {host_source(job.source)}) is no address "
                                 f"ZeroMQ can dial ({exc.strerror}); give a name or address every node can "
                                 "reach") from None
        except BaseException:
            # NOTE: an open socket would keep the context's term() at the head's teardown waiting for ever
            monitor = getattr(self, "monitor", None)
            if monitor is not None:
                self.sock.disable_monitor()
                monitor.close()
            self.sock.close(linger=0)
            raise
        self.t_start = time.monotonic()
        self.last_heard: float | None = None
        self.refused = False
        self.connected = False  # a TCP connection to the root's port was made (whatever answers there)
        self._closed_handshakes = 0  # handshakes the peer closed unanswered
        self._seq = 0
        self._last_sent = 0.0  # when a message last went to the root: a heartbeat is due only after a quiet period
        self._last_tick: float | None = None  # when tick() last ran: a gap longer than the timeout is this head's own
        self._last_wait_said = self.t_start  # when this head last said it waits for the root (monotonic)
        # ZeroMQ resolves the root's host name as it dials, and says nothing when that fails: a thread asks too, so
        # that a name that does not resolve (yet: a Kubernetes service's record comes after its pod) is said
        self.unresolved = ""  # why the root's host name did not resolve when last asked; "" once it did
        self._resolve_done = threading.Event()
        if not job.is_root and not _is_address(job.root_host):
            threading.Thread(target=self._resolve, name="tray-root-resolve", daemon=True).start()
        self.send(join)

    def _resolve(self) -> None:
        while not self._resolve_done.is_set():
            try:
                socket.getaddrinfo(self.job.root_host, self.job.root_port, type=socket.SOCK_STREAM)
            except OSError as exc:
                self.unresolved = str(exc)
                self._resolve_done.wait(RESOLVE_EVERY_S)
                continue
            self.unresolved = ""
            return

    def send(self, msg: Any) -> None:
        if self.closed:  # refused by the root: nothing sent can reach it
            return
        try:
            self.sock.send(msg.to_msgpack(self.limit), _NOBLOCK)
            self._last_sent = time.monotonic()
        except zmq.Again:  # not connected yet and the queue is full: heartbeats will tell
            pass

    def receive(self) -> list[Any]:
        """Every pending message from the root (malformed ones dropped: only the root can send here)."""
        out: list[Any] = []
        # NOTE: the socket's EVENTS says whether a message waits; sock.poll() makes a Poller each call
        while not self.closed and cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN:
            frames = self.sock.recv_multipart()
            if self.last_heard is None:
                self._resolve_done.set()  # the root answered: its name resolved
            self.last_heard = time.monotonic()
            try:
                data = jobwire.message_of(frames, self.limit)
                out.append(jobwire.decode(data, token=self.job.token, sender="the root", limit=self.limit))
            except WireError as exc:  # CURVE authenticated the root: a version skew, said and skipped
                say(f"rejected a message from the root: {exc.reason}")
        return out

    def on_monitor(self) -> None:
        """Read the link's monitor events; once the root refused the handshake, close the link (`refused`). A root
        with another token closes every handshake unanswered (an event with no detail at every redial, 0.1 s apart),
        as a root that exits or a peer that closes does once: only TOKEN_FAILURES of them before anything was heard
        count as a refusal."""
        while not self.refused and self.monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            if event not in FAILED_HANDSHAKE:
                continue
            if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._closed_handshakes += 1
                if self.last_heard is not None or self._closed_handshakes < TOKEN_FAILURES:
                    continue
            self.refused = True
            # NOTE: closed, not disconnected: libzmq 4.3 keeps redialling a disconnected endpoint until the socket
            # closes, every 100 ms one more failed handshake at the root; a refusal stays a refusal.
            self.close(linger_ms=0)

    @property
    def closed(self) -> bool:
        return self.sock.closed

    def tick(self) -> str | None:
        """Send a heartbeat when due; the reason this node must stop, if the root is lost or refused it."""
        now = time.monotonic()
        # NOTE: CLOCK_BOOTTIME runs on while the machine is suspended, which CLOCK_MONOTONIC does not
        boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        gap, self._last_tick = boot - (self._last_tick or boot), boot
        limit = self.job.node_heartbeat_timeout_s
        silent = now - self.last_heard if self.last_heard is not None else 0.0
        # NOTE: this head itself did not run (SIGSTOP, a suspended VM): what it then hears nothing from is not the
        # root's fault, and the other nodes have counted this one lost meanwhile. So too when a pause a little
        # shorter than the timeout ends a silence past it (the beats before the pause), and always on node 0, whose
        # root runs in this very process: its silence is this head's own.
        own = self.job.is_root or (gap > HEARTBEAT_INTERVAL_S and silent - gap < 2 * HEARTBEAT_INTERVAL_S)
        if gap > limit or (silent > limit and own):
            paused = f"{gap:.1f} s" if gap > HEARTBEAT_INTERVAL_S else f"most of {silent:.1f} s"
            lost = "the root (this head)" if self.job.is_root else "this node"
            return (f"this head did not run for {paused} (stopped, suspended, or starved of CPU), nothing heard from "
                    f"the root for longer than --node-heartbeat-timeout-s {limit:g} s: the other nodes count {lost} "
                    "lost")
        # NOTE: any message tells the root this node is alive: a beat goes only after HEARTBEAT_INTERVAL_S with nothing
        # sent (while votes flow, a step every few ms, none does), so the root hears from the node every period at most
        # (and a tick) all the same
        if now - self._last_sent >= HEARTBEAT_INTERVAL_S and self.last_heard is not None:
            self._seq += 1
            self.send(jobwire.Beat(token=self.job.token, node_rank=self.job.node_rank, seq=self._seq))
        where = f"the root (node 0 at {self.job.endpoint})"
        if self.refused:
            return (f"{where} refused this node's CURVE handshake: TRAY_JOB_TOKEN differs from node 0's (every node "
                    "needs the same token), or something else listens on that port")
        if self.last_heard is None:
            if now - self.t_start > self.connect_timeout_s and self.connected:
                return (f"{where} did not answer within {self.connect_timeout_s:.0f} s (--timeout-s): its port "
                        "accepted a TCP connection, but nothing there finished ZeroMQ's handshake: another program "
                        "listens on that port (node 0's head then fails saying the port is in use; give every node "
                        "another with --rdzv-endpoint HOST:PORT), or node 0's head is stopped")
            dns = (f"its host {self.job.root_host!r} (from {host_source(self.job.source)}) does not resolve "
                   f"({self.unresolved})") if self.unresolved else ""
            if now - self.t_start > self.connect_timeout_s:
                if dns:
                    return (f"could not reach {where} within {self.connect_timeout_s:.0f} s (--timeout-s): {dns}; "
                            "give a name or address every node can resolve (or wait longer for its record: "
                            "--timeout-s)")
                return (f"could not reach {where} within {self.connect_timeout_s:.0f} s (--timeout-s; node 0 not "
                        "started, ended or given up already, a wrong root address "
                        f"(from {host_source(self.job.source)}), or a firewall)")
            if not self.job.is_root and now - self._last_wait_said >= WAIT_SAID_EVERY_S:
                self._last_wait_said = now
                say(f"node {self.job.node_rank}: no answer yet from {where} ({now - self.t_start:.0f} s" +
                    (f"; {dns}" if dns else "; TCP connected" if self.connected else "; not connected") +
                    f"); gives up after --timeout-s {self.connect_timeout_s:g} s")
            return None
        if silent > limit:
            return (f"lost {where}: nothing heard for {silent:.1f} s (timeout {self.job.node_heartbeat_timeout_s:.1f} "
                    "s): node 0's head was killed or stopped, its machine is down, or the network is cut")
        return None

    def close(self, linger_ms: int | None = None) -> None:
        """Close the link (again: nothing); `linger_ms` overrides the socket's LINGER."""
        self._resolve_done.set()
        if self.closed:
            return
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close(linger=linger_ms)


# the ranks a spanning barrier's message says a node leader it missed leads (tray/collectives/span.py)
_LEADS = re.compile(r"rank [0-9]{1,18} leads ranks ([0-9]{1,18}(?:,[0-9]{1,18}){0,4095}) on its node")


class NodeHead(Head):
    """`tray launch --nnodes N ...`: this node's ranks plus the link to the root (and, on node 0, the root)."""

    _adopts_ranks_manifest = False

    def __init__(self, spec: TraySpec, job: JobSpec, placements: list[NumaPlacement] | None = None) -> None:
        super().__init__(spec, placements, rank_base=job.node_rank * spec.nprocs,
                         world_size=job.nnodes * spec.nprocs)
        self.job = job
        if spec.local_ranks_filter is not None:  # local ranks, as torchrun's flag; the output names global ranks
            self.routing = dataclasses.replace(
                self.routing, ranks=tuple(self.rank_base + r for r in spec.local_ranks_filter))
        self.root: Root | None = None
        # the root's address, resolved before any rank is spawned (its host name may need a while to resolve: the
        # head waits for it up to --timeout-s, with nothing to supervise yet)
        self._root_address = bind_address(job.root_host, job.root_port, job.source, spec.handshake_timeout_s) \
            if job.is_root else None
        self.link: NodeLink | None = None
        self._left: dict[int, str] = {}  # ranks that left, not yet told to the root (their votes still held here)
        self._told_left: set[int] = set()
        self._forwarded: set[tuple[str, int]] = set()  # steps whose votes of this node went on to the root
        self._held_said: frozenset[tuple[str, int, int]] = frozenset()  # the held votes the root knows of
        self._held_seen: dict[tuple[str, int, int], float] = {}  # held votes whose rank waits: since when held
        self._expired: set[tuple[str, int]] = set()  # group steps the root gave up (timed out): late votes wait not
        self.job_stop: jobwire.JobStop | None = None
        self.job_end = False
        self.done_sent = False
        self._rank_sock: zmq.Socket | None = None
        self._root_lost = False  # no verdict can come: the root refused this node, or is gone
        self._t_offered: float | None = None  # when this node's offers went to the root (monotonic)
        self._table_wait_s = 0.0  # how long they waited there for the other nodes' (the table)
        self._interrupt_told = False

    # --- hooks of Head ---------------------------------------------------------------------------
    def _join_mode(self) -> str:
        """A job of several nodes joins its collectives lazily: its groups' ids travel through the root."""
        return "lazy"

    def _job_env(self, local_rank: int) -> dict[str, str]:
        return job_rank_env(self.job, local_rank, self.spec.nprocs)

    def _reserve_master_port(self, lock_dir_fd: int) -> PortReservation | None:
        """The job's MASTER_PORT (the root's port + 1), held on node 0 while it runs, so that a program binding it
        plainly cannot take it from the store of a program's torch.distributed (one binding it with SO_REUSEADDR
        can: see PortReservation); a port already taken is said, not refused (a program without torch.distributed
        never uses it). Other nodes hold none: their ranks dial node 0."""
        if not self.job.is_root:
            return None
        port = master_port_of(self.job)
        host = (self._root_address or "").removeprefix("tcp://").rpartition(":")[0] or "0.0.0.0"
        try:
            # NOTE: no lock file in the jobs root (a killed head would leave it): the root's own port, the one
            # below, is listened on, so no other job of this port pair runs here at once
            return PortReservation(host=host, port=port)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                # the root's host is no address of this machine: the root's own bind fails next, and says so
                return None
            beside = "+ 1" if port > self.job.root_port else "- 1, the root's being the last one"
            say(f"MASTER_PORT {port} (the root's port {beside}) is taken on {host} ({exc.strerror}): a program's "
                "torch.distributed store cannot listen there; where the program uses one, give the job another "
                "port with --rdzv-endpoint HOST:PORT (the same on every node)")
            return None

    def _start_job(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        self._rank_sock = sock
        # the manifest's digest does not cover --var: the nodes compare both (jobwire.manifest_with_vars)
        manifest = jobwire.manifest_with_vars(self.manifest.digest, dict(self.spec.vars))
        parts = part_digests(self.manifest.doc, {k.name: k.code for k in self.manifest.kernels})
        if self.job.is_root:
            self.root = Root(ctx, self.job, local_world_size=self.spec.nprocs, manifest=manifest,
                             backend=self.spec.backend, groups=self.resolved.groups,
                             join_timeout_s=self.spec.handshake_timeout_s, address=self._root_address,
                             manifest_parts=parts)
        join = jobwire.NodeJoin(token=self.job.token, node_rank=self.job.node_rank, nnodes=self.job.nnodes,
                                local_world_size=self.spec.nprocs, rdzv_id=self.job.rdzv_id,
                                hostname=node_name(self.job.source, os.environ), pid=os.getpid(), manifest=manifest,
                                backend=self.spec.backend, manifest_parts=parts)
        self.link = NodeLink(ctx, self.job, join, self.spec.handshake_timeout_s)

    def _extra_sockets(self) -> list[zmq.Socket]:
        assert self.link is not None
        return [*(self.root.sockets() if self.root else []), self.link.sock, self.link.monitor]

    def _on_extra(self, sock: zmq.Socket) -> None:
        assert self.link is not None
        if self.root is not None and sock in self.root.sockets():
            self.root.on_readable(sock)
        elif sock is self.link.monitor:
            self.link.on_monitor()
        else:
            for msg in self.link.receive():
                self._on_job_message(msg)

    def _tick(self, sock: zmq.Socket) -> None:
        assert self.link is not None
        # NOTE: the link first: after a pause of this head (SIGSTOP), the root's tick would count the other nodes lost
        lost = self.link.tick()
        if lost is not None and not self.job.is_root and self._root_said_meanwhile():
            return  # the job ended, or the root's verdict came, while this head did not run: that stands
        if self.root is not None and lost is None:
            self.root.tick()
        if lost is None:
            self._say_held()
        if lost is not None:
            self._root_lost = True
            self._fail(Failure(None, f"node {self.job.node_rank}: {lost}; stopping this node's ranks",
                               exit_code=EXIT_HANDSHAKE if self.link.last_heard is None else 1))
            return
        if not self.done_sent and self.procs and all(p.returncode == 0 for p in self.procs):
            self.done_sent = True
            self.link.send(jobwire.NodeDone(token=self.job.token, node_rank=self.job.node_rank))

    def _root_said_meanwhile(self) -> bool:
        """Whether the job's end or the root's verdict is here, reading what the link delivers within CATCH_UP_S: a
        head stopped past the heartbeat timeout finds the root silent for that long, while the root sent it JobEnd
        (this node was done) or JobStop before it went quiet."""
        assert self.link is not None
        deadline = time.monotonic() + CATCH_UP_S
        while not (self.job_end or self.job_stop is not None or self.link.closed) and \
                self.link.sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
            for msg in self.link.receive():
                self._on_job_message(msg)
        return self.job_end or self.job_stop is not None

    def _finished(self) -> bool:
        return self.job_end

    def _deadline_from_first_contact(self) -> bool:
        """A job of several nodes: --timeout-s from the spawn on every node (each head's clock is its own; one
        started at its ranks' first contact would leave a node whose ranks never join unbounded, the root bounding
        only the nodes' join)."""
        return False

    def _raise_if_signalled(self) -> None:
        """A SIGINT/SIGTERM to this head stops the job, not only this node: the other heads hear it as the job's
        root cause now, rather than as this node's silence a heartbeat timeout later."""
        if self._signals and not self._interrupt_told and self.job_stop is None:
            self._interrupt_told = True
            name = signal.Signals(self._signals[0]).name
            summary = f"node {self.job.node_rank}: its head was interrupted ({name}); the job stops"
            if self.root is not None:  # node 0: the root tells every head itself
                self.root.stop_job(self.job.node_rank, summary)
            elif self.link is not None:
                self.link.send(jobwire.NodeFailure.bounded(token=self.job.token, node_rank=self.job.node_rank,
                                                           rank=-1, summary=summary, report="", tail=(), exit_code=1))
        super()._raise_if_signalled()

    def _handshake_is_ours(self) -> bool:
        # while every local rank waits on the root (for the table or for go), the root bounds the wait
        # (a node that never joins, a lost node) and names who is missing; the ranks' heartbeats still count
        n = self.spec.nprocs
        waiting_on_root = (len(self.offers) == n and self.t_table is None) or (len(self.ready) == n and not self.t_go)
        return not waiting_on_root

    def _waited_on_root_s(self) -> float:
        return self._table_wait_s

    def _offers_complete(self, sock: zmq.Socket) -> None:
        assert self.link is not None
        self._t_offered = time.monotonic()
        joins = wire.joins_of(self.offers[p.rank] for p in self.procs)
        try:
            self.link.send(jobwire.NodeOffers(token=self.job.token, node_rank=self.job.node_rank, joins=joins))
        except WireError as exc:  # more than the job's whole table may hold: no node's join info fits beside it
            self._fail(Failure(None, f"node {self.job.node_rank}: its ranks' join info cannot go to the root "
                               f"({exc.reason}); a job of {self.world_size} ranks has a table of at most "
                               f"{self.link.limit} B: span fewer groups across nodes (the manifest's groups), or run "
                               "fewer ranks per job", exit_code=EXIT_HANDSHAKE))

    def _all_ready(self, sock: zmq.Socket) -> None:
        assert self.link is not None
        timings = {phase: secs for phase, (secs, _) in self._timeline().items()}
        self.link.send(jobwire.NodeReady(token=self.job.token, node_rank=self.job.node_rank, timings=timings))

    def _on_vote(self, sock: zmq.Socket, vote: wire.Vote) -> None:
        assert self.link is not None
        voters = self._voters_here(vote.topic)
        if voters is None or vote.rank not in voters:
            reason = f"rank {vote.rank} voted on {vote.topic!r}, a step it takes no part in"
            self._reject_log(f"rank-{vote.rank}", reason)
            self._send(sock, f"rank-{vote.rank}", wire.Reject(token=self.token, reason=reason))
            return
        key = (vote.topic, vote.round)
        box = self.votes.setdefault(key, {})
        box[vote.rank] = vote.value
        if key not in self._expired:
            self._note_wait(key, vote)
        local = list(voters)
        if vote.topic.startswith(GROUP_PREFIX):
            # a group step is bounded by its timeout at the root, which must see each arrival as it happens
            ranks: tuple[int, ...] = (vote.rank,)
        elif all(r in box for r in local):
            ranks = tuple(local)
        else:
            self._check_abandoned_steps()
            self._check_crossed_steps()
            return
        try:
            now = time.monotonic()
            until = self._waits_until.get(key, {})
            waits = tuple(max(0.0, until.get(r, now) - now) for r in ranks)
            self.link.send(jobwire.NodeVote(token=self.job.token, node_rank=self.job.node_rank, topic=vote.topic,
                                            round=vote.round, ranks=ranks, values=tuple(box[r] for r in ranks),
                                            waits=waits))
        except WireError as exc:
            self._fail(Failure(vote.rank, f"step {vote.topic!r} (round {vote.round}): the votes of ranks "
                               f"{','.join(map(str, ranks))} cannot be sent to the root ({exc.reason}); vote smaller "
                               "values"))
            return
        self._forwarded.add(key)
        self._held_said = frozenset(e for e in self._held_said if (e[0], e[1]) != key)  # the root drops them too
        self._tell_left()
        self._check_crossed_steps()

    def _pending_steps(self) -> list[str]:
        """The job's undecided steps as the root knew them at the stop, with the ranks not heard from by node; this
        head's own ranks as it knows them (a vote it held a moment had not reached the root), and its own steps the
        root had not heard of. Without a stop from the root (the root lost): this head's own view."""
        stop = self.job_stop
        if stop is None:
            return super()._pending_steps()
        mine = range(self.rank_base, self.rank_base + self.spec.nprocs)
        lines = []
        said = set()
        for topic, rnd, missing in zip(stop.pending_topics, stop.pending_rounds, stop.pending_missing):
            said.add((topic, rnd))
            box = self.votes.get((topic, rnd), {})
            still = [r for r in missing if not (r in mine and r in box)]
            if still:
                lines.append(describe_pending(topic, rnd, still, self.spec.nprocs))
        for (topic, rnd), box in self.votes.items():
            if (topic, rnd) in said:
                continue
            voters = step_voters(topic, self.world_size, self.resolved.groups, self.spec.nprocs) or ()
            still = [r for r in voters if r in mine and r not in box]
            if still:
                lines.append(describe_pending(topic, rnd, still, self.spec.nprocs))
        return lines

    def _say_held(self, *, now_all: bool = False) -> None:
        """Tell the root of the votes this head holds in tray-wide steps (waiting for this node's other ranks) that
        have stayed held HELD_SAID_AFTER_S (`now_all`: every one, at once: this node fails), each with how long its
        rank still waits: the root needs them to see steps that wait for one another across nodes, and to name who it
        never heard from. Ranks of a node in lockstep vote within that time, so they send nothing more than their
        NodeVote. At most HELD_SAID_MAX are told, those whose ranks still wait first (a rank waits in one step at a
        time; votes of steps given up stay held for good)."""
        assert self.link is not None
        now = time.monotonic()
        entries = {(topic, rnd, r) for (topic, rnd), box in self.votes.items()
                   if (topic, rnd) not in self._forwarded and not topic.startswith(GROUP_PREFIX) for r in box}
        self._held_seen = {e: self._held_seen.get(e, now) for e in entries}
        ready = [e for e, t in self._held_seen.items() if now_all or now - t >= HELD_SAID_AFTER_S]
        ready.sort(key=lambda e: (not self._waits((e[0], e[1]), e[2], now), -self._held_seen[e]))
        held = frozenset(ready[:HELD_SAID_MAX])
        if held == self._held_said:
            return
        self._held_said = held
        told = sorted(held)
        waits = tuple(max(0.0, self._waits_until.get((t, n), {}).get(r, now) - now) for t, n, r in told)
        try:
            self.link.send(jobwire.NodeHeld(token=self.job.token, node_rank=self.job.node_rank,
                                            topics=tuple(e[0] for e in told), rounds=tuple(e[1] for e in told),
                                            ranks=tuple(e[2] for e in told), waits=waits))
        except WireError:  # topics too long for one message: the root goes without (it judges what it hears)
            pass

    def _rank_left(self, p: RankProcess, how: str) -> None:
        if p.rank not in self._told_left:
            self._left[p.rank] = how
            self._tell_left()

    def _tell_left(self) -> None:
        """Tell the root which ranks left, each once its votes held here (a step's box waiting for this node's
        other voters) went on to the root: the root, seeing it leave first, would judge it never voted."""
        if self.link is None:
            return
        held = {r for key, box in self.votes.items() if key not in self._forwarded for r in box}
        for rank, how in list(self._left.items()):
            if rank in held:
                continue
            del self._left[rank]
            self._told_left.add(rank)
            self.link.send(jobwire.NodeLeft(token=self.job.token, node_rank=self.job.node_rank, rank=rank, how=how))

    def _fail(self, failure: Failure) -> None:
        if self.failure is not None:
            return
        self.failure = failure
        if self.job_stop is None and self.link is not None:
            self._say_held(now_all=True)  # what this node's ranks wait in, for the root's account of the stop
            self.link.send(jobwire.NodeFailure.bounded(
                token=self.job.token, node_rank=self.job.node_rank, rank=-1 if failure.rank is None else failure.rank,
                summary=failure.summary, report=failure.report, tail=tuple(failure.tail),
                exit_code=max(1, failure.exit_code)))

    def _after_loop(self) -> None:
        """After a local failure: keep serving the root and the link until the job's verdict arrives."""
        if self.failure is None or self.job_stop is not None or self.link is None or self._root_lost:
            return
        if self.link.closed:  # refused by the root while the ranks were stopping: no verdict can come
            return
        poller = zmq.Poller()
        for s in self._extra_sockets():
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + min(VERDICT_WAIT_S, self.job.node_heartbeat_timeout_s)
        # a SIGINT/SIGTERM noted meanwhile ends the wait: the teardown follows at once (exit 130)
        while self.job_stop is None and not self.link.closed and not self._signals and time.monotonic() < deadline:
            for s, _ in poller.poll(20):
                self._on_extra(s)
            if self.root is not None:
                self.root.tick()

    def _tell_late_nodes(self) -> None:
        """The job stopped before every node joined: the root stays up (its ranks are gone already) until those nodes
        join and hear the root cause, at most LATE_TELL_S and never past the join's deadline, so that a node started
        a moment later says the job's first failure, not that it could not reach the root."""
        root = self.root
        if root is None or root.stop is None or not root.missing_nodes() or self._signals:
            return
        now = time.monotonic()
        deadline = min(now + LATE_TELL_S, root.t_start + root.join_timeout_s)
        if deadline <= now:
            return
        late = ",".join(map(str, root.missing_nodes()))
        say(f"root: node(s) {late} not joined yet: telling them the root cause as they join (for {deadline - now:.0f} "
            "s at most)")
        poller = zmq.Poller()
        for sock in root.sockets():
            poller.register(sock, zmq.POLLIN)
        while root.missing_nodes() and not self._signals and time.monotonic() < deadline:
            for sock, _ in poller.poll(20):
                root.on_readable(sock)
        if root.missing_nodes():
            say(f"root: node(s) {','.join(map(str, root.missing_nodes()))} never joined: each gives up after its "
                "--timeout-s")

    def _close_job(self) -> None:
        if self.link is not None:
            self.link.close()
        self._tell_late_nodes()
        if self.root is not None:
            for line in self.root.rejected:
                say(f"root: {line}")
            if self.root.rejects > len(self.root.rejected):
                say(f"root: {self.root.rejects} messages rejected in all (the first {len(self.root.rejected)} said)")
            if not self.spec.quiet and self.spec.timeline:
                say(f"root: {self.root.summary()}")
            self.root.close()

    # --- from the root ---------------------------------------------------------------------------
    def _notes_on_mine(self, stop: jobwire.JobStop) -> tuple[str, ...]:
        """What this head knows of its own ranks that another node's failed wait names as missing (alive, busy,
        stopped, dead): only this node can tell, as the head of one host does for its ranks."""
        named = set(BarrierTimeout.missing_in(stop.summary) or BarrierTimeout.missing_in(stop.report))
        # a node leader named in a spanning barrier may be waiting for the ranks it leads: those are told of too
        named |= {int(r) for led in _LEADS.findall(f"{stop.summary}\n{stop.report}") for r in led.split(",")}
        late = [p for p in self.procs if p.rank in named]
        if not late:
            return ()
        self._sample_cpu(late)
        return tuple(f"node {self.job.node_rank}: {self._status(p, 'give the wait more time')}" for p in late)

    def _on_job_message(self, msg: Any) -> None:
        sock = self._rank_sock
        assert sock is not None
        if isinstance(msg, jobwire.JobTable):
            self.t_table = time.time()
            if self._t_offered is not None:  # a node slower to offer is not this node's ranks' to answer for
                self._table_wait_s = time.monotonic() - self._t_offered
            # this node's offers, and of other nodes' the join info their ranks use (peer mappings stay in a node)
            here = range(self.rank_base, self.rank_base + self.spec.nprocs)
            table = wire.Table(token=self.token, offers=tuple(self.offers[p.rank] for p in self.procs),
                               joins={r: infos for r, infos in msg.joins.items() if r not in here})
            try:
                data = wire.encode(table, wire.job_message_limit(self.world_size))
            except WireError as exc:  # the job's join info, with this node's offers: at the limit
                self._fail(Failure(None, f"node {self.job.node_rank}: the job's table cannot go to its ranks "
                                   f"({exc.reason}); export fewer buffers per rank, or span fewer groups across nodes",
                                   exit_code=EXIT_HANDSHAKE))
                return
            for p in self.procs:
                self._send_bytes(sock, f"rank-{p.rank}", data, table.KIND)
        elif isinstance(msg, jobwire.JobGo):
            if not self.spec.quiet and self.spec.timeline:
                first, last = self.rank_base, self.rank_base + self.spec.nprocs - 1
                say(f"node {self.job.node_rank} of {self.job.nnodes} (ranks {first}..{last} of {self.world_size}): "
                    "every node is ready")
            Head._all_ready(self, sock)  # go to this node's ranks, as a head of one host says it
        elif isinstance(msg, jobwire.JobDecision):
            box = self.votes.pop((msg.topic, msg.round), {})
            self._forget_waits((msg.topic, msg.round))
            if msg.missing:  # expired at the root: a late vote on it is answered at once, it waits for nothing
                self._expired.add((msg.topic, msg.round))
            self._forwarded.discard((msg.topic, msg.round))
            decision = wire.Decision(token=self.token, topic=msg.topic, round=msg.round, values=msg.values)
            # once for every rank: it holds a value of every voter of the job
            data = wire.encode(decision, wire.job_message_limit(self.world_size))
            for r in sorted(box):
                self._send_bytes(sock, f"rank-{r}", data, decision.KIND)
        elif isinstance(msg, jobwire.JobStop):
            self.job_stop = msg
            where = f"node {msg.node_rank}, " if msg.node_rank >= 0 and not msg.summary.startswith("node ") else ""
            # every head prints this same root cause, whichever node it happened on; the node it happened on adds
            # its notes on its own ranks (alive, busy, stopped; their stacks went to this node's output)
            mine = self.failure is not None and msg.node_rank == self.job.node_rank and \
                msg.rank == (-1 if self.failure.rank is None else self.failure.rank)
            self.failure = Failure(None if msg.rank < 0 else msg.rank, where + msg.summary, report=msg.report,
                                   tail=msg.tail, exit_code=msg.exit_code,
                                   notes=self.failure.notes if mine and self.failure is not None else
                                   self._notes_on_mine(msg))
        elif isinstance(msg, jobwire.JobEnd):
            self.job_end = True
