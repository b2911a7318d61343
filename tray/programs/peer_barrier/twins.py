"""Host twins of the barrier stress kernels (manifests/kernels/peer_stress.cu), registered on import."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tray.twins import twin, u32_at, u64_at

_MASK32 = 0xFFFFFFFF


def stress_words(round_: int, writer: int, member: int, words: int) -> np.ndarray:
    """`stress_word(r, w, g, i)` for i < words: what writer `writer` puts into member `member`'s buffer
    in round `round_` (u32[words], wrapping u32 arithmetic as in the kernel)."""
    base = ((round_ * 0x9E3779B1) ^ (writer << 24) ^ (member << 16)) & _MASK32
    i = np.arange(words, dtype=np.uint32)
    with np.errstate(over="ignore"):
        return np.uint32(base) ^ (i * np.uint32(0x85EBCA6B))


@twin("stress_next")
def stress_next(backend: Any, grid: Any, block: Any, state: int) -> None:
    u64_at(state, 1)[0] += 1


@twin("stress_produce")
def stress_produce(backend: Any, grid: Any, block: Any, peers: int, state: int, G: int, me: int, words: int,
                   skew_ns: int, corrupt_round: int) -> None:
    r = int(u64_at(state, 1)[0])
    wait_ns = skew_ns * ((r + me) % G)
    if wait_ns:
        time.sleep(wait_ns * 1e-9)
    slot = ((r & 1) * G + me) * words
    for g, ptr in enumerate(u64_at(peers, G)):
        values = stress_words(r, me, g, words)
        if r == corrupt_round and g == (me + 1) % G:
            values[0] ^= 1
        u32_at(int(ptr) + 4 * slot, words)[:] = values


@twin("stress_check")
def stress_check(backend: Any, grid: Any, block: Any, buf: int, state: int, G: int, me: int, words: int) -> None:
    st = u64_at(state, 4)
    r = int(st[0])
    got = u32_at(buf + 4 * (r & 1) * G * words, G * words).reshape(G, words)
    bad = np.count_nonzero(got != np.stack([stress_words(r, w, me, words) for w in range(G)]), axis=1)
    if bad.any():
        st[1] += int(bad.sum())
        st[2] |= sum(1 << w for w in range(G) if bad[w])
        if st[3] == 0:
            st[3] = r
