"""What to launch (TraySpec), a running rank (RankProcess, RankState) and the outcome (TrayResult)."""

from __future__ import annotations

import enum
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field

# the exit status of a tray (or job) whose ranks (or nodes) never formed it: offers that disagree, a deadline
EXIT_HANDSHAKE = 3
EXIT_USAGE = 2  # a usage or manifest error (the head's own, or one a rank met starting its tray)


@dataclass(frozen=True)
class TraySpec:
    """A tray to launch: `nprocs` ranks of `cmd` on `backend` with `manifest` (None: built-in)."""

    nprocs: int
    cmd: tuple[str, ...]
    backend: str = "host"
    manifest: str | None = None
    vars: tuple[tuple[str, int], ...] = ()
    log_dir: str | None = None
    # NOTE: 30 s covers a cold CUDA context + NCCL init on 8 GPUs with a wide margin.
    handshake_timeout_s: float = 30.0
    heartbeat_timeout_s: float = 10.0
    grace_s: float = 3.0
    extra_env: tuple[tuple[str, str], ...] = ()
    # quiet: no rank output on the terminal and no timeline (benches); timeline: the startup timeline
    quiet: bool = False
    timeline: bool = True
    # after a failure (exit 1 or 3), tear down and start again up to this many times
    max_restarts: int = 0
    # which rank streams go to --log-dir files (bits: 1 stdout, 2 stderr), and which of those also to the
    # terminal (tee) or only to the file (redirects): one value for every rank, or a tuple with one per local
    # rank (tray.launch.output.parse_streams); ranks whose output the terminal shows (None: all)
    tee: int | tuple[int, ...] = 0
    redirects: int | tuple[int, ...] = 0
    local_ranks_filter: tuple[int, ...] | None = None
    # the barrier timeout of the ranks' programs (TRAY_BARRIER_TIMEOUT_S); None: the manifest's or 2 s
    barrier_timeout_s: float | None = None
    # when the ranks join their NCCL groups (tray/collectives/early.py): "auto" (early when a manifest program
    # has a collective op), "early" (while the ranks start) or "lazy" (at the first collective); None: the
    # environment's TRAY_JOIN_COLLECTIVES, else "auto" (how the benches' trays get it)
    join_collectives: str | None = None
    # when the `tray launch` process started (time.time(); None: the head runs in a longer-lived Python): the
    # timeline then counts the head's own start, interpreter and imports, until its first rank is spawned
    launched_at: float | None = None
    # ranks may share GPUs when they outnumber them (rank r on GPU r mod G, each its own NCCL_HOSTID): for checking
    # a program's correctness on fewer GPUs than ranks; None: the environment's TRAY_SHARE_GPUS
    share_gpus: bool | None = None
    # torchrun's TORCHELASTIC_RUN_ID, the same on every attempt of a launch (None: made by run_tray, once per launch)
    run_id: str | None = None
    # MASTER_PORT on one host (--master-port; None: a free port the head reserves)
    master_port: int | None = None


class RankState(enum.Enum):
    """Where a rank is, as the head sees it. Transitions only move right, or to EXITED/FAILED."""

    SPAWNED = "spawned"
    OFFERED = "offered"
    READY = "ready"
    RUNNING = "running"
    EXITED = "exited"
    FAILED = "failed"


@dataclass
class RankProcess:
    """A running child of the head."""

    rank: int
    popen: subprocess.Popen
    t_spawn: float
    state: RankState = RankState.SPAWNED
    phase: str = "spawn"
    last_heartbeat: float | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=20))
    returncode: int | None = None
    t_exit: float | None = None  # when the head saw it exit (wall-clock, as t_spawn)
    # when the head last learnt the phase (monotonic s): the age is part of a timeout's report
    phase_at: float = field(default_factory=time.monotonic)
    # (when, CPU seconds) of the rank's process when its heartbeat window last ran out: whether it ran meanwhile
    cpu_mark: tuple[float, float | None] | None = None
    # since when (monotonic s) the rank, its tray closed, has been seen stopped (state T or t); None: not stopped
    stopped_since: float | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass(frozen=True)
class Failure:
    """Why a rank (or the tray) failed. `rank` is None for a tray-wide failure (handshake)."""

    rank: int | None
    summary: str
    report: str = ""
    tail: tuple[str, ...] = ()
    exit_code: int = 1
    notes: tuple[str, ...] = ()  # what the head knows of the ranks the failure names (alive, phase, ...)


@dataclass
class TrayResult:
    """The outcome: exit code of the head, the root cause, every rank's return code and timeline."""

    exit_code: int
    root_cause: Failure | None
    returncodes: dict[int, int | None]
    timeline: dict[str, tuple[float, int]] = field(default_factory=dict)  # phase -> (s, slowest rank)
    startup_s: float | None = None
    job_dir: str = ""
    rejected: list[str] = field(default_factory=list)
    attempts: int = 1
    # a stop signal (SIGINT, SIGTERM, SIGHUP) that came during the teardown of a tray that had failed before it: its
    # name; the failure stands as the result, and no restart follows
    interrupted: str = ""
