"""The fault matrix of the launcher: the jobs root, leftover processes, shared memory, deadlines, big
messages, head-side OS errors and restarts. Each case runs with a bound on time, and the `tray_env`
fixture checks that nothing is left behind (processes carrying the test's marker, job dirs, /dev/shm);
in-process cases also check the head's fds."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq
from conftest import planted_segment

from tray.launch import TraySpec, run_tray

# a leftover child: inherits the rank's stdout/stderr and carries the test's marker
SPAWN_LEFTOVER = """
import subprocess
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]])
"""


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def start_head(tray_env, n: int, body: str, *args: str, stderr: int = subprocess.DEVNULL) -> subprocess.Popen:
    """A head in the background, its stdout piped (its stderr as `stderr` says); returns once every rank printed
    `up`."""
    head = subprocess.Popen(tray_env.command(n, body, *args), stdout=subprocess.PIPE, stderr=stderr,
                            text=True, env=tray_env.env(), cwd=str(tray_env.tmp))
    seen, deadline = 0, time.monotonic() + 30
    while seen < n and time.monotonic() < deadline:
        seen += head.stdout.readline().strip().endswith("up")
    assert seen == n, "the ranks did not come up"
    return head


def sigkill_leaves_nothing(tray_env, head: subprocess.Popen) -> None:
    """SIGKILL the head: what it leaves (ranks, their children, the job dir) is gone within 5 s (the watchdog)."""
    t0 = time.monotonic()
    head.send_signal(signal.SIGKILL)
    head.wait(timeout=10)
    assert wait_for(lambda: tray_env.leftovers() == [], 5), tray_env.leftovers()
    assert time.monotonic() - t0 < 5


# --- 1. the jobs root --------------------------------------------------------------------------------

def launch_with_root(tray_env, root: Path):
    env = tray_env.env()
    env["TRAY_JOBS_ROOT"] = str(root)
    cmd = [sys.executable, "-m", "tray", "launch", "-n", "1", "--backend", "host", "--", sys.executable, "-c", "pass"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=str(tray_env.tmp))


def test_jobs_root_symlink_is_refused(tray_env, tmp_path):
    elsewhere = tmp_path / "chosen-by-someone-else"
    elsewhere.mkdir(mode=0o700)
    link = tmp_path / "root-link"
    link.symlink_to(elsewhere)
    run = launch_with_root(tray_env, link)
    assert run.returncode == 2, run.stderr
    assert "is a symbolic link or not a directory" in one_error_line(run.stderr)
    assert list(elsewhere.iterdir()) == []


def test_jobs_root_under_a_file_names_the_file(tray_env, tmp_path):
    """TRAY_JOBS_ROOT=/dev/null/x said 'File exists', which names neither the file nor the fault."""
    afile = tmp_path / "a-file"
    afile.write_text("")
    run = launch_with_root(tray_env, afile / "x")
    assert run.returncode == 2, run.stderr
    assert f"cannot create the jobs root {afile / 'x'}: {afile} is not a directory" in one_error_line(run.stderr)


def test_jobs_root_open_to_others_is_refused(tray_env, tmp_path):
    root = tmp_path / "shared-root"
    root.mkdir()
    root.chmod(0o755)
    run = launch_with_root(tray_env, root)
    assert run.returncode == 2, run.stderr
    assert "has mode 0755, expected 0700" in one_error_line(run.stderr)
    assert f"chmod 700 {root} if it is yours alone" in one_error_line(run.stderr)


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory of another uid needs root")
def test_jobs_root_of_another_uid_is_refused(tray_env, tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 4321, 4321)
    run = launch_with_root(tray_env, root)
    assert run.returncode == 2, run.stderr
    assert "is owned by uid 4321" in one_error_line(run.stderr)
    assert list(root.iterdir()) == []


def test_socket_path_too_long_is_a_setup_error(tray_env, tmp_path):
    root = tmp_path / ("r" * 100)
    run = launch_with_root(tray_env, root)
    assert run.returncode == 2, run.stderr
    line = one_error_line(run.stderr)
    assert "UNIX sockets allow 107" in line and "set TRAY_JOBS_ROOT to a shorter directory" in line


def test_socket_path_too_long_in_bytes_is_a_setup_error(tray_env):
    """A socket path holds bytes: a root of few characters but many bytes (é is two) is refused before the spawn,
    not by the bind after it."""
    base = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: pytest's own temp dirs can leave no room
    try:
        suffix = len(f"/job-{4 * 1024 * 1024}-abcdef01/head.sock")
        chars = 107 - suffix - len(str(base)) - 1
        assert chars >= 8, f"{base} leaves too little room below 107 characters"
        root = base / ("é" * chars)  # within 107 characters, beyond 107 bytes
        run = launch_with_root(tray_env, root)
    finally:
        shutil.rmtree(base)
    assert run.returncode == 2, run.stderr
    line = one_error_line(run.stderr)
    assert "bytes; UNIX sockets allow 107" in line and "set TRAY_JOBS_ROOT to a shorter directory" in line


def test_jobs_root_not_utf8_is_a_setup_error(tray_env):
    """ZeroMQ binds the head's socket by a UTF-8 address: a root whose name is other bytes is refused by name. It
    once failed the bind with a traceback, and the socket left open kept the teardown waiting for good."""
    base = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: under pytest's own temp dirs the length is refused
    try:
        root = base / os.fsdecode(b"jobs-\xff")
        env = tray_env.env()
        env["TRAY_JOBS_ROOT"] = str(root)
        cmd = [sys.executable, "-m", "tray", "launch", "-n", "1", "--backend", "host", "--", sys.executable, "-c",
               "pass"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=20, env=env, cwd=str(tray_env.tmp))
        assert run.returncode == 2, run.stderr
        line = one_error_line(run.stderr)
        assert "the jobs root" in line and "jobs-\\xff is not a UTF-8 path" in line and "set TRAY_JOBS_ROOT" in line
        assert not os.path.lexists(root)  # refused before it was made
        long_root = base / ("x" * 80) / os.fsdecode(b"jobs-\xff")  # too long as well: the path said as it is held
        env["TRAY_JOBS_ROOT"] = str(long_root)
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=20, env=env, cwd=str(tray_env.tmp))
        line = one_error_line(run.stderr)
        assert run.returncode == 2 and "UNIX sockets allow 107" in line and "jobs-\\xff would be" in line, line
    finally:
        shutil.rmtree(base)


def test_head_socket_bind_failure_is_named_and_cleaned(tray_env, monkeypatch):
    from tray.launch.jobdir import SetupError

    def no_room(self, endpoint):
        raise zmq.ZMQError(errno.ENOSPC)

    monkeypatch.setenv("TRAY_JOBS_ROOT", str(tray_env.jobs_root))
    monkeypatch.setattr(zmq.Socket, "bind", no_room)
    fds = set(os.listdir("/proc/self/fd"))
    spec = TraySpec(nprocs=2, cmd=(sys.executable, "-c", "import time, sys; time.sleep(600)", tray_env.marker),
                    backend="host", quiet=True)
    with pytest.raises(SetupError, match=r"cannot bind the head's socket ipc://.*head.sock: No space left on device"):
        run_tray(spec)
    assert set(os.listdir("/proc/self/fd")) == fds


def test_many_buffers_under_a_low_soft_fd_limit(tray_env, tmp_path):
    """60 host buffers (a memfd each) under `ulimit -Sn 64`: the rank raises its soft limit toward the hard one before
    it allocates, as it did only before mapping its peers (it failed with a bare OSError: Too many open files); under
    a hard limit too low, the failure names the buffer, the limit and what to do."""
    import json
    import resource

    manifest = tmp_path / "many.json"
    manifest.write_text(json.dumps({"format": 1, "name": "many", "buffers": [
        {"name": f"b{i}", "dtype": "u32", "shape": [16], "export": True} for i in range(60)]}))
    body = """
    with tray.init() as rank:
        rank.barrier()
        print("ran", rank.rank, flush=True)
    """
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1024:
        pytest.skip("this machine's hard open-file limit is below 1024")
    for soft, hard in ((64, 1024), (64, 64)):
        proc = subprocess.run(tray_env.command(2, body, "-q", "--manifest", str(manifest)), capture_output=True,
                              text=True, timeout=60, env=tray_env.env(), cwd=str(tray_env.tmp),
                              preexec_fn=lambda limits=(soft, hard): resource.setrlimit(resource.RLIMIT_NOFILE, limits))
        if hard > soft:
            assert proc.returncode == 0, proc.stderr
            assert "ran 0" in proc.stdout and "ran 1" in proc.stdout, proc.stdout
        else:
            assert proc.returncode == 1, proc.stderr
            assert re.search(r"reported DeviceError: memfd_create\(buffer 'b\d+'\): Too many open files: this rank's "
                             r"open-file limit is 64 \(at most 64\), and every host buffer holds a descriptor; raise "
                             r"it \(ulimit -n\)", proc.stderr), proc.stderr


def test_in_process_tray_leaves_no_fd(tray_env, monkeypatch):
    monkeypatch.setenv("TRAY_JOBS_ROOT", str(tray_env.jobs_root))
    prog = tray_env.script("""
    with tray.init() as rank:
        rank.barrier()
    """)
    spec = TraySpec(nprocs=2, cmd=(sys.executable, str(prog), tray_env.marker), backend="host", quiet=True)
    run_tray(spec)  # the first run imports what it needs (zmq's own fds stay)
    fds = set(os.listdir("/proc/self/fd"))
    assert run_tray(spec).exit_code == 0
    assert set(os.listdir("/proc/self/fd")) == fds


def test_an_exception_of_the_programs_own_signal_handler_in_the_teardown_leaves_nothing(tray_env, monkeypatch):
    """A program that runs trays in-process with a deadline of its own (a SIGALRM handler that raises, as
    pytest-timeout's) got its exception in the teardown's grace: the rest of the cleanup was skipped, and a rank, the
    watchdog, the job dir, fds and the subreaper flag stayed for the process's life. The exception still comes; the
    tray is torn down whole first. (The fixture checks processes and job dirs.)"""
    import ctypes
    import signal

    from tray.launch import head as head_mod

    monkeypatch.setenv("TRAY_JOBS_ROOT", str(tray_env.jobs_root))
    prog = tray_env.script("""
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # slow to stop: the teardown waits out its grace
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 1:
            sys.exit(3)
        time.sleep(600)
    """)
    quick = TraySpec(nprocs=2, cmd=(sys.executable, "-c", "pass", tray_env.marker), backend="host", quiet=True)
    run_tray(quick)  # the first run imports what it needs (zmq's own fds stay)
    fds = set(os.listdir("/proc/self/fd"))

    class Deadline(Exception):
        pass

    def on_alarm(signum, frame):
        raise Deadline

    said = head_mod._say

    def say(text: str) -> None:
        said(text)
        if text.startswith("stopping rank 0"):
            signal.setitimer(signal.ITIMER_REAL, 0.5)  # in the grace's wait

    monkeypatch.setattr(head_mod, "_say", say)
    before = signal.signal(signal.SIGALRM, on_alarm)
    try:
        t0 = time.monotonic()
        with pytest.raises(Deadline):
            run_tray(TraySpec(nprocs=2, cmd=(sys.executable, str(prog), tray_env.marker), backend="host", quiet=True,
                              grace_s=30.0))
        assert time.monotonic() - t0 < 20
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert set(os.listdir("/proc/self/fd")) == fds
    flag = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
    assert flag.value == 0
    assert run_tray(quick).exit_code == 0


def test_the_subreaper_flag_is_put_back_as_it_was_and_held_while_any_tray_runs() -> None:
    """run_tray() cleared the flag at its end: a process that was a subreaper already lost it, and of two trays at
    once the first to end took it from the other (whose ranks' escaped descendants then went to pid 1)."""
    import ctypes

    from tray.launch.head import _Subreaper

    libc = ctypes.CDLL(None)

    def flag() -> int:
        v = ctypes.c_int(-1)
        libc.prctl(37, ctypes.byref(v), 0, 0, 0)
        return v.value

    assert flag() == 0
    s = _Subreaper()
    s.take()
    s.take()  # a second tray
    s.release()
    assert flag() == 1  # the second still runs
    s.release()
    assert flag() == 0
    libc.prctl(36, 1, 0, 0, 0)  # a subreaper of its own
    try:
        s.take()
        s.release()
        assert flag() == 1
    finally:
        libc.prctl(36, 0, 0, 0, 0)


def test_run_tray_in_a_program_spares_its_own_children_and_its_own_sighup_handler(tray_env, monkeypatch):
    """run_tray() in a program with children of its own (started before the tray and while it runs, in process
    groups of their own) and a SIGHUP handler of its own: the teardown kills only what carries the tray's job in
    its environment, and a SIGHUP during the tray reaches the program's handler, not a KeyboardInterrupt."""
    import signal as sig
    import threading

    monkeypatch.setenv("TRAY_JOBS_ROOT", str(tray_env.jobs_root))
    prog = tray_env.script("""
    import subprocess
    with tray.init() as rank:
        if rank.rank == 0:   # the tray's own: killed at the end though it left the tray's process group
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]], process_group=0)
        time.sleep(1.5)
        rank.barrier(timeout_s=30)
    """)
    mine = [subprocess.Popen(["sleep", "60"], start_new_session=True)]
    got: list[int] = []
    old = sig.signal(sig.SIGHUP, lambda signum, frame: got.append(signum))
    try:
        def meanwhile() -> None:
            time.sleep(0.8)
            mine.append(subprocess.Popen(["sleep", "60"], process_group=0))
            os.kill(os.getpid(), sig.SIGHUP)

        t = threading.Thread(target=meanwhile)
        t.start()
        result = run_tray(TraySpec(nprocs=2, cmd=(sys.executable, str(prog), tray_env.marker), backend="host",
                                   quiet=True))
        t.join()
        assert result.exit_code == 0
        assert got == [sig.SIGHUP]
        assert [p.poll() for p in mine] == [None, None]   # both alive: the program's, not the tray's
        assert wait_for(lambda: tray_env.leftovers() == [], 5), tray_env.leftovers()
    finally:
        sig.signal(sig.SIGHUP, old)
        for p in mine:
            p.kill()
            p.wait()


# --- 2. leftover processes -----------------------------------------------------------------------------

def test_leftover_child_holding_stdout_does_not_hang_the_tray(tray_env):
    run = tray_env.launch(2, SPAWN_LEFTOVER + """
with tray.init() as rank:
    rank.barrier()
print("done", flush=True)
""", timeout_s=30)
    assert run.returncode == 0, run.output
    assert run.stdout.count("done") == 2
    assert run.seconds < 10


@pytest.mark.parametrize("escape", ["session", "process_group", "grandchild_group", "group_with_a_child"])
def test_a_ranks_descendant_that_left_the_trays_process_group_is_killed_at_the_end(tray_env, escape):
    """A rank's child in a session or process group of its own (setsid, `Popen(process_group=0)`, or a grandchild
    that did setpgid) outlives its rank; at the tray's end it is killed. Before, only a new session was, and the
    others ran on, reparented to pid 1. So is the child of such a child in its group (`timeout 60 CMD` puts itself
    in a group of its own): CMD ran on once the head killed `timeout`. (The fixture's check finds any left: each
    carries the test's marker.)"""
    spawn = {
        "session": "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]], "
                   "start_new_session=True)",
        "process_group": "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]], "
                         "process_group=0)",
        "grandchild_group": "subprocess.Popen([sys.executable, '-c', 'import os, subprocess, sys, time; "
                            "subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(600)\", sys.argv[1]], "
                            "process_group=0); time.sleep(600)', sys.argv[1]])",
        "group_with_a_child": "subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(600)\", "
                              "sys.argv[1]]); time.sleep(600)', sys.argv[1]], process_group=0)",
    }[escape]
    depth = 2 if escape in ("grandchild_group", "group_with_a_child") else 1
    run = tray_env.launch(2, f"""
import subprocess
import psutil
with tray.init() as rank:
    {spawn}
    t0 = time.monotonic()   # every descendant up (a loaded machine starts them slowly), so the end must find them
    while len(psutil.Process().children(recursive=True)) < {depth} and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    rank.barrier(timeout_s=30)
print("done", flush=True)
""", timeout_s=60)
    assert run.returncode == 0, run.output
    assert run.stdout.count("done") == 2
    assert wait_for(lambda: tray_env.leftovers() == [], 5), tray_env.leftovers()


def test_daemons_the_ranks_children_leave_are_reaped_while_the_tray_runs(tray_env):
    """The head adopts the orphans of its ranks' descendants (a subreaper); one that ended stayed a zombie until the
    tray's end, so a long-running tray (a server's; `tray launch` as PID 1 of a container, with no init to reap)
    gathered one per daemon. Each is reaped within a second of its end now."""
    run = tray_env.launch(2, """
import subprocess
import psutil
daemon = "import os, sys, time\\nif os.fork():\\n    sys.exit(0)\\nos.setsid()\\ntime.sleep(0.2)"
with tray.init() as rank:
    if rank.rank == 0:
        for _ in range(3):   # a parent that exits at once: its child is handed to the head, then ends
            subprocess.run([sys.executable, "-c", daemon], timeout=30)
        head = psutil.Process(os.getppid())
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            zombies = [c.pid for c in head.children() if c.status() == psutil.STATUS_ZOMBIE]
            if not zombies and time.monotonic() - t0 > 1.5:
                break
            time.sleep(0.1)
        print("zombies left", len(zombies), "after", round(time.monotonic() - t0, 1), flush=True)
    rank.barrier(timeout_s=30)
""", timeout_s=60)
    assert run.returncode == 0, run.output
    assert "[rank 0] zombies left 0 after" in run.stdout, run.output


def test_a_removed_working_directory_is_a_setup_error(tray_env, tmp_path):
    """Started in a directory since removed, the tray's watchdog could not start (its interpreter cannot make
    paths absolute) while the tray ran on unguarded; now a one-line SetupError before anything starts."""
    gone = tmp_path / "gone"
    gone.mkdir()
    cmd = tray_env.command(2, "print('ran')")
    # NOTE: the `tray` script, as a user types it: `python -m tray` cannot start there at all (-m puts the
    # working directory on sys.path, which Python cannot make absolute)
    cmd[:3] = [str(Path(sys.executable).parent / "tray")]
    proc = subprocess.run(["/bin/sh", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "sh", str(gone), *cmd],
                          capture_output=True, text=True, timeout=60, env=tray_env.env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert one_error_line(proc.stderr) == "tray: SetupError: the current directory was removed: the ranks (and the " \
        "tray's watchdog) would start in a directory that is gone; cd to one that exists"


def test_head_sigkilled_takes_ranks_and_their_children(tray_env):
    head = start_head(tray_env, 3, SPAWN_LEFTOVER + """
with tray.init() as rank:
    print("up", flush=True)
    time.sleep(600)
""")
    try:
        assert wait_for(lambda: len(tray_env.leftovers()) >= 7, 10)  # 3 ranks, 3 children, the job dir
        sigkill_leaves_nothing(tray_env, head)
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.close()


def test_head_sigkilled_leaves_no_semaphore_of_a_ranks_spawn_pool(tray_env):
    """A rank's multiprocessing spawn Pool: its resource tracker unlinks the pool's semaphores once its clients are
    gone, but the watchdog SIGKILLed it with them at once after a killed head, leaving sem.mp-* in /dev/shm (the
    head's own teardown gives SIGTERM and a second first). Now the watchdog does as the head does. (The fixture
    checks /dev/shm.)"""
    head = start_head(tray_env, 2, """
import multiprocessing
if __name__ == "__main__":
    with tray.init() as rank:
        pool = multiprocessing.get_context("spawn").Pool(1)
        assert pool.map(abs, [-1, -2]) == [1, 2]
        print("up", flush=True)
        time.sleep(600)
""")
    try:
        made = lambda: {s for s in os.listdir("/dev/shm") if s.startswith("sem.mp-")} - tray_env.shm_before  # noqa: E731
        assert wait_for(made, 10), "the pool made no semaphore"
        sigkill_leaves_nothing(tray_env, head)
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.close()


def test_head_sigkilled_takes_the_ranks_children_that_dropped_the_trays_environment(tray_env):
    """A rank's child started with an environment of its own (no TRAY_JOB) but left in the tray's process group: with
    the head killed, the watchdog's kill of that group takes it (no mark in its environment names the job)."""
    head = start_head(tray_env, 2, """
import subprocess
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]], env={"PATH": os.defpath})
with tray.init() as rank:
    print("up", flush=True)
    time.sleep(600)
""")
    try:
        assert wait_for(lambda: len(tray_env.leftovers()) >= 5, 10)  # 2 ranks, 2 children, the job dir
        sigkill_leaves_nothing(tray_env, head)
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_a_signal_to_the_watchdog_while_it_starts_changes_nothing(tray_env, sig):
    """The watchdog ignores the stop signals (the head acts on them), but only from its main(): one that reached it
    while its interpreter started (a SIGTERM to the tray's process group, in its first ~0.1-0.5 s) killed it, and the
    tray stopped with exit 3 ("exited with code -15 ... its stderr, above, says why"). Now they are blocked from its
    start until it ignores them. The signal lands in that window on any machine: a sitecustomize holds the
    watchdog's interpreter start for 1 s (the watchdog keeps the PYTHONPATH it is given)."""
    site = tray_env.tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys, time\n"
        "if 'tray.launch.watchdog' in getattr(sys, 'orig_argv', ()):\n"
        "    time.sleep(1.0)\n")
    env = tray_env.env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    head = subprocess.Popen(tray_env.command(2, """
with tray.init() as rank:
    rank.barrier()
print("done", flush=True)
"""), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tray_env.tmp))
    try:
        def watchdog() -> int | None:
            try:
                kids = psutil.Process(head.pid).children()
            except psutil.Error:
                return None
            for kid in kids:
                try:
                    if "tray.launch.watchdog" in " ".join(kid.cmdline()):
                        return kid.pid
                except psutil.Error:
                    pass
            return None

        deadline, pid = time.monotonic() + 20, None
        while pid is None and time.monotonic() < deadline and head.poll() is None:
            pid = watchdog()
        assert pid is not None, "no watchdog seen"
        time.sleep(0.3)  # in its sitecustomize's second, long before its main()
        assert "tray.launch.watchdog" in " ".join(psutil.Process(pid).cmdline())
        os.kill(pid, sig)
        out, err = head.communicate(timeout=30)
        assert head.returncode == 0, err
        assert out.count("done") == 2, out + err
    finally:
        if head.poll() is None:
            head.kill()
            head.communicate()


def test_double_sigterm_leaves_no_job_dir(tray_env):
    # ranks that ignore SIGTERM keep the head in its teardown (grace, then SIGKILL) when the second comes
    head = start_head(tray_env, 2, """
import signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with tray.init() as rank:
    print("up", flush=True)
    time.sleep(600)
""")
    try:
        head.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=20) == 130
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.close()
    assert list(tray_env.jobs_root.iterdir()) == []


