"""The TP bench on real host-backend trays: one-shot peer allreduce exact and identical on every rank."""

from __future__ import annotations

import json
import sys

import pytest


@pytest.mark.parametrize("n", [2, 4])
def test_tp_bench_checks_pass(tray_env, tmp_path, n):
    out = tmp_path / "tp.json"
    run = tray_env.run([sys.executable, "-m", "tray", "bench", "tp", "-n", str(n), "--backend", "host", "--sizes",
                        "8,1040,4096", "--tokens", "1,3", "--hidden", "64", "--ffn", "128", "--repeats", "2",
                        "--json", str(out)])
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["passed"]
    assert [s["bytes"] for s in report["sizes"]] == [8, 1040, 4096]
    for s in report["sizes"]:  # 8 B: 4 elements, all in the tail; 1040 B: 520 elements over n chunks
        c = s["checks"]
        assert c["wrong"] == {"ar_oneshot": 0, "ar_twoshot": 0, "ar_nccl": 0} and c["peer_identical_on_all_ranks"]
        assert s["us"]["ar_peer"] == min(s["us"]["ar_oneshot"], s["us"]["ar_twoshot"]) > 0 and s["us"]["ar_nccl"] > 0
    assert [t["tokens"] for t in report["tokens"]] == [1, 3]
    for t in report["tokens"]:
        c = t["checks"]
        assert c["mlp_peer_vs_one_gpu_rel_err"] < 1e-2 and c["two_shot_equals_one_shot"], c
        assert t["us"]["mlp_one_gpu"] > 0


def test_tp_refuses_odd_byte_sizes(tray_env):
    run = tray_env.run(
        [sys.executable, "-m", "tray", "bench", "tp", "-n", "2", "--backend", "host", "--sizes", "25"]
    )
    assert run.returncode == 2 and "even byte counts" in run.stderr, run.output
