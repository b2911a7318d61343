"""The low-latency allreduce's launch shape: manifest vars ll_threads / ll_lines (defaults: the shape it always had,
256 threads, one line of 4 bf16 per thread; the dense format's ll3_threads / ll3_lines: 128 and 1) and the bench's
--ll-shapes grammar."""

from __future__ import annotations

import pytest

from tray.errors import UsageError
from tray.manifest.builtin import builtin_path
from tray.manifest.load import load_manifest
from tray.programs.tp_mlp.ll import LLShape, parse_ll_shapes

LL_PROGRAMS = ("ar_ll", "mlp_ll", "ll_stress")


def _ll_launches(vars_: dict[str, int]) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    resolved = load_manifest(builtin_path("tp_mlp")).resolve(2, vars_)
    return [(op.grid, op.block) for name in LL_PROGRAMS for op in resolved.program(name).ops
            if getattr(op, "kernel", None) == "tp_ll_allreduce"]


@pytest.mark.parametrize("count", [1, 4, 1024, 1025, 32768, 65536 + 3])
def test_default_shape_is_the_historic_launch(count):
    launches = _ll_launches({"count": count})
    assert len(launches) == 5
    assert set(launches) == {(((count + 1023) // 1024, 1, 1), (256, 1, 1))}


def test_shape_vars_set_block_and_lines_per_thread():
    # 512 threads x 2 lines x 4 elements = 4096 elements per block
    assert set(_ll_launches({"count": 32768, "ll_threads": 512, "ll_lines": 2})) == {((8, 1, 1), (512, 1, 1))}
    assert set(_ll_launches({"count": 32769, "ll_threads": 512, "ll_lines": 2})) == {((9, 1, 1), (512, 1, 1))}
    assert set(_ll_launches({"count": 8, "ll_threads": 64, "ll_lines": 4})) == {((1, 1, 1), (64, 1, 1))}


def test_parse_ll_shapes_is_the_product_threads_major():
    assert parse_ll_shapes("threads=256,512;lines=1,2") == (
        LLShape(256, 1), LLShape(256, 2), LLShape(512, 1), LLShape(512, 2))
    assert parse_ll_shapes(" lines = 4 ") == (LLShape(256, 4),)
    assert parse_ll_shapes("threads=128,128") == (LLShape(128, 1),)
    assert LLShape(512, 2).key == "ar_ll[t512,l2]" and LLShape(512, 2).vars() == {"ll_threads": 512, "ll_lines": 2}
    assert parse_ll_shapes("threads=128;formats=ll3,ll") == (LLShape(128, 1, "ar_ll3"), LLShape(128, 1))
    assert LLShape(128, 1, "ar_ll3").key == "ar_ll3[t128,l1]"
    assert LLShape(256, 2, "ar_ll3").vars() == {"ll3_threads": 256, "ll3_lines": 2}


def _ll3_launches(vars_: dict[str, int]) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    resolved = load_manifest(builtin_path("tp_mlp")).resolve(2, vars_)
    return [(op.grid, op.block) for name in ("ar_ll3", "ll3_stress") for op in resolved.program(name).ops
            if getattr(op, "kernel", None) == "tp_ll3_allreduce"]


@pytest.mark.parametrize("count", [1, 6, 768, 769, 32768])
def test_dense_format_has_its_own_shape_vars(count):
    # default: 128 threads x 1 line of 6 bf16 = 768 elements per block; ll_threads does not move it
    launches = _ll3_launches({"count": count, "ll_threads": 512})
    assert len(launches) == 3
    assert set(launches) == {(((count + 767) // 768, 1, 1), (128, 1, 1))}
    assert set(_ll3_launches({"count": count, "ll3_threads": 256, "ll3_lines": 2})) == {
        (((count + 3071) // 3072, 1, 1), (256, 1, 1))}


@pytest.mark.parametrize("text, match", [
    ("threads=100", "multiples of 32"),
    ("threads=1024", r"multiples of 32 in 32 \.\. 512"),
    ("lines=0", "lines 1 .. 64"),
    ("blocks=4", r"expected 'threads=N,N;lines=N,N\[;formats=ll,ll3\]'"),
    ("formats=ll4", "formats are ll, ll3"),
    ("formats=ll;formats=ll3", "each axis once"),
    ("threads=256;threads=512", "each axis once"),
    ("threads=a", "comma-separated integers"),
    ("lines=", "lists no value"),
])
def test_parse_ll_shapes_refuses_bad_specs(text, match):
    with pytest.raises(UsageError, match=match):
        parse_ll_shapes(text)
