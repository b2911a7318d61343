"""The barrier variants of bench/barrier_variants.py are generated from the production kernel: every
variant's diff still applies, and a diff that no longer fits is refused, not silently skipped. Where nvcc
is installed, each variant's PTX is read for the release/acquire pattern the producer/consumer contract
needs: every variant has it but v4_nofence, which the check must flag."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
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
    with pytest.raises(variants.PatchError, match="hunk 4 matches the production kernel 0 times"):
        variants.apply_diff(changed, diff, "v4_nofence.diff")


def test_only_selects_in_catalogue_order_and_names_unknown_variants(variants):
    assert [v.name for v in variants.select("v10_shfl, production")] == ["production", "v10_shfl"]
    assert variants.select(None) == variants.VARIANTS
    with pytest.raises(ValueError, match=r"unknown variant\(s\) \['v99'\]; expected names among"):
        variants.select("production,v99")
    with pytest.raises(ValueError, match="unknown variant"):
        variants.select(",")


# --- the release/acquire pattern, read off each variant's PTX ----------------------------------------------

NVCC = shutil.which("nvcc")
_FENCE = re.compile(r"^\s*(fence\.(acq_rel|sc)\.sys|membar\.sys)\b")
_FLAG_STORE = re.compile(r"^\s*st\.(relaxed|release)\.sys\.")
_ACQUIRE = re.compile(r"^\s*(ld\.acquire\.sys\.|fence\.(acq_rel|sc)\.sys)")


def release_acquire_problems(ptx: str) -> list[str]:
    """What the barrier's PTX lacks of the producer/consumer contract (empty: nothing). Each flag store
    (`st.relaxed.sys` / `st.release.sys`) must be a release: `st.release.sys`, or after a sys-scope fence
    of the same thread; the waiting side must acquire (`ld.acquire.sys` or a sys-scope fence). Reads the
    PTX in text order: enough for these straight kernels (every fence precedes its stores in every path)."""
    lines = ptx.splitlines()
    fences = [i for i, line in enumerate(lines) if _FENCE.match(line)]
    problems = []
    for i, line in enumerate(lines):
        if _FLAG_STORE.match(line) and "st.release" not in line and not any(f < i for f in fences):
            problems.append(f"line {i + 1}: flag store with no sys-scope fence before it: {line.strip()}")
    if not any(_ACQUIRE.match(line) for line in lines):
        problems.append("no acquire on the waiting side")
    return problems


@pytest.mark.skipif(NVCC is None, reason="no nvcc to compile the variants to PTX")
def test_every_variant_but_the_one_without_fence_releases_before_its_flag_stores(variants, tmp_path):
    for v in variants.VARIANTS:
        src = tmp_path / f"{v.name}.cu"
        src.write_text(variants.variant_source(v))
        ptx = tmp_path / f"{v.name}.ptx"
        subprocess.run([NVCC, "-arch=sm_90", "-ptx", "-o", str(ptx), str(src)], check=True, capture_output=True,
                       timeout=120)
        problems = release_acquire_problems(ptx.read_text())
        if v.name == "v4_nofence":
            assert problems and "no sys-scope fence" in problems[0], v.name
        else:
            assert not problems, (v.name, problems)
