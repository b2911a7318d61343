"""The tile shape the masked expert GEMMs are compiled with (manifests/kernels/ep_gemm.cu), read from the
kernel's source and a manifest's compiler options, and the launch geometry it implies.

The shape is fixed when the source is compiled: `#ifndef GEMM_X / #define GEMM_X value` defaults in the
source, overridden by `-DGEMM_X=value` options. A launch must pass GEMM_SMEM_BYTES of dynamic shared memory
when the ring is over 48 KiB (the kernel traps otherwise), and a grid of ceil(N / BN) x ceil(cap / BM) x
experts; the ep_moe manifest writes both out, and the tests check them against this reading.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

NAMES = ("GEMM_BM", "GEMM_BN", "GEMM_BK", "GEMM_STAGES", "GEMM_PREFETCH", "GEMM_LDMATRIX", "GEMM_PIPE")
STATIC_SMEM_MAX = 48 << 10  # the kernel's GEMM_STATIC_SMEM_MAX


@dataclass(frozen=True)
class GemmTile:
    bm: int
    bn: int
    bk: int
    stages: int
    prefetch: int
    ldmatrix: int
    pipe: int

    @property
    def smem(self) -> int:
        """GEMM_SMEM_BYTES: the ring of stages of A (bm rows) and B (bn rows), rows padded to bk + 8 bf16."""
        return self.stages * (self.bm + self.bn) * (self.bk + 8) * 2

    @property
    def dynamic_smem(self) -> int:
        """The dynamic shared memory a launch passes: the ring when it is over 48 KiB, else 0 (static)."""
        return self.smem if self.smem > STATIC_SMEM_MAX else 0

    @property
    def options(self) -> list[str]:
        return [f"-D{n}={v}" for n, v in zip(NAMES, self.values(), strict=True)]

    def values(self) -> tuple[int, ...]:
        return (self.bm, self.bn, self.bk, self.stages, self.prefetch, self.ldmatrix, self.pipe)


def tile_of(source: str, options: Sequence[str] = ()) -> GemmTile:
    """The tile shape `source` (ep_gemm.cu's text) compiles to with `options`. Raises ValueError when the
    source lacks a default for one of NAMES."""
    values: dict[str, int] = {}
    for name in NAMES:
        m = re.search(rf"#ifndef {name}\s*\n#define {name} (\d+)", source)
        if m is None:
            raise ValueError(f"ep_gemm.cu has no default for {name} (#ifndef {name} / #define {name} N)")
        values[name] = int(m.group(1))
    for opt in options:
        m = re.fullmatch(r"-D(\w+)=(\d+)", opt)
        if m and m.group(1) in values:
            values[m.group(1)] = int(m.group(2))
    return GemmTile(*(values[n] for n in NAMES))


def masked_tile(manifest: str = "ep_moe") -> GemmTile:
    """The tile shape a built-in manifest compiles ep_masked_gemm_gather with (its source and options)."""
    import json

    from tray.manifest.builtin import builtin_dir, builtin_path

    spec = next(k for k in json.loads(builtin_path(manifest).read_text())["kernels"]
                if k["entry"] == "ep_masked_gemm_gather")
    return tile_of((builtin_dir() / spec["source"]).read_text(), spec.get("options", ()))
