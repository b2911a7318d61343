"""The CUDA C of the EP/TP/barrier-stress kernels, compiled for the CPU, against their numpy twins, bit for bit;
the peer barrier kernel's epoch, announcements, timeout record and broken path, against what its comments say.

No GPU needed: a shim header gives the CUDA names a host meaning (IEEE float ops with no contraction
for the __f*_rn intrinsics, a sequential loop over blocks and threads for a launch), so the kernels'
indexing, vector packing and bf16 bit recipes are checked here; only the intrinsics' own semantics
(documented IEEE round-to-nearest) are taken on trust. Skipped when no C++ compiler is installed.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from conftest import MANIFESTS

import tray.programs.ep_moe.twins as ep_twins
import tray.programs.tp_mlp.twins
import tray.twins
from tray.backend.host import HostBackend
from tray.dtypes import f32_to_bf16_bits
from tray.programs.ep_moe import ll_phases
from tray.programs.ep_moe.gemm_tile import NAMES, tile_of
from tray.programs.ep_moe.twins import route_rows
from tray.twins import lookup

NO_EXPERT_ID = 1 << 20  # an id out of range of any expert count here
TILE = tile_of((MANIFESTS / "kernels" / "ep_gemm.cu").read_text())  # the masked GEMM's default tile shape
CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the CUDA sources for the CPU")

SHIM = r"""
#include <cmath>
#include <cstring>
#include <cstddef>
struct uint4 { unsigned int x, y, z, w; } __attribute__((aligned(16)));
struct uint2 { unsigned int x, y; } __attribute__((aligned(8)));
struct dim3 { unsigned int x = 1, y = 1, z = 1; };
static dim3 blockIdx, threadIdx, gridDim, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }
struct float4 { float x, y, z, w; } __attribute__((aligned(16)));
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline int __float2int_rn(float x) { return std::isnan(x) ? 0 : (int)std::nearbyintf(x); }
static inline unsigned int atomicOr(unsigned int* p, unsigned int v) { unsigned o = *p; *p |= v; return o; }
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { unsigned o = *p; *p += v; return o; }
typedef unsigned long long u64_t;
static inline u64_t atomicAdd(u64_t* p, u64_t v) { u64_t o = *p; *p += v; return o; }
static inline u64_t atomicOr(u64_t* p, u64_t v) { u64_t o = *p; *p |= v; return o; }
static inline u64_t atomicMax(u64_t* p, u64_t v) { u64_t o = *p; if (v > o) *p = v; return o; }
static inline u64_t atomicCAS(u64_t* p, u64_t c, u64_t v) { u64_t o = *p; if (o == c) *p = v; return o; }
static u64_t emu_clock_ns = 0;  // %globaltimer: advances 1 us per read, so every spin ends
static long long emu_cycles = 0;  // clock64(): advances 3 cycles per read (an SM's counter: monotone)
static inline long long clock64() { return emu_cycles += 3; }
static inline void __threadfence_system() {}
static inline void __threadfence() {}
static inline void __syncwarp() {}
#define LAUNCH(call) for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x) \
    for (threadIdx.x = 0; threadIdx.x < blockDim.x; ++threadIdx.x) { call; }
