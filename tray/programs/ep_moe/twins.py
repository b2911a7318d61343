"""Host twins of the EP MoE kernels (manifests/kernels/ep_moe.cu, ep_math.cu), registered on import.

Each twin computes the bytes its CUDA kernel writes: copies for the data movement, and for the math the
same float32 operations in the same order (numpy float32 ufuncs round to nearest even per operation and
never fuse a multiply with an add, like the kernels' __fmul_rn/__fadd_rn). The pure functions here
(`silu_mul_f32`, `fill_bits`, `reduce_bits`) are the
specification the tests and benches check against.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tray.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from tray.twins import at as _at
from tray.twins import twin, u64_at

_F32 = np.float32


def _rows(ptr: int, rows: int, hidden: int) -> np.ndarray:
    """`rows` bf16 rows of `hidden` at `ptr`, as a u16 [rows, hidden] view."""
    return _at(ptr, rows * hidden, np.uint16).reshape(rows, hidden)


# --- bf16 and float32 arithmetic, exactly as the kernels do it --------------------------------------------


def _c(bits: int) -> np.float32:
    return np.array(bits, np.uint32).view(_F32)[()]


_LOG2E, _LN2_HI, _LN2_LO = _c(0x3FB8AA3B), _c(0x3F317200), _c(0x35BFBE8E)
_POLY = (
    _c(0x39500D01),
    _c(0x3AB60B61),
    _c(0x3C088889),
    _c(0x3D2AAAAB),
    _c(0x3E2AAAAB),
    _F32(0.5),
    _F32(1.0),
    _F32(1.0),
)


def ep_exp_f32(x: np.ndarray) -> np.ndarray:
    """The kernels' exp: clamp to [-87, 88], Cody-Waite reduction, degree-7 Taylor polynomial, times 2^n."""
    with np.errstate(all="ignore"):
        x = np.clip(np.asarray(x, _F32), _F32(-87.0), _F32(88.0))  # NaN stays NaN, like the ternaries
        t = x * _LOG2E
        n = np.where(np.isnan(t), _F32(0), np.rint(t)).astype(np.int32)  # __float2int_rn(NaN) = 0
        fn = n.astype(_F32)
        r = x - fn * _LN2_HI
        r = r - fn * _LN2_LO
        p = np.full_like(r, _POLY[0])
        for c in _POLY[1:]:
            p = p * r + c
        scale = ((n + 127).astype(np.uint32) << 23).view(_F32)
        return p * scale


