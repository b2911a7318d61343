"""Launch options without a tray: output routing, rank filters, the GPU check, oversubscription, barrier
timeouts (flag, env, manifest), and what the head reads from a BarrierTimeout."""

from __future__ import annotations

import datetime
import json
import os
import sys

import pytest

from tray.cli import build_parser, main
from tray.envvars import share_gpus
from tray.errors import BarrierTimeout, ManifestError, UsageError
from tray.launch.output import BOTH, STDERR, STDOUT, Routing, check_streams, parse_ranks_filter, parse_streams, stamp
from tray.launch.pick import (
    backend_and_nprocs,
    check_gpus,
    devices_for,
    rank_devices,
    shared_note,
    warn_if_oversubscribed,
)
from tray.manifest.load import parse_manifest
from tray.rank.env import RankEnv


def test_routing_as_torchrun():
    plain = Routing()
    assert plain.to_terminal(0, STDOUT) and not plain.to_log(0, STDOUT)
    logged = Routing(log_dir="d")  # --log-dir alone: both streams to the file and the terminal
    assert logged.to_log(0, STDOUT) and logged.to_log(1, STDERR) and logged.to_terminal(1, STDERR)
    redirected = Routing(log_dir="d", redirects=STDERR)
    assert redirected.to_log(0, STDERR) and not redirected.to_terminal(0, STDERR)
    assert redirected.to_terminal(0, STDOUT) and not redirected.to_log(0, STDOUT)
    teed = Routing(log_dir="d", tee=STDOUT)
    assert teed.to_log(0, STDOUT) and teed.to_terminal(0, STDOUT) and not teed.to_log(0, STDERR)
    filtered = Routing(log_dir="d", ranks=(0,))
    assert filtered.to_terminal(0, STDOUT) and not filtered.to_terminal(1, STDOUT) and filtered.to_log(1, STDOUT)
    assert not Routing(quiet=True).to_terminal(0, STDOUT)
    both = Routing(log_dir="d", redirects=BOTH, tee=STDOUT)   # torchrun -r 3 -t 1: stdout on the terminal too
    assert both.to_terminal(0, STDOUT) and both.to_log(0, STDOUT) and both.to_log(0, STDERR)
    assert not both.to_terminal(0, STDERR)
    with pytest.raises(UsageError, match="--redirects needs --log-dir"):
        Routing(redirects=BOTH)


def test_routing_per_local_rank():
    # node 1 of a job with 2 ranks per node: global ranks 2, 3 are local ranks 0, 1
    routing = Routing(log_dir="d", redirects=(BOTH, 0), tee=(0, STDERR), rank_base=2)
    assert routing.to_log(2, STDOUT) and routing.to_log(2, STDERR)  # local 0: --redirects 3, the file only
    assert not routing.to_terminal(2, STDOUT) and not routing.to_terminal(2, STDERR)
    assert routing.to_log(3, STDERR) and routing.to_terminal(3, STDERR)  # local 1: --tee 2
    assert not routing.to_log(3, STDOUT) and routing.to_terminal(3, STDOUT)
    unnamed = Routing(log_dir="d", redirects=(STDOUT, 0))  # a rank given 0 in both: as --log-dir alone
    assert unnamed.to_log(1, STDOUT) and unnamed.to_log(1, STDERR) and unnamed.to_terminal(1, STDOUT)
    with pytest.raises(UsageError, match="--tee needs --log-dir"):
        Routing(tee=(0, STDOUT))
    Routing(tee=(0, 0), redirects=(0, 0))  # all zero: nothing asked of the files


def test_the_log_dir_example_of_the_help_and_docs_shows_rank_0_on_the_terminal():
    from conftest import REPO

    from tray.cli import LAUNCH_EPILOG

    line = next(x for x in LAUNCH_EPILOG.splitlines() if "--local-ranks-filter 0" in x).split()
    assert f"$ {' '.join(line)}" in (REPO / "docs" / "cli.md").read_text()  # the same example in both
    args = build_parser().parse_args(line[1:])
    n = args.nprocs
    routing = Routing(log_dir=args.log_dir, tee=parse_streams("--tee", args.tee, n),
                      redirects=parse_streams("--redirects", args.redirects, n),
                      ranks=parse_ranks_filter(args.local_ranks_filter, n))
    assert routing.to_terminal(0, STDOUT) and routing.to_terminal(0, STDERR)  # "rank 0 on the terminal"
    assert not any(routing.to_terminal(r, s) for r in range(1, n) for s in (STDOUT, STDERR))
    assert all(routing.to_log(r, s) for r in range(n) for s in (STDOUT, STDERR))


def test_streams_for_every_rank_or_per_local_rank():
    assert parse_streams("--tee", "3", 4) == 3
    assert parse_streams("--redirects", "0:3,1:2", 4) == (3, 2, 0, 0)
    assert parse_streams("--redirects", " 2:1 , 0:0", 3) == (0, 0, 1)


