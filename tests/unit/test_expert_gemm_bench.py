"""bench/expert_gemm.py without a GPU: its production shape is the manifest's, each variant's shared memory is
the kernel's formula, and bad arguments are usage errors (exit 2) that say what was expected."""

from __future__ import annotations

import pytest

from bench.expert_gemm import VARIANTS, main, production_variant
from tray.programs.ep_moe.gemm_tile import GemmTile, masked_tile


def test_production_is_the_manifest_tile_shape():
    prod = production_variant()
    assert (prod.bm, prod.bn, prod.bk, prod.stages, prod.prefetch, prod.ldmatrix, prod.pipe) == masked_tile().values()
    assert prod.options == masked_tile().options


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_every_variant_passes_the_shared_memory_its_ring_needs(v):
    tile = GemmTile(v.bm, v.bn, v.bk, v.stages, v.prefetch, v.ldmatrix, v.pipe)
    assert v.smem == tile.smem and v.dynamic_smem == tile.dynamic_smem and v.options == tile.options
    assert v.smem <= 227 << 10  # an H100/H200 block's shared-memory limit


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--experts", "7"], "must be positive and divide --all-experts"),
        (["--only", "t1x1"], "no variant t1x1"),
        (["--hidden", "7164"], "multiples of 8"),
        (["--routing", "skewed"], "a routing is 'uniform', 'zipf'"),
        (["--tokens", "12,x"], "comma-separated counts"),
    ],
)
def test_bad_arguments_are_usage_errors(capsys, argv, says):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err
