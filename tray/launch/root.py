"""The job's root (README.md, "Several nodes"): served by node 0's head, inside its poll loop.

Heads connect over TCP with CURVE (keys from the job token). The root checks that the nodes form one
job (node ranks 0..N-1 once each, one node count, one ranks-per-node, one manifest, one backend, one
rendezvous id), assembles one table from one offers message per node (the join info of the groups that
span nodes: all a node's ranks use of other nodes' offers), gathers per-node votes into
one decision per step, says go when every node is ready, and ends the job when every node is done.
The first failure anywhere (a node's report, a lost node, a node that never joined) becomes the job's
root cause, sent to every head as JobStop. A connection that fails its CURVE handshake is not a node
of this job (a port scanner, a head started with another token): it is counted, logged and ignored,
so no stranger can stop the job; a join that then times out says how many failed and from where.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import math
import os
import re
import resource
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from tray.errors import BarrierTimeout, UsageError, WireError
from tray.handshake import jobwire, raise_fd_soft_limit
from tray.handshake.steps import (
    GROUP_PREFIX,
    NO_DECISION,
    crossed_steps,
    describe_cycle,
    never_joined,
    ranks_by_node,
    step_voters,
)
from tray.handshake.wire import MAX_FRAME_NBYTES, MAX_MESSAGE_NBYTES, PER_RANK_NBYTES, job_message_limit
from tray.launch.curve import ZapHandler, job_keys, make_server
from tray.launch.job import HEARTBEAT_INTERVAL_S, SLURM_PORT_BASE, SLURM_PORT_JOBS, SLURM_PORT_STEP_STRIDE, JobSpec
from tray.launch.spawn import say
from tray.launch.spec import EXIT_HANDSHAKE
from tray.text import printable

EXIT_JOB = 1
FAILED_HANDSHAKE = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
# NOTE: failed handshakes are logged at most this often: a head with another token redials every 100 ms,
# a port scanner faster; one line per interval says how many failed since the last.
HANDSHAKE_LOG_INTERVAL_S = 5.0
# NOTE: a head with another token fails its handshake at every redial (0.1 s apart); one or two failures may as well
# be a head that stopped, or a root that closed, while connecting
TOKEN_FAILURES = 3
_PENDING_SAID = 20  # undecided steps named in a JobStop, at most
# NOTE: the cycle check over every undecided step runs from the tick, at most this often, not on every vote: a
# relayed collective's round over many ranks would otherwise cost the root one full check per vote
_CROSSED_EVERY_S = 0.1
# a node not heard from for longer than this (two heartbeats and some) is said to be silent when a failed wait missed
# its ranks
_NODE_LATE_S = 2 * HEARTBEAT_INTERVAL_S + 0.5
_VOTERS_KEPT = 4096
_DRAIN_MAX = 256  # messages from the nodes handled per readable event (the head's loop goes on between batches)
# zmq's flags as plain ints: each operation on pyzmq's enum constants builds an enum (~1 us per message at the root)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK, _NOBLOCK_MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_BEAT_LOOK_S = 0.1  # how often the root looks for nodes it has sent nothing for a while (a beat is then due)
_COPY_BELOW = 1 << 16  # smaller messages are copied as they are sent; a larger one is shared (zero-copy)
# a NodeOffers message beside its join info and token, at most: its kind, version, node rank and the field names (~55 B)
_OFFERS_ENVELOPE_NBYTES = 64


# NOTE: a job-wide step sends every node its decision, which ZeroMQ's I/O thread encrypts (CURVE) into a buffer per
# node: at 1,000 nodes of 4 about 19 MB allocated and freed at once per step, which glibc gave back to the OS and
# faulted in again at every step (about 8,200 page faults a step in the root's process, a sixth more of its CPU there:
# bench/results/host/root_scale/faults_before_1000L4_*.json). The root keeps this much freed memory per node of the job,
# within these bounds, rather than trim it (glibc's own threshold starts at 128 KiB and adapts up to 64 MiB), in each of
# glibc's arenas. Setting it stops glibc adapting its mmap threshold too (128 KiB, where a larger buffer is mapped and
# unmapped each time): the root sets that to its largest message (a decision of every rank's value), at most 32 MiB
_KEPT_PER_NODE = 64 << 10
_KEPT_LEAST, _KEPT_MOST = 1 << 20, 256 << 20
_MAPPED_LEAST, _MAPPED_MOST = 128 << 10, 32 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameters
# an operator's own settings of glibc's malloc, which the root leaves as they are
_MALLOC_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory(nbytes: int, mapped_from: int = _MAPPED_MOST) -> bool:
    """Have glibc keep up to `nbytes` of freed memory in this process (its trim threshold, per arena) rather than give
    it back to the OS at each free, and allocate blocks below `mapped_from` bytes from its heap rather than map each
    (its mmap threshold); what was never allocated is not taken. False, changing nothing, where the C library is not
    glibc, where the environment sets glibc's malloc already (MALLOC_*_ or GLIBC_TUNABLES with glibc.malloc), or where
    glibc refused."""
    env = os.environ
    if any(k in env for k in _MALLOC_SETTINGS) or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return False
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mapped_from))) and \
            bool(libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(nbytes)))
    except (ValueError, OSError, AttributeError):  # no such confstr name, no libc to load, no mallopt
        return False


# where a job's root host came from, by the job's source (JobSpec.source: "cli", "slurm", "cli+pytorchjob", ...)
_HOST_FROM = {"cli": "--rdzv-endpoint or --master-addr", "slurm": "the first host of SLURM_JOB_NODELIST",
              "pytorchjob": "PET_MASTER_ADDR", "lws": "LWS_LEADER_ADDRESS"}
# how often the root asks again for an address its host name does not have yet
_RESOLVE_EVERY_S = 0.5
_RESOLVE_SAID_AFTER_S = 2.0


def _node_of(ident: bytes) -> int | None:
    """The node rank a head's identity names (`node-R-PID`, tray/launch/node.py), None for another."""
    m = re.fullmatch(rb"node-([0-9]{1,9})-[0-9]{1,12}", ident)
    return int(m.group(1)) if m else None


