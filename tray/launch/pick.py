"""Which backend and how many ranks a tray gets when the command line leaves them out."""

from __future__ import annotations

import os
import sys

from tray.errors import UsageError

# NOTE: with no GPU visible, a 4-rank tray is what CI and the demo run.
HOST_DEFAULT_NPROCS = 4


def backend_and_nprocs(backend: str | None, nprocs: int | None) -> tuple[str, int]:
    """(backend, nprocs): `backend` or cuda when a GPU is visible (else host); `nprocs` or every visible GPU
    (host: HOST_DEFAULT_NPROCS). Raises UsageError for an unknown backend, no GPU on cuda, or nprocs < 1."""
    from tray.backend import BACKENDS, detect_backend

    chosen = backend or detect_backend()
    if chosen not in BACKENDS:
        raise UsageError(f"unknown backend {chosen!r}; expected one of {', '.join(BACKENDS)}")
    if nprocs is not None and nprocs < 1:
        raise UsageError(f"-n must be at least 1, got {nprocs}")
    if chosen == "cuda":
        from tray.backend.cuda import gpu_count

        visible = gpu_count()  # NOTE: from /proc where it can: no cuInit in the head before its ranks start
        check_gpus(nprocs, visible, os.environ.get("CUDA_VISIBLE_DEVICES"))
        nprocs = visible if nprocs is None else nprocs
    elif nprocs is None:
        nprocs = HOST_DEFAULT_NPROCS
    return chosen, nprocs


def check_gpus(nprocs: int | None, visible: int, cuda_visible_devices: str | None) -> None:
    """Raise UsageError when a cuda tray of `nprocs` ranks (None: one per GPU) does not fit the `visible` GPUs,
    before anything is spawned; the message names CUDA_VISIBLE_DEVICES when it is set."""
    where = f" (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r})" if cuda_visible_devices is not None else ""
    if visible == 0:
        raise UsageError(f"--backend cuda but no GPU is visible{where}; use --backend host")
    if nprocs is not None and nprocs > visible:
        raise UsageError(f"-n {nprocs} needs {nprocs} GPUs (one per rank), {visible} visible{where}; "
                         f"use -n {visible} or fewer, or --backend host")


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def warn_if_oversubscribed(nprocs: int, ncores: int | None = None) -> bool:
    """Say on stderr when `nprocs` ranks outnumber the cores (a rank then waits for a core: barriers and
    heartbeats run late). Returns whether it warned."""
    ncores = cores() if ncores is None else ncores
    if nprocs <= ncores:
        return False
    print(f"tray: warning: {nprocs} ranks on {ncores} CPU cores: ranks wait for a core, so barriers and "
          "steps take longer; raise --barrier-timeout-s (or TRAY_BARRIER_TIMEOUT_S) if they time out",
          file=sys.stderr, flush=True)
    return True