@pytest.mark.parametrize("nohup", [False, True], ids=["hangup", "nohup"])
def test_sighup_stops_the_tray_as_sigterm_does_unless_the_head_was_started_ignoring_it(tray_env, nohup):
    """The terminal closed: the head died of SIGHUP (exit 129, nothing said, a rank's setsid daemon left behind).
    Now an interruption like SIGTERM; under nohup (SIGHUP ignored from the start) the tray runs on."""
    body = SPAWN_LEFTOVER + """
with tray.init() as rank:
    print("up", flush=True)
    time.sleep(3 if os.environ.get("NOHUP_TEST") else 600)
"""
    env = tray_env.env() | ({"NOHUP_TEST": "1"} if nohup else {})
    # NOTE: `preexec_fn` sets what nohup does: SIGHUP ignored in the head from its start
    head = subprocess.Popen(tray_env.command(2, body), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(tray_env.tmp),
                            preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if nohup else None)
    try:
        seen, deadline = 0, time.monotonic() + 30
        while seen < 2 and time.monotonic() < deadline:
            seen += head.stdout.readline().strip().endswith("up")
        assert seen == 2, "the ranks did not come up"
        head.send_signal(signal.SIGHUP)
        code = head.wait(timeout=20)
        err = head.stderr.read()
        if nohup:
            assert code == 0, err
        else:
            assert code == 130, err
            assert "tray: interrupted (SIGHUP: its terminal closed; nohup tray launch ... keeps a tray running past " \
                "its terminal); the tray was stopped" in err
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.close()
        head.stderr.close()
    assert wait_for(lambda: tray_env.leftovers() == [], 5), tray_env.leftovers()


