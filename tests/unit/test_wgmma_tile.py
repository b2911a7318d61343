"""The Hopper wgmma expert GEMMs without a GPU: the shape read from ep_gemm_wgmma.cu and its options, the ring's
shared memory and grid, the limits the source's #error lines enforce (run through the C preprocessor), the
ep_moe manifest's experts_wgmma launches, the --gemm wgmma selection and its refusal below compute capability
9.0, the bench's wgmma cases, and the mismatch report the GPU checks print."""

from __future__ import annotations

import json
import shutil
import subprocess
import types

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
    swiglu_tile,
    wgmma_tile,
    wgmma_tile_of,
)
from tray.programs.ep_moe.rank_program import EXPERTS_PROGRAM, GEMM_KERNELS, resolve_gemm
from tray.programs.ep_moe.tma import TENSOR_MAP_BYTES, encode_weight_map, weight_map_args, write_weight_maps

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


def test_the_manifest_launches_experts_wgmma_with_the_compiled_shape():
    program, suffix = "experts_wgmma", ""
    kernels = {k["name"]: k for k in MANIFEST["kernels"]}
    tiles = {}
    for name, entry in ((f"ep_wgmma_gemm{suffix}", "ep_wgmma_gemm"),
                        (f"ep_wgmma_swiglu_gather{suffix}", "ep_wgmma_gemm_gather")):
        k = kernels[name]
        assert k["source"] == "kernels/ep_gemm_wgmma.cu" and k["entry"] == entry
        assert "--gpu-architecture=sm_90a" in k["options"]
        tiles[name] = wgmma_tile_of(SOURCE, k["options"])
    stages = 4  # one ring at every batch (rank_program.EXPERTS_PROGRAM's note)
    # w2: the plain TMA build; w13: the same ring in SwiGLU mode (it writes act, and h13 is never written), its
    # blocks row tile fastest (WG_RASTER 1; w2's column tile fastest)
    assert tiles[f"ep_wgmma_gemm{suffix}"] == WgmmaTile(256, stages, 1, 1)
    assert tiles[f"ep_wgmma_swiglu_gather{suffix}"] == WgmmaTile(256, stages, 1, 1, 1, raster=1)
    programs = {p["name"]: p["ops"] for p in MANIFEST["programs"]}
    wg, masked = programs[program], programs["experts_masked"]
    assert [op["kernel"] for op in wg] == [f"ep_wgmma_swiglu_gather{suffix}", f"ep_wgmma_gemm{suffix}"]
    assert [op["kernel"] for op in masked] == ["ep_masked_gemm_gather", "ep_silu_mul_rows", "ep_masked_gemm"]
    # the gate/up GEMM: the masked one's arguments with act for h13 (its output is the activation), then the map
    # of w13 in SwiGLU boxes at wg_tmaps + 256; w2: the masked one's, then w2's map at + 128 (the rank writes both)
    w13_args = [("act" if a == "h13" else a) for a in masked[0]["args"]]
    for op, args, tile in ((wg[0], w13_args + ["wg_tmaps@256"], tiles[f"ep_wgmma_swiglu_gather{suffix}"]),
                           (wg[1], masked[2]["args"] + ["wg_tmaps@128"], tiles[f"ep_wgmma_gemm{suffix}"])):
        assert op["args"] == args, op
        assert op["block"] == tile.threads and op["shmem"] == tile.smem, op
        assert op["grid"][0].endswith(f"+ {tile.bn - 1}) // {tile.bn}"), op
        assert op["grid"][1] == f"(cap + {tile.bm - 1}) // {tile.bm}" and op["grid"][2] == masked[0]["grid"][2], op
    # the gate/up grid runs over the 2 ffn rows of w13 (WG_BN / 2 columns of act per block)
    assert wg[0]["grid"][0] == masked[0]["grid"][0].replace("127) // 128", "255) // 256")
    buffers = {b["name"]: b for b in MANIFEST["buffers"]}
    assert buffers["wg_tmaps"]["dtype"] == "u8" and buffers["wg_tmaps"]["shape"] == [3 * 128]
    # the rank encodes w13's SwiGLU map from this shape
    assert swiglu_tile() == tiles["ep_wgmma_swiglu_gather"] and swiglu_tile().b_box_rows == 64


def test_the_swiglu_builds_exp_and_silu_are_ep_maths_text():
    """ep_gemm_wgmma.cu carries its own ep_exp and silu_mul (NVRTC compiles each file alone): the same text as
    ep_math.cu's, so SwiGLU mode's act bytes equal ep_silu_mul_rows's."""
    math = (MANIFESTS / "kernels" / "ep_math.cu").read_text()

    def body(text: str, name: str) -> str:
        start = text.index(f"__device__ __forceinline__ float {name}(")
        return text[start : text.index("\n}\n", start) + 3]

    for name in ("ep_exp", "silu_mul"):
        assert body(SOURCE, name) == body(math, name), name


def test_gemm_selection_covers_every_gemm_kernel_and_program():
    names = {k["name"] for k in MANIFEST["kernels"]}
    programs = {p["name"] for p in MANIFEST["programs"]}
    assert {n for n in names if "gemm" in n} <= set(GEMM_KERNELS) <= names
    assert set(EXPERTS_PROGRAM.values()) <= programs and "wgmma" in GEMMS
    assert GEMM_KERNELS["ep_wgmma_gemm"] == GEMM_KERNELS["ep_wgmma_swiglu_gather"] == ("wgmma",)
    assert GEMM_KERNELS["ep_silu_mul_rows"] == ("masked",)  # the wgmma gate/up GEMM applies the activation itself
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


# --- TMA mode (WG_TMA 1): the weights' tensor map fields and the tile's bookkeeping -------------------------


def test_tma_mode_shape_options_and_limits():
    tma = wgmma_tile_of(SOURCE, ["-DWG_BN=256", "-DWG_STAGES=4", "-DWG_WS=1", "-DWG_TMA=1"])
    assert tma == WgmmaTile(256, 4, 1, 1) and tma.threads == 384 and wgmma_tile_of(SOURCE, tma.options) == tma
    assert wgmma_tile_of(SOURCE).tma == 0 and "-DWG_TMA=0" in WgmmaTile(256, 4).options
    assert tma.smem == WgmmaTile(256, 4, 1).smem == 197632  # the same ring; the map lives in global memory
    assert tma.b_box_bytes == 256 * 64 * 2 == 32768 and WgmmaTile(128, 6, 1, 1).b_box_bytes == 16384
    tma.check()
    for bad in (WgmmaTile(256, 4, 0, 1), WgmmaTile(256, 4, 1, 2)):
        with pytest.raises(ValueError, match="WG_TMA 0 or 1 \\(1 only with WG_WS 1\\)"):
            bad.check()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the C preprocessor)")
@pytest.mark.parametrize("ws, tma", [(1, 1), (0, 1), (1, 2), (0, 0)])
def test_the_tma_limits_are_the_sources_error_lines(ws, tma):
    run = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-DWG_BN=256", "-DWG_STAGES=4", f"-DWG_WS={ws}",
                          f"-DWG_TMA={tma}", str(KERNEL)], capture_output=True, text=True, timeout=60)
    try:
        WgmmaTile(256, 4, ws, tma).check()
        refused = False
    except ValueError:
        refused = True
    assert (run.returncode != 0) == refused, run.stderr


@pytest.mark.parametrize("experts, n, k, bn, strides", [
    (128, 4096, 7168, 256, (14336, 58720256)),  # w13 of the layer: [128][2 x 2048][7168]
    (128, 7168, 2048, 256, (4096, 29360128)),   # w2: [128][7168][2048]
    (3, 200, 72, 128, (144, 28800)),            # partial boxes in N and K (zero-filled by the map)
])
def test_weight_map_fields_against_hand_computed_values(experts, n, k, bn, strides):
    args = weight_map_args(experts, n, k, bn)
    assert args.dtype == "BFLOAT16" and args.rank == 3
    assert args.dims == (k, n, experts)  # innermost first: K contiguous, then the expert's rows, then experts
    assert args.strides == strides == (2 * k, 2 * n * k)  # bytes, dimensions 1 and 2
    assert args.box == (64, bn, 1) and args.element_strides == (1, 1, 1)
    assert args.box_bytes == WgmmaTile(bn, 4, 1, 1).b_box_bytes  # what the kernel's expect_tx counts
    assert (args.swizzle, args.interleave, args.l2, args.oob_fill) == ("128B", "NONE", "L2_256B", "NONE")
    assert args.box[0] * 2 == 128 and all(s % 16 == 0 for s in args.strides)  # the 128-byte swizzle's span


@pytest.mark.parametrize("experts, n, k, bn, match", [
    (128, 4096, 7164, 256, "multiple of 8"),
    (128, 4096, 7168, 48, "32, 64, 128 or 256 rows; got 48"),
    (0, 4096, 7168, 256, r"every extent >= 1; got \[0\]\[4096\]\[7168\]"),
])
def test_weight_map_refuses_what_the_driver_or_kernel_would(experts, n, k, bn, match):
    with pytest.raises(ValueError, match=match):
        weight_map_args(experts, n, k, bn)


class _FakeEnum:
    """Stands for a cuda.bindings enum class: each member is its own name."""

    def __getattr__(self, name: str) -> str:
        return name


def _fake_cu(result):
    calls = []

    def encode(*args):
        calls.append(args)
        return result

    fake = types.SimpleNamespace(CUtensorMapDataType=_FakeEnum(), CUtensorMapInterleave=_FakeEnum(),
                                 CUtensorMapSwizzle=_FakeEnum(), CUtensorMapL2promotion=_FakeEnum(),
                                 CUtensorMapFloatOOBfill=_FakeEnum(), cuTensorMapEncodeTiled=encode,
                                 cuuint64_t=lambda v: ("u64", v), cuuint32_t=lambda v: ("u32", v))
    return fake, calls


