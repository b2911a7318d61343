"""The experts' masked GEMMs on one GPU: tile shapes of manifests/kernels/ep_gemm.cu against cuBLAS and the
GPU's own read bandwidth, at the EP layer's shapes.

    python bench/expert_gemm.py [--experts 128] [--tokens 256,8192] [--routing uniform,zipf] [--json PATH]

One rank's experts of an EP MoE layer (default: 128 of 256 experts, hidden 7168, expert dim 2048, top-8: the
EP2 rank of the ep-moe bench): routing drawn as the ep-moe bench draws it (`tray/programs/ep_moe/plan.py`)
over `--tokens` global tokens, the rows that land on this rank's experts counted per expert (at most the
capacity a graph must allow, `--capacity` x the mean), and each expert's rows read in place from the
token rows through a slot index, as the layer's `experts_masked` program reads the received rows.

Timed per case, median of `--repeats` graph replays after a warm-up (device events):
  <variant>        ep_masked_gemm_gather (w13, gate and up) + ep_masked_gemm (w2, down) compiled with that
                   variant's tile shape (-DGEMM_BM.. options, named t<BM>x<BN>k<BK>s<stages>[p<L2 prefetch
                   bytes>][L: fragments by ldmatrix][P: a step ahead]); `production` is the manifest's own options
  wgmma[_n<BN>s<stages>]  ep_wgmma_gemm_gather + ep_wgmma_gemm (manifests/kernels/ep_gemm_wgmma.cu, Hopper
                   warpgroup MMA, compute capability 9.0 only: skipped, and said so, elsewhere); `wgmma` is the
                   manifest's shape (the layer's `experts_wgmma`); _ws_: the warp-specialized block (WG_WS 1);
                   _wsp_: it persistent (ep_wgmma_gemm_tiles_gather + ep_wgmma_gemm_tiles, one block per SM);
                   _tma_: the warp-specialized block with the weights by tensor copies (WG_TMA 1, a tensor map
                   per weight encoded here: tray/programs/ep_moe/tma.py); _tmap_: it persistent; _swiglu_: the
                   gate/up GEMM in SwiGLU mode (WG_SWIGLU 1: it writes act = silu(gate) * up, no h13 and no
                   activation kernel), w2 by the plain build of the same ring: the manifest's shape, whose gate/up
                   GEMM takes an expert's blocks row tile fastest (WG_RASTER 1; w2 and the other variants column
                   tile fastest)
  cublas_cap       cuBLAS cublasGemmEx per expert over the `cap` rows a graph must allow, on a dense slab
                   (the in-graph baseline: the counts live on the device)
  cublas_rows      cuBLAS per expert over exactly the rows present (counts known on the host: not possible
                   inside a captured layer, the floor cuBLAS could reach with a host round trip)
  read_ceiling     a kernel that reads the same weight bytes once (16-byte loads, every SM), the GPU's
                   streaming-read rate for them: the GEMMs' floor at decode sizes, where weights dominate
Correctness first: every variant's h13 and y bytes must equal production's (the tile shape never changes a
sum's order), production's rows must match float64 over sampled experts (every routed row of 8 experts),
and cuBLAS's within bf16 rounding. Each wgmma case runs on outputs poisoned with NaN and must: match float64
elementwise within WGMMA_RTOL |want| + WGMMA_ATOL max|want| on every row of the sampled experts, for h13
(the gather entry) and for y (the dense entry, over the act it produced itself); match production within
twice that (both are one bf16 rounding of nearly the same float32 sum); write every row present (no NaN);
give the same bytes on a second run (deterministic); and its dense entry over the slab must give the
gather's bytes. A failed check fails the run (exit 1) after every case has printed what it found (the first
mismatches: expert, row, column, got, want).
A SwiGLU variant's act must equal the plain build's h13 (same ring) through ep_silu_mul_rows, byte for byte.
Then the layer's phases (ALTERNATE) are timed again in alternation, round after round, so a drift of the clocks
over the run reaches them alike ("alternating": the median of each phase's round medians, and the rounds); the
ratios to cuBLAS quoted for the layer come from there.
Bytes: the weight bytes of the experts with rows (w13 + w2), plus the A rows read and C rows written.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tray.bench import median, write_report
from tray.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from tray.errors import UsageError
from tray.manifest.builtin import kernel_dir
from tray.programs.ep_moe.gemm_tile import WGMMA_CAPABILITY, WgmmaTile, masked_tile, mismatch_report, wgmma_tile
from tray.programs.ep_moe.plan import capacity, parse_routing, random_routing
from tray.programs.ep_moe.tma import TENSOR_MAP_BYTES, encode_weight_map, write_weight_maps
from tray.programs.ep_moe.twins import silu_mul_bits

WARMUP = 3
# ep_silu_mul_rows's blocks per expert (grid x; y: the experts), as the manifest launches it
SILU_BLOCKS_X = 32
# the expert phases timed again in alternation with cuBLAS over the exact rows: the layer's (`wgmma`, the manifest's
# shape), the same SwiGLU ring launched column tile fastest, the 3-stage one, and the plain TMA rings with the
# activation kernel it replaces
ALTERNATE = ("wgmma", "wgmma_swiglu_n256s4", "wgmma_swiglu_n256s3", "wgmma_tma_n256s4", "wgmma_tma_n256s3",
             "cublas_rows")
ALTERNATE_ROUNDS = 7


@dataclass(frozen=True)
class Variant:
    """A tile shape of ep_gemm.cu: GEMM_BM, GEMM_BN, GEMM_BK, GEMM_STAGES, GEMM_PREFETCH, GEMM_LDMATRIX, GEMM_PIPE."""

    name: str
    bm: int
    bn: int
    bk: int
    stages: int
    prefetch: int
    ldmatrix: int = 0
    pipe: int = 0

    @property
    def options(self) -> list[str]:
        return [f"-DGEMM_BM={self.bm}", f"-DGEMM_BN={self.bn}", f"-DGEMM_BK={self.bk}",
                f"-DGEMM_STAGES={self.stages}", f"-DGEMM_PREFETCH={self.prefetch}",
                f"-DGEMM_LDMATRIX={self.ldmatrix}", f"-DGEMM_PIPE={self.pipe}"]

    @property
    def smem(self) -> int:
        """GEMM_SMEM_BYTES; passed as dynamic shared memory when over 48 KiB (the kernel's own rule)."""
        return self.stages * (self.bm + self.bn) * (self.bk + 8) * 2

    @property
    def dynamic_smem(self) -> int:
        return self.smem if self.smem > 48 << 10 else 0


# names: t<BM>x<BN>k<BK>s<stages>[p<prefetch bytes>][L: ldmatrix][P: fragments a step ahead]
VARIANTS = (
    Variant("t64x128k32s3", 64, 128, 32, 3, 0),
    Variant("t128x128k64s3p256L", 128, 128, 64, 3, 256, 1),
    Variant("t128x128k64s3p256LP", 128, 128, 64, 3, 256, 1, 1),
    Variant("t128x128k32s4p256LP", 128, 128, 32, 4, 256, 1, 1),
    Variant("t64x128k64s4p256L", 64, 128, 64, 4, 256, 1),
    Variant("t64x128k64s4p256LP", 64, 128, 64, 4, 256, 1, 1),
    Variant("t128x64k64s4p256LP", 128, 64, 64, 4, 256, 1, 1),
    Variant("t128x128k64s2p256LP", 128, 128, 64, 2, 256, 1, 1),
)


@dataclass(frozen=True)
class WgmmaVariant:
    """A shape of ep_gemm_wgmma.cu: WG_BN columns per block, WG_STAGES K tiles of 64 in the ring."""

    name: str
    bn: int
    stages: int
    ws: int = 0
    tma: int = 0  # WG_TMA 1: B by tensor copies from the maps in Case.tmaps (the entries' last argument)
    swiglu: int = 0  # WG_SWIGLU 1: the gate/up GEMM writes act = silu(gate) * up (no h13, no activation kernel)
    raster: int = 0  # WG_RASTER 1: an expert's blocks taken row tile fastest (the launch order)
    persistent: bool = False  # the ep_wgmma_gemm_tiles(_gather) entries: one block per SM over the tiles with rows

    @property
    def tile(self) -> WgmmaTile:
        return WgmmaTile(self.bn, self.stages, self.ws, self.tma, self.swiglu, self.raster)

    @property
    def options(self) -> list[str]:
        return ["--gpu-architecture=sm_90a", *self.tile.options]

    @property
    def plain(self) -> WgmmaVariant:
        """The same ring without SwiGLU mode, launched column tile fastest: w2's build, as the manifest's
        ep_wgmma_gemm (and the reference the SwiGLU act is checked against)."""
        return WgmmaVariant(f"{self.name}_plain", self.bn, self.stages, self.ws, self.tma, 0, 0, self.persistent)


# names: wgmma[_ws|_wsp]_n<WG_BN>s<WG_STAGES> (_ws: WG_WS 1, the warp-specialized block: a producer warpgroup feeds
# two consumer warpgroups through mbarriers, 384 threads; _wsp: the same block persistent, ep_wgmma_gemm_tiles*,
# one per SM walking the tiles with rows; _tma: the warp-specialized block with B by tensor copies, WG_TMA 1, the
# producer warpgroup issuing only A's copies); `wgmma` (the manifest's shape) always runs on a compute capability
# 9.0 GPU.
# n128s3 (97 KiB, 118 registers x 256 threads) fits two blocks per SM, so one block's prologue, barriers and
# epilogue overlap the other's MMA; the others are one block per SM with a deeper ring.
WGMMA_VARIANTS = (
    WgmmaVariant("wgmma_n128s6", 128, 6),
    WgmmaVariant("wgmma_n128s3", 128, 3),
    WgmmaVariant("wgmma_n256s3", 256, 3),
    WgmmaVariant("wgmma_ws_n256s4", 256, 4, 1),
    WgmmaVariant("wgmma_ws_n256s3", 256, 3, 1),
    WgmmaVariant("wgmma_ws_n128s6", 128, 6, 1),
    WgmmaVariant("wgmma_wsp_n256s4", 256, 4, 1, persistent=True),
    WgmmaVariant("wgmma_wsp_n256s3", 256, 3, 1, persistent=True),
    WgmmaVariant("wgmma_wsp_n128s6", 128, 6, 1, persistent=True),
    WgmmaVariant("wgmma_tma_n256s4", 256, 4, 1, 1),
    WgmmaVariant("wgmma_tma_n256s3", 256, 3, 1, 1),
    WgmmaVariant("wgmma_tma_n128s6", 128, 6, 1, 1),
    WgmmaVariant("wgmma_tmap_n256s4", 256, 4, 1, 1, persistent=True),
    WgmmaVariant("wgmma_swiglu_n256s4", 256, 4, 1, 1, 1),
    WgmmaVariant("wgmma_swiglu_n256s3", 256, 3, 1, 1, 1),
)
# wgmma vs float64, elementwise: |got - want| <= WGMMA_RTOL |want| + WGMMA_ATOL max|want| (over the expert). One
# round to nearest even is at most half a bf16 ulp, and an ulp is at most 2^-7 of the value; the absolute term
# absorbs float32 accumulation over K (~sqrt(K) 2^-24 of the terms' size) where the sum cancels to near zero.
# A swizzle, descriptor or fragment-layout error moves values by their own size, far outside either.
WGMMA_RTOL = 2.0**-7
WGMMA_ATOL = 2.0**-10
# wgmma vs production (mma.sync): each is one rounding of a float32 sum in another order, and y also carries the
# difference of the act it was computed from: twice the float64 bounds, and an absolute 2^-8 of the largest |y|
WGMMA_PROD_RTOL = 2.0**-6
WGMMA_PROD_ATOL = 2.0**-8
POISON_WORD = 0x7FC07FC0  # bf16 NaN in both halves: outputs are filled with it before every checked wgmma run


def wgmma_variant() -> WgmmaVariant:
    """The shape the ep_moe manifest compiles the wgmma GEMMs with (experts_wgmma)."""
    return WgmmaVariant("wgmma", *wgmma_tile().values())


READ_SOURCE = r"""
// Reads `words` 16-byte vectors once (grid-stride, every SM) and folds them into one word per block, so the
// loads cannot be dropped; the folded words are written where the host never reads them for timing.
extern "C" __global__ void expert_gemm_read(const uint4* __restrict__ src, long long words, unsigned int* out) {
    unsigned int acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9E3779B9u) {
        out[blockIdx.x] = acc;  // practically never: the fold only has to be live
    }
}
"""


def production_variant() -> Variant:
    """The tile shape the ep_moe manifest compiles the masked GEMMs with (the kernel's defaults and its options)."""
    return Variant("production", *masked_tile().values())


class Case:
    """One routing on one GPU: the buffers, the counts and the index, and the launches over them."""

    def __init__(self, backend: Any, a: argparse.Namespace, tokens: int, routing: str, w13: Any, w2: Any) -> None:
        self.E, self.H, self.F = a.experts, a.hidden, a.expert_dim
        world = a.all_experts // a.experts
        self.cap = capacity(a.capacity, world, max(tokens // world, 1), a.topk, a.all_experts)
        r = random_routing(tokens, a.all_experts, a.topk, a.seed, parse_routing(routing))
        self.label = f"{routing}_T{tokens}"
        self.tokens = tokens
        # the rows of this rank's experts (0 .. E-1), in token order, as the layout fills the slots
        rows = np.zeros(self.E, np.int32)
        index = np.full(self.E * self.cap, -1, np.int32)
        dropped = 0
        for t, e in zip(*np.nonzero(r.experts < self.E), strict=True):
            expert = int(r.experts[t, e])
            if rows[expert] < self.cap:
                index[expert * self.cap + rows[expert]] = t
                rows[expert] += 1
            else:
                dropped += 1
        self.rows, self.index, self.dropped = rows, index, dropped
        b = backend
        self.x = b.allocate("eg_x", tokens * self.H * 2, export=False)
        self.rows_buf = b.allocate("eg_rows", rows.nbytes, export=False)
        self.index_buf = b.allocate("eg_index", index.nbytes, export=False)
        self.h13 = b.allocate("eg_h13", self.E * self.cap * 2 * self.F * 2, export=False)
        self.act = b.allocate("eg_act", self.E * self.cap * self.F * 2, export=False)
        self.y = b.allocate("eg_y", self.E * self.cap * self.H * 2, export=False)
        self.slab = b.allocate("eg_slab", self.E * self.cap * self.H * 2, export=False)
        # the _tma variants' tensor maps (w13's, then w2's, per WG_BN and SwiGLU mode: MAP_SLOTS); filled by _wgmma,
        # 64-byte aligned as every allocation is
        self.tmaps = b.allocate("eg_tmaps", 2 * len(MAP_SLOTS) * TENSOR_MAP_BYTES, export=False)
        rng = np.random.default_rng(a.seed + 1)
        self.x_host = f32_to_bf16_bits(rng.standard_normal((tokens, self.H)).astype(np.float32))
        b.write(self.x.ptr, self.x_host)
        b.write(self.rows_buf.ptr, rows)
        b.write(self.index_buf.ptr, index)
        slab = np.zeros((self.E * self.cap, self.H), np.uint16)
        kept = index >= 0
        slab[kept] = self.x_host[index[kept]]
        b.write(self.slab.ptr, slab)
        self.w13, self.w2 = w13, w2
        present = rows > 0
        self.weight_bytes = int(present.sum()) * 3 * self.F * self.H * 2
        self.row_bytes = int(rows.sum()) * (self.H + 2 * self.F + self.F + self.H) * 2  # A in, C out, both GEMMs

    def close(self) -> None:
        for buf in (self.x, self.rows_buf, self.index_buf, self.h13, self.act, self.y, self.slab, self.tmaps):
            buf.close()


def _replays_us(backend: Any, graph: Any, repeats: int) -> float:
    """Median µs of `repeats` replays of `graph`, each between device timer marks."""
    samples = []
    for _ in range(repeats):
        timer = backend.timer()
        timer.start()
        graph.replay()
        timer.stop()
        samples.append(timer.elapsed_s() * 1e6)
        timer.close()
    return median(samples)


def _time(backend: Any, launches: list[Any], repeats: int) -> float:
    """Median µs of one replay of a graph of `launches` (callables), after WARMUP replays."""
    graph = backend.capture(lambda: [launch() for launch in launches])
    for _ in range(WARMUP):
        graph.replay()
    us = _replays_us(backend, graph, repeats)
    graph.close()
    return us


def _alternating(backend: Any, phases: dict[str, list[Any]], repeats: int) -> dict[str, Any]:
    """Each expert phase of `phases` timed in turn, round after round (ALTERNATE_ROUNDS rounds of `repeats` replays),
    so a drift of the GPU's clocks over the run (power, heat) reaches every phase alike: per phase the median of
    its rounds' medians, and every round's figure."""
    graphs = {n: backend.capture(lambda launches=launches: [launch() for launch in launches])
              for n, launches in phases.items()}
    rounds: dict[str, list[float]] = {n: [] for n in graphs}
    try:
        for g in graphs.values():
            for _ in range(WARMUP):
                g.replay()
        for _ in range(ALTERNATE_ROUNDS):
            for n, g in graphs.items():
                rounds[n].append(_replays_us(backend, g, repeats))
    finally:
        for g in graphs.values():
            g.close()
    return {"us": {n: median(r) for n, r in rounds.items()}, "rounds_us": rounds}


def _masked(backend: Any, case: Case, v: Variant) -> tuple[Any, Any]:
    source = (kernel_dir() / "ep_gemm.cu").read_bytes()
    gather = backend.load_kernel(f"ep_masked_gemm_gather[{v.name}]", source, "ep_masked_gemm_gather",
                                 v.options, peers=False, filename="ep_gemm.cu")
    dense = backend.load_kernel(f"ep_masked_gemm[{v.name}]", source, "ep_masked_gemm", v.options, peers=False,
                                filename="ep_gemm.cu")
    E, H, F, cap = case.E, case.H, case.F, case.cap
    w13 = gather.bind((-(-2 * F // v.bn), -(-cap // v.bm), E), (128, 1, 1),
                      [case.x.ptr, case.index_buf.ptr, case.w13.ptr, case.h13.ptr, case.rows_buf.ptr, cap, F, 2, H],
                      shmem_nbytes=v.dynamic_smem)
    w2 = dense.bind((-(-H // v.bn), -(-cap // v.bm), E), (128, 1, 1),
                    [case.act.ptr, case.w2.ptr, case.y.ptr, case.rows_buf.ptr, cap, H, 1, F],
                    shmem_nbytes=v.dynamic_smem)
    return w13, w2


# the first of the two tensor-map slots (w13's, w2's) of each (WG_BN, WG_SWIGLU) in Case.tmaps
MAP_SLOTS = {(128, 0): 0, (256, 0): 2, (128, 1): 4, (256, 1): 6}


def _wgmma(backend: Any, case: Case, v: WgmmaVariant) -> tuple[Any, Any, Any]:
    """(w13 by the gather entry from the token rows, w2 by the dense entry from act, w13 by the dense entry
    from the gathered slab) of ep_gemm_wgmma.cu compiled with v's shape; v.persistent: the _tiles entries, one
    block per SM, the expert count as their last argument. v.swiglu: both w13 launches write act (silu(gate) * up)
    and w2 runs the plain build of the same ring (v.plain), as the layer's experts_wgmma does."""
    source = (kernel_dir() / "ep_gemm_wgmma.cu").read_bytes()
    entry = "ep_wgmma_gemm_tiles" if v.persistent else "ep_wgmma_gemm"

    def load(name: str, w: WgmmaVariant) -> Any:
        return backend.load_kernel(f"{name}[{w.name}]", source, name, w.options, peers=False,
                                   filename="ep_gemm_wgmma.cu")

    gather, dense = load(f"{entry}_gather", v), load(entry, v)
    dense2 = load(entry, v.plain) if v.swiglu else dense
    E, H, F, cap, t = case.E, case.H, case.F, case.cap, v.tile
    block = (t.threads, 1, 1)
    if v.persistent:
        from tray.backend.cuda import driver as drv

        sms = drv.device_attribute(backend.device, "MULTIPROCESSOR_COUNT")
        grid13 = grid2 = (sms, 1, 1)
        tail = [E]
    else:
        grid13, grid2, tail = t.grid(2 * F, cap, E), t.grid(H, cap, E), []
    map13: list[int] = []
    map2: list[int] = []
    if t.tma:
        # the weights' maps (w13 [E][2F][H] in the gate/up kernel's boxes, w2 [E][H][F] in the plain ring's), each
        # kernel reading its own by address
        first = MAP_SLOTS[(t.bn, t.swiglu)]
        write_weight_maps(backend, case.tmaps, [encode_weight_map(case.w13.ptr, E, 2 * F, H, t.b_box_rows),
                                                encode_weight_map(case.w2.ptr, E, H, F, t.bn)], first)
        at = case.tmaps.ptr + first * TENSOR_MAP_BYTES
        map13, map2 = [at], [at + TENSOR_MAP_BYTES]
    c13 = case.act if t.swiglu else case.h13
    w13 = gather.bind(grid13, block,
                      [case.x.ptr, case.index_buf.ptr, case.w13.ptr, c13.ptr, case.rows_buf.ptr, cap, F, 2, H,
                       *tail, *map13], shmem_nbytes=t.smem)
    w2 = dense2.bind(grid2, block,
                     [case.act.ptr, case.w2.ptr, case.y.ptr, case.rows_buf.ptr, cap, H, 1, F, *tail, *map2],
                     shmem_nbytes=t.smem)
    w13_dense = dense.bind(grid13, block,
                           [case.slab.ptr, case.w13.ptr, c13.ptr, case.rows_buf.ptr, cap, F, 2, H, *tail,
                            *map13], shmem_nbytes=t.smem)
    return w13, w2, w13_dense


def run_wgmma(backend: Any, a: argparse.Namespace, case: Case, v: WgmmaVariant, silu: Any, zero: Any,
              base: tuple[np.ndarray, np.ndarray], want13: dict[int, np.ndarray], out: dict[str, Any],
              failed: list[str]) -> list[Any]:
    """One wgmma shape on `case`: its checks (see the top of this file) into out["checks"], each failure into
    `failed` with what was off, then its times into out["us"]. Returns the launches of its whole expert phase
    (w13, the activation unless the gate/up GEMM applies it, w2)."""
    E, H, F, cap = case.E, case.H, case.F, case.cap
    w13, w2, w13_dense = _wgmma(backend, case, v)
    starts = np.concatenate([[0], np.cumsum(case.rows)])
    phase = [w13.launch, w2.launch] if v.swiglu else [w13.launch, silu.launch, w2.launch]

    def poisoned(launches: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """h13, act and y rows present after `launches` on outputs filled with NaN."""
        for buf, nbytes in ((case.h13, E * cap * 2 * F * 2), (case.act, E * cap * F * 2), (case.y, E * cap * H * 2)):
            zero.bind((4096, 1, 1), (256, 1, 1), [buf.ptr, nbytes // 4, POISON_WORD]).launch()
        for launch in launches:
            launch()
        backend.synchronize()
        return (_rows_of(backend, case.h13, case, 2 * F), _rows_of(backend, case.act, case, F),
                _rows_of(backend, case.y, case, H))

    if v.swiglu:
        # the plain build's h13 on the same rows: SwiGLU mode's act must be its activation, byte for byte
        plain13, _, _ = _wgmma(backend, case, v.plain)
        h13, _, _ = poisoned([plain13.launch])
        act_want = silu_mul_bits(h13, F)
        _, act, y = poisoned(phase)
    else:
        h13, act, y = poisoned(phase)
    problems: list[str] = []
    nan = int(np.isnan(bf16_bits_to_f32(h13)).any(axis=1).sum() + np.isnan(bf16_bits_to_f32(y)).any(axis=1).sum()
              + np.isnan(bf16_bits_to_f32(act)).any(axis=1).sum())
    out["checks"][f"{v.name}_nan_rows"] = nan
    if nan:
        problems.append(f"{nan} rows present hold NaN (unwritten)")
    if v.swiglu:
        same_act = bool(np.array_equal(act, act_want))
        out["checks"][f"{v.name}_act_equals_plain_then_silu"] = same_act
        if not same_act:
            bad = np.flatnonzero((act != act_want).any(axis=1))
            shown = bad[:64]
            report = mismatch_report(bf16_bits_to_f32(act[shown]), bf16_bits_to_f32(act_want[shown]), 0.0, 0.0)
            problems.append(f"act differs from the plain build's h13 through ep_silu_mul_rows in {bad.size} rows "
                            f"(first {bad[:4].tolist()}): {report}")

    def vs_float64(got_bits: np.ndarray, want: np.ndarray) -> tuple[float, str]:
        """Max error relative to the largest |want|, and mismatch_report's text (empty: within tolerance)."""
        got = bf16_bits_to_f32(got_bits).astype(np.float64)
        scale = max(float(np.abs(want).max()), 1e-30)
        return float(np.abs(got - want).max() / scale), mismatch_report(got, want, WGMMA_RTOL, WGMMA_ATOL * scale)

    errs13, errs2 = [], []
    for e, want in want13.items():
        rows = slice(starts[e], starts[e + 1])
        err, report = vs_float64(h13[rows], want)
        errs13.append(err)
        if report:
            problems.append(f"h13 (gather entry) expert {e} ({case.rows[e]} rows) vs float64: {report}")
        w2e = bf16_bits_to_f32(backend.read(case.w2.ptr + e * H * F * 2, H * F * 2).view(np.uint16)
                               .reshape(H, F)).astype(np.float64)
        err, report = vs_float64(y[rows], bf16_bits_to_f32(act[rows]).astype(np.float64) @ w2e.T)
        errs2.append(err)
        if report:
            problems.append(f"y (dense entry) expert {e} ({case.rows[e]} rows) vs float64 over its own act: {report}")
    out["checks"][f"{v.name}_h13_vs_float64_max_rel"] = max(errs13, default=float("nan"))
    out["checks"][f"{v.name}_y_vs_float64_max_rel"] = max(errs2, default=float("nan"))
    # against production, every expert with rows (float32 is enough at this tolerance)
    off = {"h13": 0, "y": 0}
    for name, got_all, prod_all in (("h13", h13, base[0]), ("y", y, base[1])):
        g, p = bf16_bits_to_f32(got_all), bf16_bits_to_f32(prod_all)
        atol = WGMMA_PROD_ATOL * (float(np.abs(p).max()) if p.size else 1.0)
        bad_rows = np.flatnonzero(~(np.abs(g - p) <= WGMMA_PROD_RTOL * np.abs(p) + atol).all(axis=1))
        bad_experts = np.unique(np.searchsorted(starts, bad_rows, side="right") - 1)
        off[name] = int(bad_experts.size)
        for e in bad_experts[:2]:  # the first two, in full
            rows = slice(starts[e], starts[e + 1])
            report = mismatch_report(g[rows], p[rows], WGMMA_PROD_RTOL, atol)
            problems.append(f"{name} expert {int(e)} ({case.rows[e]} rows) vs production: {report}")
    out["checks"][f"{v.name}_experts_off_production"] = off
    if off["h13"] or off["y"]:
        problems.append(f"experts off production: h13 {off['h13']}, y {off['y']}")
    # the same bytes on a second run; the dense entry over the gathered slab gives the gather's bytes (h13, or in
    # SwiGLU mode act)
    h13_again, act_again, y_again = poisoned(phase)
    same = bool(np.array_equal(act_again, act) and np.array_equal(y_again, y)
                and (v.swiglu or np.array_equal(h13_again, h13)))
    out["checks"][f"{v.name}_deterministic"] = same
    if not same:
        problems.append(f"a second run differs: act {int((act_again != act).sum())} values, "
                        f"y {int((y_again != y).sum())} values")
    h13_dense, act_dense, _ = poisoned([w13_dense.launch])
    first, dense_first = (act, act_dense) if v.swiglu else (h13, h13_dense)
    dense_ok = bool(np.array_equal(dense_first, first))
    out["checks"][f"{v.name}_dense_equals_gather"] = dense_ok
    if not dense_ok:
        problems.append(f"the dense entry over the slab differs from the gather: "
                        f"{int((dense_first != first).sum())} values")
    failed.extend(f"{v.name}: {p}" for p in problems)
    t13 = _time(backend, [w13.launch], a.repeats)
    t2 = _time(backend, [w2.launch], a.repeats)
    tall = _time(backend, phase, a.repeats)
    out["us"][v.name] = {"w13": t13, "w2": t2, "experts": tall, "smem": v.tile.smem, "options": v.options}
    flops = 2.0 * int(case.rows.sum()) * 3 * F * H
    print(f"  {case.label:<16} {v.name:<20} w13{'+silu' if v.swiglu else ''} {t13:9.1f}  w2 {t2:9.1f}  experts "
          f"{tall:9.1f} µs  {case.weight_bytes / tall / 1e6:6.2f} TB/s of weights  "
          f"{flops / (t13 + t2) / 1e6:6.1f} TFLOP/s (GEMMs)  {'ok' if not problems else 'FAILED'}", flush=True)
    for p in problems:
        print(f"    {v.name}: {p}", flush=True)
    return phase


def _rows_of(backend: Any, buf: Any, case: Case, width: int) -> np.ndarray:
    """The rows present of a [E][cap][width] bf16 buffer, expert-major (u16 [sum(rows), width]); only those
    rows cross to the host (a capacity of 4x the mean leaves most slots unused)."""
    out = np.empty((int(case.rows.sum()), width), np.uint16)
    at = 0
    for e in np.flatnonzero(case.rows > 0):
        n = int(case.rows[e])
        out[at : at + n] = backend.read(buf.ptr + int(e) * case.cap * width * 2, n * width * 2).view(np.uint16) \
            .reshape(n, width)
        at += n
    return out


def run_case(backend: Any, a: argparse.Namespace, case: Case, variants: list[Variant], silu_kernel: Any,
             read_kernel: Any, wgmmas: list[WgmmaVariant] = (), zero_kernel: Any = None) -> dict[str, Any]:
    E, H, F, cap = case.E, case.H, case.F, case.cap
    silu = silu_kernel.bind((SILU_BLOCKS_X, E, 1), (256, 1, 1),  # the manifest's grid: the rows present only
                            [case.h13.ptr, case.act.ptr, case.rows_buf.ptr, E, 1, cap, F])
    out: dict[str, Any] = {"label": case.label, "tokens": case.tokens, "cap": cap, "dropped_pairs": case.dropped,
                           "rows_total": int(case.rows.sum()), "rows_max": int(case.rows.max()),
                           "experts_with_rows": int((case.rows > 0).sum()), "weight_bytes": case.weight_bytes,
                           "row_bytes": case.row_bytes, "us": {}, "checks": {}}
    base_h13 = base_y = None
    failed: list[str] = []
    for v in variants:
        w13, w2 = _masked(backend, case, v)
        w13.launch()
        silu.launch()
        w2.launch()
        backend.synchronize()
        h13, y = _rows_of(backend, case.h13, case, 2 * F), _rows_of(backend, case.y, case, H)
        if base_h13 is None:
            base_h13, base_y = h13, y
            ok = True
        else:
            ok = bool(np.array_equal(h13, base_h13) and np.array_equal(y, base_y))
        out["checks"][f"{v.name}_equals_production"] = ok
        if not ok:
            failed.append(f"{v.name}: bytes differ from production")
        t13 = _time(backend, [w13.launch], a.repeats)
        t2 = _time(backend, [w2.launch], a.repeats)
        tall = _time(backend, [w13.launch, silu.launch, w2.launch], a.repeats)
        out["us"][v.name] = {"w13": t13, "w2": t2, "experts": tall, "smem": v.smem, "options": v.options}
        print(f"  {case.label:<16} {v.name:<20} w13 {t13:9.1f}  w2 {t2:9.1f}  experts {tall:9.1f} µs  "
              f"{case.weight_bytes / tall / 1e6:6.2f} TB/s of weights  {'ok' if ok else 'DIFFERS'}", flush=True)
    # float64 over every row of 8 sampled experts (those with the most rows first, then spread)
    order = np.argsort(-case.rows, kind="stable")
    sample = sorted(set(order[:4].tolist()) | set(np.flatnonzero(case.rows > 0)[:: max(E // 4, 1)][:4].tolist()))
    errs = []
    starts = np.concatenate([[0], np.cumsum(case.rows)])
    want13: dict[int, np.ndarray] = {}
    for e in sample:
        if case.rows[e] == 0:
            continue
        w13e = bf16_bits_to_f32(backend.read(case.w13.ptr + e * 2 * F * H * 2, 2 * F * H * 2).view(np.uint16)
                                .reshape(2 * F, H)).astype(np.float64)
        xe = bf16_bits_to_f32(case.x_host[case.index[e * cap : e * cap + case.rows[e]]]).astype(np.float64)
        want = want13[int(e)] = xe @ w13e.T
        got = bf16_bits_to_f32(base_h13[starts[e] : starts[e + 1]]).astype(np.float64)
        errs.append(float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)))
    out["checks"]["production_h13_vs_float64_max_rel"] = max(errs) if errs else float("nan")
    out["checks"]["float64_experts"] = [int(e) for e in sample]
    if not errs or max(errs) > 1e-2:
        failed.append(f"production h13 vs float64: max relative error {max(errs) if errs else 'none'}")
    phases: dict[str, list[Any]] = {}
    for wv in wgmmas:
        phases[wv.name] = run_wgmma(backend, a, case, wv, silu, zero_kernel, (base_h13, base_y), want13, out, failed)
    # cuBLAS per expert on the dense slab: cap rows (graph-valid) and exactly the rows present (host counts)
    def per_expert(a: Any, w: Any, c: Any, n: int, k: int, m_of: Any) -> list[Any]:
        """One cuBLAS call per expert with rows: C_e[m, n] = A_e[m, k] @ W_e[n, k]^T, m = m_of(e)."""
        return [lambda e=e, m=m_of(e): backend.gemm(a.ptr + e * cap * k * 2, w.ptr + e * n * k * 2,
                                                    c.ptr + e * cap * n * 2, m, n, k)
                for e in range(E) if m_of(e) > 0]

    for name, m_of in (("cublas_cap", lambda e: cap), ("cublas_rows", lambda e: int(case.rows[e]))):
        g13 = per_expert(case.slab, case.w13, case.h13, 2 * F, H, m_of)
        g2 = per_expert(case.act, case.w2, case.y, H, F, m_of)
        for c in g13:
            c()
        silu.launch()
        for c in g2:
            c()
        backend.synchronize()
        h13 = _rows_of(backend, case.h13, case, 2 * F)
        close = bf16_bits_to_f32(h13).astype(np.float64)
        ref = bf16_bits_to_f32(base_h13).astype(np.float64)
        ok = bool(np.allclose(close, ref, rtol=2**-6, atol=2**-6 * np.abs(ref).max()))
        out["checks"][f"{name}_close_to_production"] = ok
        if not ok:
            failed.append(f"{name}: h13 not within bf16 rounding of production")
        t13 = _time(backend, g13, a.repeats)
        t2 = _time(backend, g2, a.repeats)
        tall = _time(backend, [*g13, silu.launch, *g2], a.repeats)
        out["us"][name] = {"w13": t13, "w2": t2, "experts": tall}
        phases[name] = [*g13, silu.launch, *g2]
        print(f"  {case.label:<16} {name:<20} w13 {t13:9.1f}  w2 {t2:9.1f}  experts {tall:9.1f} µs  "
              f"{case.weight_bytes / tall / 1e6:6.2f} TB/s of weights", flush=True)
    if wgmmas:
        out["alternating"] = _alternating(backend, {n: phases[n] for n in phases if n in ALTERNATE}, a.repeats)
        cub = out["alternating"]["us"]["cublas_rows"]
        out["alternating"]["vs_cublas_rows"] = {n: t / cub for n, t in out["alternating"]["us"].items()}
        print(f"  {case.label:<16} alternating rounds (median of {ALTERNATE_ROUNDS}): "
              + ", ".join(f"{n} {t:.1f} µs ({t / cub:.3f}x cublas_rows)" for n, t in out["alternating"]["us"].items()),
              flush=True)
    # the read ceiling over the same weight bytes (the experts with rows, w13 then w2)
    from tray.backend.cuda import driver as drv

    sms = drv.device_attribute(backend.device, "MULTIPROCESSOR_COUNT")
    sink = backend.allocate("eg_sink", 4 * sms * 8, export=False)
    reads = []
    for buf, per in ((case.w13, 2 * F * H * 2), (case.w2, H * F * 2)):
        # experts with rows are read; a run of consecutive experts is one launch
        e = 0
        while e < E:
            if case.rows[e] == 0:
                e += 1
                continue
            f = e
            while f < E and case.rows[f] > 0:
                f += 1
            args = [buf.ptr + e * per, (f - e) * per // 16, sink.ptr]
            reads.append(read_kernel.bind((sms * 8, 1, 1), (512, 1, 1), args))
            e = f
    t_read = _time(backend, [r.launch for r in reads], a.repeats)
    sink.close()
    out["us"]["read_ceiling"] = {"experts": t_read}
    out["tbps"] = {k: case.weight_bytes / v["experts"] / 1e6 for k, v in out["us"].items()}
    prod = out["us"][variants[0].name]["experts"]
    out["ratios"] = {
        **{f"{k}_vs_production": v["experts"] / prod for k, v in out["us"].items() if k != variants[0].name},
        "production_vs_read_ceiling": prod / t_read,
        "production_vs_cublas_cap": prod / out["us"]["cublas_cap"]["experts"],
        "production_vs_cublas_rows": prod / out["us"]["cublas_rows"]["experts"],
        **{f"{w.name}_vs_cublas_rows": out["us"][w.name]["experts"] / out["us"]["cublas_rows"]["experts"]
           for w in wgmmas},
        **{f"{w.name}_gemms_vs_cublas_rows": (out["us"][w.name]["w13"] + out["us"][w.name]["w2"])
           / (out["us"]["cublas_rows"]["w13"] + out["us"]["cublas_rows"]["w2"]) for w in wgmmas},
    }
    best = min([v.name for v in variants] + [w.name for w in wgmmas], key=lambda n: out["us"][n]["experts"])
    out["best_variant"] = best
    out["failed"] = failed
    print(f"  {case.label:<16} read_ceiling {t_read:9.1f} µs ({case.weight_bytes / t_read / 1e6:.2f} TB/s); "
          f"best variant {best} {out['us'][best]['experts']:.1f} µs", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/expert_gemm.py", description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128, help="this rank's experts (default 128: EP2 of 256)")
    ap.add_argument("--all-experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--expert-dim", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", default="256,8192", help="global tokens per case (default 256,8192: EP2 at "
                    "128 and 4096 tokens per rank)")
    ap.add_argument("--routing", default="uniform,zipf")
    ap.add_argument("--capacity", default="4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--only", default="", help="comma-separated variant names (production, and on a compute "
                    "capability 9.0 GPU wgmma, always run)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens takes comma-separated counts, got {a.tokens!r}")
    routings = a.routing.split(",")
    if a.experts < 1 or a.all_experts % a.experts:
        ap.error(f"--experts ({a.experts}) must be positive and divide --all-experts ({a.all_experts})")
    if min(tokens) < 1 or a.repeats < 1 or not 1 <= a.topk <= a.all_experts:
        ap.error(f"--tokens and --repeats must be positive and --topk in 1..{a.all_experts}; got --tokens "
                 f"{a.tokens}, --repeats {a.repeats}, --topk {a.topk}")
    if a.hidden % 8 or a.expert_dim % 8:
        ap.error(f"--hidden ({a.hidden}) and --expert-dim ({a.expert_dim}) must be multiples of 8 (16-byte rows)")
    try:
        for r in routings:
            parse_routing(r)
        capacity(a.capacity, 1, 1, a.topk, a.all_experts)
    except UsageError as exc:
        ap.error(str(exc))
    only = a.only.split(",") if a.only else []
    names = {v.name for v in VARIANTS} | {w.name for w in WGMMA_VARIANTS} | {"production", "wgmma"}
    unknown = sorted(set(only) - names)
    if unknown:
        ap.error(f"--only: no variant {', '.join(unknown)}; the variants are {', '.join(sorted(names))}")
    production = production_variant()
    variants = [production] + [v for v in VARIANTS if not only or v.name in only]
    wgmmas = [wgmma_variant()] + [w for w in WGMMA_VARIANTS if not only or w.name in only]
    from tray.backend.cuda import CudaBackend

    t0 = time.perf_counter()
    runs = []
    with CudaBackend.open(0) as backend:
        E, H, F = a.experts, a.hidden, a.expert_dim
        w13 = backend.allocate("eg_w13", E * 2 * F * H * 2, export=False)
        w2 = backend.allocate("eg_w2", E * H * F * 2, export=False)
        math_src = (kernel_dir() / "ep_math.cu").read_bytes()
        fill = backend.load_kernel("ep_fill", math_src, "ep_fill", [], peers=False, filename="ep_math.cu")
        silu = backend.load_kernel("ep_silu_mul_rows", math_src, "ep_silu_mul_rows", [], peers=False,
                                   filename="ep_math.cu")
        read = backend.load_kernel("expert_gemm_read", READ_SOURCE.encode(), "expert_gemm_read", [], peers=False)
        zero = backend.load_kernel("ep_zero32", math_src, "ep_zero32", [], peers=False, filename="ep_math.cu")
        if backend.capability != WGMMA_CAPABILITY:
            major, minor = backend.capability
            print(f"wgmma cases skipped: they need compute capability 9.0 (Hopper, sm_90a), this GPU is "
                  f"{major}.{minor}", flush=True)
            wgmmas = []
        # weights ~ N(0, 1/K)-sized values so h13 and y stay in a sane range
        fill.bind((4096, 1, 1), (256, 1, 1), [w13.ptr, E * 2 * F, H, H, 0, 0, 0, 11, float(H) ** -0.5 / 2**22]).launch()
        fill.bind((4096, 1, 1), (256, 1, 1), [w2.ptr, E * H, F, F, 0, 0, 0, 12, float(F) ** -0.5 / 2**22]).launch()
        backend.synchronize()
        print(f"expert GEMMs on device 0: {E} experts, hidden {H}, expert dim {F}, top-{a.topk} of "
              f"{a.all_experts}; variants {[v.name for v in variants] + [w.name for w in wgmmas]}", flush=True)
        for t in tokens:
            for r in routings:
                case = Case(backend, a, t, r, w13, w2)
                try:
                    runs.append(run_case(backend, a, case, variants, silu, read, wgmmas, zero))
                finally:
                    case.close()
        w13.close()
        w2.close()
    failed = [f"{r['label']}: {f}" for r in runs for f in r["failed"]]
    report = {"bench": "expert_gemm", "shape": {"experts": a.experts, "all_experts": a.all_experts, "hidden": a.hidden,
                                               "expert_dim": a.expert_dim, "topk": a.topk},
              "capacity": a.capacity, "repeats": a.repeats, "seed": a.seed,
              "variants": {v.name: v.options for v in [*variants, *wgmmas]}, "runs": runs, "passed": not failed,
              "failed": failed, "wall_s": time.perf_counter() - t0}
    write_report(report, a.json)
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
