"""Host twins of the TP allreduce kernels (manifests/kernels/tp_allreduce.cu), registered on import.

The TP program also launches `ep_silu_mul`, `ep_fill` and `ep_zero32` (manifests/kernels/ep_math.cu);
importing this module registers their twins too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
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


# --- the low-latency one-shot (tp_ll_allreduce): the same protocol over mapped host memory -------------
LL_TICKET_BITS = 20  # TP_LL_TICKET_BITS: every launch adds 2^20 to the ticket word
LL_MAX_GROUP = 64  # the missing-member mask is one u64
LL_REFUSED, LL_MISSING, LL_EPOCH = 3, 2, 1  # state words
_LL_POLL_YIELD_S = 1e-3  # NOTE: spin with sched_yield for the first ms, then sleep: 2 cores host several ranks
_LL_POLL_SLEEP_S = 50e-6


def ll_flag(epoch: int) -> int:
    """The 32-bit flag of launch `epoch` (1-based): 1 + epoch % (2^32 - 1), never 0."""
    return 1 + epoch % 0xFFFFFFFF


def ll_lines(count: int) -> int:
    """Lines (4 bf16 each) of a `count`-element message."""
    return -(-count // 4)


def ll_pack(bits: np.ndarray, flag: int) -> np.ndarray:
    """bf16 bits u16[count] -> the message's line words u64[lines * 2]: 2 bf16 | flag << 32 each."""
    padded = np.zeros(ll_lines(bits.size) * 4, np.uint16)
    padded[: bits.size] = bits
    return padded.view(np.uint32).astype(np.uint64) | np.uint64(flag << 32)


def ll_refused(count: int, max_count: int, G: int, me: int, blocks: int) -> bool:
    """The launches the kernel refuses (state[3] = 1): count outside 1 .. 4 * (max_count // 4), bad G or me,
    a grid above 2^20 blocks."""
    return (count < 1 or ll_lines(count) > max_count // 4 or not 1 <= G <= LL_MAX_GROUP or not 0 <= me < G
            or blocks > 1 << LL_TICKET_BITS)


def ll3_flag(epoch: int) -> int:
    """The 16-bit flag of launch `epoch` (1-based) in `tp_ll3_allreduce`: 1 + epoch % 65535, never 0."""
    return 1 + epoch % 0xFFFF


