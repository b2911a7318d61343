"""The fault matrix: each fault must end the tray with the right root cause, exit code and time bound,
and leave nothing behind (the `tray_env` fixture checks processes, job dirs and shm)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest
from conftest import MANIFESTS

# A healthy rank: joins, then waits in the barrier long enough to be torn down by the head.
WAIT_IN_BARRIER = """
    with tray.init() as rank:
        if rank.rank == 2:
            FAULT
        rank.barrier(timeout_s=30)
"""


def fault(action: str) -> str:
    return WAIT_IN_BARRIER.replace("FAULT", action)


def test_rank_exits_1(tray_env):
    run = tray_env.launch(4, fault("sys.exit(1)"))
    assert run.returncode == 1, run.output
    assert "FAILED: rank 2" in run.stderr and "exited with code 1" in run.stderr
    first = [ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED")]
    assert first and "rank 2" in first[0]
    assert run.seconds < 15


def test_rank_raises_reports_its_error(tray_env):
    run = tray_env.launch(4, fault("raise ValueError('bad input 42')"))
    assert run.returncode == 1, run.output
    assert "FAILED: rank 2 reported ValueError: bad input 42" in run.stderr
    assert "Traceback" in run.stderr
    assert run.seconds < 15
    run = tray_env.launch(2, fault("raise MemoryError()").replace("rank.rank == 2", "rank.rank == 1"))
    assert "FAILED: rank 1 reported MemoryError (no message)\n" in run.stderr, run.stderr


def test_an_uncaught_error_of_a_rank_kept_without_with_is_reported_and_so_is_a_second_init(tray_env):
    """`rank = tray.init()` at a program's top, as scripts under torchrun keep it, has no `with` to report what ends
    the program: the head said only "exited with code 1". Now the rank's uncaught exception is its error report, and
    the rank prints one line of it, not the traceback twice; a second tray.init() is one such error. sys.exit(1)
    stays an exit code."""
    run = tray_env.launch(2, """
    rank = tray.init()
    if rank.rank == 1:
        raise ValueError('bad input 42')
    rank.barrier(timeout_s=30)
""")
    assert run.returncode == 1, run.output
    assert "tray: FAILED: rank 1 reported ValueError: bad input 42\n" in run.stderr, run.stderr
    # NOTE: the rank's own one line may not come: the head stops it as the report arrives
    # the traceback once: the head's, in its error report
    assert run.stderr.count("Traceback") == 1 and run.stderr.count("raise ValueError('bad input 42')") == 1, run.stderr
    run = tray_env.launch(2, """
    rank = tray.init()
    tray.init()
""")
    assert run.returncode == 1, run.output
    assert "tray: FAILED: rank 0 reported UsageError: tray.init() was already called in this process" in run.stderr \
        or "tray: FAILED: rank 1 reported UsageError: tray.init() was already called in this process" in run.stderr, \
        run.stderr
    run = tray_env.launch(2, """
    rank = tray.init()
    if rank.rank == 1:
        sys.exit(3)
    rank.barrier(timeout_s=30)
""")
    assert "tray: FAILED: rank 1 (pid " in run.stderr and "exited with code 3" in run.stderr, run.stderr


def test_another_threads_exception_passed_to_the_excepthook_is_not_the_ranks_failure(tray_env):
    """A common recipe routes other threads' exceptions to sys.excepthook; such a thread ends, the process goes on:
    the rank must not be reported failed for it (nor its bye withheld)."""
    run = tray_env.launch(2, """
    import threading
    threading.excepthook = lambda a: sys.excepthook(a.exc_type, a.exc_value, a.exc_traceback)
    rank = tray.init()
    t = threading.Thread(target=lambda: 1 / 0)
    t.start()
    t.join()
    rank.barrier(timeout_s=30)
    rank.close()
""")
    assert run.returncode == 0, run.output
    assert "ZeroDivisionError" in run.stderr and "FAILED" not in run.stderr, run.stderr


def test_a_caught_exception_the_program_logs_through_the_excepthook_is_not_the_ranks_failure(tray_env):
    """A program may log an exception it caught by calling sys.excepthook itself, then go on: with its Rank kept
    without `with`, that was reported as the rank's failure and the tray stopped. It prints, and the tray goes on; an
    exception that then ends the program is still reported."""
    run = tray_env.launch(2, """
    rank = tray.init()
    try:
        1 / 0
    except ZeroDivisionError:
        sys.excepthook(*sys.exc_info())
    rank.barrier(timeout_s=30)
    if rank.rank == 1:
        raise ValueError('bad input 43')
    rank.barrier(timeout_s=30)
""")
    assert run.returncode == 1, run.output
    for r in (0, 1):  # each rank's, printed
        assert f"[rank {r}] ZeroDivisionError: division by zero" in run.stderr, run.stderr
    assert "reported ZeroDivisionError" not in run.stderr, run.stderr
    assert "tray: FAILED: rank 1 reported ValueError: bad input 43\n" in run.stderr, run.stderr


def test_an_exception_an_atexit_handler_logs_is_not_the_ranks_failure_and_one_through_a_programs_hook_is(tray_env):
    """An atexit handler (or a greenlet) that logs an exception through sys.excepthook has its own frame at the bottom
    of the stack, not the program's module: it was reported as the rank's failure, and a tray whose every rank ended
    well failed. The rule now is the other way round: only a call from the interpreter, whose first frame is a hook's
    (tray's, or the one the program set over it, here a callable object and a partial), ends the process."""
    run = tray_env.launch(2, """
    import atexit
    rank = tray.init()

    def flush():
        try:
            raise ValueError('logged at exit')
        except ValueError:
            sys.excepthook(*sys.exc_info())

    atexit.register(flush)
    rank.barrier(timeout_s=30)
""")
    assert run.returncode == 0, run.output
    for r in (0, 1):
        assert f"[rank {r}] ValueError: logged at exit" in run.stderr, run.stderr
    assert "FAILED" not in run.stderr and "reported" not in run.stderr, run.stderr
    for wrap in ("Hook(sys.excepthook)", "functools.partial(lambda prev, *a: prev(*a), sys.excepthook)"):
        run = tray_env.launch(2, f"""
    import functools

    class Hook:
        def __init__(self, previous):
            self.previous = previous

        def __call__(self, *exc):
            self.previous(*exc)

    rank = tray.init()
    sys.excepthook = {wrap}
    rank.barrier(timeout_s=30)
    if rank.rank == 1:
        raise ValueError('bad input 45')
    rank.barrier(timeout_s=30)
""")
        assert run.returncode == 1, run.output
        assert "tray: FAILED: rank 1 reported ValueError: bad input 45\n" in run.stderr, (wrap, run.stderr)


@pytest.mark.parametrize("end", ["sys.exit(1)", "os._exit(1)"])
def test_an_exception_logged_through_the_excepthook_then_an_exit_is_named_with_the_death(tray_env, end):
    """A runner that catches the program's exception, logs it through sys.excepthook and exits (coverage's does
    sys.exit(1)): the program is still on the stack then, so it is no report; the head names it with the exit."""
    run = tray_env.launch(2, f"""
    rank = tray.init()
    rank.barrier(timeout_s=30)
    if rank.rank == 1:
        try:
            raise ValueError('bad input 44')
        except ValueError:
            sys.excepthook(*sys.exc_info())
            {end}
    rank.barrier(timeout_s=30)
""")
    assert run.returncode == 1, run.output
    # NOTE: "N s after logging" when the head saw the exit a second or more later (a loaded machine)
    assert re.search(r"tray: FAILED: rank 1 \(pid \d+\) exited with code 1 \(last phase: running\), ([0-9.]+ s )?after "
                     r"logging ValueError: bad input 44\n", run.stderr), run.stderr
    assert "raise ValueError('bad input 44')" in run.stderr, run.stderr  # its traceback, in the report or its output


def test_a_rank_that_logged_long_before_it_died_is_named_with_how_long_before(tray_env):
    """A rank that logged an exception through sys.excepthook and went on, then died of something else (the OOM
    killer's SIGKILL, say): the death was said "after logging ValueError", as if that exception had ended it."""
    run = tray_env.launch(2, """
    rank = tray.init()
    rank.barrier(timeout_s=30)
    if rank.rank == 1:
        try:
            raise ValueError('logged and gone on')
        except ValueError:
            sys.excepthook(*sys.exc_info())
        time.sleep(1.5)
        os.kill(os.getpid(), 9)
    rank.barrier(timeout_s=30)
""")
    assert run.returncode == 1, run.output
    said = re.search(r"tray: FAILED: rank 1 \(pid \d+\) was killed by SIGKILL \(last phase: running\), ([0-9.]+) s "
                     r"after logging ValueError: logged and gone on\n", run.stderr)
    assert said and 1.4 <= float(said.group(1)) < 10, run.stderr


@pytest.mark.parametrize("grace", ["0.5", "6"])
def test_a_sigterm_handler_gets_the_stop_grace_and_one_cut_short_is_said(tray_env, grace):
    """A rank saving its state in a SIGTERM handler for 2 s was SIGKILLed after the fixed 3 s... or, with a
    handler longer than that, cut short in silence. --stop-grace-s sets the grace; a rank killed at its end is said."""
    run = tray_env.launch(2, """
    import signal

    def save(signum, frame):
        time.sleep(2)
        print("saved", flush=True)
        sys.exit(0)

    if os.environ["TRAY_RANK"] == "0":
        signal.signal(signal.SIGTERM, save)
    with tray.init() as rank:
        rank.barrier(timeout_s=30)
        if rank.rank == 1:
            raise ValueError("stop the tray")
        time.sleep(60)
    """, "--stop-grace-s", grace, timeout_s=60)
    assert run.returncode == 1, run.output
    assert "tray: FAILED: rank 1 reported ValueError: stop the tray" in run.stderr, run.stderr
    cut = f"rank 0 did not exit within the {float(grace):g} s grace after SIGTERM: SIGKILLed (a SIGTERM handler " \
          "still running was cut short; --stop-grace-s S gives more)"
    if grace == "0.5":
        assert cut in run.stderr and "[rank 0] saved" not in run.stdout, run.output
    else:
        assert "[rank 0] saved" in run.stdout and "did not exit within" not in run.stderr, run.output


def test_a_rank_that_closed_its_standard_streams_survives_the_heads_stack_dump(tray_env):
    """A program that closed fds 1 and 2 before tray.init(): ZeroMQ's eventfd took fd 2, and the head's stack dump
    signal (faulthandler writing to fd 2) aborted the rank in libzmq (SIGABRT), where the signal must never end a
    rank."""
    run = tray_env.launch(2, """
    import signal
    from tray.handshake import STACK_DUMP_SIGNAL_OFFSET
    os.close(1)
    os.close(2)
    with tray.init() as rank:
        os.kill(os.getpid(), signal.SIGRTMIN + STACK_DUMP_SIGNAL_OFFSET)
        time.sleep(0.3)
        rank.barrier(timeout_s=30)
        open(f"survived-{rank.rank}", "w").close()
    """, timeout_s=60)
    assert run.returncode == 0, run.output
    assert sorted(p.name for p in tray_env.tmp.glob("survived-*")) == ["survived-0", "survived-1"], run.output


def _head_until_its_teardown(tray_env, cmd: list[str]) -> tuple[subprocess.Popen, list[str], Any]:
    """The head started on `cmd`, its stderr read on a thread into a list, once it says it stops its ranks."""
    import threading

    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=tray_env.env(),
                            cwd=str(tray_env.tmp))
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(head.stderr))
    reader.start()
    deadline = time.monotonic() + 30
    while not any("tray: stopping rank" in ln for ln in err) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not any("tray: stopping rank" in ln for ln in err):
        head.kill()
        head.communicate()
        reader.join(10)
        raise AssertionError("".join(err))
    return head, err, reader


