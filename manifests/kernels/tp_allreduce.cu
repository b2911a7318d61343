// tp_allreduce: the peer allreduces of manifests/tp_mlp.json (bf16 in, bf16 out, sum).
//
// Sum: every output element is the float32 sum of the members' elements in member order 0..G-1,
// starting at 0, rounded once to bf16 (round to nearest even, NaN -> 0x7FC0). Same inputs, same order,
// same operations: every member gets identical bytes from either protocol below, and the numpy twins
// (tray/programs/tp_mlp/twins.py) do the same float32 adds.
//
// One-shot (`tp_sum_peers`): every member writes its partial into its own exported buffer, a peer
// barrier, then every member reads every member's buffer through the peer table and sums all `count`
// elements. Moves (G - 1) * S bytes into each member: the latency path for small messages.
//
// Two-shot (`tp_rs_peers` then `tp_ag_peers`): element range [me * chunk, me * chunk + n_me) is member
// me's, chunk = ceil(count / G) rounded up to 8 elements (one 16-byte vector), n_me its clipped length.
// Barrier; reduce-scatter: member me sums its range from every member's partial (peer reads) into its
// own `out`; barrier; all-gather: member me writes its range of `out` into every other member's `out`
// (peer writes); barrier. Moves 2 (G - 1) / G * S bytes per member: the bandwidth path.
//
// The manifest launches these with programmatic stream serialization: a kernel may be scheduled while the
// barrier before it still waits, and holds in `griddepcontrol.wait` until that barrier has ended and its
// memory operations are visible (the same guarantee as a kernel boundary, without the launch gap).
//
// Each thread owns 8 consecutive bf16 (one 16-byte vector) and first issues the loads from up to 8
// members, then adds them in order, so a warp has 8 remote loads in flight. Grid-stride loops: any
// grid works; any count works (the count % 8 tail goes element by element).

__device__ __forceinline__ float bf16_to_f32(unsigned int bits16) {
    return __uint_as_float(bits16 << 16);
}

__device__ __forceinline__ unsigned int f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        return 0x7FC0u;
    }
    u += 0x7FFFu + ((u >> 16) & 1u);
    return u >> 16;
}

__device__ __forceinline__ void add8(float* acc, uint4 v) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        acc[2 * j] = __fadd_rn(acc[2 * j], bf16_to_f32(w[j] & 0xFFFFu));
        acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], bf16_to_f32(w[j] >> 16));
    }
}

#define TP_LOADS 8

__device__ __forceinline__ unsigned int pack2(float a, float b) {
    return f32_to_bf16(a) | (f32_to_bf16(b) << 16);
}

// out[begin, begin + n) = member-order sum of peers[g][begin, begin + n); begin % 8 == 0.
__device__ void sum_range(const uint4* const* peers, unsigned short* out, long long begin, long long n, int G) {
    const long long nvec = n / 8;
    const long long v0 = begin / 8;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    uint4* out4 = (uint4*)out;
    for (long long i = first; i < nvec; i += stride) {
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int g0 = 0; g0 < G; g0 += TP_LOADS) {
            uint4 v[TP_LOADS];
#pragma unroll
            for (int u = 0; u < TP_LOADS; ++u) {
                if (g0 + u < G) {
                    v[u] = peers[g0 + u][v0 + i];
                }
            }
#pragma unroll
            for (int u = 0; u < TP_LOADS; ++u) {
                if (g0 + u < G) {
                    add8(acc, v[u]);
                }
            }
        }
        uint4 o;
        o.x = pack2(acc[0], acc[1]);
        o.y = pack2(acc[2], acc[3]);
        o.z = pack2(acc[4], acc[5]);
        o.w = pack2(acc[6], acc[7]);
        out4[v0 + i] = o;
    }
    // the tail (n % 8 elements), one element per thread of the first threads
    const long long e = begin + nvec * 8 + first;
    if (first < n - nvec * 8) {
        float acc = 0.0f;
        for (int g = 0; g < G; ++g) {
            acc = __fadd_rn(acc, bf16_to_f32(((const unsigned short*)peers[g])[e]));
        }
        out[e] = (unsigned short)f32_to_bf16(acc);
    }
}

// Waits for the kernel before this one (with a programmatic launch); does nothing otherwise.
__device__ __forceinline__ void wait_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ long long tp_chunk(long long count, int G) {
    return ((count + G - 1) / G + 7) / 8 * 8;
}

__device__ __forceinline__ long long tp_chunk_len(long long count, long long chunk, int m) {
    const long long left = count - (long long)m * chunk;
    return left < 0 ? 0 : (left < chunk ? left : chunk);
}

//   peers  u64[G]: member g's partial [count] bf16 (as mapped here)
//   out    [count] bf16, local
extern "C" __global__ void tp_sum_peers(const uint4* const* peers, uint4* __restrict__ out, long long count,
                                        int G) {
    wait_previous_kernel();
    sum_range(peers, (unsigned short*)out, 0, count, G);
}

// Two-shot, step 1: this member's range of the sum into its own `out` (the rest of `out` untouched).
extern "C" __global__ void tp_rs_peers(const uint4* const* peers, uint4* __restrict__ out, long long count, int G,
                                       int me) {
    wait_previous_kernel();
    const long long chunk = tp_chunk(count, G);
    sum_range(peers, (unsigned short*)out, (long long)me * chunk, tp_chunk_len(count, chunk, me), G);
}

// Two-shot, step 2: this member's range of its `out` (outs[me]) into every other member's `out`.
//   outs   u64[G]: member g's out [count] bf16 (as mapped here)
extern "C" __global__ void tp_ag_peers(uint4* const* outs, long long count, int G, int me) {
    wait_previous_kernel();
    const long long chunk = tp_chunk(count, G);
    const long long n = tp_chunk_len(count, chunk, me);
    const long long begin = (long long)me * chunk;
    const long long nvec = n / 8;
    const long long v0 = begin / 8;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const uint4* mine = outs[me];
    for (long long i = first; i < nvec; i += stride) {
        const uint4 v = mine[v0 + i];
        for (int g = 0; g < G; ++g) {
            if (g != me) {
                outs[g][v0 + i] = v;
            }
        }
    }
    const long long e = begin + nvec * 8 + first;
    if (first < n - nvec * 8) {
        const unsigned short v = ((const unsigned short*)mine)[e];
        for (int g = 0; g < G; ++g) {
            if (g != me) {
                ((unsigned short*)outs[g])[e] = v;
            }
        }
    }
}
