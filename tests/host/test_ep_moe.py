"""The EP MoE bench and its manifest on real host-backend trays; weights loaded per rank from safetensors."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import MANIFESTS

EP_MOE = str(MANIFESTS / "ep_moe.json")
TINY = ["--hidden", "64", "--experts", "8", "--topk", "2", "--expert-dim", "32", "--repeats", "2"]


HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.skipif(HAVE_MATPLOTLIB, reason="matplotlib is installed: --plot works")
def test_plot_without_the_extra_is_a_usage_error(tray_env, tmp_path):
    run = tray_env.run([sys.executable, "-m", "tray", "bench", "ep-moe", "-n", "2", "--backend", "host",
                        "--plot", str(tmp_path / "ep.png")])
    assert run.returncode == 2 and "tray[plot]" in run.stderr, run.output
    assert not (tmp_path / "ep.png").exists()


@pytest.mark.parametrize("n, tokens", [(2, "4,8"), (4, "4")])
def test_bench_checks_pass_and_report(tray_env, tmp_path, n, tokens):
    out = tmp_path / "ep.json"
    run = tray_env.run(
        [
            sys.executable,
            "-m",
            "tray",
            "bench",
            "ep-moe",
            "-n",
            str(n),
            "--backend",
            "host",
            "--tokens",
            tokens,
            *TINY,
            "--json",
            str(out),
            *(["--plot", str(tmp_path / "ep.png")] if HAVE_MATPLOTLIB else []),
        ]
    )
    assert run.returncode == 0, run.output
    assert "PASSED" in run.stdout
    assert (tmp_path / "ep.png").is_file() == HAVE_MATPLOTLIB
    report = json.loads(out.read_text())
    assert report["passed"] and report["environment"]["commit"]
    for r in report["runs"]:
        c = r["checks"]
        assert c["peer_rows_differ_from_ep1"] == 0 and c["nccl_rows_differ_from_ep1"] == 0, c
        assert c["ep1_vs_float64_rel_err"] < 1e-2, c
        assert c["recv_counts_ok"] and c["nan_rows"] == 0
        for path in ("peer", "nccl", "ep1"):
            assert set(r["us"][path]) == {"dispatch", "experts", "combine", "reduce", "layer"}
            assert all(v > 0 for v in r["us"][path].values())
        assert r["gbps"]["ceiling"] > 0 and r["ratios"]["epn_layer_vs_ep1_layer"] > 0


def test_too_small_cap_is_refused_before_launch(tray_env):
    run = tray_env.run(
        [
            sys.executable,
            "-m",
            "tray",
            "bench",
            "ep-moe",
            "-n",
            "2",
            "--backend",
            "host",
            "--tokens",
            "16",
            *TINY,
            "--cap",
            "1",
        ]
    )
    assert run.returncode == 2, run.output
    assert "more than cap 1" in run.stderr


DISPATCH_OVERFLOW = """
import tray.programs.ep_moe.twins  # the host twins of the manifest's kernels, registered before init
with tray.init() as rank:
    T, K = 4, 2
    rank.write("route_expert", np.array([0, 1] * T, np.int32))
    pos = np.zeros(T * K, np.int32)
    pos[3] = 8                                   # cap is 8: this pair overflows
    rank.write("route_pos", pos)
    rank.write("send_counts", np.zeros(8, np.int32))
    rank.run("dispatch", {"tokens": T, "cap": 8, "capp": 8})
    rank.synchronize()
    err = rank.read("err")
    assert err[0] & 1 and err[1] == 1, err
    print("overflow caught")