@pytest.mark.parametrize("text, message", [
    ("4", "--redirects expects 0 (none), 1 (stdout), 2 (stderr) or 3 (both), got 4"),
    ("all", "--redirects expects 0 (none), 1 (stdout), 2 (stderr) or 3 (both) for every rank, or "
            "LOCAL_RANK:VALUE,... like 0:3,1:2; got 'all'"),
    ("0:3,1:4", "--redirects 0:3,1:4: local rank 1 is given 4; values are 0 (none)"),
    ("0:-1", "--redirects 0:-1: local rank 0 is given -1; values are"),
    ("2:3", "--redirects 2:3: local rank 2 is not one of 0..1 (-n 2)"),
    ("-1:3", "--redirects -1:3: local rank -1 is not one of 0..1 (-n 2)"),
    ("0:3,0:1", "--redirects 0:3,0:1: local rank 0 is listed twice"),
    ("0:3,1", "LOCAL_RANK:VALUE,... like 0:3,1:2; got item '1' in '0:3,1'"),
    ("0:3,", "got item '' in '0:3,'"),
    ("0:3:1", "got item '0:3:1' in '0:3:1'"),
    ("a:3", "got item 'a:3' in 'a:3'"),
])
def test_bad_streams_are_one_line_usage_errors(text, message):
    with pytest.raises(UsageError) as err:
        parse_streams("--redirects", text, 2)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_stream_numbers_and_rank_filters():
    assert check_streams("--tee", 3) == 3
    with pytest.raises(UsageError, match="0 \\(none\\), 1 \\(stdout\\), 2 \\(stderr\\) or 3 \\(both\\), got 4"):
        check_streams("--tee", 4)
    assert parse_ranks_filter("2, 0", 4) == (0, 2)
    assert parse_ranks_filter(None, 4) is None
    with pytest.raises(UsageError, match="ranks are 0..3 with -n 4"):
        parse_ranks_filter("4", 4)
    with pytest.raises(UsageError, match="comma-separated ranks"):
        parse_ranks_filter("a,b", 4)


def test_log_stamps_are_iso_with_milliseconds():
    assert stamp(datetime.datetime(2026, 11, 30, 13, 21, 5, 123456)) == "2026-11-30T13:21:05.123"


def test_gpu_count_checked_before_spawning():
    check_gpus(2, 2, None)
    check_gpus(None, 4, None)
    with pytest.raises(UsageError, match=r"-n 3 needs 3 GPUs \(one per rank\), 2 visible "
                                         r"\(CUDA_VISIBLE_DEVICES='0,1'\); use -n 2 or fewer"):
        check_gpus(3, 2, "0,1")
    with pytest.raises(UsageError, match="no GPU is visible; use --backend host"):
        check_gpus(None, 0, None)
    with pytest.raises(UsageError, match=r"or --share-gpus \(ranks take turns on a GPU: for checking a program's "):
        check_gpus(3, 2, None)


def test_shared_gpus_place_rank_r_on_gpu_r_mod_g():
    check_gpus(4, 1, None, share=True)  # any number of ranks fits
    with pytest.raises(UsageError, match="no GPU is visible"):
        check_gpus(4, 0, None, share=True)
    assert rank_devices(4, 1) == [0, 0, 0, 0]
    assert rank_devices(5, 2) == [0, 1, 0, 1, 0]
    assert rank_devices(2, 4) == [0, 1]  # fewer ranks than GPUs: one each, as without sharing
    assert shared_note([0, 1]) is None
    note = shared_note([0, 1, 0, 1], rank_base=4)
    assert note is not None and note.startswith("--share-gpus: 4 ranks on 2 GPU(s) (GPU 0: ranks 4,6; GPU 1: ranks "
                                                "5,7)") and "timings mean nothing" in note


def test_share_gpus_from_the_flag_or_the_environment(monkeypatch):
    assert share_gpus(True, None) and not share_gpus(False, "1")  # the flag wins
    assert [share_gpus(None, v) for v in ("1", "true", "YES", "0", "", None, "no")] == [True] * 3 + [False] * 4
    with pytest.raises(UsageError, match=r"TRAY_SHARE_GPUS must be 1 \(ranks may share GPUs\) or 0, got 'maybe'"):
        share_gpus(None, "maybe")
    import tray.backend.cuda as cuda

    monkeypatch.setattr(cuda, "gpu_count", lambda: 1)
    monkeypatch.setenv("TRAY_SHARE_GPUS", "1")
    assert devices_for("cuda", 3, None) == [0, 0, 0]
    assert devices_for("cuda", 3, False) == [0, 1, 2]  # not shared: the GPU check refuses -n 3 before this
    assert devices_for("host", 3, True) == [0, 1, 2]  # no GPUs to share
    monkeypatch.delenv("TRAY_SHARE_GPUS")
    assert devices_for("cuda", 2, None) == [0, 1]


def test_a_wrong_share_gpus_variable_is_refused_on_the_host_backend_too(monkeypatch):
    """TRAY_SHARE_GPUS=maybe was read only where GPUs are shared: a host tray took it, the GPU host refused it."""
    monkeypatch.setenv("TRAY_SHARE_GPUS", "maybe")
    with pytest.raises(UsageError, match=r"TRAY_SHARE_GPUS must be 1 \(ranks may share GPUs\) or 0, got 'maybe'"):
        backend_and_nprocs("host", 2)
    assert backend_and_nprocs("host", 2, share=True) == ("host", 2)  # --share-gpus given: the variable is not read


