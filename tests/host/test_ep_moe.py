"""The EP MoE bench and its manifest on real host-backend trays; weights loaded per rank from safetensors."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import MANIFESTS

EP_MOE = str(MANIFESTS / "ep_moe.json")
TINY = ["--hidden", "64", "--experts", "8", "--topk", "2", "--expert-dim", "32", "--repeats", "2"]
PEER = {"dispatch", "dispatch_send", "layout", "fanout", "experts", "combine", "reduce", "layer", "dispatch_ll",
        "combine_ll", "layer_ll"}
NCCL = {"dispatch", "experts", "combine", "reduce", "layer"}


HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.skipif(HAVE_MATPLOTLIB, reason="matplotlib is installed: --plot works")
def test_plot_without_the_extra_is_a_usage_error(tray_env, tmp_path):
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
            "--plot",
            str(tmp_path / "ep.png"),
        ]
    )
    assert run.returncode == 2 and "tray[plot]" in run.stderr, run.output
    assert not (tmp_path / "ep.png").exists()


def test_a_kernel_without_a_twin_is_named_with_how_to_register_one(tray_env):
    vars_ = ["max_tokens=4", "tokens=4", "max_cap=8", "cap=8", "groups=2"]
    args = [a for v in vars_ for a in ("--var", v)]
    body = 'with tray.init() as rank:\n    rank.run("dispatch", {"tokens": 4, "cap": 8})\n'
    run = tray_env.launch(2, body, "--manifest", EP_MOE, *args)
    assert run.returncode != 0
    assert "kernel 'ep_dispatch' has no host twin" in run.output
    assert '@tray.twin("ep_dispatch")' in run.output


@pytest.mark.parametrize(
    "n, tokens, routing, gemm, nccl_timing",
    [(2, "4,40", "uniform,zipf:2", "auto", "eager"), (4, "8", "zipf", "cublas", "captured"),
     (2, "8", "zipf", "wgmma", "eager")],  # wgmma: the SwiGLU gate/up GEMM's twin and the dense entry's
)
def test_bench_checks_pass_and_report(tray_env, tmp_path, n, tokens, routing, gemm, nccl_timing):
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
            "--routing",
            routing,
            "--gemm",
            gemm,
            *TINY,
            "--nccl-timing",
            nccl_timing,
            "--json",
            str(out),
            *(["--plot", str(tmp_path / "ep.png")] if HAVE_MATPLOTLIB else []),
        ]
    )
    assert run.returncode == 0, run.output
    assert "PASSED" in run.stdout and "EP1 done" in run.stdout
    assert (tmp_path / "ep.png").is_file() == HAVE_MATPLOTLIB
    report = json.loads(out.read_text())
    assert report["passed"] and report["environment"]["commit"]
    assert report["gemm"] == {"auto": "masked"}.get(gemm, gemm)  # auto: masked off Hopper
    assert len(report["runs"]) == len(tokens.split(",")) * len(routing.split(","))
    for r in report["runs"]:
        c = r["checks"]
        assert c["peer_rows_differ_from_ep1"] == 0 and c["nccl_rows_differ_from_ep1"] == 0, c
        assert c["ll_rows_differ_from_ep1"] == 0 and c["ep1_ll_rows_differ_from_ep1"] == 0 and c["ll_equals_peer"], c
        assert r["ratios"]["peer_ll_dispatch_combine_vs_nccl"] > 0
        assert c["ep1_vs_float64_rel_err"] < 1e-2 and c["layout_reports_ok"] and c["after_replay_equal"], c
        assert c["nan_rows"] == 0
        # the fanout exists for the cuBLAS GEMMs alone: the masked ones read the received rows in place
        peer = PEER if gemm == "cublas" else PEER - {"fanout"}
        for path, phases in (("peer", peer), ("nccl", NCCL), ("ep1", peer)):
            assert set(r["us"][path]) == phases
            assert all(v > 0 for v in r["us"][path].values()), (path, r["us"][path])
        # every figure says how it was taken; eager NCCL figures come with eager peer ones beside them
        assert report["nccl_timing"] == nccl_timing and r["timing"]["peer"] == "captured"
        moved = {"dispatch", "combine", "layer"}
        assert r["timing"]["nccl"] == {p: nccl_timing if p in moved else "captured" for p in NCCL}
        if nccl_timing == "eager":
            assert set(r["us"]["peer_eager"]) == moved and all(v > 0 for v in r["us"]["peer_eager"].values())
            assert r["ratios"]["peer_eager_layer_vs_nccl_layer"] > 0
            assert c["nccl_after_replay_how"] == "eager rerun"
        else:
            assert "peer_eager" not in r["us"] and "nccl_after_replay_how" not in c
        assert r["gbps"]["ceiling"] > 0 and r["ratios"]["epn_layer_vs_ep1_layer"] > 0
        assert r["gbps"]["nvlink_bytes_per_rank"] < r["gbps"]["logical_bytes_per_rank"]
        assert r["cap"] == 4 * r["global_tokens"] * 2 // 8 or r["cap"] == r["global_tokens"]


def test_a_small_capacity_drops_pairs_counted_and_ep1_still_matches(tray_env, tmp_path):
    out = tmp_path / "ep.json"
    args = ["--tokens", "16", "--routing", "zipf:2", *TINY, "--capacity", "1", "--json", str(out)]
    run = tray_env.run([sys.executable, "-m", "tray", "bench", "ep-moe", "-n", "2", "--backend", "host", *args])
    assert run.returncode == 0, run.output
    r = json.loads(out.read_text())["runs"][0]
    assert r["dropped_pairs"] > 0 and r["max_rows_per_expert"] > r["cap"]
    assert r["checks"]["passed"] and r["checks"]["peer_rows_differ_from_ep1"] == 0
    words = r["checks"]["err_words"]  # rank 0 peer, low-latency, NCCL; rank 1 the same; EP1 peer, low-latency
    assert r["checks"]["ll_rows_differ_from_ep1"] == 0
    assert words[0][2] + words[3][2] == words[1][2] + words[4][2] == words[2][2] + words[5][2] == r["dropped_pairs"]
    assert words[6][2] == words[7][2] == r["dropped_pairs"]
    bad = tray_env.run(
        [sys.executable, "-m", "tray", "bench", "ep-moe", "-n", "2", "--backend", "host", "--capacity", "lots"]
    )
    assert bad.returncode == 2 and "--capacity is 'worst' or a positive factor" in bad.stderr


def test_fp8_dispatch_is_timed_matches_ep1_fp8_and_states_its_error(tray_env, tmp_path):
    """--dispatch bf16,fp8: dispatch_fp8 and layer_fp8 timed beside the bf16 figures (which keep their keys),
    EP2's FP8 outputs equal EP1's byte for byte, and the FP8 layer's error against the bf16 layer and float64
    is stated: above zero (the rows really went through e4m3) and below e4m3's few percent."""
    out = tmp_path / "ep.json"
    shape = ["--hidden", "256", "--experts", "8", "--topk", "2", "--expert-dim", "32", "--repeats", "2"]
    args = ["--tokens", "8", "--routing", "zipf", *shape, "--sms", "all", "--dispatch", "bf16,fp8", "--json", str(out)]
    run = tray_env.run([sys.executable, "-m", "tray", "bench", "ep-moe", "-n", "2", "--backend", "host", *args])
    assert run.returncode == 0, run.output
    assert "FP8 accuracy: layer output vs bf16 dispatch" in run.stdout
    report = json.loads(out.read_text())
    assert report["passed"] and report["dispatch"] == ["bf16", "fp8"]
    r = report["runs"][0]
    c = r["checks"]
    assert c["fp8_rows_differ_from_ep1_fp8"] == 0 and c["fp8_after_replay_equal"] and c["fp8_layout_reports_ok"], c
    assert c["fp8_nan_rows"] == 0 and c["peer_rows_differ_from_ep1"] == 0, c
    assert 1e-3 < c["fp8_vs_bf16_rel_err"] < 0.08 and 1e-3 < c["fp8_vs_float64_rel_err"] < 0.08, c
    for path in ("peer", "ep1"):
        assert set(r["us"][path]) == PEER - {"fanout"} | {"dispatch_fp8", "layer_fp8"}
        assert r["us"][path]["dispatch_fp8"] > 0 and r["us"][path]["layer_fp8"] > 0
    # e4m3 bytes + a float32 scale per 128 values: (256 + 8) / 512 of the bf16 row bytes, routing words alike
    g = r["gbps"]
    assert g["nvlink_bytes_per_rank_fp8"] < 0.6 * g["nvlink_bytes_per_rank"] and g["peer_dispatch_fp8_nvlink"] > 0
    bad = tray_env.run([sys.executable, "-m", "tray", "bench", "ep-moe", "-n", "2", "--backend", "host",
                        *TINY, "--dispatch", "bf16,fp8"])
    assert bad.returncode == 2 and "--dispatch fp8 needs --hidden a multiple of 128" in bad.stderr, bad.output


