"""The EP MoE layer on GPUs: the device layout's reports, and the bench's checks (EP-N == EP1 byte for byte
over peer buffers, in the low-latency mode and over NCCL, after timed graph replays too; EP1 vs float64 over
every expert)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import MANIFESTS, gpu_ranks, gpus_shared

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "host"))

pytestmark = pytest.mark.gpu


def test_layout_reports_drops_and_bad_ids_on_gpu(tray_env):
    from test_ep_moe import LAYOUT_REPORTS

    if gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs")
    vars_ = ["hidden=64", "experts=8", "topk=2", "ffn=32", "max_tokens=4", "tokens=4", "max_cap=8", "cap=8", "groups=2"]
    args = [a for v in vars_ for a in ("--var", v)]
    run = tray_env.launch(
        2, LAYOUT_REPORTS, "--manifest", str(MANIFESTS / "ep_moe.json"), *args, backend="cuda", timeout_s=180
    )
    assert run.returncode == 0, run.output
    assert run.stdout.count("layout reports") == 4  # two ranks, the standard and the low-latency dispatch


def test_gather_gemm_equals_the_dense_gemm_over_the_fanned_out_slab_on_gpu(tray_env):
    """The tensor-core GEMM reading received rows through the layout's slot index writes the bytes the dense
    GEMM writes over the slab the fanout filled (real cp.async, not the CPU emulation's)."""
    from test_ep_moe import GATHER_EQUALS_SLAB

    if gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs")
    vars_ = ["hidden=64", "experts=8", "topk=2", "ffn=32", "max_tokens=16", "tokens=16", "max_cap=16", "cap=16",
             "groups=2"]
    args = [a for v in vars_ for a in ("--var", v)]
    run = tray_env.launch(
        2, GATHER_EQUALS_SLAB, "--manifest", str(MANIFESTS / "ep_moe.json"), *args, backend="cuda", timeout_s=180
    )
    assert run.returncode == 0, run.output
    assert run.stdout.count("gather equals slab") == 2


def test_fp8_dispatch_writes_the_twin_recipe_bytes_on_gpu(tray_env):
    """The CUDA ep_dispatch_fp8 / ep_dequant_fp8 over two GPUs write, byte for byte, the e4m3 bytes, scales and
    rebuilt bf16 rows of the host recipe (tray/programs/ep_moe/twins.py), subnormals and saturation included."""
    from test_ep_moe import FP8_EQUALS_TWIN

    if gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs")
    vars_ = ["hidden=256", "experts=8", "topk=2", "ffn=32", "max_tokens=6", "tokens=6", "max_cap=8", "cap=8",
             "groups=2"]
    args = [a for v in vars_ for a in ("--var", v)]
    run = tray_env.launch(
        2, FP8_EQUALS_TWIN, "--manifest", str(MANIFESTS / "ep_moe.json"), *args, backend="cuda", timeout_s=180
    )
    assert run.returncode == 0, run.output
    assert run.stdout.count("fp8 equals twin") == 2


def test_fp8_dispatch_bench_passes_on_gpu(tray_env, tmp_path):
    """--dispatch bf16,fp8: EP2's FP8 outputs equal EP1's byte for byte (after the timed replays too), and the
    FP8 layer's error against the bf16 layer and float64 is above zero and within e4m3's few percent."""
    if gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "ep.json"
    cmd = [sys.executable, "-m", "tray", "bench", "ep-moe", "-n", "2", "--backend", "cuda", "--tokens", "64",
           "--hidden", "1024", "--experts", "32", "--topk", "4", "--expert-dim", "512", "--routing", "uniform,zipf",
           "--sms", "all,8", "--repeats", "3", "--dispatch", "bf16,fp8", "--json", str(out)]
    run = tray_env.run(cmd, timeout_s=600)
    assert run.returncode == 0, run.output
    for r in json.loads(out.read_text())["runs"]:
        c = r["checks"]
        assert c["passed"] and c["fp8_rows_differ_from_ep1_fp8"] == 0 and c["fp8_after_replay_equal"], c
        assert 1e-3 < c["fp8_vs_bf16_rel_err"] < 0.08 and 1e-3 < c["fp8_vs_float64_rel_err"] < 0.08, c
        assert r["us"]["peer"]["dispatch_fp8"] > 0 and r["us"]["peer_sm8"]["dispatch_fp8"] > 0, r["us"]


def test_ll_phases_record_every_phase_on_gpu(tray_env, tmp_path):
    """--ll-phases on 2 GPUs: the diagnosis builds write the production bytes (out and expert_rows after their timed
    launches equal the low-latency path's), every launch's records pass their checks (each block's epoch, every
    boundary stamped, both clocks non-decreasing), and the figures are sane: the spans since the first block's
    entry grow boundary by boundary and fit in one launch's period, the SM clock measured against globaltimer is
    at most the driver's maximum and not far below it, and the stamps cost little beside the production figure."""
    if gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "ep.json"
    cmd = [sys.executable, "-m", "tray", "bench", "ep-moe", "-n", "2", "--backend", "cuda", "--tokens", "64",
           "--hidden", "1024", "--experts", "32", "--topk", "4", "--expert-dim", "512", "--routing", "uniform,zipf",
           "--sms", "all", "--gemm", "masked", "--repeats", "3", "--ll-phases", "--json", str(out)]
    run = tray_env.run(cmd, timeout_s=600)
    assert run.returncode == 0, run.output
    assert "low-latency phases, rank 1:" in run.stdout and "dispatch: diagnosis build" in run.stdout
    for r in json.loads(out.read_text())["runs"]:
        phases = r["ll_phases"]
        assert phases["ok"] and len(phases["per_rank"]) == 2, phases
        for e in phases["per_rank"]:
            assert e["out_equal"] and e["expert_rows_equal"] and e["problems"] == [], e
            clock = e["clock"]
            assert 0.5 < clock["sm_ghz"] < 3.5, clock  # GHz: any GPU of today
            if clock["driver_ghz"] is not None:  # the driver's maximum: at most it, not far below it
                assert 0.3 * clock["driver_ghz"] < clock["sm_ghz"] < 1.02 * clock["driver_ghz"], clock
            for kernel in ("dispatch", "combine"):
                s = e[kernel]
                assert s["launches"] >= 8 and s["blocks"] == r["sms"]["peer"], s
                since = [s["since_entry_us"][b] for b in s["boundaries"][1:]]
                assert all(0 <= a <= b for a, b in zip(since, since[1:], strict=False)) and since[-1] > 0, s
                assert all(p["median"] >= 0 and p["block0"] >= 0 for p in s["phase_us"].values()), s
                if gpus_shared():  # time-sliced: a launch's span and its period are whatever the slices made them
                    continue
                # NOTE: launches in one stream run one after another: a launch's span fits in its period (+ the
                # globaltimer's coarse granularity)
                assert since[-1] < 1.5 * e["us_phases_build"][kernel] + 2, (since, e["us_phases_build"])
                assert e["us_phases_build"][kernel] < 1.5 * e["us_production"][kernel] + 3, e


@pytest.mark.parametrize(
    "tokens, routing, capacity, gemm, nccl_timing",
    [
        ("64,300", "uniform,zipf:1.5", "4", "masked", "eager"),
        ("64", "zipf", "worst", "masked", "eager"),
        ("64", "zipf", "4", "cublas", "eager"),
        # the Hopper warpgroup-MMA GEMMs in the layer (compute capability 9.0; rows of 1 .. 200 per expert)
        ("64,300", "uniform,zipf:1.5", "4", "wgmma", "eager"),
        # the low-latency mode's batch: 128 tokens per rank, hot experts overflowing the capacity
        ("128", "zipf:1.5", "2", "masked", "eager"),
        # NCCL captured in a graph registers the send/recv buffers (local ones included) with its peers
        ("64", "uniform", "4", "masked", "captured"),
    ],
)
def test_ep_bench_passes_on_gpu(tray_env, tmp_path, tokens, routing, capacity, gemm, nccl_timing):
    if gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs")
    if gemm == "wgmma":
        from tray.backend.cuda import CudaBackend
        from tray.programs.ep_moe.gemm_tile import WGMMA_CAPABILITY

        with CudaBackend.open(0) as b:
            if b.capability != WGMMA_CAPABILITY:
                pytest.skip(f"--gemm wgmma needs compute capability 9.0, GPU 0 is {b.capability}")
    out = tmp_path / "ep.json"
    cmd = [
        sys.executable,
        "-m",
        "tray",
        "bench",
        "ep-moe",
        "-n",
        "2",
        "--backend",
        "cuda",
        "--tokens",
        tokens,
        "--hidden",
        "1024",
        "--experts",
        "32",
        "--topk",
        "4",
        "--expert-dim",
        "512",
        "--routing",
        routing,
        "--capacity",
        capacity,
        "--gemm",
        gemm,
        "--nccl-timing",
        nccl_timing,
        "--sms",
        "all,8",
        "--repeats",
        "3",
        "--json",
        str(out),
    ]
    run = tray_env.run(cmd, timeout_s=600)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    for r in report["runs"]:
        c = r["checks"]
        assert c["passed"] and c["after_replay_equal"] and c["layout_reports_ok"], c
        assert c["peer_rows_differ_from_ep1"] == 0 and c["nccl_rows_differ_from_ep1"] == 0, c
        # the low-latency mode: EP2 and EP1 both equal EP1's standard path, after the timed replays too
        assert c["ll_rows_differ_from_ep1"] == 0 and c["ep1_ll_rows_differ_from_ep1"] == 0 and c["ll_equals_peer"], c
        assert all(w[3] == 0 and not w[0] & (4 | 8 | 16) for w in c["err_words"]), c["err_words"]  # no timeout
        assert all(v > 0 for v in r["us"]["peer"].values()) and "peer_sm8" in r["us"], r["us"]
        assert {"dispatch_ll", "combine_ll", "layer_ll"} <= set(r["us"]["peer_sm8"]), r["us"]
        # the masked GEMMs read the received rows in place: only the cuBLAS baseline copies them (fanout)
        assert ("fanout" in r["us"]["peer"]) == (gemm == "cublas"), r["us"]["peer"]
        if capacity == "worst":
            assert r["dropped_pairs"] == 0
