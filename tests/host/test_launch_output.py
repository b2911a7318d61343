"""What `tray launch` prints and keeps: quiet mode, torchrun's --redirects (for every rank or per rank) and
--local-ranks-filter, stamped log files that hold a failed rank's report, one traceback per failure, a slow
rank named slow."""

from __future__ import annotations

import re
import time


def test_quiet_redirects_filter_and_logs(tray_env, tmp_path):
    logs = tmp_path / "logs"
    body = """
    with tray.init() as rank:
        print("out", rank.rank, "NCCL_RUNTIME_CONNECT" in os.environ, os.environ["TRAY_BARRIER_TIMEOUT_S"])
        print("err", rank.rank, file=sys.stderr)
        rank.barrier()
        if rank.rank == 1:
            raise ValueError("boom at rank 1")
        rank.barrier()
    """
    run = tray_env.launch(3, body, "-q", "--log-dir", str(logs), "--redirects", "2", "--local-ranks-filter", "0,1",
                          "--barrier-timeout-s", "9")
    assert run.returncode == 1, run.output
    assert "tray up in" not in run.stderr  # -q: no timeline
    assert "[rank 0] out 0 False 9.0" in run.stdout  # the host backend sets no NCCL variable
    assert "[rank 2]" not in run.output  # filtered from the terminal ...
    assert "err 0" not in run.output  # ... stderr redirected to the files only
    stamped = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} ")
    log2 = (logs / "rank-2.log").read_text()  # ... but every rank's file has its stderr
    assert "err 2" in log2 and "out 2" not in log2
    log1 = (logs / "rank-1.log").read_text().splitlines()
    assert log1 and all(stamped.match(line) for line in log1), log1
    assert any("ValueError: boom at rank 1" in line for line in log1)  # the report, though the rank was stopped
    assert any('raise ValueError("boom at rank 1")' in line for line in log1)
    assert run.output.count("Traceback (most recent call last)") == 1, run.output  # printed once, by the head
    assert "FAILED: rank 1 reported ValueError: boom at rank 1" in run.stderr
    # the root cause first: before the teardown says which ranks it stops
    assert run.stderr.index("tray: FAILED:") < run.stderr.index("tray: stopping rank"), run.stderr
    assert run.stderr.count("tray: FAILED:") == 1


def test_redirects_per_local_rank(tray_env, tmp_path):
    """--redirects 0:3: rank 0's lines go to its file only; rank 1, not listed, still reaches the terminal."""
    logs = tmp_path / "logs"
    body = """
    with tray.init() as rank:
        print("out", rank.rank)
        print("err", rank.rank, file=sys.stderr)
    """
    run = tray_env.launch(2, body, "-q", "--log-dir", str(logs), "--redirects", "0:3")
    assert run.returncode == 0, run.output
    assert "[rank 0]" not in run.output, run.output
    assert "[rank 1] out 1" in run.stdout and "[rank 1] err 1" in run.stderr, run.output
    log0 = (logs / "rank-0.log").read_text()
    assert "out 0" in log0 and "err 0" in log0, log0


# rank 1 keeps the others waiting at a barrier, alive and heartbeating, just late
LATE_RANK = """
def somewhere_else():
    time.sleep(2.0)

with tray.init() as rank:
    if rank.rank == 1:
        somewhere_else()
    rank.barrier()
"""


def test_a_slow_rank_is_named_slow_not_dead(tray_env):
    """...and its Python stack shows where it is: the head has it written to the rank's stderr (a signal the rank
    registered with faulthandler) before it is stopped."""
    run = tray_env.launch(2, LATE_RANK, "--barrier-timeout-s", "0.5")
    assert run.returncode == 1, run.output
    # the wait as measured: 0.50 s, or a little more on loaded cores (0.5 s is the timeout)
    assert re.search(r"waited 0\.5\d s for rank 1", run.stderr), run.stderr
    assert re.search(r"rank 1 is alive, last heartbeat [0-9.]+ s ago, phase running: running but not where the "
                     r"others wait for it, slow or stuck elsewhere", run.stderr), run.stderr
    stack = [line for line in run.stderr.splitlines() if line.startswith("[rank 1]")]
    assert any("in somewhere_else" in line for line in stack), run.stderr
    assert not any(line.startswith("[rank 0]") and "somewhere_else" in line for line in run.stderr.splitlines())
    assert run.stderr.index("in somewhere_else") < run.stderr.index("tray: FAILED:")