def silu_mul_f32(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u = g / (1 + exp(-g)) * u in float32, the kernels' operation order."""
    g = np.asarray(g, _F32)
    with np.errstate(all="ignore"):
        s = g / (_F32(1.0) + ep_exp_f32(-g))
        return s * np.asarray(u, _F32)


def silu_mul_bits(h13_bits: np.ndarray, ffn: int) -> np.ndarray:
    """`ep_silu_mul` on u16 [rows, 2 * ffn] -> u16 [rows, ffn]."""
    f = bf16_bits_to_f32(h13_bits)
    return f32_to_bf16_bits(silu_mul_f32(f[:, :ffn], f[:, ffn:]))


def reduce_bits(comb_bits: np.ndarray, weight_bits: np.ndarray) -> np.ndarray:
    """`ep_reduce`: u16 [tokens, topk, hidden] and u16 [tokens, topk] -> u16 [tokens, hidden]."""
    comb = bf16_bits_to_f32(comb_bits)
    w = bf16_bits_to_f32(weight_bits)
    acc = np.zeros((comb.shape[0], comb.shape[2]), _F32)
    with np.errstate(all="ignore"):
        for k in range(comb.shape[1]):
            acc = acc + w[:, k, None] * comb[:, k, :]
    return f32_to_bf16_bits(acc)


_M64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def fill_bits(
    rows: int,
    cols: int,
    row_stride: int,
    index_base: int,
    rank: int,
    rank_stride: int,
    seed: int,
    scale: float,
) -> np.ndarray:
    """`ep_fill`: u16 [rows, cols], element (i, j) from global index
    index_base + rank * rank_stride + i * row_stride + j (see ep_math.cu)."""
    base = (index_base + rank * rank_stride + (seed * 0xD1B54A32D192ED03)) & _M64
    idx = (
        np.arange(rows, dtype=np.uint64)[:, None] * np.uint64(row_stride & _M64)
        + np.arange(cols, dtype=np.uint64)[None, :]
        + np.uint64(base)
    )
    z = _splitmix64(idx)
    m = (z >> np.uint64(40)).astype(np.int64) - 8388608
    return f32_to_bf16_bits(m.astype(_F32) * np.float32(scale))


# --- the twins ---------------------------------------------------------------------------------------------


@twin("ep_dispatch")
def ep_dispatch(
    backend: Any,
    grid: Any,
    block: Any,
    x: int,
    route_expert: int,
    route_pos: int,
    slab_peers: int,
    count_peers: int,
    send_counts: int,
    err: int,
    tokens: int,
    topk: int,
    hidden: int,
    experts: int,
    G: int,
    me: int,
    cap: int,
) -> None:
    local = experts // G
    xs = _rows(x, tokens, hidden)
    ex = _at(route_expert, tokens * topk, np.int32)
    pos = _at(route_pos, tokens * topk, np.int32)
    slabs = [_rows(int(p), local * cap, hidden) for p in u64_at(slab_peers, G)]
    counts = [_at(int(p), G * local, np.int32) for p in u64_at(count_peers, G)]
    sent = _at(send_counts, experts, np.int32)
    for e in range(experts):
        counts[e // local][me * local + e % local] = sent[e]
    bad = (ex < 0) | (ex >= experts) | (pos < 0) | (pos >= cap)
    if bad.any():
        errs = _at(err, 4, np.uint32)
        errs[0] |= 1
        errs[1] += int(bad.sum())
    for p in np.flatnonzero(~bad):
        e = int(ex[p])
        g, el = divmod(e, local)
        slabs[g][el * cap + int(pos[p])] = xs[p // topk]


@twin("ep_combine")
def ep_combine(
    backend: Any,
    grid: Any,
    block: Any,
    y: int,
    combine_src: int,
    comb_peers: int,
    err: int,
    experts: int,
    cap: int,
    tokens: int,
    topk: int,
    hidden: int,
    G: int,
) -> None:
    rows = experts // G * cap
    ys = _rows(y, rows, hidden)
    src = _at(combine_src, rows, np.int32)
    pairs = tokens * topk
    combs = [_rows(int(p), pairs, hidden) for p in u64_at(comb_peers, G)]
    for r in np.flatnonzero(src >= 0):
        g, pair = divmod(int(src[r]), pairs)
        if g >= G:
            _at(err, 4, np.uint32)[0] |= 2
            continue
        combs[g][pair] = ys[r]


@twin("ep_copy_rows")
def ep_copy_rows(
    backend: Any,
    grid: Any,
    block: Any,
    dst: int,
    src: int,
    dst_index: int,
    src_index: int,
    rows_a: int,
    rows_b: int,
    src_div: int,
    hidden: int,
) -> None:
    rows = rows_a * rows_b
    i = np.arange(rows, dtype=np.int64)
    d = _at(dst_index, rows, np.int32).astype(np.int64) if dst_index else i
    s = _at(src_index, rows, np.int32).astype(np.int64) if src_index else i // src_div
    keep = (d >= 0) & (s >= 0)
    if not keep.any():
        return
    d, s = d[keep], s[keep]
    dst_rows = _rows(dst, int(d.max()) + 1, hidden)
    dst_rows[d] = _rows(src, int(s.max()) + 1, hidden)[s]


@twin("ep_peer_copy")
def ep_peer_copy(
    backend: Any,
    grid: Any,
    block: Any,
    src: int,
    dst_peers: int,
    tokens: int,
    topk: int,
    hidden: int,
    G: int,
    me: int,
) -> None:
    rows_per_peer = tokens * topk // G
    rows = _rows(src, G * rows_per_peer, hidden)
    for g, p in enumerate(u64_at(dst_peers, G)):
        dst = _rows(int(p), G * rows_per_peer, hidden)
        dst[me * rows_per_peer : (me + 1) * rows_per_peer] = rows[g::G]  # rows interleave over members


@twin("ep_silu_mul")
def ep_silu_mul(backend: Any, grid: Any, block: Any, h13: int, act: int, rows: int, ffn: int) -> None:
    _rows(act, rows, ffn)[...] = silu_mul_bits(_rows(h13, rows, 2 * ffn), ffn)


@twin("ep_reduce")
def ep_reduce(
    backend: Any,
    grid: Any,
    block: Any,
    comb: int,
    weights: int,
    out: int,
    tokens: int,
    topk: int,
    hidden: int,
) -> None:
    c = _at(comb, tokens * topk * hidden, np.uint16).reshape(tokens, topk, hidden)
    w = _at(weights, tokens * topk, np.uint16).reshape(tokens, topk)
    _rows(out, tokens, hidden)[...] = reduce_bits(c, w)


@twin("ep_fill")
def ep_fill(
    backend: Any,
    grid: Any,
    block: Any,
    dst: int,
    rows: int,
    cols: int,
    row_stride: int,
    index_base: int,
    rank: int,
    rank_stride: int,
    seed: int,
    scale: float,
) -> None:
    # NOTE: row blocks bound the temporaries (the uint64 index grid is 4x the output's bytes).
    step = max(1, (1 << 22) // max(cols, 1))
    out = _at(dst, rows * cols, np.uint16).reshape(rows, cols)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        out[r0 : r0 + n] = fill_bits(
            n, cols, row_stride, index_base + r0 * row_stride, rank, rank_stride, seed, scale
        )


@twin("ep_zero32")
def ep_zero32(backend: Any, grid: Any, block: Any, dst: int, words: int, value: int) -> None:
    _at(dst, words, np.uint32)[:] = np.uint32(value & 0xFFFFFFFF)
