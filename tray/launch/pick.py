"""Which backend and how many ranks a tray gets when the command line leaves them out."""

from __future__ import annotations

import os
import sys

from tray.errors import UsageError

# NOTE: with no GPU visible, a 4-rank tray is what CI and the demo run.
HOST_DEFAULT_NPROCS = 4
# more ranks than one host could run as processes: refused before anything is sized by it
MAX_NPROCS = 1 << 20


def backend_and_nprocs(backend: str | None, nprocs: int | None, share: bool | None = None) -> tuple[str, int]:
    """(backend, nprocs): `backend` or cuda when a GPU is visible (else host); `nprocs` or every visible GPU
    (host: HOST_DEFAULT_NPROCS). `share`: ranks may share GPUs (None: TRAY_SHARE_GPUS). Raises UsageError for an
    unknown backend, no GPU on cuda, more ranks than GPUs without sharing, or nprocs < 1."""
    from tray.backend import BACKENDS, detect_backend

    chosen = backend or detect_backend()
    if chosen not in BACKENDS:
        raise UsageError(f"unknown backend {chosen!r}; expected one of {', '.join(BACKENDS)}")
    if nprocs is not None and nprocs < 1:
        raise UsageError(f"-n must be at least 1, got {nprocs}")
    if nprocs is not None and nprocs > MAX_NPROCS:
        raise UsageError(f"-n must be at most {MAX_NPROCS} (ranks of one node, each a process), got {nprocs}")
    from tray.envvars import share_gpus

    # NOTE: read on every backend: a wrong TRAY_SHARE_GPUS is refused on the laptop too, not first on the GPU host
    sharing = share_gpus(share, os.environ.get("TRAY_SHARE_GPUS"))
    if chosen == "cuda":
        from tray.backend.cuda import gpu_count

        visible = gpu_count()  # NOTE: from /proc where it can: no cuInit in the head before its ranks start
        check_gpus(nprocs, visible, os.environ.get("CUDA_VISIBLE_DEVICES"), share=sharing)
        nprocs = visible if nprocs is None else nprocs
    elif nprocs is None:
        nprocs = HOST_DEFAULT_NPROCS
    return chosen, nprocs


def check_gpus(nprocs: int | None, visible: int, cuda_visible_devices: str | None, share: bool = False) -> None:
    """Raise UsageError when a cuda tray of `nprocs` ranks (None: one per GPU) does not fit the `visible` GPUs
    (any number fits when `share`: ranks may share GPUs), before anything is spawned; the message names
    CUDA_VISIBLE_DEVICES when it is set."""
    where = f" (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r})" if cuda_visible_devices is not None else ""
    if visible == 0:
        raise UsageError(f"--backend cuda but no GPU is visible{where}; use --backend host")
    if nprocs is not None and nprocs > visible and not share:
        raise UsageError(f"-n {nprocs} needs {nprocs} GPUs (one per rank), {visible} visible{where}; "
                         f"use -n {visible} or fewer, --backend host, or --share-gpus (ranks take turns on a GPU: "
                         "for checking a program's correctness, not its speed)")


def rank_devices(nprocs: int, gpus: int) -> list[int]:
    """The GPU of each of `nprocs` local ranks over `gpus` visible ones: rank r on GPU r, or r mod `gpus` when
    the ranks outnumber the GPUs (--share-gpus)."""
    return [r % gpus if gpus > 0 else r for r in range(nprocs)]


def devices_for(backend: str, nprocs: int, share: bool | None) -> list[int]:
    """The GPU ordinal of each local rank (TRAY_DEVICE): its local rank, or with ranks sharing GPUs (`share`;
    None: TRAY_SHARE_GPUS) and more ranks than visible GPUs, the local rank modulo the GPUs."""
    if backend != "cuda":
        return list(range(nprocs))
    from tray.envvars import share_gpus

    if not share_gpus(share, os.environ.get("TRAY_SHARE_GPUS")):
        return list(range(nprocs))
    from tray.backend.cuda import gpu_count

    return rank_devices(nprocs, gpu_count())


def shared_note(devices: list[int], rank_base: int = 0) -> str | None:
    """The line the head prints when ranks share GPUs (`devices`: local rank -> GPU), else None."""
    by_gpu: dict[int, list[int]] = {}
    for r, d in enumerate(devices):
        by_gpu.setdefault(d, []).append(rank_base + r)
    if all(len(rs) == 1 for rs in by_gpu.values()):
        return None
    where = "; ".join(f"GPU {d}: ranks {','.join(map(str, rs))}" for d, rs in sorted(by_gpu.items()))
    return (f"--share-gpus: {len(devices)} ranks on {len(by_gpu)} GPU(s) ({where}). Ranks on one GPU take "
            "turns (time-sliced) and NCCL runs over its socket transport (each rank its own NCCL_HOSTID): for "
            "checking correctness; timings mean nothing")


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def warn_if_oversubscribed(nprocs: int, ncores: int | None = None, timeout_flag: str = "--barrier-timeout-s") -> bool:
    """Say on stderr when `nprocs` ranks outnumber the cores (a rank then waits for a core: barriers and
    heartbeats run late), naming the command's own barrier timeout option. Returns whether it warned."""
    ncores = cores() if ncores is None else ncores
    if nprocs <= ncores:
        return False
    print(f"tray: warning: {nprocs} ranks on {ncores} CPU cores: ranks wait for a core, so barriers and "
          f"steps take longer; raise {timeout_flag} if they time out", file=sys.stderr, flush=True)
    return True