FP8_EQUALS_TWIN = """
from tray.dtypes import f32_to_bf16_bits
from tray.programs.ep_moe.twins import dequantize_fp8, pack_routing, quantize_fp8
with tray.init() as rank:
    T, K, H, E, G = 6, 2, 256, 8, rank.world_size
    L = E // G

    def inputs(r):  # every rank's tokens and routing, from its rank number: each rank knows what it gets
        rng = np.random.default_rng(r)
        x = rng.standard_normal((T, H)).astype(np.float32) * np.float32(2.0 ** (r - 3))
        x[0, :128] = 0.0                                         # a zero block: scale 1, zero bytes
        x[1, 128:] = np.exp2(rng.integers(-133, -127, 128)) * rng.choice([-1, 1], 128)  # bf16 subnormals
        x[2, :128] *= 1e-4
        x[2, 5] = -3e4                                           # one large value: the rest near zero
        x[3, 128:] = 3.3895314e38 * rng.choice([-1, 1], 128)     # the largest finite bf16
        idx = np.array([[t % E, (t + 3) % E] for t in range(T)], np.int32)
        return f32_to_bf16_bits(x), idx, rng.integers(0, 1 << 16, (T, K)).astype(np.uint16)

    x, idx, w = inputs(rank.rank)
    rank.write("x", x)
    rank.write("topk_idx", idx)
    rank.write("topk_w", w)
    rank.write("err", np.zeros(4, np.uint32))
    rank.write("recv", np.full((G * T, H), 0x1234, np.uint16))
    rank.synchronize()
    rank.barrier_of("world").launch()
    rank.run("dispatch_fp8", {"tokens": T, "cap": 8, "blocks": 3, "threads": 64})
    rank.synchronize()
    q8 = rank.read("recv8").reshape(-1, H)[: G * T]
    sc = rank.read("recv8_scale").reshape(-1, H // 128)[: G * T]
    recv = rank.read("recv").view(np.uint16).reshape(-1, H)[: G * T]
    meta = rank.read("meta").reshape(-1, K)[: G * T]
    for s in range(G):
        xs, idxs, ws = inputs(s)
        rows = slice(s * T, (s + 1) * T)
        sent = ((idxs >= rank.rank * L) & (idxs < (rank.rank + 1) * L)).any(axis=1)
        want_q, want_sc = quantize_fp8(xs)
        assert sent.any() and not sent.all(), sent
        assert np.array_equal(meta[rows], pack_routing(idxs, ws, E)), (s, "meta")
        assert np.array_equal(q8[rows][sent], want_q[sent]), (s, "e4m3 bytes")
        assert np.array_equal(sc[rows][sent].view(np.uint32), want_sc[sent].view(np.uint32)), (s, "scales")
        assert np.array_equal(recv[rows][sent], dequantize_fp8(want_q[sent], want_sc[sent])), (s, "rebuilt rows")
        assert (recv[rows][~sent] == 0x1234).all(), (s, "rows not sent here")
    assert rank.read("err").tolist() == [0, 0, 0, 0]
    print("fp8 equals twin")
"""