def test_a_rank_killed_just_before_a_stop_signal_is_said_not_hidden_by_the_interrupt(tray_env):
    """Rank 1 sends the head SIGINT and is SIGKILLed at once, within the head's turn: the head left its loop on the
    signal before judging the death, and said only "interrupted". The death is said, judged or not."""
    run = tray_env.launch(2, """
    import signal
    if os.environ["RANK"] == "1":
        time.sleep(0.5)
        os.kill(os.getppid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
    """)
    assert run.returncode == 130, run.output
    assert re.search(r"tray: (FAILED: )?rank 1 \(pid [0-9]+\) was killed by SIGKILL", run.stderr), run.stderr


def test_a_second_stop_signal_during_the_grace_ends_it_at_once(tray_env):
    """With a long --stop-grace-s, a Ctrl-C during the grace was only noted: the head waited out the whole grace."""
    cmd = tray_env.command(2, """
    import signal
    if os.environ["TRAY_RANK"] == "0":
        signal.signal(signal.SIGTERM, lambda *a: time.sleep(60))
    with tray.init() as rank:
        rank.barrier(timeout_s=30)
        if rank.rank == 1:
            raise ValueError("stop the tray")
        time.sleep(60)
    """, "--stop-grace-s", "40")
    head, err, reader = _head_until_its_teardown(tray_env, cmd)
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        head.send_signal(signal.SIGINT)
        code = head.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if head.poll() is None:
            head.kill()
        head.communicate()
        reader.join(10)
    said = "".join(err)
    assert code == 1 and took < 10, (code, took, said)
    assert "rank 0 SIGKILLed at once: a second stop signal during the grace" in said, said


def test_rank_sigkilled(tray_env):
    run = tray_env.launch(4, fault("os.kill(os.getpid(), 9)"))
    assert run.returncode == 1, run.output
    assert "rank 2" in run.stderr and "was killed by SIGKILL" in run.stderr
    assert run.seconds < 15