// Kernels with block barriers and warp-wide tensor-core ops run their threads as cooperative contexts:
// each runs until it waits (__syncthreads, an mma), and a wait is released when every thread it names
// has arrived: the block for __syncthreads, the 32 lanes of the warp for an mma, which is then computed
// from the lanes' fragments as the PTX ISA lays them out (m16n8k16, .bf16, float32 accumulate).
#define TRAY_EMULATED 1
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)
#include <ucontext.h>
#include <cstdlib>
#include <functional>
#include <vector>
namespace coop {
enum { RUN, BLOCK_WAIT, WARP_WAIT, DONE };
struct Lane { unsigned int a[4], b[2]; float d[4]; unsigned int xv[2]; unsigned int seq; };
static std::vector<ucontext_t> ctx;
static std::vector<std::vector<char>> stacks;
static std::vector<int> state;
static std::vector<Lane> lanes;
// cp.async, deferred: a thread's copies land when it waits for their group (cp.async.wait_group), not when
// issued, so a kernel that reads a stage before waiting for it reads stale bytes here as on the GPU.
struct Copy { void* dst; const void* src; int n; };
static std::vector<std::vector<Copy>> cp_open;                 // [thread] issued, not yet committed
static std::vector<std::vector<std::vector<Copy>>> cp_groups;  // [thread] committed groups, oldest first
static ucontext_t sched;
static unsigned int cur;
static std::function<void()> body;
static void entry() { body(); state[cur] = DONE; }
static void wait(int why) { state[cur] = why; swapcontext(&ctx[cur], &sched); }
static float bf(unsigned int word, int half) {
    return __uint_as_float(((half ? word >> 16 : word) & 0xFFFFu) << 16);
}
static void warp_mma(unsigned int w) {
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        const Lane& x = lanes[w * 32 + l];
        const int g = l >> 2, t = l & 3;
        for (int j = 0; j < 2; ++j) {
            A[g][2 * t + j] = bf(x.a[0], j);
            A[g + 8][2 * t + j] = bf(x.a[1], j);
            A[g][2 * t + 8 + j] = bf(x.a[2], j);
            A[g + 8][2 * t + 8 + j] = bf(x.a[3], j);
            B[2 * t + j][g] = bf(x.b[0], j);
            B[2 * t + 8 + j][g] = bf(x.b[1], j);
            C[g][2 * t + j] = x.d[j];
            C[g + 8][2 * t + j] = x.d[2 + j];
        }
    }
    for (int l = 0; l < 32; ++l) {
        Lane& x = lanes[w * 32 + l];
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
            float acc = C[row][col];
            for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
            x.d[i] = acc;
        }
    }
}
static void run_block(unsigned int n, std::function<void()> fn) {
    body = fn;
    ctx.assign(n, ucontext_t());
    stacks.assign(n, std::vector<char>(1 << 16));
    state.assign(n, RUN);
    lanes.assign(n, Lane());
    cp_open.assign(n, {});
    cp_groups.assign(n, {});
    for (unsigned int i = 0; i < n; ++i) {
        getcontext(&ctx[i]);
        ctx[i].uc_stack.ss_sp = stacks[i].data();
        ctx[i].uc_stack.ss_size = stacks[i].size();
        ctx[i].uc_link = &sched;
        makecontext(&ctx[i], entry, 0);
    }
    for (;;) {
        bool ran = false, released = false;
        for (unsigned int i = 0; i < n; ++i) {
            if (state[i] == RUN) {
                cur = i;
                threadIdx.x = i;
                ran = true;
                swapcontext(&sched, &ctx[i]);
            }
        }
        unsigned int done = 0, block_wait = 0;
        for (unsigned int i = 0; i < n; ++i) {
            done += state[i] == DONE;
            block_wait += state[i] == BLOCK_WAIT;
        }
        if (done == n) return;
        for (unsigned int w = 0; w < n / 32; ++w) {
            bool all = true;
            for (unsigned int l = 0; l < 32; ++l) all = all && state[w * 32 + l] == WARP_WAIT;
            if (all) {
                warp_mma(w);
                for (unsigned int l = 0; l < 32; ++l) state[w * 32 + l] = RUN;
                released = true;
            }
        }
        if (!released && block_wait + done == n) {
            for (unsigned int i = 0; i < n; ++i) if (state[i] == BLOCK_WAIT) state[i] = RUN;
            released = true;
        }
        if (!ran && !released) std::abort();  // a barrier some thread never reaches
    }
}
}  // namespace coop
static inline void __syncthreads() { coop::wait(coop::BLOCK_WAIT); }
// Warp-wide exchanges: each lane deposits a value and waits for the warp; after the release every lane reads
// all 32. Two slots by exchange parity: a lane released first cannot overwrite a value others still read.
static inline void warp_values(unsigned int v, unsigned int* all) {
    const unsigned int s = coop::lanes[coop::cur].seq & 1u;
    coop::lanes[coop::cur].xv[s] = v;
    coop::wait(coop::WARP_WAIT);
    const unsigned int base = coop::cur & ~31u;
    for (int l = 0; l < 32; ++l) all[l] = coop::lanes[base + l].xv[s];
    coop::lanes[coop::cur].seq += 1u;
}
static inline unsigned int __match_any_sync(unsigned int mask, unsigned int v) {
    unsigned int all[32], peers = 0;
    warp_values(v, all);
    for (int l = 0; l < 32; ++l) peers |= (all[l] == v ? 1u : 0u) << l;
    return peers & mask;
}
static inline int __shfl_sync(unsigned int, int v, int src) {
    unsigned int all[32];
    warp_values((unsigned int)v, all);
    return (int)all[src & 31];
}
static inline int __shfl_up_sync(unsigned int, int v, unsigned int delta) {
    unsigned int all[32];
    warp_values((unsigned int)v, all);
    const unsigned int lane = coop::cur & 31u;
    return (int)all[lane >= delta ? lane - delta : lane];  // lanes below delta get their own value, as the GPU's
}
static inline unsigned int __ballot_sync(unsigned int mask, int p) {
    unsigned int all[32], bits = 0;
    warp_values(p ? 1u : 0u, all);
    for (int l = 0; l < 32; ++l) bits |= all[l] << l;
    return bits & mask;
}
// ldmatrix (m8n8, b16): lane l gives the address of row l % 8 of matrix l / 8 and receives the word (row l / 4,
// columns 2 (l % 4), 2 (l % 4) + 1) of each matrix
static inline void emu_ldmatrix(unsigned int* r, const unsigned short* p, int count) {
    unsigned int lo[32], hi[32];
    const unsigned long long a = (unsigned long long)p;
    warp_values((unsigned int)a, lo);
    warp_values((unsigned int)(a >> 32), hi);
    const unsigned int lane = coop::cur & 31u;
    for (int m = 0; m < count; ++m) {
        const unsigned int src = m * 8 + lane / 4;
        const unsigned short* row = (const unsigned short*)(((unsigned long long)hi[src] << 32) | lo[src]);
        r[m] = row[2 * (lane % 4)] | ((unsigned int)row[2 * (lane % 4) + 1] << 16);
    }
}
static inline int __popc(unsigned int v) { return __builtin_popcount(v); }
static inline int __ffs(int v) { return __builtin_ffs(v); }
static inline int atomicAdd(int* p, int v) { int o = *p; *p += v; return o; }
static inline void mma_bf16_m16n8k16(float* d, const unsigned int* a, const unsigned int* b) {
    coop::Lane& x = coop::lanes[coop::cur];
    for (int i = 0; i < 4; ++i) { x.a[i] = a[i]; x.d[i] = d[i]; }
    x.b[0] = b[0];
    x.b[1] = b[1];
    coop::wait(coop::WARP_WAIT);
    for (int i = 0; i < 4; ++i) d[i] = coop::lanes[coop::cur].d[i];
}
static inline void emu_cp_async(void* dst, const void* src, int n) {
    coop::cp_open[coop::cur].push_back({dst, src, n});
}
static inline void emu_cp_commit() {
    coop::cp_groups[coop::cur].push_back(coop::cp_open[coop::cur]);
    coop::cp_open[coop::cur].clear();
}
static inline void emu_cp_wait(int pending) {  // 16-byte copies; bytes past the source size are zeroed
    auto& groups = coop::cp_groups[coop::cur];
    while ((int)groups.size() > pending) {
        for (const coop::Copy& c : groups.front()) {
            std::memcpy(c.dst, c.src, c.n);
            std::memset((char*)c.dst + c.n, 0, 16 - c.n);
        }
        groups.erase(groups.begin());
    }
}
"""

# kernel name -> its parameter list as C (the launcher forwards them unchanged)
KERNELS = {
    "ep_moe.cu": {
        "ep_dispatch": "const uint4* x, const int* ti, const unsigned short* tw, unsigned char* const* rp, "
        "unsigned int* const* mp, unsigned char* send, unsigned int* sm, unsigned int* err, int tokens, "
        "int topk, int hidden, int experts, int G, int me",
        "ep_layout_count": "const unsigned int* meta, int* hist, int tokens, int topk, int experts, int G, int me",
        "ep_layout_place": "const unsigned int* meta, const int* hist, int* rr, int* ss, int* er, unsigned int* err, "
        "int tokens, int topk, int experts, int G, int me, int cap",
        "ep_fanout": "const uint4* recv, const int* rr, unsigned char* slab, int tokens, int topk, int hidden, int G",
        "ep_combine": "const uint4* y, const unsigned int* meta, const int* rr, unsigned char* const* cp, "
        "unsigned char* send, int tokens, int topk, int hidden, int experts, int G, int me, int groups",
        "ep_dispatch_ll": "const uint4* x, const int* ti, const unsigned short* tw, unsigned char* const* rp, "
        "unsigned int* const* mp, unsigned long long* const* fp, unsigned long long* flags, unsigned long long* state, "
        "unsigned int* gc, const unsigned int* meta, const uint4* recv, int* rr, int* ss, int* er, "
        "unsigned char* slab, unsigned int* err, int tokens, int topk, int hidden, int experts, int G, int me, int cap",
        "ep_combine_ll": "const uint4* y, const unsigned int* meta, const int* rr, unsigned char* const* cp, "
        "unsigned long long* const* fp, unsigned long long* flags, unsigned long long* state, unsigned int* gc, "
        "const uint4* comb, const int* ti, uint4* out, unsigned int* err, int tokens, int topk, int hidden, "
        "int experts, int G, int me, int groups",
        "ep_peer_copy": "const uint4* src, unsigned char* const* dp, int rows, int hidden, int G, int me",
        "ep_dispatch_fp8": "const unsigned short* x, const int* ti, const unsigned short* tw, "
        "unsigned char* const* qp, float* const* sp, unsigned int* const* mp, unsigned int* err, int tokens, "
        "int topk, int hidden, int experts, int G, int me",
        "ep_dequant_fp8": "const unsigned char* q, const float* s, const unsigned int* meta, unsigned short* recv, "
        "int tokens, int topk, int hidden, int experts, int G, int me",
    },
    "ep_math.cu": {
        "ep_silu_mul": "const uint4* h13, uint4* act, int rows, int ffn",
        "ep_reduce": "const uint4* comb, const int* ti, uint4* out, int tokens, int topk, int hidden, "
        "int experts, int groups",
        "ep_fill": "unsigned short* dst, long long rows, long long cols, long long rs, long long ib, "
        "int rank, long long rks, unsigned int seed, float scale",
        "ep_zero32": "unsigned int* dst, long long words, unsigned int value",
    },
    "tp_allreduce.cu": {
        "tp_sum_peers": "const uint4* const* peers, uint4* out, long long count, int G",
        "tp_rs_peers": "const uint4* const* peers, uint4* out, long long count, int G, int me",
        "tp_ag_peers": "uint4* const* outs, long long count, int G, int me",
        "tp_ll_allreduce": "const unsigned short* in, unsigned short* out, unsigned long long* const* recv_peers, "
        "unsigned long long* state, long long count, long long max_count, int G, int me, "
        "unsigned long long timeout_ns",
        "tp_ll3_allreduce": "const unsigned short* in, unsigned short* out, unsigned long long* const* recv_peers, "
        "unsigned long long* state, long long count, long long max_count, int G, int me, "
        "unsigned long long timeout_ns",
        "tp_ll_stress_step": "unsigned short* in, const unsigned short* out, unsigned long long* stress, "
        "long long count, int G, int me",
        "tp_ll_stress_next": "unsigned long long* stress, int G, int me, unsigned long long skew_ns",
    },
    "peer_stress.cu": {
        "stress_next": "unsigned long long* state",
        "stress_produce": "unsigned int* const* peers, const unsigned long long* state, int G, int me, "
        "unsigned long long words, unsigned long long skew_ns, unsigned long long corrupt_round",
        "stress_check": "const unsigned int* buf, unsigned long long* state, int G, int me, unsigned long long words",
    },
    "peer_barrier.cu": {
        "peer_barrier": "unsigned long long* own_flags, unsigned long long* const* peer_flags, "
        "unsigned long long* counter, unsigned long long* err, unsigned int* host_flag, int G, int me, "
        "unsigned long long timeout_ns",
    },
}
_SILU_ROWS = "const uint4* h13, uint4* act, const int* rows, int all_experts, int G, int cap, int ffn"
KERNELS["ep_math.cu"]["ep_silu_mul_rows"] = _SILU_ROWS
KERNELS["ep_gemm.cu"] = {
    "ep_masked_gemm": "const uint4* A, const uint4* B, unsigned int* C, const int* rows, int cap, int n, int n_factor, "
    "int K",
    "ep_masked_gemm_gather": "const uint4* A, const int* a_index, const uint4* B, unsigned int* C, const int* rows, "
    "int cap, int n, int n_factor, int K",
}
# kernels with block barriers or warp-wide ops: each block's threads run cooperatively (see SHIM); the
# masked GEMM also gets a 3-D launcher, run3_<name>(gx, gy, gz, block, ...)
COOP = {"ep_layout_count", "ep_layout_place", "ep_dispatch_ll", "ep_combine_ll", "ep_masked_gemm",
        "ep_masked_gemm_gather", "stress_produce", "peer_barrier", "tp_ll_allreduce", "tp_ll3_allreduce",
        "ep_dispatch_fp8", "ep_dequant_fp8"}
# inline PTX has no CPU meaning: the clock read becomes the shim's clock, the barrier's sys-scope loads and
# stores plain volatile ones (one thread runs at a time here: ordering is the GPU's to check, not this test's)
PTX_ON_CPU = {
    'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));': "now = (emu_clock_ns += 1000);",
    'asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");':
        "*(volatile unsigned long long*)addr = value;",
    'asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");':
        "value = *(const volatile unsigned long long*)addr;",
    'asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");':
        "value = *(const volatile unsigned long long*)addr;",
    'asm volatile("fence.acq_rel.sys;" ::: "memory");': "__threadfence_system();",
    'asm volatile("mov.u32 %0, %%smid;" : "=r"(id));': "id = blockIdx.x;",
    'asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(addr), "l"(w0), "l"(w1) : "memory");':
        "((volatile unsigned long long*)addr)[0] = w0; ((volatile unsigned long long*)addr)[1] = w1;",
    'asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(w0), "=l"(w1) : "l"(addr) : "memory");':
        "w0 = ((const volatile unsigned long long*)addr)[0]; w1 = ((const volatile unsigned long long*)addr)[1];",
}
ENTRY = {name: f"tray_{name}" for name in ("stress_next", "stress_produce", "stress_check", "peer_barrier")}


def _names(params: str) -> str:
    return ", ".join(p.strip().split()[-1].lstrip("*") for p in params.split(","))


def build(d, kernels_by_file, defines=(), ptx_on_cpu=None, prelude=""):
    """Compile the kernels of `kernels_by_file` ({file: {name: params}}) for the CPU into d/emu.so, with the
    preprocessor `defines` (NAME=VALUE) and `prelude` (C++) placed before the sources, the inline PTX replaced
    as `ptx_on_cpu` says (default PTX_ON_CPU); return the loaded library."""
    src = [SHIM, prelude, *(f"#define {name} {value}" for name, value in (x.split("=", 1) for x in defines))]
    for file, kernels in kernels_by_file.items():
        code = (MANIFESTS / "kernels" / file).read_text()
        for ptx, cpu in (PTX_ON_CPU if ptx_on_cpu is None else ptx_on_cpu).items():
            code = code.replace(ptx, cpu)
        src.append(f"namespace k_{file.split('.')[0]} {{\n{code}\n}}")
        for name, params in kernels.items():
            call = f"k_{file.split('.')[0]}::{ENTRY.get(name, name)}({_names(params)})"
            run = f"coop::run_block(block, [&] {{ {call}; }});" if name in COOP else f"LAUNCH({call})"
            if name in COOP:
                run = f"for (blockIdx.x = 0; blockIdx.x < grid; ++blockIdx.x) {run}"
            # a 1-D launch is grid x 1 x 1: a run3_ before it leaves gridDim.y/z and blockIdx.y/z behind
            src.append(
                f'extern "C" void run_{name}(unsigned int grid, unsigned int block, {params}) {{ '
                f"gridDim.x = grid; gridDim.y = gridDim.z = 1; blockIdx.y = blockIdx.z = 0; blockDim.x = block; "
                f"{run} }}"
            )
            body = f"coop::run_block(block, [&] {{ {call}; }});" if name in COOP else f"LAUNCH({call})"
            src.append(
                f'extern "C" void run3_{name}(unsigned int gx, unsigned int gy, unsigned int gz, '
                f"unsigned int block, {params}) {{ gridDim.x = gx; gridDim.y = gy; gridDim.z = gz; "
                "blockDim.x = block; for (blockIdx.z = 0; blockIdx.z < gz; ++blockIdx.z) "
                "for (blockIdx.y = 0; blockIdx.y < gy; ++blockIdx.y) "
                + (f"for (blockIdx.x = 0; blockIdx.x < gx; ++blockIdx.x) {body} }}" if name in COOP
                   else f"{{ {body} }} }}")
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
            # NOTE: a function's static locals (the kernels' __shared__ arrays) are otherwise one object per
            # process across every build loaded (STB_GNU_UNIQUE), sized by whichever build came first
            "-fno-gnu-unique",
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


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build(tmp_path_factory.mktemp("emu"), KERNELS)


def both(emulated, name, grid, block, make_args, arrays):
    """Run the emulated CUDA kernel and the twin on copies of `arrays`; return both results."""
    cuda_arrays = emulate(emulated, name, grid, block, make_args, arrays)
    twin_arrays = {k: v.copy() for k, v in arrays.items()}
    lookup(name)(
        HostBackend.open(0),
        (grid, 1, 1),
        (block, 1, 1),
        *[int(a.value) if isinstance(a, ctypes.c_void_p) else a for a in make_args(twin_arrays)],
    )
    return cuda_arrays, twin_arrays


def emulate(emulated, name, grid, block, make_args, arrays, sig=None):
    """Run the emulated CUDA kernel on a copy of `arrays`; return it. `sig`: its C parameters when not KERNELS'."""
    cuda_arrays = {k: v.copy() for k, v in arrays.items()}
    fn = getattr(emulated, f"run_{name}")
    sig = sig or KERNELS[next(f for f, ks in KERNELS.items() if name in ks)][name]
    types = []
    for p in sig.split(","):
        p = p.strip()
        types.append(
            ctypes.c_void_p
            if "*" in p
            else ctypes.c_ulonglong
            if p.startswith("unsigned long long")
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
    return cuda_arrays


def ptr(a):
    return int(a.ctypes.data)


def bf16_random(rng, shape, scale=1.0):
    return f32_to_bf16_bits((rng.standard_normal(shape) * scale).astype(np.float32))


def bf16_wide(rng, shape):
    """bf16 values of magnitudes 2^-24, 2^-9 and 1, either sign: float32 sums of a few of them cancel, so
    their result depends on the order of the terms."""
    mag = np.exp2(rng.choice([-24, -9, 0, 0], shape)) * (1 + rng.integers(0, 4, shape) / 128)
    return f32_to_bf16_bits((mag * rng.choice([-1, 1], shape)).astype(np.float32))


def test_silu_mul_and_reduce(emulated):
    rng = np.random.default_rng(0)
    rows, ffn = 5, 24
    arrays = {"h13": bf16_random(rng, (rows, 2 * ffn), 6.0), "act": np.zeros((rows, ffn), np.uint16)}
    c, t = both(emulated, "ep_silu_mul", 2, 32, lambda a: [ptr(a["h13"]), ptr(a["act"]), rows, ffn], arrays)
    assert np.array_equal(c["act"], t["act"]) and c["act"].any()
    T, K, H, E, R = 5, 3, 16, 12, 4
    idx = np.array([[0, 5, 11], [3, 4, 5], [-1, 2, 99], [6, 9, 7], [99, -1, 40]], np.int32)  # bad ids: no group
    arrays = {"comb": bf16_random(rng, (R, T, H)), "ti": idx, "out": np.zeros((T, H), np.uint16)}
    c, t = both(
        emulated,
        "ep_reduce",
        3,
        8,
        lambda a: [ptr(a["comb"]), ptr(a["ti"]), ptr(a["out"]), T, K, H, E, R],
        arrays,
    )
    assert np.array_equal(c["out"], t["out"]) and c["out"][:4].any() and not c["out"][4].any()


def test_fill_and_zero(emulated):
    arrays = {"d": np.zeros((6, 10), np.uint16)}

    def args(a):
        return [ptr(a["d"]), 6, 10, 17, 5, 3, 1000, 7, 6.0 / 2**23]

    c, t = both(emulated, "ep_fill", 4, 16, args, arrays)
    assert np.array_equal(c["d"], t["d"]) and np.unique(c["d"]).size > 30
    arrays = {"d": np.ones(33, np.uint32)}
    c, t = both(emulated, "ep_zero32", 2, 8, lambda a: [ptr(a["d"]), 33, 0x7FC07FC0], arrays)
    assert np.array_equal(c["d"], t["d"]) and (c["d"] == 0x7FC07FC0).all()


def skewed_routing(rng, tokens, experts, topk, hot=0):
    """Distinct experts per token, expert `hot` far more popular than the rest (it overflows a small cap)."""
    p = np.ones(experts)
    p[hot] = experts
    return np.stack([rng.choice(experts, topk, replace=False, p=p / p.sum()) for _ in range(tokens)]).astype(np.int32)


def tables(a, names):
    return np.array([ptr(a[n]) for n in names], np.uint64)


def layout_both(emulated, meta, T, K, E, G, me, cap, grid, block, arrays):
    """ep_layout_count then ep_layout_place, emulated and twin, each compared; returns the emulated arrays
    (rr, ss, er, err, hist). slot_src (ss) starts at -1: the slots of no pair kept must stay so."""
    L = E // G
    chunks = -(-G * T * K // ep_twins.LAYOUT_CHUNK)
    arrays = {**arrays, "hist": np.full((chunks, L), -5, np.int32), "ss": np.full(L * cap, -1, np.int32)}
    c, t = both(
        emulated, "ep_layout_count", grid, block,
        lambda a: [ptr(a["meta"]), ptr(a["hist"]), T, K, E, G, me], arrays,
    )
    assert np.array_equal(c["hist"], t["hist"])
    assert np.array_equal(c["hist"], ep_twins.layout_hist(meta, me * L, L))
    c, t = both(
        emulated, "ep_layout_place", grid, block,
        lambda a: [ptr(a["meta"]), ptr(a["hist"]), ptr(a["rr"]), ptr(a["ss"]), ptr(a["er"]), ptr(a["err"]), T, K, E, G,
                   me, cap],
        {**arrays, "hist": c["hist"]},
    )
    for k in ("rr", "ss", "er", "err"):
        assert np.array_equal(c[k], t[k]), k
    assert_slots_invert_rows(c["ss"], c["rr"], c["er"], K, cap)
    return c


def assert_slots_invert_rows(ss, rr, er, K, cap):
    """slot_src is route_row's inverse: slot el * cap + p (p < expert_rows[el]) holds the received row of the
    pair placed there, every other slot is untouched (-1)."""
    rows = rr.reshape(-1)
    want = np.full(ss.size, -1, np.int64)
    kept = np.flatnonzero(rows >= 0)
    want[rows[kept]] = kept // K
    assert np.array_equal(ss, want)
    filled = (np.arange(cap)[None, :] < er[:, None]).reshape(-1)
    assert (ss[filled] >= 0).all() and (ss[~filled] == -1).all()


# 2400 routing words: three chunks, the last partial; grids of one block (it walks every chunk) and of
# two; a hot expert overflows cap, an id out of range reaches no expert
@pytest.mark.parametrize("G, grid, block", [(2, 1, 64), (2, 2, 256), (1, 3, 96)])
def test_layout_over_chunks_numbers_pairs_in_global_order(emulated, G, grid, block):
    rng = np.random.default_rng(7)
    T, K, E = 1200 // G, 2, 16
    L, cap = E // G, 200
    idx = skewed_routing(rng, G * T, E, K, hot=3)
    idx[7, 1] = NO_EXPERT_ID
    meta = ep_twins.pack_routing(idx, np.zeros_like(idx, np.uint16), E)
    for me in range(G):
        arrays = {
            "meta": meta,
            "rr": np.full((G * T, K), 7, np.int32),
            "er": np.zeros(L, np.int32),
            "err": np.zeros(4, np.uint32),
        }
        c = layout_both(emulated, meta, T, K, E, G, me, cap, grid, block, arrays)
        want_rows, totals = route_rows(meta, me * L, L, cap)
        assert np.array_equal(c["rr"], want_rows) and c["er"].tolist() == np.minimum(totals, cap).tolist()
        dropped = int(np.maximum(totals - cap, 0).sum())
        assert c["err"][2] == dropped and (dropped > 0) == (me == 3 // L), (me, totals)


# H 1040: rows of two 2 KiB chunks, the second partial; the layout on 1 block of 64 threads (four rounds of
# its one chunk) and on 4 blocks of 32 (three idle: one chunk)
@pytest.fixture(scope="module")
def emulated_combine_batched(tmp_path_factory):
    """ep_moe.cu and ep_math.cu built with COMBINE_BATCH=2 (the default is 3): a combine item issues the loads of its
    next 2 matching expert rows at once, so with top-k 3 below an item may take two rounds."""
    return build(tmp_path_factory.mktemp("emu_cb"), {f: KERNELS[f] for f in ("ep_moe.cu", "ep_math.cu")},
                 ["COMBINE_BATCH=2"])


@pytest.mark.parametrize("H, grid, block, batched", [(16, 1, 64, False), (1040, 4, 32, False), (1040, 4, 32, True)])
def test_dispatch_layout_fanout_combine(request, H, grid, block, batched):
    """The whole data path of two ranks, kernel by kernel: emulated CUDA == twin at every step (the combine also
    with its batched loads: the same bytes)."""
    emulated = request.getfixturevalue("emulated_combine_batched" if batched else "emulated")
    rng = np.random.default_rng(1)
    G, T, K, E, R = 2, 40, 3, 8, 2
    L, cap = E // G, 26  # expert 0 is hot: it overflows cap 26
    idx = [skewed_routing(rng, T, E, K) for _ in range(G)]
    idx[1][5, 2] = E + 3  # an id out of range: flagged, reaches no expert
    xs = [bf16_random(rng, (T, H)) for _ in range(G)]
    ws = [bf16_random(rng, (T, K)) for _ in range(G)]
    recv = [np.zeros((G * T, H), np.uint16) for _ in range(G)]
    meta = [np.zeros((G * T, K), np.uint32) for _ in range(G)]
    for me in range(G):
        arrays = {
            "x": xs[me],
            "ti": idx[me],
            "tw": ws[me],
            "err": np.zeros(4, np.uint32),
            **{f"r{g}": recv[g] for g in range(G)},
            **{f"m{g}": meta[g] for g in range(G)},
        }

        def dispatch_args(a, me=me):
            a["rp"], a["mp"] = tables(a, ["r0", "r1"]), tables(a, ["m0", "m1"])
            return [
                ptr(a["x"]),
                ptr(a["ti"]),
                ptr(a["tw"]),
                ptr(a["rp"]),
                ptr(a["mp"]),
                0,
                0,
                ptr(a["err"]),
                T,
                K,
                H,
                E,
                G,
                me,
            ]

        c, t = both(emulated, "ep_dispatch", 3, 64, dispatch_args, arrays)
        for k in ("r0", "r1", "m0", "m1", "err"):
            assert np.array_equal(c[k], t[k]), k
        assert c["err"].tolist() == ([0, 0, 0, 0] if me == 0 else [1, 1, 0, 0])
        recv, meta = [c["r0"], c["r1"]], [c["m0"], c["m1"]]

        # the NCCL path's send buffers hold, block g, exactly what the peer path put in member g's block me
        arrays = {**arrays, "send": np.zeros((G * T, H), np.uint16), "sm": np.zeros((G * T, K), np.uint32)}
        c, t = both(
            emulated,
            "ep_dispatch",
            2,
            32,
            lambda a, me=me: [
                ptr(a["x"]),
                ptr(a["ti"]),
                ptr(a["tw"]),
                0,
                0,
                ptr(a["send"]),
                ptr(a["sm"]),
                ptr(a["err"]),
                T,
                K,
                H,
                E,
                G,
                me,
            ],
            arrays,
        )
        assert np.array_equal(c["send"], t["send"]) and np.array_equal(c["sm"], t["sm"])
        for g in range(G):
            assert np.array_equal(c["sm"][g * T : (g + 1) * T], meta[g][me * T : (me + 1) * T])
            assert np.array_equal(c["send"][g * T : (g + 1) * T], recv[g][me * T : (me + 1) * T])

    combs = [np.zeros((R * T, H), np.uint16) for _ in range(G)]
    for me in range(G):
        arrays = {
            "meta": meta[me],
            "rr": np.full((G * T, K), 7, np.int32),
            "er": np.zeros(L, np.int32),
            "err": np.zeros(4, np.uint32),
        }
        c = layout = layout_both(emulated, meta[me], T, K, E, G, me, cap, grid, block, arrays)
        want_rows, totals = route_rows(meta[me], me * L, L, cap)
        assert np.array_equal(c["rr"], want_rows) and c["er"].tolist() == np.minimum(totals, cap).tolist()
        assert c["err"][2] == np.maximum(totals - cap, 0).sum() and (c["err"][0] == 2) == (totals > cap).any()
        rows = c["rr"]
        arrays = {"recv": recv[me], "rr": rows, "slab": np.zeros((L * cap, H), np.uint16)}
        c, t = both(
            emulated, "ep_fanout", 2, 64, lambda a: [ptr(a["recv"]), ptr(a["rr"]), ptr(a["slab"]), T, K, H, G], arrays
        )
        assert np.array_equal(c["slab"], t["slab"]) and c["slab"].any()
        # what the fanout copies into slot s is received row slot_src[s]: the gather GEMM's rows
        ss = layout["ss"]
        assert np.array_equal(c["slab"][ss >= 0], recv[me][ss[ss >= 0]])

        y = bf16_wide(rng, (L * cap, H))
        arrays = {
            "y": y,
            "meta": meta[me],
            "rr": rows,
            **{f"c{g}": combs[g] for g in range(G)},
            "send": np.zeros((G * T, H), np.uint16),
        }

        def combine_args(a, me=me, nccl=False):
            a["cp"] = tables(a, ["c0", "c1"])
            return [
                ptr(a["y"]),
                ptr(a["meta"]),
                ptr(a["rr"]),
                0 if nccl else ptr(a["cp"]),
                ptr(a["send"]) if nccl else 0,
                T,
                K,
                H,
                E,
                G,
                me,
                R,
            ]

        c, t = both(emulated, "ep_combine", 3, 64, combine_args, arrays)
        assert np.array_equal(c["c0"], t["c0"]) and np.array_equal(c["c1"], t["c1"])
        combs = [c["c0"], c["c1"]]
        c, t = both(emulated, "ep_combine", 2, 32, lambda a, me=me: combine_args(a, me, nccl=True), arrays)
        assert np.array_equal(c["send"], t["send"])
        for s in range(G):  # block s of the NCCL send buffer is what member s's comb[me] got
            assert np.array_equal(c["send"][s * T : (s + 1) * T], combs[s][me * T : (me + 1) * T])
    for me in range(G):
        arrays = {"comb": combs[me], "ti": idx[me], "out": np.zeros((T, H), np.uint16)}
        c, t = both(
            emulated, "ep_reduce", 2, 64, lambda a: [ptr(a["comb"]), ptr(a["ti"]), ptr(a["out"]), T, K, H, E, R], arrays
        )
        assert np.array_equal(c["out"], t["out"]) and c["out"].any()

    arrays = {"src": bf16_random(rng, (2 * T, H)), **{f"d{g}": np.zeros((3 * T, H), np.uint16) for g in range(3)}}

    def peer_copy_args(a):
        a["dp"] = tables(a, ["d0", "d1", "d2"])
        return [ptr(a["src"]), ptr(a["dp"]), T, H, 3, 1]

    c, t = both(emulated, "ep_peer_copy", 2, 64, peer_copy_args, arrays)
    for g in range(3):
        assert np.array_equal(c[f"d{g}"], t[f"d{g}"])
    assert not c["d1"].any() and c["d0"][T : 2 * T].any() and c["d2"][T : 2 * T].any()


def ll_dispatch_args(me, G, T, K, H, E, cap, fanout=True):
    """ep_dispatch_ll's arguments; fanout False passes no slab (the masked GEMMs' dispatch)."""
    def args(a):
        a["rp"], a["mp"] = tables(a, [f"recv{g}" for g in range(G)]), tables(a, [f"meta{g}" for g in range(G)])
        a["fp"] = tables(a, [f"flags{g}" for g in range(G)])
        return [ptr(a["x"]), ptr(a["ti"]), ptr(a["tw"]), ptr(a["rp"]), ptr(a["mp"]), ptr(a["fp"]), ptr(a[f"flags{me}"]),
                ptr(a["state"]), ptr(a["gc"]), ptr(a[f"meta{me}"]), ptr(a[f"recv{me}"]), ptr(a["rr"]), ptr(a["ss"]),
                ptr(a["er"]), ptr(a["slab"]) if fanout else 0, ptr(a["err"]), T, K, H, E, G, me, cap]
    return args


def ll_combine_args(me, G, T, K, H, E, R):
    def args(a):
        a["cp"], a["fp"] = tables(a, [f"comb{g}" for g in range(G)]), tables(a, [f"flags{g}" for g in range(G)])
        return [ptr(a["y"]), ptr(a["meta"]), ptr(a["rr"]), ptr(a["cp"]), ptr(a["fp"]), ptr(a[f"flags{me}"]),
                ptr(a["state"]), ptr(a["gc"]), ptr(a[f"comb{me}"]), ptr(a["ti"]), ptr(a["out"]), ptr(a["err"]),
                T, K, H, E, G, me, R]
    return args


def assert_same(c, t, skip=("rp", "mp", "fp", "cp")):
    for k in c:
        if k not in skip:
            assert np.array_equal(c[k], t[k]), k


def one_rank_ll_arrays(rng, idx, T, K, H, L, cap):
    """dispatch_ll's arrays for one rank alone (G 1): its tokens and routing (idx), empty receive and layout
    buffers (route_row 7 and slot_src -1: unwritten entries show), fresh flags, epochs and grid counter."""
    G = 1
    return {
        "x": bf16_random(rng, (T, H)), "ti": idx, "tw": bf16_random(rng, (T, K)),
        "recv0": np.zeros((T, H), np.uint16), "meta0": np.zeros((T, K), np.uint32),
        "flags0": np.zeros(2 * G, np.uint64), "state": np.zeros(2, np.uint64), "gc": np.zeros(1, np.uint32),
        "rr": np.full((T, K), 7, np.int32), "ss": np.full(L * cap, -1, np.int32), "er": np.zeros(L, np.int32),
        "slab": np.zeros((L * cap, H), np.uint16), "err": np.zeros(4, np.uint32),
    }


@pytest.mark.parametrize("fanout, T, block, R, K, E", [(True, 40, 64, 2, 3, 8), (False, 40, 64, 2, 3, 8),
                                                       (False, 96, 32, 8, 10, 16)])
def test_low_latency_kernels_on_one_rank_equal_their_twins_launch_after_launch(emulated, fanout, T, block, R, K, E):
    """EP1 shape (G 1: the rank sends to itself, announces to itself), one block (the grid barrier's
    single arrival flips it): dispatch_ll and combine_ll write what the standard kernels' twins write,
    epochs advance by one per launch, the grid counter flips once per grid barrier (two with the fanout,
    one without: then the slab is never written). 96 tokens of top-3 over 32 threads: the layout takes two
    rounds of LL_LAYOUT_WORDS words a thread, its count carried from one to the next; its 8 reduction groups
    take the reduce past the LL_REDUCE_GROUPS it loads at once; top-10 of 16 experts."""
    rng = np.random.default_rng(3)
    G, H = 1, 1040
    L, cap = E // G, 26  # expert 0 is hot: it overflows cap 26
    idx = skewed_routing(rng, T, E, K)
    idx[5, 2] = E + 3
    arrays = one_rank_ll_arrays(rng, idx, T, K, H, L, cap)
    for launch in (1, 2):
        arrays["err"][:] = 0
        c, t = both(emulated, "ep_dispatch_ll", 1, block, ll_dispatch_args(0, G, T, K, H, E, cap, fanout), arrays)
        assert_same(c, t)
        want_rows, totals = route_rows(c["meta0"], 0, L, cap)
        assert np.array_equal(c["rr"], want_rows) and c["er"].tolist() == np.minimum(totals, cap).tolist()
        assert_slots_invert_rows(c["ss"], c["rr"], c["er"], K, cap)
        assert c["err"].tolist() == [3, 1, int(np.maximum(totals - cap, 0).sum()), 0]
        assert c["state"].tolist() == [launch, 0] and c["flags0"].tolist() == [launch, 0]
        assert c["gc"][0] == (0 if fanout or launch == 2 else 0x80000000)
        filled = c["ss"] >= 0
        assert c["slab"].any() == fanout and c["slab"][~filled].sum() == 0
        if fanout:
            assert np.array_equal(c["slab"][filled], c["recv0"][c["ss"][filled]])
        arrays = {k: v for k, v in c.items() if k not in ("rp", "mp", "fp")}
    comb = {
        "y": bf16_wide(rng, (L * cap, H)), "meta": c["meta0"], "rr": c["rr"], "comb0": np.zeros((R * T, H), np.uint16),
        "flags0": c["flags0"], "state": c["state"], "gc": np.zeros(1, np.uint32), "ti": idx,
        "out": np.zeros((T, H), np.uint16), "err": np.zeros(4, np.uint32),
    }
    for launch in (1, 2):
        c, t = both(emulated, "ep_combine_ll", 1, block, ll_combine_args(0, G, T, K, H, E, R), comb)
        assert_same(c, t)
        assert c["state"].tolist() == [2, launch] and c["flags0"].tolist() == [2, launch]
        assert c["gc"][0] == (0x80000000 if launch == 1 else 0) and c["err"].tolist() == [0, 0, 0, 0]
        used = ep_twins.groups_used(idx, E, R)
        want = ep_twins.reduce_groups_bits(c["comb0"].reshape(R, T, H), used)
        assert np.array_equal(c["out"], want) and c["out"].any()
        comb = {k: v for k, v in c.items() if k not in ("cp", "fp")}


def test_low_latency_kernels_of_one_of_two_ranks_wait_for_the_peer_then_equal_their_twins(emulated):
    """G 2, rank 0's kernels, its peer's part played first by the standard twins (rows, routing and its
    announcement already in rank 0's buffers): rank 0 announces to the peer, passes its wait, lays out and
    fans out both sources' pairs, and its combine reduces its own and the peer's rows."""
    rng = np.random.default_rng(5)
    G, T, K, E, R, H = 2, 24, 3, 8, 2, 16
    L, cap = E // G, 30
    idx = [skewed_routing(rng, T, E, K) for _ in range(G)]
    idx[0][3], idx[1][2] = [4, 5, 6], [5, 6, 7]  # tokens with no expert of group 0 (the hot expert's)
    xs = [bf16_random(rng, (T, H)) for _ in range(G)]
    ws = [bf16_random(rng, (T, K)) for _ in range(G)]
    recv = [np.zeros((G * T, H), np.uint16) for _ in range(G)]
    meta = [np.zeros((G * T, K), np.uint32) for _ in range(G)]
    host = HostBackend.open(0)
    rp, mp = np.array([ptr(r) for r in recv], np.uint64), np.array([ptr(m) for m in meta], np.uint64)
    peer_err = np.zeros(4, np.uint32)
    lookup("ep_dispatch")(host, (1, 1, 1), (32, 1, 1), ptr(xs[1]), ptr(idx[1]), ptr(ws[1]), ptr(rp), ptr(mp), 0, 0,
                          ptr(peer_err), T, K, H, E, G, 1)
    flags = [np.zeros(2 * G, np.uint64) for _ in range(G)]
    flags[0][1] = 1  # the peer's dispatch announcement
    arrays = {
        "x": xs[0], "ti": idx[0], "tw": ws[0], "recv0": recv[0], "recv1": recv[1], "meta0": meta[0], "meta1": meta[1],
        "flags0": flags[0], "flags1": flags[1], "state": np.zeros(2, np.uint64), "gc": np.zeros(1, np.uint32),
        "rr": np.full((G * T, K), 7, np.int32), "ss": np.full(L * cap, -1, np.int32), "er": np.zeros(L, np.int32),
        "slab": np.zeros((L * cap, H), np.uint16), "err": np.zeros(4, np.uint32),
    }
    c, t = both(emulated, "ep_dispatch_ll", 1, 64, ll_dispatch_args(0, G, T, K, H, E, cap), arrays)
    assert_same(c, t)
    want_rows, totals = route_rows(c["meta0"], 0, L, cap)
    dropped = int(np.maximum(totals - cap, 0).sum())  # the hot expert 0 is rank 0's
    assert c["err"].tolist() == [2, 0, dropped, 0] and dropped > 0 and c["flags1"].tolist() == [1, 0, 0, 0]
    assert c["meta0"][T:].any() and np.array_equal(c["meta0"][T:], meta[0][T:])  # the peer's block, untouched
    assert np.array_equal(c["rr"], want_rows) and (want_rows[T:] >= 0).any()
    y = bf16_wide(rng, (L * cap, H))
    combs = [np.zeros((R * T, H), np.uint16) for _ in range(G)]
    combs[0][T:] = bf16_random(rng, (T, H))  # group 1's rows of rank 0's tokens, from the peer: +0 for the tokens
    used = [ep_twins.groups_used(i, E, R) for i in idx]  # that use none of its experts, as combine_ll writes them
    combs[0][T:][~used[0][:, 1]] = 0
    assert (~used[0][:, 1]).any() and (~used[0][:, 0]).any() and (~used[1][:, 0]).any()  # misses to write
    combs[1][:T] = 0x4321  # rank 0's rows of group 0 for the peer's tokens land here: misses must become +0
    c["flags0"][G + 1] = 1  # the peer's combine announcement
    comb = {
        "y": y, "meta": c["meta0"], "rr": c["rr"], "comb0": combs[0], "comb1": combs[1], "flags0": c["flags0"],
        "flags1": c["flags1"], "state": c["state"], "gc": np.zeros(1, np.uint32), "ti": idx[0],
        "out": np.zeros((T, H), np.uint16), "err": np.zeros(4, np.uint32),
    }
    c, t = both(emulated, "ep_combine_ll", 1, 64, ll_combine_args(0, G, T, K, H, E, R), comb)
    assert_same(c, t)
    assert c["err"].tolist() == [0, 0, 0, 0] and c["flags1"].tolist() == [1, 0, 1, 0]
    assert c["comb1"][:T].any() and c["comb0"][:T].any()  # group 0's rows to the peer and to itself
    # the (token, group 0) pairs with no expert of group 0 got +0 rows, on both sides; the others their sums
    assert (c["comb0"][:T][~used[0][:, 0]] == 0).all() and (c["comb1"][:T][~used[1][:, 0]] == 0).all()
    assert (c["comb1"][:T][used[1][:, 0]] != 0x4321).any()
    want = ep_twins.reduce_groups_bits(c["comb0"].reshape(R, T, H), used[0])
    assert np.array_equal(c["out"], want) and c["out"].any()


def test_low_latency_kernels_name_a_silent_peer_and_end(emulated):
    """A peer that never announces: past the timeout (the emulated clock runs 1 us a read) the kernels
    record the missing member (err[0] bit 4, err[3] bit 1) and return instead of hanging."""
    G, T, K, E, R, H = 2, 4, 2, 4, 2, 16
    L, cap = E // G, 8
    arrays = {
        "x": np.ones((T, H), np.uint16), "ti": np.tile(np.array([0, 3], np.int32), (T, 1)),
        "tw": np.zeros((T, K), np.uint16), "recv0": np.zeros((G * T, H), np.uint16),
        "recv1": np.zeros((G * T, H), np.uint16), "meta0": np.zeros((G * T, K), np.uint32),
        "meta1": np.zeros((G * T, K), np.uint32), "flags0": np.zeros(2 * G, np.uint64),
        "flags1": np.zeros(2 * G, np.uint64), "state": np.zeros(2, np.uint64), "gc": np.zeros(1, np.uint32),
        "rr": np.zeros((G * T, K), np.int32), "ss": np.zeros(L * cap, np.int32), "er": np.zeros(L, np.int32),
        "slab": np.zeros((L * cap, H), np.uint16), "err": np.zeros(4, np.uint32),
    }
    c = emulate(emulated, "ep_dispatch_ll", 1, 32, ll_dispatch_args(0, G, T, K, H, E, cap), arrays)
    # (the layout then counts the peer's never-written block too: whatever it reports besides is moot)
    assert c["err"][0] & 4 and c["err"][3] == 2 and c["flags1"].tolist() == [1, 0, 0, 0]
    comb = {
        "y": np.zeros((L * cap, H), np.uint16), "meta": c["meta0"], "rr": c["rr"],
        "comb0": np.zeros((R * T, H), np.uint16), "comb1": np.zeros((R * T, H), np.uint16), "flags0": c["flags0"],
        "flags1": c["flags1"], "state": c["state"], "gc": np.zeros(1, np.uint32), "ti": arrays["ti"],
        "out": np.zeros((T, H), np.uint16), "err": np.zeros(4, np.uint32),
    }
    c = emulate(emulated, "ep_combine_ll", 1, 32, ll_combine_args(0, G, T, K, H, E, R), comb)
    assert c["err"].tolist() == [4, 0, 0, 2] and c["flags1"].tolist() == [1, 0, 1, 0]


# the diagnosis build's parameters (ep_moe.cu, LL_PHASES 1): the production kernels' own, then the record buffer
LL_PHASE_PARAMS = ", unsigned long long* ph, int pb, int pl"
LL_PHASE_KERNELS = {
    "ep_dispatch_ll": KERNELS["ep_moe.cu"]["ep_dispatch_ll"] + LL_PHASE_PARAMS,
    "ep_combine_ll": KERNELS["ep_moe.cu"]["ep_combine_ll"] + LL_PHASE_PARAMS,
    "ep_ll_clock": "unsigned long long* out, unsigned long long spin_ns",
}


@pytest.fixture(scope="module")
def emulated_phases(tmp_path_factory):
    return build(tmp_path_factory.mktemp("emu_phases"), {"ep_moe.cu": LL_PHASE_KERNELS}, defines=("LL_PHASES=1",))


def with_phases(make_args, slots, blocks):
    def args(a):
        return [*make_args(a), ptr(a["ph"]), blocks, slots]
    return args


def assert_record(rec, epoch, used):
    """One block's record: `used` boundaries stamped in both clocks, strictly later each (the emulated clocks
    advance on every read), the rest 0; the SM id (block 0 here) and the launch's epoch."""
    ns, cycles = rec[: ll_phases.STAMPS].astype(np.int64), rec[ll_phases.STAMPS : 2 * ll_phases.STAMPS].astype(np.int64)
    assert (ns[:used] > 0).all() and (np.diff(ns[:used]) > 0).all() and not ns[used:].any(), ns
    assert (cycles[:used] > 0).all() and (np.diff(cycles[:used]) > 0).all() and not cycles[used:].any(), cycles
    assert rec[ll_phases.SMID_WORD] == 0 and rec[ll_phases.EPOCH_WORD] == epoch


@pytest.mark.parametrize("fanout", [False, True])
def test_low_latency_phase_build_writes_the_same_bytes_and_stamps_every_boundary(emulated, emulated_phases, fanout):
    """The diagnosis build (LL_PHASES 1) of dispatch_ll and combine_ll writes what the production build writes, byte
    for byte, launch after launch (epochs, flags and grid counter included), and records each launch in its epoch's
    slot: every boundary stamped in order in both clocks (the fanout's too when there is one), nothing in the block
    slots beyond the grid; kernel_records finds the launches whole, summarize reads them, and ep_ll_clock's spin
    gives the emulated clocks' ratio."""
    rng = np.random.default_rng(11)
    G, T, K, E, R, H = 1, 24, 3, 8, 2, 272
    L, cap = E // G, 20
    slots, blocks = 3, 2  # one block runs: the second block slot stays 0
    idx = skewed_routing(rng, T, E, K)
    arrays = one_rank_ll_arrays(rng, idx, T, K, H, L, cap)
    ph = np.zeros((slots, 2, blocks, ll_phases.WORDS), np.uint64)
    sig = LL_PHASE_KERNELS["ep_dispatch_ll"]
    for launch in (1, 2):
        make = ll_dispatch_args(0, G, T, K, H, E, cap, fanout)
        prod = emulate(emulated, "ep_dispatch_ll", 1, 64, make, arrays)
        diag = emulate(emulated_phases, "ep_dispatch_ll", 1, 64, with_phases(make, slots, blocks), {**arrays, "ph": ph},
                       sig=sig)
        assert_same(prod, diag)
        assert prod["state"][0] == launch and prod["er"].any()
        ph = diag["ph"]
        assert_record(ph[launch % slots, 0, 0], launch, 7 if fanout else 6)
        arrays = {k: v for k, v in prod.items() if k not in ("rp", "mp", "fp")}
    comb = {
        "y": bf16_wide(rng, (L * cap, H)), "meta": arrays["meta0"], "rr": arrays["rr"],
        "comb0": np.zeros((R * T, H), np.uint16), "flags0": arrays["flags0"], "state": arrays["state"],
        "gc": np.zeros(1, np.uint32), "ti": idx, "out": np.zeros((T, H), np.uint16), "err": np.zeros(4, np.uint32),
    }
    for launch in (1, 2):
        make = ll_combine_args(0, G, T, K, H, E, R)
        prod = emulate(emulated, "ep_combine_ll", 1, 64, make, comb)
        diag = emulate(emulated_phases, "ep_combine_ll", 1, 64, with_phases(make, slots, blocks), {**comb, "ph": ph},
                       sig=LL_PHASE_KERNELS["ep_combine_ll"])
        assert_same(prod, diag)
        assert prod["out"].any() and prod["state"][1] == launch
        ph = diag["ph"]
        assert_record(ph[launch % slots, 1, 0], launch, 6)
        comb = {k: v for k, v in prod.items() if k not in ("cp", "fp")}
    assert not ph[:, :, 1].any() and not ph[0].any()  # beyond the grid; the slot of epoch 3, never launched
    clock = emulate(emulated_phases, "ep_ll_clock", 1, 32, lambda a: [ptr(a["out"]), 50_000],
                    {"out": np.zeros(4, np.uint64)}, sig=LL_PHASE_KERNELS["ep_ll_clock"])["out"]
    assert clock[2] - clock[0] >= 50_000
    ghz = ll_phases.sm_clock_ghz(clock)
    assert ghz == pytest.approx(3 / 1000)  # the shim's clocks: 3 cycles and 1000 ns a read
    for kernel in ll_phases.KERNELS:
        found = ll_phases.kernel_records(ph, kernel, 1, 2)
        assert found.problems == [] and found.records.shape == (2, 1, ll_phases.WORDS)
        s = ll_phases.summarize(kernel, found.records, ghz)
        since = [s["since_entry_us"][b] for b in ll_phases.BOUNDARIES[kernel][1:]]
        assert s["launches"] == 2 and all(b > a > 0 for a, b in zip(since, since[1:], strict=False)), s
        assert all(p["median"] > 0 for p in s["phase_us"].values()), s


def test_a_wrong_twin_is_caught(emulated, monkeypatch):
    """The comparison can fail: a twin that sums the reduction groups in descending order differs."""

    def descending(comb_bits, used):
        return f32_to_bf16_bits(
            sum(
                (
                    np.where(used[:, q, None], ep_twins.bf16_bits_to_f32(comb_bits[q]), np.float32(0))
                    for q in reversed(range(comb_bits.shape[0]))
                ),
                np.zeros(comb_bits.shape[1:], np.float32),
            )
        )

    monkeypatch.setattr(ep_twins, "reduce_groups_bits", descending)
    rng = np.random.default_rng(3)
    T, K, H, E, R = 64, 4, 16, 16, 4
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    arrays = {"comb": bf16_wide(rng, (R, T, H)), "ti": idx, "out": np.zeros((T, H), np.uint16)}
    c, t = both(
        emulated, "ep_reduce", 2, 64, lambda a: [ptr(a["comb"]), ptr(a["ti"]), ptr(a["out"]), T, K, H, E, R], arrays
    )
    assert not np.array_equal(c["out"], t["out"])


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


@pytest.mark.parametrize("count", [4, 40, 131])  # 4 and 131: a tail of count % 8 elements; 131 < G * chunk
def test_tp_one_shot_and_two_shot_give_the_same_bytes(emulated, count):
    rng = np.random.default_rng(3)
    for G in (1, 2, 3):
        parts = [bf16_random(rng, count) for _ in range(G)]
        outs = {"one": [], "two": []}
        for kind in ("emu", "twin"):
            one = np.full(count, 0xFFFF, np.uint16)
            tbl = np.array([ptr(p) for p in parts], np.uint64)
            two = [np.full(count, 0xFFFF, np.uint16) for _ in range(G)]
            otbl = np.array([ptr(o) for o in two], np.uint64)
            if kind == "emu":
                _tp(emulated, "tp_sum_peers", 2, 4, ptr(tbl), ptr(one), count, G)
                for me in range(G):
                    _tp(emulated, "tp_rs_peers", 2, 4, ptr(tbl), ptr(two[me]), count, G, me)
                for me in range(G):
                    _tp(emulated, "tp_ag_peers", 3, 2, ptr(otbl), count, G, me)
            else:
                host = HostBackend.open(0)
                lookup("tp_sum_peers")(host, (2, 1, 1), (4, 1, 1), ptr(tbl), ptr(one), count, G)
                for me in range(G):
                    lookup("tp_rs_peers")(host, (2, 1, 1), (4, 1, 1), ptr(tbl), ptr(two[me]), count, G, me)
                for me in range(G):
                    lookup("tp_ag_peers")(host, (3, 1, 1), (2, 1, 1), ptr(otbl), count, G, me)
            outs["one"].append(one)
            outs["two"].append(two)
        emu_one, twin_one = outs["one"]
        assert np.array_equal(emu_one, twin_one) and (emu_one != 0xFFFF).all()
        for member in range(G):  # every member's two-shot output is the one-shot output, bit for bit
            assert np.array_equal(outs["two"][0][member], emu_one), (G, member)
            assert np.array_equal(outs["two"][1][member], emu_one), (G, member)


def _tp(emulated, name, grid, block, *args):
    fn = getattr(emulated, f"run_{name}")
    kinds = [ctypes.c_void_p if "*" in p else ctypes.c_longlong if "long long" in p else ctypes.c_int
             for p in KERNELS["tp_allreduce.cu"][name].split(",")]
    fn.argtypes = [ctypes.c_uint, ctypes.c_uint, *kinds]
    fn(grid, block, *args)


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


def test_a_wrong_position_is_caught(emulated, monkeypatch):
    """The comparison can fail: a layout twin that swaps the first two pairs of an expert differs."""
    original = lookup("ep_layout_place")

    def swapped(backend, grid, block, meta, hist, route_row, slot_src, expert_rows, err, tokens, topk, experts, G, me,
                cap):
        original(backend, grid, block, meta, hist, route_row, slot_src, expert_rows, err, tokens, topk, experts, G, me,
                 cap)
        rows = np.ctypeslib.as_array((ctypes.c_int32 * (G * tokens * topk)).from_address(route_row))
        first = np.flatnonzero((rows >= 0) & (rows < cap))[:2]  # expert 0's first two pairs
        rows[first] = rows[first[::-1]]

    monkeypatch.setitem(tray.twins._TWINS, "ep_layout_place", swapped)
    rng = np.random.default_rng(4)
    G, T, K, E, cap = 1, 16, 2, 4, 16
    meta = skewed_routing(rng, T, E, K).astype(np.uint32)
    arrays = {
        "meta": meta,
        "rr": np.zeros((T, K), np.int32),
        "ss": np.zeros(E * cap, np.int32),
        "er": np.zeros(E, np.int32),
        "err": np.zeros(4, np.uint32),
        "hist": ep_twins.layout_hist(meta, 0, E),
    }
    c, t = both(
        emulated,
        "ep_layout_place",
        2,
        32,
        lambda a: [ptr(a["meta"]), ptr(a["hist"]), ptr(a["rr"]), ptr(a["ss"]), ptr(a["er"]), ptr(a["err"]), T, K, E, G,
                   0, cap],
        arrays,
    )
    assert not np.array_equal(c["rr"], t["rr"])


def test_masked_gemm_and_silu_rows_touch_only_the_rows_present(emulated):
    """Tensor-core tiles (emulated lane by lane) against float64 and the twin; tiles at or beyond an
    expert's row count write nothing. cap 70 and N 136: partial tiles in both; K: five K steps, so the
    ring of cp.async stages wraps (a stage refilled too early or read before it landed shows here)."""
    rng = np.random.default_rng(5)
    L, cap, n, n_factor, K = 5, 70, 68, 2, 5 * TILE.bk
    N = n * n_factor
    rows = np.array([70, 5, 0, 27, 38], np.int32)  # 1..16, 17..32, 33..64, more rows: every warp shape
    a = bf16_random(rng, (L * cap, K))
    b = bf16_random(rng, (L * N, K))
    for e in (1, 3, 4):  # expert 0's first rows with its weights, in the other shapes
        a[e * cap : e * cap + rows[e]] = a[: rows[e]]
        b[e * N : (e + 1) * N] = b[:N]
    poison = np.full((L * cap, N), 0x7FC0, np.uint16)
    c_cuda, c_twin = poison.copy(), poison.copy()
    fn = emulated.run3_ep_masked_gemm
    fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    fn(-(-N // TILE.bn), -(-cap // TILE.bm), L, 128, ptr(a), ptr(b), ptr(c_cuda), ptr(rows), cap, n, n_factor, K)
    lookup("ep_masked_gemm")(
        None, (-(-N // TILE.bn), -(-cap // TILE.bm), L), (128, 1, 1), ptr(a), ptr(b), ptr(c_twin), ptr(rows), cap, n,
        n_factor, K,
    )
    f64 = ep_twins.bf16_bits_to_f32
    for e in range(L):
        r = slice(e * cap, e * cap + rows[e])
        want = f64(a[r]).astype(np.float64) @ f64(b[e * N : (e + 1) * N]).astype(np.float64).T
        for got in (c_cuda[r], c_twin[r]):
            assert np.allclose(f64(got), want, rtol=1e-2, atol=1e-2 * np.abs(want).max(initial=1.0))
        rest = slice(e * cap + rows[e], (e + 1) * cap)
        assert (c_cuda[rest] == 0x7FC0).all() and (c_twin[rest] == 0x7FC0).all()
        # the two differ at most by the order of float32 sums: a bf16 ulp here and there
        x, y = f64(c_cuda[r]).astype(np.float64), f64(c_twin[r]).astype(np.float64)
        assert (np.abs(x - y) <= 2**-7 * np.abs(y) + 1e-6).all()
    for e in (1, 3, 4):  # a row's bytes do not depend on how many rows its tile holds
        assert np.array_equal(c_cuda[e * cap : e * cap + rows[e]], c_cuda[: rows[e]])

    F = 24
    arrays = {"h": bf16_random(rng, (L * cap, 2 * F), 4.0), "act": np.zeros((L * cap, F), np.uint16), "rows": rows}
    c, t = both(
        emulated,
        "ep_silu_mul_rows",
        2,
        64,
        lambda x: [ptr(x["h"]), ptr(x["act"]), ptr(x["rows"]), 2 * L, 2, cap, F],
        arrays,
    )
    assert np.array_equal(c["act"], t["act"])
    filled = np.zeros(L * cap, bool)
    for e in range(L):
        filled[e * cap : e * cap + rows[e]] = True
    assert c["act"][filled].any() and not c["act"][~filled].any()
    # the manifest's 2-D grid: blocks y stride over the experts (2 rows of blocks for 2 L experts), x over the rows
    for gy in (2, 2 * L):
        act2 = np.zeros((L * cap, F), np.uint16)
        fn = emulated.run3_ep_silu_mul_rows
        fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
        fn(3, gy, 1, 32, ptr(arrays["h"]), ptr(act2), ptr(rows), 2 * L, 2, cap, F)
        assert np.array_equal(act2, t["act"]), gy


def run_masked_gemm(emulated, a, b, c, rows, cap, n, n_factor, K, a_index=None, bm=TILE.bm, bn=TILE.bn):
    """The emulated ep_masked_gemm (a_index None) or ep_masked_gemm_gather over experts = rows.size, built
    with tiles of bm x bn."""
    name = "ep_masked_gemm" if a_index is None else "ep_masked_gemm_gather"
    fn = getattr(emulated, f"run3_{name}")
    pointers = [a, b, c, rows] if a_index is None else [a, a_index, b, c, rows]
    fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_void_p] * len(pointers) + [ctypes.c_int] * 4
    fn(-(-n * n_factor // bn), -(-cap // bm), rows.size, 128, *[ptr(x) for x in pointers], cap, n, n_factor, K)


# (GEMM_BM, GEMM_BN, GEMM_BK, GEMM_STAGES, GEMM_PREFETCH, GEMM_LDMATRIX, GEMM_PIPE): the default, then shapes
# that change every loop bound of the tile loads and warp tiles (vectors per row, rows per thread, mma tiles
# per warp, ring depth), fragments by ldmatrix (x4 pairs and the x2 of an odd count), 128-row tiles (the
# 64 x 64 warp shape), fragments loaded a step ahead (GEMM_PIPE)
GEMM_SHAPES = [TILE.values(), (64, 128, 32, 3, 0, 0, 0), (32, 64, 64, 4, 256, 0, 1), (64, 32, 128, 2, 128, 0, 0),
               (64, 64, 64, 3, 0, 0, 0), (64, 128, 64, 3, 256, 1, 1), (32, 32, 64, 3, 0, 1, 1),
               (128, 64, 64, 2, 0, 0, 1), (128, 128, 64, 3, 256, 1, 1)]


@pytest.fixture(scope="module")
def gemm_shapes(tmp_path_factory):
    """One CPU build of ep_gemm.cu per GEMM_SHAPES entry, compiled side by side (one compiler per core)."""
    dirs = [tmp_path_factory.mktemp("gemm") for _ in GEMM_SHAPES]

    def one(shape, d):
        return build(d, {"ep_gemm.cu": KERNELS["ep_gemm.cu"]}, [f"{k}={v}" for k, v in zip(NAMES, shape, strict=True)])

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        libs = list(pool.map(one, GEMM_SHAPES, dirs))
    return dict(zip(GEMM_SHAPES, libs, strict=True))


def test_masked_gemm_bytes_do_not_depend_on_the_tile_shape(gemm_shapes):
    """Every compiled tile shape writes the same bytes (each output element is the same mma sequence over
    K), touches only the rows present, and follows the slot index; K 392 is 13, 7 or 4 K tiles, the last
    partial (8 columns, half an mma step), so every ring wraps and every K tail is masked. A shape whose
    loads or warp tiles were wrong would differ from the default here."""
    rng = np.random.default_rng(7)
    L, cap, n, n_factor, K = 4, 70, 68, 2, 392
    N = n * n_factor
    rows = np.array([70, 9, 0, 33], np.int32)  # 2 row tiles of 64, or 3 of 32; 1..16, 17..32, more rows
    recv = bf16_random(rng, (L * cap + 3, K))
    index = np.full(L * cap, -1, np.int32)
    for e in range(L):
        index[e * cap : e * cap + rows[e]] = rng.integers(0, recv.shape[0], rows[e])
    b = bf16_random(rng, (L * N, K))
    outs = {}
    for shape, lib in gemm_shapes.items():
        c = np.full((L * cap, N), 0x7FC0, np.uint16)
        run_masked_gemm(lib, recv, b, c, rows, cap, n, n_factor, K, a_index=index, bm=shape[0], bn=shape[1])
        outs[shape] = c
    base = outs[GEMM_SHAPES[0]]
    kept = np.flatnonzero(index >= 0)
    assert (base[index < 0] == 0x7FC0).all() and not (base[kept] == 0x7FC0).all(axis=1).any()
    f32 = ep_twins.bf16_bits_to_f32
    want = np.zeros((L * cap, N))
    for e in range(L):
        r = slice(e * cap, e * cap + rows[e])
        want[r] = f32(recv[index[r]]).astype(np.float64) @ f32(b[e * N : (e + 1) * N]).astype(np.float64).T
    assert np.allclose(f32(base[kept]), want[kept], rtol=1e-2, atol=1e-2 * np.abs(want).max())
    for shape, c in outs.items():
        assert np.array_equal(c, base), f"tile shape {shape} wrote other bytes than {GEMM_SHAPES[0]}"


def test_masked_gemm_gather_reads_each_slot_from_the_row_its_index_names(emulated):
    """The gather GEMM over received rows and a slot index (shuffled, repeated: a token used by several
    experts, or twice) writes the dense GEMM's bytes over the slab the index describes, emulated and twin;
    the slots at or beyond an expert's rows hold -1 and are never read. The same rows read without the
    index (A[e * cap + r], what a kernel ignoring it would do) give other bytes wherever the index names
    another row, so the index is tested."""
    rng = np.random.default_rng(6)
    L, cap, n, n_factor, K = 5, 70, 68, 2, 3 * TILE.bk
    N = n * n_factor
    rows = np.array([70, 5, 0, 27, 38], np.int32)
    recv = bf16_random(rng, (L * cap + 9, K))  # more rows than slots: an ignored index still reads in bounds
    index = np.full(L * cap, -1, np.int32)
    slab = np.zeros((L * cap, K), np.uint16)
    for e in range(L):
        src = rng.integers(0, recv.shape[0], rows[e]).astype(np.int32)
        src[: rows[e] // 4] = src[rows[e] // 4 : 2 * (rows[e] // 4)]  # some rows twice in one expert
        index[e * cap : e * cap + rows[e]] = src
        slab[e * cap : e * cap + rows[e]] = recv[src]
    b = bf16_random(rng, (L * N, K))
    poison = np.full((L * cap, N), 0x7FC0, np.uint16)
    dense, gathered, ignored = poison.copy(), poison.copy(), poison.copy()
    run_masked_gemm(emulated, slab, b, dense, rows, cap, n, n_factor, K)
    run_masked_gemm(emulated, recv, b, gathered, rows, cap, n, n_factor, K, a_index=index)
    run_masked_gemm(emulated, recv, b, ignored, rows, cap, n, n_factor, K)
    assert np.array_equal(gathered, dense)
    kept = np.flatnonzero(index >= 0)
    moved = kept[index[kept] != kept]  # slots whose index names another row than the slot's own position
    assert moved.size > kept.size // 2 and not (gathered[moved] == ignored[moved]).all(axis=1).any()
    assert (gathered[index < 0] == 0x7FC0).all()
    grid, block = (-(-N // TILE.bn), -(-cap // TILE.bm), L), (128, 1, 1)
    twin_dense, twin_gathered = poison.copy(), poison.copy()
    lookup("ep_masked_gemm")(None, grid, block, ptr(slab), ptr(b), ptr(twin_dense), ptr(rows), cap, n, n_factor, K)
    lookup("ep_masked_gemm_gather")(
        None, grid, block, ptr(recv), ptr(index), ptr(b), ptr(twin_gathered), ptr(rows), cap, n, n_factor, K
    )
    assert np.array_equal(twin_gathered, twin_dense)
    f32 = ep_twins.bf16_bits_to_f32
    x, y = f32(gathered[kept]).astype(np.float64), f32(twin_gathered[kept]).astype(np.float64)
    assert (np.abs(x - y) <= 2**-7 * np.abs(y) + 1e-6).all()  # the twin sums in another order


def _call(emulated, name, grid, block, *args):
    """Launch the emulated kernel `name` with plain ints (addresses as ints)."""
    fn = getattr(emulated, f"run_{name}")
    sig = next(kernels[name] for kernels in KERNELS.values() if name in kernels)
    kinds = []
    for p in sig.split(","):
        p = p.strip()
        kinds.append(ctypes.c_void_p if "*" in p else ctypes.c_ulonglong if p.startswith("unsigned long long")
                     else ctypes.c_longlong if p.startswith("long long") else ctypes.c_int)
    fn.argtypes = [ctypes.c_uint, ctypes.c_uint, *kinds]
    fn(grid, block, *args)


def _stress_world(G, words):
    return {"buf": [np.full(2 * G * words, 0xA5A5A5A5, np.uint32) for _ in range(G)],
            "state": [np.zeros(4, np.uint64) for _ in range(G)]}


def _stress_rounds(run, world, G, words, rounds, corrupt=None, lost=None):
    """`rounds` rounds of next -> produce (every member) -> check (every member) on `world`, through
    `run(name, grid, block, *args)`. `lost` = (round, writer): that writer's produce is skipped in that
    round, as if its stores had not landed when the barrier let the others through."""
    table = np.array([ptr(b) for b in world["buf"]], np.uint64)
    for r in range(1, rounds + 1):
        for me in range(G):
            run("stress_next", 1, 1, ptr(world["state"][me]))
        for me in range(G):
            if lost == (r, me):
                continue
            corrupt_round = 2 if corrupt == me else 0
            run("stress_produce", 3, 32, ptr(table), ptr(world["state"][me]), G, me, words, 0, corrupt_round)
        for me in range(G):
            run("stress_check", 2, 64, ptr(world["buf"][me]), ptr(world["state"][me]), G, me, words)


@pytest.mark.parametrize("G", [2, 3])
def test_stress_kernels_match_twins_and_catch_wrong_data(emulated, G):
    import tray.programs.peer_barrier.twins  # noqa: F401  (registers the stress twins)

    words = 37  # not a multiple of the block: the grid-stride tails are exercised
    host = HostBackend.open(0)

    def cuda(name, grid, block, *args):
        _call(emulated, name, grid, block, *args)

    def twin(name, grid, block, *args):
        lookup(name)(host, (grid, 1, 1), (block, 1, 1), *args)

    for corrupt, lost in ((None, None), (1, None), (None, (3, 0))):
        worlds = []
        for run in (cuda, twin):
            world = _stress_world(G, words)
            _stress_rounds(run, world, G, words, 5, corrupt, lost)
            worlds.append(world)
        c, t = worlds
        for me in range(G):
            assert np.array_equal(c["buf"][me], t["buf"][me]) and np.array_equal(c["state"][me], t["state"][me])
        states = c["state"]
        assert all(int(s[0]) == 5 for s in states)
        if corrupt is None and lost is None:
            assert all(int(s[1]) == 0 and int(s[3]) == 0 for s in states)
        elif corrupt is not None:  # one flipped word, seen by member corrupt + 1 in round 2
            victim = (corrupt + 1) % G
            assert [int(s[1]) for s in states] == [int(m == victim) for m in range(G)]
            assert int(states[victim][2]) == 1 << corrupt and int(states[victim][3]) == 2
        else:  # writer 0's round-3 words never landed: every member sees round 1's words there instead
            assert all(int(s[1]) == words and int(s[2]) == 1 and int(s[3]) == 3 for s in states)


def test_peer_barrier_kernel_announces_names_the_missing_and_stays_broken(emulated):
    """Member 1 of 3, one launch at a time, its peers' announcements preset: thread t stores the epoch into
    member t's slot 1; a member that announced this epoch or a later one lets it pass; a member that never
    announces is named (err = epoch, bit t; the host flag raised); a broken barrier stores nothing."""
    G, me = 3, 1
    flags = [np.zeros(G, np.uint64) for _ in range(G)]
    table = np.array([ptr(f) for f in flags], np.uint64)
    counter, err, host_flag = np.zeros(1, np.uint64), np.zeros(2, np.uint64), np.zeros(1, np.uint32)

    def launch():
        _call(emulated, "peer_barrier", 1, 32, ptr(flags[me]), ptr(table), ptr(counter), ptr(err), ptr(host_flag),
              G, me, 50_000)

    flags[me][0], flags[me][2] = 1, 1
    launch()
    assert int(counter[0]) == 1 and [int(f[me]) for f in flags] == [1] * G
    assert err.tolist() == [0, 0] and int(host_flag[0]) == 0
    flags[me][0] = 3  # member 0 is already past a later barrier (flags only grow); member 2 stays at 1
    launch()
    assert int(counter[0]) == 2 and [int(f[me]) for f in flags] == [2] * G
    assert err.tolist() == [2, 1 << 2] and int(host_flag[0]) == 1
    launch()  # broken: no epoch, no announcement, the first timeout's record kept
    assert int(counter[0]) == 2 and [int(f[me]) for f in flags] == [2] * G and err.tolist() == [2, 1 << 2]


# --- the low-latency one-shot: one member's launch, its peers' lines preset (one thread runs at a time) ---
LL_G, LL_ME, LL_MAX = 3, 1, 16  # 4 lines per slot
LL_KERNELS = ("tp_ll_allreduce", "tp_ll3_allreduce")  # 2 bf16 | 32-bit flag; 3 bf16 | 16-bit flag per word


def ll_format(kernel: str):
    from tray.programs.tp_mlp.twins import LL3_FORMAT, LL_FORMAT

    return {"tp_ll_allreduce": LL_FORMAT, "tp_ll3_allreduce": LL3_FORMAT}[kernel]


class _LLTray:
    """Receive buffers of LL_G members, the peer table, member LL_ME's state, input and output; `preset(g, bits,
    epoch)` writes member g's lines into LL_ME's slot as g's kernel would (in the line format of `kernel`)."""

    def __init__(self, count: int, ticket_launches: int, offset: int = 0, kernel: str = "tp_ll_allreduce") -> None:
        self.fmt = ll_format(kernel)
        ll_lines = self.fmt.lines
        self.count, self.offset = count, offset
        self.slot_words = LL_MAX // 4 * 2
        self.recv = [np.zeros(2 * LL_G * self.slot_words, np.uint64) for _ in range(LL_G)]
        self.table = np.array([ptr(r) for r in self.recv], np.uint64)
        self.state = np.array([ticket_launches << 20, 0, 0, 0], np.uint64)
        self.inp = np.zeros(count + 8, np.uint16)
        self.out = np.full(count + 8, 0xFFFF, np.uint16)
        self.lines = ll_lines(count)

    def words(self, member: int, parity: int, src: int) -> np.ndarray:
        base = (parity * LL_G + src) * self.slot_words
        return self.recv[member][base:base + self.slot_words]

    def preset(self, src: int, bits: np.ndarray, epoch: int) -> None:
        self.words(LL_ME, epoch & 1, src)[: 2 * self.lines] = self.fmt.pack(bits, self.fmt.flag(epoch))

    def args(self, count: int | None = None, timeout_ns: int = 50_000) -> list[int]:
        return [ptr(self.inp) + 2 * self.offset, ptr(self.out) + 2 * self.offset, ptr(self.table), ptr(self.state),
                self.count if count is None else count, LL_MAX, LL_G, LL_ME, timeout_ns]

    def snapshot(self) -> list[np.ndarray]:
        return [r.copy() for r in self.recv] + [self.state.copy(), self.out.copy()]


@pytest.mark.parametrize("kernel", LL_KERNELS)
@pytest.mark.parametrize("count, grid, block, offset", [(10, 1, 2, 0), (16, 2, 32, 0), (13, 1, 2, 1), (12, 1, 1, 2)])
def test_tp_ll_allreduce_sends_sums_in_member_order_and_zeroes(emulated, kernel, count, grid, block, offset):
    """grid 1 x 2 threads over 2-4 lines: a thread handles two lines (the second read in the loop); the tail
    line pads with zeros (counts 10, 13, 16: not whole lines of 4 or of 6); offset 1 element: in and out not
    4-byte aligned (element loads); offset 2: 4- but not 8-byte aligned (the dense format's 4-byte loads, the
    other's element loads). Emulated kernel and twin write the same bytes: the lines in the peers' slots, the
    sum, the zeroed slots, the ticket."""
    from tray.programs.tp_mlp.twins import sum_members_bits

    rng = np.random.default_rng(7)
    parts = [bf16_random(rng, count) for _ in range(LL_G)]
    results = []
    for kind in ("emu", "twin"):
        t = _LLTray(count, ticket_launches=5, offset=offset, kernel=kernel)  # the 6th launch: epoch 6, parity 0
        t.inp[offset:offset + count] = parts[LL_ME]
        for g in (0, 2):
            t.preset(g, parts[g], 6)
        if kind == "emu":
            _call(emulated, kernel, grid, block, *t.args())
        else:
            lookup(kernel)(HostBackend.open(0), (grid, 1, 1), (block, 1, 1), *t.args())
        assert np.array_equal(t.out[offset:offset + count], sum_members_bits(parts)), kind
        assert (t.out[:offset] == 0xFFFF).all() and (t.out[offset + count:] == 0xFFFF).all(), kind
        for g in (0, 2):
            sent = t.words(g, 0, LL_ME)
            assert np.array_equal(sent[: 2 * t.lines], t.fmt.pack(parts[LL_ME], t.fmt.flag(6))), kind
            assert not sent[2 * t.lines:].any() and not t.words(LL_ME, 0, g).any(), kind  # consumed: zeroed
        assert t.state.tolist() == [6 << 20, 0, 0, 0], kind
        results.append(t.snapshot())
    assert all(np.array_equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("kernel", LL_KERNELS)
def test_tp_ll_allreduce_names_the_missing_member_stays_broken_and_refuses_big_counts(emulated, kernel):
    """Member 2's lines never come: the wait ends (state[2] = bit 2, state[1] = the epoch); the next launch
    takes its ticket, stores and waits for nothing; a count above the slots is refused before any ticket."""
    for kind in ("emu", "twin"):
        t = _LLTray(8, ticket_launches=0, kernel=kernel)  # epoch 1, parity 1
        t.inp[:8] = np.arange(1, 9, dtype=np.uint16)
        t.preset(0, np.arange(8, dtype=np.uint16), 1)

        def launch(t=t, kind=kind, **kw):
            if kind == "emu":
                _call(emulated, kernel, 1, 32, *t.args(**kw))
            else:
                lookup(kernel)(HostBackend.open(0), (1, 1, 1), (32, 1, 1), *t.args(**kw))

        launch(timeout_ns=20_000_000 if kind == "twin" else 50_000)
        assert t.state.tolist() == [1 << 20, 1, 1 << 2, 0], kind
        sent = t.fmt.pack(t.inp[:8], t.fmt.flag(1))
        assert np.array_equal(t.words(0, 1, LL_ME)[:sent.size], sent), kind  # sent first
        launch()  # broken: epoch 2's parity-0 slots stay empty everywhere
        assert t.state.tolist() == [2 << 20, 1, 1 << 2, 0] and not any(t.words(g, 0, LL_ME).any() for g in (0, 2))
        t.state[:] = [2 << 20, 0, 0, 0]
        launch(count=LL_MAX + 1)
        assert t.state.tolist() == [2 << 20, 0, 0, 1], kind


@pytest.mark.parametrize("kernel", LL_KERNELS)
def test_tp_ll_allreduce_zeroing_keeps_a_line_of_the_flags_last_turn_out(emulated, kernel):
    """The flag repeats every 2 x its period of launches on one parity (16-bit: 131070, 32-bit: 2^33 - 2): a line
    left in a slot that long ago would pass for new. Member 2 sends 3 lines at launch E; launch E + 2 x period
    (the launches between sent shorter messages, if any) has member 2 missing: the wait must time out naming it,
    which it does only because launch E zeroed the lines it consumed."""
    period = 0xFFFF if kernel == "tp_ll3_allreduce" else 0xFFFFFFFF
    rng = np.random.default_rng(3)
    parts = [bf16_random(rng, 16) for _ in range(LL_G)]
    for kind in ("emu", "twin"):
        t = _LLTray(16, ticket_launches=9, kernel=kernel)  # epoch 10
        t.inp[:16] = parts[LL_ME]

        def launch(t=t, kind=kind, **kw):
            if kind == "emu":
                _call(emulated, kernel, 1, 32, *t.args(**kw))
            else:
                lookup(kernel)(HostBackend.open(0), (1, 1, 1), (32, 1, 1), *t.args(**kw))

        for g in (0, 2):
            t.preset(g, parts[g], 10)
        launch()
        assert t.state.tolist() == [10 << 20, 0, 0, 0] and not t.words(LL_ME, 0, 2).any(), kind
        later = 10 + 2 * period
        assert t.fmt.flag(later) == t.fmt.flag(10) and later & 1 == 0
        t.state[0] = (later - 1) << 20
        t.preset(0, parts[0], later)
        launch(timeout_ns=20_000_000 if kind == "twin" else 50_000)
        assert t.state.tolist() == [later << 20, later, 1 << 2, 0], kind


# --- the low-latency one-shot, every member on its own thread, all at once: each member a copy of the build
# (dlopen gives each file its own globals: block and thread indices, the block scheduler), the clock real ---
REAL_CLOCK = r"""
#include <chrono>
#include <sched.h>
static unsigned long long emu_real_ns() {
    sched_yield();  // a member that waits lets the others run: 2 cores host up to 8 members
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}
"""
LL_WORLD_MAX = 512  # elements per slot: 128 lines


@pytest.fixture(scope="module")
def ll_members(tmp_path_factory):
    """8 loaded copies of the low-latency kernels: member g launches through copy g."""
    d = tmp_path_factory.mktemp("ll_members")
    ptx = {**PTX_ON_CPU, 'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));': "now = emu_real_ns();"}
    build(d, {"tp_allreduce.cu": {k: KERNELS["tp_allreduce.cu"][k] for k in LL_KERNELS}}, ptx_on_cpu=ptx,
          prelude=REAL_CLOCK)
    libs = []
    for g in range(8):
        shutil.copyfile(d / "emu.so", d / f"emu{g}.so")  # a new file (inode): dlopen loads it again
        libs.append(ctypes.CDLL(str(d / f"emu{g}.so")))
    return libs


def _ll_world(G, ticket_launches):
    slot_words = LL_WORLD_MAX // 4 * 2
    recv = [np.zeros(2 * G * slot_words, np.uint64) for _ in range(G)]
    return {"recv": recv, "table": np.array([ptr(r) for r in recv], np.uint64),
            "state": [np.array([ticket_launches << 20, 0, 0, 0], np.uint64) for _ in range(G)]}


def _ll_run_members(libs, world, launches, members, G, timeout_ns):
    """Each member of `members` runs `launches` ([(kernel, grid, block, ins[G], outs[G], count)]) back to back on its
    own thread, no sync between members (as streams of a lockstep program). Returns the seconds until all ended."""
    import threading
    import time

    errors = []

    def member(g):
        try:
            for kernel, grid, block, ins, outs, count in launches:
                _call(libs[g], kernel, grid, block, ptr(ins[g]), ptr(outs[g]), ptr(world["table"]),
                      ptr(world["state"][g]), count, LL_WORLD_MAX, G, g, timeout_ns)
        except BaseException as exc:  # re-raised below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(g,), daemon=True) for g in members]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a member's launch never ended"
    if errors:
        raise errors[0]
    return time.monotonic() - t0


@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_tp_ll_members_at_once_across_parities_epochs_and_the_flag_wrap(ll_members, G):
    """G members at once, 6 launches back to back from launch 65533 on: the dense format's 16-bit flag wraps
    (65534, 65535, 1, then 3, 4 after a launch of the other format on the same buffers), each parity used three
    times, counts with tails (not whole lines of 6 or of 4), more lines than threads (grid-stride). Every
    member's `out` is the member-order float32 sum rounded once, the same bytes on every member; afterwards
    every slot of every member is zero and every state word says 6 good launches."""
    from tray.programs.tp_mlp.twins import sum_members_bits

    rng = np.random.default_rng(G)
    seq = [("tp_ll3_allreduce", 101), ("tp_ll3_allreduce", 500), ("tp_ll3_allreduce", 13),
           ("tp_ll_allreduce", 257), ("tp_ll3_allreduce", 1), ("tp_ll3_allreduce", 512)]
    first = 65532  # launches before: the first here is epoch 65533
    world = _ll_world(G, first)
    launches = []
    for kernel, count in seq:
        ins = [bf16_wide(rng, count) for _ in range(G)]
        launches.append((kernel, 2, 32, ins, [np.full(count, 0xFFFF, np.uint16) for _ in range(G)], count))
    _ll_run_members(ll_members, world, launches, range(G), G, 30_000_000_000)
    for kernel, _, _, ins, outs, count in launches:
        want = sum_members_bits(ins)
        assert all(np.array_equal(o, want) for o in outs), (kernel, count)
    assert all(st.tolist() == [(first + len(seq)) << 20, 0, 0, 0] for st in world["state"])
    assert not any(r.any() for r in world["recv"])


def test_tp_ll_members_at_once_name_the_member_that_never_launches(ll_members):
    """4 members, member 2 never launches: every other member's wait ends after the timeout (50 ms, real time
    here) and records member 2 and the launch, whose sum it never writes."""
    G, count, timeout_ns = 4, 100, 50_000_000
    world = _ll_world(G, 6)
    ins = [np.full(count, 0x3F80, np.uint16) for _ in range(G)]
    outs = [np.full(count, 0xFFFF, np.uint16) for _ in range(G)]
    seconds = _ll_run_members(ll_members, world, [("tp_ll3_allreduce", 2, 32, ins, outs, count)], (0, 1, 3), G,
                              timeout_ns)
    assert timeout_ns / 1e9 <= seconds < 30
    for g in (0, 1, 3):
        assert world["state"][g].tolist() == [7 << 20, 7, 1 << 2, 0], g
        assert not (outs[g] == 0x4080).any(), g  # 4.0 would be the sum of the four ones


def test_tp_ll_ticket_gives_every_block_the_launch_number():
    """Block 0 adds 2^20 - (grid - 1), the others 1: in any order every partial sum stays inside the launch's
    2^20 range, so ticket >> 20 is the launch number for every block, and launches with other grids follow."""
    rng = np.random.default_rng(0)
    total = 0
    for launch, grid in enumerate((1, 7, 300, 2, 1 << 20)):
        adds = [(1 << 20) - (grid - 1)] + [1] * (grid - 1)
        seen = set()
        for b in rng.permutation(grid) if grid < 1000 else [0, *range(1, grid)]:
            seen.add(total >> 20)
            total += adds[b]
        assert seen == {launch} and total == (launch + 1) << 20


def test_tp_ll_stress_kernels_check_each_round_and_advance(emulated):
    """Round 0 only fills; round 1 checks out against round 0's sum: a right sum counts nothing, one flipped
    element counts one; next advances the round and the skewed member (r % G) spins until its time is up."""
    from tray.programs.tp_mlp.twins import ll_stress_values

    G, me, count = 3, 1, 37
    for kind in ("emu", "twin"):
        inp, out = np.zeros(count, np.uint16), np.zeros(count, np.uint16)
        stress = np.zeros(4, np.uint64)

        def step(kind=kind, inp=inp, out=out, stress=stress):
            args = [ptr(inp), ptr(out), ptr(stress), count, G, me]
            if kind == "emu":
                _call(emulated, "tp_ll_stress_step", 2, 8, *args)
            else:
                lookup("tp_ll_stress_step")(HostBackend.open(0), (2, 1, 1), (8, 1, 1), *args)

        def advance(kind=kind, stress=stress):
            if kind == "emu":
                _call(emulated, "tp_ll_stress_next", 1, 1, ptr(stress), G, me, 3000)
            else:
                lookup("tp_ll_stress_next")(HostBackend.open(0), (1, 1, 1), (1, 1, 1), ptr(stress), G, me, 3000)

        step()
        assert stress.tolist() == [0, 0, 0, 0] and np.array_equal(inp, f32_to_bf16_bits(
            ll_stress_values(0, me, count).astype(np.float32))), kind
        sums = sum(ll_stress_values(0, g, count) for g in range(G))
        out[:] = f32_to_bf16_bits(sums.astype(np.float32))
        advance()
        step()
        assert stress.tolist() == [1, 0, 0, 0], kind
        out[5] ^= 0x8000
        step()
        assert stress.tolist() == [1, 1, 0, 0], kind
        advance()  # round 1: member 1 (r % G) is skewed
        assert int(stress[0]) == 2, kind


def fp8_rows(rng, T, H):
    """bf16 rows whose 128-value blocks cover what the e4m3 recipe must get right: ordinary values of both
    signs, an all-zero block, a block of bf16 subnormals, a block with one large value (most of the rest
    fall to e4m3 subnormals or zero), exact ties, and the largest finite bf16 (its scale saturates nothing)."""
    x = rng.standard_normal((T, H)).astype(np.float32) * np.exp2(rng.integers(-8, 8, (T, 1))).astype(np.float32)
    x[1, :128] = 0.0
    x[2, 128:256] = rng.choice([-1, 1], 128) * np.exp2(rng.integers(-133, -127, 128)).astype(np.float32)
    x[3, :128] = rng.standard_normal(128) * 1e-3
    x[3, 7] = -1e4
    x[4, :128] = 448.0 * (1 + 2 * rng.integers(0, 8, 128)) / 16  # ties between e4m3 neighbours after scaling
    x[4, 0] = 448.0
    x[5, 128:256] = 3.3895314e38 * rng.choice([-1, 1], 128)
    return f32_to_bf16_bits(x)


def test_e4m3_recipe_matches_ml_dtypes_in_range_and_saturates_beyond():
    """The twin's e4m3 conversion is ml_dtypes' float8_e4m3fn (nearest even) on every finite value within
    +-464 (the last value that rounds to 448), and +-448 beyond it where ml_dtypes gives NaN; decoding every
    code gives ml_dtypes' value."""
    rng = np.random.default_rng(9)
    f = np.concatenate([
        rng.standard_normal(20000).astype(np.float32) * np.exp2(rng.integers(-14, 9, 20000)).astype(np.float32),
        np.arange(-464, 465, 0.0625, dtype=np.float32),
        (np.arange(0, 64) * 2.0**-10).astype(np.float32),
    ])
    f = f[np.abs(f) <= 464]
    want = f.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(ep_twins.f32_to_e4m3_bits(f), want)
    big = np.array([465, 480, 1e6, np.inf, -500, -np.inf], np.float32)
    assert ep_twins.f32_to_e4m3_bits(big).tolist() == [0x7E] * 4 + [0xFE] * 2
    assert ep_twins.f32_to_e4m3_bits(np.array([np.nan, -np.nan], np.float32)).tolist() == [0x7F, 0xFF]
    codes = np.arange(256, dtype=np.uint8)
    got, ref = ep_twins.e4m3_bits_to_f32(codes), codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = ~np.isnan(ref)  # NOTE: both NaN codes decode to the one NaN the bf16 recipe keeps (0x7FC0)
    assert np.array_equal(got, ref, equal_nan=True) and np.array_equal(np.signbit(got[finite]), np.signbit(ref[finite]))


def test_fp8_dispatch_and_dequant_equal_their_twins(emulated):
    """Two ranks, each rank's ep_dispatch_fp8 then each receiver's ep_dequant_fp8, emulated CUDA == twin
    byte for byte: e4m3 rows, scales, routing words, err, and the bf16 rows rebuilt (rows of tokens with no
    expert on a rank stay as they were); the rebuilt rows are within e4m3's half step (2^-4 relative, of the
    block's amax for values near zero) of the bf16 rows sent."""
    rng = np.random.default_rng(11)
    G, T, K, E, H = 2, 12, 2, 8, 640  # 5 blocks of 128 per row: a whole group of 4 per warp and a partial one
    L, nblk = E // G, H // 128
    idx = [skewed_routing(rng, T, E, K) for _ in range(G)]
    idx[1][5, 1] = E + 3  # an id out of range: flagged, sent as no expert
    for i in idx:  # token 0 goes to rank 1 alone, token 2 to rank 0 alone
        i[0], i[2] = [L + 1, L + 2], [0, 1]
    xs = [fp8_rows(rng, T, H) for _ in range(G)]
    ws = [bf16_random(rng, (T, K)) for _ in range(G)]
    q = [np.full((G * T, H), 0xAB, np.uint8) for _ in range(G)]
    sc = [np.full((G * T, nblk), -1.0, np.float32) for _ in range(G)]
    meta = [np.zeros((G * T, K), np.uint32) for _ in range(G)]
    for me in range(G):
        arrays = {"x": xs[me], "ti": idx[me], "tw": ws[me], "err": np.zeros(4, np.uint32),
                  **{f"q{g}": q[g] for g in range(G)}, **{f"s{g}": sc[g] for g in range(G)},
                  **{f"m{g}": meta[g] for g in range(G)}}

        def args(a, me=me):
            a["qp"], a["sp"], a["mp"] = (tables(a, [f"{n}{g}" for g in range(G)]) for n in "qsm")
            return [ptr(a["x"]), ptr(a["ti"]), ptr(a["tw"]), ptr(a["qp"]), ptr(a["sp"]), ptr(a["mp"]), ptr(a["err"]),
                    T, K, H, E, G, me]

        c, t = both(emulated, "ep_dispatch_fp8", 3, 64, args, arrays)
        assert_same(c, t, skip=("qp", "sp", "mp"))
        assert c["err"].tolist() == ([0, 0, 0, 0] if me == 0 else [1, 1, 0, 0])
        q, sc, meta = [c[f"q{g}"] for g in range(G)], [c[f"s{g}"] for g in range(G)], [c[f"m{g}"] for g in range(G)]
    # what the bf16 dispatch sends alongside: the same routing words
    assert np.array_equal(meta[0][T:], ep_twins.pack_routing(idx[1], ws[1], E).reshape(T, K))
    for g in range(G):  # token 1's zero block goes as zero bytes with scale 1 wherever it goes
        if ((idx[0][1] >= g * L) & (idx[0][1] < (g + 1) * L)).any():
            assert (q[g][1, :128] == 0).all() and sc[g][1, 0] == 1.0
    assert {0x7E, 0xFE} <= set(np.unique(np.concatenate([q[g] for g in range(G)])).tolist())  # +-448 reached
    for me in range(G):
        recv = np.full((G * T, H), 0x1234, np.uint16)
        arrays = {"q": q[me], "s": sc[me], "meta": meta[me], "recv": recv}
        c, t = both(emulated, "ep_dequant_fp8", 2, 64,
                    lambda a, me=me: [ptr(a["q"]), ptr(a["s"]), ptr(a["meta"]), ptr(a["recv"]), T, K, H, E, G, me],
                    arrays)
        assert np.array_equal(c["recv"], t["recv"])
        sent = np.concatenate([((i >= me * L) & (i < (me + 1) * L)).any(axis=1) for i in idx])
        assert sent.any() and not sent.all()
        assert (c["recv"][~sent] == 0x1234).all() and not (c["recv"][sent] == 0x1234).all()
        x = np.concatenate([ep_twins.bf16_bits_to_f32(xi) for xi in xs])[sent].reshape(-1, nblk, 128)
        got = ep_twins.bf16_bits_to_f32(c["recv"][sent]).reshape(-1, nblk, 128)
        scale = np.abs(x).max(axis=2, keepdims=True) / 448
        err = np.abs(got - x)
        # e4m3's half step (2^-4 relative; 2^-10 * scale among its subnormals), bf16's own rounding of the
        # result (2^-8 relative, 2^-134 among bf16 subnormals)
        assert (err <= np.abs(x) * (2.0**-4 + 2.0**-8) + scale * 2.0**-10 * 1.01 + 2.0**-134).all()
        assert err.max() > 0
