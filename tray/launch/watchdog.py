"""The tray's watchdog: a tiny sidecar that outlives a SIGKILLed head just long enough to clean up.

The head starts it first; it leads the tray's process group (every rank, and everything a rank
starts, joins that group) and holds the job dir's lock with the head. It waits on a pipe from the
head. EOF without "done" means the head died: it kills every other process of the group and every process of
this user whose environment names the job dir (TRAY_JOB: a rank's descendants that left the group), removes the
NCCL segments the head recorded, removes the job dir, and exits. A group led by a live process cannot be reused
by another, and a job dir's name is never reused, so the kills never reach a stranger.

    python -m tray.launch.watchdog ROOT JOB_NAME PIPE_FD LOCK_FD
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tray.envvars import own_module
from tray.launch.jobdir import SetupError, open_root
from tray.launch.shm import remove_recorded_shm
from tray.text import is_digits

DONE = b"done\n"
# NOTE: SIGKILLed processes vanish within milliseconds; the bound only guards against a process in
# uninterruptible sleep (D state), which no signal can end sooner.
REAP_TIMEOUT_S = 5.0
# NOTE: once the ranks are gone, what they started gets SIGTERM and this long to end before SIGKILL: a multiprocessing
# resource tracker (which ignores SIGTERM) then unlinks the /dev/shm semaphores and segments its dead clients left.
SETTLE_S = 1.0
# what the watchdog ignores: the stop signals are the head's to act on, SIGUSR1/SIGUSR2 (Slurm's --signal) the ranks'
IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_ROOT_ENV, _JOB_ENV = "TRAY_WATCHDOG_ROOT", "TRAY_WATCHDOG_JOB"  # the jobs root and the job dir's name


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses): state, ppid,
    ... (field 3 of proc(5) is [0]); None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int | str) -> str | None:
    """Process `pid`'s start time (field 22 of /proc/PID/stat, clock ticks after boot): with the pid, it names one
    process, not a later one given the same pid. None when it cannot be read or the process is a zombie."""
    fields = stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 and fields[0] != "Z" else None


def adopted_line(pid: int, started: str) -> bytes:
    """What the head tells its watchdog of a process it adopted (stays a child of no one once the head is gone)."""
    return f"adopted {pid} {started}\n".encode()


def adopted_in(data: bytes) -> list[tuple[int, str]]:
    """(pid, start time) of each `adopted` line the head wrote; other lines are skipped."""
    found = []
    for line in data.split(b"\n"):
        words = line.split()
        if len(words) == 3 and words[0] == b"adopted" and words[1].isdigit() and words[2].isdigit():
            found.append((int(words[1]), words[2].decode()))
    return found


def adopted_alive(adopted: list[tuple[int, str]], exclude: frozenset[int] = frozenset()) -> list[int]:
    """Those of `adopted` still running as the same process (same start time), this user's, minus `exclude`."""
    uid, alive = os.getuid(), []
    for pid, started in adopted:
        try:
            if pid in exclude or os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        if start_time(pid) == started:
            alive.append(pid)
    return alive


