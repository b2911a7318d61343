"""`tray bench tp`'s defaults per backend: its parser's help says them, the bench takes them (no numpy here)."""

from __future__ import annotations

DEFAULTS = {
    "cuda": {"sizes": tuple(8 << i for i in range(24)), "tokens": tuple(4**i for i in range(7)),
             "hidden": 8192, "ffn": 28672, "repeats": 20, "ll_sweep_bytes": 4 << 20},
    "host": {"sizes": tuple(8 << i for i in range(13)), "tokens": (1, 8, 64), "hidden": 256, "ffn": 1024,
             "repeats": 3, "ll_sweep_bytes": 32 << 10},
}
