"""The collectives' /dev/shm segments of a tray's ranks: recorded while they run, removed once dead.

A rank killed mid-run cannot unlink the collectives' segments (NCCL's, on cuda). The head reads which
ones its ranks map (`/proc/<pid>/maps`) and records them in the job dir (`shm.list`); whoever cleans
the job dir (the head, its watchdog, or the next launch's sweep once the job dir's lock is free)
removes exactly those, and only if they are owned by this uid, named as `tray.collectives.SHM_NAME_RE`
says, and mapped or held open by no process we can see. Segments of another tray are never listed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tray.collectives import SHM_NAME_RE

if TYPE_CHECKING:
    import psutil
else:
    from tray.lazy import lazy_import

    psutil = lazy_import("psutil")  # NOTE: the head needs it at teardown, not before its ranks start

SHM_DIR = "/dev/shm"
SHM_LIST_NAME = "shm.list"


def mapped_collective_shm(pids: Iterable[int]) -> set[str]:
    """Names (e.g. `nccl-a1B2c3`) of the collectives' segments that processes `pids` map and that still exist."""
    found: set[str] = set()
    prefix = SHM_DIR + "/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at < 0 or line.endswith("(deleted)\n"):
                        continue
                    name = line[at + len(prefix):].strip()
                    if SHM_NAME_RE.match(name):
                        found.add(name)
        except OSError:
            continue
    return found


def record_shm(job_fd: int, names: Iterable[str]) -> None:
    """Append `names` to the job dir's shm.list (opened relative to the job dir's fd)."""
    text = "".join(f"{n}\n" for n in sorted(names))
    if not text:
        return
    fd = os.open(SHM_LIST_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=job_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def recorded_shm(job_fd: int) -> set[str]:
    """The names in the job dir's shm.list that look like NCCL segments (anything else is ignored)."""
    try:
        fd = os.open(SHM_LIST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=job_fd)
    except OSError:
        return set()
    with os.fdopen(fd) as f:
        return {ln.strip() for ln in f if SHM_NAME_RE.match(ln.strip())}


def in_use(paths: set[str], but: int | None = None) -> set[str]:
    """The paths among `paths` that a visible process of this uid (other than pid `but`) maps or holds open."""
    used: set[str] = set()
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.pid == but or proc.info["uids"] is None or proc.info["uids"].real != os.getuid():
                continue
            used.update(m.path for m in proc.memory_maps(grouped=True) if m.path in paths)
            used.update(f.path for f in proc.open_files() if f.path in paths)
        except (psutil.Error, OSError):
            continue
    return used


def remove_shm(names: Iterable[str]) -> list[str]:
    """Unlink the NCCL segments `names` that are ours and unused; returns the names removed."""
    candidates: dict[str, str] = {}
    for name in names:
        if not SHM_NAME_RE.match(name):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            candidates[path] = name
    if not candidates:
        return []
    busy = in_use(set(candidates))
    removed = []
    for path, name in candidates.items():
        if path in busy:
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return removed


def remove_recorded_shm(root_fd: int, job_name: str) -> list[str]:
    """remove_shm() of the segments recorded in job dir `job_name` under the root's fd. The caller
    holds the job dir's lock (its head and watchdog are gone)."""
    try:
        job_fd = os.open(job_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError:
        return []
    try:
        return remove_shm(recorded_shm(job_fd))
    finally:
        os.close(job_fd)
