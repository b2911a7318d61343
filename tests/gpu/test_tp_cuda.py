"""The TP allreduces on GPUs: every peer path (low-latency in both line formats, one-shot, two-shot) and NCCL checked
after their timed graph replays, at 2 ranks (and 4 where visible; and as two nodes of two GPUs, TP within each), on
small sizes; the low-latency kernels' bounded wait names a rank that never sends."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import MANIFESTS, gpu_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "host"))

pytestmark = pytest.mark.gpu
PATHS = {"ar_ll", "ar_ll3", "ar_oneshot", "ar_twoshot", "ar_nccl"}


def checked_paths(s: dict) -> bool:
    """Every path of size record `s` checked, none wrong: PATHS, and NCCL on symmetric windows where it was timed."""
    wrong = s["checks"]["wrong"]
    return PATHS <= set(wrong) <= PATHS | {"ar_nccl_win"} and not any(wrong.values())


@pytest.mark.parametrize("n", [2, 4])
def test_tp_bench_every_path_right_after_timed_replays(tray_env, tmp_path, n):
    if gpu_ranks() < n:
        pytest.skip(f"needs {n} GPUs")
    out = tmp_path / "tp.json"
    # 8 B: one line, its tail padded; 1040 B: 520 elements, a partial last line and two-shot chunks; 64 KiB:
    # 32 blocks of lines; 4 MiB: 2048 blocks (more than are resident at once), past the default threshold,
    # still swept
    sizes = "8,1040,65536,4194304"
    run = tray_env.run([sys.executable, "-m", "tray", "bench", "tp", "-n", str(n), "--backend", "cuda", "--sizes",
                        sizes, "--tokens", "1,16", "--hidden", "1024", "--ffn", "4096", "--repeats", "3",
                        "--json", str(out)], timeout_s=300)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["passed"], run.output
    for s in report["sizes"]:
        assert checked_paths(s), s
        assert s["checks"]["peer_identical_on_all_ranks"] and s["us"]["ar_ll"] > 0 and s["us"]["ar_ll3"] > 0, s
        ll = min(("ar_ll", "ar_ll3"), key=lambda k: s["us"][k])  # the faster line format of this run
        want = ll if s["bytes"] <= report["ll_max_bytes"] else s["ar_peer_path"]
        assert s["ar_peer_path"] == want and s["us"]["ar_peer"] == s["us"][want], s
    for t in report["tokens"]:  # the layer's 2 and 32 KiB outputs reduced by the low-latency path too
        assert t["checks"]["ll_equals_one_shot"] and t["checks"]["two_shot_equals_one_shot"], t
        assert t["us"]["mlp_ll"] > 0, t


def test_tp_bench_within_each_node_of_a_two_node_job(tray_env, tmp_path):
    """Two nodes of two GPUs (each its own NCCL_HOSTID): every node one TP group, every path right on every rank."""
    if gpu_ranks() < 4:
        pytest.skip("needs 4 GPUs")
    out = tmp_path / "tp.json"
    run = tray_env.run([sys.executable, "-m", "tray", "bench", "tp", "-n", "4", "--nnodes", "2", "--backend", "cuda",
                        "--sizes", "8,1040,65536,4194304", "--tokens", "1,16", "--hidden", "1024", "--ffn", "4096",
                        "--repeats", "3", "--json", str(out)], timeout_s=300)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["nnodes"] == 2 and report["tp_size"] == 2, run.output
    assert report["tp_within_nodes"] and report["tp_groups"] == [[0, 1], [2, 3]], report
    for s in report["sizes"]:
        assert checked_paths(s), s
        assert s["checks"]["peer_identical_on_all_ranks"], s
    for t in report["tokens"]:
        assert t["checks"]["passed"] and t["checks"]["ll_equals_one_shot"], t


@pytest.mark.parametrize("program", ["ar_ll", "ar_ll3"])
def test_ll_allreduce_wait_is_bounded_and_names_the_missing_rank(tray_env, program):
    from test_tp import LL_MISSING, LL_MISSING_VARS

    if gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs")
    run = tray_env.run(tray_env.command(2, LL_MISSING, "--manifest", str(MANIFESTS / "tp_mlp.json"),
                                        *[a for v in LL_MISSING_VARS for a in ("--var", v)], backend="cuda")
                       + [program], timeout_s=180)
    assert run.returncode == 0, run.output
    assert "named [1]: " in run.stdout and "rank 0 waited 0.20 s for rank 1" in run.stdout, run.output
    assert "broken state [1, 2, 0] launches 4" in run.stdout, run.output


@pytest.mark.parametrize("stress", ["ll_stress", "ll3_stress"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("count", [4, 32768, 2097152])
def test_ll_allreduce_stress_every_round_right(tray_env, n, count, stress):
    """Rounds of different inputs through the low-latency slots from a graph of 8 rounds replayed 25 times
    without a host sync, member r % G held back 20 µs in round r: every round's sum checked on the device,
    in either line format (4 elements: one line; 64 KiB: 32 or 22 blocks; 4 MiB: 2048 or 1366 blocks, more
    than are resident at once, so the last blocks of one rank still read while its peers' next launch writes
    the other parity; 64 KiB and 4 MiB end in a partial line of the dense format)."""
    from test_tp import LL_STRESS, ll_stress_vars

    if gpu_ranks() < n:
        pytest.skip(f"needs {n} GPUs")
    run = tray_env.run(tray_env.command(n, LL_STRESS, "--manifest", str(MANIFESTS / "tp_mlp.json"),
                                        *ll_stress_vars(count), backend="cuda") + ["8", "25", stress],
                       timeout_s=180)
    assert run.returncode == 0, run.output
    assert run.stdout.count("stress rounds 201 wrong 0") == n, run.output


@pytest.mark.parametrize("threads, lines", [(32, 1), (512, 4)])
def test_ll_allreduce_stress_at_other_launch_shapes(tray_env, threads, lines):
    """The stress of the low-latency path at launch shapes the tune sweep times (manifest vars ll_threads,
    ll_lines) on 4 MiB: 32 threads x 1 line is 16384 blocks of one warp, 512 x 4 is 256 blocks whose threads
    each send and sum 4 lines; every round right on both ranks."""
    from test_tp import LL_STRESS, ll_stress_vars

    if gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs")
    shape = ["--var", f"ll_threads={threads}", "--var", f"ll_lines={lines}"]
    run = tray_env.run(tray_env.command(2, LL_STRESS, "--manifest", str(MANIFESTS / "tp_mlp.json"),
                                        *ll_stress_vars(2097152), *shape, backend="cuda") + ["8", "25", "ll_stress"],
                       timeout_s=180)
    assert run.returncode == 0, run.output
    assert run.stdout.count("stress rounds 201 wrong 0") == 2, run.output
