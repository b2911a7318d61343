"""The CUDA C of the EP/TP kernels, compiled for the CPU, against their numpy twins, bit for bit.

No GPU needed: a shim header gives the CUDA names a host meaning (IEEE float ops with no contraction
for the __f*_rn intrinsics, a sequential loop over blocks and threads for a launch), so the kernels'
indexing, vector packing and bf16 bit recipes are checked here; only the intrinsics' own semantics
(documented IEEE round-to-nearest) are taken on trust. Skipped when no C++ compiler is installed.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from conftest import MANIFESTS

import tray.programs.ep_moe.twins
import tray.programs.tp_mlp.twins  # noqa: F401
from tray.backend.host import HostBackend
from tray.dtypes import f32_to_bf16_bits
from tray.twins import lookup

CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the CUDA sources for the CPU")

SHIM = r"""
#include <cmath>
#include <cstring>
#include <cstddef>
struct uint4 { unsigned int x, y, z, w; } __attribute__((aligned(16)));
struct dim3 { unsigned int x = 1, y = 1, z = 1; };
static dim3 blockIdx, threadIdx, gridDim, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline int __float2int_rn(float x) { return std::isnan(x) ? 0 : (int)std::nearbyintf(x); }
static inline unsigned int atomicOr(unsigned int* p, unsigned int v) { unsigned o = *p; *p |= v; return o; }
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { unsigned o = *p; *p += v; return o; }
static inline void __threadfence_system() {}
static inline void __syncwarp() {}
#define LAUNCH(call) for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x) \
    for (threadIdx.x = 0; threadIdx.x < blockDim.x; ++threadIdx.x) { call; }