def test_fp8_dispatch_program_writes_the_twin_recipe_bytes(tray_env):
    """dispatch_fp8 over two ranks' peer buffers: each receiver holds every source's e4m3 bytes and scales for
    the tokens routed to it, the bf16 rows rebuilt from them, and nothing else (on the host backend the twins
    run; tests/gpu runs the same body on the CUDA kernels)."""
    vars_ = ["hidden=256", "experts=8", "topk=2", "ffn=32", "max_tokens=6", "tokens=6", "max_cap=8", "cap=8",
             "groups=2"]
    run = tray_env.launch(2, FP8_EQUALS_TWIN, "--manifest", EP_MOE, *[a for v in vars_ for a in ("--var", v)])
    assert run.returncode == 0, run.output
    assert run.stdout.count("fp8 equals twin") == 2


LAYOUT_REPORTS = """
import tray.programs.ep_moe.twins  # the host twins of the manifest's kernels, registered before init
with tray.init() as rank:
    T, K, cap = 4, 2, 3
    idx = np.array([[0, 5]] * T, np.int32)        # expert 0 gets 2 * T = 8 pairs: 5 over cap 3
    idx[1, 1] = 99                                # out of range: flagged by its source, reaches nobody
                                                  # so expert 5 (rank 1) gets 2 * 3 pairs: 3 over cap
    rank.write("topk_idx", idx)
    rank.write("topk_w", np.zeros(T * K, np.uint16))
    v = {"tokens": T, "cap": cap, "blocks": 2, "threads": 64}
    # the standard dispatch + layout, then the low-latency dispatch (layout inside): same reports, and the
    # same received row (source * T + token) behind each expert slot kept
    for steps in (("dispatch", "layout"), ("dispatch_ll",)):
        rank.write("err", np.zeros(4, np.uint32))
        rank.write("expert_rows", np.full(4, -1, np.int32))
        rank.write("slot_src", np.full(4 * 8, -1, np.int32))
        for p in steps:
            rank.run(p, v)
        rank.synchronize()
        err = rank.read("err")
        rows = rank.read("expert_rows")
        src = rank.read("slot_src")[: 4 * cap].reshape(4, cap)
        if rank.rank == 0:  # expert 0: tokens 0, 1, 2 of source 0 kept
            assert err.tolist() == [3, 1, 5, 0] and rows.tolist() == [3, 0, 0, 0], (steps, err, rows)
            assert src[0].tolist() == [0, 1, 2] and (src[1:] == -1).all(), (steps, src)
        else:  # expert 5 (local 1): tokens 0, 2, 3 of source 0 (its token 1 has no expert 5)
            assert err.tolist() == [3, 1, 3, 0] and rows.tolist() == [0, 3, 0, 0], (steps, err, rows)
            assert src[1].tolist() == [0, 2, 3] and (src[[0, 2, 3]] == -1).all(), (steps, src)
        print("layout reports")
"""


