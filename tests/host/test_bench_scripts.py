"""The bench scripts beside the figures (bench/peer_barrier.py, bench/startup.py, bench/teardown.py) on host-backend
trays:
a progress line per stage, `--plot` writes a PNG, and without matplotlib `--plot` is a usage error."""

from __future__ import annotations

import builtins
import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import REPO

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# script -> (its stage prefix, the stages it announces, tiny arguments for a 2-rank host tray)
BENCHES = {
    "peer_barrier": ("peer-barrier", 3, ["--iters", "20"]),
    "startup": ("startup", 6, ["--repeats", "1", "--wake-gib", "0.0625"]),
    "teardown": ("teardown", 2, ["--repeats", "1"]),
}


def run_bench(tray_env, name: str, *extra: str):
    prefix, stages, tiny = BENCHES[name]
    run = tray_env.run([sys.executable, str(REPO / "bench" / f"{name}.py"), "-n", "2", "--backend", "host",
                        *tiny, *extra], timeout_s=120)
    assert run.returncode == 0, run.output
    lines = run.stdout.splitlines()
    for i in range(1, stages + 1):
        assert any(line.startswith(f"{prefix}: [{i}/{stages}] ") for line in lines), (i, run.stdout)
    assert any(line.startswith(f"{prefix}: done in ") for line in lines), run.stdout
    return run


def test_teardown_times_each_way_of_ending(tray_env, tmp_path):
    report_path = tmp_path / "report.json"
    run_bench(tray_env, "teardown", "--json", str(report_path))
    report = json.loads(report_path.read_text())
    assert set(report["runs"]) == {"exit", "os_exit"} and report["nprocs"] == 2  # no reset without a GPU
    for way, m in report["median"].items():
        assert m["close_s"] > 0 and m["tail_s"] > 0 and m["closed_to_last_s"] >= 0, (way, m)
    assert report["finalization_s"] == report["median"]["exit"]["tail_s"] - report["median"]["os_exit"]["tail_s"]


@pytest.mark.parametrize("name", ["peer_barrier", "startup"])
def test_a_bench_prints_a_line_per_stage_and_keeps_its_report(tray_env, tmp_path, name):
    report_path = tmp_path / "report.json"
    run_bench(tray_env, name, "--json", str(report_path))
    report = json.loads(report_path.read_text())
    if name == "peer_barrier":
        assert report["passed"] and all(report[f"{m}_us"] > 0 for m in ("eager", "eager_sync", "captured"))
    else:
        assert report["tray"]["ready_s"] > 0 and report["cold"]["kernel_cache"] == "cold"
        # from `tray launch` executed: the head's own start (until its first rank is spawned) counts
        head = report["tray"]["phases_s"]["head"]
        assert 0 < head < report["tray"]["ready_s"] and report["tray"]["clock"] == "from `tray launch` executed"
        assert report["in_process"]["ready_s"] > 0 and report["in_process"]["phases_s"]["head"] < head
        wake = report["wake"]  # 32 pages of 2 MiB per rank, parked, the device pool scribbled over, woken
        assert wake["gib_per_rank"] == 0.0625 and wake["wake_s"] > 0 and wake["load_s"] > 0
        assert [r["checked_bytes"] for r in wake["runs"]] == [2 * (64 << 20)]  # every byte of both ranks
        assert wake["cold_restart_s"] == report["tray"]["ready_s"] + wake["load_s"]


def test_startup_without_the_wake_stage(tray_env, tmp_path):
    report_path = tmp_path / "report.json"
    run = run_bench(tray_env, "startup", "--wake-gib", "0", "--json", str(report_path))
    assert "startup: [4/6] wake from park: skipped (--wake-gib 0)" in run.stdout
    assert "wake" not in json.loads(report_path.read_text())


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib (the `plot` extra) is not installed")
@pytest.mark.parametrize("name", ["peer_barrier", "startup"])  # the benches with --plot
def test_plot_writes_a_png(tray_env, tmp_path, name):
    png = tmp_path / "plots" / f"{name}.png"
    run = run_bench(tray_env, name, "--plot", str(png))
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000, run.stdout
    assert f"plot in {png}" in run.stdout