"""


def test_a_kernel_without_a_twin_is_named_with_how_to_register_one(tray_env):
    vars_ = ["max_tokens=4", "tokens=4", "max_cap=8", "cap=8", "max_capp=8", "capp=8"]
    args = [a for v in vars_ for a in ("--var", v)]
    body = 'with tray.init() as rank:\n    rank.run("dispatch", {"tokens": 4, "cap": 8, "capp": 8})\n'
    run = tray_env.launch(2, body, "--manifest", EP_MOE, *args)
    assert run.returncode != 0
    assert "kernel 'ep_dispatch' has no host twin" in run.output
    assert '@tray.twin("ep_dispatch")' in run.output


def test_dispatch_flags_a_pair_beyond_capacity(tray_env):
    vars_ = [
        "hidden=64",
        "experts=8",
        "topk=2",
        "ffn=32",
        "max_tokens=4",
        "tokens=4",
        "max_cap=8",
        "cap=8",
        "max_capp=8",
        "capp=8",
    ]
    args = [a for v in vars_ for a in ("--var", v)]
    run = tray_env.launch(2, DISPATCH_OVERFLOW, "--manifest", EP_MOE, *args)
    assert run.returncode == 0, run.output
    assert run.stdout.count("overflow caught") == 2


WEIGHTS_MANIFEST = {
    "format": 1,
    "name": "expert_weights",
    "vars": {"experts": 8, "ffn": 4, "hidden": 16},
    "buffers": [
        {
            "name": "w13",
            "dtype": "bf16",
            "shape": ["experts // world_size", "2 * ffn", "hidden"],
            "bind": {
                "file": "ckpt.safetensors",
                "tensors": ["experts.{e}.w1", "experts.{e}.w3"],
                "range": {"e": ["experts // world_size * rank", "experts // world_size"]},
            },
        },
        {
            "name": "norm",
            "dtype": "f32",
            "shape": ["hidden"],
            "bind": {"file": "ckpt.safetensors", "tensors": ["norm"]},
        },
        {"name": "scratch", "dtype": "f32", "shape": [4]},
    ],
}

LOAD_WEIGHTS = """
import ml_dtypes
import tray.weights
with tray.init() as rank:
    report = tray.weights.load_weights(rank)
    E, F, H, G, r = 8, 4, 16, rank.world_size, rank.rank
    rng = np.random.default_rng(0)
    w = {f"experts.{e}.{n}": rng.standard_normal((F, H)).astype(ml_dtypes.bfloat16)
         for e in range(E) for n in ("w1", "w3")}
    mine = range(r * E // G, (r + 1) * E // G)
    want = np.stack([np.concatenate([w[f"experts.{e}.w1"], w[f"experts.{e}.w3"]]) for e in mine])
    assert rank.read("w13").tobytes() == want.tobytes()
    assert rank.read("norm").tobytes() == np.arange(H, dtype=np.float32).tobytes()
    assert report.nbytes == want.nbytes + 4 * H and report.tensors == 2 * len(mine) + 1
    print("weights ok")
"""


def write_checkpoint(tmp_path):
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    w = {
        f"experts.{e}.{n}": rng.standard_normal((4, 16)).astype(ml_dtypes.bfloat16)
        for e in range(8)
        for n in ("w1", "w3")
    }
    w["norm"] = np.arange(16, dtype=np.float32)
    save_file(w, str(tmp_path / "ckpt.safetensors"))


def test_each_rank_loads_its_experts(tray_env, tmp_path):
    write_checkpoint(tmp_path)
    manifest = tmp_path / "weights.json"
    manifest.write_text(json.dumps(WEIGHTS_MANIFEST))
    run = tray_env.launch(4, LOAD_WEIGHTS, "--manifest", str(manifest))
    assert run.returncode == 0, run.output
    assert run.stdout.count("weights ok") == 4


def test_a_bad_checkpoint_fails_the_tray_naming_file_and_tensor(tray_env, tmp_path):
    write_checkpoint(tmp_path)
    doc = json.loads(json.dumps(WEIGHTS_MANIFEST))
    doc["buffers"][0]["bind"]["tensors"] = ["experts.{e}.w1", "experts.{e}.w2"]
    manifest = tmp_path / "weights.json"
    manifest.write_text(json.dumps(doc))
    run = tray_env.launch(2, LOAD_WEIGHTS, "--manifest", str(manifest))
    assert run.returncode != 0
    assert (
        "ckpt.safetensors: no tensor 'experts.0.w2'" in run.output or "no tensor 'experts.4.w2'" in run.output
    )
