"""The tile shape the masked expert GEMMs are compiled with (manifests/kernels/ep_gemm.cu, and the Hopper
warpgroup-MMA ones of ep_gemm_wgmma.cu), read from the kernel's source and a manifest's compiler options, and
the launch geometry it implies.

The shape is fixed when the source is compiled: `#ifndef GEMM_X / #define GEMM_X value` defaults in the
source, overridden by `-DGEMM_X=value` options. A launch must pass GEMM_SMEM_BYTES of dynamic shared memory
when the ring is over 48 KiB (the kernel traps otherwise), and a grid of ceil(N / BN) x ceil(cap / BM) x
experts; the ep_moe manifest writes both out, and the tests check them against this reading.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tray.errors import UsageError

NAMES = ("GEMM_BM", "GEMM_BN", "GEMM_BK", "GEMM_STAGES", "GEMM_PREFETCH", "GEMM_LDMATRIX", "GEMM_PIPE")
STATIC_SMEM_MAX = 48 << 10  # the kernel's GEMM_STATIC_SMEM_MAX


@dataclass(frozen=True)
class GemmTile:
    bm: int
    bn: int
    bk: int
    stages: int
    prefetch: int
    ldmatrix: int
    pipe: int

    @property
    def smem(self) -> int:
        """GEMM_SMEM_BYTES: the ring of stages of A (bm rows) and B (bn rows), rows padded to bk + 8 bf16."""
        return self.stages * (self.bm + self.bn) * (self.bk + 8) * 2

    @property
    def dynamic_smem(self) -> int:
        """The dynamic shared memory a launch passes: the ring when it is over 48 KiB, else 0 (static)."""
        return self.smem if self.smem > STATIC_SMEM_MAX else 0

    @property
    def options(self) -> list[str]:
        return [f"-D{n}={v}" for n, v in zip(NAMES, self.values(), strict=True)]

    def values(self) -> tuple[int, ...]:
        return (self.bm, self.bn, self.bk, self.stages, self.prefetch, self.ldmatrix, self.pipe)


def _defaults(source: str, names: Sequence[str], filename: str) -> dict[str, int]:
    """name -> N of each `#ifndef name / #define name N` in `source`; ValueError naming the first missing."""
    values: dict[str, int] = {}
    for name in names:
        m = re.search(rf"#ifndef {name}\s*\n#define {name} (\d+)", source)
        if m is None:
            raise ValueError(f"{filename} has no default for {name} (#ifndef {name} / #define {name} N)")
        values[name] = int(m.group(1))
    return values


def _compiled(source: str, options: Sequence[str], names: Sequence[str], filename: str) -> list[int]:
    """The values of `names` that `source` compiles with: its defaults, overridden by `-DNAME=N` options."""
    values = _defaults(source, names, filename)
    for opt in options:
        m = re.fullmatch(r"-D(\w+)=(\d+)", opt)
        if m and m.group(1) in values:
            values[m.group(1)] = int(m.group(2))
    return [values[n] for n in names]


def _builtin_kernel(manifest: str, entry: str) -> tuple[str, Sequence[str]]:
    """The source text and compiler options of the built-in manifest's first kernel with `entry`."""
    import json

    from tray.manifest.builtin import builtin_dir, builtin_path

    spec = next(k for k in json.loads(builtin_path(manifest).read_text())["kernels"] if k["entry"] == entry)
    return (builtin_dir() / spec["source"]).read_text(), spec.get("options", ())


def tile_of(source: str, options: Sequence[str] = ()) -> GemmTile:
    """The tile shape `source` (ep_gemm.cu's text) compiles to with `options`. Raises ValueError when the
    source lacks a default for one of NAMES."""
    return GemmTile(*_compiled(source, options, NAMES, "ep_gemm.cu"))


def masked_tile(manifest: str = "ep_moe") -> GemmTile:
    """The tile shape a built-in manifest compiles ep_masked_gemm_gather with (its source and options)."""
    return tile_of(*_builtin_kernel(manifest, "ep_masked_gemm_gather"))


