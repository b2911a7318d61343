"""The environment a figure was measured in: commit, host, Python, and (when present) GPU facts."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any


def git_commit() -> str:
    """The commit of the git work tree this tray package was imported from (a checkout or an editable
    install), "-dirty" when it has changes; "unknown" for an installed wheel (set TRAY_COMMIT there), also one
    installed under another project's work tree (a venv in the user's repository: its commit is not tray's)."""
    here = str(Path(__file__).resolve().parent)
    try:
        tracked = subprocess.run(["git", "-C", here, "ls-files", "--error-unmatch", "--", Path(__file__).name],
                                 capture_output=True, text=True, timeout=5)
        if tracked.returncode != 0:  # not a git work tree, or one that does not hold this file
            return "unknown"
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip() or "unknown"
        return commit + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_facts() -> dict[str, Any]:
    """GPU names, driver and NCCL versions where they can be read (nvidia-smi, libnccl); {} without."""
    facts: dict[str, Any] = {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,persistence_mode",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        rows = [[c.strip() for c in line.split(",")] for line in out.stdout.strip().splitlines() if line]
        if out.returncode == 0 and rows:
            facts["gpus"] = [r[0] for r in rows]
            facts["gpu"] = rows[0][0]
            facts["driver"] = rows[0][1]
            facts["gpu_memory"] = rows[0][2]
            if len(rows[0]) > 3:  # Enabled: the driver keeps the GPUs initialised with no process using them
                facts["persistence_mode"] = rows[0][3]
    except (OSError, subprocess.SubprocessError):
        pass
    if facts:
        try:
            from tray.backend.cuda import driver as drv

            drv.init()
            v = drv.driver_version()
            facts["cuda_driver_api"] = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:
            pass
        try:
            from tray.collectives.nccl import version

            facts["nccl"] = version()
        except Exception:
            pass
    return facts


# the environment variables that change what a figure measures, kept beside it (never a token: see _SECRET)
_KNOBS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_", "TRAY_",
          "TORCH_SYMM_MEM_", "NVSHMEM_", "PYTHONDONTWRITEBYTECODE")
_SECRET = ("TOKEN", "SECRET", "KEY", "PASSWORD")


def knobs(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of `environ` (default os.environ) named in _KNOBS, secrets left out."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in sorted(env.items())
            if k.startswith(_KNOBS) and not any(s in k for s in _SECRET)}


_LOAD_AT_IMPORT = round(os.getloadavg()[0], 2)


def environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Facts to store beside every result: commit, host, Python, GPU, driver, NCCL, the variables in effect."""
    env = {
        "commit": os.environ.get("TRAY_COMMIT") or git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        # the 1-minute load average when this module was imported (a bench's start) and now (its report, its own
        # processes counted): a figure timed on a machine already busy says so
        "load_average_1m_start": _LOAD_AT_IMPORT,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "variables": knobs(),
    }
    env.update(gpu_facts())
    env.update(extra or {})
    return env