def test_sigquit_stops_the_tray_as_sigterm_does(tray_env):
    """Ctrl-\\ or kill -QUIT to the head, as torchrun takes it: the head dumped its core and the ranks died at once
    of its death (no grace, a rank's handlers never run); now an interruption like SIGTERM."""
    body = """
import signal
with tray.init() as rank:
    signal.signal(signal.SIGTERM, lambda *_: (print("graceful", rank.rank, flush=True), sys.exit(0)))
    print("up", flush=True)
    time.sleep(600)
"""
    head = start_head(tray_env, 2, body, stderr=subprocess.PIPE)
    try:
        head.send_signal(signal.SIGQUIT)
        code = head.wait(timeout=20)
        out, err = head.stdout.read(), head.stderr.read()
        assert code == 130, err
        assert "tray: interrupted (SIGQUIT); the tray was stopped" in err, err
        assert out.count("graceful") == 2, out + err
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.close()
        head.stderr.close()
    assert wait_for(lambda: tray_env.leftovers() == [], 5), tray_env.leftovers()


def test_sigterm_before_the_ranks_are_up_stops_the_tray(tray_env):
    # the head has its handlers once its job dir exists; the ranks are still starting (spawn, import)
    head = subprocess.Popen(tray_env.command(2, """
time.sleep(600)
with tray.init() as rank:
    pass
"""), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=tray_env.env(), cwd=str(tray_env.tmp))
    try:
        assert wait_for(lambda: any(tray_env.jobs_root.glob("job-*")), 10), "the head made no job dir"
        # a storm of SIGTERMs, every 5 ms until the head is gone: through the teardown, the CLI's own
        # handling and the interpreter's shutdown (which would put SIGTERM's default back: killed, -15)
        deadline = time.monotonic() + 20
        while head.poll() is None and time.monotonic() < deadline:
            head.send_signal(signal.SIGTERM)
            time.sleep(0.005)
        assert head.wait(timeout=5) == 130
        assert "tray: interrupted (SIGTERM); the tray was stopped" in head.stderr.read()
    finally:
        if head.poll() is None:
            head.kill()
        head.stderr.close()
    assert list(tray_env.jobs_root.iterdir()) == []


