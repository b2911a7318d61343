"""Private job directories (0700) under the user's runtime dir, and sweeping stale ones."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import psutil


def jobs_root() -> Path:
    """$TRAY_JOBS_ROOT or $TMPDIR/tray-<uid>: one root per user, 0700."""
    root = Path(os.environ.get("TRAY_JOBS_ROOT") or Path(tempfile.gettempdir()) / f"tray-{os.getuid()}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = root.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{root} must be owned by uid {os.getuid()} with mode 0700")
    return root


def make_job_dir() -> Path:
    """A new job dir named after the head's pid; 0700 (mkdtemp)."""
    sweep_stale()
    return Path(tempfile.mkdtemp(prefix=f"job-{os.getpid()}-", dir=jobs_root()))


def head_pid_of(job_dir: Path) -> int | None:
    try:
        return int(job_dir.name.split("-")[1])
    except (IndexError, ValueError):
        return None


def sweep_stale() -> list[Path]:
    """Remove job dirs whose head is gone (a head killed with SIGKILL cannot clean up)."""
    removed = []
    for d in jobs_root().glob("job-*"):
        pid = head_pid_of(d)
        if pid is not None and not psutil.pid_exists(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed
