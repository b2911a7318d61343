"""The masked GEMM's tile shape as the kernel source and a manifest's options give it, and the ep_moe
manifest's launches of it: a grid or dynamic shared memory that disagreed with the compiled shape would
skip rows or trap on the GPU, so they are checked here."""

from __future__ import annotations

import json

import pytest
from conftest import MANIFESTS

from tray.programs.ep_moe.gemm_tile import GemmTile, masked_tile, tile_of

SOURCE = (MANIFESTS / "kernels" / "ep_gemm.cu").read_text()


def test_options_override_the_source_defaults():
    base = tile_of(SOURCE)
    t = tile_of(SOURCE, ["-DGEMM_BM=32", "-DGEMM_BK=128", "-O3", "-DOTHER=1"])
    assert (t.bm, t.bk) == (32, 128) and (t.bn, t.stages, t.prefetch, t.ldmatrix, t.pipe) == (
        base.bn, base.stages, base.prefetch, base.ldmatrix, base.pipe)
    small = GemmTile(64, 128, 32, 3, 0, 0, 0)
    assert small.smem == 3 * 192 * 40 * 2 and small.dynamic_smem == 0
    assert GemmTile(128, 128, 64, 3, 256, 1, 0).dynamic_smem == 3 * 256 * 72 * 2


def test_a_source_without_a_default_is_refused():
    with pytest.raises(ValueError, match="GEMM_STAGES"):
        tile_of(SOURCE.replace("#define GEMM_STAGES", "#define GEMM_STAGES_X"))


def test_the_manifest_launches_the_masked_gemms_with_the_compiled_tile():
    tile = masked_tile()
    assert tile == tile_of(SOURCE, next(k.get("options", []) for k in json.loads(
        (MANIFESTS / "ep_moe.json").read_text())["kernels"] if k["entry"] == "ep_masked_gemm_gather"))
    ops = [op for p in json.loads((MANIFESTS / "ep_moe.json").read_text())["programs"] for op in p["ops"]
           if op.get("kernel") in ("ep_masked_gemm", "ep_masked_gemm_gather")]
    assert len(ops) >= 2
    for op in ops:
        assert op.get("shmem", 0) == tile.dynamic_smem, op
        assert op["grid"][0].endswith(f"+ {tile.bn - 1}) // {tile.bn}"), op
        assert op["grid"][1] == f"(cap + {tile.bm - 1}) // {tile.bm}", op
        assert op["block"] == 128
