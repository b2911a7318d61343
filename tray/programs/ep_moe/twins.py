"""Host twins of the EP MoE kernels (manifests/kernels/ep_moe.cu, ep_math.cu, ep_gemm.cu, ep_gemm_wgmma.cu),
registered on import.

Each twin computes the bytes its CUDA kernel writes: copies for the data movement, and for the math the
same float32 operations in the same order (numpy float32 ufuncs round to nearest even per operation and
never fuse a multiply with an add, like the kernels' __fmul_rn/__fadd_rn). The pure functions here
(`silu_mul_f32`, `fill_bits`, `reduce_groups_bits`, `route_rows`, `slot_sources`,
`layout_hist`, `pack_routing`) are the specification the tests and benches check against.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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


def reduce_groups_bits(comb_bits: np.ndarray, used: np.ndarray) -> np.ndarray:
    """`ep_reduce`: u16 [groups, tokens, hidden] and bool [tokens, groups] (token t uses group q) ->
    u16 [tokens, hidden], the float32 sum over the used groups in ascending order, rounded once."""
    comb = bf16_bits_to_f32(comb_bits)
    acc = np.zeros(comb.shape[1:], _F32)
    with np.errstate(all="ignore"):
        for q in range(comb.shape[0]):
            m = used[:, q]
            acc[m] = acc[m] + comb[q][m]
    return f32_to_bf16_bits(acc)


def groups_used(experts: np.ndarray, num_experts: int, groups: int) -> np.ndarray:
    """bool [tokens, groups]: token t has a valid expert e (0 <= e < num_experts) of group
    e // (num_experts // groups). `experts`: i32 [tokens, topk]."""
    e = np.asarray(experts, np.int64)
    valid = (e >= 0) & (e < num_experts)
    used = np.zeros((e.shape[0], groups), bool)
    rows, cols = np.nonzero(valid)
    used[rows, e[rows, cols] // (num_experts // groups)] = True
    return used


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


NO_EXPERT = 0xFFFF


def pack_routing(experts: np.ndarray, weight_bits: np.ndarray, num_experts: int) -> np.ndarray:
    """The routing words ep_dispatch sends: u32 (weight bits << 16) | expert id, NO_EXPERT for an id out
    of range. `experts`: i32 [...]; `weight_bits`: u16 [...] (bf16) of the same shape."""
    e = np.asarray(experts, np.int64)
    ids = np.where((e < 0) | (e >= num_experts), NO_EXPERT, e).astype(np.uint32)
    return (np.asarray(weight_bits, np.uint32) << np.uint32(16)) | ids


def route_rows(meta: np.ndarray, lo: int, local: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Slab rows of the routing words `meta` (u32 [num_tokens, topk], global token order) for experts
    lo .. lo + local - 1: (i32 [num_tokens, topk] el * cap + position or -1, i64 [local] pairs per expert
    before the cap). Positions count in global token order, then top-k slot order."""
    e = (np.asarray(meta, np.uint32) & np.uint32(0xFFFF)).astype(np.int64).reshape(-1)
    el = e - lo
    mine = (el >= 0) & (el < local) & (e != NO_EXPERT)
    rows = np.full(e.size, -1, np.int32)
    idx = np.flatnonzero(mine)
    keys = el[idx]
    order = np.argsort(keys, kind="stable")
    totals = np.bincount(keys, minlength=local)
    starts = np.concatenate([[0], np.cumsum(totals)[:-1]])
    pos = np.empty(idx.size, np.int64)
    pos[order] = np.arange(idx.size) - starts[keys[order]]
    keep = pos < cap
    rows[idx[keep]] = (keys[keep] * cap + pos[keep]).astype(np.int32)
    return rows.reshape(np.shape(meta)), totals


def slot_sources(route_row: np.ndarray, topk: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `route_rows`' rows (i32 [num_tokens, topk], el * cap + position or -1) for `slots`
    expert slots: (i64 slot numbers written, i64 the received row each holds, i.e. its token index).
    Every other slot is left alone by the layout."""
    flat = np.asarray(route_row, np.int64).reshape(-1)
    kept = np.flatnonzero(flat >= 0)
    if kept.size and int(flat[kept].max()) >= slots:
        raise ValueError(f"route_row names slot {int(flat[kept].max())}, beyond the {slots} slots given")
    return flat[kept], kept // topk


def _dispatch_routing(topk_idx: int, topk_w: int, err: int, tokens: int, topk: int, experts: int,
                      G: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """What both dispatch kernels do before moving rows: count out-of-range experts into err[0..1], pack
    the routing words (u32[tokens * topk]), and say which tokens each member g receives (bool[tokens])."""
    idx = _at(topk_idx, tokens * topk, np.int32)
    bad = int(((idx < 0) | (idx >= experts)).sum())
    if bad:
        errs = _at(err, 4, np.uint32)
        errs[0] |= 1
        errs[1] += bad
    packed = pack_routing(idx, _at(topk_w, tokens * topk, np.uint16), experts)
    local = experts // G
    idx2 = idx.reshape(tokens, topk).astype(np.int64)
    return packed, [((idx2 >= g * local) & (idx2 < (g + 1) * local)).any(axis=1) for g in range(G)]


@twin("ep_dispatch")
def ep_dispatch(
    backend: Any,
    grid: Any,
    block: Any,
    x: int,
    topk_idx: int,
    topk_w: int,
    recv_peers: int,
    meta_peers: int,
    send: int,
    send_meta: int,
    err: int,
    tokens: int,
    topk: int,
    hidden: int,
    experts: int,
    G: int,
    me: int,
) -> None:
    words = tokens * topk
    packed, hits = _dispatch_routing(topk_idx, topk_w, err, tokens, topk, experts, G)
    xs = _rows(x, tokens, hidden)
    for g, hit in enumerate(hits):
        if send_meta:
            _at(send_meta, G * words, np.uint32)[g * words : (g + 1) * words] = packed
        else:
            _at(int(u64_at(meta_peers, G)[g]) + me * words * 4, words, np.uint32)[:] = packed
        if send:
            dst = _rows(send + g * tokens * hidden * 2, tokens, hidden)
        else:
            dst = _rows(int(u64_at(recv_peers, G)[g]) + me * tokens * hidden * 2, tokens, hidden)
        dst[hit] = xs[hit]


# --- FP8 dispatch: e4m3 bytes and a float32 scale per 128 values (ep_moe.cu's ep_dispatch_fp8) ---------------

FP8_BLOCK = 128  # NOTE: ep_moe.cu's FP8_BLOCK: values per scale
FP8_MAX = _F32(448.0)  # the largest finite e4m3fn value


def f32_to_e4m3_bits(f: np.ndarray) -> np.ndarray:
    """float32 [...] -> e4m3fn bits u8 [...]: round to nearest even, saturating to +-448 (0x7E, 0xFE); NaN ->
    0x7F with its sign. (ml_dtypes' float8_e4m3fn turns values beyond 448 into NaN instead; this is the
    kernel's recipe, bit by bit.)"""
    u = np.ascontiguousarray(f, _F32).view(np.uint32)
    sign = ((u >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    with np.errstate(all="ignore"):
        sub = np.rint(a.view(_F32) * _F32(512.0)).astype(np.int64).astype(np.uint32)  # multiples of 2^-9
    r = (a + np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
    e = (r >> np.uint32(23)).astype(np.int64) - 127
    m = (r >> np.uint32(20)) & np.uint32(7)
    normal = (((e + 7) << 3).astype(np.uint32) & np.uint32(0xFF)) | m
    code = np.where(a < np.uint32(0x3C800000), sub, normal)
    code = np.where((e > 8) | ((e == 8) & (m == 7)), np.uint32(0x7E), code)
    code = np.where(a > np.uint32(0x7F800000), np.uint32(0x7F), code)
    return (sign | code).astype(np.uint8)


def e4m3_bits_to_f32(c: np.ndarray) -> np.ndarray:
    """e4m3fn bits u8 [...] -> float32 [...], exactly (0x7F, 0xFF: NaN)."""
    c = np.asarray(c, np.uint32)
    sign = (c & np.uint32(0x80)) << np.uint32(24)
    e, m = (c >> np.uint32(3)) & np.uint32(15), c & np.uint32(7)
    sub = (m.astype(_F32) * _F32(2.0**-9)).view(np.uint32)
    bits = np.where(e == 0, sub, ((e + np.uint32(120)) << np.uint32(23)) | (m << np.uint32(20)))
    bits = np.where((e == 15) & (m == 7), np.uint32(0x7FC00000), bits | sign)
    return bits.view(_F32)


def quantize_fp8(x_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16 rows u16 [rows, hidden] (hidden % 128 == 0) -> (e4m3 bits u8 [rows, hidden], f32 scales
    [rows, hidden // 128]): per 128-value block scale = amax / 448 (1 for an all-zero block; NaN never
    counts as the amax), byte = e4m3(x / scale)."""
    rows, hidden = x_bits.shape
    if hidden % FP8_BLOCK:
        raise ValueError(f"FP8 rows need hidden % {FP8_BLOCK} == 0, got hidden {hidden}")
    x = bf16_bits_to_f32(x_bits).reshape(rows, hidden // FP8_BLOCK, FP8_BLOCK)
    with np.errstate(all="ignore"):
        amax = np.max(np.where(np.isnan(x), _F32(0), np.abs(x)), axis=2)
        scale = np.where(amax > 0, amax / FP8_MAX, _F32(1.0)).astype(_F32)
        q = f32_to_e4m3_bits(x / scale[:, :, None])
    return q.reshape(rows, hidden), scale


def dequantize_fp8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(e4m3 bits u8 [rows, hidden], f32 [rows, hidden // 128]) -> bf16 bits u16 [rows, hidden]:
    bf16(e4m3 * scale), float32 product rounded once to nearest even."""
    rows, hidden = q.shape
    f = e4m3_bits_to_f32(q).reshape(rows, hidden // FP8_BLOCK, FP8_BLOCK)
    with np.errstate(all="ignore"):
        return f32_to_bf16_bits(f * np.asarray(scale, _F32)[:, :, None]).reshape(rows, hidden)


@twin("ep_dispatch_fp8")
def ep_dispatch_fp8(
    backend: Any,
    grid: Any,
    block: Any,
    x: int,
    topk_idx: int,
    topk_w: int,
    recv8_peers: int,
    scale_peers: int,
    meta_peers: int,
    err: int,
    tokens: int,
    topk: int,
    hidden: int,
    experts: int,
    G: int,
    me: int,
) -> None:
    words = tokens * topk
    packed, hits = _dispatch_routing(topk_idx, topk_w, err, tokens, topk, experts, G)
    q, scale = quantize_fp8(_rows(x, tokens, hidden))
    nblk = hidden // FP8_BLOCK
    for g, hit in enumerate(hits):
        _at(int(u64_at(meta_peers, G)[g]) + me * words * 4, words, np.uint32)[:] = packed
        dst = _at(int(u64_at(recv8_peers, G)[g]) + me * tokens * hidden, tokens * hidden, np.uint8)
        dst.reshape(tokens, hidden)[hit] = q[hit]
        dst_s = _at(int(u64_at(scale_peers, G)[g]) + me * tokens * nblk * 4, tokens * nblk, np.float32)
        dst_s.reshape(tokens, nblk)[hit] = scale[hit]


@twin("ep_dequant_fp8")
def ep_dequant_fp8(
    backend: Any,
    grid: Any,
    block: Any,
    recv8: int,
    recv8_scale: int,
    meta: int,
    recv: int,
    tokens: int,
    topk: int,
    hidden: int,
    experts: int,
    G: int,
    me: int,
) -> None:
    rows, nblk, local = G * tokens, hidden // FP8_BLOCK, experts // G
    e = (_at(meta, rows * topk, np.uint32) & np.uint32(0xFFFF)).astype(np.int64).reshape(rows, topk)
    hit = ((e != NO_EXPERT) & (e >= me * local) & (e < (me + 1) * local)).any(axis=1)
    q = _at(recv8, rows * hidden, np.uint8).reshape(rows, hidden)[hit]
    scale = _at(recv8_scale, rows * nblk, np.float32).reshape(rows, nblk)[hit]
    _rows(recv, rows, hidden)[hit] = dequantize_fp8(q, scale)


# NOTE: ep_moe.cu's LAYOUT_CHUNK and LAYOUT_MAX_LOCAL
LAYOUT_CHUNK = 1024
LAYOUT_MAX_LOCAL = 4096


def layout_hist(meta: np.ndarray, lo: int, local: int) -> np.ndarray:
    """`ep_layout_count`: i32 [chunks, local], pairs of expert lo + el in each LAYOUT_CHUNK words of the
    routing words `meta` (u32, any shape, read flat)."""
    e = (np.asarray(meta, np.uint32).reshape(-1) & np.uint32(0xFFFF)).astype(np.int64)
    chunks = -(-e.size // LAYOUT_CHUNK)
    el = e - lo
    mine = (el >= 0) & (el < local) & (e != NO_EXPERT)
    which = np.arange(e.size) // LAYOUT_CHUNK
    hist = np.zeros((chunks, local), np.int64)
    np.add.at(hist, (which[mine], el[mine]), 1)
    return hist.astype(np.int32)


@twin("ep_layout_count")
def ep_layout_count(
    backend: Any, grid: Any, block: Any, meta: int, hist: int, tokens: int, topk: int, experts: int, G: int, me: int
) -> None:
    local, words = experts // G, G * tokens * topk
    if local > LAYOUT_MAX_LOCAL:
        return
    h = layout_hist(_at(meta, words, np.uint32), me * local, local)
    _at(hist, h.size, np.int32)[:] = h.reshape(-1)


@twin("ep_layout_place")
def ep_layout_place(
    backend: Any,
    grid: Any,
    block: Any,
    meta: int,
    hist: int,
    route_row: int,
    slot_src: int,
    expert_rows: int,
    err: int,
    tokens: int,
    topk: int,
    experts: int,
    G: int,
    me: int,
    cap: int,
) -> None:
    local, n = experts // G, G * tokens
    errs = _at(err, 4, np.uint32)
    if local > LAYOUT_MAX_LOCAL:
        errs[0] |= 8
        return
    rows, totals = route_rows(_at(meta, n * topk, np.uint32).reshape(n, topk), me * local, local, cap)
    _at(route_row, n * topk, np.int32)[:] = rows.reshape(-1)
    slots, sources = slot_sources(rows, topk, local * cap)
    _at(slot_src, local * cap, np.int32)[slots] = sources.astype(np.int32)
    _at(expert_rows, local, np.int32)[:] = np.minimum(totals, cap)
    over = totals > cap
    if over.any():
        errs[0] |= 2
        errs[2] += np.uint32(int((totals[over] - cap).sum()) & 0xFFFFFFFF)


@twin("ep_fanout")
def ep_fanout(
    backend: Any,
    grid: Any,
    block: Any,
    recv: int,
    route_row: int,
    slab: int,
    tokens: int,
    topk: int,
    hidden: int,
    G: int,
) -> None:
    n = G * tokens
    rows = _at(route_row, n * topk, np.int32)
    keep = np.flatnonzero(rows >= 0)
    if keep.size:
        dst = _rows(slab, int(rows.max()) + 1, hidden)
        dst[rows[keep]] = _rows(recv, n, hidden)[keep // topk]


@twin("ep_combine")
def ep_combine(
    backend: Any,
    grid: Any,
    block: Any,
    y: int,
    meta: int,
    route_row: int,
    comb_peers: int,
    send: int,
    tokens: int,
    topk: int,
    hidden: int,
    experts: int,
    G: int,
    me: int,
    groups: int,
) -> None:
    n, mine, per_group = G * tokens, groups // G, experts // groups
    m = _at(meta, n * topk, np.uint32).reshape(n, topk)
    rows = _at(route_row, n * topk, np.int32).reshape(n, topk)
    e = (m & np.uint32(0xFFFF)).astype(np.int64)
    group = np.where(e == NO_EXPERT, -1, e // per_group)
    w = bf16_bits_to_f32((m >> np.uint32(16)).astype(np.uint16))
    ys = _rows(y, int(rows.max()) + 1, hidden) if (rows >= 0).any() else np.zeros((0, hidden), np.uint16)
    peers = None if send else u64_at(comb_peers, G)
    for qi in range(mine):
        q = me * mine + qi
        used = (group == q).any(axis=1)
        acc = np.zeros((n, hidden), _F32)
        with np.errstate(all="ignore"):
            for kk in range(topk):
                sel = (group[:, kk] == q) & (rows[:, kk] >= 0)
                acc[sel] = acc[sel] + w[sel, kk, None] * bf16_bits_to_f32(ys[rows[sel, kk]])
        bits = f32_to_bf16_bits(acc)
        for s in range(G):
            u = slice(s * tokens, (s + 1) * tokens)
            hit = used[u]
            if send:
                dst = _rows(send + ((s * mine + qi) * tokens) * hidden * 2, tokens, hidden)
            else:
                assert peers is not None
                dst = _rows(int(peers[s]) + q * tokens * hidden * 2, tokens, hidden)
            dst[hit] = bits[u][hit]


# --- low-latency mode (ep_dispatch_ll, ep_combine_ll): the standard twins in sequence, with the kernels'
# epochs and flags between them. The flag protocol is the same bytes in the same buffers, so a host rank
# waits for its peers (other processes, writing the shared buffers) exactly as a GPU rank does; x86 keeps
# each process's stores in order, so a flag seen set means the rows before it are there.

# NOTE: the kernels give up after 10 s (LL_TIMEOUT_NS); host ranks share a few cores and may lag far
# more than GPUs do, so their twins wait longer before reporting a member missing.
LL_TWIN_TIMEOUT_S = 120.0
LL_GRID_FLIP = 0x80000000


def _ll_epoch(state: int, which: int) -> int:
    """Advance and return the launch epoch ll_state[which] (u64)."""
    words = u64_at(state, 2)
    words[which] += np.uint64(1)
    return int(words[which])


def _ll_grid(counter: int, barriers: int) -> None:
    """The grid barriers' net effect on ll_grid: each adds 2^31 (mod 2^32)."""
    c = _at(counter, 1, np.uint32)
    c[0] = np.uint32((int(c[0]) + barriers * LL_GRID_FLIP) & 0xFFFFFFFF)


def _ll_announce_and_wait(flag_peers: int, flags: int, slot: int, epoch: int, G: int, me: int, err: int) -> None:
    """Store `epoch` into every member's flags[slot + me], then wait until every member t announced
    `epoch` or later in this rank's flags[slot + t]; a member silent past LL_TWIN_TIMEOUT_S is recorded
    as the kernel does (err[0] |= 4, err[3] |= 1 << (t % 32)) and the twin goes on."""
    for p in u64_at(flag_peers, G):
        u64_at(int(p) + (slot + me) * 8, 1)[0] = np.uint64(epoch)
    own = u64_at(flags + slot * 8, G)
    deadline = time.monotonic() + LL_TWIN_TIMEOUT_S
    for t in range(G):
        while int(own[t]) < epoch:
            if time.monotonic() > deadline:
                errs = _at(err, 4, np.uint32)
                errs[0] |= 4
                errs[3] |= np.uint32(1 << (t % 32))
                break
            time.sleep(20e-6)


@twin("ep_dispatch_ll")
def ep_dispatch_ll(
    backend: Any,
    grid: Any,
    block: Any,
    x: int,
    topk_idx: int,
    topk_w: int,
    recv_peers: int,
    meta_peers: int,
    flag_peers: int,
    flags: int,
    state: int,
    grid_counter: int,
    meta: int,
    recv: int,
    route_row: int,
    slot_src: int,
    expert_rows: int,
    slab: int,
    err: int,
    tokens: int,
    topk: int,
    hidden: int,
    experts: int,
    G: int,
    me: int,
    cap: int,
) -> None:
    ep_dispatch(backend, grid, block, x, topk_idx, topk_w, recv_peers, meta_peers, 0, 0, err, tokens, topk, hidden,
                experts, G, me)
    epoch = _ll_epoch(state, 0)
    _ll_grid(grid_counter, 2 if slab else 1)  # the second grid barrier comes before the fanout only
    _ll_announce_and_wait(flag_peers, flags, 0, epoch, G, me, err)
    ep_layout_place(backend, grid, block, meta, 0, route_row, slot_src, expert_rows, err, tokens, topk, experts, G,
                    me, cap)
    if slab:
        ep_fanout(backend, grid, block, recv, route_row, slab, tokens, topk, hidden, G)


@twin("ep_combine_ll")
def ep_combine_ll(
    backend: Any,
    grid: Any,
    block: Any,
    y: int,
    meta: int,
    route_row: int,
    comb_peers: int,
    flag_peers: int,
    flags: int,
    state: int,
    grid_counter: int,
    comb: int,
    topk_idx: int,
    out: int,
    err: int,
    tokens: int,
    topk: int,
    hidden: int,
    experts: int,
    G: int,
    me: int,
    groups: int,
) -> None:
    ep_combine(backend, grid, block, y, meta, route_row, comb_peers, 0, tokens, topk, hidden, experts, G, me, groups)
    # the kernel also writes +0 for the (token, group) pairs whose token uses no expert of the group, and its reduce
    # adds every group's row (the same bytes as ep_reduce's over the groups used: +0 changes no sum from +0)
    n, mine, per_group = G * tokens, groups // G, experts // groups
    e = (_at(meta, n * topk, np.uint32).reshape(n, topk) & np.uint32(0xFFFF)).astype(np.int64)
    group = np.where(e == NO_EXPERT, -1, e // per_group)
    peers = u64_at(comb_peers, G)
    for qi in range(mine):
        q = me * mine + qi
        miss = ~(group == q).any(axis=1)
        for s in range(G):
            _rows(int(peers[s]) + q * tokens * hidden * 2, tokens, hidden)[miss[s * tokens : (s + 1) * tokens]] = 0
    epoch = _ll_epoch(state, 1)
    _ll_grid(grid_counter, 1)
    _ll_announce_and_wait(flag_peers, flags, G, epoch, G, me, err)
    c = _at(comb, groups * tokens * hidden, np.uint16).reshape(groups, tokens, hidden)
    _rows(out, tokens, hidden)[...] = reduce_groups_bits(c, np.ones((tokens, groups), bool))


@twin("ep_peer_copy")
def ep_peer_copy(
    backend: Any, grid: Any, block: Any, src: int, dst_peers: int, rows: int, hidden: int, G: int, me: int
) -> None:
    others = G - 1
    data = _rows(src, rows * others, hidden)
    for i, p in enumerate(u64_at(dst_peers, G)):
        if i == me:
            continue
        slot = (i - me - 1) % G  # rows interleave over the other members
        _rows(int(p), G * rows, hidden)[me * rows : (me + 1) * rows] = data[slot::others]


@twin("ep_silu_mul")
def ep_silu_mul(backend: Any, grid: Any, block: Any, h13: int, act: int, rows: int, ffn: int) -> None:
    _rows(act, rows, ffn)[...] = silu_mul_bits(_rows(h13, rows, 2 * ffn), ffn)


@twin("ep_silu_mul_rows")
def ep_silu_mul_rows(
    backend: Any,
    grid: Any,
    block: Any,
    h13: int,
    act: int,
    rows: int,
    all_experts: int,
    G: int,
    cap: int,
    ffn: int,
) -> None:
    experts = all_experts // G
    present = np.minimum(_at(rows, experts, np.int32), cap)
    h = _rows(h13, experts * cap, 2 * ffn)
    a = _rows(act, experts * cap, ffn)
    for e in np.flatnonzero(present > 0):
        r = slice(e * cap, e * cap + int(present[e]))
        a[r] = silu_mul_bits(h[r], ffn)


def _masked_gemm(
    a_rows: Callable[[int, int], np.ndarray], b: int, c: int, present: np.ndarray, cap: int, n: int, k: int
) -> None:
    """C rows e * cap .. e * cap + present[e] - 1 = bf16(A_e @ B[e].T) for every expert e with rows, where
    a_rows(e, count) gives A_e: expert e's first `count` A rows, u16 [count, k] (bf16 bits)."""
    experts = present.size
    b_rows = _rows(b, experts * n, k)
    c_rows = _rows(c, experts * cap, n)
    for e in np.flatnonzero(present > 0):
        count = int(present[e])
        w = bf16_bits_to_f32(b_rows[e * n : (e + 1) * n])
        c_rows[e * cap : e * cap + count] = f32_to_bf16_bits(bf16_bits_to_f32(a_rows(e, count)) @ w.T)


@twin("ep_masked_gemm")
def ep_masked_gemm(
    backend: Any,
    grid: Any,
    block: Any,
    a: int,
    b: int,
    c: int,
    rows: int,
    cap: int,
    n_units: int,
    n_factor: int,
    k: int,
) -> None:
    """The rows present of every expert (grid z = experts): float32 products and sums, rounded once (the
    host backend's gemm; the tensor cores' summation order differs, so GPU results match within bf16
    rounding, not bit for bit)."""
    experts = int(grid[2])
    present = np.minimum(_at(rows, experts, np.int32), cap)
    a_all = _rows(a, experts * cap, k)
    _masked_gemm(lambda e, count: a_all[e * cap : e * cap + count], b, c, present, cap, n_units * n_factor, k)


@twin("ep_masked_gemm_gather")
def ep_masked_gemm_gather(
    backend: Any,
    grid: Any,
    block: Any,
    a: int,
    a_index: int,
    b: int,
    c: int,
    rows: int,
    cap: int,
    n_units: int,
    n_factor: int,
    k: int,
) -> None:
    """ep_masked_gemm with expert e's row r read from A row a_index[e * cap + r] (the layout's slot_src):
    the same arithmetic on the same values, so the bytes equal ep_masked_gemm's over the gathered slab."""
    experts = int(grid[2])
    present = np.minimum(_at(rows, experts, np.int32), cap)
    index = _at(a_index, experts * cap, np.int32).astype(np.int64)
    read = (np.arange(cap)[None, :] < present[:, None]).reshape(-1)  # the slots below each expert's rows
    a_all = _rows(a, int(index[read].max(initial=-1)) + 1, k)
    _masked_gemm(lambda e, count: a_all[index[e * cap : e * cap + count]], b, c, present, cap, n_units * n_factor, k)


@twin("ep_wgmma_gemm")
def ep_wgmma_gemm(backend: Any, grid: Any, block: Any, a: int, b: int, c: int, rows: int, cap: int, n_units: int,
                  n_factor: int, k: int, tmap: int = 0) -> None:
    """ep_gemm_wgmma.cu's dense entry (the manifest's TMA build): ep_masked_gemm's contract and the same host
    arithmetic (grid z = experts; the x and y extents follow the wgmma tile, which the host does not need). `tmap`,
    the tensor map of the weights, describes `b`, which the twin reads directly."""
    ep_masked_gemm(backend, grid, block, a, b, c, rows, cap, n_units, n_factor, k)


@twin("ep_wgmma_swiglu_gather")
def ep_wgmma_swiglu_gather(backend: Any, grid: Any, block: Any, a: int, a_index: int, b: int, c: int, rows: int,
                           cap: int, n_units: int, n_factor: int, k: int, tmap: int) -> None:
    """ep_gemm_wgmma.cu's gather entry in SwiGLU mode: C = act [experts][cap][ffn] (ffn = n_units, n_factor 2),
    the gate/up GEMM's rows rounded to bf16 and then ep_silu_mul_rows's arithmetic, so the bytes are those of the
    gather entry into h13 followed by ep_silu_mul_rows (the h13 rows here live only in a host array)."""
    if n_factor != 2:
        raise ValueError(f"SwiGLU mode reads gate and up rows of B [experts][2 ffn][K]: n_factor 2, got {n_factor}")
    experts = int(grid[2])
    present = np.minimum(_at(rows, experts, np.int32), cap)
    index = _at(a_index, experts * cap, np.int32).astype(np.int64)
    read = (np.arange(cap)[None, :] < present[:, None]).reshape(-1)
    a_all = _rows(a, int(index[read].max(initial=-1)) + 1, k)
    b_rows = _rows(b, experts * 2 * n_units, k)
    c_rows = _rows(c, experts * cap, n_units)
    for e in np.flatnonzero(present > 0):
        count = int(present[e])
        w = bf16_bits_to_f32(b_rows[e * 2 * n_units : (e + 1) * 2 * n_units])
        h13 = f32_to_bf16_bits(bf16_bits_to_f32(a_all[index[e * cap : e * cap + count]]) @ w.T)
        c_rows[e * cap : e * cap + count] = silu_mul_bits(h13, n_units)


@twin("ep_reduce")
def ep_reduce(
    backend: Any,
    grid: Any,
    block: Any,
    comb: int,
    topk_idx: int,
    out: int,
    tokens: int,
    topk: int,
    hidden: int,
    experts: int,
    groups: int,
) -> None:
    c = _at(comb, groups * tokens * hidden, np.uint16).reshape(groups, tokens, hidden)
    idx = _at(topk_idx, tokens * topk, np.int32).reshape(tokens, topk)
    _rows(out, tokens, hidden)[...] = reduce_groups_bits(c, groups_used(idx, experts, groups))


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
        out[r0 : r0 + n] = fill_bits(n, cols, row_stride, index_base + r0 * row_stride, rank, rank_stride, seed, scale)


@twin("ep_zero32")
def ep_zero32(backend: Any, grid: Any, block: Any, dst: int, words: int, value: int) -> None:
    _at(dst, words, np.uint32)[:] = np.uint32(value & 0xFFFFFFFF)