@pytest.mark.parametrize("leader, first, then, named", [
    # rank 1 killed; rank 0, connected to it as a gloo or TCPStore client is, exits 1 on the broken connection a
    # moment later, within the head's turn: exits were judged in rank order at the turn, and rank 0 was named
    ("1", "os.kill(os.getpid(), signal.SIGKILL)", "os._exit(1)", r"rank 1 \(pid [0-9]+\) was killed by SIGKILL"),
    ("1", "os.kill(os.getpid(), signal.SIGKILL)", "os._exit(1)", r"rank 1 \(pid [0-9]+\) was killed by SIGKILL"),
    # rank 0 exits 1, rank 1 aborts on the lost connection (std::terminate in a C++ library): an abort is no more a
    # cause than the exit (a rule that put every fault signal first named rank 1)
    ("0", "os._exit(1)", "os.abort()", r"rank 0 \(pid [0-9]+\) exited with code 1"),
])
def test_a_rank_ending_on_a_peers_end_a_moment_later_is_not_the_root_cause(tray_env, leader, first, then, named):
    run = tray_env.launch(2, f"""
    import signal, socket
    port = int(os.environ["MASTER_PORT"])
    if os.environ["RANK"] == "{leader}":
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(1)
        c, _ = s.accept()
        time.sleep(0.3)
        {first}
    for _ in range(500):
        try:
            c = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            time.sleep(0.01)
    c.recv(1)
    {then}
    """)
    assert run.returncode == 1, run.output
    failed = [ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED")]
    assert failed and re.match("tray: FAILED: " + named, failed[0]), run.stderr


def test_rank_segfaults(tray_env):
    run = tray_env.launch(4, fault("import ctypes; ctypes.string_at(0)"))
    assert run.returncode == 1, run.output
    assert "rank 2" in run.stderr and "was killed by SIGSEGV" in run.stderr
    # the rank enabled faulthandler: where it crashed is in its output
    assert "[rank 2] Fatal Python error: Segmentation fault" in run.stderr, run.stderr
    assert run.seconds < 15


def test_rank_hangs_before_offer(tray_env):
    body = """
    if os.environ["TRAY_RANK"] == "3":
        time.sleep(600)
    with tray.init() as rank:
        rank.barrier(timeout_s=30)
    """
    run = tray_env.launch(4, body, "--timeout-s", "2")
    assert run.returncode == 3, run.output
    assert "rank 3 did not offer within 2 s of the first rank's contact (--timeout-s; process alive" in run.stderr
    assert re.search(r"spawn: not heard from in its \d+\.\d s \(tray.init\(\) not called yet", run.stderr), run.stderr
    # how the root cause's rank ended is said too: the teardown stopped it (it was left out of that line)
    assert re.search(r"after teardown: .*rank 3 \(the root cause\): killed by SIGTERM", run.stderr), run.stderr
    assert run.seconds < 15


def test_a_rank_stopped_before_it_offers_is_said_stopped_not_only_alive(tray_env):
    """A rank stopped (SIGSTOP) before tray.init() was said "alive" when the handshake gave up; alive but stopped, it
    never comes until continued. Its SIGTERM in the teardown is acted on (SIGCONT with it)."""
    body = """
    import signal
    if os.environ["TRAY_RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    with tray.init() as rank:
        rank.barrier(timeout_s=30)
    """
    run = tray_env.launch(2, body, "--timeout-s", "2")
    assert run.returncode == 3, run.output
    assert "rank 1 did not offer within 2 s of the first rank's contact (--timeout-s; process alive but stopped " \
        "(state T: SIGSTOP, SIGTSTP or a debugger)" in run.stderr, run.stderr
    assert re.search(r"after teardown: .*rank 1 \(the root cause\): killed by SIGTERM", run.stderr), run.stderr


def test_rank_hangs_in_barrier_is_named_missing(tray_env):
    run = tray_env.launch(4, """
    with tray.init() as rank:
        if rank.rank == 1:
            time.sleep(600)
        rank.barrier(timeout_s=1.0)
    """)
    assert run.returncode == 1, run.output
    line = next(ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED"))
    assert "BarrierTimeout" in line and "for rank 1" in line and "waited 1.0" in line
    assert run.seconds < 15


def test_a_barrier_timeout_names_the_rank_that_waited_and_the_one_it_missed(tray_env):
    """Rank 0 never comes: the rank that reports says that it waited (its own number) and that rank 0 is missing."""
    run = tray_env.launch(3, """
    with tray.init() as rank:
        if rank.rank == 0:
            time.sleep(600)
        rank.barrier(timeout_s=1.0)
    """)
    assert run.returncode == 1, run.output
    line = next(ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED"))
    found = re.search(r"rank (\d+) reported BarrierTimeout: barrier world epoch \d+: rank (\d+) waited 1\.0\d* s "
                      r"for rank 0\b", line)
    assert found and found.group(1) == found.group(2) and found.group(1) in ("1", "2"), line
    assert "rank 0 missing" in line, line


def test_rank_stopped_misses_heartbeats(tray_env):
    run = tray_env.launch(3, """
    import signal
    with tray.init() as rank:
        if rank.rank == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
        rank.barrier(timeout_s=60)
    """,
        "--heartbeat-timeout-s", "2")
    assert run.returncode == 1, run.output
    assert "rank 0" in run.stderr and "sent no heartbeat" in run.stderr
    assert run.seconds < 20


def test_a_rank_that_closed_its_tray_is_not_expected_to_heartbeat(tray_env):
    """`rank.close()` says bye: a program that goes on without the tray (writing results, say) for longer than
    the heartbeat timeout is not failed as frozen; before, only leaving a `with` block said bye."""
    run = tray_env.launch(2, """
    rank = tray.init()
    rank.barrier()
    rank.close()
    time.sleep(4)
    print("after close", rank.rank, flush=True)
    """, "--heartbeat-timeout-s", "2")
    assert run.returncode == 0, run.output
    assert "after close 0" in run.stdout and "after close 1" in run.stdout, run.output


@pytest.mark.parametrize("death", ["os._exit(3)", "os.kill(os.getpid(), 9)", "os._exit(0)"])
def test_a_rank_dying_while_its_peers_map_its_buffers_is_the_root_cause(tray_env, death):
    """Rank 1 dies as the ranks fetch each other's buffers: the others' fetch from it fails, and their report (which
    came first) was printed as the root cause, rank 1 only in the teardown's line."""
    run = tray_env.launch(4, f"""
    import tray.rank.lifecycle as lifecycle
    mapping = lifecycle._import_peers

    def dying(parts, *args):
        if parts.env.rank == 1:   # its fd socket holds the others' requests, and it dies meanwhile
            parts.fd_server._table_ready.clear()
            time.sleep(0.5)
            {death}
        return mapping(parts, *args)

    lifecycle._import_peers = dying
    with tray.init() as rank:
        rank.barrier()
    """, "--manifest", str(MANIFESTS / "peer_fill.json"))
    assert run.returncode == 1, run.output
    how = {"os._exit(3)": "exited with code 3", "os.kill(os.getpid(), 9)": "was killed by SIGKILL",
           "os._exit(0)": "exited with code 0"}[death]
    cause = next(line for line in run.stderr.splitlines() if line.startswith("tray: FAILED:"))
    assert cause.startswith("tray: FAILED: rank 1 (pid") and how in cause, run.stderr
    assert run.seconds < 15


def test_a_rank_that_closed_its_tray_is_waited_for_aloud_and_failed_once_stopped(tray_env):
    """A rank sends no heartbeat once it closed its tray (its program may go on without it), and the tray ends when
    it exits: stopped there (SIGSTOP), the tray waited for good, saying nothing. Whom it waits for is said every
    10 s once a rank exited; a rank stopped for --heartbeat-timeout-s fails the tray, and its SIGTERM is acted on
    (SIGCONT with it), not cut short by the SIGKILL after the grace."""
    run = tray_env.launch(2, """
    import signal
    with tray.init() as rank:
        rank.barrier(timeout_s=30)
        me = rank.rank
    if me == 1:
        time.sleep(12.5)
        os.kill(os.getpid(), signal.SIGSTOP)
    """, "--heartbeat-timeout-s", "2", timeout_s=60)
    assert run.returncode == 1, run.output
    waiting = [ln for ln in run.stderr.splitlines() if ln.startswith("tray: waiting for rank 1 to exit")]
    assert len(waiting) == 1 and "(1 of 2 did;" in waiting[0] and \
        re.search(r"rank 1 closed its tray 1[0-2] s ago, sleeping", waiting[0]), run.stderr
    first = [ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED")]
    assert first and first[0].startswith("tray: FAILED: rank 1 (pid") and "and has been stopped for 2." in first[0] \
        and "(state T:" in first[0], run.stderr
    assert "rank 1 (the root cause): killed by SIGTERM" in run.stderr, run.stderr
    assert run.seconds < 25, run.output


def test_a_barrier_that_misses_a_rank_which_closed_its_tray_says_so(tray_env):
    """The note on the missing rank said 'stopped or frozen (no heartbeat)' of a rank that had closed its tray."""
    run = tray_env.launch(2, """
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 0:
            rank.barrier(timeout_s=1)
    if os.environ["TRAY_RANK"] == "1":
        time.sleep(20)
    """)
    assert run.returncode == 1, run.output
    assert re.search(r"rank 1 closed its tray \(rank.close\(\), or the end of its `with tray.init\(\)` block\) "
                     r"[0-9.]+ s ago: it takes part in no barrier or step any more", run.stderr), run.stderr
    assert run.seconds < 15


def test_offers_with_different_manifests(tray_env):
    other = MANIFESTS / "peer_fill.json"
    run = tray_env.launch(4, f"""
    path = {str(other)!r} if os.environ["TRAY_RANK"] == "1" else None
    with tray.init(manifest=path) as rank:
        rank.barrier()
    """)
    assert run.returncode == 3, run.output
    assert "manifests differ: rank 1 offered manifest" in run.stderr
    assert "ranks 0,2,3 offered manifest" in run.stderr
    assert run.seconds < 15


def test_two_ranks_claim_one_device(tray_env):
    run = tray_env.launch(4, """
    if os.environ["TRAY_RANK"] == "1":
        os.environ["TRAY_DEVICE"] = "0"
    with tray.init() as rank:
        rank.barrier()
    """)
    assert run.returncode == 3, run.output
    assert "ranks 0,1 claim one device" in run.stderr
    assert run.seconds < 15


def test_non_member_cannot_fetch_fds(tray_env):
    run = tray_env.launch(2, """
    import subprocess
    with tray.init() as rank:
        if rank.rank == 0:
            probe = (
                "import sys\\n"
                "from tray.handshake.fdpass import fetch_fds\\n"
                "from tray.errors import HandshakeError\\n"
                "try:\\n"
                "    fetch_fds(sys.argv[1], sys.argv[2], ['tray:barrier:world'], 'rank 1', 5.0)\\n"
                "    print('PROBE GOT FDS')\\n"
                "except HandshakeError as e:\\n"
                "    print('PROBE REFUSED:', e)\\n"
            )
            path = os.path.join(os.environ["TRAY_JOB"], "rank-1.fds")
            out = subprocess.run([sys.executable, "-c", probe, path, os.environ["TRAY_TOKEN"]],
                                 capture_output=True, text=True, timeout=30)
            print(out.stdout.strip(), out.stderr.strip())
        rank.barrier(timeout_s=30)
    """)
    assert run.returncode == 0, run.output
    assert "PROBE REFUSED: rank 1's fd socket refused: pid" in run.stdout
    assert "is not a member of the tray table" in run.stdout
    assert "PROBE GOT FDS" not in run.stdout


def test_garbage_and_wrong_token_are_rejected_naming_the_sender(tray_env):
    run = tray_env.launch(2, """
    import zmq, msgpack
    from tray.handshake.wire import PROTOCOL_VERSION
    with tray.init() as rank:
        if rank.rank == 0:
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, b"intruder")
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(os.environ["TRAY_RDZV"])
            s.send(b"\\xc1garbage")
            s.send(msgpack.packb({"kind": "bye", "v": PROTOCOL_VERSION, "token": "not-the-token", "rank": 0}))
            print("replies:", s.poll(1000), flush=True)   # none: a Reject carries the token, so only ranks get one
            s.close(); ctx.term()
        rank.barrier(timeout_s=30)
    """)
    assert run.returncode == 0, run.output
    assert "rejected a message from intruder" in run.stderr
    assert "token" in run.stderr
    assert "replies: 0" in run.stdout



def test_a_process_taking_a_free_rank_identity_gets_no_token(tray_env):
    """A rank's identity is only a name: any process of this user could take one not yet connected (or left) and,
    sending garbage or a wrong token, got a Reject, which carries the job's token. Only a sender that showed the token
    gets one now."""
    run = tray_env.launch(2, """
    import zmq, msgpack
    from tray.handshake.wire import PROTOCOL_VERSION
    if os.environ["TRAY_RANK"] == "0":   # before rank 0 connects: its identity is free
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, b"rank-0")
        s.setsockopt(zmq.LINGER, 0)
        s.connect(os.environ["TRAY_RDZV"])
        s.send(b"\\xc1garbage")
        s.send(msgpack.packb({"kind": "bye", "v": PROTOCOL_VERSION, "token": "not-the-token", "rank": 0}))
        got = [msgpack.unpackb(s.recv()) for _ in range(2) if s.poll(1500)]
        print("leaked:", any(os.environ["TRAY_TOKEN"] in str(m) for m in got), flush=True)
        s.send(msgpack.packb({"kind": "bye", "v": PROTOCOL_VERSION, "token": os.environ["TRAY_TOKEN"], "rank": 7}))
        print("with the token:", msgpack.unpackb(s.recv()).get("kind") if s.poll(1500) else None, flush=True)
        s.close()
        for name in (b"stranger", b"rank-7", b"rank-0x"):   # identities of no rank of this tray: never answered
            t = ctx.socket(zmq.DEALER)
            t.setsockopt(zmq.IDENTITY, name)
            t.setsockopt(zmq.LINGER, 0)
            t.connect(os.environ["TRAY_RDZV"])
            t.send(msgpack.packb({"kind": "heartbeat", "v": PROTOCOL_VERSION, "token": os.environ["TRAY_TOKEN"],
                                  "rank": 0, "phase": "start", "seq": 1}))
            print("stranger answered:", t.poll(1000) != 0, flush=True)
            t.close()
        ctx.term()
    with tray.init() as rank:
        rank.barrier(timeout_s=30)
    """)
    assert run.returncode == 0, run.output
    assert "rejected a message from rank-0" in run.stderr
    assert "leaked: False" in run.stdout
    assert "with the token: reject" in run.stdout
    assert run.stdout.count("stranger answered: False") == 3, run.stdout


def test_a_message_claiming_another_ranks_number_is_refused_and_never_counted_as_its_vote(tray_env):
    """Rank 1 sends a vote signed with the job token but claiming rank 0: the identity a message comes from decides
    whose it is, so the head refuses it (the tray fails naming rank 1) and never hands it out as rank 0's value."""
    run = tray_env.launch(2, """
    from tray.handshake import wire
    with tray.init() as rank:
        if rank.rank == 1:
            rank._wiring.client.send(wire.Vote(token=rank.env.token, rank=0, topic="who", round=1, value=-1))
            time.sleep(0.5)
        values = rank.exchange("who", rank.rank, timeout_s=10)
        assert -1 not in values, f"rank {rank.rank} got a value rank 0 never sent: {values}"
        assert values == [0, 1], values
    """)
    assert run.returncode == 1, run.output
    said = "identity 'rank-1' does not match the rank it claims (0)"
    assert f"rejected a message from rank-1: {said}" in run.stderr, run.stderr
    first = [ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED")]
    assert first and first[0].startswith("tray: FAILED: rank 1 reported HandshakeError"), run.stderr
    assert said in first[0], run.stderr
    assert "got a value rank 0 never sent" not in run.output


def test_a_second_offer_from_a_rank_is_rejected_and_the_table_is_handed_out_once(tray_env):
    """A rank that offers again once the tray is up (its offer re-sent) changes nothing: the head logs and drops
    it, runs no second validation and sends no second table."""
    run = tray_env.launch(2, """
    from tray.handshake import wire
    with tray.init() as rank:
        if rank.rank == 0:
            device = wire.DeviceIdentity(ordinal=0, uuid="dev-0", pci_bus="", numa_node=-1)
            again = wire.Offer(token=rank.env.token, rank=0, world_size=2, host="elsewhere", pid=os.getpid(),
                               uid=os.getuid(), device=device, backend="host", manifest="0" * 64, fd_socket="/nowhere",
                               buffers=(), groups={}, timings={})
            rank._wiring.client.send(again)
        rank.barrier(timeout_s=30)
        rank.exchange("after", rank.rank)
        print("still up", rank.rank, flush=True)
    """)
    assert run.returncode == 0, run.output
    assert "rejected a message from rank-0: a second offer" in run.stderr, run.stderr
    assert "offers disagree" not in run.output
    assert run.stdout.count("still up") == 2, run.output


def test_an_error_report_naming_a_rank_number_of_thousands_of_digits_fails_the_tray_naming_its_sender(tray_env):
    """A rank's error message is read for the ranks it names (a barrier's missing ranks, a peer's fd socket): one of
    5000 digits (int() refuses it) once crashed the head with a traceback. It is the sender's failure, said."""
    run = tray_env.launch(2, """
    from tray.handshake import wire
    with tray.init() as rank:
        if rank.rank == 1:
            for text in ("rank " + "1" * 5000 + "'s fd socket", "waited 1 s for rank " + "1" * 5000):
                rank._wiring.client.send(wire.ErrorReport(token=rank.env.token, rank=1, phase="running",
                                                          error_type="X", message=text, traceback=""))
            time.sleep(30)
        rank.barrier(timeout_s=30)
    """)
    assert run.returncode == 1, run.output
    assert "Traceback" not in run.stderr, run.stderr
    first = [ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED")]
    assert first and first[0].startswith("tray: FAILED: rank 1 reported X: rank 111"), run.stderr


def test_offers_each_within_its_limit_but_too_large_together_fail_the_tray_naming_the_largest(tray_env):
    """Each offer is checked against one message's limit; the table carries all of them. Together over the table's
    limit, its encoding raised out of the head's loop: no FAILED line, exit 2 (a usage error), no restart."""
    run = tray_env.launch(2, """
    import dataclasses
    from tray.handshake import client, wire
    plain = client.RendezvousClient.send
    def send(self, msg):
        if isinstance(msg, wire.Offer) and msg.rank == 1:
            msg = dataclasses.replace(msg, timings={**msg.timings, "x" * 700_000: 1.0})
        elif isinstance(msg, wire.Offer):
            msg = dataclasses.replace(msg, timings={**msg.timings, "y" * 600_000: 1.0})
        return plain(self, msg)
    client.RendezvousClient.send = send
    with tray.init() as rank:
        print("up", flush=True)
    """)
    assert run.returncode == 3, run.output
    assert "Traceback" not in run.stderr and "up" not in run.stdout, run.output
    first = [ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED")]
    assert first and "the table of every rank's offer cannot be sent" in first[0], run.stderr
    assert "the largest offer is rank 1's" in first[0], run.stderr


def test_a_vote_packed_smaller_than_the_head_packs_it_is_named_when_the_decision_is_too_large(tray_env):
    """A vote whose floats a rank packed as msgpack float32 grows when the head re-encodes it (float64): the handler
    naming the rank that sent the largest vote re-encoded each at the limit, and raised out of the head's loop."""
    run = tray_env.launch(2, """
    import msgpack
    from tray.handshake import client
    plain = client.RendezvousClient.send_bytes
    def send_bytes(self, data):
        body = msgpack.unpackb(data, raw=False)
        if body.get("kind") == "vote" and self.rank == 1:
            body["value"] = [0.5] * 180_000
            data = msgpack.packb(body, use_bin_type=True, use_single_float=True)
        return plain(self, data)
    client.RendezvousClient.send_bytes = send_bytes
    with tray.init() as rank:
        rank.exchange("t", 1, timeout_s=30)
    """)
    assert run.returncode == 1, run.output
    assert "Traceback" not in run.stderr, run.stderr
    first = [ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED")]
    assert first and "exchange 't' (round 1): the decision cannot be sent" in first[0], run.stderr
    assert "rank 1 sent the largest" in first[0], run.stderr


def test_a_fifo_at_a_ranks_error_file_does_not_hang_its_report(tray_env):
    """Something other than a file at the name the failing rank writes its error file under (a FIFO, made by the
    rank here for whoever could plant one): the open would block for good, the rank alive and heartbeating, and the
    head never hear of the failure. The rank sends its report instead."""
    run = tray_env.launch(2, """
    with tray.init() as rank:
        if rank.rank == 1:
            os.mkfifo(os.path.join(os.environ["TRAY_JOB"], "rank-1.error.tmp"))
            raise RuntimeError("fails on purpose")
        time.sleep(600)
    """, timeout_s=60)
    assert run.returncode == 1, run.output
    assert "rank 1 reported RuntimeError: fails on purpose" in run.stderr, run.output
    assert run.seconds < 30, run.output


@pytest.mark.parametrize("planted", ["fifo", "link", "list"])
def test_what_a_rank_leaves_at_its_error_file_does_not_hang_or_end_the_head(tray_env, planted):
    """The head reads a failed rank's error file: a FIFO there (made by the rank, for whoever could plant one) blocked
    its read for good, the tray never ending; a link was followed; JSON that is not an object raised in the head.
    Each is now no report, and the rank's exit is the root cause."""
    run = tray_env.launch(2, f"""
    with tray.init() as rank:
        if rank.rank == 1:
            path = os.path.join(os.environ["TRAY_JOB"], "rank-1.error.json")
            if {planted!r} == "fifo":
                os.mkfifo(path)
            elif {planted!r} == "link":
                os.symlink("/etc/hostname", path)
            else:
                with open(path, "w") as f:
                    f.write("[1, 2]")
            os._exit(3)
        time.sleep(600)
    """, timeout_s=60)
    assert run.returncode == 1, run.output
    assert re.search(r"FAILED: rank 1 \(pid \d+\) exited with code 3", run.stderr), run.output
    assert run.seconds < 30, run.output


def test_head_sigkilled_takes_its_ranks(tray_env):
    cmd = tray_env.command(3, """
    with tray.init() as rank:
        print("up", flush=True)
        time.sleep(600)
    """)
    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=tray_env.env(),
                            cwd=str(tray_env.tmp))
    try:
        seen = 0
        deadline = time.monotonic() + 30
        while seen < 3 and time.monotonic() < deadline:
            line = head.stdout.readline()
            seen += line.strip().endswith("up")
        assert seen == 3
        ranks = [c for c in psutil.Process(head.pid).children() if "tray.launch.watchdog" not in c.cmdline()]
        assert len(ranks) == 3
        t0 = time.monotonic()
        head.send_signal(signal.SIGKILL)
        head.wait(timeout=10)
        gone, alive = psutil.wait_procs(ranks, timeout=5)
        assert not alive, alive
        assert time.monotonic() - t0 < 5
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.close()
    # a head killed by SIGKILL cannot remove its job dir; its watchdog does
    deadline = time.monotonic() + 5
    while list(tray_env.jobs_root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tray_env.jobs_root.iterdir()) == []


def test_a_head_sigkilled_the_moment_its_watchdog_was_released_leaves_no_job_dir(tray_env):
    """The head released its watchdog at the end of a clean run, then removed the job dir: a SIGKILL in between (a
    time limit's kill, the OOM killer) left the dir, with nobody to remove it. The dir goes first now. (The fixture
    checks that no job dir is left.)"""
    cmd = tray_env.command(2, """
    with tray.init() as rank:
        rank.barrier()
    """)
    head = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=tray_env.env(),
                            cwd=str(tray_env.tmp))
    try:
        watchdog = None
        deadline = time.monotonic() + 30
        while watchdog is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                watchdog = next((c for c in psutil.Process(head.pid).children()
                                 if "tray.launch.watchdog" in " ".join(c.cmdline())), None)
        assert watchdog is not None
        while time.monotonic() < deadline:  # the watchdog's end: the head killed at once (no sleep: a window of ms)
            try:
                if watchdog.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
        head.send_signal(signal.SIGKILL)
        head.wait(timeout=10)
    finally:
        if head.poll() is None:
            head.kill()
            head.wait(timeout=10)


@pytest.mark.parametrize("how", ["process_group", "session"])
def test_head_sigkilled_takes_the_descendants_that_left_the_trays_group(tray_env, how):
    """A rank's child in a process group (or session) of its own is not in the tray's group: with the head killed
    (no subreaper left to adopt it), the watchdog finds it by the job dir its environment names."""
    cmd = tray_env.command(2, f"""
    import subprocess
    with tray.init() as rank:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]],
                                 {'process_group=0' if how == 'process_group' else 'start_new_session=True'})
        print("up", child.pid, flush=True)
        time.sleep(600)
    """)
    _kill_head_then_check_gone(tray_env, cmd, "up", 2, wait_s=5)


def test_head_sigkilled_a_daemon_that_left_the_session_and_cleared_its_environment_is_stopped(tray_env):
    """A rank's daemon (double fork, setsid, an empty environment) is adopted by the head, its subreaper; the head
    SIGKILLed, it was known by nothing (neither the tray's group nor TRAY_JOB in its environment) and ran on. The head
    now tells its watchdog of the orphans it adopts, by pid and start time."""
    cmd = tray_env.command(1, """
    with tray.init() as rank:
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            pid = os.fork()
            if pid == 0:
                os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]], {})
            os.write(w, str(pid).encode())
            os._exit(0)
        os.close(w)
        daemon = int(os.read(r, 32))
        time.sleep(1.5)   # the head, its subreaper, has adopted it and looked
        print("daemon", daemon, flush=True)
        time.sleep(600)
    """)
    _kill_head_then_check_gone(tray_env, cmd, "daemon", 1, wait_s=8)


def _kill_head_then_check_gone(tray_env, cmd: list[str], word: str, count: int, wait_s: float) -> None:
    """Start the head of `cmd`, wait for `count` lines "... WORD PID" (children its ranks started), SIGKILL the head,
    then check those children are gone within `wait_s`, and so is every job dir."""
    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=tray_env.env(),
                            cwd=str(tray_env.tmp))
    children = []
    try:
        deadline = time.monotonic() + 40
        while len(children) < count and time.monotonic() < deadline:
            line = head.stdout.readline().split()
            if len(line) >= 2 and line[-2] == word:
                children.append(psutil.Process(int(line[-1])))
        assert len(children) == count
        head.send_signal(signal.SIGKILL)
        head.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=wait_s)
        assert not alive, alive
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.close()
        for c in children:
            with contextlib.suppress(psutil.Error):
                c.kill()
    deadline = time.monotonic() + wait_s
    while list(tray_env.jobs_root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tray_env.jobs_root.iterdir()) == []


@pytest.mark.parametrize("n", [1, 2])
def test_small_trays(tray_env, n):
    run = tray_env.launch(n, """
    with tray.init() as rank:
        rank.barrier()
        assert rank.exchange("x", rank.rank) == list(range(rank.world_size))
    """)
    assert run.returncode == 0, run.output


def test_head_exit_code_is_usage_error_for_bad_manifest(tray_env, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 1, "name": "x", "buffers": [{"name": "b", "dtype": "f33", "shape": [1]}]}')
    run = tray_env.run([sys.executable, "-m", "tray", "launch", "-n", "2", "--backend", "host", "--manifest",
                        str(bad), "--", sys.executable, "-c", "pass"])
    assert run.returncode == 2
    assert "bad.json: $.buffers[0].dtype" in run.stderr
    assert os.path.isdir(tray_env.jobs_root)


def test_missing_command_is_a_usage_error(tray_env):
    run = tray_env.run([sys.executable, "-m", "tray", "launch", "-n", "2", "--backend", "host", "--",
                        "/nonexistent/program"])
    assert run.returncode == 2, run.output
    assert "cannot start rank 0: '/nonexistent/program': No such file or directory" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_command_in_this_directory_named_without_a_slash_is_said_to_be_looked_for_on_path(tray_env):
    """`tray launch -- prog.py` (or --no-python) with prog.py right here: exec looks on PATH only, and "No such file
    or directory" alone denied a file the user can see."""
    (tray_env.tmp / "prog.py").write_text("pass\n")
    run = tray_env.run([sys.executable, "-m", "tray", "launch", "-n", "2", "--backend", "host", "--", "prog.py"])
    assert run.returncode == 2, run.output
    assert ("cannot start rank 0: 'prog.py': No such file or directory; a command without a '/' is looked for on PATH "
            "only, and prog.py in this directory is not: name it ./prog.py, or without `--` and --no-python (tray "
            "launch -n N prog.py: this Python runs it)") in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_exchange_timeout_names_who_never_joined_the_step(tray_env):
    run = tray_env.launch(3, """
    with tray.init() as rank:
        if rank.rank == 2:
            time.sleep(600)
        rank.exchange("step", rank.rank, timeout_s=1.0)
    """)
    assert run.returncode == 1, run.output
    assert "no decision on exchange 'step' from the head within 1.0 s" in run.stderr
    assert "tray-wide step: exchange 'step' (round 1) was still waiting for rank 2" in run.stderr
    # the head says, under the verdict, what the rank never heard from is doing, and has it write its stack
    notes = run.stderr.split("tray: FAILED: ", 1)[1].splitlines()[1:3]
    assert notes and notes[0].startswith("tray:   rank 2 is alive, last heartbeat") and "running but not where " \
        "the others wait for it" in notes[0] and "give the step more time (the timeout_s of exchange 'step', " \
        "round 1)" in notes[0], run.stderr
    assert any(ln.startswith("[rank 2]") and re.search(r"prog_\w+\.py\", line \d+ in <module>", ln)
               for ln in run.stderr.splitlines()), \
        run.stderr
    assert run.seconds < 15


@pytest.mark.parametrize("leaves", ["exit", "close"])
def test_a_rank_that_ends_while_others_wait_in_a_step_is_named_at_once(tray_env, leaves):
    """Rank 2 ends (exits 0, or closes its tray and goes on) while ranks 0 and 1 wait in an exchange it never
    joins: the tray fails at once naming it, not when their 30 s timeout passes."""
    end = "sys.exit(0)" if leaves == "exit" else "rank.close(); time.sleep(30)"
    run = tray_env.launch(3, f"""
    rank = tray.init()
    rank.barrier()
    if rank.rank == 2:
        {end}
    rank.exchange("step", rank.rank, timeout_s=30.0)
    """)
    assert run.returncode == 1, run.output
    how = "exited with code 0" if leaves == "exit" else "closed its tray"
    assert "FAILED: rank 2 (pid" in run.stderr and f") {how}" in run.stderr, run.stderr
    assert re.search(r"while (rank [01] waits|ranks 0,1 wait) for it in exchange 'step' \(round 1\), which it never "
                     "joined", run.stderr), run.stderr
    assert run.seconds < 15


def test_ranks_waiting_in_different_steps_are_named_at_once(tray_env):
    """Rank 0 waits in exchange 'a', ranks 1 and 2 in exchange 'b' (a topic that differs by rank, or exchanges in
    another order): neither can ever be decided. The head sees it as the last of them votes and fails the tray
    naming both steps, instead of each rank's 60 s timeout passing."""
    run = tray_env.launch(3, """
    with tray.init() as rank:
        rank.barrier()
        rank.exchange("a" if rank.rank == 0 else "b", rank.rank)
    """)
    assert run.returncode == 1, run.output
    assert "the ranks wait in steps that wait for one another, so none can ever end:" in run.stderr, run.stderr
    assert re.search(r"exchange '([ab])' \(round 1\) waits for rank \d, which waits in exchange '(?!\1)[ab]' "
                     r"\(round 1\)", run.stderr), run.stderr
    assert "in the same order" in run.stderr
    assert run.seconds < 15


def test_a_rank_that_gave_a_step_up_is_not_taken_for_one_waiting_in_it(tray_env):
    """Rank 0 gives exchange 'a' up (its 1 s timeout, caught) and goes on to 'b', late; rank 1 votes 'b' first, then
    'a'. Rank 0's old vote in 'a' is still in the head's box: counted as waiting, it made a false deadlock. A vote
    counts as waiting only while its rank still waits (the vote says how long)."""
    run = tray_env.launch(2, """
    with tray.init() as rank:
        if rank.rank == 0:
            try:
                rank.exchange("a", 0, timeout_s=3.0)   # counted as waiting for 2 s of it, then given up
            except tray.HandshakeError:
                print("gave a up", flush=True)
            time.sleep(2.0)
            assert rank.exchange("b", 0) == [0, 1]
        else:
            time.sleep(4.0)
            assert rank.exchange("b", 1) == [0, 1]
        print("ok", rank.rank, flush=True)
    """)
    assert run.returncode == 0, run.output
    assert "gave a up" in run.stdout and run.stdout.count("ok ") == 2, run.output


def test_decisions_of_steps_given_up_do_not_lengthen_a_later_wait(tray_env):
    """Rank 0 gives exchange 'a' up three times, then waits in 'c' for 2 s; the decisions of its old rounds of 'a'
    arrive meanwhile (rank 1 votes them late), each skipped as stale. Each restarted the wait's timeout: 'c' gave up
    after 2 s past the last of them, not 2 s after it began."""
    run = tray_env.launch(2, """
    with tray.init() as rank:
        if rank.rank == 0:
            for _ in range(3):
                try:
                    rank.exchange("a", 0, timeout_s=0.3)
                except tray.HandshakeError:
                    pass
            t0 = time.monotonic()
            try:
                rank.exchange("c", 0, timeout_s=2.0)
            except tray.HandshakeError:
                print(f"c gave up after {time.monotonic() - t0:.2f} s", flush=True)
        else:
            time.sleep(1.5)
            for i in range(3):
                assert rank.exchange("a", 1) == [0, 1]
                time.sleep(0.8)
            rank.exchange("c", 1)
        rank.barrier(timeout_s=30)
    """)
    assert run.returncode == 0, run.output
    waited = float(re.search(r"c gave up after ([0-9.]+) s", run.stdout).group(1))
    assert 2.0 <= waited < 3.0, run.output


def test_steps_in_the_same_order_are_not_taken_for_crossed_ones(tray_env):
    """Ranks that reach the same steps at different times (rank 2 late) are no deadlock, whatever else waits."""
    run = tray_env.launch(3, """
    with tray.init() as rank:
        for i in range(3):
            if rank.rank == 2:
                time.sleep(0.3)
            assert rank.exchange(f"s{i}", rank.rank) == [0, 1, 2]
            assert rank.exchange("t", i) == [i, i, i]
        print("steps ok", rank.rank, flush=True)
    """)
    assert run.returncode == 0, run.output
    assert run.stdout.count("steps ok") == 3


def test_the_collectives_join_is_named_as_the_program_started_it(tray_env):
    """A rank that skips its first collective: the others' wait names what they did, not tray's own topic."""
    run = tray_env.launch(2, """
    with tray.init() as rank:
        if rank.rank == 0:
            rank.collectives("world")
    """)
    assert run.returncode == 1, run.output
    assert "the join of the groups' collectives (a rank's first rank.collectives() or program collective op)" \
        in run.stderr, run.stderr
    assert "tray.collectives.join" not in run.stderr, run.stderr
    assert run.seconds < 15


def test_a_rank_holding_the_gil_is_busy_not_frozen_unless_it_uses_no_cpu(tray_env):
    """The heartbeat thread needs the GIL: a rank that holds it in a long C call sends none. Busy (a regex
    backtracking, a CPU used) it is watched, not failed; asleep in such a call (no CPU) it is failed at the
    timeout, the message saying how to give it longer."""
    busy = """
import math
import re
with tray.init() as rank:
    rank.barrier()
    if rank.rank == 0:
        t = time.perf_counter()
        re.match(r"(a+)+$", "a" * 16 + "b")   # each further "a" doubles the time: sized to 4-8 s on this machine
        n = 16 + max(0, math.ceil(math.log2(4.0 / max(time.perf_counter() - t, 1e-6))))
        re.match(r"(a+)+$", "a" * n + "b")   # seconds in C with the GIL held
    rank.barrier(timeout_s=120)
    print("ok", rank.rank)
"""
    run = tray_env.launch(2, busy, "--heartbeat-timeout-s", "2", timeout_s=120)
    assert run.returncode == 0, run.output
    assert "rank 0 has sent no heartbeat for" in run.stderr and "but keeps a CPU busy" in run.stderr, run.stderr
    asleep = """
import ctypes
with tray.init() as rank:
    rank.barrier()
    if rank.rank == 0:
        ctypes.PyDLL(None).sleep(30)   # asleep with the GIL held
    rank.barrier(timeout_s=60)
"""
    run = tray_env.launch(2, asleep, "--heartbeat-timeout-s", "2")
    assert run.returncode == 1, run.output
    assert "FAILED: rank 0" in run.stderr and "used no CPU meanwhile: stopped or frozen (or sleeping in a call that " \
        "holds the GIL: raise --heartbeat-timeout-s)" in run.stderr, run.stderr
    assert run.seconds < 20


@pytest.mark.parametrize("heartbeat", ["2", "default"])
def test_a_rank_busy_holding_the_gil_is_named_running_with_its_stack_when_a_barrier_gives_up(tray_env, heartbeat):
    """Also before the heartbeat's own window has judged it (the default timeout, longer than the barrier's): the
    verdict samples the rank's CPU then, and a rank holding the GIL writes its stack all the same."""
    body = """
import json
import re
def somewhere_busy():
    re.match(r"(a+)+$", "a" * 30 + "b")   # far longer than the barrier waits, the GIL held

with tray.init() as rank:
    if rank.rank == 1:
        somewhere_busy()
    rank.barrier(timeout_s=TIMEOUT)
"""
    if heartbeat == "default":  # judged only at the barrier's verdict, 1 s after the rank was late (1.5 s)
        run = tray_env.launch(2, body.replace("TIMEOUT", "2.5"), timeout_s=60)
    else:
        run = tray_env.launch(2, body.replace("TIMEOUT", "4"), "--heartbeat-timeout-s", heartbeat, timeout_s=60)
    assert run.returncode == 1, run.output
    assert "(busy in a call that holds the GIL: a CPU in use, no heartbeat): running but not where the others " \
        "wait for it" in run.stderr, run.stderr
    assert any(line.startswith("[rank 1]") and "in somewhere_busy" in line for line in run.stderr.splitlines()), \
        run.stderr


def test_a_twin_past_its_buffer_is_an_error_naming_it_not_a_silent_overwrite(tray_env):
    """A manifest buffer smaller than what a kernel's twin writes: in a rank, the twin's view is checked against the
    memory the backend mapped, so the launch fails saying so (it wrote past the buffer silently, or crashed)."""
    import json

    kernels = tray_env.tmp / "kernels"
    kernels.mkdir()
    (kernels / "fill.cu").write_text('extern "C" __global__ void my_fill(float* y, int count) {}\n')
    manifest = tray_env.tmp / "fill.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "fill", "vars": {"count": 256},
        "buffers": [{"name": "y", "dtype": "f32", "shape": ["count // 4"]}],   # a quarter of what fill writes
        "kernels": [{"name": "fill", "source": "kernels/fill.cu", "entry": "my_fill"}],
        "programs": [{"name": "go", "ops": [{"op": "launch", "kernel": "fill", "grid": 1, "block": 32,
                                              "args": ["y", "count"]}]}]}))
    body = """
from tray.twins import f32_at

@tray.twin("fill")
def fill(backend, grid, block, y_ptr, count):
    f32_at(y_ptr, count)[:] = 1.0

with tray.init() as rank:
    rank.run("go")
"""
    run = tray_env.launch(2, body, "--manifest", str(manifest))
    assert run.returncode == 1, run.output
    assert "UsageError: program 'go', op 0 (launch fill): a kernel twin reaches 1024 B at 0x" in run.stderr, run.stderr
    assert "0 B into buffer 'y' of 256 B" in run.stderr, run.stderr
    assert "a buffer in the manifest is smaller than what the kernel reads or writes there" in run.stderr


def test_a_twin_past_its_buffer_names_the_program_its_vars_and_the_op(tray_env):
    """vars given to run() that make a kernel write past its buffer: the error says which program, with which vars,
    and which op, eager and captured, on the rank's stream or a caller's (it named only the twin's address)."""
    import json

    kernels = tray_env.tmp / "kernels"
    kernels.mkdir()
    (kernels / "fill.cu").write_text('extern "C" __global__ void my_fill(float* y, int count) {}\n')
    manifest = tray_env.tmp / "fill.json"
    ops = [{"op": "barrier", "group": "world"},
           {"op": "launch", "kernel": "fill", "grid": 1, "block": 32, "args": ["y", "count"]}]
    manifest.write_text(json.dumps({
        "format": 1, "name": "fill", "vars": {"n": 64, "count": 64},
        "buffers": [{"name": "y", "dtype": "f32", "shape": ["n"]}],
        "kernels": [{"name": "fill", "source": "kernels/fill.cu", "entry": "my_fill"}],
        "programs": [{"name": "go", "ops": ops}, {"name": "cap", "graph": True, "ops": ops}]}))
    body = """
from tray.errors import UsageError
from tray.twins import f32_at

@tray.twin("fill")
def fill(backend, grid, block, y_ptr, count):
    f32_at(y_ptr, count)[:] = 1.0

with tray.init() as rank:
    for program in ("go", "cap"):
        for stream in (None, 0):
            rank.run(program, stream=stream)
            rank.run(program, vars={"count": 48}, stream=stream)
            try:
                rank.run(program, vars={"count": 300}, stream=stream)
            except UsageError as exc:
                print(f"rank {rank.rank} (stream {stream}): {exc}")
            else:
                raise SystemExit("no error")
"""
    run = tray_env.launch(2, body, "--manifest", str(manifest))
    assert run.returncode == 0, run.output
    for program in ("go", "cap"):
        for stream in (None, 0):
            assert f"rank 0 (stream {stream}): program '{program}' (count=300), op 1 (launch fill): a kernel twin " \
                "reaches 1200 B at 0x" in run.stdout, run.stdout


def test_a_twin_past_a_peers_buffer_is_an_error_naming_it(tray_env):
    """The same through a peer table: a peers kernel's twin writing past the end of a peer's exported buffer fails
    the launch naming the peer and the buffer, also when the overrun stays within the page the memfd was rounded to
    (it passed silently: a peer's mapping was judged by its page-rounded size, 4096 B for a buffer of 1024 B)."""
    import json

    kernels = tray_env.tmp / "kernels"
    kernels.mkdir()
    (kernels / "put.cu").write_text('extern "C" __global__ void my_put(unsigned long long* peers, int count) {}\n')
    manifest = tray_env.tmp / "put.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "put", "vars": {"count": 256},
        "buffers": [{"name": "inbox", "dtype": "u32", "shape": ["count // 2"], "export": True}],  # half of it
        "kernels": [{"name": "put", "source": "kernels/put.cu", "entry": "my_put", "peers": True}],
        "programs": [{"name": "go", "ops": [{"op": "launch", "kernel": "put", "grid": 1, "block": 32,
                                              "args": ["peers:inbox", "count"]}]}]}))
    body = """
from tray.twins import u32_at, u64_at

@tray.twin("put")
def put(backend, grid, block, peers_ptr, count):
    u32_at(int(u64_at(peers_ptr, 2)[1 - tray_rank]), count)[:] = 1

tray_rank = int(__import__("os").environ["TRAY_RANK"])
with tray.init() as rank:
    rank.run("go")
"""
    run = tray_env.launch(2, body, "--manifest", str(manifest))
    assert run.returncode == 1, run.output
    assert "UsageError: program 'go', op 0 (launch put): a kernel twin reaches 1024 B at 0x" in run.stderr, run.stderr
    assert "B into rank 1's buffer 'inbox' as mapped here of 512 B" in run.stderr or \
        "B into rank 0's buffer 'inbox' as mapped here of 512 B" in run.stderr, run.stderr


