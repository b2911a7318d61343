// ep_moe: the data-movement kernels of the expert-parallel MoE layer (manifests/ep_moe.json).
//
// Rows are `hidden` bf16 values (2 * hidden bytes, a multiple of 16: the host checks hidden % 8 == 0)
// moved as 16-byte vectors. The unit of work is a warp item: one CHUNK_VECS-vector chunk (2 KiB) of one
// row; each lane first loads its ROW_UNROLL vectors of the chunk, then stores them. Items are walked
// with a grid-stride loop (item = row * chunks_per_row + chunk), so any grid works, nothing depends on
// how many SMs the GPU has or which blocks are co-resident, and a small batch (128 tokens x top-8 =
// 1024 rows of 7 chunks at hidden 7168) still spreads over 7168 warps. blockDim.x must be a multiple
// of 32 (the manifest launches 256: 8 warps per block).
//
// Slab layout (the owner's receive slab `slab` and the expert outputs `y`): [local expert][cap][hidden]
// with the rows of one expert in global token order (source rank, then token). Positions are
// precomputed on the host (tray/programs/ep_moe/plan.py); a production router would compute them on the device
// with a prefix sum over the per-(source, expert) counts.
//
// Kernels that write peer memory end with publish(): the warp's stores are performed at system scope
// before it exits (one fence per warp, after __syncwarp orders the lanes' stores before lane 0's fence).
// The peer barrier that follows (its fence after the previous kernel ended) then publishes them to every
// member; the fence here keeps that true even if a barrier someday overlaps the end of this kernel.

typedef unsigned long long u64;

#define ROW_UNROLL 4
#define CHUNK_VECS (32 * ROW_UNROLL)

__device__ __forceinline__ void publish(int lane) {
    __syncwarp();
    if (lane == 0) {
        __threadfence_system();
    }
}

// Copy chunk `chunk` (vectors chunk * CHUNK_VECS ..) of a row of `nvec` 16-byte vectors, one warp.
__device__ __forceinline__ void copy_chunk(uint4* dst, const uint4* src, int nvec, int chunk, int lane) {
    const int base = chunk * CHUNK_VECS + lane;
    uint4 v[ROW_UNROLL];
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; ++u) {
        const int i = base + u * 32;
        if (i < nvec) {
            v[u] = src[i];
        }
    }
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; ++u) {
        const int i = base + u * 32;
        if (i < nvec) {
            dst[i] = v[u];
        }
    }
}

// The warp items of `rows` rows: this warp takes items first, first + stride, ... below count.
struct WarpItems {
    long long first, stride, count;
    int chunks;
};

__device__ __forceinline__ WarpItems warp_items(long long rows, int nvec) {
    WarpItems it;
    it.chunks = (nvec + CHUNK_VECS - 1) / CHUNK_VECS;
    it.count = rows * it.chunks;
    it.first = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    it.stride = (long long)gridDim.x * (blockDim.x >> 5);
    return it;
}

// dispatch (peer path): every (token, k) pair of this rank is written straight into the receive slab
// of the rank that owns expert route_expert[t][k], at row route_pos[t][k] of that expert.
//
//   x             [tokens][hidden] bf16                 this rank's tokens
//   route_expert  [tokens][topk] i32                    global expert id per pair
//   route_pos     [tokens][topk] i32                    row within the expert's cap rows
//   slab_peers    u64[G]: member g's slab [experts/G][cap][hidden] bf16 (as mapped here)
//   count_peers   u64[G]: member g's recv_counts [G][experts/G] i32; this rank writes row `me`
//   send_counts   [experts] i32                         pairs this rank sends to each expert
//   err           u32[4] local: err[0] |= 1 on a bad route (expert out of range or pos >= cap: the
//                 capacity overflowed), err[1] counts the pairs that were not sent
extern "C" __global__ void ep_dispatch(const uint4* __restrict__ x,
                                       const int* __restrict__ route_expert,
                                       const int* __restrict__ route_pos,
                                       unsigned char* const* slab_peers,
                                       int* const* count_peers,
                                       const int* __restrict__ send_counts,
                                       unsigned int* err,
                                       int tokens,
                                       int topk,
                                       int hidden,
                                       int experts,
                                       int G,
                                       int me,
                                       int cap) {
    const int local = experts / G;
    const int nvec = hidden / 8;
    const size_t row_bytes = (size_t)hidden * 2;
    if (blockIdx.x == 0) {
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            const int g = e / local;
            count_peers[g][me * local + (e - g * local)] = send_counts[e];
        }
    }
    const int lane = threadIdx.x & 31;
    const WarpItems it = warp_items((long long)tokens * topk, nvec);
    for (long long item = it.first; item < it.count; item += it.stride) {
        const long long p = item / it.chunks;
        const int chunk = (int)(item - p * it.chunks);
        const int e = route_expert[p];
        const int pos = route_pos[p];
        if (e < 0 || e >= experts || pos < 0 || pos >= cap) {
            if (lane == 0 && chunk == 0) {
                atomicOr(&err[0], 1u);
                atomicAdd(&err[1], 1u);
            }
            continue;
        }
        const int g = e / local;
        const int el = e - g * local;
        uint4* dst = (uint4*)(slab_peers[g] + ((size_t)el * cap + pos) * row_bytes);
        copy_chunk(dst, x + (size_t)(p / topk) * nvec, nvec, chunk, lane);
    }
    publish(lane);
}