def _table_limit_said() -> str:
    return f"1 MiB, or {PER_RANK_NBYTES} B per rank in a job of more than {MAX_MESSAGE_NBYTES // PER_RANK_NBYTES} ranks"


def host_source(source: str) -> str:
    """What named the root's host, for a job of `source` (JobSpec.source)."""
    return " or ".join(_HOST_FROM.get(s, s) for s in source.split("+"))


def bind_address(host: str, port: int, source: str = "cli", wait_s: float = 0.0) -> str:
    """`tcp://IP:PORT` for the root's host name, asking again for up to `wait_s` while it does not resolve: in a
    Kubernetes job the root's own service name (PET_MASTER_ADDR) may get its DNS record only after the pod starts.
    UsageError naming where the name came from when it never does."""
    deadline = time.monotonic() + wait_s
    said = False
    t0 = time.monotonic()
    while True:
        try:
            return f"tcp://{socket.gethostbyname(host)}:{port}"
        except OSError as exc:
            now = time.monotonic()
            if now >= deadline:
                raise UsageError(f"the root's host {host!r} (from {host_source(source)}) did not resolve"
                                 + (f" within {wait_s:g} s (--timeout-s)" if wait_s else "")
                                 + f" ({exc}); give a name or address every node can reach") from None
            if not said and now - t0 >= _RESOLVE_SAID_AFTER_S:
                said = True
                say(f"root: its host {host!r} (from {host_source(source)}) does not resolve yet ({exc}); asking "
                    f"again every {_RESOLVE_EVERY_S:g} s for up to {wait_s:g} s (--timeout-s)")
            time.sleep(min(_RESOLVE_EVERY_S, max(0.0, deadline - now)))


_REJECTS_KEPT = 100
_REJECTS_SAID = 20  # connections whose unreadable first message is said, at most
_WAIT_SAID_EVERY_S = 10.0  # while nodes are missing, the root says so this often
_HANDSHAKE_MS = 5000  # a connection to the root that has not finished CURVE's handshake by then is dropped
_BACKLOG_MIN = 100  # ZeroMQ's default listen queue
# descriptors node 0's head needs beside one per node's connection: its ZeroMQ sockets and their mailboxes, the job
# dir, the watchdog's pipe, and per local rank its connection, output pipes and pidfd
_FDS_BESIDE_NODES = 64
_FDS_PER_RANK = 8


@dataclass
class NodeState:
    """A node as the root sees it."""

    ident: bytes
    join: jobwire.NodeJoin
    last_seen: float
    last_sent: float = 0.0  # when the root last sent it anything (monotonic): its beat is left out until a quiet spell
    offered: bool = False
    joins: dict[int, dict[str, bytes]] = field(default_factory=dict)  # its ranks' join info (NodeOffers)
    ready: dict[str, float] | None = None
    done: bool = False


@dataclass
class _Step:
    """Votes of one (topic, round) so far: rank -> value; `t0` the first vote's arrival."""

    voters: tuple[int, ...]
    values: dict[int, Any] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)
    timeout_s: float | None = None
    until: dict[int, float] = field(default_factory=dict)  # rank -> until when it waits for the decision (monotonic)
    latest: float = 0.0  # the latest of `until`: whether any voter still waits, without a pass over them
    # the voters not heard from yet: the step is decided when none is left. NOTE: not a pass over every voter at each
    # vote, which made a tray-wide step O(nodes x ranks) at the root
    unheard: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self.unheard = set(self.voters)


