"""Spawning ranks: the env contract (DESIGN section 4), PR_SET_PDEATHSIG, NUMA binding, and the
output pumps that prefix every line with `[rank R]`."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from tray.errors import UsageError
from tray.launch.spec import RankProcess, TraySpec
from tray.numa import NumaPlacement, prepare_binding

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_print_lock = threading.Lock()


def rank_env(spec: TraySpec, rank: int, *, job_dir: Path, endpoint: str, token: str, manifest: str,
             t_spawn: float) -> dict[str, str]:
    """The environment of rank `rank`: the head's own, untouched, plus the tray's variables."""
    env = dict(os.environ)
    env.update(dict(spec.extra_env))
    env.update({
        "TRAY_RANK": str(rank),
        "TRAY_WORLD_SIZE": str(spec.nprocs),
        "TRAY_LOCAL_RANK": str(rank),
        "TRAY_LOCAL_WORLD_SIZE": str(spec.nprocs),
        "TRAY_DEVICE": str(rank),
        "TRAY_RDZV": endpoint,
        "TRAY_JOB": str(job_dir),
        "TRAY_TOKEN": token,
        "TRAY_MANIFEST": manifest,
        "TRAY_BACKEND": spec.backend,
        "TRAY_VARS": ",".join(f"{k}={v}" for k, v in spec.vars),
        "TRAY_T_SPAWN": repr(t_spawn),
        "RANK": str(rank),
        "WORLD_SIZE": str(spec.nprocs),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(spec.nprocs),
        "PYTHONUNBUFFERED": "1",
    })
    # NOTE: NCCL must not connect lazily inside a CUDA graph capture; respect a user's choice.
    env.setdefault("NCCL_RUNTIME_CONNECT", "0")
    return env


def _preexec(bind: Callable[[], None] | None) -> Callable[[], None]:
    def run_in_child() -> None:
        # The head dies -> its ranks die, even on SIGKILL of the head.
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if bind is not None:
            bind()

    return run_in_child


def spawn_rank(spec: TraySpec, rank: int, env: dict[str, str], placement: NumaPlacement) -> RankProcess:
    """Start one rank in the head's process group, with pipes for its output."""
    t_spawn = float(env["TRAY_T_SPAWN"])
    try:
        popen = subprocess.Popen(
            list(spec.cmd), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=_preexec(prepare_binding(placement)), close_fds=True,
        )
    except OSError as exc:
        raise UsageError(f"cannot start rank {rank}: {spec.cmd[0]!r}: {exc.strerror}; "
                         "check the command after `--` (a path, or a program on PATH)") from None
    return RankProcess(rank=rank, popen=popen, t_spawn=t_spawn)


def start_pumps(proc: RankProcess, log_dir: str | None, quiet: bool) -> list[threading.Thread]:
    """Threads that copy the rank's stdout/stderr to ours with a `[rank R]` prefix (and to a log)."""
    log: TextIO | None = None
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log = open(Path(log_dir) / f"rank-{proc.rank}.log", "a", buffering=1)
    threads = []
    streams = [(proc.popen.stdout, sys.stdout), (proc.popen.stderr, sys.stderr)]
    remaining = [len(streams)]
    for src, dst in streams:
        t = threading.Thread(target=_pump, args=(proc, src, dst, log, quiet, remaining),
                             name=f"tray-out-{proc.rank}", daemon=True)
        t.start()
        threads.append(t)
    return threads


def _pump(proc: RankProcess, src, dst: TextIO, log: TextIO | None, quiet: bool, remaining: list[int]) -> None:
    prefix = f"[rank {proc.rank}] "
    for raw in iter(src.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        proc.tail.append(line)
        if not quiet:
            with _print_lock:
                dst.write(prefix + line + "\n")
                dst.flush()
        if log is not None:
            log.write(f"{time.time():.6f} {line}\n")
    src.close()
    with _print_lock:
        remaining[0] -= 1
        if remaining[0] == 0 and log is not None:
            log.close()
