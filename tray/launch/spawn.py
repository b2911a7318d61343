"""Spawning ranks: the env contract (docs/design.md section 4), PR_SET_PDEATHSIG, NUMA binding, and the
output pumps that prefix every line with `[rank R]`."""

from __future__ import annotations

import ctypes
import errno
import os
import selectors
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TextIO

from tray.collectives.early import IDS_ENV
from tray.errors import UsageError
from tray.handshake import raise_fd_soft_limit
from tray.launch.output import STDERR, STDOUT, Routing, stamp
from tray.launch.ports import MASTER_ADDR
from tray.launch.spec import RankProcess, TraySpec
from tray.launch.watchdog import stat_fields
from tray.numa import NumaPlacement, prepare_binding

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
# one lock per terminal stream: a line is written whole under its stream's lock (a stdout nobody reads then
# blocks only what goes to stdout, never tray's own lines on stderr)
_stdout_lock, _stderr_lock = threading.Lock(), threading.Lock()


def _lock_of(stream: TextIO) -> threading.Lock:
    return _stdout_lock if stream is sys.stdout else _stderr_lock


# NOTE: the head holds 5 descriptors per rank (its pidfd among them) and 19 of its own (measured on the host
# backend: 29 at 2 ranks, 79 at 12), and ZeroMQ aborts the process (not an error it can catch) when it runs out: a
# margin over both
_FDS_PER_RANK = 6
_FDS_BASE = 32


def ensure_fd_limit(nprocs: int) -> None:
    """Raise this process's soft open-file limit to what `nprocs` ranks need (up to the hard limit); raises
    SetupError naming the limit when even the hard one is short."""
    import resource

    from tray.launch.jobdir import SetupError

    need = _FDS_BASE + _FDS_PER_RANK * nprocs
    before, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = raise_fd_soft_limit(need)
    if soft != resource.RLIM_INFINITY and soft < need:
        raise SetupError(f"the open-file limit (ulimit -n) is {before} (at most {hard}); a tray of {nprocs} ranks "
                         f"needs about {need} descriptors in its head: raise it, or run fewer ranks")


# NOTE: threads count against the user's process limit (ulimit -u) as processes do: the head runs 4 threads (3 more
# than when it checks), the watchdog 1, a rank 5 (measured on the host backend, 2 ranks), and ZeroMQ aborts a process
# that cannot start one (not an error it can catch). The least a tray starts, so that no tray that could run is
# refused (a rank's program may start more). Root is not held to the limit.
_TASKS_PER_RANK = 5
_TASKS_BASE = 4


def ensure_proc_limit(nprocs: int) -> None:
    """Raise SetupError naming the process limit (ulimit -u) when this user's processes and threads, with what a tray
    of `nprocs` ranks starts, would be over it (counted only when the limit is near); raise the soft limit to the hard
    one when that is enough."""
    import resource

    from tray.launch.jobdir import SetupError

    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    uid = os.getuid()
    need = _TASKS_BASE + _TASKS_PER_RANK * nprocs
    if soft == resource.RLIM_INFINITY or uid == 0 or soft >= 4 * need + 4096:
        return
    used = _tasks_of(uid)
    if used + need <= soft:
        return
    if hard == resource.RLIM_INFINITY or used + need <= hard:
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
            return
        except (OSError, ValueError):
            pass
    raise SetupError(f"the process limit (ulimit -u) is {soft} (at most {hard}), and this user runs {used} processes "
                     f"and threads now; a tray of {nprocs} ranks starts at least {need} more: raise it, or run fewer "
                     "ranks")


def _tasks_of(uid: int) -> int:
    """The processes and threads whose real user is `uid` (what the process limit counts), as /proc shows them."""
    used = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                used += int(fields["Threads"])
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return used


