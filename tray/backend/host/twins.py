"""Host twins of the generic kernels any tray may launch (manifests/kernels/peer_fill.cu).

Imported by the host backend, so these are registered in every host rank; a program's own kernels
register their twins from the program (see `tray.twins`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tray.twins import twin, u32_at, u64_at


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