def group_members(pgid: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Pids of the live processes in process group `pgid` (from /proc), minus `exclude`."""
    found = []
    for entry in os.listdir("/proc"):
        if not is_digits(entry):
            continue
        pid = int(entry)
        if pid in exclude:
            continue
        fields = stat_fields(pid)  # state ppid pgrp ...
        if fields is not None and len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            found.append(pid)
    return found


def marked_processes(mark: bytes, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Pids of this user's live processes whose environment holds the entry `mark` (b"NAME=value"), from /proc,
    minus `exclude`: a rank's descendants inherit TRAY_JOB, also those that left the tray's process group."""
    found, uid, entry_of = [], os.getuid(), b"\0" + mark + b"\0"
    for entry in os.listdir("/proc"):
        if not is_digits(entry) or int(entry) in exclude:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = b"\0" + f.read() + b"\0"
        except OSError:  # gone, or not ours to read
            continue
        fields = stat_fields(entry)
        if entry_of in environ and fields is not None and fields[0] != "Z":
            found.append(int(entry))
    return found


def kill_marked(mark: bytes, exclude: frozenset[int], timeout_s: float = REAP_TIMEOUT_S) -> list[int]:
    """SIGKILL this user's processes whose environment holds `mark` until none is left or `timeout_s` passed (one
    may fork while we look); returns the pids still alive then (normally none, and none when /proc cannot be
    listed)."""
    return _signal_until_gone(lambda: marked_processes(mark, exclude), signal.SIGKILL, timeout_s, set(),
                              raise_unlisted=False)


def kill_group(pgid: int, exclude: frozenset[int], timeout_s: float = REAP_TIMEOUT_S) -> list[int]:
    """SIGKILL every process of group `pgid` except `exclude` until none is left (a process may fork
    while we look) or `timeout_s` passed; reaps those that are our children (orphans adopted by a
    subreaper). Returns the pids still alive at the end (normally none)."""
    signalled: set[int] = set()
    try:
        return _signal_until_gone(lambda: group_members(pgid, exclude), signal.SIGKILL, timeout_s, signalled,
                                  raise_unlisted=True)
    finally:
        _reap(signalled)


def term_group(pgid: int, exclude: frozenset[int], grace_s: float) -> list[int]:
    """SIGTERM every process of group `pgid` except `exclude` (once each) and wait up to `grace_s` for the group to
    empty; the pids still there then (for kill_group), reaping those that are our children. What the ranks started
    gets to end as under torchrun, which SIGTERMs its workers' groups: a multiprocessing resource tracker (it ignores
    SIGTERM) unlinks the semaphores and shared memory its dead clients left in /dev/shm once the last of them (a
    rank, its DataLoader workers) is gone, and a SIGKILL at once would leave them there. /proc that cannot be listed
    gives none (kill_group says so)."""
    signalled: set[int] = set()
    try:
        return _signal_until_gone(lambda: group_members(pgid, exclude), signal.SIGTERM, grace_s, signalled,
                                  raise_unlisted=False, again=False)
    finally:
        _reap(signalled)


def _signal_until_gone(find: Callable[[], list[int]], sig: int, timeout_s: float, signalled: set[int], *,
                       raise_unlisted: bool, again: bool = True) -> list[int]:
    """Send `sig` to the pids `find()` gives until it gives none or `timeout_s` passed; the pids left then. `again`:
    to every pid each round (SIGKILL: one may have forked), else once to each (SIGTERM: a handler is not to be
    interrupted over and over). /proc that cannot be listed (every descriptor in use: EMFILE) is asked again until
    the deadline, then raises OSError or, without `raise_unlisted`, gives none. The pids signalled are added to
    `signalled`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = find()
        except OSError:
            if time.monotonic() >= deadline:
                if raise_unlisted:
                    raise
                return []
            time.sleep(0.05)
            continue
        if not left or time.monotonic() >= deadline:
            return left
        for pid in left:
            if not again and pid in signalled:
                continue
            try:
                os.kill(pid, sig)
                signalled.add(pid)
            except OSError:
                pass
        time.sleep(0.005)


def _reap(pids: set[int]) -> None:
    """Collect the exit status of those of `pids` that are our children and have ended (orphans adopted by the
    head, a subreaper): otherwise they would stay zombies."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


class Watchdog:
    """The head's handle on its watchdog: `pgid` is the tray's process group. `done()` tells it the
    head cleaned up itself and waits for it to exit."""

    def __init__(self, root: Path, job_name: str, lock_fd: int) -> None:
        read_fd, self._write_fd = os.pipe()
        os.set_inheritable(lock_fd, True)
        # NOTE: where the job is goes in the environment, which only this user can read (a command line is anyone's);
        # the job's secret does not go at all
        cmd, env = own_module("tray.launch.watchdog", str(read_fd), str(lock_fd))
        env.pop("TRAY_JOB_TOKEN", None)
        # NOTE: nor the job dir of a tray this one runs inside (a tray launched by a rank): that tray's watchdog kills
        # what names its job dir, and this one must outlive it to clean up after its own head
        env.pop("TRAY_JOB", None)
        env.update({_ROOT_ENV: str(root), _JOB_ENV: job_name})
        # NOTE: the signals it ignores are blocked from its fork until its main() ignores them (it unblocks them then):
        # a SIGTERM to the tray's process group while its interpreter starts (~0.1-0.5 s) ended it, and with it the
        # tray (exit 3). A signal meanwhile to the head stays pending here, delivered when the mask is put back.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED_SIGNALS)
        try:
            self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(read_fd, lock_fd), process_group=0,
                                          env=env)
        except BaseException:
            os.close(self._write_fd)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            os.close(read_fd)
            os.set_inheritable(lock_fd, False)
        self.pgid = self.popen.pid

    def adopted(self, pids: list[int]) -> None:
        """Tell the watchdog of processes the head adopted (orphans of the ranks' descendants that left the tray's
        group): should the head die, no subreaper holds them, nor need their environment name the job dir any more,
        so the watchdog stops them by pid and start time. Best effort: a full pipe drops the note."""
        lines = b"".join(adopted_line(pid, started) for pid in pids if (started := start_time(pid)) is not None)
        if lines and self._write_fd >= 0:
            try:
                os.write(self._write_fd, lines)
            except OSError:
                pass

    def done(self, timeout_s: float = 5.0) -> None:
        """Release the watchdog without a cleanup (the head did it). Idempotent."""
        if self._write_fd >= 0:
            try:
                os.write(self._write_fd, DONE)
            except OSError:
                pass
            os.close(self._write_fd)
            self._write_fd = -1
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def _watch(root: str, job_name: str, pipe_fd: int, lock_fd: int) -> int:
    data = b""
    while True:
        try:
            chunk = os.read(pipe_fd, 64)
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    if data.endswith(DONE):
        return 0
    adopted = adopted_in(data)
    # the head died without cleaning up: every process of the tray's group, then the rank's descendants that left
    # it (setpgid, setsid: the head, a subreaper, would have adopted and killed them), known by the job dir their
    # environment names; as in the head's teardown, SIGTERM and a moment to end first (the ranks themselves died with
    # the head): a multiprocessing resource tracker unlinks what its dead clients left in /dev/shm once they are gone
    me, pgid = os.getpid(), os.getpgid(0)
    mark = f"TRAY_JOB={Path(root) / job_name}".encode()
    signalled: set[int] = set()
    _signal_until_gone(lambda: group_members(pgid, frozenset({me})) + marked_processes(mark, frozenset({me}))
                       + adopted_alive(adopted, frozenset({me})),
                       signal.SIGTERM, SETTLE_S, signalled, raise_unlisted=False, again=False)
    kill_group(pgid, frozenset({me}))
    kill_marked(mark, frozenset({me}))
    # the head's adopted orphans, which may have left both the group and the environment that names the job dir
    _signal_until_gone(lambda: adopted_alive(adopted, frozenset({me})), signal.SIGKILL, REAP_TIMEOUT_S, set(),
                       raise_unlisted=False)
    try:
        _, root_fd = open_root(Path(root))
    except SetupError:
        return 1
    try:
        remove_recorded_shm(root_fd, job_name)
        shutil.rmtree(job_name, dir_fd=root_fd, ignore_errors=True)
    finally:
        os.close(root_fd)
        os.close(lock_fd)
    return 0


def main(argv: list[str]) -> int:
    # The terminal's Ctrl-C and a SIGTERM are the head's to handle, SIGUSR1/SIGUSR2 (Slurm's --signal) the ranks'; the
    # watchdog only acts on EOF. Started with them blocked (Watchdog): ignored first, then unblocked (one pending goes).
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED_SIGNALS)
    pipe_fd, lock_fd = int(argv[0]), int(argv[1])
    return _watch(os.environ[_ROOT_ENV], os.environ[_JOB_ENV], pipe_fd, lock_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
