"""The TP bench on real host-backend trays: one-shot peer allreduce exact and identical on every rank."""

from __future__ import annotations

import json
import sys

import pytest


@pytest.mark.parametrize("n", [2, 4])
def test_tp_bench_checks_pass(tray_env, tmp_path, n):
    out = tmp_path / "tp.json"
    run = tray_env.run(
        [
            sys.executable,
            "-m",
            "tray",
            "bench",
            "tp",
            "-n",
            str(n),
            "--backend",
            "host",
            "--sizes",
            "512,1024,4096",
            "--hidden",
            "64",
            "--ffn",
            "128",
            "--repeats",
            "2",
            "--json",
            str(out),
        ]
    )
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["passed"]
    assert [s["bytes"] for s in report["sizes"]] == [512, 1024, 4096]
    for s in report["sizes"]:
        c = s["checks"]
        assert c["peer_exact"] and c["peer_identical_on_all_ranks"] and c["nccl_ok"], c
        assert c["mlp_peer_vs_one_gpu_rel_err"] < 1e-2 and c["mlp_peer_identical_on_all_ranks"], c
        assert s["us"]["ar_peer"] > 0 and s["us"]["ar_nccl"] > 0 and s["us"]["mlp_one_gpu"] > 0


def test_tp_refuses_sizes_that_are_not_whole_vectors(tray_env):
    run = tray_env.run(
        [sys.executable, "-m", "tray", "bench", "tp", "-n", "2", "--backend", "host", "--sizes", "24"]
    )
    assert run.returncode == 2 and "multiples of 16 bytes" in run.stderr, run.output