def test_layout_reports_drops_and_bad_ids(tray_env):
    vars_ = ["hidden=64", "experts=8", "topk=2", "ffn=32", "max_tokens=4", "tokens=4", "max_cap=8", "cap=8", "groups=2"]
    args = [a for v in vars_ for a in ("--var", v)]
    run = tray_env.launch(2, LAYOUT_REPORTS, "--manifest", EP_MOE, *args)
    assert run.returncode == 0, run.output
    assert run.stdout.count("layout reports") == 4  # two ranks, the standard and the low-latency dispatch


GATHER_EQUALS_SLAB = """
import tray.programs.ep_moe.twins  # the host twins of the manifest's kernels, registered before init
from tray.programs.ep_moe.gemm_tile import masked_tile
with tray.init() as rank:
    T, K, E, H, F, cap = 16, 2, 8, 64, 32, 16
    L = E // rank.world_size
    rng = np.random.default_rng(rank.rank)
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)  # K distinct experts per token
    rank.write("topk_idx", idx)
    rank.write("topk_w", np.zeros(T * K, np.uint16))
    rank.write("x", (rng.integers(0, 1 << 15, (T, H)) & 0xBFFF).astype(np.uint16))  # finite bf16 of both signs
    rank.write("w13", (rng.integers(0, 1 << 15, (L, 2 * F, H)) & 0xBFFF).astype(np.uint16))
    v = {"tokens": T, "cap": cap, "blocks": 2, "threads": 64}
    for p in ("dispatch", "layout", "fanout"):
        rank.run(p, v)
    buf = {n: rank.buffer(n).ptr for n in ("slab", "recv", "slot_src", "w13", "h13", "expert_rows")}
    tile = masked_tile()  # the manifest's tile shape: its grid and the ring's dynamic shared memory
    grid, block = (-(-2 * F // tile.bn), -(-cap // tile.bm), L), (128, 1, 1)
    outputs = []
    for name, a in (("ep_masked_gemm", [buf["slab"]]), ("ep_masked_gemm_gather", [buf["recv"], buf["slot_src"]])):
        rank.write("h13", np.full((L * cap, 2 * F), 0x7FC0, np.uint16))
        rank.kernel(name).launch(grid, block, [*a, buf["w13"], buf["h13"], buf["expert_rows"], cap, F, 2, H],
                                 tile.dynamic_smem)
        rank.synchronize()
        outputs.append(rank.read("h13").view(np.uint16).reshape(L, cap, 2 * F).copy())
    dense, gathered = outputs
    rows = rank.read("expert_rows")
    present = np.arange(cap)[None, :] < rows[:, None]
    assert rows.sum() > 0 and (dense[present] != 0x7FC0).any() and (dense[~present] == 0x7FC0).all()
    assert np.array_equal(gathered, dense), "the gather GEMM differs from the dense one over the fanned-out slab"
    print("gather equals slab")
"""


