// tp_allreduce: the read side of the one-shot allreduce of manifests/tp_mlp.json.
//
// Protocol (the manifest's program): every member writes its partial into its own exported buffer,
// a peer barrier, then this kernel: every member reads every member's buffer through the peer table
// and sums in member order 0..G-1 with a float32 accumulator starting at 0, rounded once to bf16
// (round to nearest even, NaN -> 0x7FC0). Same inputs, same order, same operations: every member gets
// identical bytes. The numpy twin (tray/programs/tp_mlp/twins.py) does the same float32 adds.
//
// Each thread owns 8 consecutive bf16 (one 16-byte vector) and first issues the loads from up to 8
// members, then adds them in order, so a warp has 8 remote loads in flight. Grid-stride loop: any
// grid works; count % 8 == 0 (the host checks).

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

//   peers  u64[G]: member g's partial [count] bf16 (as mapped here)
//   out    [count] bf16, local
extern "C" __global__ void tp_sum_peers(const uint4* const* peers, uint4* __restrict__ out, long long count,
                                        int G) {
    const long long nvec = count / 8;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int g0 = 0; g0 < G; g0 += TP_LOADS) {
            uint4 v[TP_LOADS];
#pragma unroll
            for (int u = 0; u < TP_LOADS; ++u) {
                if (g0 + u < G) {
                    v[u] = peers[g0 + u][i];
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
        o.x = f32_to_bf16(acc[0]) | (f32_to_bf16(acc[1]) << 16);
        o.y = f32_to_bf16(acc[2]) | (f32_to_bf16(acc[3]) << 16);
        o.z = f32_to_bf16(acc[4]) | (f32_to_bf16(acc[5]) << 16);
        o.w = f32_to_bf16(acc[6]) | (f32_to_bf16(acc[7]) << 16);
        out[i] = o;
    }
}