def test_cuda_without_gpus_is_one_line_and_exit_2(capsys, monkeypatch):
    import tray.backend.cuda as cuda

    monkeypatch.setattr(cuda, "visible_gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert main(["launch", "-n", "3", "--backend", "cuda", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-n 3 needs 3 GPUs" in err and "CUDA_VISIBLE_DEVICES='0,1'" in err


def test_oversubscription_warns(capsys):
    assert not warn_if_oversubscribed(2, ncores=2)
    assert warn_if_oversubscribed(100, ncores=2)
    assert "100 ranks on 2 CPU cores" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("tray 0.")


@pytest.mark.parametrize("argv, message", [
    (["--tee", "1"], "--tee needs --log-dir"),
    (["--redirects", "5", "--log-dir", "d"], "--redirects expects 0 (none)"),
    (["--tee", "0:3,2:1", "-n", "2", "--log-dir", "d"], "--tee 0:3,2:1: local rank 2 is not one of 0..1 (-n 2)"),
    (["--redirects", "0:3", "-n", "2"], "--redirects needs --log-dir"),
    (["--local-ranks-filter", "7", "-n", "2"], "ranks are 0..1 with -n 2"),
    (["--barrier-timeout-s", "0"], "--barrier-timeout-s must be a number of seconds > 0"),
    (["--timeout-s", "-5"], "--timeout-s must be a number of seconds > 0, got -5.0"),
    (["--heartbeat-timeout-s", "0"], "--heartbeat-timeout-s must be a number of seconds > 0"),
    (["--heartbeat-timeout-s", "1.5"], "--heartbeat-timeout-s must be at least 2 s: ranks heartbeat every 0.5 s"),
    (["-n", "two"], "tray launch: argument -n/--nprocs/--nproc-per-node: expected a number of ranks (or gpu, auto, "
                    "cpu), got 'two'"),
    (["--bakend=host"], "unrecognized arguments: --bakend=host (did you mean --backend?)"),
    (["--manifest", ""], "the manifest's name is empty (--manifest ''); give a manifest file or a built-in name"),
    (["--log-dir", ""], "--log-dir needs a directory, got an empty one (an unset variable?)"),
    (["--log-dir", "", "--tee", "3"], "--log-dir needs a directory, got an empty one"),
])
def test_launch_refuses_bad_options_before_spawning(capsys, argv, message):
    try:
        code = main(["launch", "--backend", "host", *argv, "--", "false"])
    except SystemExit as stop:  # argparse's own checks end there, through the one-line error
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["gate", "peer-barrier", "-n", "1", "--drop", "0"], "tray: UsageError: --drop needs 2 ranks or more"),
    (["gate", "peer-barrier", "-n", "2", "--iters", "0"], "tray: UsageError: --iters and --replays must be 1 or more"),
    (["gate", "peer-barrier", "-n", "4", "--drop", "5"], "tray: UsageError: --drop 5 is not a rank of a 4-rank tray"),
    (["gate", "peer-barrier", "-n", "2", "--corrupt", "1"], "tray: UsageError: --corrupt 1 needs --stress"),
    (["gate", "peer-barrier", "-n", "2", "--stress", "--corrupt", "7"],
     "tray: UsageError: --corrupt 7 is not a rank of a 2-rank tray (0..1)"),
    (["bench", "ep-moe", "--tokenz", "3"], "tray bench ep-moe: unrecognized arguments: --tokenz (did you mean "
                                          "--tokens?) 3 (`tray bench ep-moe --help` lists the options)"),
    ([], "tray: UsageError: tray: the following arguments are required"),
    (["bench"], "tray: UsageError: tray bench: the following arguments are required: {ep-moe,tp,park}"),
    (["inspect", "ep_moe", "-n", "0"], "tray: UsageError: tray inspect -n 0: the number of ranks to resolve the "
                                       "manifest for is 1 to 1048576"),
    # a world past any job's: a tuple of every rank built (24 GB and the OOM killer), or an OverflowError's traceback
    (["inspect", "ep_moe", "-n", "1000000000"], "tray inspect -n 1000000000: the number of ranks to resolve the "
                                                "manifest for is 1 to 1048576"),
    (["inspect", "ep_moe", "-n", str(10 ** 30)], "the number of ranks to resolve the manifest for is 1 to 1048576"),
    # each ignored, the run then passing as though they had been taken
    (["gate", "peer-barrier", "-n", "2", "--stress", "--drop", "1"], "tray: UsageError: --drop and --stress are two "
                                                                      "gates"),
    (["gate", "peer-barrier", "-n", "2", "--replays", "3"], "tray: UsageError: --replays set the rounds of --stress"),
    (["gate", "peer-barrier", "-n", "2", "--skew-ns", "9"], "tray: UsageError: --skew-ns set the rounds of --stress"),
    (["bench", "tp", "-n", "2", "--hidden", "0"], "and --hidden (0) be a positive multiple of 8"),
    (["bench", "tp", "-n", "2", "--repeats", "0"], "tray: UsageError: --repeats must be at least 1, got 0"),
    # said as a var of the bench's manifest ('max_count', 'pages') the user never gave
    (["bench", "tp", "-n", "2", "--sizes", str(10 ** 30)], "--sizes are bytes per allreduce, at most 2**40"),
    (["bench", "park", "-n", "2", "--gib", "1e30"], "--gib: expected at most 1048576"),
    (["bench", "ep-moe", "-n", "2", "--ref-tokens", "-1"], "tray: UsageError: --ref-tokens is how many tokens"),
    (["bench", "ep-moe", "-n", "2", "--experts", "0"], "tray: UsageError: --experts 0 must be at least 1"),
    (["bench", "ep-moe", "-n", "2", "--expert-dim", "0"], "--expert-dim (0) must be at least 8"),
    # the report's path, checked before the run (it was after it, the results printed then the report lost)
    (["gate", "peer-barrier", "-n", "2", "--json", "/"], "tray: UsageError: --json / is a directory"),
    (["gate", "peer-barrier", "-n", "2", "--json", ""], "tray: UsageError: --json needs a file path"),
    (["bench", "tp", "-n", "2", "--json", "/dev/null/r.json"], "tray: UsageError: --json /dev/null/r.json: "),
    (["bench", "ep-moe", "-n", "2", "--json", "/"], "tray: UsageError: --json / is a directory"),
    (["bench", "park", "-n", "2", "--json", "/"], "tray: UsageError: --json / is a directory"),
])
def test_other_commands_refuse_bad_options_in_one_line(capsys, argv, message):
    try:
        code = main([*argv, "--backend", "host"] if argv[:1] == ["gate"] else argv)
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["bench", "tp", "-n", "1"], "tray: UsageError: tp compares a TP group of the ranks of a node with one rank: -n / "
                                 "--nnodes must be at least 2, got -n 1 over 1 node(s)"),
    (["bench", "ep-moe", "-n", "3"], "tray: UsageError: --experts 16 must be at least 1 and divide over 3 "
                                      "ranks"),
])
def test_a_bench_refusing_its_options_says_nothing_of_its_defaults_first(capsys, argv, message):
    """The host backend's benches print the defaults they take; a run refused at once printed them before the error,
    as if it were about to run."""
    assert main([*argv, "--backend", "host"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == message + "\n", (out, err)


def test_barrier_timeout_from_env():
    base = {"TRAY_RANK": "0", "TRAY_WORLD_SIZE": "1", "TRAY_RDZV": "ipc://x", "TRAY_JOB": "/j", "TRAY_TOKEN": "t",
            "TRAY_BACKEND": "host"}
    assert RankEnv.from_environ(base).barrier_timeout_s is None
    assert RankEnv.from_environ({**base, "TRAY_BARRIER_TIMEOUT_S": "7.5"}).barrier_timeout_s == 7.5
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(UsageError, match="TRAY_BARRIER_TIMEOUT_S must be a number of seconds > 0"):
            RankEnv.from_environ({**base, "TRAY_BARRIER_TIMEOUT_S": bad})


def test_manifest_barrier_timeout(tmp_path):
    doc = {"format": 1, "name": "m"}
    assert parse_manifest(doc, "m.json", str(tmp_path)).barrier_timeout_s is None
    assert parse_manifest({**doc, "barrier_timeout_s": 30}, "m.json", str(tmp_path)).barrier_timeout_s == 30.0
    with pytest.raises(ManifestError, match=r"\$\.barrier_timeout_s: expected a number of seconds > 0, got 0"):
        parse_manifest({**doc, "barrier_timeout_s": 0}, "m.json", str(tmp_path))
    with pytest.raises(ManifestError, match=r"\$\.barrier_timeout_s"):
        parse_manifest(json.loads('{"format": 1, "name": "m", "barrier_timeout_s": "2"}'), "m.json", str(tmp_path))


def test_head_reads_missing_ranks_from_a_barrier_timeout():
    err = BarrierTimeout("world", 3, 0, [2, 5], 2.0)
    assert BarrierTimeout.missing_in(str(err)) == [2, 5]
    assert BarrierTimeout.missing_in("ValueError: boom") == []
    assert BarrierTimeout.waited_in(str(err)) == 2.0


def test_a_report_that_only_looks_like_a_barrier_timeout_is_none():
    """A rank's error message is its own text: a rank number of 5000 digits (int() refuses it) or a time that is no
    number reads as no barrier timeout, instead of raising in the head or the root."""
    huge = "1" * 5000
    assert BarrierTimeout.missing_in(f"waited 1.00 s for rank {huge}") == []
    assert BarrierTimeout.waited_in("waited 1.2.3 s for rank 0") is None
    assert BarrierTimeout.waited_in("waited . s for rank 0") is None


def test_the_command_line_takes_share_gpus_or_the_variable(monkeypatch, capsys):
    import tray.backend.cuda as cuda
    from tray.cli import _backend_and_n

    monkeypatch.setattr(cuda, "gpu_count", lambda: 1)
    monkeypatch.delenv("TRAY_SHARE_GPUS", raising=False)
    assert build_parser("launch").parse_args(["launch", "--share-gpus", "-n", "4", "p.py"]).share_gpus is True
    assert build_parser("launch").parse_args(["launch", "-n", "4", "p.py"]).share_gpus is None  # the variable decides
    assert _backend_and_n("cuda", 4, True) == ("cuda", 4)
    with pytest.raises(UsageError, match="-n 4 needs 4 GPUs .* or --share-gpus"):
        _backend_and_n("cuda", 4, None)
    monkeypatch.setenv("TRAY_SHARE_GPUS", "1")
    assert _backend_and_n("cuda", 4, None) == ("cuda", 4)
    with pytest.raises(UsageError, match="-n 4 needs 4 GPUs"):
        _backend_and_n("cuda", 4, False)  # only the flag overrides the variable, and it can only turn sharing on
    monkeypatch.setenv("TRAY_SHARE_GPUS", "often")
    assert main(["launch", "--backend", "cuda", "-n", "2", "--", "true"]) == 2
    assert "TRAY_SHARE_GPUS must be 1 (ranks may share GPUs) or 0, got 'often'" in capsys.readouterr().err


def test_a_python_without_trays_dependencies_gets_one_line_saying_how_to_install_them():
    """`python -m tray launch` from a checkout, with a Python that has none of tray's dependencies (-S: no
    site-packages): one SetupError line naming the missing module and what to do, exit 2, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    for argv in (["launch", "-n", "2", "--backend", "host", "--", "x"], ["gate", "peer-barrier", "--backend", "host"]):
        run = subprocess.run([sys.executable, "-S", "-m", "tray", *argv], cwd=repo, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2, run.stderr
        assert run.stderr.startswith("tray: SetupError: this Python") and run.stderr.count("\n") == 1, run.stderr
        assert "one of its dependencies: install tray with them" in run.stderr


def test_tray_options_after_the_program_are_the_programs_with_a_note(capsys):
    from tray.cli import _command_parser, _note_options_after_the_program

    launch = _command_parser(build_parser("launch"), ["launch"])
    _note_options_after_the_program(["prog.py", "-n", "2", "--backend=host", "--lr", "3"], launch)
    err = capsys.readouterr().err
    assert err == ("tray: note: -n --backend=host after the program 'prog.py' go to the program, not to tray launch; "
                   "put tray's options before the program\n")
    _note_options_after_the_program(["--", "prog.py", "-n", "2"], launch)  # `--`: the split is explicit
    _note_options_after_the_program(["prog.py", "--lr", "3"], launch)
    assert capsys.readouterr().err == ""


def test_a_missing_or_unexecutable_program_is_one_line_saying_what_to_do(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAY_JOBS_ROOT", str(tmp_path / "jobs"))
    assert main(["launch", "-n", "2", "--backend", "host", "nothere.py"]) == 2
    assert capsys.readouterr().err == ("tray: UsageError: nothere.py: no such file here or on PATH (the program to "
                                       "run: a path to a .py file, or -- CMD ARGS...)\n")
    prog = tmp_path / "hello.py"
    prog.write_text("print(1)\n")  # not executable
    assert main(["launch", "-n", "2", "-q", "--backend", "host", "--", str(prog)]) == 2
    err = capsys.readouterr().err
    assert f"Permission denied; {prog} is not executable: name it without `--`" in err and err.count("\n") == 1, err
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho 1\n")  # not executable, and no .py: its interpreter is not this Python
    assert main(["launch", "-n", "2", "-q", "--backend", "host", "--", str(script)]) == 2
    err = capsys.readouterr().err
    assert (f"Permission denied; {script} is a file without execute permission: chmod +x {script}, or start it with "
            "its interpreter") in err and err.count("\n") == 1, err
    # a directory or a FIFO where the program is named: said to be one (it was "Permission denied" alone)
    fifo = tmp_path / "prog.fifo"
    os.mkfifo(fifo)
    for path, what in ((tmp_path, "a directory"), (fifo, "not a regular file")):
        assert main(["launch", "-n", "2", "-q", "--backend", "host", "--", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"Permission denied; {path} is {what}" in err and err.count("\n") == 1, err


def test_a_py_program_on_path_needs_no_dashes(tmp_path, monkeypatch):
    from tray.cli import _check_program

    (tmp_path / "onpath.py").write_text("#!/usr/bin/env python3\n")
    (tmp_path / "onpath.py").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    _check_program(["onpath.py"], dashed=False)  # found on PATH: run as given
    with pytest.raises(UsageError, match="nothere.py: no such file here or on PATH"):
        _check_program(["nothere.py"], dashed=False)


def test_a_py_program_that_is_a_directory(tray_env):
    """`tray launch -n 1 app.py` where app.py is a directory: run by its __main__.py, as `python app.py` would; one
    without it is said to be a directory (it was "no such file here" for a path that is there)."""
    app = tray_env.tmp / "app.py"
    app.mkdir()
    cmd = [sys.executable, "-m", "tray", "launch", "-n", "1", "-q", "--backend", "host", str(app), tray_env.marker]
    run = tray_env.run(cmd)
    assert run.returncode == 2, run.output
    assert f"{app}: a directory without a __main__.py, not a program" in run.stderr, run.stderr
    (app / "__main__.py").write_text("import sys\nprint('ran', sys.argv[1:])\n")
    run = tray_env.run(cmd)
    assert run.returncode == 0, run.output
    assert f"[rank 0] ran ['{tray_env.marker}']" in run.stdout, run.output


def test_torchruns_spellings_parse_as_tray_launchs_own():
    """torchrun's underscore spellings, short -r/-t, N:N node counts and its --nproc-per-node words; the help
    lists the dashed spellings only."""
    ap = build_parser("launch")
    args = ap.parse_args(["launch", "--nproc_per_node", "2", "--max_restarts=1", "--rdzv_id", "x", "--nnodes", "2:2",
                          "--node_rank", "1", "--rdzv_endpoint", "h:1", "-r", "3", "-t", "1", "--local_ranks_filter",
                          "0", "--rdzv_backend", "c10d", "--no_python", "prog", "a"])
    assert (args.nprocs, args.max_restarts, args.rdzv_id, args.nnodes, args.node_rank, args.rdzv_endpoint) == \
        (2, 1, "x", 2, 1, "h:1")
    assert (args.redirects, args.tee, args.local_ranks_filter, args.torchrun_rdzv_backend, args.no_python) == \
        ("3", "1", "0", "c10d", True)
    assert args.cmd == ["prog", "a"]
    assert ap.parse_args(["launch", "--nproc-per-node", "gpu", "true"]).nprocs == "gpu"
    launch = next(a for a in ap._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices["launch"]
    text = launch.format_help()
    options, epilog = text.split("examples:")
    assert "--nproc-per-node" in options and "--nproc_per_node" not in text and "--rdzv-backend" not in options
    # torchrun's flags that change nothing are not options of the list, but the help names them
    assert "torchrun's --rdzv-backend, --rdzv-conf, --monitor-interval" in " ".join(epilog.split()), epilog


@pytest.mark.parametrize("argv, says", [
    (["--nnodes", "1:2"], "'1:2' is an elastic range (torchrun's MIN:MAX)"),
    (["-n", "many"], "expected a number of ranks (or gpu, auto, cpu), got 'many'"),
    (["-m", "--no-python"], "-m/--module and --no-python say 2 ways of starting the program; give one"),
    (["-m", "--no-python", "--run-path"], "-m/--module and --no-python and --run-path say 3 ways"),
    (["-n", "gpu", "--backend", "host"], "--nproc-per-node gpu: no GPU is visible (or --backend host was given)"),
])
def test_torchruns_forms_that_cannot_be_are_one_line(capsys, argv, says):
    try:
        code = main(["launch", *argv, "--", "true"])
    except SystemExit as exited:  # the parser's own errors
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_torchruns_flags_without_effect_are_noted_unless_their_value_is_tray_s_way(capsys, monkeypatch):
    from tray.cli import _note_torchrun_flags

    args = build_parser("launch").parse_args(["launch", "--rdzv-backend", "etcd", "--start-method", "spawn",
                                              "--monitor-interval", "0.1", "--role", "trainer", "true"])
    _note_torchrun_flags(args)
    err = capsys.readouterr().err
    assert "--rdzv-backend etcd is torchrun's and has no effect under tray launch: the nodes of a job meet" in err
    assert "--role trainer is torchrun's and has no effect under tray launch: ROLE_NAME is 'default'" in err
    assert "--start-method" not in err and "--monitor-interval" not in err


def test_log_files_are_never_opened_through_a_link_nor_in_a_directory_others_could_swap_them_in(tmp_path):
    """--log-dir in a directory another user controls: a rank-R.log planted there as a link once had the head
    append a rank's output to the link's target; now the head refuses the link, a file another user owns, and a
    directory others may write in (not sticky) or that another user owns."""
    import stat as stat_mod

    from tray.launch.spawn import check_log_dir, open_log

    logs = tmp_path / "logs"
    old_umask = os.umask(0o002)
    try:
        check_log_dir(str(logs / "new" / "nested"))   # made by tray under umask 002: 0755, not refused as others'
    finally:
        os.umask(old_umask)
    assert stat_mod.S_IMODE((logs / "new").stat().st_mode) == 0o755
    check_log_dir(str(logs))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    (logs / "rank-0.log").symlink_to(victim)
    with pytest.raises(OSError):
        open_log(str(logs), 0)
    assert victim.read_text() == "keep\n"
    with open_log(str(logs), 1) as log:
        log.write("line\n")
    assert stat_mod.S_IMODE((logs / "rank-1.log").stat().st_mode) == 0o600
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(OSError, match=r"another user could replace the log files in it \(mode 0777: anyone may"):
        check_log_dir(str(open_dir))
    open_dir.chmod(0o1777)  # sticky: nobody replaces another's file
    check_log_dir(str(open_dir))
    open_dir.chmod(0o777)
    with pytest.raises(OSError, match=r"lies under .*/open \(mode 0777: anyone may write in it\)"):
        check_log_dir(str(open_dir / "me" / "logs"))   # a directory above it others may change
    open_dir.chmod(0o1777)
    os.mkfifo(logs / "rank-3.log")
    with pytest.raises(OSError, match="is not a regular file"):   # a FIFO there would have blocked the open
        open_log(str(logs), 3)
    if os.getuid() == 0:
        planted = open_dir / "rank-2.log"
        planted.write_text("")
        os.chown(planted, 65534, 65534)
        with pytest.raises(OSError, match="belongs to another user"):
            open_log(str(open_dir), 2)
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(OSError, match=r"in it \(owned by uid 65534\)"):
            check_log_dir(str(theirs))
        # --log-dir itself another user's link in a sticky directory others write in (/tmp): its owner could point it
        # at a directory of theirs while the tray runs, and the logs, opened by path again after the run, would follow
        mine = tmp_path / "mine"
        mine.mkdir(mode=0o700)
        (open_dir / "logs").symlink_to(mine)
        check_log_dir(str(open_dir / "logs"))   # this user's own link: its owner alone may replace it
        (open_dir / "logs").unlink()
        (open_dir / "logs").symlink_to(mine)
        os.lchown(open_dir / "logs", 65534, 65534)
        with pytest.raises(OSError, match=rf"a log file in it lies under the link {open_dir / 'logs'} \(owned by "
                                          r"uid 65534\)"):
            check_log_dir(str(open_dir / "logs"))


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`tray inspect M | head`: stdout's pipe closed under the command ends it as SIGPIPE would (141), with no
    traceback, also at the interpreter's last flush."""
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: its first write fails
    try:
        proc = subprocess.run([sys.executable, "-m", "tray", "inspect", "ep_moe", "-n", "4"], stdout=write_end,
                              stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(write_end)
    err = proc.stderr.decode()
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("args", [["inspect", "--list"], ["--version"], ["doctor"]])
def test_a_short_output_whose_reader_went_away_or_disk_is_full_is_said_as_a_long_one(args):
    """Output short enough to wait in stdout's buffer until the command returns (stdout block-buffered to a pipe or
    a file, PYTHONUNBUFFERED unset, as a user's shell has it; argparse's --version too): a reader gone is 141 with
    nothing said, a full disk the one line, as when the error comes while the command runs; not the interpreter's
    "Exception ignored ... BrokenPipeError" and exit 120."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "tray", *args], stdout=write_end, stderr=subprocess.PIPE,
                              env=env, timeout=60)
    finally:
        os.close(write_end)
    err = proc.stderr.decode()
    assert (proc.returncode, err) == (141, ""), err
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "tray", *args], stdout=full, stderr=subprocess.PIPE, env=env,
                              timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err == ("tray: SetupError: cannot write the command's output (No space left on device): what it printed "
                   "to stdout is lost; free space there, or send it elsewhere\n"), err


def test_output_to_a_full_disk_is_one_line(tmp_path):
    """`tray inspect M > /dev/full` (stdout on a full disk) and `tray gate --json` where it cannot be written: one
    line naming what was lost, exit 2, not a traceback."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "tray", "inspect", "ep_moe", "-n", "4"], stdout=full,
                              stderr=subprocess.PIPE, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err == ("tray: SetupError: cannot write the command's output (No space left on device): what it printed "
                   "to stdout is lost; free space there, or send it elsewhere\n"), err
    from tray.bench import write_report
    from tray.errors import SetupError

    with pytest.raises(SetupError, match=r"--json /dev/full: cannot write the report \(No space left on device\); "
                                         r"the results above stand"):
        write_report({"command": "x", "environment": {}}, "/dev/full")


def test_a_full_disk_that_is_not_the_output_is_not_said_as_the_output(tmp_path):
    """A file the command writes (a bench's config in its work dir) on a full disk, stdout a pipe with room: the
    error as raised, naming where, not "what it printed to stdout is lost"."""
    import subprocess
    import sys

    code = ("import errno, sys\nfrom tray import cli\n"
            "def full(args):\n    print('the output')\n"
            "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "cli.cmd_inspect = full\nsys.exit(cli.main(['inspect', 'peer_fill']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "the output\n", proc.stdout
    assert "cannot write the command's output" not in proc.stderr, proc.stderr
    assert proc.stderr.rstrip().endswith("OSError: [Errno 28] No space left on device"), proc.stderr


def test_the_programs_arguments_that_are_prefixes_of_two_spelled_options_go_to_it():
    """Every launch option has two spellings (--barrier-timeout-s, --barrier_timeout_s); a prefix of both is one
    option, not an ambiguous one: after the program it is the program's (as torchrun passes `--bar`), before it
    tray's own. A prefix of two different options is still refused."""
    ap = build_parser("launch")
    args = ap.parse_args(["launch", "-n", "2", "prog.py", "--bar", "--time", "3", "--share", "--join=x", "--heart"])
    assert args.cmd == ["prog.py", "--bar", "--time", "3", "--share", "--join=x", "--heart"]
    assert args.nprocs == 2 and args.barrier_timeout_s is None and args.timeout_s == 30.0
    args = ap.parse_args(["launch", "--barrier", "5", "--heart", "4", "prog.py"])
    assert args.barrier_timeout_s == 5.0 and args.heartbeat_timeout_s == 4.0 and args.cmd == ["prog.py"]
    with pytest.raises(SystemExit):
        ap.parse_args(["launch", "prog.py", "--lo"])   # --log-dir or --local-ranks-filter


def test_a_module_that_hides_a_dependency_is_named(tray_env):
    """A zmq.py on PYTHONPATH (or beside the program run with -m tray) hides the installed package: one line naming
    that file, not a traceback from inside it or "this Python has tray but not 'zmq.utils'"."""
    import sys

    shadow = tray_env.tmp / "shadow"
    shadow.mkdir()
    env = tray_env.env()
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "tray", "launch", "-n", "1", "-q", "--backend", "host", "--", sys.executable, "-c",
           "pass", tray_env.marker]
    for body in ("x = 1\n", "raise ImportError('not the real one')\n"):
        (shadow / "zmq.py").write_text(body)
        run = tray_env.run(cmd, env=env)
        assert run.returncode == 2, run.output
        assert run.stderr.strip() == (f"tray: SetupError: {shadow / 'zmq.py'} hides the package 'zmq' that tray needs "
                                      "(Python finds it first: it is on PYTHONPATH or in the current directory); "
                                      "rename it, or take its directory off the path"), run.stderr


def test_the_ep_moe_bench_help_says_which_paths_cross_nodes():
    """`tray bench ep-moe --help`: --nnodes runs the peer path (its rows for other nodes staged and carried by
    NCCL) and the NCCL path, as docs/cli.md and the report's cross_node_path say. The help once said the
    exchange ran the NCCL path alone across nodes."""
    import argparse

    from tray.programs.ep_moe.bench import CROSS_NODE_PATH

    ap = build_parser("bench")
    bench = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    ep_moe = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices["ep-moe"]
    nnodes = next(a for a in ep_moe._actions if "--nnodes" in a.option_strings)
    assert "staged and carried by an NCCL all-to-all" in nnodes.help and "the NCCL path beside it" in nnodes.help
    assert "staged and carried by an NCCL all-to-all" in CROSS_NODE_PATH


@pytest.mark.parametrize("argv, said", [
    (["launch", "--backend", "host", "-n", "99999999999999999999", "--", "true"], "-n must be at most 1048576"),
    (["bench", "park", "--backend", "host", "-n", "2", "--gib", "nan"], "argument --gib: expected a number > 0"),
    (["bench", "park", "--backend", "host", "-n", "2", "--gib", "-1"], "argument --gib: expected a number > 0"),
    (["bench", "park", "--backend", "host", "-n", "2", "--page-mib", "inf"], "--page-mib: expected a number > 0"),
])
def test_absurd_rank_counts_and_sizes_are_one_line_and_exit_2(capsys, argv, said):
    """-n 10**20 raised OverflowError sizing a list per rank; --gib nan raised ValueError in the bench and --gib -1
    ran a bench of one page."""
    try:
        code = main(argv)
    except SystemExit as exc:  # an argument argparse refused
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_ctrl_c_while_the_command_loads_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C while `tray` is still importing its command (tray.cli and what it loads, ~50-100 ms): one line saying
    nothing was started, exit 130, as one during a launch; not a traceback through the import machinery. The
    interruption lands deterministically: a finder that sitecustomize puts first raises it as tray.cli is looked up."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tray.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, _Interrupt())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(repo)]))
    for argv in ([sys.executable, "-m", "tray"], [sys.executable, "-c", "from tray.command import program; program()"]):
        run = subprocess.run([*argv, "launch", "-n", "2", "--backend", "host", "--", "true"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 130, (argv, run.returncode, run.stderr)
        assert run.stderr == "tray: interrupted while the command was loading; nothing was started\n", run.stderr


def test_the_tray_command_enters_through_tray_command():
    """The `tray` script and `python -m tray` both start at tray.command.program (the Ctrl-C above is handled there)."""
    import tomllib
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    scripts = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"tray": "tray.command:program"}
    assert "from tray.command import program" in (repo / "tray" / "__main__.py").read_text()


def test_a_second_signal_inside_mains_handling_of_the_first_still_says_the_interruption(monkeypatch, capsys):
    """A storm of SIGTERMs: one that lands in main's handling of the first, before it holds signals, escaped main as a
    second KeyboardInterrupt and the head exited 130 saying nothing. `program` says it then."""
    import signal

    from tray import cli

    def storm() -> int:  # main, interrupted by a second signal while handling the first
        raise KeyboardInterrupt(f"signal {int(signal.SIGTERM)}")

    previous = {sig: signal.getsignal(sig) for sig in cli._STOP_SIGNALS}
    monkeypatch.setattr(cli, "main", storm)
    monkeypatch.setattr(cli, "_interrupt_said", False)
    try:
        with pytest.raises(SystemExit) as ended:
            cli.program()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert ended.value.code == 130
    assert capsys.readouterr().err == "tray: interrupted (SIGTERM); the tray was stopped\n"


@pytest.mark.parametrize("argv, meant", [(["lanch"], "launch"), (["launch", "--backend", "hst"], "host"),
                                         (["bench", "tpp"], "tp")])
def test_a_mistyped_choice_is_answered_with_the_one_meant(capsys, argv, meant):
    """`tray lanch` listed every command and suggested none, as argparse does."""
    from tray.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser(argv[0]).parse_args(argv)
    err = capsys.readouterr().err
    assert f"invalid choice: '{argv[-1]}'" in err and f"; did you mean {meant!r}? (`tray" in err, err


def test_stop_grace_is_a_flag_of_bounded_seconds():
    """The 3 s between a rank's SIGTERM and its SIGKILL was fixed (torchrun's is 30 s): a rank saving its state in a
    SIGTERM handler for longer was cut short, and nothing said so."""
    import pytest

    from tray.cli import build_parser

    ap = build_parser("launch")
    assert ap.parse_args(["launch", "prog.py"]).stop_grace_s == 3.0
    assert ap.parse_args(["launch", "--stop-grace-s", "30", "prog.py"]).stop_grace_s == 30.0
    assert ap.parse_args(["launch", "--stop_grace_s", "0", "prog.py"]).stop_grace_s == 0.0
    for bad in ("-1", "1e9", "soon"):
        with pytest.raises(SystemExit):
            ap.parse_args(["launch", "--stop-grace-s", bad, "prog.py"])


def test_sigint_and_sigterm_stop_a_tray_unless_ignored_or_handled_outside_python(monkeypatch) -> None:
    """A program that ignores SIGINT (started in a script's background) had it taken over for the tray's run; one
    whose handler was installed in C (getsignal: None) had its tray's result lost to a TypeError when the head put it
    back, and every later SIGTERM swallowed by the head's handler."""
    import signal

    from tray.envvars import stop_signals

    handlers = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                signal.SIGHUP: signal.SIG_DFL, signal.SIGQUIT: signal.SIG_DFL}
    monkeypatch.setattr(signal, "getsignal", lambda sig: handlers[sig])
    assert stop_signals() == (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    handlers[signal.SIGINT] = signal.SIG_IGN
    handlers[signal.SIGTERM] = None
    assert stop_signals() == (signal.SIGHUP, signal.SIGQUIT)


def test_run_tray_without_a_command_is_a_usage_error() -> None:
    """TraySpec(cmd=()) raised IndexError from inside subprocess."""
    from tray.launch import TraySpec, run_tray

    for cmd in ((), ("",)):
        with pytest.raises(UsageError, match=r"TraySpec.cmd is the command each rank runs"):
            run_tray(TraySpec(nprocs=1, cmd=cmd, backend="host"))