@pytest.mark.parametrize("name", ["peer_barrier", "startup"])  # the benches with --plot
def test_plot_without_matplotlib_is_a_usage_error_naming_the_extra(monkeypatch, capsys, tmp_path, name):
    real_import = builtins.__import__

    def no_matplotlib(module, *args, **kwargs):
        if module == "matplotlib" or module.startswith("matplotlib."):
            raise ImportError(f"No module named {module!r}")
        return real_import(module, *args, **kwargs)

    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the scripts import torch_baselines from beside them
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    png = tmp_path / "x.png"
    with pytest.raises(SystemExit) as exit_info:
        script.main(["-n", "2", "--backend", "host", "--plot", str(png)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "tray[plot]" in err and "matplotlib" in err, err
    assert not png.exists()


def test_address_cost_times_the_wrapped_and_unwrapped_call(tmp_path):
    import subprocess

    out = tmp_path / "address_cost.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "address_cost.py"), "--number", "2000", "--repeats", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert set(report["ns_per_call"]) == {"wrapped_ints", "unwrapped_ints", "wrapped_numpy_int"}
    assert all(v > 0 for v in report["ns_per_call"].values()) and "environment" in report


def test_the_long_run_bench_samples_the_head_and_a_rank_in_each_mode(tray_env, tmp_path):
    """bench/long_run.py, tiny: a checkpoint every 100 exchanges, its growth figures and rank 0's count of topics."""
    report_path = tmp_path / "report.json"
    run = tray_env.run([sys.executable, str(REPO / "bench" / "long_run.py"), "-n", "2", "--steps", "300", "--every",
                        "100", "--json", str(report_path)], timeout_s=120)
    assert run.returncode == 0, run.output
    assert [line[:17] for line in run.stdout.splitlines() if line.startswith("long_run: [")] == \
        ["long_run: [1/2] 2", "long_run: [2/2] 2"], run.stdout
    report = json.loads(report_path.read_text())
    for mode, topics in (("unique", 301), ("reused", 2)):  # 'warm' and the steps' topics
        m = report["modes"][mode]
        assert [p["step"] for p in m["points"]] == [100, 200, 300] and m["us_per_exchange_median"] > 0, m
        assert m["last"]["rank_topics"] == topics and m["last"]["head_rss"] > 0 and m["last"]["rank_fds"] > 0, m


def test_the_step_latency_bench_times_tray_and_its_floor_at_each_rank_count(tray_env, tmp_path):
    """bench/step_latency.py, tiny: 2 ranks, 20 exchanges after 5 of warm-up; the tray, its floor, their ratio and
    the encoding's share, from every rank's steps."""
    report_path = tmp_path / "report.json"
    run = tray_env.run([sys.executable, str(REPO / "bench" / "step_latency.py"), "--ranks", "2", "--steps", "20",
                        "--warmup", "5", "--json", str(report_path)], timeout_s=120)
    assert run.returncode == 0, run.output
    assert any(line.startswith("step_latency: [1/1] 2 ranks") for line in run.stdout.splitlines()), run.stdout
    assert any(line.startswith("step_latency: done in ") for line in run.stdout.splitlines()), run.stdout
    r = json.loads(report_path.read_text())["ranks"]["2"]
    for side in ("tray", "floor"):
        assert r[side]["samples"] == 40 and 0 < r[side]["p10_us"] <= r[side]["median_us"] <= r[side]["p90_us"], r
    assert r["ratio"] == pytest.approx(r["tray"]["median_us"] / r["floor"]["median_us"]), r
    assert 0 < r["parts"]["vote_decode_us"] < r["parts"]["codec_on_path_us"] and r["parts"]["codec_share"] > 0, r


def test_the_vote_cost_bench_times_the_heads_votes_after_steps_given_up(tmp_path):
    """bench/vote_cost.py, tiny: a head holding 0 and 300 given-up steps, 20 timed votes a pass; a figure per count,
    and no more than a few times the first at 300 (each vote judged every given-up step before)."""
    out = tmp_path / "v.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "vote_cost.py"), "--given-up", "0,300", "--votes", "20",
                          "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["runs"]
    assert [r["given_up"] for r in rows] == [0, 300] and all(r["us_per_vote"] > 0 for r in rows), rows
    assert rows[1]["us_per_vote"] < 20 * rows[0]["us_per_vote"] + 50, rows


def test_the_root_scale_bench_runs_a_root_and_its_nodes_links_through_a_job(tray_env, tmp_path):
    """bench/root_scale.py, tiny: 3 nodes of 2, 3 steps, 1.2 s idle (two heartbeats each way): every phase timed, the
    table checked to be the job's join info (rank 0's NCCL id alone), a node's ranks' table timed, each step's decision
    checked, the root's counters per phase."""
    report_path = tmp_path / "report.json"
    run = tray_env.run([sys.executable, str(REPO / "bench" / "root_scale.py"), "--nodes", "3", "-L", "2", "--iters",
                        "3", "--idle-s", "1.2", "--timeout-s", "60", "--json", str(report_path)], timeout_s=120)
    assert run.returncode == 0, run.output
    assert run.stdout.startswith("3 nodes x 2: join "), run.stdout
    r = json.loads(report_path.read_text())["runs"][0]
    assert r["world_size"] == 6 and 128 < r["table_bytes"] < 400, r  # rank 0's 128-byte id, not six offers
    ranks = r["ranks_table"]  # two offers of ~0.64 KB and rank 0's id
    assert ranks["head_ms"] > 0 and ranks["rank_ms"] > 0 and 2 * 400 < ranks["bytes"] < 4 * 400, ranks
    assert 0 < r["step_ms"]["median"] <= r["step_ms"]["p90"], r
    root = r["root"]
    # a vote per node and step in, a decision per node and step out
    assert root["steps"]["messages_in"] >= 3 * 3 and root["steps"]["messages_out"] >= 3 * 3, root
    assert 0 < root["table"]["cpu_ms"] <= root["table"]["process_cpu_ms"], root
    assert root["idle"]["messages_in_per_s"] > 0 and "3 nodes" in root["summary"], root