"""

# kernel name -> its parameter list as C (the launcher forwards them unchanged)
KERNELS = {
    "ep_moe.cu": {
        "ep_dispatch": "const uint4* x, const int* re, const int* rp, unsigned char* const* sp, "
        "int* const* cp, const int* sc, unsigned int* err, int tokens, int topk, int hidden, int experts, "
        "int G, int me, int cap",
        "ep_combine": "const uint4* y, const int* cs, unsigned char* const* cp, unsigned int* err, "
        "int experts, int cap, int tokens, int topk, int hidden, int G",
        "ep_copy_rows": "unsigned char* dst, const unsigned char* src, const int* di, const int* si, "
        "int ra, int rb, int sd, int hidden",
        "ep_peer_copy": "const uint4* src, unsigned char* const* dp, int tokens, int topk, int hidden, "
        "int G, int me",
    },
    "ep_math.cu": {
        "ep_silu_mul": "const uint4* h13, uint4* act, int rows, int ffn",
        "ep_reduce": "const uint4* comb, const unsigned short* w, uint4* out, int tokens, int topk, "
        "int hidden",
        "ep_fill": "unsigned short* dst, long long rows, long long cols, long long rs, long long ib, "
        "int rank, long long rks, unsigned int seed, float scale",
        "ep_zero32": "unsigned int* dst, long long words, unsigned int value",
    },
    "tp_allreduce.cu": {"tp_sum_peers": "const uint4* const* peers, uint4* out, long long count, int G"},
}


def _names(params: str) -> str:
    return ", ".join(p.strip().split()[-1].lstrip("*") for p in params.split(","))


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    d = tmp_path_factory.mktemp("emu")
    src = [SHIM]
    for file, kernels in KERNELS.items():
        src.append(f"namespace k_{file.split('.')[0]} {{\n{(MANIFESTS / 'kernels' / file).read_text()}\n}}")
        for name, params in kernels.items():
            call = f"k_{file.split('.')[0]}::{name}({_names(params)})"
            src.append(
                f'extern "C" void run_{name}(unsigned int grid, unsigned int block, {params}) {{ '
                f"gridDim.x = grid; blockDim.x = block; LAUNCH({call}) }}"
            )
    (d / "emu.cpp").write_text("\n".join(src))
    lib = d / "emu.so"
    subprocess.run(
        [
            CXX,
            "-O1",
            "-std=c++17",
            "-shared",
            "-fPIC",
            "-ffp-contract=off",
            "-fno-fast-math",
            "-w",
            "-x",
            "c++",
            str(d / "emu.cpp"),
            "-o",
            str(lib),
        ],
        check=True,
        capture_output=True,
    )
    return ctypes.CDLL(str(lib))


def both(emulated, name, grid, block, make_args, arrays):
    """Run the emulated CUDA kernel and the twin on copies of `arrays`; return both results."""
    cuda_arrays = {k: v.copy() for k, v in arrays.items()}
    twin_arrays = {k: v.copy() for k, v in arrays.items()}
    fn = getattr(emulated, f"run_{name}")
    sig = KERNELS[next(f for f, ks in KERNELS.items() if name in ks)][name]
    types = []
    for p in sig.split(","):
        p = p.strip()
        types.append(
            ctypes.c_void_p
            if "*" in p
            else ctypes.c_float
            if p.startswith("float")
            else ctypes.c_longlong
            if p.startswith("long long")
            else ctypes.c_uint
            if p.startswith("unsigned")
            else ctypes.c_int
        )
    fn.argtypes = [ctypes.c_uint, ctypes.c_uint, *types]
    fn(grid, block, *make_args(cuda_arrays))
    lookup(name)(
        HostBackend.open(0),
        (grid, 1, 1),
        (block, 1, 1),
        *[int(a.value) if isinstance(a, ctypes.c_void_p) else a for a in make_args(twin_arrays)],
    )
    return cuda_arrays, twin_arrays


def ptr(a):
    return int(a.ctypes.data)


def bf16_random(rng, shape, scale=1.0):
    return f32_to_bf16_bits((rng.standard_normal(shape) * scale).astype(np.float32))


def test_silu_mul_and_reduce(emulated):
    rng = np.random.default_rng(0)
    rows, ffn = 5, 24
    arrays = {"h13": bf16_random(rng, (rows, 2 * ffn), 6.0), "act": np.zeros((rows, ffn), np.uint16)}
    c, t = both(emulated, "ep_silu_mul", 2, 32, lambda a: [ptr(a["h13"]), ptr(a["act"]), rows, ffn], arrays)
    assert np.array_equal(c["act"], t["act"]) and c["act"].any()
    T, K, H = 3, 11, 16  # 11 > 8: the reduce loads its k rows in two passes
    arrays = {
        "comb": bf16_random(rng, (T, K, H)),
        "w": bf16_random(rng, (T, K)),
        "out": np.zeros((T, H), np.uint16),
    }
    c, t = both(
        emulated, "ep_reduce", 3, 8, lambda a: [ptr(a["comb"]), ptr(a["w"]), ptr(a["out"]), T, K, H], arrays
    )
    assert np.array_equal(c["out"], t["out"]) and c["out"].any()


def test_fill_and_zero(emulated):
    arrays = {"d": np.zeros((6, 10), np.uint16)}

    def args(a):
        return [ptr(a["d"]), 6, 10, 17, 5, 3, 1000, 7, 6.0 / 2**23]

    c, t = both(emulated, "ep_fill", 4, 16, args, arrays)
    assert np.array_equal(c["d"], t["d"]) and np.unique(c["d"]).size > 30
    arrays = {"d": np.ones(33, np.uint32)}
    c, t = both(emulated, "ep_zero32", 2, 8, lambda a: [ptr(a["d"]), 33, 0x7FC07FC0], arrays)
    assert np.array_equal(c["d"], t["d"]) and (c["d"] == 0x7FC07FC0).all()


@pytest.mark.parametrize("H", [16, 1040])  # 1040: rows of two 2 KiB chunks, the second partial
def test_dispatch_combine_copy_rows_peer_copy(emulated, H):
    rng = np.random.default_rng(1)
    G, T, K, E, cap = 2, 6, 2, 4, 8
    L = E // G
    ex = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    pos = np.zeros((T, K), np.int32)
    seen = np.zeros(E, np.int32)
    for t_, k_ in np.ndindex(T, K):  # rows in token order within each expert, like the plan
        pos[t_, k_] = seen[ex[t_, k_]]
        seen[ex[t_, k_]] += 1
    pos[2, 1] = cap  # one overflowing pair: flagged, not written
    x = bf16_random(rng, (T, H))
    slabs = [np.zeros((L * cap, H), np.uint16) for _ in range(G)]
    counts = [np.zeros((G, L), np.int32) for _ in range(G)]
    arrays = {
        "x": x,
        "ex": ex,
        "pos": pos,
        "sc": np.arange(E, dtype=np.int32),
        "err": np.zeros(4, np.uint32),
        **{f"s{g}": s for g, s in enumerate(slabs)},
        **{f"c{g}": c for g, c in enumerate(counts)},
    }

    def dispatch_args(a):
        a["sp"] = np.array([ptr(a[f"s{g}"]) for g in range(G)], np.uint64)
        a["cp"] = np.array([ptr(a[f"c{g}"]) for g in range(G)], np.uint64)
        return [
            ptr(a["x"]),
            ptr(a["ex"]),
            ptr(a["pos"]),
            ptr(a["sp"]),
            ptr(a["cp"]),
            ptr(a["sc"]),
            ptr(a["err"]),
            T,
            K,
            H,
            E,
            G,
            1,
            cap,
        ]

    c, t = both(emulated, "ep_dispatch", 3, 64, dispatch_args, arrays)
    for k in ("s0", "s1", "c0", "c1", "err"):
        assert np.array_equal(c[k], t[k]), k
    assert c["err"][0] == 1 and c["err"][1] == 1 and c["s0"].any() and c["s1"].any()

    src = np.full(L * cap, -1, np.int32)
    src[[0, 3, 9]] = [0, 13, 21]  # pair ids (s * T + t) * K + k, both origins
    arrays = {
        "y": bf16_random(rng, (L * cap, H)),
        "cs": src,
        "err": np.zeros(4, np.uint32),
        "m0": np.zeros((T * K, H), np.uint16),
        "m1": np.zeros((T * K, H), np.uint16),
    }

    def combine_args(a):
        a["cp"] = np.array([ptr(a["m0"]), ptr(a["m1"])], np.uint64)
        return [ptr(a["y"]), ptr(a["cs"]), ptr(a["cp"]), ptr(a["err"]), E, cap, T, K, H, G]

    c, t = both(emulated, "ep_combine", 2, 32, combine_args, arrays)
    assert np.array_equal(c["m0"], t["m0"]) and np.array_equal(c["m1"], t["m1"]) and c["m1"].any()

    arrays = {
        "dst": np.zeros((10, H), np.uint16),
        "src": bf16_random(rng, (7, H)),
        "di": np.array([9, -1, 0, 4, 2, 5], np.int32),
        "si": np.array([6, 0, 1, 2, -1, 3], np.int32),
    }
    for use_di, use_si in ((1, 0), (0, 1), (1, 1)):
        c, t = both(
            emulated,
            "ep_copy_rows",
            2,
            64,
            lambda a, u=use_di, v=use_si: [
                ptr(a["dst"]),
                ptr(a["src"]),
                ptr(a["di"]) if u else 0,
                ptr(a["si"]) if v else 0,
                2,
                3,
                1,
                H,
            ],
            arrays,
        )
        assert np.array_equal(c["dst"], t["dst"]) and c["dst"].any()

    arrays = {
        "src": bf16_random(rng, (T * K, H)),
        "d0": np.zeros((T * K, H), np.uint16),
        "d1": np.zeros((T * K, H), np.uint16),
    }

    def peer_copy_args(a):
        a["dp"] = np.array([ptr(a["d0"]), ptr(a["d1"])], np.uint64)
        return [ptr(a["src"]), ptr(a["dp"]), T, K, H, G, 1]

    c, t = both(emulated, "ep_peer_copy", 2, 64, peer_copy_args, arrays)
    assert np.array_equal(c["d0"], t["d0"]) and np.array_equal(c["d1"], t["d1"]) and c["d1"].any()


def test_tp_sum_peers(emulated):
    rng = np.random.default_rng(2)
    for G in (1, 3, 9):  # 9: more members than loads in flight per pass
        parts = {f"p{g}": bf16_random(rng, 40) for g in range(G)}
        arrays = {**parts, "out": np.zeros(40, np.uint16)}

        def args(a, G=G):
            a["tbl"] = np.array([ptr(a[f"p{g}"]) for g in range(G)], np.uint64)
            return [ptr(a["tbl"]), ptr(a["out"]), 40, G]

        c, t = both(emulated, "tp_sum_peers", 1, 4, args, arrays)
        assert np.array_equal(c["out"], t["out"]) and c["out"].any()


def test_ties_round_to_even(emulated):
    """1 + 2^-8 is halfway between two bf16 values: even mantissa wins (as __float2bfloat16_rn)."""
    one, odd, half_ulp = 0x3F80, 0x3F81, 0x3B80  # 1.0, 1.0078125, 2^-8
    arrays = {
        "p0": np.array([one, odd] * 4, np.uint16),
        "p1": np.array([half_ulp] * 8, np.uint16),
        "out": np.zeros(8, np.uint16),
    }

    def args(a):
        a["tbl"] = np.array([ptr(a["p0"]), ptr(a["p1"])], np.uint64)
        return [ptr(a["tbl"]), ptr(a["out"]), 8, 2]

    c, t = both(emulated, "tp_sum_peers", 1, 1, args, arrays)
    assert c["out"].tolist() == t["out"].tolist() == [one, 0x3F82] * 4
