"""The barrier variants of bench/barrier_variants.py are generated from the production kernel: every
variant's diff still applies, and a diff that no longer fits is refused, not silently skipped."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import REPO

from tray.backend.cuda.barrier import BARRIER_SOURCE
from tray.manifest.builtin import kernel_dir


@pytest.fixture(scope="module")
def variants():
    spec = importlib.util.spec_from_file_location("barrier_variants", REPO / "bench" / "barrier_variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["barrier_variants"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["barrier_variants"]


def test_every_variant_applies_to_the_production_kernel(variants):
    production = (kernel_dir() / BARRIER_SOURCE).read_text()
    diffs = {v.diff for v in variants.VARIANTS if v.diff}
    assert diffs == {p.name for p in variants.PATCHES.glob("*.diff")}, "a diff file no variant uses, or missing"
    for v in variants.VARIANTS:
        source = variants.variant_source(v)
        assert "tray_peer_barrier" in source
        assert (source == production) == (v.diff is None), v.name


def test_a_diff_that_no_longer_fits_is_refused(variants):
    production = (kernel_dir() / BARRIER_SOURCE).read_text()
    diff = (variants.PATCHES / "v4_nofence.diff").read_text()
    changed = production.replace('asm volatile("fence.acq_rel.sys;" ::: "memory");', "/* moved */")
    with pytest.raises(variants.PatchError, match="hunk 2 matches the production kernel 0 times"):
        variants.apply_diff(changed, diff, "v4_nofence.diff")
