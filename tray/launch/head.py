"""The head: spawn the ranks, run the rendezvous (ROUTER), coordinate votes, supervise, tear down.

The first failure (exit code, signal, error report, missed heartbeat, handshake timeout) is the root
cause; the head stops every other rank, prints the root cause first and exits non-zero.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from tray.collectives.early import StartJoin
from tray.envvars import join_collectives, stop_signals
from tray.errors import BarrierTimeout, TrayError, WireError
from tray.handshake import HEARTBEAT_INTERVAL_S, STACK_DUMP_SIGNAL_OFFSET
from tray.handshake.steps import (
    GROUP_PREFIX,
    NO_DECISION,
    crossed_steps,
    describe_cycle,
    describe_step,
    never_joined,
    step_voters,
)
from tray.launch.jobdir import JobDir, SetupError, make_job_dir
from tray.launch.output import Routing, stamp
from tray.launch.pick import devices_for, shared_note
from tray.launch.ports import MASTER_ADDR, PortReservation
from tray.launch.shm import mapped_collective_shm, record_shm, remove_shm
from tray.launch.spawn import (
    OutputPump,
    check_log_dir,
    ensure_fd_limit,
    ensure_proc_limit,
    open_log,
    rank_env,
    say,
    spawn_rank,
)
from tray.launch.spec import EXIT_HANDSHAKE, EXIT_USAGE, Failure, RankProcess, RankState, TrayResult, TraySpec
from tray.launch.watchdog import REAP_TIMEOUT_S, SETTLE_S, Watchdog, kill_group, stat_fields, term_group
from tray.manifest import Manifest, builtin_manifest, load_manifest
from tray.manifest.builtin import BUILTIN_PATH
from tray.numa import NumaPlacement, placement_for
from tray.text import is_digits, printable, ranks_text, text_path

if TYPE_CHECKING:
    import psutil
    import zmq

    from tray.handshake import wire
else:  # NOTE: loaded on first use, after the ranks are spawned (tray.lazy): the head's start is on every rank's path
    from tray.lazy import lazy_import

    psutil = lazy_import("psutil")
    zmq = lazy_import("zmq")
    wire = lazy_import("tray.handshake.wire")

_POLL_MS = 20
_REPORTER_EXIT_S = 1.0  # how long a rank that reported its exception may take to end by itself before its SIGTERM
_ADOPTED_EVERY_S = 0.5  # how often the head looks for orphans it adopted, to tell its watchdog of them
PHASES = ("head", "spawn", "import", "manifest", "device", "allocate", "offer", "table", "import_peers", "join",
          "ready")
# A rank's phases up to `run`, in the order it passes them. Heartbeats travel on their own socket and
# may arrive after a later step's message: a heartbeat never moves a rank back along this order.
_HANDSHAKE_ORDER = {name: i for i, name in enumerate(
    ("spawn", "start", "manifest", "device", "allocate", "offer", "table", "import_peers", "join", "ready",
     "running"))}
# NOTE: how often the head reads its ranks' /proc/<pid>/maps for the collectives' segments (a few small reads).
SHM_SAMPLE_S = 1.0
# NOTE: after every rank and leftover is gone, the output still in the pipes is read for this long
# at most; a pipe that some escaped process holds open cannot delay the verdict longer.
DRAIN_S = 1.0
# a rank's error file is read up to this (its report: 16 kB of message and 64 kB of traceback, as JSON)
ERROR_FILE_MAX_NBYTES = 1 << 20
# NOTE: a rank whose heartbeat is this late (two periods and some) is not being scheduled or holds the GIL: from here
# the head counts the CPU its process uses; any (two clock ticks or more) is busy, not frozen: a stopped process, or
# one asleep in a call that holds the GIL, uses none, while a busy one on a machine with more ranks than cores may
# get far less than a whole CPU (on 2 cores under load, under half: it was judged frozen then)
_LATE_S = 2 * HEARTBEAT_INTERVAL_S + 0.5
_CLOSED_ITS_TRAY = "closed its tray (rank.close(), or the end of its `with tray.init()` block)"
# a rank whose fd socket reset under a peer has died, or is dying: its exit is seen within this (else the report
# stands as the root cause)
_DEATH_SEEN_WITHIN_S = 0.5
_BUSY_CPU_S = 0.02
# NOTE: how long the head waits, after a rank died of SIGTERM/SIGINT, for the same signal to reach itself
_SIGNAL_SIBLING_S = 0.2
# the exit statuses of a rank killed by one of the signals that stop a tray (envvars.stop_signals): one the head got
# too is the whole tray's interruption, not the rank's failure
_STOP_DEATHS = (-signal.SIGTERM, -signal.SIGINT, -signal.SIGQUIT, -signal.SIGHUP)
_LOOK_GAP_S = 1.0  # looks this far apart (the head did not run between them) time no stop
_EXIT_TIE_S = 0.02  # failures seen this close are one moment (a turn of the loop): the order seen may be wrong
_MIN_WINDOW_S = 0.5  # CPU time is counted in clock ticks (10 ms): a shorter window would misjudge
# a verdict that names a late rank samples its CPU this long when the tick has not yet (two ticks of a busy CPU, also
# when it gets half of one)
_CPU_SAMPLE_S = 0.1
# NOTE: how long the head lets a rank's stack dump reach the output pump before the teardown signals the rank (a
# standard signal pending beside a real-time one is delivered first)
_STACK_DUMP_WAIT_S = 0.3
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
_libc = ctypes.CDLL(None, use_errno=True)


_say = say


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


# how long the teardown waits for the thread making the NCCL ids (loading NCCL takes ~0.1 s)
_IDS_JOIN_S = 10.0


def _init_driver() -> None:
    from tray.backend.cuda import visible_gpu_count

    visible_gpu_count()


class _Subreaper:
    """This process a child subreaper while any tray of it runs: orphans of the ranks' descendants reparent to the
    head (found at teardown). Counted: of two trays at once, the first to end left the other's orphans to pid 1; and
    put back as it was (a process that was a subreaper already stayed one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trays = 0
        self._before = 0

    def take(self) -> None:
        with self._lock:
            if self._trays == 0:
                was = ctypes.c_int(0)
                self._before = was.value if _libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0) == 0 \
                    else 0
                _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            self._trays += 1

    def release(self) -> None:
        with self._lock:
            self._trays -= 1
            if self._trays == 0:
                _libc.prctl(PR_SET_CHILD_SUBREAPER, int(bool(self._before)), 0, 0, 0)


_subreaper = _Subreaper()


def _check_log_dir(log_dir: str, ranks: range) -> None:
    """--log-dir made, and each rank's log file opened (created if new), before any rank starts: a file that cannot
    be one (a link, another user's) is a SetupError here, not an error of the running tray."""
    try:
        check_log_dir(log_dir)
        for r in ranks:
            open_log(log_dir, r).close()
    except OSError as exc:
        if exc.errno == errno.EEXIST and exc.filename:  # a file on the way (make_private_dirs)
            said = f": {exc.filename} is not a directory"
        elif exc.filename:
            said = f" ({exc.filename}): {exc.strerror}"
        else:
            said = f": {exc.strerror}"
        raise SetupError(f"--log-dir {log_dir}: cannot write there{said}; give a directory of yours") from None