class _LockThatSignals:
    """A Popen's waitpid lock that sends SIGINT to this process the first time the main thread takes
    it: the signal arrives while the head is inside Popen.poll, holding the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fired = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got and not self.fired and threading.current_thread() is threading.main_thread():
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)  # handled before this call returns
        return got

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_signal_inside_popen_poll_still_tears_down(tray_env, monkeypatch):
    # a KeyboardInterrupt raised right there would leave the lock taken: the rank could never be waited for
    from tray.launch import head as head_module

    monkeypatch.setenv("TRAY_JOBS_ROOT", str(tray_env.jobs_root))
    locks = []

    def spawn_rank(*args, **kwargs):
        proc = real_spawn_rank(*args, **kwargs)
        locks.append(_LockThatSignals())
        proc.popen._waitpid_lock = locks[-1]
        return proc

    real_spawn_rank = head_module.spawn_rank
    monkeypatch.setattr(head_module, "spawn_rank", spawn_rank)
    prog = tray_env.script("""
    with tray.init() as rank:
        time.sleep(600)
    """)
    spec = TraySpec(nprocs=2, cmd=(sys.executable, str(prog), tray_env.marker), backend="host", quiet=True)
    with pytest.raises(KeyboardInterrupt, match="signal 2"):
        run_tray(spec)
    assert locks and all(lock.fired for lock in locks)
    assert list(tray_env.jobs_root.iterdir()) == []


# --- 3. NCCL's shared memory, 8. the stale-dir lock ---------------------------------------------------

MAP_FAKE_NCCL_SEGMENT = """
import mmap
name = os.environ["FAKE_SEGMENT"]
fd = os.open("/dev/shm/" + name, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
segment = mmap.mmap(fd, 4096)
"""


def fake_segment_name() -> str:
    return "nccl-" + secrets.token_hex(3)


def test_segments_of_a_killed_tray_are_removed_by_the_next_launch(tray_env, monkeypatch):
    with planted_segment(fake_segment_name()) as name:
        _killed_trays_segment_is_swept(tray_env, monkeypatch, name)


def _killed_trays_segment_is_swept(tray_env, monkeypatch, name: str) -> None:
    monkeypatch.setenv("FAKE_SEGMENT", name)
    head = start_head(tray_env, 2, MAP_FAKE_NCCL_SEGMENT + """
with tray.init() as rank:
    print("up", flush=True)
    time.sleep(600)
""")
    try:
        assert wait_for(lambda: any(tray_env.jobs_root.glob("job-*/shm.list")), 10)  # the head recorded it
        # the head and its watchdog die together: nobody cleans up now
        watchdog = next(c for c in psutil.Process(head.pid).children() if "tray.launch.watchdog" in c.cmdline())
        job = next(tray_env.jobs_root.glob("job-*")).name
        # where the job is stays off the command line (anyone's to read), and the job's secret off the watchdog
        assert job not in " ".join(watchdog.cmdline()) and str(tray_env.jobs_root) not in " ".join(watchdog.cmdline())
        assert watchdog.environ().get("TRAY_WATCHDOG_JOB") == job and "TRAY_JOB_TOKEN" not in watchdog.environ()
        watchdog.kill()
        head.kill()
        head.wait(timeout=10)
        assert wait_for(lambda: not [x for x in tray_env.leftovers() if x.startswith("process")], 5)
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.close()
    try:
        assert os.path.exists(f"/dev/shm/{name}")
        assert len(list(tray_env.jobs_root.iterdir())) == 1
        run = tray_env.launch(1, "pass")
        assert run.returncode == 0, run.output
        assert not os.path.exists(f"/dev/shm/{name}")
        assert list(tray_env.jobs_root.iterdir()) == []
    finally:
        Path("/dev/shm", name).unlink(missing_ok=True)  # a failed run must not leave the segment behind


def test_sweep_spares_a_live_job_dir_whose_pid_it_cannot_see(tray_env):
    with planted_segment(fake_segment_name()) as name:
        _sweep_spares_a_live_job_dir(tray_env, name)


def _sweep_spares_a_live_job_dir(tray_env, name: str) -> None:
    # a head in another pid namespace: its pid means nothing here (this one does not exist), its lock does
    live = tray_env.jobs_root / "job-999999999-0a1b2c3d"
    live.mkdir(mode=0o700)
    segment = Path("/dev/shm") / name
    segment.write_bytes(b"\0" * 4096)
    (live / "shm.list").write_text(name + "\n")
    lock = os.open(live / "head.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = tray_env.launch(1, "pass")
        assert run.returncode == 0, run.output
        assert live.is_dir() and segment.exists()
        fcntl.flock(lock, fcntl.LOCK_UN)
        run = tray_env.launch(1, "pass")
        assert run.returncode == 0, run.output
        assert not live.exists() and not segment.exists()
    finally:
        os.close(lock)
        segment.unlink(missing_ok=True)


# --- 4. big exchange, 5.-6. deadlines -----------------------------------------------------------------

def test_exchange_too_big_for_the_decision_fails_at_the_rank(tray_env):
    run = tray_env.launch(4, """
with tray.init() as rank:
    rank.exchange("big", b"x" * 600_000)
""")
    assert run.returncode == 1, run.output
    line = next(ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED"))
    assert "reported UsageError: exchange('big'): rank" in line
    assert "each of the 4 ranks may send at most 262128 B" in line
    assert run.seconds < 15


def test_rank_exiting_0_before_init_is_judged_at_once(tray_env):
    run = tray_env.launch(3, """
if os.environ["TRAY_RANK"] == "1":
    sys.exit(0)
with tray.init() as rank:
    rank.barrier(timeout_s=60)
""")
    assert run.returncode == 1, run.output
    assert "FAILED: rank 1" in run.stderr and "exited with code 0 before it joined the tray" in run.stderr
    assert run.seconds < 10


def test_a_program_that_never_calls_init_runs_on_as_under_torchrun(tray_env):
    """No rank called tray.init() within --timeout-s: said once, and the program runs on (a torch program loading
    its weights, say); its exits are still watched: one failing ends the tray naming it."""
    run = tray_env.launch(3, "time.sleep(3)\nprint('done', os.environ['RANK'])\n", "--timeout-s", "1")
    assert run.returncode == 0, run.output
    assert run.stdout.count("done") == 3 and run.stderr.count("no rank has called tray.init() 1 s after") == 1
    run = tray_env.launch(3, "time.sleep(2)\nsys.exit(int(os.environ['RANK']) == 1)\n", "--timeout-s", "1")
    assert run.returncode == 1 and "FAILED: rank 1" in run.stderr and "exited with code 1" in run.stderr, run.output


def test_a_rank_that_dies_silently_before_init_is_said_to_have_printed_nothing(tray_env):
    """A rank that ends before tray.init() without a line of output: the head does not point at its last lines, which
    do not exist; one that printed is pointed at them."""
    run = tray_env.launch(2, """
if os.environ["RANK"] == "1":
    os._exit(7)
with tray.init() as rank:
    rank.barrier(timeout_s=60)
""")
    assert run.returncode == 1, run.output
    assert "exited with code 7" in run.stderr and "it failed before its first message: it printed nothing)" in \
        run.stderr, run.stderr
    run = tray_env.launch(2, """
if os.environ["RANK"] == "1":
    print("loading failed", flush=True)
    os._exit(7)
with tray.init() as rank:
    rank.barrier(timeout_s=60)
""")
    assert run.returncode == 1, run.output
    assert "it failed before its first message: the rank's last lines say)" in run.stderr, run.stderr
    assert "loading failed" in run.stderr, run.stderr


def test_once_a_rank_joined_the_others_must_within_the_timeout(tray_env):
    """The handshake's clock starts at the first rank's contact: ranks that all start late (loading weights before
    tray.init()) still form a tray; one that never joins is named --timeout-s after the first did."""
    run = tray_env.launch(2, "time.sleep(2.5)\nwith tray.init() as rank:\n    rank.barrier()\n", "--timeout-s", "2")
    assert run.returncode == 0, run.output
    run = tray_env.launch(3, """
time.sleep(600 if os.environ["RANK"] == "2" else 0)
with tray.init() as rank:
    rank.barrier(timeout_s=60)
""", "--timeout-s", "2")
    assert run.returncode == 3, run.output
    assert ("rank 2 did not offer within 2 s of the first rank's contact (--timeout-s; process alive, last phase: "
            "spawn: not heard from in its ") in run.stderr, run.stderr
    assert "(tray.init() not called yet, or still in its first steps)" in run.stderr, run.stderr
    assert run.seconds < 10


# --- restarts, minor items ------------------------------------------------------------------------

def test_max_restarts_runs_again_after_a_failure(tray_env):
    body = """
attempt = int(os.environ["TRAY_RESTART_COUNT"])
assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
assert os.environ["TORCHELASTIC_MAX_RESTARTS"] == "2"
with tray.init() as rank:
    if attempt == 0 and rank.rank == 1:
        raise RuntimeError("first attempt fails")
    rank.barrier(timeout_s=30)
    print("attempt", attempt, "ok", "run", os.environ["TORCHELASTIC_RUN_ID"], flush=True)
"""
    run = tray_env.launch(2, body, "--max-restarts", "2")
    assert run.returncode == 0, run.output
    # a restart is the same run, as under torchrun (checkpoints keyed on the run id resume)
    first = [line for line in run.stdout.splitlines() if " run " in line]
    assert len({line.split(" run ")[1] for line in first}) == 1, run.stdout
    assert "attempt 1 of 3 failed (exit 1): rank 1 reported RuntimeError: first attempt fails" in run.stderr
    assert run.stdout.count("attempt 1 ok") == 2 and "attempt 2" not in run.stdout
    # both attempts printed a timeline; only the first has the head's own start (the second's would hold attempt 1)
    assert run.stderr.count("tray up in") == 2 and run.stderr.count("after `tray launch` started") == 1, run.stderr
    assert run.stderr.count("the head's own start") == 1, run.stderr
    run = tray_env.launch(2, "sys.exit(3)\n", "--max-restarts", "1")
    assert run.returncode == 1, run.output
    assert "attempt 1 of 2 failed (exit 1)" in run.stderr
    assert "attempt 2 of 2 failed too (exit 1); no restart left (--max-restarts 1)" in run.stderr, run.stderr


def test_a_second_tray_init_in_one_process_is_refused_at_once(tray_env):
    run = tray_env.launch(2, """
with tray.init() as rank:
    rank.barrier()
with tray.init() as rank:
    pass
""")
    assert run.returncode == 1, run.output
    assert "UsageError: tray.init() was already called in this process" in run.stderr, run.stderr
    assert "exited with code 1 (last phase: bye)" in run.stderr  # its first tray closed: it raised in the program
    assert run.seconds < 15


def test_torchruns_one_host_flags_and_variables(tray_env):
    """--rdzv-id is the run id and --master-port the MASTER_PORT on one host, --standalone is accepted, and
    OMP_NUM_THREADS is 1 in every rank of a tray of several unless it is set (as torchrun)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    body = """
print("env", os.environ["TORCHELASTIC_RUN_ID"], os.environ["MASTER_PORT"], os.environ.get("OMP_NUM_THREADS"))
"""
    run = tray_env.launch(2, body, "--standalone", "--rdzv-id", "myjob", "--master-port", str(port))
    assert run.returncode == 0, run.output
    assert run.stdout.count(f"env myjob {port} 1") == 2, run.stdout
    env = tray_env.env()
    env["OMP_NUM_THREADS"] = "3"
    run = tray_env.run(tray_env.command(2, body), env=env)
    assert run.returncode == 0 and run.stdout.count(" 3\n") == 2, run.output


def test_a_master_port_another_tray_holds_is_refused_naming_it(tray_env):
    """Two trays given one --master-port: both started (a port asked for is bound with SO_REUSEADDR, which the
    other holder had set too), and the first one's torch store then failed to bind. The second is refused now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = start_head(tray_env, 1, """
with tray.init() as rank:
    print("up", flush=True)
    time.sleep(600)
""", "--master-port", str(port))
    try:
        run = tray_env.launch(1, "print('second ran')", "--master-port", str(port))
        assert run.returncode == 2, run.output
        assert f"tray: SetupError: --master-port {port}: cannot reserve it on 127.0.0.1 (another tray (head pid " \
            f"{first.pid}) holds it)" in run.stderr, run.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=20)
        first.stdout.close()
    run = tray_env.launch(1, "print('third ran')", "--master-port", str(port))   # free again, no file left
    assert run.returncode == 0 and "third ran" in run.stdout, run.output


def test_duplicate_ready_sends_go_once(tray_env):
    run = tray_env.launch(2, """
from tray.handshake import wire
with tray.init() as rank:
    if rank.rank == 0:
        rank._wiring.client.send(wire.Ready(token=rank.env.token, rank=0, timings={}))
    rank.barrier(timeout_s=30)
    rank.exchange("after", 1)
""")
    assert run.returncode == 0, run.output
    assert "rejected a message from rank-0: a second ready (go is sent once)" in run.stderr
    assert run.stderr.count("tray up in") == 1


def test_watchdog_group_member_scan_sees_a_group():
    from tray.launch.watchdog import group_members

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], process_group=0)
    try:
        assert wait_for(lambda: group_members(child.pid) == [child.pid], 5)
    finally:
        child.kill()
        child.wait()
    assert group_members(child.pid) == []


def test_a_gate_killed_leaves_no_directory_the_next_tray_does_not_sweep(tray_env):
    """The gate's ranks write their results into a scratch dir under the jobs root, locked as a job dir is: with
    the gate SIGKILLed, its tray's watchdog removes the ranks and the job dir, and the next tray's sweep the
    scratch dir (a temporary directory elsewhere would stay for good)."""
    gate = subprocess.Popen([sys.executable, "-m", "tray", "gate", "peer-barrier", "-n", "2", "--backend", "host",
                             "--iters", "100000000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=tray_env.env(), cwd=str(tray_env.tmp))
    try:
        assert wait_for(lambda: any(tray_env.jobs_root.glob("job-*")), 20), "the gate started no tray"
        scratch = list(tray_env.jobs_root.glob("scratch-*"))
        assert len(scratch) == 1 and oct(scratch[0].stat().st_mode & 0o777) == "0o700", scratch
        gate.kill()
        gate.wait(timeout=10)
        assert wait_for(lambda: not any(tray_env.jobs_root.glob("job-*")), 10), "the watchdog left the job dir"
        assert scratch[0].exists()  # nothing removes it until a tray starts ...
        run = tray_env.launch(1, "with tray.init() as rank:\n    pass\n")
        assert run.returncode == 0, run.output
        assert list(tray_env.jobs_root.iterdir()) == []  # ... and that tray's sweep did
    finally:
        if gate.poll() is None:
            gate.kill()
            gate.wait(timeout=10)


def test_a_signal_to_the_whole_step_is_an_interruption_not_a_rank_failure(tray_env):
    """scancel, a time limit or Ctrl-C signal the head and its ranks at once: a rank dead of that SIGTERM is not
    blamed; the head says it was interrupted (by what, under Slurm) and exits 130."""
    env = tray_env.env()
    env["SLURM_JOB_ID"] = "77"
    head = subprocess.Popen(tray_env.command(2, """
with tray.init() as rank:
    open(f"up-{rank.rank}", "w").close()
    time.sleep(60)
"""), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tray_env.tmp))
    try:
        assert wait_for(lambda: len(list(tray_env.tmp.glob("up-*"))) == 2, 30)
        ranks = [c.pid for c in psutil.Process(head.pid).children() if "up-" not in " ".join(c.cmdline())
                 and tray_env.marker in " ".join(c.cmdline())]
        assert len(ranks) == 2, ranks
        for pid in ranks:  # the ranks first, as a step-wide signal may reach them before the head
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.05)  # Slurm's signals are not simultaneous either: the head sees the ranks die first
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=20) == 130
        err = head.stderr.read()
        assert "FAILED" not in err, err
        assert ("tray: interrupted (SIGTERM: under Slurm, scancel, the job's time limit, or its preemption or "
                "requeue); the tray was stopped") in err
    finally:
        if head.poll() is None:
            head.kill()
        head.stderr.close()


def signal_the_step(tray_env, head: subprocess.Popen, sig: int) -> str:
    """`sig` to the head's two ranks, then to the head a moment later (as a signal to the whole step arrives); the
    head's exit must be 130; returns its stderr."""
    ranks = [c.pid for c in psutil.Process(head.pid).children() if tray_env.marker in " ".join(c.cmdline())]
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, sig)
    time.sleep(0.05)  # the head hears of it a moment after its ranks
    head.send_signal(sig)
    assert head.wait(timeout=20) == 130, head.stderr.read()
    return head.stderr.read()