def test_tensor_map_encode_passes_the_fields_and_returns_the_128_bytes(monkeypatch):
    from tray.backend.cuda import driver as drv

    words = types.SimpleNamespace(opaque=list(range(1, 17)))
    fake, calls = _fake_cu((0, words))
    monkeypatch.setattr(drv, "cu", fake)
    raw = drv.tensor_map_encode_tiled(weight_map_args(128, 7168, 2048, 256), 0x7F0000000000)
    assert raw == b"".join(i.to_bytes(8, "little") for i in range(1, 17)) and len(raw) == TENSOR_MAP_BYTES
    (call,) = calls
    assert call == ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 3, 0x7F0000000000,
                    [("u64", 2048), ("u64", 7168), ("u64", 128)], [("u64", 4096), ("u64", 29360128)],
                    [("u32", 64), ("u32", 256), ("u32", 1)], [("u32", 1)] * 3, "CU_TENSOR_MAP_INTERLEAVE_NONE",
                    "CU_TENSOR_MAP_SWIZZLE_128B", "CU_TENSOR_MAP_L2_PROMOTION_L2_256B",
                    "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE")
    try:
        from cuda.bindings import driver as real
    except ImportError:
        return  # a CPU install without the gpu extra: the names are checked where the bindings are
    for enum, name in zip(("CUtensorMapDataType", "CUtensorMapInterleave", "CUtensorMapSwizzle",
                           "CUtensorMapL2promotion", "CUtensorMapFloatOOBfill"), call[0:1] + call[7:], strict=True):
        assert hasattr(getattr(real, enum), name), (enum, name)


def test_tensor_map_encode_failure_names_the_fields(monkeypatch):
    from tray.backend.cuda import driver as drv

    fake, _ = _fake_cu((1, None))
    monkeypatch.setattr(drv, "cu", fake)
    with pytest.raises(drv.CudaError, match=r"cuTensorMapEncodeTiled\(BFLOAT16 at 0x1000, dims \[72, 200, 3\], "
                                            r"strides \[144, 28800\], box \[64, 128, 1\]"):
        drv.tensor_map_encode_tiled(weight_map_args(3, 200, 72, 128), 0x1000)
    with pytest.raises(ValueError, match="16-byte aligned"):
        encode_weight_map(0x1008, 3, 200, 72, 128)


def test_write_weight_maps_places_each_map_at_its_slot():
    written = []
    backend = types.SimpleNamespace(write=lambda ptr, data: written.append((ptr, bytes(data))))
    buf = types.SimpleNamespace(ptr=0x10000, nbytes=4 * TENSOR_MAP_BYTES)
    maps = [bytes([1]) * TENSOR_MAP_BYTES, bytes([2]) * TENSOR_MAP_BYTES]
    write_weight_maps(backend, buf, maps, 2)
    assert written == [(0x10000 + 2 * TENSOR_MAP_BYTES, maps[0] + maps[1])]
    with pytest.raises(ValueError, match="64-byte aligned"):
        write_weight_maps(backend, types.SimpleNamespace(ptr=0x10020, nbytes=512), maps)
    with pytest.raises(ValueError, match="need 640 bytes"):
        write_weight_maps(backend, buf, maps, 3)
    with pytest.raises(ValueError, match="map sizes \\[127\\]"):
        write_weight_maps(backend, buf, [b"\0" * 127])


def test_the_bindings_take_the_encode_arguments():
    """With the real bindings, the call gets past their argument conversion (plain ints for the cuuint32_t
    lists raise TypeError there): it returns the map where a driver is present, else the driver's absence."""
    pytest.importorskip("cuda.bindings.driver")
    from tray.backend.cuda import driver as drv

    try:
        raw = drv.tensor_map_encode_tiled(weight_map_args(3, 200, 72, 128), 1 << 21)
    except drv.CudaError as exc:
        assert exc.code == "LIBRARY_NOT_FOUND", exc
    else:
        assert len(raw) == TENSOR_MAP_BYTES


def test_the_gpu_run_wgmma_stage_names_only_bench_variants():
    """gpu-run.sh's wgmma stage passes --only lists to the bench: a name it does not know would end the run."""
    import re
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "scripts" / "gpu-run.sh").read_text()
    lists = re.findall(r"wg_only=([\w,]+)", script)
    assert lists, "no wg_only list in scripts/gpu-run.sh"
    names = {w.name for w in WGMMA_VARIANTS} | {"production", "wgmma"}
    for listed in lists:
        assert set(listed.split(",")) <= names, sorted(set(listed.split(",")) - names)
    assert any("wgmma_tma_n256s4" in listed.split(",") for listed in lists)
