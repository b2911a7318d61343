"""GEMM of the cuda backend: cuBLAS `cublasGemmEx` on raw device addresses, via nvmath-python's bindings.

nvmath's high-level `matmul` wants array objects; its raw bindings take ints (the calls below were
verified on the target). One cuBLAS handle per backend, bound to the rank's stream, with a
fixed workspace set before any capture so that captured GEMMs allocate nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tray.backend.cuda import driver as drv
from tray.errors import DeviceError, UsageError

WORKSPACE_NBYTES = 32 << 20  # NOTE: cuBLAS's recommended workspace for Hopper; captures need a fixed one
# cudaDataType_t values (library_types.h) of the manifest dtypes cuBLAS multiplies here
CUDA_DATA_TYPES = {"bf16": 14, "f16": 2, "f32": 0}


def _cublas() -> Any:
    try:
        from nvmath.bindings import cublas
    except ImportError as exc:
        raise DeviceError(f"GEMM on the cuda backend needs nvmath-python ({exc}); install it "
                          "(`make gpu-wheels` carries it to machines without a network)") from exc
    return cublas


def _checked(call: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        if type(exc).__name__ == "cuBLASError" or isinstance(exc, OSError | RuntimeError):
            raise DeviceError(f"{call}: {exc}") from exc
        raise


class CublasGemm:
    """Row-major C[m, n] (+)= A[m, k] @ B[n, k]^T with float32 accumulation, on one stream."""

    def __init__(self, stream_handle: int) -> None:
        self._lib = _cublas()
        self._handle = _checked("cublasCreate", self._lib.create)
        self._workspace = 0
        try:
            _checked("cublasSetStream", self._lib.set_stream, self._handle, stream_handle)
            self._workspace = drv.mem_alloc(WORKSPACE_NBYTES)
            _checked("cublasSetWorkspace", self._lib.set_workspace, self._handle, self._workspace,
                     WORKSPACE_NBYTES)
        except BaseException:
            self.close()
            raise
        # NOTE: host-mode scalars; cuBLAS reads them when the call is enqueued (or captured)
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = {False: np.zeros(1, dtype=np.float32), True: np.ones(1, dtype=np.float32)}

    def gemm(self, a_ptr: int, b_ptr: int, c_ptr: int, m: int, n: int, k: int, dtype: str,
             accumulate: bool) -> None:
        """Enqueue the GEMM. Raises UsageError for an unsupported dtype or a non-positive shape."""
        data_type = CUDA_DATA_TYPES.get(dtype)
        if data_type is None:
            known = ", ".join(CUDA_DATA_TYPES)
            raise UsageError(f"gemm dtype {dtype!r} is not supported; use one of {known}")
        if min(m, n, k) <= 0:
            raise UsageError(f"gemm shape m={m}, n={n}, k={k}: every dimension must be positive")
        lib = self._lib
        # Column-major cuBLAS sees row-major C[m, n] as C^T[n, m] = op_T(B)[n, k] @ A^T[k, m].
        _checked(f"cublasGemmEx(m={m}, n={n}, k={k}, {dtype})", lib.gemm_ex, self._handle,
                 lib.Operation.T, lib.Operation.N, n, m, k, self._alpha.ctypes.data,
                 b_ptr, data_type, k, a_ptr, data_type, k, self._beta[bool(accumulate)].ctypes.data,
                 c_ptr, data_type, n, lib.ComputeType.COMPUTE_32F, lib.GemmAlgo.DEFAULT)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        workspace, self._workspace = self._workspace, 0
        try:
            if handle is not None:
                _checked("cublasDestroy", self._lib.destroy, handle)
        finally:
            if workspace:
                drv.mem_free(workspace)