// combine (peer path): every used row of this rank's expert outputs goes back to the combine slab of
// the rank its token came from, at that token's (t, k) slot.
//
//   y            [rows][hidden] bf16                    rows = (experts / G) * cap expert outputs
//   combine_src  [rows] i32                             global pair id (src * tokens + t) * topk + k,
//                                                       or -1 for an unused row
//   comb_peers   u64[G]: member g's combine slab [tokens][topk][hidden] bf16
//   err          u32[4] local: err[0] |= 2 on a pair id outside the tray
extern "C" __global__ void ep_combine(const uint4* __restrict__ y,
                                      const int* __restrict__ combine_src,
                                      unsigned char* const* comb_peers,
                                      unsigned int* err,
                                      int experts,
                                      int cap,
                                      int tokens,
                                      int topk,
                                      int hidden,
                                      int G) {
    const int nvec = hidden / 8;
    const size_t row_bytes = (size_t)hidden * 2;
    const long long pairs = (long long)tokens * topk;
    const int lane = threadIdx.x & 31;
    const WarpItems it = warp_items((long long)(experts / G) * cap, nvec);
    for (long long item = it.first; item < it.count; item += it.stride) {
        const long long r = item / it.chunks;
        const int chunk = (int)(item - r * it.chunks);
        const int v = combine_src[r];
        if (v < 0) {
            continue;
        }
        const long long g = v / pairs;
        if (g >= G) {
            if (lane == 0 && chunk == 0) {
                atomicOr(&err[0], 2u);
            }
            continue;
        }
        uint4* dst = (uint4*)(comb_peers[g] + (size_t)(v - g * pairs) * row_bytes);
        copy_chunk(dst, y + (size_t)r * nvec, nvec, chunk, lane);
    }
    publish(lane);
}

// copy_rows (NCCL path pack/unpack, local only): for i < rows = rows_a * rows_b,
//   dst row (dst_index ? dst_index[i] : i)  <-  src row (src_index ? src_index[i] : i / src_div)
// and a row whose index is negative is skipped. A null index array (0) means "the identity".
extern "C" __global__ void ep_copy_rows(unsigned char* dst,
                                        const unsigned char* src,
                                        const int* __restrict__ dst_index,
                                        const int* __restrict__ src_index,
                                        int rows_a,
                                        int rows_b,
                                        int src_div,
                                        int hidden) {
    const int nvec = hidden / 8;
    const size_t row_bytes = (size_t)hidden * 2;
    const int lane = threadIdx.x & 31;
    const WarpItems it = warp_items((long long)rows_a * rows_b, nvec);
    for (long long item = it.first; item < it.count; item += it.stride) {
        const long long i = item / it.chunks;
        const int chunk = (int)(item - i * it.chunks);
        const long long d = dst_index ? (long long)dst_index[i] : i;
        const long long s = src_index ? (long long)src_index[i] : i / src_div;
        if (d < 0 || s < 0) {
            continue;
        }
        copy_chunk((uint4*)(dst + (size_t)d * row_bytes), (const uint4*)(src + (size_t)s * row_bytes), nvec,
                   chunk, lane);
    }
}

// peer_copy (the GPU-to-GPU copy ceiling): the bytes of a dispatch (tokens * topk rows), but
// contiguous. With rows_per_peer = tokens * topk / G, source row i < G * rows_per_peer goes to member
// g = i % G, at row me * rows_per_peer + i / G of its `dst` buffer ([G][rows_per_peer][hidden] bf16).
extern "C" __global__ void ep_peer_copy(const uint4* __restrict__ src,
                                        unsigned char* const* dst_peers,
                                        int tokens,
                                        int topk,
                                        int hidden,
                                        int G,
                                        int me) {
    const long long rows_per_peer = (long long)tokens * topk / G;
    const int nvec = hidden / 8;
    const size_t row_bytes = (size_t)hidden * 2;
    const int lane = threadIdx.x & 31;
    const WarpItems it = warp_items((long long)G * rows_per_peer, nvec);
    for (long long item = it.first; item < it.count; item += it.stride) {
        const long long i = item / it.chunks;
        const int chunk = (int)(item - i * it.chunks);
        // rows interleave over the members, so every NVLink carries traffic at every moment (as in a
        // dispatch); blocks of rows per member would drive one link at a time
        const long long g = i % G;
        const long long j = i / G;
        uint4* dst = (uint4*)(dst_peers[g] + ((size_t)me * rows_per_peer + j) * row_bytes);
        copy_chunk(dst, src + (size_t)i * nvec, nvec, chunk, lane);
    }
    publish(lane);
}