def say(msg: str, wait_s: float = -1) -> None:
    """One line of tray's own on stderr, `tray: msg`, written in one piece under the lock the output pump
    writes the ranks' lines to stderr under: never cut by, or joined to, a rank's line (print() writes the text
    and its newline apart, and a rank's line could come between). With `wait_s` >= 0, not said when that lock is not
    free within it (the pump is held up writing to stderr itself)."""
    if not _stderr_lock.acquire(timeout=wait_s):
        return
    try:
        sys.stderr.write(f"tray: {msg}\n")
        sys.stderr.flush()
    except OSError as exc:
        _reader_gone(sys.stderr, exc)
    finally:
        _stderr_lock.release()


# torchrun sets these per worker, overriding the launcher's own; ranks here get neither (docs/cli.md): one inherited
# would send every rank's @record traceback to one file, or make every rank a client of a store nobody hosts
TORCHRUN_PER_WORKER = ("TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE")


def torchrun_env(rank: int, nprocs: int, master_port: int | None, run_id: str, *, local_rank: int | None = None,
                 local_world_size: int | None = None, group_rank: int = 0, group_world_size: int = 1,
                 master_addr: str = MASTER_ADDR) -> dict[str, str]:
    """What torchrun gives its workers: by default for one host (one node: GROUP_RANK 0, one role);
    a job of several trays passes the global `rank` of `nprocs`, this node's `local_*` and `group_*`
    (node rank, node count) and the job's `master_addr`.

    Like torchrun, these override what the head's environment has (a MASTER_PORT exported in the shell
    would collide between trays); MASTER_* only when the head reserved a port."""
    local_rank = rank if local_rank is None else local_rank
    local_world_size = nprocs if local_world_size is None else local_world_size
    env = {
        "RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_world_size), "ROLE_NAME": "default", "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(nprocs), "TORCHELASTIC_RUN_ID": run_id,
    }
    if master_port is not None:
        env.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
    return env


