"""A TCP port reserved for a job's torch rendezvous (MASTER_PORT), held by the head while the job runs."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time

from tray.launch.jobdir import still_named

# NOTE: one host: ranks reach rank 0's store over loopback (torchrun's standalone mode does the same).
MASTER_ADDR = "127.0.0.1"


def _lock_port(dir_fd: int, port: int) -> int:
    """Hold `port-<port>.lock` under `dir_fd` (its fd, the holder's pid written in it); OSError(EADDRINUSE) naming
    the holder when another process holds it. The holder removes the file as it lets go (PortReservation.close);
    the jobs root's sweep removes one a killed holder left."""
    name = f"port-{port}.lock"
    for _ in range(_LOCK_TRIES):
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        locked = _flock_soon(fd)
        if not still_named(fd, name, dir_fd):
            # NOTE: its holder (or the sweep) removed it between our open and our flock: that inode is no one's
            # lock any more, whoever holds it now; try the file as it is named now
            os.close(fd)
            continue
        if not locked:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OSError(errno.EADDRINUSE, f"another tray (head pid {holder}) holds it")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd
    raise OSError(errno.EADDRINUSE, f"its lock file {name} kept changing under this tray")


_LOCK_TRIES = 8
_HELD_RECHECKS_S = (0.005, 0.02, 0.05)  # a held lock is tried again after each of these waits


def _flock_soon(fd: int) -> bool:
    """Whether `fd` got its exclusive lock, now or after the waits of _HELD_RECHECKS_S."""
    for wait_s in (*_HELD_RECHECKS_S, None):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if wait_s is None:
                return False
            # NOTE: another tray's sweep holds a stale lock for the moment it takes to remove it; a tray's own hold
            # lasts its whole run, so a lock still held after these short waits is a tray's
            time.sleep(wait_s)
    return False


class PortReservation:
    """A free port, held by a bound (never listening) socket until `close()`.

    WHY held and not probed-then-freed: the port is picked by `bind(port 0)` without SO_REUSEADDR, so the
    kernel gives it to nobody else who binds it that way, such as another tray's head reserving its own.
    SO_REUSEADDR is set after the bind, so rank 0's torch TCPStore (which binds with SO_REUSEADDR and
    listens) can still bind it while this socket holds it: a non-listening holder does not conflict then.
    What this keeps out: a process that binds this exact port number by itself, without SO_REUSEADDR, fails
    with EADDRINUSE while the job runs. What it does not: Linux lets any user's socket that sets SO_REUSEADDR
    share a port no socket listens on, so such a process (of any user) may bind it and listen before rank 0's
    store does; rank 0's store then fails to bind, naming the port. torch's store takes no credentials anyway:
    whoever can reach it may connect.

    A port asked for is bound with SO_REUSEADDR (a connection of its last user left in TIME_WAIT must not refuse
    it), which another holder that set it too would not refuse either: so another tray of this user is kept off it
    by a lock, `port-<P>.lock` in the jobs root (`lock_dir_fd`), held while this reservation is.
    """

    def __init__(self, host: str = MASTER_ADDR, port: int = 0, lock_dir_fd: int | None = None) -> None:
        """`port` 0: a free one; else that one (OSError when it is taken, EADDRINUSE naming the tray that holds
        it when another tray of this user does)."""
        self.host = host
        self._lock_fd: int | None = None
        self._lock_at = (lock_dir_fd, f"port-{port}.lock")
        self._sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if port and lock_dir_fd is not None:
                self._lock_fd = _lock_port(lock_dir_fd, port)
            if port:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        except BaseException:
            self.close()
            raise
        self.port: int = self._sock.getsockname()[1]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._lock_fd is not None:
            dir_fd, name = self._lock_at
            try:  # NOTE: removed while still held, so no other tray can find it unlocked in between
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