def _environ_of(pid: int) -> bytes:
    """Process `pid`'s environment as /proc has it, each entry between NULs; empty when unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"\0" + f.read() + b"\0"
    except OSError:
        return b""


def _own_children() -> set[int]:
    """This process's children now, from /proc (no psutil import on the start's path); empty if unreadable."""
    pids: set[int] = set()
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(pid) for pid in f.read().split())
    except OSError:
        pass
    return pids


@contextlib.contextmanager
def _signals_held() -> Iterator[list[int]]:
    """SIGINT, SIGTERM and SIGHUP (envvars.stop_signals) only note their number in the list yielded; the head acts
    on it where it chooses, and a signal that came is raised as KeyboardInterrupt once the block ends without another
    exception. A KeyboardInterrupt raised by the handler itself lands wherever the head happens to be,
    e.g. inside `Popen.poll` between taking and releasing the Popen's waitpid lock: that rank can then
    never be waited for, and the teardown fails with TimeoutExpired (exit 1 instead of 130). Outside
    the main thread (no signal handlers there) the list stays empty."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    saved: dict[int, Any] = {}
    try:
        for sig in stop_signals():
            # a signal pending now is handled by the old handler first (it may raise: nothing is held yet)
            saved[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
        yield got
    finally:
        interrupted: KeyboardInterrupt | None = None
        for sig, handler in saved.items():
            while True:
                try:
                    signal.signal(sig, handler)
                    break
                except KeyboardInterrupt as exc:  # a signal handled meanwhile by a handler restored before
                    interrupted = exc
        if interrupted is not None:
            raise interrupted
    if got:
        raise KeyboardInterrupt(f"signal {got[0]}")


_WAIT_MARGIN_S = 1.0  # a rank's vote counts as waiting until this long (at most half its wait) before it runs out
_REJECTS_SAID = 20  # refused messages said (and kept in TrayResult.rejected); the rest are counted
_DRAIN_MAX = 256  # messages handled per turn of the loop
_WAIT_SAID_EVERY_S = 10.0  # while ranks have not offered (or said ready), the head says so this often
_GRACE_POLL_S = 0.02  # how often the teardown's grace looks at the ranks and at stop signals
_ADOPTED_PASSES = 5  # the teardown's passes over orphans it adopted (each pass kills their trees)
_SPAWN_SAY_S = 5.0  # a spawn of the ranks that runs longer says how far it got this often
_LOGGED_LONG_BEFORE_S = 1.0  # a rank that logged an exception this long before it died: said with how long
# NOTE: ZMQ_POLLIN and ZMQ_DONTWAIT (zmq.h) as plain ints: pyzmq's zmq.POLLIN and zmq.NOBLOCK are enum flags, and
# each & or | with one makes a new enum member (~3 us), on every message's path
_POLLIN = 1
_NOBLOCK = 1


class Head:
    """One tray launch. `run()` returns a TrayResult and leaves no process, socket or job dir."""

    def __init__(self, spec: TraySpec, placements: list[NumaPlacement] | None = None,
                 restart_count: int = 0, *, rank_base: int = 0, world_size: int | None = None) -> None:
        self.spec = spec
        self.restart_count = restart_count
        self.master_port: PortReservation | None = None
        # A head of a job of several trays runs global ranks rank_base..rank_base+nprocs-1 of world_size.
        self.rank_base = rank_base
        self.world_size = world_size or spec.nprocs
        self.manifest: Manifest = load_manifest(spec.manifest) if spec.manifest else builtin_manifest()
        # this head's ranks are one node of the job: its nprocs is the job's local world size; --var without
        # --manifest is for the manifest the ranks load (tray.init(manifest=...)), which the head takes later
        self.resolved = self.manifest.resolve(self.world_size, dict(spec.vars) if spec.manifest else None,
                                              spec.nprocs)
        self.placements = placements or [placement_for(None)] * spec.nprocs
        # local rank -> GPU; `shared`: some ranks share one (--share-gpus), each then its own host to NCCL
        self.devices = devices_for(spec.backend, spec.nprocs, spec.share_gpus)
        self.shared = len(set(self.devices)) < len(self.devices)
        self.routing = Routing(log_dir=spec.log_dir, tee=spec.tee, redirects=spec.redirects,
                               ranks=spec.local_ranks_filter, quiet=spec.quiet, rank_base=rank_base)
        self.token = secrets.token_hex(16)
        self.procs: list[RankProcess] = []
        self._exits = _ExitOrder((), None)  # replaced by the loop's, which watches the ranks' exits
        self._closed_looked_at = 0.0  # when _check_closed_ranks last looked (monotonic)
        self.offers: dict[int, wire.Offer] = {}
        self.ready: dict[int, wire.Ready] = {}
        self.votes: dict[tuple[str, int], dict[int, object]] = {}
        self.failure: Failure | None = None
        self.rejected: list[str] = []
        self._rejects = 0  # messages refused (only the first _REJECTS_SAID are kept and said)
        self._waits_until: dict[tuple[str, int], dict[int, float]] = {}  # step -> rank -> until when it waits there
        self._last_vote: dict[int, tuple[str, int]] = {}  # rank -> the step of its latest vote
        # the identities the ranks connect with (client.py): their main socket's and their heartbeat's
        self._idents = {f"rank-{r}{end}": r for r in range(rank_base, rank_base + spec.nprocs) for end in ("", ".hb")}
        self.t_go: float | None = None
        self.t_table: float | None = None
        self.t_spawned = 0.0
        self.t_start = time.monotonic()
        self.shm: set[str] = set()
        self._t_shm = 0.0
        self._job_path: Path | None = None  # the job dir, once made
        self._failed_first = False  # the loop ended on a failure, before any stop signal came
        self._watchdog: Watchdog | None = None
        self._children_before: set[int] = set()  # this process's children before the tray (run_tray in a program)
        self._adopted_told: set[int] = set()  # adopted orphans the watchdog was told of (_note_adopted)
        self._reporters: set[int] = set()  # ranks that reported their exception: each is ending by itself
        self._adopted_next = 0.0  # when to look for newly adopted ones (monotonic)
        self._signals: list[int] = []  # SIGINT/SIGTERM noted while run() holds them (_signals_held)
        self._failed_said = False  # the root cause's line is out (at the teardown's start)
        self.t_first_contact: float | None = None  # when the head first heard a rank (monotonic): the handshake's clock
        self._no_contact_said = False
        self._last_wait_said = 0.0  # when the head last said whom the handshake waits for (monotonic)
        self._busy_said: set[int] = set()  # ranks said to be busy without heartbeats
        # the ranks join NCCL while they start (tray/collectives/early.py); the head's time making the ids
        # the ranks' collectives join while they start (tray/collectives/early.py), or at their first use
        self.start_join = StartJoin(self._join_mode(), spec.backend, self.resolved,
                                    range(self.rank_base, self.rank_base + spec.nprocs))

    # --- lifecycle ------------------------------------------------------------------------------
    def run(self) -> TrayResult:
        """Spawn, supervise, tear down. Raises SetupError (the jobs root, the job dir, the head's
        socket or its watchdog cannot be made) after stopping whatever was started, and
        KeyboardInterrupt after the teardown when SIGINT or SIGTERM came: from before the job dir is
        made to the teardown's end, a signal is noted and acted on between two turns of the loop."""
        try:
            with _signals_held() as self._signals:
                job_dir = self._run()
        except KeyboardInterrupt:
            if not self._failed_first or self._job_path is None:
                raise
            # the tray had failed before the signal came (a Ctrl-C during a slow teardown, Slurm's SIGTERM): its root
            # cause is what the user needs, said whole, and its exit code stands
            sig = _signal_name(-self._signals[0]) if self._signals else "a signal"
            _say(f"{sig} during the teardown of a tray that had failed before it: the root cause follows")
            result = self._result(self._job_path)
            result.interrupted = sig
            return result
        return self._result(job_dir)

    def _run(self) -> Path:
        """run() with the signals held; returns the job dir (removed by now)."""
        ensure_fd_limit(self.spec.nprocs)
        ensure_proc_limit(self.spec.nprocs)
        if self.spec.log_dir:
            _check_log_dir(self.spec.log_dir, range(self.rank_base, self.rank_base + self.spec.nprocs))
        try:
            os.getcwd()
        except FileNotFoundError:
            raise SetupError("the current directory was removed: the ranks (and the tray's watchdog) would start "
                             "in a directory that is gone; cd to one that exists") from None
        job = make_job_dir(self.spec.nprocs)
        self._job_path = job.path
        self._children_before = _own_children()
        endpoint = f"ipc://{job.path}/head.sock"
        ctx = sock = watchdog = pump = None
        ids_thread: threading.Thread | None = None
        _subreaper.take()
        try:
            self.master_port = self._reserve_master_port(job.root_fd)  # held until the tray is down
            try:
                watchdog = self._watchdog = Watchdog(job.root, job.path.name, job.lock_fd)
            except OSError as exc:
                raise SetupError(f"cannot start the tray's watchdog ({sys.executable}): {exc.strerror}") from None
            note = shared_note(self.devices, self.rank_base) if self.shared else None
            if note and self.restart_count == 0:
                _say(note)  # even when quiet: a bench's timings of shared GPUs must not pass for real ones
            self.t_start = time.monotonic()
            t0 = time.time()
            self._spawn_all(job.path, endpoint, watchdog.pgid)
            self.t_spawned = time.time() - t0
            self.start_join.start(watchdog.pgid)  # before any thread of the head: a fork from a lone thread
            pump = OutputPump(self.procs, self.routing)
            if self.spec.backend == "cuda":
                # NOTE: with the driver initialised in a live process (here, the head), each rank's
                # cuInit + context costs ~0.7 s instead of ~1.5 s (measured on 4x H200, no persistence
                # daemon). Started after the spawn: no thread may exist while ranks are forked.
                threading.Thread(target=_init_driver, name="tray-driver", daemon=True).start()
            if self.start_join.wanted:
                # the ids read on a thread, after the driver's is started: the head binds its socket meanwhile
                ids_thread = threading.Thread(target=self.start_join.write, args=(job.path, _say),
                                              name="tray-join-ids", daemon=True)
                ids_thread.start()
            ctx = zmq.Context()
            sock = _bind_router(ctx, endpoint, job)
            self._start_job(ctx, sock)
            self._loop(sock, job)
            self._failed_first = self._failed_first or (self.failure is not None and not self._signals)
            self._after_loop()
        finally:
            # NOTE: each step of the cleanup runs whatever an earlier one raised (a signal handler of a program that
            # embeds the head, raising in the grace's sleep, once left a rank, the watchdog, the job dir and fds for
            # the process's life); the first exception is raised after the last step
            cut: list[BaseException] = []

            def step(fn: Any, *args: Any) -> None:
                try:
                    fn(*args)
                except BaseException as exc:
                    cut.append(exc)

            step(self._teardown, job, watchdog, pump)
            if cut:  # the teardown cut short: whatever it had not stopped is killed now
                step(self._kill_left, watchdog, pump)
            step(self._close_job)
            if sock is not None:
                step(sock.close)
            if ctx is not None:
                step(ctx.term)
            if ids_thread is not None:
                step(ids_thread.join, _IDS_JOIN_S)  # it writes into the job dir: done before the dir goes
            step(self.start_join.close)
            if self.master_port is not None:
                step(self.master_port.close)  # before the job: its lock file is removed through the jobs root's fd
            step(job.close)
            # NOTE: the watchdog released last: a head SIGKILLed before the job dir is gone is cleaned up after (it
            # was released first, and a kill between the two left the job dir behind)
            if watchdog is not None:
                step(watchdog.done)
            step(_subreaper.release)
            if cut:
                raise cut[0]
        return job.path

    def _kill_left(self, watchdog: Watchdog | None, pump: OutputPump | None) -> None:
        """After a teardown cut short by an exception: every rank still running, and the rest of the tray's process
        group, SIGKILLed and reaped; the output pump stopped."""
        for p in self.procs:
            if p.popen.poll() is None:
                with contextlib.suppress(OSError):
                    p.popen.kill()
        if watchdog is not None:
            with contextlib.suppress(OSError):
                kill_group(watchdog.pgid, frozenset({watchdog.popen.pid}))
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(REAP_TIMEOUT_S)
        if pump is not None:
            pump.stop(0.0)

    def _reserve_master_port(self, lock_dir_fd: int) -> PortReservation | None:
        """The ranks' MASTER_PORT on one host: --master-port, else a free one; held while the tray runs."""
        try:
            return PortReservation(port=self.spec.master_port or 0, lock_dir_fd=lock_dir_fd)
        except OSError as exc:
            raise SetupError(f"--master-port {self.spec.master_port}: cannot reserve it on {MASTER_ADDR} "
                             f"({exc.strerror}); choose another, or leave it out (a free port)") from None

    def _spawn_all(self, job_dir: Path, endpoint: str, process_group: int) -> None:
        """Start every rank. A stop signal is acted on between two spawns (the ranks started are stopped by the
        teardown), and a spawn that runs long says its progress every _SPAWN_SAY_S: hundreds of ranks on a few cores
        take minutes to start, each fork waiting for a core."""
        manifest = str(Path(self.spec.manifest).resolve()) if self.spec.manifest else ""
        t0 = time.monotonic()
        next_say = t0 + _SPAWN_SAY_S
        for r in range(self.spec.nprocs):
            self._raise_if_signalled()
            if (now := time.monotonic()) >= next_say:
                next_say = now + _SPAWN_SAY_S
                _say(f"started {r} of {self.spec.nprocs} ranks in {now - t0:.0f} s")
            t_spawn = time.time()
            env = rank_env(self.spec, r, job_dir=job_dir, endpoint=endpoint, token=self.token,
                           manifest=manifest, t_spawn=t_spawn, restart_count=self.restart_count,
                           master_port=self.master_port.port if self.master_port else None, device=self.devices[r],
                           shared_env=self.start_join.shared_gpu_env(self.rank_base + r) if self.shared else None)
            env.update(self._job_env(r))
            env.update(self.start_join.rank_env(job_dir))
            self.procs.append(spawn_rank(self.spec, self.rank_base + r, env, self.placements[r], process_group))

    def _loop(self, sock: zmq.Socket, job: JobDir) -> None:
        """Supervise until every rank exited or one failure is known (the root cause)."""
        extra = self._extra_sockets()
        poller = zmq.Poller()
        for s in (sock, *extra):
            poller.register(s, zmq.POLLIN)
        # NOTE: the order in which ranks exit is seen as it happens (a pidfd per rank in the poll); the exits are
        # judged at the turns in that order: two ranks ending within one turn (one killed, the other ending on the
        # broken connection a moment later) were judged in rank order, and the later, a consequence, could be named
        # the root cause. Judged at the turns still: the last messages of a rank that just exited are read first
        self._exits = _ExitOrder(self.procs, poller)
        try:
            next_turn = 0.0  # when the supervision below runs next (monotonic)
            while not self.failure:
                self._raise_if_signalled()
                ready = dict(poller.poll(max(0, math.ceil((next_turn - time.monotonic()) * 1000))))
                self._exits.note(ready)
                for s in extra:
                    if s in ready:
                        self._on_extra(s)
                self._drain(sock, 0)
                # NOTE: the supervision (children's exits, deadlines, the watchdog, segments, adopted orphans: ~50 us
                # of CPU, most of it waitpid and /proc) runs _POLL_MS apart, not after every batch of messages: with
                # ranks in lockstep that was once per vote, on every step's path (bench/step_latency.py)
                now = time.monotonic()
                if now < next_turn:
                    continue
                next_turn = now + _POLL_MS / 1000
                if extra and not self.failure:
                    self._tick(sock)
                if not self.failure:
                    self._check_children(sock)
                if not self.failure:
                    self._check_deadlines()
                if not self.failure:
                    self._check_watchdog()
                self._sample_shm(job)
                self._note_adopted()
                if self._finished():
                    return
        finally:
            self._exits.close()

    def _check_watchdog(self) -> None:
        """The watchdog ends only when told (done()): one that exited (at its start, say: its interpreter could
        not start) leaves a killed head's ranks behind, so the tray stops, naming it."""
        wd = self._watchdog
        if wd is None or (code := wd.popen.poll()) is None:
            return
        why = "its stderr, above, says why it ended" if code >= 0 else \
            "a signal sent to it, or to the tray's process group"
        self._fail(Failure(None, f"the tray's watchdog (pid {wd.popen.pid}, {sys.executable} -m "
                           f"tray.launch.watchdog) {_how_it_ended(code)}; without it a killed head would leave its "
                           f"ranks running, so the tray stops ({why})",
                           exit_code=EXIT_HANDSHAKE))

    def _drain(self, sock: zmq.Socket, timeout_ms: int) -> None:
        """Handle the messages waiting (the first after up to `timeout_ms`) until a failure is known, at most
        _DRAIN_MAX of them: the loop's supervision, when due, runs between two batches whatever floods the socket."""
        for _ in range(_DRAIN_MAX):
            if self.failure or self._signals:
                return
            if timeout_ms:
                if not sock.poll(timeout_ms, zmq.POLLIN):
                    return
                timeout_ms = 0
            # NOTE: whether a message waits, without a wait, is the socket's EVENTS (what zmq_poll asks it first):
            # sock.poll() makes a Poller each call, ~10 us of the head's CPU per message
            elif not cast(int, sock.getsockopt(zmq.EVENTS)) & _POLLIN:
                return
            ident, payload = self._recv(sock)
            if ident is not None:
                self._on_message(sock, ident, payload)

    def _raise_if_signalled(self) -> None:
        """Leave the loop for the teardown as Ctrl-C would, at a point where no step is half done."""
        if self._signals:
            raise KeyboardInterrupt(f"signal {self._signals[0]}")

    # --- hooks: a head of a job of several trays (tray/launch/node.py) overrides these ------------------
    def _deadline_from_first_contact(self) -> bool:
        """Whether --timeout-s runs from the first rank's contact (one host: ranks may load weights before
        tray.init(), a program may not use the tray at all) rather than from the spawn."""
        return True

    def _join_mode(self) -> str:
        """When the ranks join their groups' collectives (--join-collectives: early, lazy, auto)."""
        return join_collectives(self.spec.join_collectives, os.environ.get("TRAY_JOIN_COLLECTIVES"))

    def _job_env(self, local_rank: int) -> dict[str, str]:
        """Variables a rank gets beyond the tray's own (none on one host)."""
        return {}

    def _start_job(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """After the ranks are spawned and the rank socket `sock` is bound."""

    def _extra_sockets(self) -> list[zmq.Socket]:
        """Sockets the loop polls besides the ranks' (none on one host)."""
        return []

    def _on_extra(self, sock: zmq.Socket) -> None:
        """One of _extra_sockets() is readable."""

    def _tick(self, sock: zmq.Socket) -> None:
        """Every _POLL_MS (at least: a message being handled delays it) when there are extra sockets."""

    def _finished(self) -> bool:
        return all(p.returncode is not None for p in self.procs)

    def _handshake_is_ours(self) -> bool:
        """Whether the handshake deadline names this head's ranks (not when they wait on the job's root)."""
        return True

    def _waited_on_root_s(self) -> float:
        """How long this head's ranks, every one offered, waited on the job's root for the table: not counted against
        their handshake deadline (none on one host)."""
        return 0.0

    def _after_loop(self) -> None:
        """After the loop, before the teardown."""

    def _close_job(self) -> None:
        """After the teardown, before the context ends."""

    def _offers_complete(self, sock: zmq.Socket) -> None:
        """Every local offer arrived and passed validation: hand out the table."""
        self.t_table = time.time()
        table = wire.Table(token=self.token, offers=tuple(self.offers[p.rank] for p in self.procs))
        try:
            data = wire.encode(table, wire.job_message_limit(self.world_size))  # once for every rank, as a decision is
        except WireError as exc:  # each offer within its own limit, all of them together not within the table's
            sizes = {p.rank: _wire_size(self.offers[p.rank]) for p in self.procs}
            worst = max(sizes, key=lambda r: sizes[r])
            self._fail(Failure(worst, f"the table of every rank's offer cannot be sent ({exc.reason}); the largest "
                               f"offer is rank {worst}'s, {sizes[worst]} B: export fewer buffers per rank",
                               exit_code=EXIT_HANDSHAKE))
            return
        for p in self.procs:
            self._send_bytes(sock, f"rank-{p.rank}", data, table.KIND)

    def _all_ready(self, sock: zmq.Socket) -> None:
        """Every local rank reported ready: say go."""
        self.t_go = time.time()
        go = wire.encode(wire.Go(token=self.token, t_go=self.t_go))
        for p in self.procs:
            p.state = RankState.RUNNING
            self._note_phase(p, "running")
            self._send_bytes(sock, f"rank-{p.rank}", go, wire.Go.KIND)
        self._print_timeline()

    def _recv(self, sock: zmq.Socket) -> tuple[str | None, bytes]:
        frames = sock.recv_multipart()
        if len(frames) != 2:
            self._reject_log(frames[0].decode(errors="replace"), f"expected 1 frame, got {len(frames) - 1}")
            return None, b""
        return frames[0].decode(errors="replace"), frames[1]

    # --- messages -------------------------------------------------------------------------------
    def _sender_rank(self, ident: str) -> int | None:
        rank = self._idents.get(ident)  # a rank's own identity: every message but a stranger's
        if rank is not None:
            return rank
        base = ident[:-3] if ident.endswith(".hb") else ident
        if base.startswith("rank-") and is_digits(base[5:]) and \
                self.rank_base <= int(base[5:]) < self.rank_base + self.spec.nprocs:
            return int(base[5:])
        return None

    def _reject_log(self, ident: str, reason: str) -> None:
        """Say a refused message, the first _REJECTS_SAID of them: a flood from outside the tray neither fills the
        terminal nor the head's memory (the rest are counted, and the count said at the end)."""
        self._rejects += 1
        if self._rejects <= _REJECTS_SAID:
            line = f"rejected a message from {printable(ident[:64])}: {reason[:300]}"
            self.rejected.append(line)
            _say(line)
            if self._rejects == _REJECTS_SAID:
                _say(f"further rejected messages are counted, not shown ({_REJECTS_SAID} shown)")

    def _on_message(self, sock: zmq.Socket, ident: str, payload: bytes) -> None:
        rank = self._sender_rank(ident)
        try:
            msg = wire.decode(payload, token=self.token, sender=ident)
        except WireError as exc:
            self._reject_log(ident, exc.reason)
            # NOTE: a Reject carries the token: never to a process outside the tray's identities, nor to one that only
            # took a rank's identity (any process of this user can, before the rank connects or after it left) and
            # has not shown the token itself
            if rank is not None and wire.carries_token(payload, self.token):
                self._send(sock, ident, wire.Reject(token=self.token, reason=exc.reason))
            return
        if rank is None or getattr(msg, "rank", rank) != rank:
            reason = f"identity {ident!r} does not match the rank it claims ({getattr(msg, 'rank', None)})"
            self._reject_log(ident, reason)
            if rank is not None:  # one of the tray's identities claiming another rank is told; a stranger gets nothing
                self._send(sock, ident, wire.Reject(token=self.token, reason=reason))
            return
        proc = self.procs[rank - self.rank_base]
        if isinstance(msg, wire.Heartbeat):
            proc.last_heartbeat = time.monotonic()
            self._note_phase(proc, msg.phase)
        elif isinstance(msg, wire.Offer):
            self._on_offer(sock, proc, msg)
        elif isinstance(msg, wire.Ready):
            self._on_ready(sock, proc, msg)
        elif isinstance(msg, wire.ErrorReport):
            self._note_phase(proc, msg.phase, force=True)
            self._reporters.add(rank)
            if self._fail_on_a_death_first(rank, msg):
                return
            # the failure is known now, before the notes' sampling: a stop signal meanwhile came after it
            clean = not self._signals
            t_report = time.monotonic()
            notes: tuple[str, ...] = ()
            # any wait on ranks that timed out (a barrier's, the low-latency allreduce's: errors.WaitedForRanks) says
            # whom it missed: the head says what each is doing and has those still running write their stacks
            late = [self.procs[r - self.rank_base] for r in BarrierTimeout.missing_in(msg.message)
                    if 0 <= r - self.rank_base < len(self.procs)]
            more = "give barriers more time (--barrier-timeout-s S, TRAY_BARRIER_TIMEOUT_S or the manifest's " \
                   "barrier_timeout_s)"
            if not late and msg.error_type == "HandshakeError" and NO_DECISION in msg.message:
                # a tray-wide step it gave up: the head knows who never voted in it (its ranks; the root's stop
                # names those of other nodes)
                late, step = self._not_voted_beside(rank)
                more = f"give the step more time (the timeout_s of {step})"
            if late:
                self._sample_cpu(late)
                notes = tuple(self._status(p, more) for p in late)
                # faulthandler writes a rank's stack from its signal handler, also while a call holds the GIL: every
                # live rank that reached the head is asked (a stopped one writes nothing)
                reports = self._dump_stacks([p for p in late if p.popen.poll() is None and p.last_heartbeat is not None
                                             and p.phase != "bye"], sock)
                notes += self._waits_of_the_waited(rank, t_report, reports)
            said = f"{msg.error_type}: {msg.message}" if msg.message else f"{msg.error_type} (no message)"
            # a manifest the rank could not load, or a tray.init() it called wrongly: the user's input, said in one
            # line and exit 2 as the head's own usage errors (the rank's error report, tray's frames, stays in its
            # log: --log-dir)
            starting = _HANDSHAKE_ORDER.get(msg.phase, 99) < _HANDSHAKE_ORDER["running"]
            users = _users_input(msg.error_type, msg.phase)
            # a rank whose own start-up wait ran out first (tray.init(timeout_s=...) shorter than --timeout-s): the
            # tray did not form, as when the head's deadline passes
            formed = not (starting and msg.error_type in ("HandshakeError", "WireError"))
            code = EXIT_USAGE if users else (1 if formed else EXIT_HANDSHAKE)
            first = self.failure is None
            self._fail(Failure(rank, f"rank {rank} reported {said}",
                               report="" if users else f"phase {msg.phase}\n{msg.traceback}", tail=tuple(proc.tail),
                               notes=notes, exit_code=code))
            self._failed_first = self._failed_first or (first and clean)
        elif isinstance(msg, wire.Vote):
            self._on_vote(sock, msg)
        elif isinstance(msg, wire.Bye):
            self._note_phase(proc, "bye", force=True)
            self._rank_left(proc, _CLOSED_ITS_TRAY)
            self._check_abandoned_steps()
        else:
            self._reject_log(ident, f"a rank may not send {msg.KIND!r}")

    @staticmethod
    def _note_phase(proc: RankProcess, phase: str, force: bool = False) -> None:
        """Record the rank's phase, unless it is older than what the head already knows (a late
        heartbeat) or the rank said bye."""
        if not force:
            if proc.phase == "bye":
                return
            old, new = _HANDSHAKE_ORDER.get(proc.phase), _HANDSHAKE_ORDER.get(phase)
            if old is not None and new is not None and new < old:
                return
        proc.phase = phase
        proc.phase_at = time.monotonic()

    def _on_offer(self, sock: zmq.Socket, proc: RankProcess, offer: wire.Offer) -> None:
        if proc.rank in self.offers:
            self._reject_log(f"rank-{proc.rank}", "a second offer")
            return
        self.offers[proc.rank] = offer
        proc.state = RankState.OFFERED
        self._note_phase(proc, "table")
        if len(self.offers) < self.spec.nprocs:
            return
        not_adopted = self._adopt_ranks_manifest()
        leaders = {name: [members[0] for members in instances] for name, instances in self.resolved.groups.items()}
        from tray.handshake.validate import validate_offers

        problems = validate_offers(
            [self.offers[p.rank] for p in self.procs], world_size=self.world_size,
            digest=self.manifest.digest, uid=os.getuid(), pids={p.rank: p.pid for p in self.procs},
            group_leaders=leaders, shared_gpus=self.shared,
            manifest_path="" if self.manifest.path == BUILTIN_PATH else os.path.abspath(self.manifest.path),
        )
        if problems:
            problems += [not_adopted] if not_adopted else []
            self._fail(Failure(None, "the offers disagree; nobody proceeds:\n  " + "\n  ".join(problems),
                               exit_code=EXIT_HANDSHAKE))
            return
        self._offers_complete(sock)

    # a head of one host given no --manifest takes the one its ranks loaded; a node of a job of several trays
    # does not (the root checks every node against the manifest each head was given)
    _adopts_ranks_manifest = True

    def _adopt_ranks_manifest(self) -> str:
        """Given no --manifest, take the manifest every rank loaded from one file (tray.init(manifest=...)) once
        that file's digest here is the one they offered; anything else is left to validate_offers to name. Returns
        why a manifest the ranks agree on was not taken ("" when taken or not at issue)."""
        if self.spec.manifest or not self._adopts_ranks_manifest:
            return ""
        digests = {o.manifest for o in self.offers.values()}
        paths = sorted({o.manifest_path for o in self.offers.values()} - {""})
        if len(digests) != 1 or not paths or self.manifest.digest in digests:
            return ""
        (digest,) = digests
        for offered in paths:  # one file, or copies of it (a link, another checkout): the digest says they agree
            path = offered if os.path.isfile(offered) else text_path(offered)
            if not os.path.isabs(path) or not os.path.isfile(path):
                continue  # a rank's offer names it: never a FIFO or a device, whose read would never end
            try:
                manifest = load_manifest(path)
                resolved = manifest.resolve(self.world_size, dict(self.spec.vars), self.spec.nprocs)
            except (TrayError, OSError):
                continue
            if manifest.digest != digest:
                continue
            # an early join planned its groups' ids from the head's manifest before any rank loaded its own: they
            # hold for the ranks' manifest only when it gives every rank the same group instances
            differs = self.start_join.differs(resolved) if self.start_join.wanted else ""
            if differs:
                return (f"the ranks' manifest ({path}) was not taken for the head's: the NCCL ids of the early join "
                        f"(--join-collectives early) were made for the head's groups before the ranks loaded it, and "
                        f"{differs}; pass tray launch --manifest {path} (or --join-collectives lazy)")
            self.manifest, self.resolved = manifest, resolved
            return ""
        return ""

    def _on_ready(self, sock: zmq.Socket, proc: RankProcess, ready: wire.Ready) -> None:
        if proc.rank in self.ready:
            self._reject_log(f"rank-{proc.rank}", "a second ready (go is sent once)")
            return
        if self.t_table is None:
            self._reject_log(f"rank-{proc.rank}", "ready before the table was sent")
            return
        self.ready[proc.rank] = ready
        proc.state = RankState.READY
        self._note_phase(proc, "ready")
        if len(self.ready) < self.spec.nprocs:
            return
        self._all_ready(sock)

    def _on_vote(self, sock: zmq.Socket, vote: wire.Vote) -> None:
        key = (vote.topic, vote.round)
        box = self.votes.setdefault(key, {})
        box[vote.rank] = vote.value
        self._note_wait(key, vote)
        if len(box) < self.spec.nprocs:
            self._check_abandoned_steps(key)
            self._check_crossed_steps()
            return
        del self.votes[key]
        self._forget_waits(key)
        decision = wire.Decision(token=self.token, topic=vote.topic, round=vote.round,
                                 values=tuple(box[r] for r in range(self.spec.nprocs)))
        try:
            data = wire.encode(decision, wire.job_message_limit(self.world_size))
        except WireError as exc:
            # Ranks check their own value's size before voting (wire.vote_limit_nbytes); a rank that
            # skipped the check is named here, and the tray fails like any rank failure.
            sizes = {r: _wire_size(wire.Vote(token=self.token, rank=r, topic=vote.topic, round=vote.round, value=v))
                     for r, v in box.items()}
            worst = max(sizes, key=lambda r: sizes[r])
            said = ", ".join(f"rank {r}: {n} B" for r, n in sorted(sizes.items()))
            self._fail(Failure(worst, f"exchange {vote.topic!r} (round {vote.round}): the decision cannot be "
                               f"sent ({exc.reason}); votes: {said}; rank {worst} sent the largest"))
            return
        for p in self.procs:
            self._send_bytes(sock, f"rank-{p.rank}", data, decision.KIND)

    def _send(self, sock: zmq.Socket, ident: str, msg: wire.Message) -> None:
        self._send_bytes(sock, ident, wire.encode(msg), msg.KIND)

    def _send_bytes(self, sock: zmq.Socket, ident: str, data: bytes, kind: str) -> None:
        try:
            # NOTE: never blocking: a peer that stops reading must not stop the head (its queue holds 1000 messages,
            # far more than a rank is ever sent unread)
            sock.send_multipart([ident.encode(), data], flags=_NOBLOCK)
        except zmq.ZMQError as exc:  # the rank is gone (its exit is the failure we report), or it reads nothing
            rank = self._sender_rank(ident)
            if rank is not None and self.procs[rank - self.rank_base].popen.poll() is not None:
                return  # it exited: that exit is what the tray reports, in its place
            why = "it is not connected to the head (its socket closed)" if exc.errno == zmq.EHOSTUNREACH else str(exc)
            _say(f"could not send {kind} to {ident[:64]}: {why}")

    # --- supervision ----------------------------------------------------------------------------
    def _forming(self) -> bool:
        """Whether the ranks are forming a tray: one of them called tray.init() (the head heard it)."""
        return bool(self.offers) or any(p.last_heartbeat is not None for p in self.procs)

    def _check_children(self, sock: zmq.Socket) -> None:
        # the first exit first: of two failures, the earlier is the cause
        for p, code, notes in self._exits.ended(self.procs):
            p.returncode, p.t_exit = code, time.time()
            p.state = RankState.EXITED if code == 0 else RankState.FAILED
            if code == 0:
                self._drain(sock, 0)  # its last votes may still be in flight: read them before judging the steps
                if self.t_go is not None and not self.failure:
                    self._rank_left(p, "exited with code 0")
                self._check_abandoned_steps()
                if self.failure:
                    return
                continue
            # drain messages first: the rank's error report may still be in flight
            self._drain(sock, 0)
            if self.failure:
                return
            if code in _STOP_DEATHS and self._interrupted_too():
                return  # the signal came to the whole job (Ctrl-C, scancel, a time limit): the loop says so
            self._fail(self._death(p, code, notes))
            return
        self._check_early_exits()

    def _death(self, p: RankProcess, code: int, notes: tuple[str, ...] = ()) -> Failure:
        """The failure of rank `p` that ended with status `code` (non-zero), its error file's report if it left
        one."""
        how = _how_it_ended(code)
        data = self._error_data(self._job_path, p) if self._job_path is not None else None
        if data is not None and _users_input(data.get("error_type"), data.get("phase")):
            # a tray.init() called wrongly, said before its first message: the user's input
            return Failure(p.rank, f"rank {p.rank} reported {data.get('error_type')}: {data.get('message')}",
                           tail=tuple(p.tail), notes=notes, exit_code=EXIT_USAGE)
        logged = ""
        if data is None and self._job_path is not None:
            # no report, but an exception the program caught and logged through sys.excepthook (then exited: a
            # runner's sys.exit(1) after it, say): named with the death
            data = self._error_data(self._job_path, p, "logged")
            if data is not None:
                first = str(data.get("message", "")).splitlines()[0][:200] if data.get("message") else ""
                # NOTE: a program that logged and went on may end much later of something else (the OOM killer):
                # how long before its end it logged says how much the logged exception may have to do with it
                age = (p.t_exit or time.time()) - float(data.get("written_at") or 0.0)
                after = f"{age:.1f} s after logging" if _LOGGED_LONG_BEFORE_S <= age < 10 ** 7 else "after logging"
                logged = f", {after} {data.get('error_type')}" + (f": {first}" if first else "")
        return Failure(p.rank, f"rank {p.rank} (pid {p.pid}) {how} (last phase: {self._phase_of(p)}){logged}",
                       report=_error_report(data), tail=tuple(p.tail), notes=notes)

    def _fail_on_a_death_first(self, rank: int, msg: wire.ErrorReport) -> bool:
        """A rank's error that another rank's death caused (that rank's fd socket reset while this one fetched its
        buffers, say) is not the root cause: the rank that died before the report arrived is (an exit other than
        0, or 0 before the tray was up). A rank the message names ("rank 1's fd socket") is waited for briefly,
        its exit perhaps not seen yet. Fails the tray with that death, the report as a note; False if none."""
        if BarrierTimeout.missing_in(msg.message):
            return False  # a wait that timed out names whom it missed; the head says there whether they are dead
        named = {int(r) for r in re.findall(r"\brank ([0-9]{1,18})'s", msg.message)}
        deadline = time.monotonic() + (_DEATH_SEEN_WITHIN_S if named - {rank} else 0.0)
        while True:
            for p in self.procs:
                if p.rank == rank:
                    continue
                code = p.returncode if p.returncode is not None else p.popen.poll()
                if code is None or (code == 0 and self.t_go is not None):
                    continue
                p.returncode, p.t_exit = code, time.time()
                p.state = RankState.EXITED if code == 0 else RankState.FAILED
                note = (f"rank {rank} then reported {msg.error_type}: {msg.message}",)
                if code == 0:
                    self._fail(Failure(p.rank, f"rank {p.rank} (pid {p.pid}) exited with code 0 before the tray was "
                                       f"up (last phase: {self._phase_of(p)})", tail=tuple(p.tail), notes=note))
                else:
                    self._fail(self._death(p, code, note))
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def _rank_left(self, p: RankProcess, how: str) -> None:
        """Rank `p` takes part in no step any more (it exited 0, or closed its tray): this head judges its own
        steps (_check_abandoned_steps); a node of a job of several also tells the root, which judges the job's."""

    def _check_abandoned_steps(self, key: tuple[str, int] | None = None) -> None:
        """A rank that exited 0 or closed its tray (said bye) takes part in no step any more: a tray-wide step
        that other ranks wait in and it has not voted in fails now, naming it, instead of when the waiting
        ranks' timeouts pass (60 s for an exchange). `key`: judge that step alone (a vote in it came: the others are
        as they were when last judged, once a rank left)."""
        if self.failure is not None:
            return
        now = time.monotonic()
        steps = self.votes.items() if key is None else [(key, self.votes[key])]
        for (topic, rnd), box in steps:
            if not any(self._waits((topic, rnd), r, now) for r in box):
                continue  # every rank that voted gave the step up (a caught timeout): nobody waits in it
            for p in self._not_voted(topic, box):
                if p.returncode == 0:
                    how = "exited with code 0"
                elif p.returncode is None and p.phase == "bye":
                    how = _CLOSED_ITS_TRAY
                else:
                    continue
                self._fail(Failure(p.rank, f"rank {p.rank} (pid {p.pid}) {how} {never_joined(list(box), topic, rnd)}",
                                   tail=tuple(p.tail)))
                return

    def _note_wait(self, key: tuple[str, int], vote: wire.Vote) -> None:
        """Until when the rank of `vote` waits in step `key` (a margin short of its wait: past it, it may have given
        the step up, caught the timeout and gone on)."""
        until = time.monotonic() + vote.wait_s - min(_WAIT_MARGIN_S, vote.wait_s / 2)
        self._waits_until.setdefault(key, {})[vote.rank] = until
        self._last_vote[vote.rank] = key

    def _forget_waits(self, key: tuple[str, int]) -> None:
        self._waits_until.pop(key, None)

    def _waits(self, key: tuple[str, int], rank: int, now: float) -> bool:
        """Whether `rank`'s vote in step `key` still waits for the decision at `now` (monotonic)."""
        return self._waits_until.get(key, {}).get(rank, 0.0) > now

    def _check_crossed_steps(self) -> None:
        """A rank waits in one step at a time (exchange and tray's own steps return only with the decision): steps
        that wait for one another's ranks in a cycle (rank 0 in exchange 'a', rank 1 in exchange 'b') can never be
        decided. The tray fails now, naming them, instead of when the waiting ranks' timeouts pass. Only this
        head's ranks are judged: a rank of another node may still come (the root judges the cycles across nodes)."""
        if self.failure is not None:
            return
        now = time.monotonic()
        # NOTE: only the steps of the ranks' latest votes (a rank waits in one step at a time, and only once it voted
        # there): the votes of steps given up stay until their decisions (the round is never reused), and judging
        # every one of them on every vote made each vote slower the more a program had given up (~1.2 us per step)
        live = {key: self.votes[key] for key in set(self._last_vote.values()) if key in self.votes}
        cycle = crossed_steps(live, self._voters_here, range(self.rank_base, self.rank_base + self.spec.nprocs),
                              lambda key, rank: self._waits(key, rank, now))
        if cycle:
            self._fail(Failure(cycle[0][1], describe_cycle(cycle)))

    def _interrupted_too(self) -> bool:
        """A rank ended by SIGTERM/SIGINT: whether the head got one too (Ctrl-C to the terminal's process group,
        Slurm's scancel or time limit signal every process of the step at once), waiting briefly for it."""
        deadline = time.monotonic() + _SIGNAL_SIBLING_S
        while not self._signals and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(self._signals)

    def _check_early_exits(self) -> None:
        """A rank that exited 0 before the tray was up can never join it: once any rank called
        tray.init() (or this one had offered), the tray fails at once naming it. (When no rank ever
        calls tray.init(), the program does not use the tray and exit 0 is a success.)"""
        if self.t_go is not None or not self._forming():
            return
        for p in self.procs:
            if p.returncode == 0:
                when = "after its offer, before the tray was up" if p.rank in self.offers else \
                    "before it joined the tray (tray.init() never offered)"
                self._fail(Failure(p.rank, f"rank {p.rank} (pid {p.pid}) exited with code 0 {when} "
                                   f"(last phase: {self._phase_of(p)}); the other ranks wait for it in vain",
                                   tail=tuple(p.tail)))
                return

    @staticmethod
    def _phase_of(p: RankProcess) -> str:
        if p.last_heartbeat is None and p.phase == "spawn":
            # NOTE: a program may run a long time before tray.init(), or never call it (torch alone, say)
            # NOTE: t_spawn is wall-clock time (the ranks get it too); a rank that exited ran until its exit
            ran = (p.t_exit or time.time()) - p.t_spawn
            if p.returncode is not None:
                said = "the rank's last lines say" if p.tail else "it printed nothing"
                return (f"spawn: its program ran {ran:.1f} s and never reached the head (tray.init() not called, or "
                        f"it failed before its first message: {said})")
            return (f"spawn: not heard from in its {ran:.1f} s (tray.init() not called yet, or still in its first "
                    "steps)")
        return p.phase

    def _error_data(self, job_dir: Path, p: RankProcess, kind: str = "error") -> dict[str, Any] | None:
        """The failing rank's error file (`kind` "logged": the last exception its program logged through
        sys.excepthook) as a JSON object, or None where there is none to read: not through a link,
        not from what is not a regular file (a FIFO planted there would block the head for good), not past
        ERROR_FILE_MAX_NBYTES (a rank's report is far smaller), nor one of a start-up phase the head heard the rank
        get past (a tray.init() refused, then called again: not why the rank ended)."""
        try:
            fd = os.open(job_dir / f"rank-{p.rank}.{kind}.json",
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            chunks, left = [], ERROR_FILE_MAX_NBYTES
            while left and (chunk := os.read(fd, left)):
                chunks.append(chunk)
                left -= len(chunk)
            data = json.loads(b"".join(chunks))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if not isinstance(data, dict):
            return None
        said = data.get("phase")
        phase = _HANDSHAKE_ORDER.get(said, 99) if isinstance(said, str) else 99
        if phase < _HANDSHAKE_ORDER["running"] and phase < _HANDSHAKE_ORDER.get(p.phase, 99):
            return None
        data["written_at"] = st.st_mtime  # the head's reading of when the rank wrote it (wall-clock, as t_exit)
        return data

    def _handshake_missing(self) -> tuple[list[RankProcess], str]:
        """The ranks the handshake waits for, and for what: those that have not offered, else not reported ready."""
        missing = [p for p in self.procs if p.rank not in self.offers]
        if missing:
            return missing, "offer"
        return [p for p in self.procs if p.rank not in self.ready], "report ready"

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        timeout_s = self.spec.handshake_timeout_s
        if self.t_first_contact is None and (self.offers or any(p.last_heartbeat is not None for p in self.procs)):
            self.t_first_contact = now
        clock = self.t_first_contact if self._deadline_from_first_contact() else self.t_start
        waited = self._waited_on_root_s()
        if not self.t_go and clock is None and now - self.t_start > timeout_s:
            # no rank called tray.init(): a program that does not use the tray (a torch program, say) runs on, as
            # under torchrun, its ranks' exits still watched; said once, in case they are stuck before tray.init()
            if not self._no_contact_said:
                self._no_contact_said = True
                _say(f"no rank has called tray.init() {timeout_s:.0f} s after the spawn (--timeout-s): supervising "
                     "them as a plain launcher until one does (a rank's exit still ends the tray; Ctrl-C stops it)")
        elif not self.t_go and clock is not None and now - clock - waited > _WAIT_SAID_EVERY_S and \
                now - self._last_wait_said >= _WAIT_SAID_EVERY_S and now - clock - waited <= timeout_s and \
                self._handshake_is_ours():
            # a rank that has not reached tray.init() (loading weights, stuck): said while the others wait for it
            self._last_wait_said = now
            missing, what = self._handshake_missing()
            if missing:
                ranks = ranks_text([p.rank for p in missing[:8]]) + \
                    (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                first = missing[0]
                _say(f"waiting for {ranks} to {what} ({self.spec.nprocs - len(missing)} of {self.spec.nprocs} did, "
                     f"{now - clock - waited:.0f} s; gives up after --timeout-s {timeout_s:g} s): rank {first.rank} "
                     f"{self._liveness(first)}, last phase: {self._phase_of(first)}")
        if not self.t_go and clock is not None and now - clock - waited > timeout_s and self._handshake_is_ours():
            # the deadline runs from the first rank's contact: once one joins, every rank must, within --timeout-s
            missing, what = self._handshake_missing()
            since = "the first rank's contact" if self._deadline_from_first_contact() else "the spawn"
            if waited:
                since += f", not counting the {waited:.1f} s this node waited for the other nodes' offers"
            names = "; ".join(f"rank {p.rank} did not {what} within {timeout_s:.0f} s of {since} "
                              f"(--timeout-s; process {self._liveness(p)}, last phase: {self._phase_of(p)})"
                              for p in missing)
            self._fail(Failure(missing[0].rank if missing else None, names, exit_code=EXIT_HANDSHAKE,
                               tail=tuple(missing[0].tail) if missing else ()))
            return
        self._check_closed_ranks(now)
        if self.failure:
            return
        for p in self.procs:
            if p.returncode is None and p.last_heartbeat is not None and p.phase != "bye":
                silent = now - p.last_heartbeat
                if silent <= _LATE_S:
                    p.cpu_mark = None
                    self._busy_said.discard(p.rank)  # heartbeating again: a later silence is judged afresh
                    continue
                if p.cpu_mark is None:  # late: how much CPU it uses from here tells busy from frozen
                    p.cpu_mark = (now, _cpu_seconds(p.pid))
                # the CPU it used is judged over windows that end at the timeout, and are long enough to measure
                if now - p.cpu_mark[0] >= max(self.spec.heartbeat_timeout_s - _LATE_S, _MIN_WINDOW_S):
                    if self._busy(p, now):
                        continue
                    self._fail(Failure(p.rank, f"rank {p.rank} (pid {p.pid}) sent no heartbeat for "
                                       f"{silent:.1f} s (timeout {self.spec.heartbeat_timeout_s:.1f} s, last phase: "
                                       f"{p.phase}, reported {now - p.phase_at:.1f} s ago) and used no CPU meanwhile: "
                                       "stopped or frozen (or sleeping in a call that holds the GIL: raise "
                                       "--heartbeat-timeout-s)", tail=tuple(p.tail)))
                    return

    def _check_closed_ranks(self, now: float) -> None:
        """Ranks that closed their tray send no heartbeats (the program may go on without the tray), and the tray ends
        when they exit: one stopped (SIGSTOP, SIGTSTP: state T) for --heartbeat-timeout-s never would, and fails the
        tray; while ranks that closed it keep it waiting after others exited, whom it waits for
        is said every _WAIT_SAID_EVERY_S (the tray was silent until the job's time limit)."""
        closed = [p for p in self.procs if p.returncode is None and p.phase == "bye"]
        # NOTE: a stop is timed over the head's own looks: a head stopped with its ranks (a job suspended and
        # resumed, the head first) saw none of it pass
        resumed = now - self._closed_looked_at > _LOOK_GAP_S
        self._closed_looked_at = now
        states = {p.rank: _proc_state(p.pid) for p in closed}
        for p in closed:
            # NOTE: T only: a rank stopped at a debugger's breakpoint (t) is being looked at, not frozen
            if states[p.rank] != "T":
                p.stopped_since = None
                continue
            if p.stopped_since is None or resumed:
                p.stopped_since = now
            elif now - p.stopped_since > self.spec.heartbeat_timeout_s:
                self._fail(Failure(p.rank, f"rank {p.rank} (pid {p.pid}) closed its tray {now - p.phase_at:.1f} s ago "
                                   f"and has been stopped for {now - p.stopped_since:.1f} s since (state T: "
                                   "SIGSTOP, SIGTSTP, SIGTTIN or SIGTTOU; --heartbeat-timeout-s "
                                   f"{self.spec.heartbeat_timeout_s:g} s): it would never exit, and the tray ends when "
                                   "every rank has", tail=tuple(p.tail)))
                return
        ended = [p for p in self.procs if p.returncode is not None]
        if not closed or not ended or now - max(p.phase_at for p in closed) < _WAIT_SAID_EVERY_S or \
                now - self._last_wait_said < _WAIT_SAID_EVERY_S:
            return
        self._last_wait_said = now
        words = {"R": "running", "S": "sleeping", "D": "in uninterruptible sleep", "T": "stopped", "t": "stopped"}
        said = "; ".join(f"rank {p.rank} closed its tray {now - p.phase_at:.0f} s ago, "
                         f"{words.get(states[p.rank] or '?', 'state unknown')}" for p in closed[:8])
        more = f"; and {len(closed) - 8} more" if len(closed) > 8 else ""
        _say(f"waiting for {ranks_text([p.rank for p in closed])} to exit ({len(ended)} of {self.spec.nprocs} "
             f"did; a program may go on after close(), and the tray ends when every rank has): {said}{more}")

    def _busy(self, p: RankProcess, now: float) -> bool:
        """A rank silent for a whole heartbeat window: whether its process kept a CPU busy over it (a call that holds
        the GIL starves the heartbeat thread; a process stopped or blocked uses none). Said once per silence; its next
        window starts now."""
        assert p.cpu_mark is not None
        _, before = p.cpu_mark
        cpu = _cpu_seconds(p.pid)
        p.cpu_mark = (now, cpu)
        busy = before is not None and cpu is not None and cpu - before >= _BUSY_CPU_S
        if busy and p.rank not in self._busy_said:
            self._busy_said.add(p.rank)
            _say(f"rank {p.rank} has sent no heartbeat for {now - (p.last_heartbeat or now):.1f} s but keeps a CPU "
                 "busy (a call that holds the GIL?): not frozen; still watching it")
        return busy

    @staticmethod
    def _liveness(p: RankProcess) -> str:
        code = p.popen.poll()
        if code is None:
            state = _proc_state(p.pid)
            # a stopped process (SIGSTOP, SIGTSTP, a debugger) is alive, but will not come until continued
            return f"alive but stopped (state {state}: SIGSTOP, SIGTSTP or a debugger)" if state in ("T", "t") \
                else "alive"
        return f"exited with code {code}" if code >= 0 else f"killed by {_signal_name(code)}"

    def _heartbeating(self, p: RankProcess) -> bool:
        """Alive and heartbeating, or busy holding the GIL (judged so by its CPU): running, just not where it was
        waited for."""
        # NOTE: heartbeats come every HEARTBEAT_INTERVAL_S; two missed ones mean the process is not running, unless
        # it keeps a CPU busy in a call that holds the GIL (_busy, or _using_cpu now)
        if p.popen.poll() is not None or p.last_heartbeat is None:
            return False
        return (time.monotonic() - p.last_heartbeat <= _LATE_S or (p.rank in self._busy_said and p.cpu_mark is not None)
                or self._using_cpu(p))

    def _sample_cpu(self, procs: list[RankProcess]) -> None:
        """Before a verdict judges ranks late with their heartbeat (_using_cpu): those whose CPU the tick has not
        marked long enough ago are marked now, and the head sleeps _CPU_SAMPLE_S once for all of them."""
        now = time.monotonic()
        fresh = [p for p in procs if p.popen.poll() is None and p.last_heartbeat is not None
                 and now - p.last_heartbeat > _LATE_S
                 and (p.cpu_mark is None or p.cpu_mark[1] is None or now - p.cpu_mark[0] < _CPU_SAMPLE_S)]
        for p in fresh:
            p.cpu_mark = (now, _cpu_seconds(p.pid))
        if fresh:
            time.sleep(_CPU_SAMPLE_S)

    def _using_cpu(self, p: RankProcess) -> bool:
        """Whether a rank late with its heartbeat used a CPU since it became late (the tick's mark, or the one
        _sample_cpu took for the verdict): judged when a verdict needs it, before the tick's window (up to the
        heartbeat timeout) has run. Using one is proof of running; using none over so short a time is not proof of
        the opposite, which only the tick's whole window gives."""
        mark = p.cpu_mark
        cpu = _cpu_seconds(p.pid)
        return mark is not None and mark[1] is not None and cpu is not None and cpu - mark[1] >= _BUSY_CPU_S

    def _dump_stacks(self, procs: list[RankProcess], sock: zmq.Socket) -> dict[int, _LateReport]:
        """Have each rank write every thread's Python stack to its stderr (tray.rank registered the signal before
        it first reached the head), and give the output pump a moment to carry it before the teardown's SIGTERM.
        Meanwhile the ranks' messages on `sock` are read: the tray is failing, so what these ranks report is kept
        (rank -> its error, when it came), votes are put in their steps (the pending steps said with the cause), and
        the rest is dropped."""
        sent = False
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGRTMIN + STACK_DUMP_SIGNAL_OFFSET)
                sent = True
            except OSError:  # gone meanwhile
                pass
        reports: dict[int, _LateReport] = {}
        if not sent:
            return reports
        ranks = {p.rank for p in procs}
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                break
            ident, payload = self._recv(sock)
            rank = self._sender_rank(ident) if ident is not None else None
            if rank is None:
                continue
            try:
                msg = wire.decode(payload, token=self.token, sender=ident)
            except WireError:
                continue
            if getattr(msg, "rank", None) != rank:
                continue
            if isinstance(msg, wire.ErrorReport) and rank in ranks and rank not in reports:
                said = f"{msg.error_type}: {msg.message}" if msg.message else msg.error_type
                reports[rank] = _LateReport(said, BarrierTimeout.missing_in(msg.message),
                                            BarrierTimeout.waited_in(msg.message), time.monotonic())
            elif isinstance(msg, wire.Vote):
                self.votes.setdefault((msg.topic, msg.round), {})[rank] = msg.value
        return reports

    @staticmethod
    def _waits_of_the_waited(rank: int, t_report: float, reports: dict[int, _LateReport]) -> tuple[str, ...]:
        """Notes on what the ranks `rank` waited for reported meanwhile. One that timed out waiting for `rank` in a
        wait that began before `rank` gave up (its report's arrival less the time it waited) was waiting for it
        while it waited for them: the two were in different operations of a group (a barrier against a collective,
        two barriers in another order), a program whose ranks made different calls, not a slow rank. A wait that
        began after (a slow rank come late to a barrier the reporter had given up, now waiting in the next) is
        none."""
        notes = []
        mutual = False
        for m, r in sorted(reports.items()):
            if r.missing:
                notes.append(f"rank {m} was itself waiting, and reported {r.said}")
                began = r.at - r.waited_s if r.waited_s is not None else None
                mutual = mutual or (rank in r.missing and began is not None and began < t_report)
            else:
                notes.append(f"rank {m} then reported {r.said}")
        if mutual:
            notes.append("so these ranks waited for one another in different operations, none of which can end: "
                         "every member of a group must make the same barriers and collectives in the same order")
        return tuple(notes)

    def _not_voted_beside(self, rank: int) -> tuple[list[RankProcess], str]:
        """This head's ranks that never voted in the undecided tray-wide step `rank` voted in last (a rank waits in
        one at a time), and that step's description; ([], "") when that step is decided or there is none."""
        key = self._last_vote.get(rank)
        box = self.votes.get(key) if key is not None else None
        if key is None or box is None or rank not in box:
            return [], ""
        return self._not_voted(key[0], box), f"{describe_step(key[0])}, round {key[1]}"

    def _not_voted(self, topic: str, box: dict[int, object]) -> list[RankProcess]:
        """This head's ranks that take part in step `topic` (a node leaders' step: the leader alone) and have no
        vote in `box`."""
        voters = self._voters_here(topic)
        return [p for p in self.procs if p.rank not in box and (voters is None or p.rank in voters)]

    def _voters_here(self, topic: str) -> Sequence[int] | None:
        """This head's ranks that vote on `topic`, in voter order; None when the topic names no group instance of the
        manifest. NOTE: a tray-wide step's are this head's ranks: the job's list of its W voters, built and searched
        at each vote, made each of a node's votes O(ranks of the job)."""
        mine = range(self.rank_base, self.rank_base + self.spec.nprocs)
        if not topic.startswith(GROUP_PREFIX):
            return mine
        voters = step_voters(topic, self.world_size, self.resolved.groups, self.spec.nprocs)
        return None if voters is None else [r for r in voters if r in mine]

    def _status(self, p: RankProcess, more: str = "give it more time") -> str:
        """What the head knows of rank `p` now: dead (how), or alive with its last heartbeat and phase, and
        whether that makes it slow (heartbeating) or stopped (silent)."""
        code = p.popen.poll()
        if code is not None:
            how = _how_it_ended(code)
            if code == 0:
                return f"rank {p.rank} {how} (last phase: {p.phase}): gone, not slow"
            return f"rank {p.rank} {how} (last phase: {p.phase}): dead, not slow"
        if p.last_heartbeat is None:
            return f"rank {p.rank} is alive but never reached the head (last phase: {self._phase_of(p)})"
        if p.phase == "bye":
            return (f"rank {p.rank} {_CLOSED_ITS_TRAY} {time.monotonic() - p.phase_at:.1f} s ago: it takes part in "
                    "no barrier or step any more")
        silent_s = time.monotonic() - p.last_heartbeat
        head = f"rank {p.rank} is alive, last heartbeat {silent_s:.1f} s ago, phase {p.phase}"
        if self._heartbeating(p):
            if silent_s > _LATE_S:
                head += " (busy in a call that holds the GIL: a CPU in use, no heartbeat)"
            return (f"{head}: running but not where the others wait for it, slow or stuck elsewhere (its Python "
                    f"stack, every thread, went to its stderr just now: the [rank {p.rank}] lines above, or its log); "
                    f"if it is slow, {more} or run fewer ranks than cores")
        return (f"{head}: stopped or frozen (no heartbeat, no CPU used; or blocked in a call that holds the GIL: "
                f"then its Python stack went to its stderr just now, the [rank {p.rank}] lines above, or its log)")

    def _log_error_reports(self, job_dir: Path) -> None:
        """Append each rank's error report (from its error file) to its --log-dir file: the log then holds
        the traceback the rank reported, also when the rank was stopped before it could print more."""
        if not self.spec.log_dir:
            return
        for p in self.procs:
            report = _error_report(self._error_data(job_dir, p))
            if not report:
                continue
            try:
                with open_log(self.spec.log_dir, p.rank) as log:
                    log.writelines(f"{stamp()} [tray] {line}\n" for line in
                                   ["error report sent to the head:", *report.rstrip().splitlines()])
            except OSError as exc:
                _say(f"could not add rank {p.rank}'s error report to its log: {exc.strerror or exc}")

    def _fail(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure

    def _sample_shm(self, job: JobDir, force: bool = False) -> None:
        """Record the collectives' segments the live ranks map, so whoever cleans up after them knows them."""
        now = time.monotonic()
        if not force and now - self._t_shm < SHM_SAMPLE_S:
            return
        self._t_shm = now
        new = mapped_collective_shm(p.pid for p in self.procs if p.popen.poll() is None) - self.shm
        if new:
            self.shm |= new
            try:
                record_shm(job.fd, new)
            except OSError as exc:
                _say(f"could not record shared-memory segments in {job.path}: {exc.strerror}")

    def _teardown(self, job: JobDir, watchdog: Watchdog | None, pump: OutputPump | None) -> None:
        """Stop the ranks (SIGTERM, grace, SIGKILL), then everything they started (the tray's process
        group, and orphans the head adopted as subreaper), remove collective segments no live process maps,
        and read the ranks' last output for at most DRAIN_S."""
        self._sample_shm(job, force=True)
        if self.failure:  # the root cause first; its report and the ranks' ends follow the teardown
            self._say_failed()
        elif self._signals:
            # a rank's death the loop had not judged yet when a stop signal came (within a turn of it): said, so an
            # interrupt does not hide it; a death by a stop signal may be the same signal's, and is not
            for p, code, _ in self._exits.ended(self.procs):
                p.returncode, p.t_exit = code, time.time()
                if _faulted(code):
                    _say(f"rank {p.rank} (pid {p.pid}) {_how_it_ended(code)} as the stop signal came, its end not "
                         f"judged yet (last phase: {self._phase_of(p)})")
        alive = [p for p in self.procs if p.popen.poll() is None]
        if alive:
            if self.failure:
                who = ranks_text(p.rank for p in alive)
                _say(f"stopping {who} (SIGTERM, {self.spec.grace_s:.1f} s grace, then SIGKILL)")
            deadline = time.monotonic() + self.spec.grace_s
            signals_before = len(self._signals)
            # a rank that reported its exception is on its way out (its close, its exit code): it is given a moment
            # to end by itself, so that its end is said as it is ("exited with code 1"), not as the head's SIGTERM
            reporters = [p for p in alive if p.rank in self._reporters]
            for p in alive:
                if p not in reporters:
                    _terminate(p)
            if reporters:
                until = time.monotonic() + min(_REPORTER_EXIT_S, self.spec.grace_s)
                while any(p.popen.poll() is None for p in reporters) and time.monotonic() < until and \
                        len(self._signals) == signals_before:
                    time.sleep(_GRACE_POLL_S)
                for p in reporters:
                    if p.popen.poll() is None:
                        _terminate(p)
            killed = []
            for p in alive:
                # NOTE: a stop signal that comes during the grace (a second Ctrl-C) ends it: SIGKILL at once
                while p.popen.poll() is None and time.monotonic() < deadline and len(self._signals) == signals_before:
                    time.sleep(_GRACE_POLL_S)
                if p.popen.poll() is None:
                    p.popen.kill()
                    killed.append(p.rank)
            if len(self._signals) > signals_before and killed:
                _say(f"{ranks_text(killed)} SIGKILLed at once: a second stop signal during the grace")
            elif killed:
                # NOTE: a program saving its state in a SIGTERM handler was cut short: said, with how to give more
                _say(f"{ranks_text(killed)} did not exit within the {self.spec.grace_s:g} s grace after SIGTERM: "
                     "SIGKILLed (a SIGTERM handler still running was cut short; --stop-grace-s S gives more)")
        stuck: list[int] = []
        for p in self.procs:
            if p.returncode is None:
                try:
                    p.returncode = p.popen.wait(timeout=REAP_TIMEOUT_S)
                except subprocess.TimeoutExpired:  # SIGKILLed and still there: uninterruptible sleep (a hung driver)
                    stuck.append(p.pid)
        survivors: list[int] = stuck
        if watchdog is not None:
            try:
                term_group(watchdog.pgid, frozenset({watchdog.popen.pid, *stuck}), SETTLE_S)
                survivors = stuck + kill_group(watchdog.pgid, frozenset({watchdog.popen.pid, *stuck}))
            except OSError as exc:  # NOTE: the watchdog goes with its group; done() then reaps it
                _say(f"cannot list the tray's processes ({exc.strerror}); killing its whole process group")
                with contextlib.suppress(OSError):
                    os.killpg(watchdog.pgid, signal.SIGKILL)
        self._kill_adopted(exclude={p.pid for p in self.procs} | ({watchdog.popen.pid} if watchdog else set())
                           | ({self.start_join.pid} if self.start_join.pid is not None else set()))
        if survivors:
            _say(f"processes {survivors} of the tray survived SIGKILL for {REAP_TIMEOUT_S:.0f} s "
                 "(uninterruptible sleep?)")
        if self.shm:
            remove_shm(self.shm)
        if pump is not None:
            pump.stop(DRAIN_S)
        self._log_error_reports(job.path)

    def _this_trays(self, adopted: list[int]) -> list[int]:
        """Those of the head's adopted children `adopted` that are this tray's: in `tray launch` all of them; in a
        program that called run_tray() (children of its own), those whose environment names this tray's job dir."""
        if not adopted or self.spec.launched_at is not None or self._job_path is None:
            return adopted
        mark = f"\0TRAY_JOB={self._job_path}\0".encode()
        return [pid for pid in adopted if mark in _environ_of(pid)]

    def _note_adopted(self) -> None:
        """Every _ADOPTED_EVERY_S: tell the watchdog of the children the head adopted since (as _kill_adopted finds
        them), so that a SIGKILLed head leaves none of them running: an orphan that left the tray's process group and
        cleared its environment (a daemon) is known by nothing else once the head, its subreaper, is gone."""
        now = time.monotonic()
        wd = self._watchdog
        if now < self._adopted_next or wd is None:
            return
        self._adopted_next = now + _ADOPTED_EVERY_S
        known = {p.pid for p in self.procs} | {wd.popen.pid} | self._children_before | self._adopted_told
        if self.start_join.pid is not None:  # the id process: a child the head started (its Popen reaps it)
            known.add(self.start_join.pid)
        new = self._this_trays([pid for pid in _own_children() if pid not in known])
        if new:
            self._adopted_told.update(new)
            wd.adopted(new)
        # those that ended are reaped now, not at the end: a head that runs long (a server's, PID 1 of a container
        # with no init to reap for it) would otherwise gather zombies of every daemon its ranks' children left
        for pid in list(self._adopted_told):
            try:
                ended = os.waitpid(pid, os.WNOHANG)[0] == pid
            except ChildProcessError:  # reaped already, or no child of this process (any more)
                ended = True
            if ended:
                self._adopted_told.discard(pid)

    def _kill_adopted(self, exclude: set[int]) -> None:
        """Kill the head's children it did not start: orphans of the ranks' descendants (reparented here, the
        head being a subreaper) that left the tray's process group (setsid, setpgid, `Popen(process_group=0)`).
        In `tray launch` every other child is one; in a program that called run_tray() (children of its own,
        started before the tray or meanwhile), only those whose environment names this tray's job dir (a rank's
        descendants inherit it). They are reaped so none lingers as a zombie."""
        me = psutil.Process()
        # NOTE: an orphan's own descendants go with it, whatever their group (`timeout CMD` puts itself in a group of
        # its own, and CMD was left running once `timeout` was killed); each killed parent hands its children to
        # this head (the subreaper), so passes repeat until none is left, a few at most
        killed: set[int] = set()  # NOTE: handed to this head as they died: theirs, and reaped, without the filter
        for _ in range(_ADOPTED_PASSES):
            try:
                adopted = [c for c in me.children() if c.pid not in exclude and c.pid not in self._children_before]
            except psutil.Error:
                return
            # a zombie's environment cannot be read: one of those killed here is known by its pid
            ours = set(self._this_trays([c.pid for c in adopted if c.pid not in killed])) | killed
            adopted = [c for c in adopted if c.pid in ours]
            if not adopted:
                return
            tree = list(adopted)
            for c in adopted:
                with contextlib.suppress(psutil.Error):
                    tree += c.children(recursive=True)
            for c in tree:
                with contextlib.suppress(psutil.Error):
                    c.kill()
                killed.add(c.pid)
            psutil.wait_procs(adopted, timeout=2.0)

    # --- reporting ------------------------------------------------------------------------------
    def _launched_at(self) -> float | None:
        """When `tray launch` started, for the first attempt only (a restart's head phase would hold the attempts
        before it)."""
        return self.spec.launched_at if self.restart_count == 0 else None

    def _timeline(self) -> dict[str, tuple[float, int]]:
        out: dict[str, tuple[float, int]] = {}
        launched = self._launched_at()
        if launched is not None and self.procs:  # `tray launch` started -> its first rank spawned
            out["head"] = (max(0.0, self.procs[0].t_spawn - launched), self.procs[0].rank)
        out["spawn"] = (self.t_spawned, self.procs[-1].rank)
        for r in (p.rank for p in self.procs):
            timings = dict(self.offers[r].timings) if r in self.offers else {}
            if r in self.ready:
                timings.update(self.ready[r].timings)
            for phase, secs in timings.items():
                if phase not in out or secs > out[phase][0]:
                    out[phase] = (secs, r)
        if self.t_go and self.t_table:
            last = max(self.ready, key=lambda r: sum(self.ready[r].timings.values()), default=0)
            out["ready"] = (self.t_go - self.t_table, last)
        return out

    def _print_timeline(self) -> None:
        if self.spec.quiet or not self.spec.timeline:
            return
        t0 = min(p.t_spawn for p in self.procs)
        total = (self.t_go or t0) - t0
        tl = self._timeline()
        launched = self._launched_at()
        since = "" if launched is None else f", {(self.t_go or t0) - launched:.3f} s after `tray launch` started"
        _say(f"tray up in {total:.3f} s after the first spawn{since} ({self.spec.nprocs} ranks, "
             f"{self.spec.backend} backend); slowest rank per phase:")
        for phase in PHASES:
            if phase in tl:
                secs, r = tl[phase]
                who = "the head's own start, until its first rank was spawned" if phase == "head" else f"rank {r}"
                if phase == "import":  # NOTE: all a program does before tray.init() counts here (import torch, ...)
                    who += ": its start until tray.init(), the program's own imports and work before it included"
                _say(f"  {phase:<13}{secs * 1e3:9.1f} ms  {who}")
        joined = self.start_join.said()
        if joined:
            _say(f"  {joined}")

    def _say_failed(self) -> None:
        """The root cause's line and notes, once."""
        f = self.failure
        assert f is not None
        if self._failed_said:
            return
        self._failed_said = True
        _say(f"FAILED: {f.summary}")
        for note in f.notes:
            _say(f"  {note}")
        if self._job_path is not None and not os.path.isdir(self._job_path):
            # said by the head alone: the ranks' error files and sockets were in it, so what they reported is lost
            _say(f"  the job dir {self._job_path} was removed while the tray ran (by hand, or a cleanup of its jobs "
                 "root): the ranks' sockets and error files were in it, so a rank that started then could not reach "
                 "the head or report; leave it while the tray runs")

    def _print_root_cause(self) -> None:
        f = self.failure
        assert f is not None
        self._say_failed()
        if f.report.strip():
            _say("error report:")
            for line in f.report.rstrip().splitlines():
                _say(f"  {line}")
        for line in self._pending_steps():
            _say(line)
        tail = list(f.tail)
        local = f.rank is not None and 0 <= f.rank - self.rank_base < len(self.procs)
        if local and f.rank is not None:  # its output drained by now: the lines it wrote as it ended are there too
            tail = list(self.procs[f.rank - self.rank_base].tail) or tail
        tail = [line for line in tail if line.strip()]  # blank lines alone say nothing: no header over them
        if tail:
            _say(f"last lines of rank {f.rank}:")
            for line in tail[-10:]:
                _say(f"  | {line}")
        from tray.lazy import DEPENDENCIES

        missing = {f"No module named '{name}'" for name in ("tray", *DEPENDENCIES)}
        if local and any(m in line for line in tail for m in missing):
            program = self.spec.cmd[0]
            _say(f"rank {f.rank}'s Python cannot import tray (or its dependencies): the command starts {program!r} "
                 f"({shutil.which(program) or 'not found on PATH'}), while tray runs in {sys.executable}; name the "
                 "program alone (tray launch -n N prog.py: tray's Python runs it), or activate tray's environment")

    def _pending_steps(self) -> list[str]:
        """The steps undecided at the failure, each with this head's ranks that never voted in it."""
        lines = []
        for (topic, rnd), box in self.votes.items():
            missing = [p.rank for p in self._not_voted(topic, box)]
            if missing:
                who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {','.join(map(str, missing))}"
                lines.append(f"tray-wide step: {describe_step(topic)} (round {rnd}) was still waiting for {who}")
        return lines

    def _result(self, job_dir: Path) -> TrayResult:
        """The TrayResult; prints the root cause first when the tray failed."""
        codes = {p.rank: p.returncode for p in self.procs}
        if self.failure:
            self._print_root_cause()
            # every rank's end, the root cause's too: a rank that froze or never offered ends in the teardown
            ends = [f"rank {r}{' (the root cause)' if r == self.failure.rank else ''}: {_end_of(c)}"
                    for r, c in codes.items()]
            if ends:
                _say("after teardown: " + "; ".join(ends))
        if self._rejects > _REJECTS_SAID:
            _say(f"{self._rejects} messages to the head's socket were rejected in all (the first {_REJECTS_SAID} "
                 "said): a process outside this tray wrote to it")
        t0 = min((p.t_spawn for p in self.procs), default=0.0)
        return TrayResult(
            exit_code=self.failure.exit_code if self.failure else 0, root_cause=self.failure,
            returncodes=codes, timeline=self._timeline() if self.offers else {},
            startup_s=(self.t_go - t0) if self.t_go else None, job_dir=str(job_dir), rejected=self.rejected,
        )


def _users_input(error_type: object, phase: object) -> bool:
    """Whether a rank's error is the user's input, said in one line and exit 2 as the head's own usage errors: a
    manifest it could not load, or a tray.init() called wrongly (a usage error while it started its tray)."""
    starting = isinstance(phase, str) and _HANDSHAKE_ORDER.get(phase, 99) < _HANDSHAKE_ORDER["running"]
    return error_type == "ManifestError" or (error_type in ("UsageError", "SetupError") and starting)


def _error_report(data: dict[str, Any] | None) -> str:
    """A rank's error file (`Head._error_data`) as the report printed under its failure; "" for none."""
    if data is None:
        return ""
    return f"{data.get('error_type')}: {data.get('message')}\n{data.get('traceback', '')}"


class _ExitOrder:
    """The order in which the ranks exit, seen as it happens: a pidfd per running rank in the head's poller, readable
    once the rank has exited (Linux 5.3 and later; where pidfd_open is missing, ranks are judged in rank order)."""

    def __init__(self, procs: Sequence[RankProcess], poller: zmq.Poller | None) -> None:
        self._poller = poller
        self._fds: dict[int, int] = {}  # pidfd -> rank, while the rank runs
        self._seen: dict[int, float] = {}  # rank -> when its exit was seen (monotonic s)
        for p in procs:
            if p.returncode is not None or poller is None:
                continue
            try:
                fd = os.pidfd_open(p.pid)
            except (AttributeError, OSError):  # no pidfds here (an old kernel, not Linux), or out of fds
                continue
            self._fds[fd] = p.rank
            poller.register(fd, zmq.POLLIN)

    def note(self, ready: dict[Any, int]) -> None:
        """Take the exits among the poller's `ready`, and stop watching those ranks (a pidfd stays readable: it would
        wake every poll)."""
        now = time.monotonic()
        for fd in [fd for fd in self._fds if fd in ready]:
            self._seen[self._fds[fd]] = now
            self._drop(fd)

    def ended(self, procs: Sequence[RankProcess]) -> list[tuple[RankProcess, int, tuple[str, ...]]]:
        """The ranks of `procs` that ended since the last call (reaped here): (rank, exit status, notes), the first
        to end first. Failures seen within _EXIT_TIE_S of each other are one moment, whose order the kernel may have
        turned around (a killed process's sockets close before its exit is seen, and a peer that ends on that can be
        seen first): there a rank SIGKILLed (the OOM killer, a kill from outside: never a process's own reaction to
        a lost peer, as an abort or an exit may be) goes first, and the others are said beside it."""
        ended = [(p, code) for p in procs if p.returncode is None and (code := p.popen.poll()) is not None]
        if len(ended) < 2:
            return [(p, code, ()) for p, code in ended]
        now = time.monotonic()
        when = {p.rank: self._seen.get(p.rank, now) for p, _ in ended}
        failed = [when[p.rank] for p, code in ended if code != 0]
        first = min(failed) if failed else now
        tied = {p.rank for p, code in ended if code != 0 and when[p.rank] - first <= _EXIT_TIE_S}
        # the tied first, a SIGKILL among them first; then as seen
        order = sorted(ended, key=lambda e: (e[0].rank not in tied, e[0].rank in tied and e[1] != -signal.SIGKILL,
                                             when[e[0].rank], e[0].rank))
        head, code = order[0]
        if head.rank not in tied or code != -signal.SIGKILL:
            return [(p, c, ()) for p, c in order]
        others = [f"rank {p.rank} {_how_it_ended(c)} within {abs(when[p.rank] - when[head.rank]) * 1e3:.0f} ms of it "
                  "(which ended first is not known; a SIGKILL is never a process's own doing, and a killed process's "
                  "connections close before its end is seen)"
                  for p, c in order[1:] if p.rank in tied and c != -signal.SIGKILL]
        return [(head, code, tuple(others)), *((p, c, ()) for p, c in order[1:])]

    def close(self) -> None:
        for fd in list(self._fds):
            self._drop(fd)

    def _drop(self, fd: int) -> None:
        del self._fds[fd]
        if self._poller is not None:
            self._poller.unregister(fd)
        os.close(fd)


def _faulted(code: int) -> bool:
    """Whether exit status `code` is a death by a signal other than a stop (SIGTERM, SIGINT...) or SIGPIPE: SIGKILL,
    SIGSEGV, SIGABRT..."""
    return code < 0 and code not in _STOP_DEATHS and code != -signal.SIGPIPE


def _wire_size(msg: wire.Message) -> int:
    """The bytes `msg` takes as the head would send it, whatever the limit (a value a peer packed smaller, as msgpack's
    float32, re-encodes larger)."""
    try:
        return len(wire.encode(msg, sys.maxsize))
    except WireError:
        return 0


def _how_it_ended(code: int) -> str:
    """`exited with code N` or `was killed by SIGNAL`, for a rank's exit status `code`."""
    return f"exited with code {code}" if code >= 0 else f"was killed by {_signal_name(code)}"


def _end_of(code: int | None) -> str:
    """How a rank ended, for the line after the teardown."""
    if code is None:
        return "still there after SIGKILL (uninterruptible sleep?)"
    return f"killed by {_signal_name(code)}" if code < 0 else f"exit {code}"


@dataclass(frozen=True)
class _LateReport:
    """What a rank the failed wait missed reported during the stack dump's wait: its error as said, the ranks its own
    wait missed (none: not a wait), how long it waited (s, from its message) and when it arrived (monotonic)."""

    said: str
    missing: list[int]
    waited_s: float | None
    at: float


def _terminate(p: RankProcess) -> None:
    """SIGTERM to rank `p`, and SIGCONT when it is stopped: a stopped process acts on no signal but SIGKILL, so its
    SIGTERM handler would not run in the grace, and its end be said as a handler cut short."""
    p.popen.send_signal(signal.SIGTERM)
    if _proc_state(p.pid) == "T":
        with contextlib.suppress(OSError):
            os.kill(p.pid, signal.SIGCONT)


def _proc_state(pid: int) -> str | None:
    """Process `pid`'s state letter (/proc/PID/stat: R, S, D, T stopped, t traced...); None when it cannot be read."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (/proc/PID/stat); None when it cannot be read."""
    fields = stat_fields(pid)
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else None
    except (ValueError, IndexError):
        return None


def _bind_router(ctx: zmq.Context, endpoint: str, job: JobDir) -> zmq.Socket:
    """The head's ROUTER, bound at `endpoint` inside the job dir, 0600. Raises SetupError (no room or
    inodes for the socket, a path too long) naming the endpoint and what to do."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_NBYTES)  # a larger one drops its sender
    try:
        sock.bind(endpoint)
        os.chmod("head.sock", 0o600, dir_fd=job.fd)
    except (zmq.ZMQError, OSError) as exc:
        sock.close()
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise SetupError(f"cannot bind the head's socket {endpoint}: {why}; free space or inodes in {job.root}, "
                         "or set TRAY_JOBS_ROOT to another directory") from None
    except BaseException:
        sock.close()  # an open socket would keep the context's term() at the teardown waiting for good
        raise
    return sock