def test_gather_gemm_equals_the_dense_gemm_over_the_fanned_out_slab(tray_env):
    vars_ = ["hidden=64", "experts=8", "topk=2", "ffn=32", "max_tokens=16", "tokens=16", "max_cap=16", "cap=16",
             "groups=2"]
    args = [a for v in vars_ for a in ("--var", v)]
    run = tray_env.launch(2, GATHER_EQUALS_SLAB, "--manifest", EP_MOE, *args)
    assert run.returncode == 0, run.output
    assert run.stdout.count("gather equals slab") == 2


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
    assert "ckpt.safetensors: no tensor 'experts.0.w2'" in run.output or "no tensor 'experts.4.w2'" in run.output


def test_ll_phases_on_the_host_backend_is_a_usage_error(tray_env):
    """--ll-phases reads the GPU's clocks: on the host backend (twins without a clock) it is refused before any tray
    starts, saying what it needs."""
    run = tray_env.run([sys.executable, "-m", "tray", "bench", "ep-moe", "-n", "2", "--backend", "host", *TINY,
                        "--ll-phases"])
    assert run.returncode == 2, run.output
    assert "--ll-phases times the low-latency kernels' diagnosis build" in run.stderr
    assert "needs --backend cuda (the host twins have no clock)" in run.stderr and "got --backend host" in run.stderr


LL_PHASE_PLUMBING = """
import tray.programs.ep_moe.twins as ep
from tray.bench.timing import Sampler
from tray.programs.ep_moe.ll_phases import BOUNDARIES, STAMPS, WORDS
from tray.programs.ep_moe.rank_program import LAYER_OF, MoeRank
from tray.twins import u64_at

# Stand-ins for the diagnosis build (the host backend has no clock): the production twin, then a record per block
# with a counter for both clocks, in the launch's epoch slot, as ep_moe.cu's LL_PHASES build lays them out. What
# is tested is the rank side: the programs, the buffer's shape, reading back, checking, summarizing.
ticks = [10**6]

def stand_in(kernel, twin, state_arg):
    n = len(BOUNDARIES[("dispatch", "combine")[kernel]])
    def run(backend, grid, block, *args):
        *prod, phases, blocks, launches = args
        twin(backend, grid, block, *prod)
        epoch = int(u64_at(prod[state_arg], 2)[kernel])
        all_records = u64_at(phases, launches * 2 * blocks * WORDS).reshape(launches, 2, blocks, WORDS)
        rec = all_records[epoch % launches, kernel]
        for b in range(grid[0]):
            stamps = ticks[0] + 1000 * np.arange(n) + 10 * b
            rec[b, :n], rec[b, STAMPS : STAMPS + n], rec[b, 2 * STAMPS + 1] = stamps, 2 * stamps, epoch
        ticks[0] += 100_000
    return run

tray.twin("ep_dispatch_ll_phases")(stand_in(0, ep.ep_dispatch_ll, 7))
tray.twin("ep_combine_ll_phases")(stand_in(1, ep.ep_combine_ll, 6))

@tray.twin("ep_ll_clock")
def clock(backend, grid, block, out, spin_ns):
    u64_at(out, 4)[:] = [1000, 2000, 1000 + spin_ns, 2000 + 2 * spin_ns]

with tray.init() as rank:
    cfg = {"gemm": "masked", "backend": "host", "hidden": 64, "experts": 8, "topk": 2, "ffn": 32, "groups": 2,
           "seed": 0, "ll_phases": True}
    moe = MoeRank(rank, cfg)
    moe.fill_weights()
    T = 8
    rng = np.random.default_rng(rank.rank)
    idx = np.argsort(rng.random((T, 8)), axis=1)[:, :2].astype(np.int32)
    moe.upload(T, {"topk_idx": idx, "topk_w": np.full((T, 2), 0x3F00, np.uint16)})
    run = {"label": "plumbing", "tokens": T, "cap": 16}
    v = moe.budget_vars(run, 2)
    out, err = moe.checked_run(T, moe.programs(v)[LAYER_OF["ll"]])
    rows = rank.read("expert_rows").copy()
    sampler = Sampler(rank, repeats=2, warmup=1, target_s=0.0)
    e = moe.ll_phase_figures(sampler, run, v, {"dispatch_ll": 14.7, "combine_ll": 18.5}, out, rows)
    assert e["ok"] and e["out_equal"] and e["expert_rows_equal"] and e["problems"] == [], e
    assert e["clock"] == {"sm_ghz": 2.0, "spin_ns": 1_000_000}, e["clock"]
    assert e["us_production"] == {"dispatch": 14.7, "combine": 18.5} and e["us_phases_build"]["dispatch"] > 0
    for kernel in ("dispatch", "combine"):
        s = e[kernel]
        # every launch the sampler made (eagerly once, two single replays, warmup and repeats) has its slot
        assert s["launches"] == 6 and s["blocks"] == 2 and s["entry_spread_us"] == 0.01, s
        assert s["phase_us"]["sent"] == {"median": 1.0, "max_block": 1.0, "block0": 1.0}, s
    wrong = moe.ll_phase_figures(sampler, run, v, {}, out ^ 1, rows)
    assert not wrong["ok"] and not wrong["out_equal"] and "other bytes" in wrong["problems"][0], wrong
    print("ll phases plumbing")
"""