def test_a_twin_that_does_not_take_the_manifests_arguments_is_named_at_bind(tray_env):
    """The launch op passes two arguments, the twin takes three: a UsageError naming the kernel, the count and the
    twin's file and line, before anything runs; and a twin registered under a near name is suggested."""
    from tray.backend.host import HostBackend
    from tray.errors import UsageError
    from tray.twins import lookup, twin

    @twin("unit_scale")
    def unit_scale(backend, grid, block, y_ptr, count, factor):
        pass

    kernel = HostBackend(0).load_kernel("unit_scale", b"", "unit_scale", (), False)
    with pytest.raises(UsageError, match=r"kernel 'unit_scale': the manifest passes 2 arguments, which its host twin "
                                         r"'.*unit_scale' \(.*test_faults.py:\d+\) does not take"):
        kernel.bind((1, 1, 1), (32, 1, 1), [0, 4])
    kernel.bind((1, 1, 1), (32, 1, 1), [0, 4, 2.0])
    with pytest.raises(UsageError, match="did you mean 'unit_scale'"):
        lookup("unit_scal")


def test_a_flood_from_outside_the_tray_neither_stalls_nor_crashes_the_head_nor_gets_the_token(tray_env):
    """A process of this uid that is no rank writes to the head's socket: 3000 junk messages it never reads the
    answers to (the head once blocked for good on its full queue, its ranks left unreaped), one with a Unicode
    digit in its identity (it once crashed the head), one of 2 MiB. The tray runs on and ends 0; the head says the
    first rejections, then their count; the stranger is sent nothing (a Reject carries the token)."""
    run = tray_env.launch(2, """
    import threading
    import zmq
    got = []
    def flood():
        ctx = zmq.Context()
        socks = []
        for ident in (b"evil", "rank-\\u00b2".encode(), b"rank-\\xd9\\xa0"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, ident)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(os.environ["TRAY_RDZV"])
            socks.append(s)
        socks[1].send(b"\\x81\\xa1x\\x01")
        socks[2].send(b"\\x81\\xa1x\\x01")
        socks[0].send(b"y" * (2 << 20))
        for _ in range(3000):
            socks[0].send(b"x")
        time.sleep(1.0)
        got.extend(s.recv(zmq.NOBLOCK) for s in socks if s.poll(0))
        for s in socks:
            s.close()
        ctx.term()
    with tray.init() as rank:
        if rank.rank == 0:
            t = threading.Thread(target=flood)
            t.start()
            t.join()
            print("stranger got", len(got), flush=True)
        for i in range(3):
            assert rank.exchange("after", i) == [i, i]
        print("tray ok", rank.rank, flush=True)
    """, timeout_s=90)
    assert run.returncode == 0, run.output
    assert "stranger got 0" in run.stdout and run.stdout.count("tray ok") == 2, run.output
    assert "further rejected messages are counted, not shown (20 shown)" in run.stderr, run.stderr
    assert re.search(r"tray: \d+ messages to the head's socket were rejected in all \(the first 20 said\)",
                     run.stderr), run.stderr
    assert "Traceback" not in run.stderr and run.stderr.count("rejected a message from") == 20, run.stderr


