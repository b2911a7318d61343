"""The Hopper wgmma expert GEMMs without a GPU: the shape read from ep_gemm_wgmma.cu and its options, the ring's
shared memory and grid, the limits the source's #error lines enforce (run through the C preprocessor), the
ep_moe manifest's experts_wgmma launches, the --gemm wgmma selection and its refusal below compute capability
9.0, the bench's wgmma cases, and the mismatch report the GPU checks print."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from conftest import MANIFESTS

from bench.expert_gemm import WGMMA_VARIANTS, main, wgmma_variant
from tray.errors import TrayError, UsageError
from tray.programs.ep_moe.bench import GEMMS, EpBenchArgs, ran_gemm, validate
from tray.programs.ep_moe.gemm_tile import (
    WgmmaTile,
    mismatch_report,
    require_wgmma,
    wgmma_tile,
    wgmma_tile_of,
)
from tray.programs.ep_moe.rank_program import EXPERTS_PROGRAM, GEMM_KERNELS, experts_program, resolve_gemm

KERNEL = MANIFESTS / "kernels" / "ep_gemm_wgmma.cu"
SOURCE = KERNEL.read_text()
MANIFEST = json.loads((MANIFESTS / "ep_moe.json").read_text())


def test_the_shape_comes_from_the_source_defaults_and_the_options():
    base = wgmma_tile_of(SOURCE)
    assert base == WgmmaTile(256, 4)
    assert wgmma_tile_of(SOURCE, ["--gpu-architecture=sm_90a", "-DWG_BN=128", "-DWG_STAGES=6"]) == WgmmaTile(128, 6)
    ws = wgmma_tile_of(SOURCE, ["-DWG_BN=256", "-DWG_STAGES=3", "-DWG_WS=1"])
    assert ws == WgmmaTile(256, 3, 1) and ws.threads == 384 and base.threads == 256 and base.ws == 0
    assert wgmma_tile_of(SOURCE, ws.options) == ws
    with pytest.raises(ValueError, match="no default for WG_STAGES"):
        wgmma_tile_of(SOURCE.replace("#define WG_STAGES", "#define WG_STAGES_X"))


def test_ring_bytes_grid_and_limits():
    t = WgmmaTile(256, 4)
    assert t.smem == 4 * (128 * 64 * 2 + 256 * 64 * 2) + 1024 == 197632
    assert t.grid(4096, 1024, 128) == (16, 8, 128) and t.grid(7168, 1, 1) == (28, 1, 1)
    assert WgmmaTile(128, 6).grid(200, 129, 3) == (2, 2, 3)
    t.check()
    assert WgmmaTile(256, 4, 1).smem == t.smem  # the mbarriers are static shared memory
    for bad in (WgmmaTile(64, 4), WgmmaTile(256, 2), WgmmaTile(256, 5), WgmmaTile(256, 4, 2)):
        with pytest.raises(ValueError, match="WG_BN 128 or 256"):
            bad.check()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the C preprocessor)")
@pytest.mark.parametrize("bn, stages, ws", [(256, 4, 0), (128, 6, 0), (256, 3, 0), (256, 5, 0), (64, 4, 0), (128, 2, 0),
                                           (256, 4, 1), (256, 4, 2), (64, 4, 1)])
def test_the_python_limits_are_the_sources_error_lines(bn, stages, ws):
    """The kernel refuses at compile time exactly the shapes WgmmaTile.check refuses (outside the device pass
    the file preprocesses to nothing but these checks, so the CPU build never sees wgmma)."""
    run = subprocess.run(["g++", "-E", "-P", "-x", "c++", f"-DWG_BN={bn}", f"-DWG_STAGES={stages}", f"-DWG_WS={ws}",
                          str(KERNEL)],
                         capture_output=True, text=True, timeout=60)
    try:
        WgmmaTile(bn, stages, ws).check()
        refused = False
    except ValueError:
        refused = True
    assert (run.returncode != 0) == refused, run.stderr
    assert "asm" not in run.stdout and "__global__" not in run.stdout


@pytest.mark.parametrize("program, suffix", [("experts_wgmma", ""), ("experts_wgmma_prefill", "_s3")])
def test_the_manifest_launches_experts_wgmma_with_the_compiled_shape(program, suffix):
    kernels = {k["name"]: k for k in MANIFEST["kernels"]}
    tiles = set()
    for entry in ("ep_wgmma_gemm", "ep_wgmma_gemm_gather"):
        k = kernels[entry + suffix]
        assert k["source"] == "kernels/ep_gemm_wgmma.cu" and k["entry"] == entry
        assert "--gpu-architecture=sm_90a" in k["options"]
        tiles.add(wgmma_tile_of(SOURCE, k["options"]))
    assert len(tiles) == 1
    tile = tiles.pop()
    assert tile == (wgmma_tile() if not suffix else WgmmaTile(256, 3))
    programs = {p["name"]: p["ops"] for p in MANIFEST["programs"]}
    wg, masked = programs[program], programs["experts_masked"]
    want = [f"ep_wgmma_gemm_gather{suffix}", "ep_silu_mul_rows", f"ep_wgmma_gemm{suffix}"]
    assert [op["kernel"] for op in wg] == want
    for op, ref in zip(wg, masked, strict=True):
        assert op["args"] == ref["args"]  # the same contract, buffer for buffer
        if op["kernel"].startswith("ep_wgmma"):
            assert op["block"] == tile.threads and op["shmem"] == tile.smem, op
            assert op["grid"][0].endswith(f"+ {tile.bn - 1}) // {tile.bn}"), op
            assert op["grid"][1] == f"(cap + {tile.bm - 1}) // {tile.bm}" and op["grid"][2] == ref["grid"][2], op


@pytest.mark.parametrize("gemm, layer_tokens, want", [
    ("wgmma", 256, "experts_wgmma"),            # 128 tokens per EP2 rank: 8 rows per expert
    ("wgmma", 4095, "experts_wgmma"),           # 127.97 rows
    ("wgmma", 4096, "experts_wgmma_prefill"),   # 128 rows: one full M tile
    ("wgmma", 8192, "experts_wgmma_prefill"),   # 4096 per EP2 rank
    ("masked", 8192, "experts_masked"),
])
def test_the_ring_depth_follows_the_rows_per_expert(gemm, layer_tokens, want):
    assert experts_program(gemm, layer_tokens, 8, 256) == want


def test_gemm_selection_covers_every_gemm_kernel_and_program():
    names = {k["name"] for k in MANIFEST["kernels"]}
    programs = {p["name"] for p in MANIFEST["programs"]}
    assert {n for n in names if "gemm" in n} <= set(GEMM_KERNELS) <= names
    assert set(EXPERTS_PROGRAM.values()) <= programs and "wgmma" in GEMMS
    assert GEMM_KERNELS["ep_wgmma_gemm"] == ("wgmma",) and "wgmma" in GEMM_KERNELS["ep_silu_mul_rows"]
    args = {"nprocs": 2, "backend": "host", "experts": 16, "topk": 4, "hidden": 256, "expert_dim": 256}
    validate(EpBenchArgs(**args, gemm="wgmma"))
    with pytest.raises(UsageError, match="--gemm is 'auto', 'masked', 'wgmma', 'cublas', got 'wgmm'"):
        validate(EpBenchArgs(**args, gemm="wgmm"))


def test_wgmma_is_refused_below_and_above_hopper_with_what_to_use():
    require_wgmma((9, 0))
    for cap in ((8, 0), (8, 9), (10, 0), (12, 0)):
        with pytest.raises(UsageError) as exc:
            require_wgmma(cap)
        msg = str(exc.value)
        assert f"this device is {cap[0]}.{cap[1]}" in msg and "9.0" in msg and "--gemm masked" in msg


def test_the_bench_runs_the_manifest_shape_and_valid_variants(capsys):
    assert wgmma_variant().tile == wgmma_tile() and wgmma_variant().name == "wgmma"
    for v in WGMMA_VARIANTS:
        v.tile.check()
        assert v.options[0] == "--gpu-architecture=sm_90a" and wgmma_tile_of(SOURCE, v.options) == v.tile
    with pytest.raises(SystemExit) as exc:
        main(["--only", "wgmma_n64s9"])
    assert exc.value.code == 2 and "wgmma_n128s6" in capsys.readouterr().err


def test_mismatch_report_names_rows_columns_and_values():
    want = np.arange(32, dtype=np.float64).reshape(4, 8)
    assert mismatch_report(want + 0.01, want, 0.0, 0.02) == ""
    got = want.copy()
    got[1, 2:5] += 1.0
    got[3, 7] = np.nan
    report = mismatch_report(got, want, 0.0, 0.5)
    assert report.startswith("4 of 32 elements off") and "rows 1, 3;" in report and "cols 2-4, 7;" in report
    assert "(1, 2) 11/10" in report and "(3, 7) nan/31" in report
    with pytest.raises(ValueError, match="2-D arrays of one shape"):
        mismatch_report(got[0], want, 0.0, 0.0)


def _nvrtc():
    """tray's NVRTC entry, or a skip when this machine has no NVRTC (cuda-bindings or its library)."""
    try:
        from tray.backend.cuda import driver
    except ImportError as exc:
        pytest.skip(f"cuda-bindings is not installed here: {exc}")
    try:
        driver.nvrtc_compile('extern "C" __global__ void k() {}', "k.cu", ["--gpu-architecture=compute_90a"], "ptx")
    except (OSError, RuntimeError, driver.CudaError) as exc:
        pytest.skip(f"NVRTC is not available here: {exc}")
    return driver


