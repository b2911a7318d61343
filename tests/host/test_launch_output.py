"""What `tray launch` prints and keeps: quiet mode, torchrun's --redirects (for every rank or per rank) and
--local-ranks-filter, stamped log files that hold a failed rank's report, one traceback per failure, a slow
rank named slow."""

from __future__ import annotations

import re


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


def test_a_slow_rank_is_named_slow_not_dead(tray_env):
    body = """
    with tray.init() as rank:
        if rank.rank == 1:
            time.sleep(2.0)   # alive and heartbeating, just late
        rank.barrier()
    """
    run = tray_env.launch(2, body, "--barrier-timeout-s", "0.5")
    assert run.returncode == 1, run.output
    assert "waited 0.50 s for rank 1" in run.stderr
    assert re.search(r"rank 1 is alive, last heartbeat [0-9.]+ s ago, phase running: slow, not dead", run.stderr)


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