def test_tray_s_own_step_topics_are_refused_to_exchange(tray_env):
    run = tray_env.launch(1, """
    with tray.init() as rank:
        for topic in ("tray:group:world@\\u00b2:x", "tray.park"):
            try:
                rank.exchange(topic, 1)
            except tray.UsageError as exc:
                print("refused:", exc, flush=True)
        assert rank.exchange("mine", 1) == [1]
        assert rank.exchange("endless", 2, timeout_s=float("inf")) == [2]   # a wait without end still votes
        try:
            rank.exchange("nan", 3, timeout_s=float("nan"))
        except tray.UsageError as exc:
            print("refused:", exc, flush=True)
    """)
    assert run.returncode == 0, run.output
    assert run.stdout.count("are tray's own steps; choose another topic") == 2, run.output
    assert "refused: exchange('nan'): timeout_s must be a number of seconds > 0 (inf: no end), got float nan" in \
        run.stdout


def test_a_manifest_a_rank_cannot_load_is_a_usage_error_in_one_line(tray_env, tmp_path):
    """tray.init(manifest=FILE) with a mistake in FILE: exit 2 and the message, as `--manifest FILE` gives, not exit
    1 and a traceback through tray's loader."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 1, "name": "x", "buffers": [{"name": "a", "dtype": "float32", "shape": [4]}]}))
    run = tray_env.launch(2, f"""
    with tray.init(manifest={str(bad)!r}) as rank:
        pass
    """)
    assert run.returncode == 2, run.output
    assert re.search(r"FAILED: rank [01] reported ManifestError: .*bad\.json: \$\.buffers\[0\]\.dtype: unknown dtype "
                     r"'float32'.*did you mean 'f32'\?", run.stderr), run.stderr
    assert "Traceback" not in run.stderr and "error report" not in run.stderr, run.stderr


def test_a_tray_init_called_with_a_bad_timeout_is_a_usage_error_in_one_line(tray_env):
    """tray.init(timeout_s=0) fails before the rank's first message to the head: still exit 2 and the message, as
    for every tray.init() called wrongly (README, docs/api.md), not exit 1 and the rank's traceback."""
    run = tray_env.launch(2, """
    tray.init(timeout_s=0)
    """)
    assert run.returncode == 2, run.output
    assert re.search(r"FAILED: rank [01] reported UsageError: tray\.init\(\): timeout_s must be a number of seconds "
                     r"> 0 \(inf: no end\), got int 0$", run.stderr, re.M), run.stderr
    assert "Traceback" not in run.stderr and "exited with code 1" not in run.stderr, run.stderr
    run = tray_env.launch(2, """
    from tray.errors import UsageError
    try:
        tray.init(timeout_s=0)
    except UsageError:
        pass
    with tray.init() as rank:
        rank.barrier(timeout_s=30)
        if rank.rank == 1:
            os._exit(5)
        time.sleep(30)
    """)  # refused, then called right: a later death of the rank is its own, not that usage error
    assert run.returncode == 1, run.output
    assert re.search(r"FAILED: rank 1 \(pid \d+\) exited with code 5", run.stderr), run.stderr
    assert "timeout_s=0" not in run.stderr, run.stderr