@pytest.mark.parametrize("shape", list(dict.fromkeys([wgmma_tile(), *(v.tile for v in WGMMA_VARIANTS)])),
                         ids=lambda t: f"{'ws_' if t.ws else ''}n{t.bn}s{t.stages}")
def test_every_shape_compiles_for_sm90a_to_the_wgmma_it_names(shape):
    """NVRTC (no GPU needed) builds each shape the manifest and the bench launch, as the backend does (the
    manifest's arch option kept), into PTX with the full-width wgmma and the half-mode one, the proxy fence
    between cp.async's writes and wgmma's reads, and no NVLink multicast."""
    import re

    from tray.backend.cuda.nvrtc import arch_options, find_multicast

    driver = _nvrtc()
    options = arch_options(["--gpu-architecture=sm_90a", *shape.options], "compute_90")
    assert "--gpu-architecture=compute_90a" in options
    ptx = driver.nvrtc_compile(SOURCE, "ep_gemm_wgmma.cu", options, "ptx").decode()
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16", ptx))
    assert shapes == {str(shape.bn), str(shape.bn // 2)}, shapes
    assert "fence.proxy.async.shared::cta" in ptx and "wgmma.wait_group.sync.aligned" in ptx
    assert ".entry ep_wgmma_gemm(" in ptx and ".entry ep_wgmma_gemm_gather(" in ptx
    assert not find_multicast(ptx)
    # the warp-specialized block: per-stage mbarriers fed by cp.async's arrive, bounded waits, register moves
    ws = ("cp.async.mbarrier.arrive.noinc", "mbarrier.try_wait.parity", "setmaxnreg.inc", "%globaltimer")
    assert all((w in ptx) == bool(shape.ws) for w in ws), [w for w in ws if w in ptx]
    tiles = (".entry ep_wgmma_gemm_tiles(", ".entry ep_wgmma_gemm_tiles_gather(")  # the persistent entries
    assert all((t in ptx) == bool(shape.ws) for t in tiles)


@pytest.mark.parametrize("gemm, backend, cap, want", [
    ("auto", "cuda", (9, 0), "wgmma"), ("auto", "cuda", (8, 0), "masked"), ("auto", "cuda", (10, 0), "masked"),
    ("auto", "host", None, "masked"), ("masked", "cuda", (9, 0), "masked"), ("cublas", "cuda", (9, 0), "cublas"),
    ("wgmma", "cuda", (8, 9), "wgmma"),  # named: require_wgmma refuses it with its own message
])
def test_auto_gemm_is_wgmma_on_hopper_only(gemm, backend, cap, want):
    assert resolve_gemm(gemm, backend, cap) == want


def test_the_report_names_the_gemm_every_rank_ran():
    assert ran_gemm("auto", [{"gemm": "wgmma"}, {"gemm": "wgmma"}], {"gemm": "wgmma"}) == "wgmma"
    with pytest.raises(TrayError, match=r"--gemm auto: the ranks ran different expert GEMMs \(masked, wgmma\)"):
        ran_gemm("auto", [{"gemm": "wgmma"}, {"gemm": "masked"}], {"gemm": "wgmma"})
