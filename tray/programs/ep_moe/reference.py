"""The float64 reference of the EP MoE layer for sampled tokens (pure numpy; EP1's rank program runs it).

For each sampled token t: ref[t] = sum over its kept pairs (t, k) of w[t, k] * expert_e(x[t]), with
expert_e(x) = (silu(x @ w1_e.T) * (x @ w3_e.T)) @ w2_e.T, every operation in float64 on the layer's bf16
inputs, weights and routing weights. Only the (token, expert) rows the sample uses are computed, grouped by
expert so each expert's weights are read and converted once; experts run on a thread pool (numpy's casts
and matmuls release the GIL) while the caller's `expert_weights` (a device read) fetches the next one.

Cost at DeepSeek-V3's expert shape (hidden 7168, expert dim 2048; 88 MB of bf16 weights per expert):
about 70 ms of one core per expert, so a sample covering 256 experts is ~18 core-seconds; weights are
converted in row blocks, so no expert-sized float64 copy is ever made.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tray.dtypes import bf16_bits_to_f32

# NOTE: 256 rows of a 7168-wide matrix in float64 is 14.7 MB: converted, multiplied and dropped while
# (mostly) still in cache, instead of a 235 MB float64 copy of w13 per expert.
BLOCK_ROWS = 256
MAX_WORKERS = 8


def matmul_bits_t(a: np.ndarray, b_bits: np.ndarray) -> np.ndarray:
    """a @ B.T in float64: `a` f64 [m, k], `b_bits` u16 [n, k] (bf16 bits) -> f64 [m, n]."""
    n = b_bits.shape[0]
    out = np.empty((a.shape[0], n))
    for r0 in range(0, n, BLOCK_ROWS):
        block = bf16_bits_to_f32(b_bits[r0 : r0 + BLOCK_ROWS]).astype(np.float64)
        np.matmul(a, block.T, out=out[:, r0 : r0 + BLOCK_ROWS])
    return out


def expert_f64(xs: np.ndarray, w13_bits: np.ndarray, w2_bits: np.ndarray) -> np.ndarray:
    """One expert on rows `xs` (f64 [m, hidden]) in float64: w13_bits u16 [2 * ffn, hidden] (w1 then w3),
    w2_bits u16 [hidden, ffn] -> f64 [m, hidden]."""
    ffn = w2_bits.shape[1]
    h = matmul_bits_t(xs, w13_bits)
    g, u = h[:, :ffn], h[:, ffn:]
    with np.errstate(all="ignore"):  # NOTE: exp overflows to inf for very negative g: silu -> -0, as it should
        act = g / (1.0 + np.exp(-g)) * u
    return matmul_bits_t(act, w2_bits)


def workers() -> int:
    """Threads for the reference: the CPUs this process may run on, at most MAX_WORKERS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # NOTE: not on every platform (macOS)
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus))


def reference_rows(
    x_bits: np.ndarray,
    experts: np.ndarray,
    weight_bits: np.ndarray,
    kept: np.ndarray,
    tokens: list[int],
    expert_weights: Callable[[int], tuple[np.ndarray, np.ndarray]],
    threads: int | None = None,
) -> tuple[np.ndarray, int]:
    """float64 layer outputs of `tokens` -> (f64 [len(tokens), hidden], experts computed).

    x_bits u16 [num_tokens, hidden] (bf16 bits); experts i32 [num_tokens, topk]; weight_bits u16
    [num_tokens, topk] (bf16 routing weights); kept bool [num_tokens, topk] (pairs the capacity kept: the
    others contribute nothing, as in the layer); expert_weights(e) -> (w13 u16 [2 * ffn, hidden], w2 u16
    [hidden, ffn]), called from this thread only, in ascending expert order; when it is called, at most
    `threads` (workers() when None) of its earlier results are still in use, so a caller may hand out
    threads + 1 buffers in turn. Each expert's contributions are added in ascending expert order
    (deterministic). Raises what expert_weights raises."""
    sel = np.asarray(tokens, np.int64)
    hidden = x_bits.shape[1]
    ref = np.zeros((sel.size, hidden))
    if sel.size == 0:
        return ref, 0
    rows, slots = np.nonzero(kept[sel])
    ids = experts[sel][rows, slots].astype(np.int64)
    w = bf16_bits_to_f32(weight_bits[sel][rows, slots]).astype(np.float64)
    xs = bf16_bits_to_f32(x_bits[sel]).astype(np.float64)
    order = np.argsort(ids, kind="stable")
    rows, ids, w = rows[order], ids[order], w[order]
    uniq, starts = np.unique(ids, return_index=True)
    bounds = [*starts.tolist(), ids.size]
    n_threads = workers() if threads is None else max(1, threads)
    pending: list[tuple[slice, Future[np.ndarray]]] = []

    def drain(keep: int) -> None:  # add finished experts' rows in submission (= expert) order
        while len(pending) > keep:
            span, fut = pending.pop(0)
            ref[rows[span]] += w[span, None] * fut.result()  # a token's experts are distinct

    with ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="ep-ref") as pool:
        try:
            for i, e in enumerate(uniq.tolist()):
                span = slice(bounds[i], bounds[i + 1])
                w13_bits, w2_bits = expert_weights(e)
                pending.append((span, pool.submit(expert_f64, xs[rows[span]], w13_bits, w2_bits)))
                drain(n_threads)  # NOTE: at most `threads` results in use when expert_weights is next called
            drain(0)
        finally:
            for _, fut in pending:
                fut.cancel()
    return ref, int(uniq.size)