def test_a_sighup_to_the_whole_step_is_an_interruption_not_a_rank_failure(tray_env):
    """SIGHUP stops a tray as SIGTERM does (envvars.stop_signals): sent to every process of the step, the ranks died
    of it a moment before the head noted its own, and the head blamed the first rank it saw dead (exit 1) instead of
    saying it was interrupted (exit 130), as it does for SIGTERM, SIGINT and SIGQUIT."""
    head = subprocess.Popen(tray_env.command(2, """
with tray.init() as rank:
    open(f"up-{rank.rank}", "w").close()
    time.sleep(60)
"""), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=tray_env.env(), cwd=str(tray_env.tmp),
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # not under nohup
    try:
        assert wait_for(lambda: len(list(tray_env.tmp.glob("up-*"))) == 2, 30)
        err = signal_the_step(tray_env, head, signal.SIGHUP)
        assert "FAILED" not in err, err
        assert "tray: interrupted (SIGHUP" in err, err
    finally:
        if head.poll() is None:
            head.kill()
        head.stderr.close()


def test_a_sigint_to_the_whole_step_while_the_ranks_start_is_an_interruption_not_a_rank_failure(tray_env):
    """A SIGINT to every process of the step (scancel --signal=INT, kill -INT to the group) reaches the ranks a
    moment before the head: rank 0 is inside tray.init() (waiting for rank 1's offer), rank 1 not there yet. Rank 0's
    KeyboardInterrupt was reported to the head as its error, which then took it for the root cause (exit 1) instead
    of the interruption it is (exit 130), as a KeyboardInterrupt leaving the `with` block is."""
    head = subprocess.Popen(tray_env.command(2, """
if os.environ["TRAY_RANK"] == "1":
    open("up-1", "w").close()
    time.sleep(60)
open("up-0", "w").close()
with tray.init() as rank:
    rank.barrier()
"""), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=tray_env.env(), cwd=str(tray_env.tmp))
    try:
        assert wait_for(lambda: len(list(tray_env.tmp.glob("up-*"))) == 2, 30)
        time.sleep(1.0)  # rank 0 well inside tray.init(), waiting for the table
        err = signal_the_step(tray_env, head, signal.SIGINT)
        assert "FAILED" not in err and "reported KeyboardInterrupt" not in err, err
        assert "tray: interrupted" in err, err
    finally:
        if head.poll() is None:
            head.kill()
        head.stderr.close()


def test_sigusr1_to_the_whole_step_is_the_ranks_to_handle(tray_env):
    """Slurm's --signal=USR1@T warning and scancel --signal=USR1 reach every process of the step: the head and its
    watchdog died of it (no word from tray, the ranks killed with them), so a rank's handler (a checkpoint) was cut
    short. They live through it; a rank that handles it goes on, and the tray ends as the program does."""
    head = subprocess.Popen(tray_env.command(2, """
import signal
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
with tray.init() as rank:
    open(f"up-{rank.rank}", "w").close()
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    print("checkpointed on", got, flush=True)
    rank.barrier()
"""), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=tray_env.env(), cwd=str(tray_env.tmp))
    try:
        assert wait_for(lambda: len(list(tray_env.tmp.glob("up-*"))) == 2, 30)
        step = [head.pid] + [c.pid for c in psutil.Process(head.pid).children(recursive=True)]
        assert len(step) >= 4, step  # the head, its watchdog and the two ranks
        for pid in step:
            os.kill(pid, signal.SIGUSR1)
        out, err = head.communicate(timeout=30)
        assert head.returncode == 0, out + err
        assert out.count(f"checkpointed on [{int(signal.SIGUSR1)}]") == 2, out + err
    finally:
        if head.poll() is None:
            head.kill()
            head.communicate()


def test_a_job_dir_removed_while_the_ranks_start_is_said(tray_env):
    """Rank 1 sleeps before tray.init(); the job dir is removed meanwhile: its fd socket cannot be made, its report
    cannot be written, and the head says the job dir is gone instead of only "tray.init() not called"."""
    run = tray_env.launch(2, """
    import shutil
    if os.environ["TRAY_RANK"] == "1":
        for entry in os.listdir(os.environ["TRAY_JOBS_ROOT"]):
            shutil.rmtree(os.path.join(os.environ["TRAY_JOBS_ROOT"], entry), ignore_errors=True)
    with tray.init() as rank:
        rank.barrier()
    """, "--timeout-s", "10")
    assert run.returncode != 0, run.output
    assert "was removed while the tray ran" in run.stderr, run.stderr
    # its report reached nobody: the rank prints its traceback itself, not "reported to the head"
    assert re.search(r"\[rank \d\] tray\.errors\.SetupError: rank \d cannot make its fd socket", run.stderr), run.stderr
    assert "(reported to the head" not in run.stderr, run.stderr


def test_a_folder_named_tray_in_the_working_directory_does_not_shadow_the_gates_ranks(tray_env):
    """`tray gate` run from the parent of a checkout (a tray/ folder there): its ranks ran `python -m ...` with the
    working directory first on sys.path, imported that folder as a namespace package, and failed ("module 'tray'
    has no attribute 'init'"). The ranks run `python -P` with this tray's package on PYTHONPATH now."""
    script = os.path.join(os.path.dirname(sys.executable), "tray")
    if not os.path.exists(script):
        pytest.skip("no `tray` command beside this Python")
    (tray_env.tmp / "tray").mkdir()
    env = tray_env.env()
    env.pop("PYTHONPATH", None)  # as a user runs it: the installed tray
    run = tray_env.run([script, "gate", "peer-barrier", "--backend", "host", "-n", "2", "--iters", "20"],
                       env=env)
    assert run.returncode == 0, run.output
    assert "PASSED" in run.output


def test_an_environment_at_the_kernels_limit_is_named(tray_env):
    """The head's own environment fits in what exec takes, a rank's (the same and tray's variables) does not: the
    failure names the limit and what to shorten, not the command's path (it said "a path, or a program on PATH")."""
    import resource

    stack, _ = resource.getrlimit(resource.RLIMIT_STACK)
    limit = 6 * 1024 * 1024 if stack == resource.RLIM_INFINITY else min(6 * 1024 * 1024, stack // 4)
    cmd = [sys.executable, "-m", "tray", "launch", "-n", "1", "-q", "--backend", "host", "--", sys.executable, "-c",
           "pass", tray_env.marker]
    env = tray_env.env()

    def size(env: dict[str, str]) -> int:  # what the kernel counts: every string with its NUL, and a pointer each
        strings = [sys.executable, *cmd, *(f"{k}={v}" for k, v in env.items())]
        return sum(len(os.fsencode(x)) + 1 for x in strings) + 8 * (len(strings) - 1)

    i = 0
    while (room := limit - size(env) - 200) > 0:  # 200 B to spare: less than a rank's own variables
        env[f"TRAY_TEST_FILL{i}"] = "z" * min(100_000, max(1, room - len(f"TRAY_TEST_FILL{i}=") - 10))
        i += 1
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=str(tray_env.tmp))
    assert run.returncode == 2, run.stderr
    line = one_error_line(run.stderr)
    assert "cannot start rank 0" in line and "Argument list too long" in line, line
    assert "over the kernel's limit for a new program (ARG_MAX)" in line and "shorten the environment" in line, line


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to give a directory to another user")
def test_a_jobs_root_or_log_dir_refused_is_not_made_first(tray_env, tmp_path):
    """A jobs root under another user's directory, a --log-dir there, or a jobs root whose socket paths would be too
    long were refused (SetupError) after they were made: each left a directory behind, in the other user's."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    os.chmod(theirs, 0o755)
    env = tray_env.env()
    run = tray_env.run(tray_env.command(2, "print('ran')"), env={**env, "TRAY_JOBS_ROOT": str(theirs / "jobs")})
    assert run.returncode == 2 and "owned by uid 65534" in run.stderr, run.output
    run = tray_env.run(tray_env.command(2, "print('ran')", "--log-dir", str(theirs / "a" / "logs")))
    assert run.returncode == 2 and "--log-dir" in run.stderr and "owned by uid 65534" in run.stderr, run.output
    assert list(theirs.iterdir()) == [], list(theirs.iterdir())
    deep = tmp_path / ("d" * 100) / "jobs"
    run = tray_env.run(tray_env.command(2, "print('ran')"), env={**env, "TRAY_JOBS_ROOT": str(deep)})
    assert run.returncode == 2 and "socket paths under the jobs root" in run.stderr, run.output
    assert not deep.parent.exists()