def test_a_reader_that_goes_away_costs_no_traceback(tray_env, tmp_path):
    """`tray launch ... | head -2`: once stdout has no reader, the ranks' lines to it are dropped (said once on
    stderr), the tray runs to its end and exits 0; --log-dir still keeps every line."""
    import subprocess

    logs = tmp_path / "logs"
    body = """
    with tray.init() as rank:
        for i in range(400):
            print("line", i, flush=True)
            time.sleep(0.002)
        rank.barrier()
    """
    proc = subprocess.Popen(tray_env.command(2, body, "-q", "--log-dir", str(logs), "--tee", "3"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=tray_env.env(), cwd=str(tray_env.tmp))
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader leaves after one line
    try:
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first.startswith(b"[rank "), first
    assert code == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err.count("tray: stdout was closed by its reader") == 1, err
    for r in range(2):
        assert "line 399" in (logs / f"rank-{r}.log").read_text()


def test_an_unwritable_stdout_or_stderr_stops_nothing(tray_env):
    """`tray launch ... >/dev/full` (a full disk, a dead terminal): the ranks' lines to that stream are dropped,
    said once on the other, and the tray runs to its end. The output thread once died on the first ENOSPC and
    the ranks then blocked on their full pipes for good; a full stderr failed the head at its timeline (exit 1,
    ranks stopped)."""
    import subprocess

    body = """
    with tray.init() as rank:
        for i in range(3000):
            print("line", i, "y" * 60, flush=True)
        rank.barrier()
        print("done", rank.rank, file=sys.stderr, flush=True)
        print("done", rank.rank, flush=True)
    """
    for full, seen in (("stdout", "stderr"), ("stderr", "stdout")):
        with open("/dev/full", "w") as sink:
            streams = {full: sink, seen: subprocess.PIPE}
            proc = subprocess.run(tray_env.command(2, body), timeout=60, env=tray_env.env(), cwd=str(tray_env.tmp),
                                  **streams)
        out = (proc.stderr if seen == "stderr" else proc.stdout).decode()
        assert proc.returncode == 0, out
        assert "Traceback" not in out, out
        assert out.count(f"tray: {full} cannot be written (No space left on device); the ranks' lines to it are "
                         "dropped") == 1, out
        assert "[rank 0] done 0" in out and "[rank 1] done 1" in out, out


def test_characters_the_heads_streams_cannot_encode_are_escaped_not_fatal(tray_env, tmp_path):
    """A head whose locale encodes its output and log files as ASCII (LC_ALL=C without UTF-8 mode), and a rank that
    writes UTF-8 bytes: the output thread died on the first line it could not encode (a traceback), and the ranks'
    lines were lost; the rank then failed writing to its closed pipe, and the head named that BrokenPipeError as
    the root cause (exit 1). The line is written with what the encoding lacks escaped (\\xe9), to the terminal and
    to the rank's log, and the tray runs to its end."""
    import subprocess

    body = """
    with tray.init() as rank:
        for i in range(3000):
            sys.stdout.buffer.write(b"caf\\xc3\\xa9 %d %s\\n" % (i, b"y" * 60))
        sys.stdout.flush()
        rank.barrier()
        print("done", rank.rank, flush=True)
    """
    env = tray_env.env() | {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    logs = tmp_path / "logs"
    try:
        proc = subprocess.run(tray_env.command(2, body, "--log-dir", str(logs)), capture_output=True, timeout=60,
                              env=env, cwd=str(tray_env.tmp))
    except subprocess.TimeoutExpired:
        raise AssertionError("the tray hung") from None
    err, out = proc.stderr.decode(errors="replace"), proc.stdout.decode(errors="replace")
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "[rank 0] caf\\xe9 2999 " in out and "[rank 0] done 0" in out and "[rank 1] done 1" in out, out[-2000:]
    log = (logs / "rank-1.log").read_text(encoding="ascii")
    assert " caf\\xe9 2999 " in log and log.rstrip().endswith(" done 1"), log[-500:]


def test_a_log_file_that_cannot_be_written_is_said_once(tmp_path, capfd):
    """--log-dir on a full disk: the rank's lines are no longer kept there, said once; the pump reads on, so the
    rank is never left blocked on its full pipe, and the terminal still gets its lines."""
    import collections
    import os
    import types

    from tray.launch.output import Routing
    from tray.launch.spawn import OutputPump

    r, w = os.pipe()
    proc = types.SimpleNamespace(rank=0, tail=collections.deque(maxlen=20),
                                 popen=types.SimpleNamespace(stdout=os.fdopen(r, "rb", buffering=0), stderr=None))
    pump = OutputPump([proc], Routing(log_dir=str(tmp_path), tee=3))
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, pump._logs[0].fileno())  # its disk is full from now on
    os.close(full)
    line = b"z" * 99 + b"\n"
    os.set_blocking(w, False)
    data, deadline = line * 1500 + b"last\n", time.monotonic() + 10.0  # three pipes' worth: read on, or it stays
    while data and time.monotonic() < deadline:
        try:
            data = data[os.write(w, data):]
        except BlockingIOError:
            time.sleep(0.01)
    os.close(w)
    pump.stop(5.0)
    assert not data, f"{len(data)} B never read"
    assert not pump._thread.is_alive()
    out, err = capfd.readouterr()
    assert err.count(f"tray: {tmp_path / 'rank-0.log'}: No space left on device; rank 0's lines are no longer kept "
                     "in it") == 1, err
    assert "Traceback" not in err, err
    assert "[rank 0] last" in out


def test_a_line_without_newlines_comes_in_bounded_pieces(tray_env, tmp_path):
    """A rank writing megabytes without a newline: the head prints them as lines of at most LINE_MAX_NBYTES
    (cut between UTF-8 characters), every byte kept and in order; it once re-split the whole unfinished line on
    every read (quadratic: 80 MB took a minute) and held all of it."""
    from tray.launch.spawn import OutputPump

    logs = tmp_path / "logs"
    body = """
    with tray.init() as rank:
        if rank.rank == 0:
            for i in range(40):
                sys.stdout.write(("y" * 9999 + "é") * 10)   # 100 KB, no newline; é is two bytes
            sys.stdout.write("\\nend\\n")
    """
    run = tray_env.launch(2, body, "-q", "--log-dir", str(logs), "--redirects", "3")
    assert run.returncode == 0, run.output
    lines = [line.split(" ", 1)[1] for line in (logs / "rank-0.log").read_text(encoding="utf-8").splitlines()]
    assert lines[-1] == "end", lines[-1:]
    assert max(len(line.encode()) for line in lines) <= OutputPump.LINE_MAX_NBYTES
    assert len(lines) > 40 * 100_010 // OutputPump.LINE_MAX_NBYTES
    assert "".join(lines[:-1]) == ("y" * 9999 + "é") * 400  # nothing lost, nothing mangled


def test_the_pump_cuts_long_lines_whatever_the_reads(tmp_path):
    """The pump itself, fed by hand: a line held over several reads and ended by a newline in a later one
    still comes out in pieces of at most LINE_MAX_NBYTES, cut between UTF-8 characters."""
    import collections
    import os
    import types

    from tray.launch.output import Routing
    from tray.launch.spawn import OutputPump

    limit = OutputPump.LINE_MAX_NBYTES
    r, w = os.pipe()
    proc = types.SimpleNamespace(rank=0, tail=collections.deque(maxlen=20),
                                 popen=types.SimpleNamespace(stdout=os.fdopen(r, "rb", buffering=0), stderr=None))
    pump = OutputPump([proc], Routing(log_dir=str(tmp_path), redirects=3))
    text = "a" * (limit - 1) + "é" * 1000 + "b" * (limit // 2)
    for part in (text[:limit - 10].encode(), text[limit - 10:].encode() + b"\nshort\n", "tail é".encode()):
        os.write(w, part)
        time.sleep(0.2)  # one read each
    os.close(w)
    pump.stop(5.0)
    lines = [line.split(" ", 1)[1] for line in (tmp_path / "rank-0.log").read_text(encoding="utf-8").splitlines()]
    assert max(len(line.encode()) for line in lines) <= limit, [len(line.encode()) for line in lines]
    assert lines[-2:] == ["short", "tail é"] and "".join(lines[:-2]) == text


def test_a_python_that_cannot_import_tray_is_named(tray_env):
    """The command's Python is not tray's (here: one without site-packages): the report says which interpreter the
    command started and which one tray runs in, and how to run the program with tray's."""
    import sys

    prog = tray_env.script("with tray.init() as rank:\n    pass\n")
    run = tray_env.run([sys.executable, "-m", "tray", "launch", "-n", "2", "-q", "--backend", "host", "--",
                        sys.executable, "-I", "-S", str(prog)])
    assert run.returncode == 1, run.output
    assert "ModuleNotFoundError: No module named 'numpy'" in run.stderr  # the test program imports it first
    assert f"Python cannot import tray (or its dependencies): the command starts {sys.executable!r}" in run.stderr
    assert "name the program alone (tray launch -n N prog.py: tray's Python runs it)" in run.stderr


def test_a_line_of_exactly_the_limit_ending_in_crlf_is_one_line(tmp_path):
    import collections
    import os
    import types

    from tray.launch.output import Routing
    from tray.launch.spawn import OutputPump

    limit = OutputPump.LINE_MAX_NBYTES
    r, w = os.pipe()
    proc = types.SimpleNamespace(rank=0, tail=collections.deque(maxlen=20),
                                 popen=types.SimpleNamespace(stdout=os.fdopen(r, "rb", buffering=0), stderr=None))
    pump = OutputPump([proc], Routing(log_dir=str(tmp_path), redirects=3))
    for part in (b"a" * (limit - 10), b"a" * 10 + b"\r", b"\nnext\n"):
        os.write(w, part)
        time.sleep(0.2)  # one read each
    os.close(w)
    pump.stop(5.0)
    lines = [line.split(" ", 1)[1] for line in (tmp_path / "rank-0.log").read_text().splitlines()]
    assert lines == ["a" * limit, "next"], [len(line) for line in lines]


def test_a_stack_is_written_even_when_the_program_replaced_stderr(tray_env):
    """A program whose sys.stderr has no file descriptor: the rank registers the stack dump on fd 2, so the late
    rank's stack still comes out, and the head's signal never ends it."""
    replaced = """
import io

class ToLog(io.TextIOBase):
    def write(self, text):
        return len(text)

sys.stderr = ToLog()
"""
    run = tray_env.launch(2, replaced + LATE_RANK, "--barrier-timeout-s", "0.5")
    assert run.returncode == 1, run.output
    assert any(line.startswith("[rank 1]") and "in somewhere_else" in line for line in run.stderr.splitlines()), \
        run.stderr
    assert "killed by signal" not in run.stderr, run.stderr


def test_trays_own_lines_are_written_whole_under_the_lock_rank_lines_take(monkeypatch):
    """print() writes a line's text and its newline apart, and a rank's line written by the output pump in between
    joined the two (`... did you mean 'step'?[rank 1] ...`); `say` writes each line in one call under the
    stderr lock the pump writes rank lines under, and a blocked stdout does not hold it."""
    import sys

    from tray.launch import spawn

    calls: list[tuple[str, bool, bool]] = []

    class Recorder:
        def write(self, text: str) -> int:
            calls.append((text, spawn._stderr_lock.locked(), spawn._stdout_lock.locked()))
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    with spawn._stdout_lock:   # a pump blocked writing to a stdout nobody reads
        spawn.say("FAILED: rank 1 reported ValueError")
    assert calls == [("tray: FAILED: rank 1 reported ValueError\n", True, True)]
    assert spawn._lock_of(sys.stderr) is spawn._stderr_lock and spawn._lock_of(sys.stdout) is spawn._stdout_lock


def test_a_log_dir_that_cannot_be_written_is_a_setup_error_before_any_rank_starts(tray_env, tmp_path):
    """--log-dir under a file gave a FileNotFoundError traceback and exit 1, after the ranks had started."""
    afile = tmp_path / "a-file"
    afile.write_text("")
    run = tray_env.launch(2, "print('ran', flush=True)", "--log-dir", str(afile / "logs"))
    assert run.returncode == 2, run.output
    assert run.stderr.strip().splitlines()[-1] == (f"tray: SetupError: --log-dir {afile / 'logs'}: cannot write "
                                                  f"there: {afile} is not a directory; give a directory of yours"), \
        run.stderr
    assert "ran" not in run.stdout and "Traceback" not in run.stderr
    logs = tmp_path / "logs"   # a rank's log file planted as a link: refused before the spawn, not a crash after it
    logs.mkdir()
    (logs / "rank-1.log").symlink_to(tmp_path / "elsewhere")
    run = tray_env.launch(2, "print('ran', flush=True)", "--log-dir", str(logs))
    assert run.returncode == 2, run.output
    assert run.stderr.strip().splitlines()[-1].startswith(f"tray: SetupError: --log-dir {logs}: cannot write there "
                                                          f"({logs / 'rank-1.log'}): "), run.stderr
    assert "ran" not in run.stdout and "Traceback" not in run.stderr and not (tmp_path / "elsewhere").exists()


def test_a_progress_bar_and_a_prompt_show_before_their_line_ends(tray_env, tmp_path):
    """An unfinished line was held until its newline (or 64 KiB): a progress bar redrawn with \\r showed nothing
    until it finished, and then every state at once; a prompt never showed. Now a line unfinished for a second is
    shown as a terminal would show it (its text after the last \\r)."""
    logs = tmp_path / "logs"
    run = tray_env.launch(1, """
    with tray.init() as rank:
        for i in range(1, 4):
            sys.stderr.write(f"\\rstep {i}/3")
            sys.stderr.flush()
            time.sleep(1.3)
        sys.stderr.write("\\rstep 3/3 done\\n")
        sys.stdout.write("continue? ")
        sys.stdout.flush()
        time.sleep(1.5)
        print("yes")
    """, "--log-dir", str(logs), timeout_s=60)
    assert run.returncode == 0, run.output
    shown = [line for line in run.stderr.splitlines() if line.startswith("[rank 0] step")]
    assert shown[:3] == ["[rank 0] step 1/3", "[rank 0] step 2/3", "[rank 0] step 3/3"], run.stderr
    assert shown[-1] == "[rank 0] step 3/3 done" and "\\r" not in run.stderr, run.stderr
    assert run.stdout.splitlines()[:2] == ["[rank 0] continue? ", "[rank 0] yes"], run.stdout
    stamped = (logs / "rank-0.log").read_text().splitlines()
    asked = next(line for line in stamped if line.endswith("continue? "))
    answered = next(line for line in stamped if line.endswith(" yes"))
    assert asked[:23] < answered[:23], stamped   # the prompt's stamp is from before the answer


def test_a_line_shown_unfinished_ends_without_an_empty_line_or_a_split_character(tray_env, tmp_path):
    """Its newline (or the \\n of a \\r\\n) coming later added an empty line; a character split between two writes
    was shown as two replacement characters; the log file keeps what was written."""
    logs = tmp_path / "logs"
    run = tray_env.launch(1, """
    with tray.init() as rank:
        os.write(1, b"loading...")
        time.sleep(1.5)
        os.write(1, b"\\n")
        os.write(1, b"crlf\\r")
        time.sleep(1.5)
        os.write(1, b"\\nnext\\r\\n")
        os.write(1, b"caf\\xc3")
        time.sleep(1.5)
        os.write(1, b"\\xa9 ok\\n")
    """, "--log-dir", str(logs), timeout_s=60)
    assert run.returncode == 0, run.output
    lines = [line for line in run.stdout.splitlines() if line.startswith("[rank 0]")]
    assert lines == ["[rank 0] loading...", "[rank 0] crlf", "[rank 0] next", "[rank 0] caf", "[rank 0] é ok"], \
        run.stdout
    logged = [line[24:] for line in (logs / "rank-0.log").read_text().splitlines()]
    assert logged == ["loading...", "crlf", "next", "caf", "é ok"], logged


def test_rank_output_dropped_because_the_heads_stdout_is_stuck_is_said(tray_env):
    """The head's stdout piped to a reader that takes nothing (`| (sleep 15; cat)`): a rank's 100 MB were dropped at
    the teardown without a word (the failure itself came first, on time)."""
    import subprocess
    import threading

    cmd = tray_env.command(2, """
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 0:
            for _ in range(2000):
                sys.stdout.write("x" * 9999 + "\\n")
            time.sleep(30)
        time.sleep(1)
        raise ValueError("stop")
    """)
    env = tray_env.env()
    env.pop("PYTHONUNBUFFERED", None)  # the head's stdout buffered, as in a plain shell: its flush at exit blocks too
    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(tray_env.tmp))
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(head.stderr))
    reader.start()
    try:
        code = head.wait(timeout=60)  # its stdout never read meanwhile
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.read()
        reader.join(10)
    said = "".join(err)
    assert code == 1 and "tray: FAILED: rank 1 reported ValueError: stop" in said, said
    assert "tray: rank output not all shown: the head's own stdout or stderr took none for" in said, said