def test_what_a_closed_rank_and_bad_exchange_values_say(tray_env):
    """Found checking docs/api.md by use: kernel() and group() worked after close(); a value msgpack cannot carry,
    or one over a message, was a WireError (a HandshakeError, whose meaning is a tray that cannot form)."""
    run = tray_env.launch(1, """
    with tray.init() as rank:
        for value in (np.int64(3), {1: 2}, b"x" * 2_000_000):
            try:
                rank.exchange("v", value)
            except tray.UsageError as exc:
                print("usage:", str(exc)[:60], flush=True)
    for call in (lambda: rank.group("world"), lambda: rank.kernel("k")):
        try:
            call()
        except tray.UsageError as exc:
            print("closed:", exc, flush=True)
    """)
    assert run.returncode == 0, run.output
    assert run.stdout.count("usage: exchange('v'): its value cannot be sent") == 3, run.output
    assert run.stdout.count("closed:") == 2, run.output


def test_a_step_made_while_another_thread_of_the_rank_waits_in_one_is_refused_at_once(tray_env):
    """Rank 0's thread waits in exchange 'a' (rank 1 comes later) while its main thread makes exchange 'b': the two
    shared the rank's one connection to the head, each skipping the other's decision as stale, and both waited out
    their timeouts, naming the head's report (which had nothing to say). The second step is refused at once; made
    after the first, it runs."""
    run = tray_env.launch(2, """
    import threading
    with tray.init() as rank:
        if rank.rank == 0:
            got = {}
            waiter = threading.Thread(target=lambda: got.update(a=rank.exchange("a", 1, timeout_s=10)))
            waiter.start()
            time.sleep(0.5)
            try:
                rank.exchange("b", 2, timeout_s=3)
            except tray.UsageError as exc:
                print("refused:", exc, flush=True)
            waiter.join()
            print("a:", got.get("a"), flush=True)
        else:
            time.sleep(1.5)
            rank.exchange("a", 1)
        print("b:", rank.exchange("b", 2, timeout_s=10), flush=True)
    """, timeout_s=60)
    assert run.returncode == 0, run.output
    assert "refused: rank 0: exchange 'b' in thread 'MainThread' while thread " in run.stdout, run.output
    assert "waits in exchange 'a': a rank's tray-wide steps" in run.stdout, run.output
    assert "a: [1, 1]" in run.stdout and run.stdout.count("b: [2, 2]") == 2, run.output


