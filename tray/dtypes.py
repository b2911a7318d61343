"""bf16 as u16 bit patterns, converted exactly as the CUDA kernels convert (no ml_dtypes needed)."""

from __future__ import annotations

import numpy as np

_F32 = np.float32


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (u16, any shape) -> float32 of the same shape (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(_F32)


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 (any shape) -> bf16 bit patterns (u16): round to nearest even, every NaN -> 0x7FC0 (the
    kernels' recipe; equal to ml_dtypes' rounding on every non-NaN value)."""
    f = np.ascontiguousarray(values, dtype=_F32)
    u = f.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), rounded)