def ll3_lines(count: int) -> int:
    """Dense lines (6 bf16 each, two words of 3) of a `count`-element message."""
    return -(-count // 6)


def ll3_pack(bits: np.ndarray, flag: int) -> np.ndarray:
    """bf16 bits u16[count] -> the dense line words u64[lines * 2]: 3 bf16 (the lower element lower) | flag << 48."""
    padded = np.zeros(ll3_lines(bits.size) * 6, np.uint64)
    padded[: bits.size] = bits
    e = padded.reshape(-1, 3)
    return e[:, 0] | e[:, 1] << np.uint64(16) | e[:, 2] << np.uint64(32) | np.uint64(flag << 48)


def ll3_unpack(words: np.ndarray, count: int) -> np.ndarray:
    """The dense line words -> bf16 bits u16[count] (flags dropped)."""
    e = np.stack([(words >> np.uint64(s)) & np.uint64(0xFFFF) for s in (0, 16, 32)], axis=1)
    return e.reshape(-1).astype(np.uint16)[:count]


def _ll_unpack(words: np.ndarray, count: int) -> np.ndarray:
    return (words & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.uint16)[:count]


@dataclass(frozen=True)
class _LLFormat:
    """A line format of the low-latency allreduce: how a message becomes words, and where a word's flag sits."""

    flag: Callable[[int], int]
    lines: Callable[[int], int]
    pack: Callable[[np.ndarray, int], np.ndarray]
    unpack: Callable[[np.ndarray, int], np.ndarray]
    flag_shift: int


LL_FORMAT = _LLFormat(ll_flag, ll_lines, ll_pack, _ll_unpack, 32)  # tp_ll_allreduce: 2 bf16 | 32-bit flag
LL3_FORMAT = _LLFormat(ll3_flag, ll3_lines, ll3_pack, ll3_unpack, 48)  # tp_ll3_allreduce: 3 bf16 | 16-bit flag


@twin("tp_ll_allreduce")
def tp_ll_allreduce(backend: Any, grid: Any, block: Any, inp: int, out: int, recv_peers: int, state: int, count: int,
                    max_count: int, G: int, me: int, timeout_ns: int) -> None:
    """Writes what the kernel writes: this member's lines into every other member's slot (parity, me), the
    member-order sum into `out`, zeroes over the consumed lines of its own slots, the ticket and the error
    words in `state`. Polls its slots with a timeout (sched_yield, then short sleeps)."""
    _ll_allreduce(LL_FORMAT, grid, inp, out, recv_peers, state, count, max_count, G, me, timeout_ns)


@twin("tp_ll3_allreduce")
def tp_ll3_allreduce(backend: Any, grid: Any, block: Any, inp: int, out: int, recv_peers: int, state: int, count: int,
                     max_count: int, G: int, me: int, timeout_ns: int) -> None:
    """`tp_ll_allreduce` with dense lines (3 bf16 and a 16-bit flag per word): the same buffers, state and sum."""
    _ll_allreduce(LL3_FORMAT, grid, inp, out, recv_peers, state, count, max_count, G, me, timeout_ns)


def _ll_allreduce(fmt: _LLFormat, grid: Any, inp: int, out: int, recv_peers: int, state: int, count: int,
                  max_count: int, G: int, me: int, timeout_ns: int) -> None:
    st = u64_at(state, 4)
    blocks = int(grid[0]) if isinstance(grid, (tuple, list)) else int(grid)
    if ll_refused(count, max_count, G, me, blocks):
        st[LL_REFUSED] = 1
        return
    ticket = int(st[0])
    st[0] = ticket + (1 << LL_TICKET_BITS)
    if st[LL_MISSING]:
        return  # broken: a member went missing in an earlier launch
    epoch = (ticket >> LL_TICKET_BITS) + 1
    flag, parity = fmt.flag(epoch), epoch & 1
    slot_words, lines = max_count // 4 * 2, fmt.lines(count)
    ptrs = [int(p) for p in u64_at(recv_peers, G)]
    own_bits = at(inp, count, np.uint16).copy()
    words = fmt.pack(own_bits, flag)
    for g, p in enumerate(ptrs):
        if g != me:
            u64_at(p + 8 * (parity * G + me) * slot_words, 2 * lines)[:] = words
    own = ptrs[me] + 8 * parity * G * slot_words
    got: dict[int, np.ndarray] = {}
    t0 = time.perf_counter()
    for g in range(G):
        if g == me:
            continue
        slot = u64_at(own + 8 * g * slot_words, 2 * lines)
        while True:
            seen = slot.copy()  # each 8-byte word read once: its data and flag together
            if np.all(seen >> np.uint64(fmt.flag_shift) == flag):
                break
            waited = time.perf_counter() - t0
            if waited * 1e9 > timeout_ns:
                st[LL_MISSING] = int(st[LL_MISSING]) | 1 << g
                st[LL_EPOCH] = max(int(st[LL_EPOCH]), epoch)
                return
            if waited < _LL_POLL_YIELD_S:
                os.sched_yield()
            else:
                time.sleep(_LL_POLL_SLEEP_S)
        got[g] = fmt.unpack(seen, count)
        slot[:] = 0
    parts = [own_bits if g == me else got[g] for g in range(G)]
    at(out, count, np.uint16)[:] = sum_members_bits(parts)


# --- the stress of the low-latency path (tp_ll_stress_step, tp_ll_stress_next) ----------------------------
def ll_stress_values(r: int, g: int, count: int) -> np.ndarray:
    """Member g's input of stress round r: int64[count], small integers -8 .. 8."""
    i = np.arange(count, dtype=np.uint64)
    return ((np.uint64(r * 131 + g * 31) + i * np.uint64(7)) % np.uint64(17)).astype(np.int64) - 8


def _ints_to_bf16_bits(v: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(v.astype(np.float32))


@twin("tp_ll_stress_step")
def tp_ll_stress_step(backend: Any, grid: Any, block: Any, inp: int, out: int, stress: int, count: int, G: int,
                      me: int) -> None:
    st = u64_at(stress, 4)
    r = int(st[0])
    if r > 0:
        want = sum(ll_stress_values(r - 1, g, count) for g in range(G))
        st[1] = int(st[1]) + int(np.count_nonzero(at(out, count, np.uint16) != _ints_to_bf16_bits(want)))
    at(inp, count, np.uint16)[:] = _ints_to_bf16_bits(ll_stress_values(r, me, count))


@twin("tp_ll_stress_next")
def tp_ll_stress_next(backend: Any, grid: Any, block: Any, stress: int, G: int, me: int, skew_ns: int) -> None:
    st = u64_at(stress, 4)
    r = int(st[0])
    st[0] = r + 1
    if r % G == me and skew_ns:
        time.sleep(skew_ns / 1e9)
