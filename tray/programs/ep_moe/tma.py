"""The tensor map through which ep_gemm_wgmma.cu's TMA mode (WG_TMA 1) reads the experts' weights.

B is [experts][N][K] bf16, K-major and dense (nn.Linear weights, one expert after another). Its map is 3-D,
dimensions innermost first: {K, N, experts} elements, byte strides {2 K, 2 N K} for dimensions 1 and 2 (the
driver takes dimension 0 as contiguous), a box of {64, rows, 1} (one K tile of `rows` rows of one expert, 128
bytes a row: the kernel's whole stage of B, WG_BN rows, or in SwiGLU mode a quarter of it, WgmmaTile.b_box_rows),
element strides 1, no interleave, the 128-byte swizzle
(row r's 16-byte chunk c lands at chunk c ^ (r % 8) of its 1024-byte atom: the layout the kernel's wgmma
descriptors read), L2 promotion of 256 bytes, and out-of-bounds elements filled with zeros (columns past K,
rows past N: the masking the cp.async path does by zero-filling).

`weight_map_args` computes these fields (pure, testable without a GPU); `encode_weight_map` has the driver
encode them into the 128 opaque bytes a kernel reads (tray/backend/cuda/driver.py tensor_map_encode_tiled).
The bytes go into a device buffer (64-byte aligned) whose address is the entries' last argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)
TENSOR_MAP_ALIGN = 64  # the driver's and the tensor copy's alignment of a map in memory
BF16_BYTES = 2
BOX_K = 64  # the kernel's WG_BK: one 128-byte swizzled row per box row
SWIZZLE_SPAN = 128  # CU_TENSOR_MAP_SWIZZLE_128B: a box's inner extent may be at most this many bytes
MAX_BOX = 256  # the driver's limit on each box dimension
MAX_DIM = 1 << 32  # globalDim[i] <= 2^32
MAX_STRIDE = 1 << 40  # globalStrides[i] < 2^40


@dataclass(frozen=True)
class TiledMapArgs:
    """cuTensorMapEncodeTiled's arguments, apart from the global address: dims and box in elements, innermost
    first; strides in bytes for dimensions 1 .. rank - 1; the enums by their driver names' tails
    (CU_TENSOR_MAP_DATA_TYPE_<dtype>, _SWIZZLE_<swizzle>, _INTERLEAVE_<interleave>, _L2_PROMOTION_<l2>,
    _FLOAT_OOB_FILL_<oob_fill>)."""

    dtype: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: str = "NONE"
    swizzle: str = "128B"
    l2: str = "L2_256B"
    oob_fill: str = "NONE"  # NONE fills out-of-bounds elements with zeros (NAN_REQUEST_ZERO_FMA would be NaN)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def box_bytes(self) -> int:
        """Bytes one tensor copy of a whole box writes to shared memory (and completes on its barrier)."""
        n = BF16_BYTES
        for b in self.box:
            n *= b
        return n


BOX_ROWS = (32, 64, 128, 256)  # WG_BN (128 or 256) rows, or a quarter of them (SwiGLU mode's gate / up boxes)


def weight_map_args(experts: int, n: int, k: int, bn: int) -> TiledMapArgs:
    """The tensor map fields for B [experts][n][k] bf16 read in boxes of 64 (k) x bn rows of one expert (bn: the
    box's rows, WgmmaTile.b_box_rows).

    Raises ValueError (naming what was expected and seen) for shapes the driver would refuse or the kernel
    does not take: k % 8 != 0 (a row's byte stride must be a multiple of 16), bn not one of BOX_ROWS, a count < 1
    or a dimension or stride past the driver's limits."""
    if bn not in BOX_ROWS:
        raise ValueError(f"the weights' box is a kernel tile of WG_BN rows (128 or 256) or a quarter of one (SwiGLU "
                         f"mode), so 32, 64, 128 or 256 rows; got {bn}")
    if experts < 1 or n < 1 or k < 1:
        raise ValueError(f"B [experts][N][K] needs every extent >= 1; got [{experts}][{n}][{k}]")
    if k % 8:
        raise ValueError(f"B's K ({k}) must be a multiple of 8: the row stride ({k * BF16_BYTES} bytes) of a tensor "
                         f"map must be a multiple of 16 bytes (the kernel's own K % 8 == 0)")
    dims = (k, n, experts)
    strides = (k * BF16_BYTES, n * k * BF16_BYTES)
    if max(dims) > MAX_DIM or max(strides) >= MAX_STRIDE:
        raise ValueError(f"B [{experts}][{n}][{k}] is past a tensor map's limits (extents <= 2^32, byte strides "
                         f"< 2^40): strides {strides}")
    box = (BOX_K, bn, 1)
    assert BOX_K * BF16_BYTES <= SWIZZLE_SPAN and max(box) <= MAX_BOX  # fixed by the constants above
    return TiledMapArgs("BFLOAT16", dims, strides, box, (1, 1, 1))


def encode_weight_map(ptr: int, experts: int, n: int, k: int, bn: int) -> bytes:
    """The 128 bytes of B's tensor map (see the module doc) for weights at device address `ptr` (16-byte
    aligned). Raises ValueError for a bad shape or address, CudaError when the driver refuses."""
    from tray.backend.cuda import driver as drv

    if ptr % 16:
        raise ValueError(f"a tensor map's global address must be 16-byte aligned; the weights are at {ptr:#x}")
    return drv.tensor_map_encode_tiled(weight_map_args(experts, n, k, bn), ptr)


def write_weight_maps(backend: Any, buf: Any, maps: list[bytes], first: int = 0) -> None:
    """Write `maps` (128 bytes each) one after another into device buffer `buf` (its address 64-byte aligned)
    from slot `first` on: a kernel reads slot i at buf.ptr + 128 i. Raises ValueError when the buffer is
    misaligned or short, or a map is not 128 bytes."""
    if buf.ptr % TENSOR_MAP_ALIGN:
        raise ValueError(f"tensor maps must sit 64-byte aligned; the buffer is at {buf.ptr:#x}")
    data = b"".join(maps)
    end = (first + len(maps)) * TENSOR_MAP_BYTES
    if first < 0 or any(len(m) != TENSOR_MAP_BYTES for m in maps) or end > buf.nbytes:
        raise ValueError(f"slots {first} .. {first + len(maps) - 1} of {TENSOR_MAP_BYTES}-byte tensor maps need "
                         f"{end} bytes; got map sizes {[len(m) for m in maps]} "
                         f"and a buffer of {buf.nbytes}")
    import numpy as np

    backend.write(buf.ptr + first * TENSOR_MAP_BYTES, np.frombuffer(data, np.uint8))