def rank_env(spec: TraySpec, rank: int, *, job_dir: Path, endpoint: str, token: str, manifest: str,
             t_spawn: float, restart_count: int = 0, master_port: int | None = None, device: int | None = None,
             shared_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of rank `rank`: the head's own, untouched, plus the tray's variables and
    torchrun's (`torchrun_env`). `restart_count` is how many times `--max-restarts` started the tray again
    (0 on the first attempt). `device`: its GPU (default: `rank`); `shared_env`: what a rank on a GPU other ranks
    share needs (the collectives' StartJoin.shared_gpu_env)."""
    env = dict(os.environ)
    env.pop("TRAY_JOB_TOKEN", None)  # the job's secret is for the heads only; a rank never needs it
    env.pop(IDS_ENV, None)  # only this head says whether its ranks join early (a tray launched from a rank)
    for key in TORCHRUN_PER_WORKER:  # an outer torchrun's (or scheduler's) for this process, not for its ranks
        env.pop(key, None)
    env.update(dict(spec.extra_env))
    env.update({
        "TRAY_RANK": str(rank),
        "TRAY_WORLD_SIZE": str(spec.nprocs),
        "TRAY_LOCAL_RANK": str(rank),
        "TRAY_LOCAL_WORLD_SIZE": str(spec.nprocs),
        "TRAY_DEVICE": str(rank if device is None else device),
        "TRAY_RDZV": endpoint,
        "TRAY_JOB": str(job_dir),
        "TRAY_TOKEN": token,
        "TRAY_MANIFEST": manifest,
        "TRAY_BACKEND": spec.backend,
        "TRAY_VARS": ",".join(f"{k}={v}" for k, v in spec.vars),
        "TRAY_T_SPAWN": repr(t_spawn),
        "TRAY_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(torchrun_env(rank, spec.nprocs, master_port, spec.run_id or Path(job_dir).name))
    if spec.nprocs > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: N ranks of a CPU thread pool each would share the cores
    if spec.barrier_timeout_s is not None:
        env["TRAY_BARRIER_TIMEOUT_S"] = repr(spec.barrier_timeout_s)
    if shared_env is not None:
        env.update(shared_env)
    if spec.backend == "cuda":
        # NOTE: NCCL must not connect lazily inside a CUDA graph capture; respect a user's choice.
        env.setdefault("NCCL_RUNTIME_CONNECT", "0")
    return env


def log_path(log_dir: str, rank: int) -> Path:
    """The log file of `rank` under `log_dir`."""
    return Path(log_dir) / f"rank-{rank}.log"


def open_log(log_dir: str, rank: int, buffering: int = -1) -> TextIO:
    """Rank `rank`'s log file under `log_dir`, opened for appending: created 0600, never through a symlink, and
    refused (OSError EPERM) when another user owns it (in a shared directory, they could have made it to read what
    the rank writes)."""
    path = log_path(log_dir, rank)
    # NOTE: O_NONBLOCK: a FIFO planted at the name would block the open; regular files are told apart below
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads
            raise OSError(errno.EINVAL, f"{path} is not a regular file (a FIFO)", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file", str(path))
        if st.st_uid != os.getuid():
            raise OSError(errno.EPERM, f"{path} belongs to another user", str(path))
        os.set_blocking(fd, True)
        # NOTE: in the locale's encoding, as the rank's own files; what it lacks (LC_ALL=C: ASCII) escaped (\xe9)
        return open(fd, "a", buffering=buffering, closefd=True, errors="backslashreplace")
    except BaseException:
        os.close(fd)
        raise


def check_log_dir(log_dir: str) -> None:
    """Make --log-dir (as mkdir -p would) and check it is this user's to write logs in: owned by this user or root,
    and, if others may write in it, sticky (so none can replace a log file there). OSError (EPERM) says why not."""
    from tray.launch.jobdir import make_private_dirs, others_may_change, unsafe_ancestor

    # NOTE: asked before anything is made too: a directory refused must not be left behind, in another's directory
    above = unsafe_ancestor(Path(log_dir))
    if above:
        raise OSError(errno.EPERM, f"it {above}")
    make_private_dirs(Path(log_dir), 0o755)  # what it makes: no one else writes there, whatever the umask
    why = others_may_change(os.stat(log_dir))
    if why:
        raise OSError(errno.EPERM, f"another user could replace the log files in it ({why})")
    # NOTE: the directory itself judged as a parent of its files: a link there (the logs are opened by path, again
    # after the run) is judged like a link above it, so another user's link in /tmp cannot be pointed elsewhere
    above = unsafe_ancestor(Path(log_dir) / "rank-0.log")
    if above:
        raise OSError(errno.EPERM, f"a log file in it {above}")


def _preexec(bind: Callable[[], None] | None) -> Callable[[], None]:
    def run_in_child() -> None:
        # The head dies -> its ranks die, even on SIGKILL of the head.
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if bind is not None:
            bind()

    return run_in_child


def spawn_rank(spec: TraySpec, rank: int, env: dict[str, str], placement: NumaPlacement,
               process_group: int) -> RankProcess:
    """Start one rank in the tray's process group `process_group` (the watchdog's), with pipes for its
    output. Everything the rank starts inherits the group, so one kill of the group reaches it all."""
    t_spawn = float(env["TRAY_T_SPAWN"])
    try:
        popen = subprocess.Popen(
            list(spec.cmd), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=_preexec(prepare_binding(placement)), close_fds=True, process_group=process_group,
        )
    except OSError as exc:
        program = spec.cmd[0]
        hint = "check the command: a path, or a program on PATH"
        if exc.errno == errno.ENOENT and os.sep not in program and os.path.isfile(program):
            # a name without a slash is looked for on PATH only: the file beside it is not what was said missing
            hint = (f"a command without a '/' is looked for on PATH only, and {program} in this directory is not: "
                    f"name it ./{program}" + (f", or without `--` and --no-python (tray launch -n N {program}: this "
                                               "Python runs it)" if program.endswith(".py") else ""))
        elif exc.errno == errno.EACCES and program.endswith(".py"):
            hint = (f"{program} is not executable: name it without `--` (tray launch -n N {program}: this Python "
                    f"runs it), or start it with python (-- python {program})")
        elif exc.errno == errno.EACCES and os.sep in program and os.path.exists(program) and \
                not os.path.isfile(program):
            what = "a directory" if os.path.isdir(program) else "not a regular file (a FIFO, a device...)"
            hint = f"{program} is {what}: name the program to run"
        elif exc.errno == errno.EACCES and os.path.isfile(program) and not os.access(program, os.X_OK):
            hint = (f"{program} is a file without execute permission: chmod +x {program}, or start it with its "
                    "interpreter")
        elif exc.errno in (errno.EMFILE, errno.ENFILE):
            hint = "the head ran out of file descriptors: raise the open-file limit (ulimit -n)"
        elif exc.errno == errno.EAGAIN:
            hint = "no more processes may start: raise the process limit (ulimit -u), or run fewer ranks"
        elif exc.errno == errno.E2BIG:
            extra = sum(len(k) + len(v) + 2 for k, v in env.items() if os.environ.get(k) != v)
            hint = (f"the command line and environment are over the kernel's limit for a new program (ARG_MAX), and "
                    f"a rank's environment has {extra} B more than this one (tray's and torchrun's variables): "
                    "shorten the environment or the program's arguments")
        raise UsageError(f"cannot start rank {rank}: {program!r}: {exc.strerror}; {hint}") from None
    return RankProcess(rank=rank, popen=popen, t_spawn=t_spawn)


def process_started_at() -> float | None:
    """When this process started, on time.time()'s scale (the kernel counts in clock ticks: 10 ms); None
    without /proc. `tray launch` passes it on, so the timeline counts the head's own start too."""
    fields = stat_fields("self")
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): starttime
    except (OSError, ValueError, IndexError, TypeError):
        return None
    return time.time() - max(0.0, age)


def _escaped(text: str, stream: TextIO) -> str:
    """`text` with the characters `stream`'s encoding cannot write as backslash escapes (\\xe9), as Python writes
    them to its own stderr: a rank's line is shown, never the end of the output thread."""
    encoding = stream.encoding or "utf-8"
    return text.encode(encoding, "backslashreplace").decode(encoding)


def _reader_gone(dst: TextIO, exc: OSError) -> None:
    """The terminal stream `dst` lost its reader (`tray launch ... | head`), or cannot be written at all (`exc`:
    a full disk, /dev/full): from now on what goes to it is dropped (its fd points at /dev/null), said once on
    the other stream; the tray runs on, log files keep every line. Called with `dst`'s lock held."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, dst.fileno())
        finally:
            os.close(null)
    except (OSError, ValueError):
        return
    other = sys.stderr if dst is sys.stdout else sys.stdout
    name = "stdout" if dst is sys.stdout else "stderr" if dst is sys.stderr else "a terminal stream"
    why = "was closed by its reader" if isinstance(exc, BrokenPipeError) else f"cannot be written ({exc.strerror})"
    try:
        other.write(f"tray: {name} {why}; the ranks' lines to it are dropped from now on (--log-dir keeps them)\n")
        other.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass


class _Stream:
    """One rank stream being pumped: its fd, where its lines go, and the partial last line."""

    def __init__(self, proc: RankProcess, src: IO[bytes], dst: TextIO | None, log: TextIO | None) -> None:
        self.proc = proc
        self.src = src
        self.fd = src.fileno()
        self.dst = dst  # None: not shown on the terminal
        self.log = log  # None: not kept in the rank's file
        self.partial = bytearray()
        self.partial_since: float | None = None  # when the unfinished line began (monotonic)
        self.shown = False  # its line was shown unfinished, and nothing came since: its newline ends nothing new


def _unread_nbytes(fd: int) -> int:
    """Bytes waiting in pipe `fd` (FIONREAD); 0 where that cannot be told."""
    import fcntl
    import termios

    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return int.from_bytes(buf, sys.byteorder)


def _incomplete_utf8_tail(data: bytearray) -> int:
    """How many bytes at the end of `data` begin a UTF-8 sequence that is not complete yet (0 when none)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:
            continue  # a continuation byte: its lead is further back
        need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
        return back if back < need else 0
    return 0


def _utf8_cut(data: bytearray, limit: int) -> int:
    """Where to cut `data` at most `limit` bytes in, not inside a UTF-8 sequence (continuation bytes are
    10xxxxxx; a sequence is at most 4 bytes: if no boundary is near, the cut is at `limit`)."""
    if len(data) <= limit:
        return len(data)
    for cut in range(limit, max(limit - 3, 1) - 1, -1):
        if data[cut] & 0xC0 != 0x80:
            return cut
    return limit


class OutputPump:
    """One thread that copies every rank's stdout/stderr to ours, each line prefixed `[rank R]`, and/or to
    its `--log-dir` file, stamped (tray.launch.output.stamp), as `routing` says; it reads only what
    select() says is there, so it never blocks teardown.

    `stop(drain_s)` lets it read until every stream ended or `drain_s` passed, then closes the
    streams: a leftover process that still holds a rank's stdout cannot keep the head waiting."""

    # NOTE: how long one select() waits before looking at the stop request again.
    _TICK_S = 0.05
    _CHUNK_NBYTES = 65536
    # A line longer than this is printed in pieces of at most this many bytes (each its own prefixed line), so
    # a rank writing without newlines costs the head time linear in its bytes and bounded memory.
    LINE_MAX_NBYTES = 65536
    # An unfinished line this old is shown as it stands (a progress bar redrawn with \r, a prompt without a
    # newline): what a terminal would show of it, its text after the last \r; the rest of the line follows as
    # its own line.
    PARTIAL_SHOWN_AFTER_S = 1.0

    def __init__(self, procs: list[RankProcess], routing: Routing) -> None:
        self._logs: list[TextIO] = []
        self._log_dir = routing.log_dir
        self._sel = selectors.DefaultSelector()
        for proc in procs:
            log = None
            if routing.log_dir:
                Path(routing.log_dir).mkdir(parents=True, exist_ok=True)
                log = open_log(routing.log_dir, proc.rank, buffering=1)
                self._logs.append(log)
            for src, dst, which in ((proc.popen.stdout, sys.stdout, STDOUT), (proc.popen.stderr, sys.stderr, STDERR)):
                if src is not None:
                    stream = _Stream(proc, src, dst if routing.to_terminal(proc.rank, which) else None,
                                     log if routing.to_log(proc.rank, which) else None)
                    self._sel.register(src.fileno(), selectors.EVENT_READ, stream)
        self._drain_until: float | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tray-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        unread: list[str] = []
        try:
            while self._sel.get_map():
                with self._lock:
                    until = self._drain_until
                if until is not None and time.monotonic() >= until:
                    # NOTE: what a stream still held when the drain ran out is dropped: said, not lost in silence
                    unread = [f"rank {s.proc.rank}'s {'stdout' if s.src is s.proc.popen.stdout else 'stderr'} "
                              f"{n} B" for s in (k.data for k in self._sel.get_map().values())
                              if (n := _unread_nbytes(s.fd))]
                    break
                for key, _ in self._sel.select(self._TICK_S):
                    self._read(key.data)
                self._show_old_partials(time.monotonic())
        finally:
            for key in list(self._sel.get_map().values()):
                self._finish(key.data)
            if unread:
                say(f"output not shown, still unread when the head stopped reading its ranks: {'; '.join(unread)}")
            self._sel.close()
            for log in self._logs:
                try:
                    log.close()
                except OSError:  # what it still held could not be written: said when it failed
                    pass

    def _read(self, s: _Stream) -> None:
        try:
            chunk = os.read(s.fd, self._CHUNK_NBYTES)
        except OSError:
            chunk = b""
        if not chunk:
            self._finish(s)
            return
        if s.shown and not s.partial:  # the line shown unfinished ends here: its newline adds no empty line
            chunk = chunk[2:] if chunk.startswith(b"\r\n") else chunk[1:] if chunk.startswith(b"\n") else chunk
        s.shown = False
        if not chunk:
            return
        first, newline, rest = chunk.partition(b"\n")
        s.partial += first  # only the new bytes are searched: a long line costs linear time
        self._emit_pieces(s)
        if newline:
            self._emit(s, bytes(s.partial))
            *lines, last = rest.split(b"\n")
            for raw in lines:
                self._emit(s, raw)
            s.partial = bytearray(last)
            self._emit_pieces(s)
        if not s.partial:
            s.partial_since = None
        elif s.partial_since is None or newline:
            s.partial_since = time.monotonic()

    def _show_old_partials(self, now: float) -> None:
        for key in list(self._sel.get_map().values()):
            s = key.data
            if s.partial and s.partial_since is not None and now - s.partial_since >= self.PARTIAL_SHOWN_AFTER_S:
                keep = _incomplete_utf8_tail(s.partial)  # a character split between two writes stays whole
                ready = s.partial[:len(s.partial) - keep]
                if ready.rstrip(b"\r").rpartition(b"\r")[2].strip():  # nothing to show: wait for more
                    self._emit(s, bytes(ready))
                    s.partial = s.partial[len(ready):]
                    s.shown = not s.partial
                s.partial_since = None if not s.partial else now

    def _emit_pieces(self, s: _Stream) -> None:
        """Emit the unfinished line's leading pieces until at most LINE_MAX_NBYTES of it is held (and a `\r` that
        may be the first half of its `\r\n`: a line of exactly the limit comes out whole)."""
        while len(s.partial) > self.LINE_MAX_NBYTES + s.partial.endswith(b"\r"):
            cut = _utf8_cut(s.partial, self.LINE_MAX_NBYTES)
            self._emit(s, bytes(s.partial[:cut]))
            del s.partial[:cut]

    def _finish(self, s: _Stream) -> None:
        if s.partial:
            self._emit(s, bytes(s.partial))
            s.partial = bytearray()
        self._sel.unregister(s.fd)
        s.src.close()

    def _emit(self, s: _Stream, raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip("\r")
        # the terminal and the failure report get what a terminal shows of a line redrawn with \r (a progress
        # bar): its text after the last \r; the log file keeps the line as written
        line = text.rpartition("\r")[2]
        s.proc.tail.append(line)
        if s.dst is not None:
            with _lock_of(s.dst):
                try:
                    out = f"[rank {s.proc.rank}] {line}\n"
                    try:
                        s.dst.write(out)
                    except UnicodeEncodeError:  # a character its encoding lacks (LC_ALL=C, PYTHONIOENCODING=ascii)
                        s.dst.write(_escaped(out, s.dst))
                    s.dst.flush()
                except OSError as exc:
                    _reader_gone(s.dst, exc)
        if s.log is not None:
            try:
                s.log.write(f"{stamp()} {text}\n")
            except OSError as exc:
                self._log_failed(s, exc)

    def _log_failed(self, s: _Stream, exc: OSError) -> None:
        """A rank's log file cannot be written (its disk is full): said once; its lines are no longer kept there
        (the terminal still gets those it would), and the tray runs on."""
        log = s.log
        for other in [s] + [key.data for key in self._sel.get_map().values()]:
            if other.log is log:
                other.log = None
        say(f"{log_path(self._log_dir, s.proc.rank)}: {exc.strerror}; rank {s.proc.rank}'s lines are no longer "
            "kept in it")

    def stop(self, drain_s: float) -> None:
        """Read for at most `drain_s` more seconds (until every stream ended), then stop and return; what was left
        unread is said (the streams' bytes), as is a pump still held up writing to the head's own output."""
        with self._lock:
            self._drain_until = time.monotonic() + drain_s
        wait_s = drain_s + 5 * self._TICK_S + 1.0
        self._thread.join(timeout=wait_s)
        if self._thread.is_alive():
            say(f"rank output not all shown: the head's own stdout or stderr took none for {wait_s:.1f} s (a pipe "
                "whose reader is slow or stopped); what was not written is dropped", wait_s=1.0)
