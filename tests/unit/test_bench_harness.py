"""The bench harness's arithmetic and table, without a tray."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from tray.bench import Row, busbw_factor, format_table, median, ratio, require_plot, write_report
from tray.errors import UsageError


def test_rows_have_nccl_tests_bandwidths():
    row = Row("ar_peer", 1 << 20, 1 << 19, "bf16", 10.0, 0, "allreduce", 4)
    assert row.algbw_gbps == pytest.approx((1 << 20) / 10e3)
    assert row.busbw_gbps == pytest.approx(row.algbw_gbps * 1.5)
    assert busbw_factor("alltoall", 4) == 0.75 and busbw_factor("barrier", 4) == 1.0
    with pytest.raises(UsageError):
        busbw_factor("allreduce", 0)


def test_table_has_the_nccl_tests_columns_and_one_line_per_row():
    rows = [Row("ar_peer", 512, 256, "bf16", 4.77, 0, "allreduce", 4), Row("ar_nccl", 512, 256, "bf16", 8.77, -1)]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["name", "size", "count", "type", "time", "algbw", "busbw", "#wrong"]
    assert len(lines) == 4
    assert lines[2].split()[:5] == ["ar_peer", "512", "256", "bf16", "4.77"] and lines[3].split()[-1] == "N/A"


def test_median_and_ratio_skip_what_was_not_measured():
    assert median([3.0, float("nan"), 1.0, 2.0]) == 2.0
    assert math.isnan(median([float("nan")]))
    assert ratio(1.0, 4.0) == 0.25
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(float("nan"), 1.0))


def test_report_gets_the_environment_and_is_written(tmp_path):
    path = tmp_path / "sub" / "r.json"
    report = {"bench": "x"}
    write_report(report, str(path), {"device": "cpu"})
    saved = json.loads(path.read_text())
    assert saved["bench"] == "x" and saved["environment"]["device"] == "cpu" and "commit" in saved["environment"]
    env = saved["environment"]  # a machine busy before the bench, and the bench's own load, are said
    assert isinstance(env["load_average_1m_start"], float) and isinstance(env["load_average_1m_end"], float)


def test_the_variables_that_change_a_figure_are_kept_and_tokens_are_not():
    from tray.envinfo import knobs

    env = {"CUDA_VISIBLE_DEVICES": "GPU-1", "NCCL_NVLS_ENABLE": "0", "TRAY_BARRIER_TIMEOUT_S": "3",
           "TRAY_JOB_TOKEN": "s3cret", "TRAY_TOKEN": "t", "HOME": "/root", "PATH": "/bin"}
    assert knobs(env) == {"CUDA_VISIBLE_DEVICES": "GPU-1", "NCCL_NVLS_ENABLE": "0", "TRAY_BARRIER_TIMEOUT_S": "3"}


def test_the_commit_is_tray_s_own_not_that_of_a_project_it_is_installed_in(tmp_path):
    """A wheel installed in a venv inside another git work tree (a user's project, its .venv ignored or not): the
    report's commit is "unknown", not that project's HEAD; a checkout of tray gives its own HEAD."""
    import shutil
    import subprocess
    from pathlib import Path

    import tray.envinfo as envinfo

    def git(*args: str, cwd: Path) -> str:
        return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GIT_AUTHOR_NAME": "a",
                                   "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a",
                                   "GIT_COMMITTER_EMAIL": "a@b"}).stdout.strip()

    if shutil.which("git") is None:
        pytest.skip("no git here")
    project = tmp_path / "project"
    site = project / ".venv" / "lib" / "site-packages" / "tray"
    site.mkdir(parents=True)
    git("init", "-q", cwd=project)
    (project / "main.py").write_text("print('mine')\n")
    git("add", "main.py", cwd=project)
    git("commit", "-q", "-m", "the user's project", cwd=project)
    shutil.copy2(envinfo.__file__, site / "envinfo.py")
    spec = importlib.util.spec_from_file_location("installed_envinfo", site / "envinfo.py")
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    assert installed.git_commit() == "unknown"
    git("add", "-f", ".venv", cwd=project)  # even committed there, it is that project's copy: still its own file
    git("commit", "-q", "-m", "vendored", cwd=project)
    assert installed.git_commit() == git("rev-parse", "HEAD", cwd=project)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_a_plot_without_matplotlib_names_the_extra():
    require_plot(None)
    with pytest.raises(UsageError, match=r"tray\[plot\]"):
        require_plot("x.png")


def test_bandwidths_keep_their_digits():
    from tray.bench import format_gbps

    assert [format_gbps(v) for v in (0.000976, 0.0127, 5.0, 47.123, 462.4)] == \
        ["0.000976", "0.0127", "5.00", "47.12", "462.4"]
    assert format_gbps(float("nan")) == "n/a"
    table = format_table([Row("allreduce peer", 512, 256, "bf16", 527.97, 0, "allreduce", 2)])
    assert "0.00097" in table and " 0.00 " not in table


def test_plot_without_matplotlib_is_a_usage_error_naming_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from tray.cli import main

    for argv in (["bench", "tp", "-n", "2", "--backend", "host", "--plot", "x.png"],
                 ["bench", "park", "-n", "2", "--backend", "host", "--plot", "x.png"]):
        assert main(argv) == 2


def test_reports_say_the_command_that_made_them(tmp_path):
    from tray.bench import invoked_command

    assert invoked_command(["/x/.venv/bin/tray", "bench", "tp", "-n", "2"]) == "tray bench tp -n 2"
    assert invoked_command(["/r/tray/__main__.py", "gate", "peer-barrier"]) == "tray gate peer-barrier"
    assert invoked_command(["bench/startup.py", "-n", "4"]) == "python bench/startup.py -n 4"
    report: dict = {}
    write_report(report, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["command"] == report["command"]


def test_tp_crossover_and_peer_pick():
    from tray.programs.tp_mlp.bench import crossover, summarize_sizes

    def entry(nbytes, one, two, nccl, wrong=0):
        return {"bytes": nbytes, "count": nbytes // 2, "us": {"ar_oneshot": one, "ar_twoshot": two, "ar_nccl": nccl},
                "checks": {"wrong": {"ar_oneshot": wrong, "ar_twoshot": 0, "ar_nccl": 0},
                           "ar_oneshot_identical_on_all_ranks": True, "ar_twoshot_identical_on_all_ranks": True}}

    ranks = [{"sizes": [entry(8, 4.0, 9.0, 8.0), entry(1 << 20, 9.0, 8.0, 12.0), entry(1 << 21, 5.0, 6.0, 9.0),
                        entry(1 << 22, 20.0, 12.0, 30.0, wrong=3)]},
             {"sizes": [entry(8, 4.5, 9.0, 8.0), entry(1 << 20, 9.0, 8.5, 12.0), entry(1 << 21, 5.0, 6.0, 9.0),
                        entry(1 << 22, 20.0, 12.0, 31.0)]}]
    rows = summarize_sizes(ranks)
    assert [r["ar_peer_path"] for r in rows] == ["ar_oneshot", "ar_twoshot", "ar_oneshot", "ar_twoshot"]
    assert rows[0]["us"]["ar_peer"] == 4.5 and rows[1]["us"]["ar_peer"] == 8.5  # the slowest rank
    assert [r["checks"]["passed"] for r in rows] == [True, True, True, False]  # 3 wrong elements on rank 0
    assert rows[3]["checks"]["wrong"]["ar_oneshot"] == 3
    assert crossover(rows) == 1 << 22  # 1 MiB won, 2 MiB lost: the two-shot wins for good only from 4 MiB
    assert crossover(rows[:3]) is None
    assert [r["ar_tray_path"] for r in rows] == ["ar_oneshot", "ar_twoshot", "ar_oneshot", "ar_twoshot"]
    slow = summarize_sizes([{"sizes": [entry(1 << 26, 300.0, 200.0, 190.0)]}])[0]
    assert slow["ar_tray_path"] == "ar_nccl" and slow["us"]["ar_tray"] == 190.0 and slow["us"]["ar_peer"] == 200.0


def test_tp_ratios_are_against_nccls_faster_formulation_and_a_wrong_window_sum_fails():
    from tray.programs.tp_mlp.bench import summarize_sizes

    def entry(nbytes, one, nccl, win, win_wrong=0):
        us = {"ar_oneshot": one, "ar_twoshot": 50.0, "ar_nccl": nccl, "ar_nccl_win": win}
        return {"bytes": nbytes, "count": nbytes // 2, "us": us,
                "checks": {"wrong": {k: (win_wrong if k == "ar_nccl_win" else 0) for k in us},
                           "ar_oneshot_identical_on_all_ranks": True, "ar_twoshot_identical_on_all_ranks": True}}

    small, large = summarize_sizes([{"sizes": [entry(512, 4.0, 8.0, 5.0), entry(1 << 20, 9.0, 12.0, 8.0)]}])
    assert small["nccl_best_path"] == "ar_nccl_win" and small["us"]["ar_nccl_best"] == 5.0
    assert small["ratios"]["ar_peer_vs_nccl"] == 4.0 / 5.0 and small["ratios"]["ar_peer_vs_nccl_plain"] == 0.5
    assert small["ratios"]["ar_nccl_win_vs_nccl"] == 5.0 / 8.0 and small["ar_tray_path"] == "ar_oneshot"
    assert large["ar_tray_path"] == "ar_nccl_win" and large["us"]["ar_tray"] == 8.0  # windows beat the peer path
    bad = summarize_sizes([{"sizes": [entry(512, 4.0, 8.0, 5.0, win_wrong=7)]}])[0]
    assert not bad["checks"]["passed"] and bad["checks"]["wrong"]["ar_nccl_win"] == 7
    plain = summarize_sizes([{"sizes": [{**entry(512, 4.0, 8.0, 5.0), "us": {"ar_oneshot": 4.0, "ar_twoshot": 50.0,
                                                                              "ar_nccl": 8.0}}]}])[0]
    assert plain["nccl_best_path"] == "ar_nccl" and "ar_peer_vs_nccl_plain" not in plain["ratios"]


def test_tp_low_latency_path_is_used_up_to_its_threshold_and_its_crossover_reported():
    from tray.programs.tp_mlp.bench import ll_wins_up_to, summarize_sizes

    def entry(nbytes, ll, one, two=50.0, nccl=9.0, ll_wrong=0):
        us = {"ar_oneshot": one, "ar_twoshot": two, "ar_nccl": nccl} | ({} if ll is None else {"ar_ll": ll})
        wrong = {k: 0 for k in us} | ({} if ll is None else {"ar_ll": ll_wrong})
        return {"bytes": nbytes, "count": nbytes // 2, "us": us,
                "checks": {"wrong": wrong, **{f"{k}_identical_on_all_ranks": True for k in us if k != "ar_nccl"}}}

    sizes = [entry(8, 3.0, 4.7), entry(1 << 16, 3.5, 5.0), entry(1 << 18, 6.0, 5.5), entry(1 << 19, 5.0, 6.0),
             entry(1 << 22, None, 17.0, ll_wrong=0)]
    rows = summarize_sizes([{"ll_max_bytes": 1 << 18, "sizes": sizes}])
    # up to the threshold the tray uses the low-latency path, measured faster or not; above it the faster other one
    assert [r["ar_peer_path"] for r in rows] == ["ar_ll", "ar_ll", "ar_ll", "ar_oneshot", "ar_oneshot"]
    assert rows[2]["us"]["ar_peer"] == 6.0 and rows[2]["ratios"]["ar_ll_vs_oneshot"] == 6.0 / 5.5
    assert "ar_ll_vs_oneshot" not in rows[4]["ratios"] and rows[4]["checks"]["passed"]
    assert ll_wins_up_to(rows) == 1 << 16  # lost at 256 KiB: a later win does not extend it
    assert ll_wins_up_to(summarize_sizes([{"sizes": [entry(8, 5.0, 4.7)]}])) is None
    bad = summarize_sizes([{"ll_max_bytes": 8, "sizes": [entry(8, 3.0, 4.7, ll_wrong=2)]}])[0]
    assert not bad["checks"]["passed"] and bad["checks"]["wrong"]["ar_ll"] == 2


def test_tp_low_latency_path_is_the_faster_line_format_per_size():
    from tray.programs.tp_mlp.bench import ll_wins_up_to, summarize_sizes

    def entry(nbytes, ll, ll3, one=5.0, nccl=9.0, ll3_wrong=0):
        us = {"ar_ll": ll, "ar_ll3": ll3, "ar_oneshot": one, "ar_twoshot": 50.0, "ar_nccl": nccl}
        wrong = {k: 0 for k in us} | {"ar_ll3": ll3_wrong}
        return {"bytes": nbytes, "count": nbytes // 2, "us": us,
                "checks": {"wrong": wrong, **{f"{k}_identical_on_all_ranks": True for k in us if k != "ar_nccl"}}}

    sizes = [entry(8, 3.0, 3.1), entry(1 << 16, 4.2, 3.9), entry(1 << 17, 5.2, 4.8), entry(1 << 18, 5.6, 5.4)]
    rows = summarize_sizes([{"ll_max_bytes": 1 << 17, "sizes": sizes}])
    assert [r["ar_peer_path"] for r in rows] == ["ar_ll", "ar_ll3", "ar_ll3", "ar_oneshot"]
    assert [r["us"]["ar_peer"] for r in rows] == [3.0, 3.9, 4.8, 5.0]
    assert rows[1]["ratios"]["ar_ll3_vs_ll"] == 3.9 / 4.2 and rows[1]["ar_tray_path"] == "ar_ll3"
    assert ll_wins_up_to(rows) == 1 << 17  # the dense format beat the one-shot at 128 KiB, neither at 256 KiB
    bad = summarize_sizes([{"ll_max_bytes": 8, "sizes": [entry(8, 3.0, 3.1, ll3_wrong=1)]}])[0]
    assert not bad["checks"]["passed"] and bad["checks"]["wrong"]["ar_ll3"] == 1


def test_tp_ll_state_words_become_named_errors():
    from tray.errors import PeerFailure, UsageError
    from tray.programs.tp_mlp.ll import LLTimeout, check_state

    check_state([5 << 20, 0, 0, 0], "world", (0, 1, 2, 3), 1, 10**9)  # healthy: nothing raised
    with pytest.raises(LLTimeout) as info:
        check_state([5 << 20, 4, 0b1010, 0], "tp", (4, 5, 6, 7), 0, 2 * 10**9)
    assert isinstance(info.value, PeerFailure) and info.value.missing == [5, 7] and info.value.epoch == 4
    assert "launch 4: rank 4 waited 2.00 s for rank 5,7" in str(info.value)
    with pytest.raises(UsageError, match="ll_max_count"):
        check_state([0, 0, 0, 1], "world", (0, 1), 0, 10**9)
    with pytest.raises(UsageError, match="expected 4"):
        check_state([0, 0], "world", (0, 1), 0, 10**9)