# ep_gemm_wgmma.cu's knobs; its block tile is 128 rows x WG_BN columns, K 64 per stage, 256 threads (384 with
# WG_WS 1: a producer warpgroup beside the two consumers); WG_TMA 1 (WG_WS 1 only): B by tensor copies; WG_SWIGLU 1
# (WG_TMA 1 only): the gate/up GEMM writing silu(gate) * up (WG_BN / 2 columns of act per block); WG_RASTER 1: an
# expert's blocks taken row tile fastest
WGMMA_NAMES = ("WG_BN", "WG_STAGES", "WG_WS", "WG_TMA", "WG_SWIGLU", "WG_RASTER")
WGMMA_BM = 128
WGMMA_BK = 64
WGMMA_THREADS = 256
WGMMA_SMEM_MAX = 227 << 10  # a Hopper block's dynamic shared memory, at most
WGMMA_CAPABILITY = (9, 0)  # wgmma.mma_async with sm_90a features: Hopper only (not on later major versions)


@dataclass(frozen=True)
class WgmmaTile:
    """ep_gemm_wgmma.cu's compiled shape: bn (WG_BN: 128 or 256) columns of C per block, `stages` K tiles of
    64 in the shared-memory ring, ws (WG_WS) 1 for the warp-specialized block (a producer warpgroup issues
    every copy, two consumer warpgroups only multiply), 0 for every thread copying and multiplying; tma (WG_TMA)
    1 (with ws 1) for B's stages by the tensor memory accelerator from a tensor map (tray/programs/ep_moe/tma.py)
    passed as the entries' last argument, A still by the producer's cp.async; swiglu (WG_SWIGLU) 1 (with tma 1) for
    the gate/up GEMM that writes silu(gate) * up, its B stage four tensor copies of bn / 4 rows (gate, up, gate, up);
    raster (WG_RASTER) 1: an expert's blocks taken row tile fastest in launch order, so the blocks reading one column
    tile of B run side by side (the bytes written do not change)."""

    bn: int
    stages: int
    ws: int = 0
    tma: int = 0
    swiglu: int = 0
    raster: int = 0

    @property
    def bm(self) -> int:
        return WGMMA_BM

    @property
    def smem(self) -> int:
        """WG_SMEM_BYTES: the ring (per stage A 128 x 64 and B bn x 64 bf16) plus 1024 bytes to align it to the
        128-byte swizzle's 1024-byte atom; a launch always passes it (dynamic shared memory)."""
        return self.stages * (WGMMA_BM + self.bn) * WGMMA_BK * 2 + 1024

    @property
    def threads(self) -> int:
        """Threads per block a launch must give (the kernel's launch bounds)."""
        return WGMMA_THREADS + (128 if self.ws else 0)

    @property
    def options(self) -> list[str]:
        return [f"-DWG_BN={self.bn}", f"-DWG_STAGES={self.stages}", f"-DWG_WS={self.ws}", f"-DWG_TMA={self.tma}",
                f"-DWG_SWIGLU={self.swiglu}", f"-DWG_RASTER={self.raster}"]

    def values(self) -> tuple[int, int, int, int, int, int]:
        return (self.bn, self.stages, self.ws, self.tma, self.swiglu, self.raster)

    @property
    def b_box_bytes(self) -> int:
        """Bytes one B stage holds (bn rows of 64 bf16): what TMA mode's expect_tx counts per stage."""
        return self.bn * WGMMA_BK * 2

    @property
    def b_box_rows(self) -> int:
        """Rows of B one tensor copy brings (the map's box): the whole stage, or a quarter in SwiGLU mode."""
        return self.bn // 4 if self.swiglu else self.bn

    def grid(self, n: int, cap: int, experts: int) -> tuple[int, int, int]:
        """The launch grid over C [experts][cap][n]: ceil(n / bn) x ceil(cap / 128) x experts."""
        return (-(-n // self.bn), -(-cap // WGMMA_BM), experts)

    def check(self) -> None:
        """ValueError when the kernel would refuse the shape at compile time (its #error lines)."""
        if (self.bn not in (128, 256) or self.stages < 3 or self.smem > WGMMA_SMEM_MAX or self.ws not in (0, 1)
                or self.tma not in (0, 1) or (self.tma and not self.ws) or self.swiglu not in (0, 1)
                or (self.swiglu and not self.tma) or self.raster not in (0, 1)):
            raise ValueError(f"ep_gemm_wgmma.cu takes WG_BN 128 or 256 and WG_STAGES >= 3 within "
                             f"{WGMMA_SMEM_MAX} bytes of shared memory, WG_WS 0 or 1, WG_TMA 0 or 1 (1 only with "
                             f"WG_WS 1), WG_SWIGLU 0 or 1 (1 only with WG_TMA 1), WG_RASTER 0 or 1; got WG_BN "
                             f"{self.bn}, WG_STAGES {self.stages} ({self.smem} bytes), WG_WS {self.ws}, WG_TMA "
                             f"{self.tma}, WG_SWIGLU {self.swiglu}, WG_RASTER {self.raster}")


def wgmma_tile_of(source: str, options: Sequence[str] = ()) -> WgmmaTile:
    """The shape `source` (ep_gemm_wgmma.cu's text) compiles to with `options`. Raises ValueError when the
    source lacks a default for one of WGMMA_NAMES."""
    return WgmmaTile(*_compiled(source, options, WGMMA_NAMES, "ep_gemm_wgmma.cu"))


def wgmma_tile(manifest: str = "ep_moe") -> WgmmaTile:
    """The shape a built-in manifest compiles ep_wgmma_gemm_gather with (its source and options)."""
    return wgmma_tile_of(*_builtin_kernel(manifest, "ep_wgmma_gemm_gather"))


def swiglu_tile(manifest: str = "ep_moe") -> WgmmaTile:
    """The shape a built-in manifest compiles its SwiGLU gate/up GEMM with (ep_wgmma_swiglu_gather); ValueError
    when that kernel is not built in SwiGLU mode (its map's box would then be the wrong size)."""
    import json

    from tray.manifest.builtin import builtin_dir, builtin_path

    spec = next(k for k in json.loads(builtin_path(manifest).read_text())["kernels"]
                if k["name"] == "ep_wgmma_swiglu_gather")
    tile = wgmma_tile_of((builtin_dir() / spec["source"]).read_text(), spec.get("options", ()))
    if not tile.swiglu:
        raise ValueError(f"{manifest}'s ep_wgmma_swiglu_gather is not compiled with -DWG_SWIGLU=1: {spec['options']}")
    return tile


def require_wgmma(capability: tuple[int, int]) -> None:
    """UsageError unless a device of compute `capability` (major, minor) runs ep_gemm_wgmma.cu: its
    wgmma.mma_async needs sm_90a, which only compute capability 9.0 (Hopper) has."""
    if tuple(capability) != WGMMA_CAPABILITY:
        major, minor = capability
        raise UsageError(
            f"the wgmma expert GEMMs need compute capability 9.0 (Hopper, sm_90a: wgmma.mma_async); this device is "
            f"{major}.{minor}: use --gemm masked (mma.sync, any sm_80+ GPU) or --gemm cublas"
        )


def _ranges(values: Sequence[int]) -> str:
    """Sorted distinct ints as runs: [0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def mismatch_report(got: Any, want: Any, rtol: float, atol: float, limit: int = 6) -> str:
    """'' when every element of `got` is within rtol * |want| + atol of `want` (2-D float arrays of one
    shape; NaN in `got` is a mismatch); else how many are not, the rows and the columns holding any (as runs,
    so a fragment-layout or swizzle error shows as a pattern), and the first `limit` as (row, col) got/want."""
    import numpy as np

    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    if g.shape != w.shape or g.ndim != 2:
        raise ValueError(f"mismatch_report compares 2-D arrays of one shape, got {g.shape} and {w.shape}")
    bad = ~(np.abs(g - w) <= rtol * np.abs(w) + atol)
    if not bad.any():
        return ""
    rows = np.flatnonzero(bad.any(axis=1)).tolist()
    cols = np.flatnonzero(bad.any(axis=0)).tolist()
    first = "; ".join(f"({r}, {c}) {g[r, c]:.6g}/{w[r, c]:.6g}" for r, c in np.argwhere(bad)[:limit].tolist())
    return (f"{int(bad.sum())} of {bad.size} elements off (rtol {rtol:g}, atol {atol:g}); rows {_ranges(rows)}; "
            f"cols {_ranges(cols)}; first (row, col) got/want: {first}")
