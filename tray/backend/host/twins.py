"""numpy twins of the CUDA kernels in manifests/kernels/, registered under the kernels' names.

A twin is called as twin(backend, grid, block, *args) with the same arguments the CUDA kernel
gets: addresses as ints, scalars as ints or floats.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

TWINS: dict[str, Callable[..., None]] = {}


def twin(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        TWINS[name] = fn
        return fn

    return register


def u32_at(ptr: int, count: int) -> np.ndarray:
    """A u32 view of `count` words at `ptr` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint32 * count).from_address(ptr))


def u64_at(ptr: int, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(ptr))


def peer_fill_words(seed: int, me: int, g: int, words: int) -> np.ndarray:
    """The words `tray_peer_fill` writes into member g's buffer for writer `me` (u32[words])."""
    base = np.uint32((seed * 0x9E3779B1) & 0xFFFFFFFF) ^ np.uint32(((me << 24) ^ (g << 16)) & 0xFFFFFFFF)
    return base ^ np.arange(words, dtype=np.uint32)


@twin("peer_fill")
def peer_fill(backend: Any, grid: Any, block: Any, peers_ptr: int, group_size: int, me: int,
              words_per_slot: int, seed: int) -> None:
    """Writes into every member g's buffer, at slot `me`, the pattern of `peer_fill_words`."""
    peers = u64_at(peers_ptr, group_size)
    for g in range(group_size):
        dst = u32_at(int(peers[g]) + 4 * me * words_per_slot, words_per_slot)
        dst[:] = peer_fill_words(seed, me, g, words_per_slot)

# The EP MoE / TP twins register themselves into TWINS on import.
from tray.backend.host import twins_moe  # noqa: E402, F401
