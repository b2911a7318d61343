"""The Hopper warpgroup-MMA expert GEMMs (manifests/kernels/ep_gemm_wgmma.cu) on one GPU of compute capability
9.0: the shared-memory layout, descriptors and accumulator fragment checked by probes whose outputs name the
row / k / column they came from, then partial tiles in every dimension against float64, counts of zero, slots
past the counts untouched, the gather entry against the dense one, and the same bytes on every run. Both
widths the kernel compiles to are covered: 128 x 256 tiles (m64n256k16 wgmma, m64n128k16 for tiles of at
most 64 rows) and 128 x 128 (m64n128k16, m64n64k16), the latter with the shortest ring (3 stages) too, and
both widths of the warp-specialized block (WG_WS 1), one block per tile and persistent (ep_wgmma_gemm_tiles*),
and of its TMA mode (WG_TMA 1: the weights by tensor copies from a tensor map encoded here, whose zero fill of
rows past N and columns past K the partial tiles exercise)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import MANIFESTS

from tray.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from tray.programs.ep_moe.gemm_tile import WGMMA_CAPABILITY, WgmmaTile, mismatch_report
from tray.programs.ep_moe.tma import TENSOR_MAP_BYTES, encode_weight_map, write_weight_maps
from tray.programs.ep_moe.twins import silu_mul_bits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("isolated_kernel_cache")]

SOURCE = (MANIFESTS / "kernels" / "ep_gemm_wgmma.cu").read_bytes()
POISON = 0x7FC0  # bf16 NaN: every output element starts as it, so an unwritten one shows
# against float64: one round to nearest even (at most half a bf16 ulp, an ulp at most 2^-7 of the value), and
# float32 accumulation where the sum cancels (see bench/expert_gemm.py, WGMMA_RTOL / WGMMA_ATOL)
RTOL = 2.0**-7
ATOL = 2.0**-10
# (shape, persistent blocks or 0 for one block per tile). The manifest's shapes (TMA with 4 stages, and the
# prefill program's TMA with 3) are among them. n128s3: a ring of 3, one tile in flight; then the
# warp-specialized block (WG_WS 1: a producer warpgroup and two consumers, mbarriers per stage) at both widths,
# one block per tile and persistent (ep_wgmma_gemm_tiles*) with 5 blocks, so each walks several tiles and its
# ring's uses carry over from one tile to the next at every offset
TILES = [(WgmmaTile(256, 4), 0), (WgmmaTile(128, 6), 0), (WgmmaTile(128, 3), 0), (WgmmaTile(256, 4, 1), 0),
         (WgmmaTile(128, 6, 1), 0), (WgmmaTile(256, 3, 1), 5), (WgmmaTile(128, 6, 1), 5),
         (WgmmaTile(256, 4, 1, 1), 0), (WgmmaTile(256, 3, 1, 1), 0), (WgmmaTile(128, 6, 1, 1), 0),
         (WgmmaTile(256, 4, 1, 1), 5)]


def tile_id(shape: tuple[WgmmaTile, int]) -> str:
    t, blocks = shape
    mode = "swiglu_" if t.swiglu else "tma_" if t.tma else "ws_" if t.ws else ""
    return f"{mode}n{t.bn}s{t.stages}{'_rows' if t.raster else ''}{f'_p{blocks}' if blocks else ''}"


@pytest.fixture(scope="module")
def backend():
    from tray.backend.cuda import CudaBackend

    b = CudaBackend.open(0)
    if b.capability != WGMMA_CAPABILITY:
        b.close()
        pytest.skip(f"wgmma needs compute capability 9.0; GPU 0 is {b.capability[0]}.{b.capability[1]}")
    yield b
    b.close()


class Gemm:
    """ep_wgmma_gemm(_gather) of one tile shape over host arrays: uploads, launches, reads back."""

    def __init__(self, backend, tile: WgmmaTile, blocks: int = 0) -> None:
        """blocks > 0: the persistent entries (ep_wgmma_gemm_tiles*, WG_WS 1) over that many blocks."""
        self.b = backend
        self.tile = tile
        self.blocks = blocks
        options = ["--gpu-architecture=sm_90a", *tile.options]
        if tile.ws and os.environ.get("TRAY_WGMMA_HANG_PRINTF") == "1":
            options.append("-DWG_HANG_PRINTF=1")  # a wait that runs out prints which barrier, stage and K tile
        name = tile_id((tile, 0))  # the persistent entries are other entries of the same build
        entry = "ep_wgmma_gemm_tiles" if blocks else "ep_wgmma_gemm"
        self.gather = backend.load_kernel(f"{entry}_gather[{name}]", SOURCE, f"{entry}_gather", options,
                                          peers=False, filename="ep_gemm_wgmma.cu")
        self.dense = backend.load_kernel(f"{entry}[{name}]", SOURCE, entry, options, peers=False,
                                         filename="ep_gemm_wgmma.cu")

    def __call__(self, a: np.ndarray, b: np.ndarray, rows: np.ndarray, cap: int,
                 index: np.ndarray | None = None) -> np.ndarray:
        """C (u16 bf16 bits [experts][cap][N], NaN where nothing was written) for A u16 [.][K] (the token rows
        when `index` i32 [experts * cap] is given, else [experts * cap][K]), B u16 [experts][N][K], rows i32.
        In SwiGLU mode B is [experts][2 ffn][K] (gate rows, then up rows) and C act [experts][cap][ffn]."""
        experts, n, k = b.shape
        cn, factor = (n // 2, 2) if self.tile.swiglu else (n, 1)
        bufs = []

        def upload(name: str, data: np.ndarray):
            buf = self.b.allocate(f"wg_{name}", max(data.nbytes, 4), export=False)
            bufs.append(buf)
            if data.nbytes:
                self.b.write(buf.ptr, np.ascontiguousarray(data))
            return buf

        try:
            a_buf, b_buf = upload("a", a), upload("b", b)
            rows_buf = upload("rows", rows.astype(np.int32))
            c_buf = upload("c", np.full((experts, cap, cn), POISON, np.uint16))
            grid = (self.blocks, 1, 1) if self.blocks else self.tile.grid(n, cap, experts)
            tail = [experts] if self.blocks else []
            if self.tile.tma:  # B's tensor map, by address, as the last argument
                maps = self.b.allocate("wg_tmaps", TENSOR_MAP_BYTES, export=False)
                bufs.append(maps)
                write_weight_maps(self.b, maps, [encode_weight_map(b_buf.ptr, experts, n, k, self.tile.b_box_rows)])
                tail.append(maps.ptr)
            block = (self.tile.threads, 1, 1)
            if index is None:
                launch = self.dense.bind(grid, block, [a_buf.ptr, b_buf.ptr, c_buf.ptr, rows_buf.ptr, cap, cn,
                                                       factor, k, *tail], shmem_nbytes=self.tile.smem)
            else:
                i_buf = upload("index", index.astype(np.int32))
                args = [a_buf.ptr, i_buf.ptr, b_buf.ptr, c_buf.ptr, rows_buf.ptr, cap, cn, factor, k, *tail]
                launch = self.gather.bind(grid, block, args, shmem_nbytes=self.tile.smem)
            launch.launch()
            self.b.synchronize()
            return self.b.read(c_buf.ptr, experts * cap * cn * 2).view(np.uint16).reshape(experts, cap, cn).copy()
        finally:
            for buf in bufs:
                buf.close()


@pytest.fixture(scope="module", params=TILES, ids=tile_id)
def gemm(backend, request) -> Gemm:
    return Gemm(backend, *request.param)


def bits(x: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(np.ascontiguousarray(x, dtype=np.float32))


def f64(u16: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(u16).astype(np.float64)


# Probes over one 128 x 128-or-256 tile, K = 64 (one stage): A row r has a single nonzero at k = r % 64, so
# C[r][n] = A[r][r % 64] * B[n][r % 64], all small integers (exact in bf16 and float32). A wrong value names
# where it came from: "rows" C = r + 1 (the A row, i.e. the accumulator's row mapping); "k" C = k + 1 for the
# k that was read (the 128-byte swizzle of A against B, the 32-byte k16 step); "cols" C = n + 1 (B's rows, the
# accumulator's column mapping; n < 256, so exact).
PROBES = {
    "rows": (lambda r, k: (r + 1.0) * (k == r % 64), lambda n, k: np.ones_like(k, dtype=np.float64),
             lambda r, n: r + 1.0),
    "k": (lambda r, k: 1.0 * (k == r % 64), lambda n, k: k + 1.0, lambda r, n: r % 64 + 1.0),
    "cols": (lambda r, k: 1.0 * (k == r % 64), lambda n, k: n + 1.0 + 0 * k, lambda r, n: n + 1.0),
}
SOURCE_OF = {"rows": "the A row + 1", "k": "the k read + 1", "cols": "the B row (column of C) + 1"}


@pytest.mark.parametrize("probe", sorted(PROBES))
@pytest.mark.parametrize("rows", [128, 64])  # two warpgroups of 64 rows x all columns; one tile of <= 64 rows
def test_one_tile_probes_name_the_source_of_every_wrong_value(gemm, probe, rows):
    fa, fb, fc = PROBES[probe]
    n, k = gemm.tile.bn, 64
    r_, k_ = np.meshgrid(np.arange(128), np.arange(k), indexing="ij")
    a = bits(fa(r_, k_))
    n_, kb_ = np.meshgrid(np.arange(n), np.arange(k), indexing="ij")
    b = bits(fb(n_, kb_))[None]
    c = gemm(a, b, np.array([rows]), 128)[0]
    r_, n_ = np.meshgrid(np.arange(rows), np.arange(n), indexing="ij")
    want = fc(r_, n_)
    report = mismatch_report(f64(c[:rows]), want, 0.0, 0.0)
    assert not report, f"probe {probe!r} ({rows} rows, tile {gemm.tile}): {report}. A wrong value is {SOURCE_OF[probe]}"
    assert (c[rows:] == POISON).all(), f"rows {rows}.. past the count were written"


# (experts' rows, cap, N, K): partial tiles in every dimension (rows not a multiple of 64, N not a multiple of
# the tile, K a multiple of 8 but not of 64), counts of 0, tiles of one row (half mode), a long K
SHAPES = [
    ([128], 128, 256, 64),
    ([0, 65, 200], 256, 200, 72),
    ([1, 64], 64, 512, 200),
    ([127, 129, 0], 192, 384, 1032),
    ([300, 5, 256, 63], 320, 264, 136),
    ([70], 128, 256, 7168),
]


def make(rows: list[int], cap: int, n: int, k: int, seed: int):
    """Random bf16 operands: token rows, a gather index (each slot past the count -1: never read), the dense
    slab the index describes, weights."""
    rng = np.random.default_rng(seed)
    experts = len(rows)
    tokens = max(sum(rows), 1) + 7
    x = bits(rng.standard_normal((tokens, k)))
    w = bits(rng.standard_normal((experts, n, k)) / np.sqrt(k))
    index = np.full(experts * cap, -1, np.int32)
    perm = rng.permutation(tokens)
    at = 0
    for e, count in enumerate(rows):
        index[e * cap : e * cap + count] = perm[at : at + count]
        at += count
    slab = np.zeros((experts * cap, k), np.uint16)
    used = index >= 0
    slab[used] = x[index[used]]
    return x, w, index, slab


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"rows{'-'.join(map(str, s[0]))}_cap{s[1]}_n{s[2]}_k{s[3]}")
def test_partial_tiles_match_float64_and_the_dense_entry(gemm, shape):
    rows, cap, n, k = shape
    x, w, index, slab = make(rows, cap, n, k, seed=len(rows) * 1000 + k)
    counts = np.array(rows, np.int32)
    gathered = gemm(x, w, counts, cap, index)
    dense = gemm(slab, w, counts, cap)
    problems = []
    for e, count in enumerate(rows):
        want = f64(slab[e * cap : e * cap + count]) @ f64(w[e]).T
        scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
        report = mismatch_report(f64(gathered[e, :count]), want, RTOL, ATOL * scale)
        if report:
            problems.append(f"expert {e} ({count} rows) vs float64: {report}")
        written = int((gathered[e, count:] != POISON).sum())
        if written:
            problems.append(f"expert {e}: {written} values written in slots at or past its count {count}")
    differ = np.argwhere(gathered != dense)
    if differ.size:
        problems.append(f"gather and dense entries differ in {len(differ)} values, first (expert, row, col) "
                        f"{differ[:4].tolist()}")
    assert not problems, f"tile {gemm.tile}, shape {shape}:\n" + "\n".join(problems)


def test_the_same_bytes_on_every_run(gemm):
    rows, cap, n, k = [300, 5, 256, 63], 320, 264, 136
    x, w, index, _ = make(rows, cap, n, k, seed=7)
    counts = np.array(rows, np.int32)
    first = gemm(x, w, counts, cap, index)
    for run in range(2):
        again = gemm(x, w, counts, cap, index)
        assert np.array_equal(again, first), f"run {run + 2} differs in {int((again != first).sum())} values"


@pytest.mark.parametrize("bn, stages, blocks, tma", [(256, 4, 0, 0), (128, 6, 0, 0), (256, 4, 1, 0), (256, 3, 7, 0),
                                                     (128, 6, 132, 0), (256, 4, 0, 1), (256, 3, 0, 1), (128, 6, 0, 1),
                                                     (256, 4, 7, 1)])
def test_the_warp_specialized_block_writes_the_plain_blocks_bytes(backend, bn, stages, blocks, tma):
    """WG_WS 1 issues the same wgmma over the same shared-memory tiles in the same order as WG_WS 0: only who
    copies and how the stages are handed over differ, so the outputs are equal byte for byte (K = 1032: 17 K
    tiles, so every stage's mbarriers go round more than once), one block per tile or persistent over `blocks`
    (1: one block walks every tile; more blocks than tiles: some walk none). tma 1: B by tensor copies (its
    128-byte swizzle must lay the stage out as the cp.async path does; N = 384 leaves a half-empty box)."""
    rows, cap, n, k = [127, 129, 0, 64, 300], 320, 384, 1032
    x, w, index, slab = make(rows, cap, n, k, seed=11)
    counts = np.array(rows, np.int32)
    plain = Gemm(backend, WgmmaTile(bn, stages, 0))(x, w, counts, cap, index)
    ws = Gemm(backend, WgmmaTile(bn, stages, 1, tma), blocks)
    for name, got in (("gather", ws(x, w, counts, cap, index)), ("dense", ws(slab, w, counts, cap))):
        differ = np.argwhere(plain != got)
        assert not differ.size, f"{name}: {len(differ)} values differ, first (expert, row, col) {differ[:4].tolist()}"


@pytest.mark.parametrize("shape", [(WgmmaTile(256, 4, 1, 1, 1), 0), (WgmmaTile(256, 3, 1, 1, 1), 0),
                                   (WgmmaTile(128, 6, 1, 1, 1), 0), (WgmmaTile(256, 4, 1, 1, 1), 7),
                                   (WgmmaTile(256, 4, 1, 1, 1, raster=1), 0)], ids=tile_id)
def test_swiglu_mode_writes_the_plain_builds_h13_through_the_activation(backend, shape):
    """SwiGLU mode (WG_SWIGLU 1) multiplies the same rows by the same gate and up weights as the plain TMA build,
    with its B stage laid out as gate / up boxes, and applies silu(gate) * up to the bf16-rounded pair in its
    epilogue: act must equal the plain build's h13 through the activation (the host twin of ep_silu_mul_rows,
    bit-exact with it), byte for byte, in full tiles and half ones (<= 64 rows), through both entries. ffn 200: the
    last block's gate box reaches into the up rows and its up box past 2 ffn (zero-filled), columns never stored;
    K 1032: 17 K tiles."""
    tile, blocks = shape
    rows, cap, ffn, k = [127, 129, 0, 64, 300], 320, 200, 1032
    x, w, index, slab = make(rows, cap, 2 * ffn, k, seed=13)
    counts = np.array(rows, np.int32)
    h13 = Gemm(backend, WgmmaTile(tile.bn, tile.stages, 1, 1), blocks)(x, w, counts, cap, index)
    fused = Gemm(backend, tile, blocks)
    for name, act in (("gather", fused(x, w, counts, cap, index)), ("dense", fused(slab, w, counts, cap))):
        problems = []
        for e, count in enumerate(rows):
            want = silu_mul_bits(h13[e, :count], ffn)
            differ = np.argwhere(act[e, :count] != want)
            if differ.size:
                problems.append(f"expert {e} ({count} rows): {len(differ)} values differ, first (row, col) "
                                f"{differ[:4].tolist()}: {act[e, :count][tuple(differ[0])]:#06x} for "
                                f"{want[tuple(differ[0])]:#06x}")
            written = int((act[e, count:] != POISON).sum())
            if written:
                problems.append(f"expert {e}: {written} values written in slots at or past its count {count}")
        assert not problems, f"{tile} {name}:\n" + "\n".join(problems)