WAITER = """
import signal, threading
said = []


def wait(rank, t0):
    try:
        rank.exchange("a", 1, timeout_s=30)
        said.append("waiter: decided")
    except BaseException as exc:
        said.append(f"waiter: {type(exc).__name__} {time.monotonic() - t0[0]:.2f} s after the close began: {exc}")


t0 = [0.0]
waiter = threading.Thread(target=wait, args=(rank, t0), name="waiter", daemon=True)
"""


def test_an_error_leaving_the_with_block_while_another_thread_waits_in_a_step_is_the_root_cause(tray_env):
    """Rank 0's thread waits in exchange 'a' (rank 1 never comes) while its main thread leaves the `with` block with an
    exception: the error report and the close used the rank's one connection to the head beside the waiting thread's
    poll (ZeroMQ sockets are not thread-safe), and the socket closed under it ended the wait with "Socket operation on
    non-socket" (or worse). The waiting step ends first, at once, with a UsageError saying why; the report is the
    root cause."""
    run = tray_env.launch(2, """
    rank = tray.init()
    """ + WAITER.replace("\n", "\n    ") + """
    if rank.rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 ends on its own, once it said how its waiter ended
    try:
        with rank:
            if rank.rank == 0:
                waiter.start()
                time.sleep(0.5)
                t0[0] = time.monotonic()
                raise ValueError("boom")
            rank.barrier(timeout_s=30)
    finally:
        if rank.rank == 0:
            waiter.join(10)
            print(*(said or ["waiter: still waiting"]), flush=True)
    """, timeout_s=60)
    assert run.returncode == 1, run.output
    first = [ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED")]
    assert first == ["tray: FAILED: rank 0 reported ValueError: boom"], run.stderr
    said = re.search(r"waiter: (\w+) ([0-9.]+) s after the close began: (.*)", run.stdout)
    assert said and said[1] == "UsageError", run.output
    assert said[3].startswith("rank 0: exchange 'a' in thread 'waiter' ended unanswered: thread 'MainThread' is "
                              "closing the rank's tray"), run.output
    assert float(said[2]) < 1.0, run.output
    assert run.seconds < 15


def test_a_rank_closing_while_another_thread_waits_in_a_step_says_bye_and_ends_that_step(tray_env):
    """Rank 0's thread waits in exchange 'a' while its main thread ends the `with` block: the bye and the close no
    longer share the socket with the waiting thread, which ends at once with a UsageError saying why. The head got
    the bye: it names rank 0 as having closed its tray when rank 1 then waits in a step rank 0 never joins (rank 0's
    process still alive)."""
    run = tray_env.launch(2, """
    rank = tray.init()
    """ + WAITER.replace("\n", "\n    ") + """
    with rank:
        if rank.rank == 0:
            waiter.start()
            time.sleep(0.5)
            t0[0] = time.monotonic()
        else:
            time.sleep(1.5)
            print("a:", rank.exchange("a", 1, timeout_s=30), flush=True)
            rank.exchange("b", 2, timeout_s=30)
    if rank.rank == 0:
        waiter.join(10)
        print(*(said or ["waiter: still waiting"]), flush=True)
        time.sleep(30)
    """, timeout_s=60)
    assert run.returncode == 1, run.output
    assert "a: [1, 1]" in run.stdout, run.output
    said = re.search(r"waiter: (\w+) ([0-9.]+) s after the close began: (.*)", run.stdout)
    assert said and said[1] == "UsageError", run.output
    assert said[3].startswith("rank 0: exchange 'a' in thread 'waiter' ended unanswered: thread 'MainThread' is "
                              "closing the rank's tray"), run.output
    assert float(said[2]) < 1.0, run.output
    assert re.search(r"FAILED: rank 0 \(pid \d+\) closed its tray .*exchange 'b'", run.stderr), run.stderr
    assert run.seconds < 15


def test_a_rank_whose_own_start_up_wait_runs_out_first_is_a_tray_that_did_not_form(tray_env):
    """tray.init(timeout_s=2) shorter than the head's --timeout-s, a peer late: exit 3 as when the head's deadline
    passes (it was 1); and a timeout that is no number of seconds is a UsageError at once."""
    run = tray_env.launch(2, """
    if os.environ["TRAY_RANK"] == "1":
        time.sleep(30)
    tray.init(timeout_s=2.0)
    """, "--timeout-s", "20", timeout_s=60)
    assert run.returncode == 3, run.output
    assert "rank 0 reported HandshakeError" in run.stderr, run.stderr
    run = tray_env.launch(1, """
    try:
        tray.init(timeout_s=-1)
    except tray.UsageError as exc:
        print("refused:", exc, flush=True)
    """)
    assert "refused: tray.init(): timeout_s must be a number of seconds > 0 (inf: no end), got int -1" in run.stdout, \
        run.output


def test_ranks_waiting_for_one_another_in_a_barrier_and_a_collective_are_named_so(tray_env):
    """Rank 0 makes a collective the others never make, and they go on to a barrier: each side waits for the other.
    The verdict says the rank waited for was itself waiting for the reporter, so neither could end: a program whose
    ranks made different calls, not a slow rank."""
    run = tray_env.launch(4, """
    with tray.init() as rank:
        c = rank.collectives("world")
        x = rank.buffer("x")
        if rank.rank == 0:
            c.allreduce(x.ptr, x.ptr, 16, "f32")
        rank.barrier()
    """, "--manifest", str(MANIFESTS / "program_smoke.json"), "--barrier-timeout-s", "2", timeout_s=60)
    assert run.returncode == 1, run.output
    verdict = run.stderr.split("tray: FAILED: ", 1)[1].split("\\ntray: stopping", 1)[0]
    assert "BarrierTimeout" in verdict.splitlines()[0], verdict
    # whichever side timed out first is the verdict; the other side's wait is under it
    assert "was itself waiting, and reported BarrierTimeout: barrier world " in verdict, verdict
    assert verdict.count("(in allreduce)") >= 1, verdict
    assert "so these ranks waited for one another in different operations, none of which can end" in verdict, verdict
    assert run.seconds < 20


@pytest.mark.parametrize("sig,restarts", [(signal.SIGINT, 0), (signal.SIGTERM, 0), (signal.SIGTERM, 2)])
def test_a_signal_during_the_teardown_of_a_failed_tray_keeps_its_root_cause(tray_env, sig, restarts):
    """Rank 1 fails; rank 0 ignores SIGTERM, so the teardown waits out its grace; a Ctrl-C (or Slurm's SIGTERM) to
    the head meanwhile still gets the whole root cause, and the failure's exit code; and no restart follows (it
    did, attempt after attempt, under --max-restarts)."""
    cmd = tray_env.command(2, """
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 1:
            raise RuntimeError("rank 1 fails")
        time.sleep(60)
    """, "--max-restarts", str(restarts))
    head, err, reader = _head_until_its_teardown(tray_env, cmd)
    try:
        head.send_signal(sig)
        assert head.wait(timeout=30) == 1, "".join(err)
    finally:
        if head.poll() is None:
            head.kill()
        reader.join(timeout=10)
        head.stdout.close()
        head.stderr.close()
    text = "".join(err)
    assert f"tray: {signal.Signals(sig).name} during the teardown of a tray that had failed before it" in text, text
    assert "RuntimeError: rank 1 fails" in text.split("failed before it", 1)[1], text
    assert "tray: interrupted" not in text, text
    assert text.count("FAILED:") == 1 and "restarting" not in text, text
    if restarts:
        assert "and SIGTERM came meanwhile: no restart" in text, text


def test_a_rank_interrupted_alone_is_named_interrupted_not_leaving(tray_env):
    """SIGINT to one rank (not to the tray): its KeyboardInterrupt left the `with` block, which sent the head a bye,
    and the verdict said it "closed its tray" while rank 0 waited in an exchange. It is named killed by SIGINT."""
    run = tray_env.launch(2, """
    import signal
    with tray.init() as rank:
        if rank.rank == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        rank.exchange("x", rank.rank)
    """)
    assert run.returncode == 1, run.output
    cause = next(ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED"))
    assert "rank 1" in cause and "SIGINT" in cause and "closed its tray" not in cause, run.stderr


def test_a_slow_rank_that_waits_after_its_peer_gave_up_is_no_mismatch(tray_env):
    """Rank 1 is only slow: it comes to barrier 2 after rank 0 gave it up, passes it (rank 0's flag is there) and
    times out in barrier 3, waiting for rank 0, which has left. Its report comes while the head reads the missed
    ranks' reports, but its wait began after rank 0 gave up: no "waited for one another" note."""
    run = tray_env.launch(2, """
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 1:
            time.sleep(0.25)
        for i in range(3):
            rank.barrier(timeout_s=0.2)
    """)
    assert run.returncode == 1, run.output
    assert "waited for one another" not in run.stderr, run.stderr


def test_a_killed_head_leaves_a_tray_its_rank_launched_to_that_trays_watchdog(tray_env):
    """A rank launches a tray of its own (its head in a session of its own), whose ranks start children in sessions
    of their own. The outer head killed: the outer watchdog kills what names the outer job dir, the inner head among
    them; the inner watchdog, which must not name it, then kills the inner ranks' children and removes the inner job
    dir (it was killed too, and both were left)."""
    inner = tray_env.script("""
    import subprocess
    with tray.init() as rank:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]],
                                 start_new_session=True)
        print("inner-up", child.pid, flush=True)
        time.sleep(600)
    """)
    cmd = tray_env.command(1, f"""
    import subprocess
    with tray.init() as rank:
        subprocess.Popen([sys.executable, "-m", "tray", "launch", "-q", "-n", "2", "--backend", "host", "--",
                          sys.executable, {str(inner)!r}, sys.argv[1]], start_new_session=True)
        time.sleep(600)
    """)
    _kill_head_then_check_gone(tray_env, cmd, "inner-up", 2, wait_s=8)


def test_a_rank_that_exited_0_is_said_gone_not_dead_in_a_barriers_verdict(tray_env):
    """The rank a barrier missed had ended well (exit 0, its tray never closed): the verdict's note says it is gone,
    not "dead"."""
    run = tray_env.launch(2, """
    with tray.init() as rank:
        if rank.rank == 1:
            os._exit(0)
        rank.barrier(timeout_s=1.5)
    """, timeout_s=60)
    assert run.returncode == 1, run.output
    assert re.search(r"rank 1 exited with code 0 \(last phase: \w+\): gone, not slow", run.stderr), run.stderr
    assert "dead, not slow" not in run.stderr, run.stderr


def test_a_child_forked_after_init_gets_a_usage_error_and_its_error_is_not_the_ranks(tray_env):
    """A worker the rank forks after tray.init() (a DataLoader's, a fork Pool's) that calls tray: its barrier bumped
    the peers' flags as if the rank had entered (it returned at once, the peers' next barrier passing unsynchronised),
    its exchange spun forever on the rank's head socket, and an exception leaving the `with` block in it wrote the
    rank's error file (a later death of the rank was reported with the worker's traceback). Now a UsageError at once,
    and the worker's exception stays its own."""
    run = tray_env.launch(2, """
    with tray.init() as rank:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            os.close(r)
            said = []
            for call in (lambda: rank.barrier(timeout_s=1.0), lambda: rank.exchange("worker", 1, timeout_s=1.0)):
                try:
                    call()
                    said.append("returned")
                    break  # an exchange after a barrier that returned would wait forever
                except tray.TrayError as exc:
                    said.append(f"{type(exc).__name__}: {exc}")
            os.write(w, "\\n".join(said).encode())
            raise RuntimeError("the worker's own error")  # leaves the with block in the worker
        os.close(w)
        said = b""
        while chunk := os.read(r, 65536):
            said += chunk
        os.waitpid(pid, 0)
        for line in said.decode().splitlines():
            print("worker:", line, flush=True)
        rank.barrier()
        if rank.rank == 1:
            os._exit(3)
        rank.barrier(timeout_s=30)
    """, timeout_s=30)
    assert run.returncode == 1, run.output
    worker = [ln for ln in run.stdout.splitlines() if "worker:" in ln]
    assert len(worker) == 4, run.output
    for line in worker:
        assert "UsageError: " in line and "forked after tray.init()" in line, line
    assert any("barrier('world') in process" in ln for ln in worker)
    assert any("exchange('worker') in process" in ln for ln in worker)
    assert "tray: FAILED: rank 1 (pid" in run.stderr and "exited with code 3" in run.stderr, run.stderr
    # the rank's death has no error report (the worker's traceback is only among the rank's last lines, as it printed)
    assert "tray: error report:" not in run.stderr and "reported to the head" not in run.output, run.stderr
    assert run.seconds < 10


def test_a_step_that_times_out_while_the_head_is_stopped_says_so(tray_env):
    """The head stopped (Ctrl-Z, SIGSTOP) while a rank waits in a step: the rank's timeout said the head waits for
    every rank and reports who is missing, which a stopped head does not; it now says the head is stopped."""
    body = """
    import signal
    with tray.init() as rank:
        head = os.getppid()
        os.kill(head, signal.SIGSTOP)
        try:
            rank.exchange("x", 1, timeout_s=1.0)
        except tray.HandshakeError as exc:
            print("said:", exc, flush=True)
        finally:
            os.kill(head, signal.SIGCONT)
    """
    run = tray_env.launch(1, body, timeout_s=30)
    assert run.returncode == 0, run.output
    assert re.search(r"no decision on exchange 'x' from the head within 1\.0 s \(the head, pid [0-9]+, is stopped",
                     run.stdout), run.output


@pytest.mark.parametrize("limit", [16, 18])
def test_a_rank_that_lowered_its_open_file_limit_is_told_so(tray_env, limit):
    """A program that lowers its own open-file limit before tray.init(): a raw "OSError: [Errno 24] Too many open files"
    from the rank, or every rank waiting 30 s on a peer whose fd socket could no longer accept. Now the first failure
    names the limit, within seconds."""
    run = tray_env.launch(4, f"""
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
    with tray.init() as rank:
        rank.barrier()
    """, timeout_s=60)
    # 2: tray.init() could not open what it needs (a SetupError); 3: a rank could not take in its peers' fds (the
    # handshake failed); 1: a rank's error otherwise. Which comes first depends on how the ranks interleave.
    assert run.returncode in (1, 2, 3), run.output
    cause = run.stderr.split("tray: FAILED: ", 1)[1]
    assert f"open-file limit is {limit}" in cause, run.output   # the verdict, or the report under it
    assert "OSError: [Errno 24]" not in run.stderr and run.seconds < 20, run.output


def test_a_rank_that_reported_its_exception_is_let_end_by_itself_and_said_so(tray_env):
    """The rank whose report was the root cause got the head's SIGTERM with the others while it was on its way out,
    and its end was said as "killed by SIGTERM" (docs: "exit 1"). It is given up to a second to end by itself."""
    run = tray_env.launch(2, """
    with tray.init() as rank:
        if rank.rank == 0:
            raise ValueError("boom")
        time.sleep(30)
    """, timeout_s=60)
    assert run.returncode == 1, run.output
    assert "after teardown: rank 0 (the root cause): exit 1; rank 1: killed by SIGTERM" in run.stderr, run.stderr
    assert run.seconds < 15, run.seconds