class Root:
    """Owns the root's ROUTER, its ZAP handler and monitor; `sockets()` are polled by the head, which
    calls `on_readable(sock)` for each readable one and `tick()` every loop turn."""

    def __init__(self, ctx: zmq.Context, job: JobSpec, *, local_world_size: int, manifest: str, backend: str,
                 groups: dict[str, tuple[tuple[int, ...], ...]], join_timeout_s: float,
                 address: str | None = None, manifest_parts: tuple[str, ...] = ()) -> None:
        """`address`: the `tcp://IP:PORT` to bind, resolved already (bind_address); the job's root host's when
        None. `manifest_parts`: node 0's manifest's parts by digest, to say where another node's differs."""
        self.manifest_parts = manifest_parts
        self.job = job
        self.nnodes = job.nnodes
        self.local_world_size = local_world_size
        self.world_size = job.nnodes * local_world_size
        self.limit = job_message_limit(self.world_size)  # the table's and a decision's most bytes
        self._offered_nbytes = 0  # of the offers messages so far: what the table holds of them, at least
        self.manifest = manifest
        self.backend = backend
        self.groups = groups
        self.join_timeout_s = join_timeout_s
        self.token = job.token
        self.nodes: dict[int, NodeState] = {}
        # nodes that sent their offers, said ready, said done: counted, not found by a pass over every node per message
        self.offered = self.readied = self.finished = 0
        self.by_ident: dict[bytes, int] = {}
        self.steps: dict[tuple[str, int], _Step] = {}
        # a timed-out step's decision as its voters got it (jobwire.frames_of): a late voter's answer
        self.expired: dict[tuple[str, int], list[bytes]] = {}
        self.left: dict[int, str] = {}  # ranks that take part in no step any more (NodeLeft): how they left
        # votes held at their node's head in tray-wide steps (NodeHeld): node -> step -> rank -> until when it waits
        self.held: dict[int, dict[tuple[str, int], dict[int, float]]] = {}
        self._held_at: dict[tuple[str, int], dict[int, float]] = {}  # the same by step: step -> rank -> until when
        self.told: set[int] = set()  # node ranks refused at their join, told why (not waited for after a stop)
        self.strangers: dict[int, str] = {}  # node rank -> why a head of another job that gave it was refused (last)
        self.unjoined: dict[bytes, str] = {}  # connection -> why its first unreadable message was refused (not joined)
        self._voters: dict[str, tuple[int, ...] | None] = {}  # step_voters by topic, for the crossed-steps check
        self._crossed_due = False  # votes came since the last crossed-steps check
        self._crossed_at = 0.0
        self.stop: jobwire.JobStop | None = None
        self.ended = False
        self.rejected: list[str] = []
        self.rejects = 0  # messages refused; the first _REJECTS_KEPT are kept in `rejected`
        self.t_start = time.monotonic()
        self.t_table: float | None = None
        self.t_go: float | None = None
        self._seq = 0
        self._beats_looked_at = 0.0  # when the root last looked for nodes a beat is due to
        self._last_wait_said = 0.0
        self._lost_check_at = 0.0  # when a node may first be silent past the heartbeat timeout (_check_lost)
        self.messages_in = 0
        self.messages_out = 0
        self.busy_s = 0.0  # time spent handling messages and ticks: the root's own cost
        # of it, the CPU time of the head's thread: on a machine shared with the job's other processes the time spent
        # is largely theirs (the root descheduled meanwhile); this is the root's alone
        self.busy_cpu_s = 0.0
        self.handshake_failures = 0  # connections that failed CURVE (a wrong root key, or a key ZAP refused)
        self.auth_failures = 0  # of those, refused by ZAP: the only ones whose peer address is known
        self._failures_logged = 0
        self._last_failure_log: float | None = None
        # resolved first: a name that does not resolve must fail before any socket exists (one left open would
        # keep the context's term() waiting for ever)
        self.endpoint = address or bind_address(job.root_host, job.root_port, job.source)
        # NOTE: anyone who reaches the port may open connections: the soft limit on descriptors is raised to the hard
        # one, so idle connections cannot take the descriptors the heads' connections and the teardown need. A limit
        # below one descriptor per node (and the head's own) is said now: libzmq would leave the connections past it
        # unaccepted, and the join would time out naming those nodes as not started
        soft, hard = raise_fd_soft_limit()
        need = job.nnodes + _FDS_BESIDE_NODES + _FDS_PER_RANK * local_world_size
        if soft != resource.RLIM_INFINITY and soft < need:
            shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
            raise UsageError(f"node 0's head serves a TCP connection per node: a job of {job.nnodes} nodes needs about "
                             f"{need} open files there, and this process may open {soft} (ulimit -n; hard limit "
                             f"{shown}); raise the limit where node 0's head starts (ulimit -n {need}, LimitNOFILE= of "
                             "its service, or the hard limit the scheduler gives), or run fewer nodes")
        keep_freed_memory(min(_KEPT_MOST, max(_KEPT_LEAST, job.nnodes * _KEPT_PER_NODE)),
                          min(_MAPPED_MOST, max(_MAPPED_LEAST, self.limit + (64 << 10))))
        keys = job_keys(job.token)
        self.zap = ZapHandler(ctx, keys)
        self.sock = make_server(ctx, keys)
        self.sock.setsockopt(zmq.LINGER, 1000)  # a JobStop/JobEnd must leave before the head exits
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # a larger one drops its sender; a node's votes or join info in a job of many ranks may pass 1 MiB (a head
        # sends them, CURVE-authenticated: a stranger delivers nothing)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.limit + MAX_FRAME_NBYTES - MAX_MESSAGE_NBYTES)
        # NOTE: a connection that has not finished CURVE's handshake within HANDSHAKE_IVL is dropped (ZeroMQ waits 30 s
        # by default): idle ones cannot hold descriptors for long
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
        # every node dials at once at the start: a listen queue of ZeroMQ's default 100 would drop the SYNs of a larger
        # job's heads beyond it, each then redialling a second or more later (the kernel caps it at somaxconn)
        self.sock.setsockopt(zmq.BACKLOG, max(_BACKLOG_MIN, job.nnodes))
        # NOTE: the monitor is attached before the bind: a head that dials while the root binds may fail its
        # handshake at once, and an event raised before the monitor exists is lost, so the root could not
        # say why that node never joined.
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        try:
            self.sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self.close()
            if exc.errno == errno.EADDRINUSE and job.port_source == "slurm":
                raise UsageError(f"the root's port {job.root_port} is in use on this machine: under Slurm it comes "
                                 f"from the job id and step ({SLURM_PORT_BASE} + 2 x ((id + "
                                 f"{SLURM_PORT_STEP_STRIDE} x step) mod {SLURM_PORT_JOBS})), so another job's step "
                                 "of the same slot, or another program holds it; give this "
                                 f"step another port with --rdzv-endpoint {job.root_host}:PORT (the same on every "
                                 "node)") from None
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"the root's port {job.root_port} is in use on this machine, by another program or "
                                 "the head of another node 0 (--node-rank 0 given twice here?); give each node its own "
                                 "--node-rank, or another port with --rdzv-endpoint HOST:PORT (the same on every node)"
                                 ) from None
            raise UsageError(f"node 0 cannot listen on {self.endpoint} ({job.root_host}): {exc.strerror}; run node 0 "
                             "on the host the endpoint names") from None

    def sockets(self) -> list[zmq.Socket]:
        return [self.sock, self.zap.socket, self.monitor]

    # --- events -------------------------------------------------------------------------------------
    def on_readable(self, sock: zmq.Socket) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._on_readable(sock)
        finally:
            self.busy_s += time.perf_counter() - t0
            self.busy_cpu_s += time.thread_time() - c0

    def _on_readable(self, sock: zmq.Socket) -> None:
        if sock is self.zap.socket:
            self.zap.handle()
        elif sock is self.monitor:
            while self.monitor.poll(0, zmq.POLLIN):
                event = recv_monitor_message(self.monitor)["event"]
                if event in FAILED_HANDSHAKE:
                    self.handshake_failures += 1
                    self.auth_failures += event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            self._log_handshake_failures()
        else:
            # NOTE: at most _DRAIN_MAX messages a turn, so the head's own loop and the root's tick run between two
            # batches whatever the nodes send; whether one waits is the socket's EVENTS: sock.poll() makes a Poller
            # each call, the largest part of the root's CPU per message with hundreds of nodes (bench/root_scale.py)
            for _ in range(_DRAIN_MAX):
                if not cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN:
                    break
                frames = self.sock.recv_multipart()
                if len(frames) != 2:
                    self._reject(frames[0], f"expected 1 frame, got {len(frames) - 1}")
                    continue
                self.messages_in += 1
                self._on_message(frames[0], frames[1])

    def _reject(self, ident: bytes, reason: str) -> None:
        if len(self.rejected) < _REJECTS_KEPT:  # the rest are counted: a flood must not fill the head's memory
            self.rejected.append(f"rejected a message from {printable(ident.decode(errors='replace')[:64])}: "
                                 f"{reason[:300]}")
        self.rejects += 1

    def _on_message(self, ident: bytes, payload: bytes) -> None:
        try:
            msg = jobwire.decode(payload, token=self.token, sender=ident.decode(errors="replace"), limit=self.limit)
        except WireError as exc:
            self._reject(ident, exc.reason)
            if ident not in self.by_ident and ident not in self.unjoined and len(self.unjoined) < _REJECTS_SAID:
                # NOTE: a connection that passed CURVE holds the job's token: a head of this job whose messages the root
                # cannot read (another tray's protocol version, most likely): said now, and named if the join times out
                who = printable(ident.decode(errors="replace")[:64])
                self.unjoined[ident] = f"{who}: {exc.reason[:300]}"
                say(f"root: cannot read the join of {self.unjoined[ident]}")
            return
        if isinstance(msg, jobwire.NodeJoin):
            self._on_join(ident, msg)
            return
        node = self.by_ident.get(ident)
        if node is None or getattr(msg, "node_rank", node) != node:
            self._reject(ident, f"{msg.KIND} from a connection that has not joined as that node")
            return
        ranks = getattr(msg, "ranks", None)
        one = getattr(msg, "rank", None)
        if ranks is None and isinstance(one, int) and one >= 0:
            ranks = (one,)
        mine = range(node * self.local_world_size, (node + 1) * self.local_world_size)
        if ranks and any(r not in mine for r in ranks):
            # a node speaks for its own ranks only: votes, failures and exits of others' are not its to give
            self._reject(ident, f"{msg.KIND} from node {node} names rank(s) "
                                f"{','.join(str(r) for r in ranks if r not in mine)}, not of that node "
                                f"(its ranks are {mine.start}..{mine.stop - 1})")
            return
        state = self.nodes[node]
        state.last_seen = time.monotonic()
        if isinstance(msg, jobwire.Beat):
            return
        if self.stop is not None and isinstance(msg, (jobwire.NodeOffers, jobwire.NodeReady, jobwire.NodeVote,
                                                      jobwire.NodeHeld)):
            return  # the job stopped: no table, go or decision follows (a late node's offers included)
        if isinstance(msg, jobwire.NodeOffers):
            if state.offered:
                self._reject(ident, f"node {node} sent its offers again (once per job)")
                return
            self._on_offers(state, msg, len(payload))
        elif isinstance(msg, jobwire.NodeReady):
            if self.t_table is None or state.ready is not None:
                self._reject(ident, f"node {node} said ready " + ("again (once per job)" if state.ready is not None
                                                                   else "before the job's table was sent"))
                return
            state.ready = dict(msg.timings)
            self.readied += 1
            if self.readied == self.nnodes:
                self.t_go = time.time()
                self._broadcast(jobwire.JobGo(token=self.token, t_go=self.t_go))
        elif isinstance(msg, jobwire.NodeVote):
            self._on_vote(node, msg)
        elif isinstance(msg, jobwire.NodeHeld):
            self._on_held(node, msg)
        elif isinstance(msg, jobwire.NodeFailure):
            self._stop(node, msg.rank, msg.summary, report=msg.report, tail=msg.tail, exit_code=msg.exit_code)
        elif isinstance(msg, jobwire.NodeLeft):
            self.left[msg.rank] = msg.how
            self._check_left()
        elif isinstance(msg, jobwire.NodeDone):
            if not state.done:
                state.done = True
                self.finished += 1
            if self.finished == self.nnodes and self.stop is None:
                self.ended = True
                self._broadcast(jobwire.JobEnd(token=self.token, nnodes=self.nnodes))
        else:
            self._reject(ident, f"a head may not send {msg.KIND!r}")

    def _on_join(self, ident: bytes, join: jobwire.NodeJoin) -> None:
        problems = []
        if join.rdzv_id != self.job.rdzv_id:
            problems.append(f"rendezvous id {join.rdzv_id!r}, the root's is {self.job.rdzv_id!r} (two jobs share "
                            "one endpoint and token?)")
        if join.nnodes != self.nnodes:
            problems.append(f"a job of {join.nnodes} nodes, the root's has {self.nnodes} (--nnodes differs)")
        if join.local_world_size != self.local_world_size:
            n = join.local_world_size
            problems.append(f"{n} {'rank' if n == 1 else 'ranks'} per node, node 0 runs {self.local_world_size}; every "
                            "node must run the same number (-n / --nproc-per-node)")
        if join.manifest != self.manifest:
            problems.append(jobwire.manifest_differs(join.manifest, self.manifest, join.manifest_parts,
                                                     self.manifest_parts))
        if join.backend != self.backend:
            problems.append(f"backend {join.backend}, node 0 runs {self.backend}")
        if join.node_rank >= self.nnodes:
            problems.append(f"node rank {join.node_rank}, outside 0..{self.nnodes - 1}")
        elif join.node_rank in self.nodes:
            first = self.nodes[join.node_rank].join
            problems.append(f"node rank {join.node_rank} joined twice: first from {first.hostname} (head pid "
                            f"{first.pid}), again from {join.hostname} (head pid {join.pid}); give each node its "
                            "own --node-rank")
        if problems:
            who = f"node {join.node_rank} ({join.hostname}, head pid {join.pid})"
            summary = f"{who} cannot join this job: " + "; ".join(problems)
            if join.rdzv_id != self.job.rdzv_id or len(self.nodes) == self.nnodes:
                # a head of another job, or any head once every node is in: not this job's to fail; only it is told
                say(f"root: refused {summary}")
                if join.node_rank not in self.nodes:
                    self.strangers[join.node_rank] = summary
                self._send(ident, jobwire.JobStop.bounded(token=self.token, node_rank=join.node_rank, rank=-1,
                                                          summary=summary, report="", tail=(),
                                                          exit_code=EXIT_HANDSHAKE))
                return
            # a node of this job that cannot be one of it (its -n, its node rank...) while the job forms: the job
            # cannot form without it, so it fails now, naming why
            self._stop(None, -1, summary, exit_code=EXIT_HANDSHAKE)
            if self.stop is not None:  # the refused head is not a member: tell it too
                self._send(ident, self.stop)
                if 0 <= join.node_rank < self.nnodes and join.node_rank not in self.nodes:
                    self.told.add(join.node_rank)
            return
        self.nodes[join.node_rank] = NodeState(ident=ident, join=join, last_seen=time.monotonic())
        self.by_ident[ident] = join.node_rank
        if self.stop is not None:  # the job stopped before this node joined: it hears the root cause, not a table
            self._send(ident, self.stop)
            return
        self._send(ident, jobwire.Beat(token=self.token, node_rank=0, seq=self._seq))

    def _on_offers(self, state: NodeState, msg: jobwire.NodeOffers, nbytes: int) -> None:
        base = msg.node_rank * self.local_world_size
        foreign = [r for r in msg.joins if not base <= r < base + self.local_world_size]
        if foreign:
            self._stop(msg.node_rank, -1, f"node {msg.node_rank} forwarded the join info of ranks {foreign[:8]}, not "
                       f"its own (ranks {base}..{base + self.local_world_size - 1})", exit_code=EXIT_HANDSHAKE)
            return
        state.offered = True
        state.joins = msg.joins
        self.offered += 1
        # NOTE: the table holds every node's join info as it came, less each message's envelope: once what came so far
        # passes the table's limit, the job is refused now, not after every node offered
        self._offered_nbytes += max(0, nbytes - _OFFERS_ENVELOPE_NBYTES - len(self.token.encode()))
        if self._offered_nbytes > self.limit:
            self._stop(None, -1, f"the job's table cannot hold every rank's join info: that of {self.offered} of "
                       f"{self.nnodes} nodes takes {self._offered_nbytes} B, and a table of {self.world_size} ranks "
                       f"may take {self.limit} B ({_table_limit_said()}); span fewer groups across nodes (the "
                       "manifest's groups), or run fewer ranks per job", exit_code=EXIT_HANDSHAKE)
            return
        if len(self.nodes) == self.nnodes and self.offered == self.nnodes:
            joins = {r: infos for n in range(self.nnodes) for r, infos in self.nodes[n].joins.items()}
            self.t_table = time.time()
            # NOTE: each node gets the join info of the ranks that lead an instance of a group with a member on it, and
            # nodes that need the same ranks' get the same bytes, encoded once (every node alike for a group over the
            # whole job): a node of a job of many small spanning groups (pairs across nodes) is not sent the job's
            tables: dict[tuple[int, ...], list[int]] = {}
            for node, ranks in self._joins_needed(joins).items():
                tables.setdefault(ranks, []).append(node)
            encoded = []  # every node's first, then sent: all nodes get their table, or none does
            for ranks, nodes in tables.items():
                try:
                    encoded.append((nodes, jobwire.frames_of(jobwire.JobTable(
                        token=self.token, joins={r: joins[r] for r in ranks}).to_msgpack(self.limit))))
                except WireError as exc:
                    self._stop(None, -1, f"the table of node {nodes[0]}, the join info of {len(ranks)} ranks, cannot "
                               f"be sent ({exc.reason}); span fewer groups across nodes (the manifest's groups), or "
                               "run fewer ranks per job", exit_code=EXIT_HANDSHAKE)
                    return
            for nodes, frames in encoded:
                for node in nodes:
                    self._send_frames(self.nodes[node].ident, frames)

    def _joins_needed(self, joins: dict[int, dict[str, bytes]]) -> dict[int, tuple[int, ...]]:
        """node -> the ranks of `joins` whose join info its ranks use: those that are member 0 of an instance of a group
        with a member on that node (its own ranks' included: its head leaves them out, its ranks have their offers)."""
        needed: dict[int, set[int]] = {n: set() for n in range(self.nnodes)}
        for instances in self.groups.values():
            for members in instances:
                if members and members[0] in joins:
                    for node in {m // self.local_world_size for m in members}:
                        needed[node].add(members[0])
        return {n: tuple(sorted(ranks)) for n, ranks in needed.items()}

    def _on_held(self, node: int, msg: jobwire.NodeHeld) -> None:
        now = time.monotonic()
        lo, hi = node * self.local_world_size, (node + 1) * self.local_world_size
        held: dict[tuple[str, int], dict[int, float]] = {}
        for t, n, r, w in zip(msg.topics, msg.rounds, msg.ranks, msg.waits):
            if lo <= r < hi:
                held.setdefault((t, n), {})[r] = now + w
        before = self.held.get(node, {})
        self._unhold(before)
        for key, ranks in held.items():
            self._held_at.setdefault(key, {}).update(ranks)
        self.held[node] = held
        self._crossed_due = True
        if self.left:
            self._check_left([*held, *(k for k in before if k not in held)])

    def _unhold(self, held: dict[tuple[str, int], dict[int, float]]) -> None:
        """Take a node's held votes `held` out of the by-step index."""
        for key, ranks in held.items():
            at = self._held_at.get(key)
            if at is not None:
                for r in ranks:
                    at.pop(r, None)
                if not at:
                    del self._held_at[key]

    def _on_vote(self, node: int, msg: jobwire.NodeVote) -> None:
        key = (msg.topic, msg.round)
        held = self.held.get(node)
        if held and key in held:  # the node's votes in this step are here now
            self._unhold({key: held.pop(key)})
        if key in self.expired:  # a late voter of a step that timed out gets the same verdict
            self._send_frames(self.nodes[node].ident, self.expired[key])
            return
        step = self.steps.get(key)
        if step is None:
            voters = step_voters(msg.topic, self.world_size, self.groups, self.local_world_size)
            if voters is None:
                self._stop(node, msg.ranks[0] if msg.ranks else -1,
                           f"a vote on {msg.topic!r} names no group instance of the manifest", exit_code=EXIT_JOB)
                return
            step = self.steps[key] = _Step(voters=voters)
        now = time.monotonic()
        group_step = msg.topic.startswith(GROUP_PREFIX)
        for r, v, w in zip(msg.ranks, msg.values, msg.waits):
            step.values[r] = v
            step.until[r] = now + w
            step.unheard.discard(r)
            if group_step and step.timeout_s is None and isinstance(v, dict):
                t = v.get("timeout_s")
                # a finite time only: NaN never compares greater, and that step would never time out here
                step.timeout_s = float(t) if isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 else None
        if msg.waits:
            step.latest = max(step.latest, now + max(msg.waits))
        if not step.unheard:
            del self.steps[key]
            self._decide(key, step, missing=())
            return
        if self.left:
            self._check_left((key,))
        self._crossed_due = True

    def _heard(self) -> tuple[dict[tuple[str, int], dict[int, Any]], dict[tuple[str, int], dict[int, float]]]:
        """Every undecided step's votes the root knows of, those held at heads (value None) with the rest, and until
        when each voter waits: ({step: {rank: value}}, {step: {rank: until}})."""
        boxes: dict[tuple[str, int], dict[int, Any]] = {key: dict(step.values) for key, step in self.steps.items()}
        until = {key: dict(step.until) for key, step in self.steps.items()}
        for key, ranks in self._held_at.items():
            for r, t in ranks.items():
                boxes.setdefault(key, {})[r] = None
                until.setdefault(key, {})[r] = t
        return boxes, until

    def _pending(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """The undecided steps with the ranks not heard from in each (at most _PENDING_SAID steps)."""
        pending = []
        boxes, _ = self._heard()
        for (topic, rnd), box in boxes.items():
            missing = tuple(r for r in self._voters_of(topic) or () if r not in box)
            if missing:
                pending.append((topic, rnd, missing))
        return pending[:_PENDING_SAID]

    def _voters_of(self, topic: str) -> tuple[int, ...] | None:
        if topic not in self._voters:
            if len(self._voters) >= _VOTERS_KEPT:  # topics of many rounds: the cache starts again
                self._voters.clear()
            self._voters[topic] = step_voters(topic, self.world_size, self.groups, self.local_world_size)
        return self._voters[topic]

    def _check_crossed_steps(self, now: float) -> None:
        """Steps that wait for one another's ranks across nodes (node 0's ranks in exchange 'a', node 1's in 'b'):
        each head judges only its own ranks, so such a cycle is the root's to name, as the last vote of it comes.
        The root hears a node's votes in a tray-wide step once all that node's ranks voted in it, or, held at the
        head a while, as the node's NodeHeld; in a group's step, each as it comes. A rank it has not heard from is
        taken for waiting nowhere."""
        if self.stop is not None:
            return
        if len(self.steps) + sum(k not in self.steps for k in self._held_at) < 2:
            return  # one step alone is no cycle: its votes are not copied to find that
        boxes, until = self._heard()
        cycle = crossed_steps(boxes, self._voters_of, range(self.world_size),
                              lambda key, rank: until[key].get(rank, 0.0) > now)
        if cycle:
            nodes = sorted({r // self.local_world_size for _, r in cycle})
            if len(nodes) == 1:
                self._stop(nodes[0], cycle[0][1], describe_cycle(cycle))
            else:
                self._stop(None, cycle[0][1], f"across nodes {','.join(map(str, nodes))}: {describe_cycle(cycle)}")

    def _check_left(self, keys: Iterable[tuple[str, int]] | None = None) -> None:
        """A step some ranks wait in whose voters include a rank that left (exited 0, closed its tray) without
        voting can never be decided: the job stops now, naming that rank, not when the waiters' timeouts pass.
        `keys`: the steps to look at (a vote's, a node's held ones), every undecided one when None (a rank left).
        NOTE: a pass over the ranks that left, not over each step's votes: a vote after a rank left copied every
        undecided step (O(ranks of the job) per vote, at every node's vote of a job-wide step)."""
        now = time.monotonic()
        if keys is None:  # in the order the steps came (the root cause named is the same from run to run)
            keys = [*self.steps, *(k for k in self._held_at if k not in self.steps)]
        for key in keys:
            step = self.steps.get(key)
            held = self._held_at.get(key, {})  # votes held at heads too: a node's other rank may never come
            if not ((step is not None and step.latest > now) or any(t > now for t in held.values())):
                continue  # every rank that voted gave the step up (a caught timeout): nobody waits in it
            if step is not None:  # through the fewer of the ranks that left and those the step still waits for
                few, many = (self.left, step.unheard) if len(self.left) <= len(step.unheard) else \
                    (step.unheard, self.left)
                gone = [r for r in few if r in many and r not in held]
            else:
                voters = self._voters_of(key[0]) or ()
                gone = [r for r in self.left if r not in held and r in voters]
            if gone:
                r = min(gone)
                waiting = [*(step.values if step is not None else ()), *held]
                self._stop(r // self.local_world_size, r, f"rank {r} {self.left[r]} {never_joined(waiting, *key)}")
                return

    def _decide(self, key: tuple[str, int], step: _Step, missing: tuple[int, ...]) -> None:
        decision = jobwire.JobDecision(token=self.token, topic=key[0], round=key[1], ranks=step.voters,
                                       values=tuple(step.values.get(r) for r in step.voters), missing=missing,
                                       waited_s=time.monotonic() - step.t0)
        try:
            frames = jobwire.frames_of(decision.to_msgpack(self.limit))
        except WireError as exc:
            self._stop(None, -1, f"step {key[0]!r} (round {key[1]}): the decision for {len(step.voters)} ranks "
                       f"cannot be sent ({exc.reason}); vote smaller values")
            return
        if missing:
            self.expired[key] = frames
        for n in sorted({r // self.local_world_size for r in step.voters}):
            if n in self.nodes:
                self._send_frames(self.nodes[n].ident, frames)

    def _failed_handshakes(self, count: int) -> str:
        """'3 connections failed the CURVE handshake from 10.0.0.7', addresses as far as they are known:
        ZAP gives the address of a refused key, but a peer without the root's key fails before ZAP. The
        addresses are all those known so far (`count` may be the latest few failures only)."""
        text = f"{count} connection{'s' if count != 1 else ''} failed the CURVE handshake from "
        known = ", ".join(self.zap.refused)
        if self.handshake_failures > self.auth_failures:
            return text + (f"{known} and " if known else "") + "addresses libzmq does not report"
        return text + (known or "addresses libzmq does not report")

    def _log_handshake_failures(self, *, now: bool = False) -> None:
        """One stderr line for the failures not yet logged, at most every HANDSHAKE_LOG_INTERVAL_S
        (`now`: regardless of the interval, as the root closes)."""
        new = self.handshake_failures - self._failures_logged
        t = time.monotonic()
        if new == 0 or (not now and self._last_failure_log is not None
                        and t - self._last_failure_log < HANDSHAKE_LOG_INTERVAL_S):
            return
        self._last_failure_log = t
        self._failures_logged = self.handshake_failures
        missing = self.missing_nodes()
        who = (f"a stranger, or a node of this job started with another TRAY_JOB_TOKEN (node(s) "
               f"{','.join(map(str, missing))} not joined yet)" if missing and self.stop is None else "not of this job")
        say(f"root: ignored: {self._failed_handshakes(new)} ({who}; {self.handshake_failures} so far on "
            f"{self.endpoint})")

    # --- time -------------------------------------------------------------------------------------
    def missing_nodes(self) -> list[int]:
        """The nodes that have not joined (yet), those refused and told why left out."""
        return [n for n in range(self.nnodes) if n not in self.nodes and n not in self.told]

    def _missing_nodes(self) -> str:
        return ",".join(map(str, self.missing_nodes())) or "none"

    def tick(self) -> None:
        """Heartbeats out; lost nodes, late joins and timed-out group steps named."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._tick()
        finally:
            self.busy_s += time.perf_counter() - t0
            self.busy_cpu_s += time.thread_time() - c0

    def summary(self) -> str:
        return (f"{self.nnodes} nodes, {self.messages_in} messages in, {self.messages_out} out, "
                f"{self.busy_s * 1e3:.1f} ms handling them ({self.busy_cpu_s * 1e3:.1f} ms of CPU)")

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._beats_looked_at >= _BEAT_LOOK_S:
            self._beats_looked_at = now
            # NOTE: a node the root sent anything in the last HEARTBEAT_INTERVAL_S - _BEAT_LOOK_S has heard from it: its
            # beat is left out (at 1,000 nodes in lockstep, 2,000 messages a second beside the steps'); looked at every
            # _BEAT_LOOK_S, so each node hears from the root every period at most all the same
            quiet = now - (HEARTBEAT_INTERVAL_S - _BEAT_LOOK_S)
            frames = None
            for state in self.nodes.values():
                if state.last_sent <= quiet:
                    if frames is None:
                        self._seq += 1
                        frames = jobwire.frames_of(jobwire.Beat(token=self.token, node_rank=0,
                                                                seq=self._seq).to_msgpack())
                    self._send_frames(state.ident, frames)
        self._log_handshake_failures()
        if self.stop is not None or self.ended:
            return
        if len(self.nodes) < self.nnodes and now - self.t_start > self.join_timeout_s:
            late = (f"node(s) {self._missing_nodes()} did not join the root at {self.job.endpoint} within "
                    f"{self.join_timeout_s:g} s (--timeout-s; raise it if nodes start later than that)")
            if self.auth_failures or self.handshake_failures >= TOKEN_FAILURES:
                why = (f"{self._failed_handshakes(self.handshake_failures)}: a head started with another "
                       "TRAY_JOB_TOKEN? (every node needs the same one)")
            elif self.handshake_failures:
                why = (f"{self._failed_handshakes(self.handshake_failures)}: a head that stopped while connecting, "
                       "or one started with another TRAY_JOB_TOKEN")
            elif unread := [text for ident, text in self.unjoined.items() if _node_of(ident) not in self.nodes]:
                why = f"the root could not read what {len(unread)} head(s) sent: {'; '.join(unread[:3])}"
            elif refused := [self.strangers[n] for n in self.missing_nodes() if n in self.strangers]:
                why = f"refused: {'; '.join(refused)}"
            else:
                why = (f"not started, or ended before it joined (its head killed or interrupted as it started: its "
                       f"output says), a wrong root address (from {host_source(self.job.source)}), or a firewall")
            self._stop(None, -1, f"{late}; {why}", exit_code=EXIT_HANDSHAKE)
            return
        if len(self.nodes) < self.nnodes and now - self._last_wait_said >= _WAIT_SAID_EVERY_S and \
                now - self.t_start >= _WAIT_SAID_EVERY_S:
            self._last_wait_said = now
            say(f"root: waiting for node(s) {self._missing_nodes()} at {self.job.endpoint} ({len(self.nodes)} of "
                f"{self.nnodes} joined, {now - self.t_start:.0f} s; gives up after --timeout-s "
                f"{self.join_timeout_s:g} s)")
        if now >= self._lost_check_at:
            self._check_lost(now)
            if self.stop is not None:
                return
        if self._crossed_due and now - self._crossed_at >= _CROSSED_EVERY_S:
            self._crossed_due, self._crossed_at = False, now
            self._check_crossed_steps(now)
            if self.stop is not None:
                return
        for key, step in list(self.steps.items()):
            if step.timeout_s is not None and now - step.t0 > step.timeout_s:
                del self.steps[key]
                self._decide(key, step, missing=tuple(r for r in step.voters if r not in step.values))

    def _check_lost(self, now: float) -> None:
        """Stop the job naming the first node silent past the heartbeat timeout. NOTE: a node's last_seen only grows,
        so none can pass the timeout before the oldest one does: the next look is due then, not at every turn of the
        loop (a look is one pass over every node, and a busy root turns its loop once per message or so)."""
        limit = self.job.node_heartbeat_timeout_s
        oldest = now
        for n, state in sorted(self.nodes.items()):
            if state.done:
                continue
            silent = now - state.last_seen
            if silent > limit:
                j = state.join
                self._stop(n, -1, f"node {n} ({j.hostname}, head pid {j.pid}) lost: no heartbeat for {silent:.1f} s "
                           f"(timeout {limit:.1f} s): its head was killed or stopped, its machine is down, or the "
                           "network is cut")
                return
            oldest = min(oldest, state.last_seen)
        self._lost_check_at = oldest + limit

    def stop_job(self, node: int, summary: str) -> None:
        """Stop the job from the root's own node (its head was interrupted): `summary` is the root cause."""
        self._stop(node, -1, summary)

    # --- sending ----------------------------------------------------------------------------------
    def _stop(self, node: int | None, rank: int, summary: str, *, report: str = "", tail: tuple[str, ...] = (),
              exit_code: int = EXIT_JOB) -> None:
        """The first failure anywhere becomes the job's root cause; later ones are only counted."""
        if self.stop is not None:
            return
        if node is not None and rank >= 0:
            # the ranks the failure missed: a wait's, or those the undecided steps wait for (a step a rank gave up,
            # whose own message cannot name them: the root can, and their nodes)
            missed = BarrierTimeout.missing_in(summary)
            if not missed and NO_DECISION in summary:
                missed = sorted({r for p in self._pending() for r in p[2]})
                if missed:
                    summary += f"; the step waited for {ranks_by_node(missed, self.local_world_size)}"
            # NOTE: first, the node's silence: the likelier cause, where the failed wait could only guess (a rank
            # slower, or of a longer timeout)
            if silent := self._silent_nodes_among(missed):
                nodes = "it" if silent.count("has been silent for") == 1 else "them"
                summary = f"{silent}; what waited for {nodes}, on node {node}: {summary}"
        stop = jobwire.JobStop.bounded(
            token=self.token, node_rank=node if node is not None else -1, rank=rank, summary=summary, report=report,
            tail=tuple(tail), exit_code=max(1, exit_code))
        # the steps still undecided, with the ranks not heard from in each: every head prints them with the cause
        pending = self._pending()
        self.stop = dataclasses.replace(stop, pending_topics=tuple(p[0] for p in pending),
                                        pending_rounds=tuple(p[1] for p in pending),
                                        pending_missing=tuple(p[2] for p in pending))
        self._broadcast(self.stop)

    def _silent_nodes_among(self, ranks: list[int]) -> str:
        """What the root knows of the nodes of `ranks` (those a failed wait missed) that it has not heard from for
        two heartbeats and more: a wait can run out before such a node's heartbeat timeout does, and the node's
        silence is then the likelier cause. "" when every such node is heard from."""
        now = time.monotonic()
        said = []
        for n in sorted({r // self.local_world_size for r in ranks}):
            state = self.nodes.get(n)
            if state is None or state.done or (silent := now - state.last_seen) <= _NODE_LATE_S:
                continue
            j = state.join
            held = [str(r) for r in ranks if r // self.local_world_size == n]
            whom = f"{'rank' if len(held) == 1 else 'ranks'} {','.join(held)}"
            said.append(f"node {n} ({j.hostname}, head pid {j.pid}), which holds {whom}, has been silent for "
                        f"{silent:.1f} s (its head beats every {HEARTBEAT_INTERVAL_S:g} s; lost after "
                        f"{self.job.node_heartbeat_timeout_s:g} s): its head was probably killed or stopped, or its "
                        "machine or network is down")
        return "; ".join(said)

    def _broadcast(self, msg: Any) -> None:
        frames = jobwire.frames_of(msg.to_msgpack(self.limit))  # once for every node
        for state in self.nodes.values():
            self._send_frames(state.ident, frames)

    def _send(self, ident: bytes, msg: Any) -> None:
        self._send_frames(ident, jobwire.frames_of(msg.to_msgpack(self.limit)))

    def _send_frames(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            # NOTE: a large message (the table, a decision of many ranks) goes to every node as the one bytes object,
            # not a copy per node: 2.5 MB x 1,000 nodes was 2.5 GB copied by the root (bench/root_scale.py)
            # NOTE: the parts sent one by one with plain int flags: send_multipart combines pyzmq's enum flags per part
            copy = len(frames[-1]) < _COPY_BELOW
            self.sock.send(ident, _NOBLOCK_MORE)
            for part in frames[:-1]:
                self.sock.send(part, _NOBLOCK_MORE)
            self.sock.send(frames[-1], _NOBLOCK, copy=copy)
            node = self.by_ident.get(ident)
            if node is not None:  # a member's
                self.nodes[node].last_sent = time.monotonic()
            self.messages_out += 1
        except zmq.ZMQError:  # the node is gone or not keeping up; its silence is what gets reported
            pass

    def close(self) -> None:
        self._log_handshake_failures(now=True)  # none goes unsaid
        for s in (getattr(self, "monitor", None), self.sock):
            if s is not None:
                s.close()
        self.zap.close()
