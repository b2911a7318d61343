"""Kernel launches of the cuda backend: arguments packed once into a `void*[]`, launched many times.

`pack_plan` (pure) decides each argument's device type from the parameter sizes the driver reports
(`cuFuncGetParamInfo`); `CudaKernel.bind` packs the values into one host block and an array of
pointers into it, both kept alive by the returned launch, so a hot loop or a capture passes one address.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tray.backend.base import BoundLaunch, Kernel, launch_dims, pointer_of, remember_bound
from tray.backend.cuda import driver as drv
from tray.errors import UsageError

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_FLOATS = {2: np.float16, 4: np.float32, 8: np.float64}
# NOTE: a block may use 48 KiB of dynamic shared memory without opting in (cuFuncSetAttribute) first
STATIC_SMEM_LIMIT = 48 << 10


def _int_dtype(value: int, size: int, where: str) -> np.dtype:
    """Signed for negative values, unsigned otherwise (same bits either way); range-checked."""
    if size not in _SIGNED:
        raise UsageError(f"{where}: an int cannot fill a {size}-byte parameter")
    bits = 8 * size
    if not -(1 << (bits - 1)) <= value < (1 << bits):
        raise UsageError(f"{where}: {value} does not fit a {size}-byte parameter")
    return np.dtype(_SIGNED[size] if value < 0 else _UNSIGNED[size])


def pack_plan(param_sizes: Sequence[int], args: Sequence[Any],
              kernel: str = "kernel") -> list[tuple[Any, Any]]:
    """How each argument is packed: a list of (numpy dtype, value), or (None, bytes) for raw structs.

    Rules, by the parameter's size in bytes: an object with an int `.ptr` (a buffer, mapping or table), or a
    peer table (its `.table_ptr`) -> its address (size 8); a numpy scalar of that size -> as is; int (or bool)
    -> int/uint of the size (signed when negative); float -> f16/f32/f64 by size; bytes of exactly the size -> raw.
    Raises UsageError naming the kernel when the count differs or an argument does not fit.
    """
    if len(param_sizes) != len(args):
        raise UsageError(f"kernel {kernel!r} takes {len(param_sizes)} parameters, got {len(args)} arguments")
    plan: list[tuple[Any, Any]] = []
    for index, (size, arg) in enumerate(zip(param_sizes, args)):
        where = f"kernel {kernel!r} argument {index}"
        ptr = pointer_of(arg)
        if ptr is not None:
            if size != 8:
                raise UsageError(f"{where}: a pointer ({type(arg).__name__}) for a {size}-byte parameter")
            plan.append((np.dtype(np.uint64), ptr))
        elif isinstance(arg, np.generic) and arg.dtype.itemsize == size:
            plan.append((arg.dtype, arg.item()))
        elif isinstance(arg, (bool, np.bool_, int, np.integer)):
            plan.append((_int_dtype(int(arg), size, where), int(arg)))
        elif isinstance(arg, (float, np.floating)):
            if size not in _FLOATS:
                raise UsageError(f"{where}: a float cannot fill a {size}-byte parameter")
            plan.append((np.dtype(_FLOATS[size]), float(arg)))
        elif isinstance(arg, (bytes, bytearray, memoryview)):
            raw = bytes(arg)
            if len(raw) != size:
                raise UsageError(f"{where}: {len(raw)} raw bytes for a {size}-byte parameter")
            plan.append((None, raw))
        else:
            raise UsageError(f"{where}: cannot pass a {type(arg).__name__} to a {size}-byte parameter (use int, "
                             "float, a numpy scalar, bytes, a buffer view, a peer table, or an object with .ptr)")
    return plan


def pack(plan: Sequence[tuple[Any, Any]], param_sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(values block u8[...], pointers u64[N]): pointer i is the address of value i inside the block.

    Both arrays must outlive every launch that uses `pointers.ctypes.data`.
    """
    offsets = []
    total = 0
    for size in param_sizes:
        total = -(-total // 16) * 16  # NOTE: 16-byte slots; parameters are read by memcpy, not by type
        offsets.append(total)
        total += size
    block = np.zeros(max(total, 16), dtype=np.uint8)
    for (dtype, value), offset, size in zip(plan, offsets, param_sizes):
        raw = value if dtype is None else np.array([value], dtype=dtype).tobytes()
        block[offset:offset + size] = np.frombuffer(raw, dtype=np.uint8)
    base = block.ctypes.data
    pointers = np.array([base + off for off in offsets], dtype=np.uint64)
    return block, pointers


class CudaLaunch(BoundLaunch):
    """One kernel with its arguments packed; `launch()` enqueues it on the backend's stream."""

    def __init__(self, kernel: CudaKernel, grid: tuple[int, int, int], block: tuple[int, int, int],
                 shmem_nbytes: int, stream: Any, plan: Sequence[tuple[Any, Any]],
                 programmatic: bool = False) -> None:
        self._function = kernel.function
        self._entry = kernel.entry
        self._stream = stream
        self._values, self._pointers = pack(plan, kernel.param_sizes)
        self._params_addr = self._pointers.ctypes.data if len(plan) else 0
        # the hot path: a closure over C arguments converted once (see drv.launcher)
        self._launch = drv.launcher(self._function, grid, block, shmem_nbytes, stream, self._params_addr,
                                    self._entry, programmatic)

    def launch(self) -> None:
        self._launch()


class CudaKernel(Kernel):
    """A loaded kernel. `param_sizes` (bytes per parameter) is read once, at load."""

    def __init__(self, name: str, entry: str, function: Any, stream: Any) -> None:
        self.name = name
        self.entry = entry
        self.function = function
        self._stream = stream
        self.param_sizes = drv.func_param_sizes(function, entry)
        self._smem_opt_in = 0  # the dynamic shared memory this function was allowed (cuFuncSetAttribute)

    def bind(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: Sequence[Any],
             shmem_nbytes: int = 0, programmatic: bool = False, stream: Any = None) -> CudaLaunch:
        """Pack `args` once; launches go to `stream` (a binding stream or an int handle; default: the
        backend's). Raises UsageError if the arguments do not match the kernel's parameters."""
        plan = pack_plan(self.param_sizes, args, self.name)
        if shmem_nbytes > max(self._smem_opt_in, STATIC_SMEM_LIMIT):
            drv.func_set_max_dynamic_smem(self.function, shmem_nbytes, self.entry)
            self._smem_opt_in = int(shmem_nbytes)
        return remember_bound(self, CudaLaunch(self, launch_dims(grid, "grid", self.name),
                                               launch_dims(block, "block", self.name), int(shmem_nbytes),
                                               self._stream if stream is None else stream, plan, programmatic))