def test_ll_phase_figures_run_the_diagnosis_programs_and_check_their_records(tray_env):
    """The rank side of --ll-phases on host trays, the diagnosis kernels played by stand-ins with counter clocks:
    both ranks time the phase programs in lockstep, read every launch's records back, summarize them, and name a
    diagnosis build whose output differs from the production one's."""
    vars_ = ["hidden=64", "experts=8", "topk=2", "ffn=32", "max_tokens=8", "tokens=8", "max_cap=16", "cap=16",
             "groups=2", "ll_phase_blocks=4", "ll_phase_launches=64"]
    args = [a for v in vars_ for a in ("--var", v)]
    run = tray_env.launch(2, LL_PHASE_PLUMBING, "--manifest", EP_MOE, *args, timeout_s=120)
    assert run.returncode == 0, run.output
    assert run.stdout.count("ll phases plumbing") == 2


def test_a_rank_outside_a_bound_buffers_group_loads_it_too(tray_env, tmp_path):
    """Every rank allocates every buffer, so every rank fills it: a rank in no instance of the buffer's group (an
    explicit group that leaves it out) has no member index, which only a bind naming {index} needs. load_weights
    failed on such a rank whatever the bind ("rank 0 is no member of group 'odd'"); a bind that names {index} there
    is a ManifestError saying why."""
    write_checkpoint(tmp_path)
    doc = {"format": 1, "name": "outside", "vars": {"hidden": 16}, "groups": [{"name": "odd", "ranks": [[1]]}],
           "buffers": [{"name": "norm", "dtype": "f32", "shape": ["hidden"], "export": True, "group": "odd",
                        "bind": {"file": "ckpt.safetensors", "tensors": ["norm"]}}]}
    manifest = tmp_path / "outside.json"
    manifest.write_text(json.dumps(doc))
    body = """
import tray.weights
with tray.init() as rank:
    tray.weights.load_weights(rank)
    assert rank.read("norm").tobytes() == np.arange(16, dtype=np.float32).tobytes()
    print("loaded outside" if rank.rank == 0 else "loaded inside")
"""
    run = tray_env.launch(2, body, "--manifest", str(manifest))
    assert run.returncode == 0, run.output
    assert "loaded outside" in run.stdout and "loaded inside" in run.stdout
    doc["buffers"][0]["bind"]["tensors"] = ["norm{index}"]
    manifest.write_text(json.dumps(doc))
    # rank 0 alone loads (rank 1 would fail on its own account: the file holds no 'norm0'), rank 1 waits for it
    alone = """
import tray.weights
with tray.init() as rank:
    if rank.rank == 0:
        tray.weights.load_weights(rank)
    rank.barrier(timeout_s=60)
"""
    run = tray_env.launch(2, alone, "--manifest", str(manifest))
    assert run.returncode != 0, run.output
    assert "{index} in 'norm{index}': rank 0 is in no instance of the buffer's group 'odd'" in run.stderr, run.stderr
