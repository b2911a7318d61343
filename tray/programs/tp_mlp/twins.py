"""Host twin of the TP allreduce kernel (manifests/kernels/tp_allreduce.cu), registered on import.

The TP program also launches `ep_silu_mul`, `ep_fill` and `ep_zero32` (manifests/kernels/ep_math.cu);
importing this module registers their twins too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import tray.programs.ep_moe.twins  # noqa: F401  (registers the ep_math.cu twins the TP manifest launches)
from tray.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from tray.twins import at, twin, u64_at

_F32 = np.float32


def sum_members_bits(parts: list[np.ndarray]) -> np.ndarray:
    """`tp_sum_peers`: the member-order float32 sum of bf16 arrays (u16), rounded to bf16."""
    acc = np.zeros(np.shape(parts[0]), _F32)
    with np.errstate(all="ignore"):
        for p in parts:
            acc = acc + bf16_bits_to_f32(p)
    return f32_to_bf16_bits(acc)


@twin("tp_sum_peers")
def tp_sum_peers(backend: Any, grid: Any, block: Any, peers: int, out: int, count: int, G: int) -> None:
    parts = [at(int(p), count, np.uint16) for p in u64_at(peers, G)]
    at(out, count, np.uint16)[:] = sum_members_bits(parts)


def chunk_range(count: int, G: int, member: int) -> tuple[int, int]:
    """(begin, n): member `member`'s element range of the two-shot allreduce (tp_chunk / tp_chunk_len)."""
    chunk = (-(-count // G) + 7) // 8 * 8
    begin = member * chunk
    return begin, max(0, min(chunk, count - begin))


@twin("tp_rs_peers")
def tp_rs_peers(backend: Any, grid: Any, block: Any, peers: int, out: int, count: int, G: int, me: int) -> None:
    begin, n = chunk_range(count, G, me)
    parts = [at(int(p) + 2 * begin, n, np.uint16) for p in u64_at(peers, G)]
    at(out + 2 * begin, n, np.uint16)[:] = sum_members_bits(parts)


@twin("tp_ag_peers")
def tp_ag_peers(backend: Any, grid: Any, block: Any, outs: int, count: int, G: int, me: int) -> None:
    begin, n = chunk_range(count, G, me)
    ptrs = [int(p) for p in u64_at(outs, G)]
    mine = at(ptrs[me] + 2 * begin, n, np.uint16)
    for g, p in enumerate(ptrs):
        if g != me:
            at(p + 2 * begin, n, np.uint16)[:] = mine
