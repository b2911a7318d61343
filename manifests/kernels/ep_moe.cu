// ep_moe: the data-movement and routing kernels of the expert-parallel MoE layer (manifests/ep_moe.json).
//
// The layer, per rank, all on the device (no host round trip; every launch is graph-capturable):
//   dispatch    each token goes once to every rank that owns one of its top-k experts (row `t` of that
//               rank's receive buffer block `me`), and its routing (expert ids and weights, packed) goes
//               to every rank; barrier
//   layout      the receiver computes, from the routing of every source, where each (token, local
//               expert) pair lands: counts per chunk of routing words, a prefix over chunks, positions in
//               global token order (source rank, then token), and per expert slot the received row it
//               holds (slot_src); pairs beyond an expert's capacity are dropped and counted in err (never
//               silently)
//   experts     GEMMs per local expert over the rows the layout counted, reading the received rows in
//               place through slot_src (ep_gemm.cu's ep_masked_gemm_gather); the cuBLAS baseline instead
//               runs the fanout (received rows copied into the expert slab [local expert][cap][hidden])
//               and a GEMM per expert over all cap rows of it
//   combine     for every received token and every reduction group held here, the weighted sum of its
//               expert outputs in that group (top-k slot order, float32, one bf16 rounding) goes back
//               as one row to the origin: comb[group][token]; barrier
//   reduce      the origin sums its groups' rows in ascending group order (ep_math.cu)
// A reduction group is experts / groups consecutive experts; EP-N runs with groups = N (one group per
// rank) and EP1 with the same groups on one rank, so both compute the same float operations in the same
// order and their outputs match byte for byte.
//
// Rows are `hidden` bf16 values (2 * hidden bytes, a multiple of 16: the host checks hidden % 8 == 0)
// moved as 16-byte vectors. The unit of row work is a warp item: one CHUNK_VECS-vector chunk (2 KiB) of
// one row; each lane first loads its ROW_UNROLL vectors of the chunk, then stores them. Items are walked
// with a grid-stride loop, so any grid works (the bench sizes it to an SM budget) and nothing depends on
// which blocks are co-resident; only the layout synchronises the threads of a block. blockDim.x must be a
// multiple of 32; the row kernels are declared for at most 512 threads (__launch_bounds__), so a launch of
// `blocks` blocks occupies at most `blocks` SMs: the bench's SM budget.
//
// Packed routing word (u32): bits 0..15 the global expert id (0xFFFF: none, e.g. an id out of range),
// bits 16..31 the bf16 routing weight.
//
// Kernels that write peer memory end with publish(): the warp's stores are performed at system scope
// before it exits (one fence per warp, after __syncwarp orders the lanes' stores before lane 0's fence).
// The peer barrier that follows (release/acquire at system scope) then publishes them to every member.

typedef unsigned long long u64;

#define ROW_UNROLL 4
#define CHUNK_VECS (32 * ROW_UNROLL)
// combine_rows issues the loads of the next COMBINE_BATCH matching expert rows of an item at once, then adds them in
// top-k order. 3 measured faster than two rows sliding (combine_ll 18.9 -> 18.6 µs at EP2, 128 tokens/rank) and
// than 4, which spills at 512 threads (bench/results/h200x2/ep_moe_combine_batch.json)
#ifndef COMBINE_BATCH
#define COMBINE_BATCH 3
#endif
// LL_PHASES 1: the low-latency kernels' diagnosis build (per-phase stamps, see ep_dispatch_ll); 0: production
#ifndef LL_PHASES
#define LL_PHASES 0
#endif
#if COMBINE_BATCH < 1
#error "COMBINE_BATCH: expert rows whose loads are issued at once, at least 1"
#endif

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


// The bf16 recipe of ep_math.cu (round to nearest even, every NaN -> 0x7FC0), repeated here because
// each kernel file compiles alone.
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

#define NO_EXPERT 0xFFFFu

// Does the token whose `topk` packed routing words start at `m` have an expert in [lo, hi)?
__device__ __forceinline__ bool hits(const unsigned int* m, int topk, unsigned int lo, unsigned int hi) {
    for (int kk = 0; kk < topk; ++kk) {
        const unsigned int e = m[kk] & 0xFFFFu;
        if (e != NO_EXPERT && e >= lo && e < hi) {
            return true;
        }
    }
    return false;
}

// The routing words (u32[tokens * topk]: weight bits << 16 | expert, NO_EXPERT for an id out of range,
// counted in err[0..1] once) to every member g: into send_meta block g on the NCCL path (send_meta not 0),
// else into block `me` of member g's meta. Grid-stride over every (member, word).
__device__ __forceinline__ void send_routing(const int* __restrict__ topk_idx,
                                             const unsigned short* __restrict__ topk_w,
                                             unsigned int* const* meta_peers,
                                             unsigned int* send_meta,
                                             unsigned int* err,
                                             int tokens,
                                             int topk,
                                             int experts,
                                             int G,
                                             int me) {
    const long long words = (long long)tokens * topk;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    for (long long i = tid; i < words * G; i += nthreads) {
        const long long g = i / words;
        const long long j = i - g * words;
        const int e = topk_idx[j];
        const bool bad = e < 0 || e >= experts;
        if (bad && g == 0) {
            atomicOr(&err[0], 1u);
            atomicAdd(&err[1], 1u);
        }
        const unsigned int word = ((unsigned int)topk_w[j] << 16) | (bad ? NO_EXPERT : (unsigned int)e);
        if (send_meta) {
            send_meta[g * words + j] = word;
        } else {
            meta_peers[g][(long long)me * words + j] = word;
        }
    }
}

// Whether token t picked one of member g's experts [g * local, (g + 1) * local): it is sent there once.
__device__ __forceinline__ bool token_goes_to(const int* __restrict__ topk_idx, long long t, int topk, int g,
                                              int local) {
    bool hit = false;
    for (int kk = 0; kk < topk; ++kk) {
        const int e = topk_idx[t * topk + kk];
        hit = hit || (e >= g * local && e < (g + 1) * local);
    }
    return hit;
}

// dispatch: this rank's routing goes to every member, and each token once to every member that owns one
// of its experts (members own experts / G consecutive experts each).
//
//   x          [tokens][hidden] bf16            this rank's tokens
//   topk_idx   [tokens][topk] i32               global expert ids from the router
//   topk_w     [tokens][topk] bf16              routing weights
//   recv_peers u64[G]: member g's receive rows [G][tokens][hidden] bf16; this rank writes block `me`
//   meta_peers u64[G]: member g's routing words [G][tokens][topk] u32; this rank writes block `me`
//   send, send_meta  0 on the peer path; on the NCCL path the local send buffers [G][tokens][hidden]
//              and [G][tokens][topk] (block g goes to member g), used instead of the peer tables
//   err        u32[4] local: err[0] |= 1 and err[1] += 1 per routing entry whose expert is out of range
//              (it is sent as NO_EXPERT and reaches no expert)
__device__ __forceinline__ void dispatch_rows(const uint4* __restrict__ x,
                                              const int* __restrict__ topk_idx,
                                              const unsigned short* __restrict__ topk_w,
                                              unsigned char* const* recv_peers,
                                              unsigned int* const* meta_peers,
                                              unsigned char* send,
                                              unsigned int* send_meta,
                                              unsigned int* err,
                                              int tokens,
                                              int topk,
                                              int hidden,
                                              int experts,
                                              int G,
                                              int me) {
    const int nvec = hidden / 8;
    const size_t row_bytes = (size_t)hidden * 2;
    send_routing(topk_idx, topk_w, meta_peers, send_meta, err, tokens, topk, experts, G, me);
    const int local = experts / G;
    const int lane = threadIdx.x & 31;
    // items: (token, member, chunk) with the member fastest, so every link carries traffic at once
    const WarpItems it = warp_items((long long)tokens * G, nvec);
    for (long long item = it.first; item < it.count; item += it.stride) {
        const long long r = item / it.chunks;
        const int chunk = (int)(item - r * it.chunks);
        const long long t = r / G;
        const int g = (int)(r - t * G);
        if (!token_goes_to(topk_idx, t, topk, g, local)) {
            continue;
        }
        unsigned char* dst = send ? send + ((size_t)g * tokens + t) * row_bytes
                                  : recv_peers[g] + ((size_t)me * tokens + t) * row_bytes;
        copy_chunk((uint4*)dst, x + (size_t)t * nvec, nvec, chunk, lane);
    }
}

extern "C" __global__ void __launch_bounds__(512) ep_dispatch(const uint4* __restrict__ x,
                                       const int* __restrict__ topk_idx,
                                       const unsigned short* __restrict__ topk_w,
                                       unsigned char* const* recv_peers,
                                       unsigned int* const* meta_peers,
                                       unsigned char* send,
                                       unsigned int* send_meta,
                                       unsigned int* err,
                                       int tokens,
                                       int topk,
                                       int hidden,
                                       int experts,
                                       int G,
                                       int me) {
    dispatch_rows(x, topk_idx, topk_w, recv_peers, meta_peers, send, send_meta, err, tokens, topk, hidden, experts,
                  G, me);
    publish(threadIdx.x & 31);
}

// layout: where every pair of this rank's experts lands, from the routing words of every source, in two
// launches over chunks of LAYOUT_CHUNK consecutive words (chunk c: words c * LAYOUT_CHUNK ..; each block
// walks chunks blockIdx.x, blockIdx.x + gridDim.x, ..., so any grid works; the manifest gives one block
// per chunk). Both read the words coalesced, once (the old one-block-per-expert walk read every word once
// per expert: 103 us at 4096 tokens).
//   ep_layout_count  hist[c][el] = pairs of local expert el in chunk c (shared-memory atomics)
//   ep_layout_place  base[el] = sum of hist[c'][el] over c' < c (the pairs of el in earlier chunks), then
//                    the chunk in rounds of blockDim words, one per thread: lanes with the same expert
//                    find each other (__match_any_sync), the lowest of them takes popc(peers) positions
//                    from base[el], warp by warp in order (one __syncthreads per warp turn), and each lane
//                    adds its rank among the lower lanes. So pairs are numbered in global order (source,
//                    token, top-k slot), the order EP1 numbers them in. The block of the last chunk also
//                    writes expert_rows and the drop report (it sees every chunk's counts).
//   meta         [G * tokens][topk] u32   routing words of the receive block
//   hist         [chunks][experts / G] i32, chunks = ceil(G * tokens * topk / LAYOUT_CHUNK)
//   route_row    [G * tokens][topk] i32   el * cap + position for a pair of local expert el at position
//                                         < cap; -1 for another rank's expert, NO_EXPERT, or a dropped pair
//   slot_src     [experts / G][cap] i32   the inverse: for the slot el * cap + position of every pair kept,
//                                         the received row (source * tokens + token) it holds; slots at or
//                                         beyond expert_rows[el] are left as they were (never read)
//   expert_rows  [experts / G] i32        min(pairs, cap)
//   err          u32[4] local: pairs beyond cap are dropped: err[0] |= 2, err[2] += dropped; more than
//                LAYOUT_MAX_LOCAL experts per rank (the host refuses it): err[0] |= 8 and nothing is laid out
// blockDim.x: a multiple of 32, at most LAYOUT_THREADS (every thread of a block runs the same loop trips,
// so each __syncthreads is reached by all of them).
#define LAYOUT_THREADS 256
#define LAYOUT_CHUNK 1024
#define LAYOUT_MAX_LOCAL 4096

extern "C" __global__ void __launch_bounds__(LAYOUT_THREADS) ep_layout_count(const unsigned int* __restrict__ meta,
                                                                            int* __restrict__ hist,
                                                                            int tokens,
                                                                            int topk,
                                                                            int experts,
                                                                            int G,
                                                                            int me) {
    __shared__ int counts[LAYOUT_MAX_LOCAL];
    const int local = experts / G;
    if (local > LAYOUT_MAX_LOCAL) {
        return;  // the same test in every thread: ep_layout_place reports it
    }
    const unsigned int lo = (unsigned int)(me * local);
    const unsigned int hi = lo + (unsigned int)local;
    const long long words = (long long)G * tokens * topk;
    const long long chunks = (words + LAYOUT_CHUNK - 1) / LAYOUT_CHUNK;
    const int tid = threadIdx.x;
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        for (int el = tid; el < local; el += blockDim.x) {
            counts[el] = 0;
        }
        __syncthreads();
        const long long first = c * LAYOUT_CHUNK;
        const long long last = first + LAYOUT_CHUNK < words ? first + LAYOUT_CHUNK : words;
        for (long long w = first + tid; w < last; w += blockDim.x) {
            const unsigned int e = meta[w] & 0xFFFFu;
            if (e >= lo && e < hi) {
                atomicAdd(&counts[e - lo], 1);
            }
        }
        __syncthreads();
        for (int el = tid; el < local; el += blockDim.x) {
            hist[c * local + el] = counts[el];
        }
        __syncthreads();  // counts is zeroed for the next chunk
    }
}

extern "C" __global__ void __launch_bounds__(LAYOUT_THREADS) ep_layout_place(const unsigned int* __restrict__ meta,
                                                                            const int* __restrict__ hist,
                                                                            int* __restrict__ route_row,
                                                                            int* __restrict__ slot_src,
                                                                            int* __restrict__ expert_rows,
                                                                            unsigned int* err,
                                                                            int tokens,
                                                                            int topk,
                                                                            int experts,
                                                                            int G,
                                                                            int me,
                                                                            int cap) {
    __shared__ int base[LAYOUT_MAX_LOCAL];
    const int local = experts / G;
    if (local > LAYOUT_MAX_LOCAL) {
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            atomicOr(&err[0], 8u);
        }
        return;
    }
    const unsigned int lo = (unsigned int)(me * local);
    const unsigned int hi = lo + (unsigned int)local;
    const long long words = (long long)G * tokens * topk;
    const long long chunks = (words + LAYOUT_CHUNK - 1) / LAYOUT_CHUNK;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int warps = blockDim.x >> 5;
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        for (int el = tid; el < local; el += blockDim.x) {
            int sum = 0;
#pragma unroll 8
            for (long long b = 0; b < c; ++b) {
                sum += hist[b * local + el];
            }
            base[el] = sum;
            if (c == chunks - 1) {
                const int total = sum + hist[c * local + el];
                expert_rows[el] = total < cap ? total : cap;
                if (total > cap) {
                    atomicOr(&err[0], 2u);
                    atomicAdd(&err[2], (unsigned int)(total - cap));
                }
            }
        }
        __syncthreads();
        const long long first = c * LAYOUT_CHUNK;
        const long long last = first + LAYOUT_CHUNK < words ? first + LAYOUT_CHUNK : words;
        for (long long r0 = first; r0 < last; r0 += blockDim.x) {
            const long long w = r0 + tid;
            const bool valid = w < last;
            const unsigned int e = valid ? meta[w] & 0xFFFFu : 0xFFFFFFFFu;  // past the end: no word's key
            const bool mine = e >= lo && e < hi;
            const unsigned int peers = __match_any_sync(0xFFFFFFFFu, e);
            const int leader = __ffs(peers) - 1;
            int first_pos = 0;
            for (int turn = 0; turn < warps; ++turn) {
                if (turn == warp && mine && lane == leader) {
                    first_pos = base[e - lo];
                    base[e - lo] = first_pos + __popc(peers);
                }
                __syncthreads();
            }
            first_pos = __shfl_sync(0xFFFFFFFFu, first_pos, leader);
            if (valid) {
                const int pos = first_pos + __popc(peers & ((1u << lane) - 1u));
                const bool kept = mine && pos < cap;
                route_row[w] = kept ? (int)(e - lo) * cap + pos : -1;
                if (kept) {
                    slot_src[(int)(e - lo) * cap + pos] = (int)(w / topk);
                }
            }
        }
        __syncthreads();  // base is rewritten for the next chunk
    }
}

// fanout: every received row goes to the slab rows of its local experts (a local copy): only for the
// cuBLAS baseline's dense per-expert GEMMs; the masked GEMMs read recv in place through slot_src.
//   recv       [G * tokens][hidden] bf16      received rows (global token order)
//   route_row  [G * tokens][topk] i32         from the layout
//   slab       [local * cap][hidden] bf16
extern "C" __global__ void __launch_bounds__(512) ep_fanout(const uint4* __restrict__ recv,
                                     const int* __restrict__ route_row,
                                     unsigned char* slab,
                                     int tokens,
                                     int topk,
                                     int hidden,
                                     int G) {
    const int nvec = hidden / 8;
    const size_t row_bytes = (size_t)hidden * 2;
    const int lane = threadIdx.x & 31;
    const WarpItems it = warp_items((long long)G * tokens * topk, nvec);
    for (long long item = it.first; item < it.count; item += it.stride) {
        const long long w = item / it.chunks;
        const int chunk = (int)(item - w * it.chunks);
        const int row = route_row[w];
        if (row < 0) {
            continue;
        }
        copy_chunk((uint4*)(slab + (size_t)row * row_bytes), recv + (size_t)(w / topk) * nvec, nvec, chunk, lane);
    }
}

// combine: for every received token u = (s, t) and every reduction group q held here that the token
// uses, one row to its origin s:
//   comb_s[q][t] = bf16( sum over kk = 0..topk-1 in that order, for entries of group q with a slab row,
//                        of w[kk] * y[row] )     (float32 accumulator from 0, each product exact)
// Groups: experts / groups consecutive experts each; this rank holds groups q0 .. q0 + groups / G - 1,
// q0 = me * groups / G. A group whose pairs were all dropped sends +0.
//
//   y          [local * cap][hidden] bf16     expert outputs
//   meta       [G * tokens][topk] u32         routing words of the receive block
//   route_row  [G * tokens][topk] i32
//   comb_peers u64[G]: member s's combine rows [groups][tokens][hidden] bf16
//   send       0 on the peer path; on the NCCL path the local buffer [G][groups / G][tokens][hidden]
//              (block s goes to member s)
__device__ __forceinline__ void combine_rows(const uint4* __restrict__ y,
                                             const unsigned int* meta,
                                             const int* route_row,
                                             unsigned char* const* comb_peers,
                                             unsigned char* send,
                                             int tokens,
                                             int topk,
                                             int hidden,
                                             int experts,
                                             int G,
                                             int me,
                                             int groups,
                                             bool zero_misses) {
    const int nvec = hidden / 8;
    const size_t row_bytes = (size_t)hidden * 2;
    const int mine = groups / G;
    const int per_group = experts / groups;
    const int lane = threadIdx.x & 31;
    // items: (token, group held here, chunk)
    const WarpItems it = warp_items((long long)G * tokens * mine, nvec);
    for (long long item = it.first; item < it.count; item += it.stride) {
        const long long r = item / it.chunks;
        const int chunk = (int)(item - r * it.chunks);
        const long long u = r / mine;
        const int qi = (int)(r - u * mine);
        const int q = me * mine + qi;
        const unsigned int* m = meta + u * topk;
        if (!hits(m, topk, (unsigned int)(q * per_group), (unsigned int)((q + 1) * per_group))) {
            if (zero_misses) {  // the token uses no expert of group q: its row of q is +0 (see combine_ll)
                const long long s = u / tokens;
                uint4* dst = (uint4*)(comb_peers[s] + ((size_t)q * tokens + (u - s * tokens)) * row_bytes);
                const int base = chunk * CHUNK_VECS + lane;
#pragma unroll
                for (int v = 0; v < ROW_UNROLL; ++v) {
                    if (base + v * 32 < nvec) {
                        dst[base + v * 32] = make_uint4(0u, 0u, 0u, 0u);
                    }
                }
            }
            continue;
        }
        float acc[ROW_UNROLL][8];
#pragma unroll
        for (int v = 0; v < ROW_UNROLL; ++v) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                acc[v][j] = 0.0f;
            }
        }
        const int base = chunk * CHUNK_VECS + lane;
        // The expert rows this item sums, in top-k order, COMBINE_BATCH at a time: the next COMBINE_BATCH matching
        // rows are found first, all their loads issued, then added in top-k order (the bytes of one row at a time).
        int kk = 0;
        for (;;) {
            const uint4* src[COMBINE_BATCH];
            float w[COMBINE_BATCH];
            int found = 0;
#pragma unroll
            for (int d = 0; d < COMBINE_BATCH; ++d) {
                src[d] = 0;
                w[d] = 0.0f;
                for (; kk < topk; ++kk) {
                    const unsigned int e = m[kk] & 0xFFFFu;
                    const int row = route_row[u * topk + kk];
                    if (e != NO_EXPERT && (int)e / per_group == q && row >= 0) {
                        src[d] = y + (size_t)row * nvec;
                        w[d] = bf16_to_f32(m[kk] >> 16);
                        ++found;
                        ++kk;
                        break;
                    }
                }
            }
            if (found == 0) {
                break;
            }
            uint4 buf[COMBINE_BATCH][ROW_UNROLL];
#pragma unroll
            for (int d = 0; d < COMBINE_BATCH; ++d) {
#pragma unroll
                for (int v = 0; v < ROW_UNROLL; ++v) {
                    if (src[d] != 0 && base + v * 32 < nvec) {
                        buf[d][v] = src[d][base + v * 32];
                    }
                }
            }
#pragma unroll
            for (int d = 0; d < COMBINE_BATCH; ++d) {
                if (src[d] == 0) {
                    continue;
                }
#pragma unroll
                for (int v = 0; v < ROW_UNROLL; ++v) {
                    if (base + v * 32 < nvec) {
                        const unsigned int wd[4] = {buf[d][v].x, buf[d][v].y, buf[d][v].z, buf[d][v].w};
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            acc[v][2 * j] = __fadd_rn(acc[v][2 * j], __fmul_rn(w[d], bf16_to_f32(wd[j] & 0xFFFFu)));
                            acc[v][2 * j + 1] =
                                __fadd_rn(acc[v][2 * j + 1], __fmul_rn(w[d], bf16_to_f32(wd[j] >> 16)));
                        }
                    }
                }
            }
            if (found < COMBINE_BATCH) {
                break;
            }
        }
        const long long s = u / tokens;
        const long long t = u - s * tokens;
        uint4* dst = (uint4*)(send ? send + (((size_t)s * mine + qi) * tokens + t) * row_bytes
                                   : comb_peers[s] + ((size_t)q * tokens + t) * row_bytes);
#pragma unroll
        for (int v = 0; v < ROW_UNROLL; ++v) {
            const int i = base + v * 32;
            if (i < nvec) {
                uint4 o;
                o.x = f32_to_bf16(acc[v][0]) | (f32_to_bf16(acc[v][1]) << 16);
                o.y = f32_to_bf16(acc[v][2]) | (f32_to_bf16(acc[v][3]) << 16);
                o.z = f32_to_bf16(acc[v][4]) | (f32_to_bf16(acc[v][5]) << 16);
                o.w = f32_to_bf16(acc[v][6]) | (f32_to_bf16(acc[v][7]) << 16);
                dst[i] = o;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(512) ep_combine(const uint4* __restrict__ y,
                                      const unsigned int* __restrict__ meta,
                                      const int* __restrict__ route_row,
                                      unsigned char* const* comb_peers,
                                      unsigned char* send,
                                      int tokens,
                                      int topk,
                                      int hidden,
                                      int experts,
                                      int G,
                                      int me,
                                      int groups) {
    combine_rows(y, meta, route_row, comb_peers, send, tokens, topk, hidden, experts, G, me, groups, false);
    publish(threadIdx.x & 31);
}

// peer_copy (the NVLink ceiling): every rank writes `rows` rows to each other member at once, the
// shape of a dispatch that sends every token to every other rank. Row i of src goes to member
// g = (me + 1 + i % (G - 1)) % G, at row me * rows + i / (G - 1) of its dst [G][rows][hidden] bf16;
// src holds rows * (G - 1) rows. Nothing is written to this rank's own buffer. G >= 2.
extern "C" __global__ void __launch_bounds__(512) ep_peer_copy(const uint4* __restrict__ src,
                                        unsigned char* const* dst_peers,
                                        int rows,
                                        int hidden,
                                        int G,
                                        int me) {
    const int nvec = hidden / 8;
    const size_t row_bytes = (size_t)hidden * 2;
    const int lane = threadIdx.x & 31;
    const int others = G - 1;
    const WarpItems it = warp_items((long long)rows * others, nvec);
    for (long long item = it.first; item < it.count; item += it.stride) {
        const long long i = item / it.chunks;
        const int chunk = (int)(item - i * it.chunks);
        // rows interleave over the members, so every link carries traffic at every moment
        const long long g = (me + 1 + i % others) % G;
        const long long j = i / others;
        uint4* dst = (uint4*)(dst_peers[g] + ((size_t)me * rows + j) * row_bytes);
        copy_chunk(dst, src + (size_t)i * nvec, nvec, chunk, lane);
    }
    publish(lane);
}

// ---------------------------------------------------------------------------------------------------------
// Low-latency mode: one kernel per direction (small batches). ep_dispatch_ll is dispatch + layout (+ fanout),
// ep_combine_ll is combine + reduce, with device-side flags where the standard path has kernel boundaries
// and peer barriers. They write the same bytes as the standard kernels (the same device functions, the
// same layout order, the same reduction order), so outputs stay byte-identical to EP1.
//
// Synchronisation, and why it cannot deadlock or reuse a stale flag:
// - Grid barrier (grid_sync): each block's thread 0 adds 1 to a local u32 counter, block 0 adds
//   0x80000000 - (gridDim.x - 1), so every barrier adds exactly 2^31: the top bit flips once all blocks
//   arrived, whatever the grid, with no reset between barriers or launches. __threadfence before the add
//   and after the wait (with __syncthreads around) orders the blocks' writes before what follows. It
//   needs every block resident at once: the launch uses at most one block per SM (grid = the SM budget,
//   at most the GPU's SM count, the bench checks it) and __launch_bounds__(512) with 512 threads, one
//   block fits an otherwise idle SM (small static shared memory); nothing runs beside it on the GPU. Past
//   LL_TIMEOUT_NS it gives up and reports err[0] |= 16 instead of hanging.
// - Peer flags: ll_flags (u64[2][G], mapped into every member) holds in [0][s] / [1][s] the last
//   dispatch / combine epoch member s announced to this rank. Epochs come from ll_state (u64[2], local;
//   [0] dispatch, [1] combine), read by every block at entry and advanced by block 0 after the first grid
//   barrier (every block read it before arriving): K launches in a captured graph get K fresh epochs, no
//   host reset (buffers start zeroed; ranks run the same programs, so the counters advance in lockstep).
//   Flags only grow, so `>= epoch` is never met by an older announcement.
// - Release: every warp fences its peer stores at system scope (publish) before its block arrives at the
//   grid barrier; then block 0's thread t < G runs fence.acq_rel.sys and stores the epoch into member
//   t's flag (st.relaxed.sys): fence + store in one thread is a release, cumulative over the blocks'
//   fenced stores it observed through the barrier.
// - Acquire: in every block thread t < G polls its own flag from member t (relaxed), then one
//   ld.acquire.sys pairs with that member's release; __syncthreads hands the acquired view to the block.
//   Past LL_TIMEOUT_NS: err[0] |= 4, err[3] |= 1 << (t % 32) (the member that never announced), and
//   the kernel goes on (its output is then wrong, and the err check says so) instead of hanging.
// - Reuse of the receive buffers across launches: a member writes this rank's recv/meta for launch e + 1
//   only after its own combine of launch e got every member's combine rows, which each member sends only
//   after its dispatch and its expert GEMMs (which read recv in place) of launch e ended (stream order);
//   comb likewise. (Timing one direction alone
//   back to back overlaps a launch's writes with the previous launch's reads of the same bytes; the
//   bytes are equal, and the outputs are checked on whole layers.)
// Buffers written by peers during the kernel (meta, recv, comb) are read through plain pointers (no
// __restrict__/const: no non-coherent cache loads), only after the acquire.
// blockDim.x: a multiple of 32, at least G, at most 512.
#define LL_TIMEOUT_NS 10000000000ull
// routing words one thread of dispatch_ll's layout reads in a round (loads issued together; a round of 512 threads
// covers 4096 words: EP2 / EP4 at 128 tokens of top-8 in one)
#define LL_LAYOUT_WORDS 8
#define LL_FULL 0xFFFFFFFFu

__device__ __forceinline__ void st_relaxed_sys(unsigned long long* addr, unsigned long long value) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ unsigned long long ld_relaxed_sys(const unsigned long long* addr) {
    unsigned long long value;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
    return value;
}

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* addr) {
    unsigned long long value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
    return value;
}

__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// Every block of the grid arrives before any block leaves (see above). Called by every thread.
__device__ __forceinline__ void grid_sync(unsigned int* counter, unsigned int* err) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1u) : 1u;
        __threadfence();
        const unsigned int old = atomicAdd(counter, add);
        if (((old ^ *(volatile unsigned int*)counter) & 0x80000000u) == 0u) {
            const unsigned long long start = globaltimer_ns();
            while (((old ^ *(volatile unsigned int*)counter) & 0x80000000u) == 0u) {
                if (globaltimer_ns() - start > LL_TIMEOUT_NS) {
                    atomicOr(&err[0], 16u);
                    break;
                }
            }
        }
        __threadfence();
    }
    __syncthreads();
}

// Block 0, after the grid barrier: announce `epoch` to every member t (its flags[slot + me]).
__device__ __forceinline__ void announce(unsigned long long* const* flag_peers, int slot, unsigned long long epoch,
                                         int G, int me) {
    if (blockIdx.x == 0 && (int)threadIdx.x < G) {
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        st_relaxed_sys(flag_peers[threadIdx.x] + slot + me, epoch);
    }
}

// Every block: wait until every member t announced `epoch` or later in flags[t]. Called by every thread.
__device__ __forceinline__ void wait_members(const unsigned long long* flags, unsigned long long epoch, int G,
                                             unsigned int* err) {
    const int t = threadIdx.x;
    if (t < G) {
        const unsigned long long* flag = flags + t;
        if (ld_relaxed_sys(flag) < epoch) {
            const unsigned long long start = globaltimer_ns();
            while (ld_relaxed_sys(flag) < epoch) {
                if (globaltimer_ns() - start > LL_TIMEOUT_NS) {
                    atomicOr(&err[0], 4u);
                    atomicOr(&err[3], 1u << (t & 31));
                    break;
                }
            }
        }
        (void)ld_acquire_sys(flag);  // pairs with member t's release: its stores to this rank are visible
    }
    __syncthreads();
}

#if LL_PHASES
// Diagnosis build of the two kernels (manifest kernels ep_dispatch_ll_phases / ep_combine_ll_phases, compiled
// with -DLL_PHASES=1; the production build, LL_PHASES 0, has none of this). Thread 0 of each block stamps the
// boundaries of the kernel's phases (in shared memory) and, at the end, writes one record of LL_PHASE_WORDS u64 to
//   phases[((epoch % phase_launches) * 2 + kernel) * phase_blocks + block]   (kernel 0 dispatch, 1 combine)
// words 0 .. LL_STAMPS-1: %globaltimer (ns) at each boundary; LL_STAMPS .. 2 LL_STAMPS-1: clock64() (SM
// cycles) at the same boundaries; 14: the SM id; 15: the launch's epoch (from ll_state: each launch of a run
// of back-to-back launches lands in its own slot, and the epoch says which launch a record is). Unused
// stamps are 0. Boundaries (stamp i):
//   dispatch: 0 entry, 1 rows and routing sent (every warp of the block past publish), 2 grid barrier passed,
//             3 announced (block 0 stored the epoch into every member's flag; other blocks: nothing to do),
//             4 members waited (the acquire done), 5 layout done (every thread), 6 fanout done (with a slab)
//   combine:  0 entry, 1 rows combined and sent, 2 grid barrier passed, 3 announced, 4 members waited,
//             5 reduce done
// Which stamp to trust for what: clock64 counts the SM's cycles exactly but only within one SM (each SM has
// its own counter): per-block phase durations come from its deltas, converted with the SM clock measured in
// the same run (ep_ll_clock). %globaltimer is one clock for the whole GPU, so it orders blocks against each
// other (the kernel's span: the last block's boundary minus the first block's entry), but it updates at a
// coarse granularity on some GPUs (up to 1 us): trust its differences to about that, never for a sub-µs
// phase of one block. Blocks beyond phase_blocks are not recorded (the host sizes phase_blocks >= grid).
// The stamps add two __syncthreads per kernel (after the sends, before the end) so that a block's boundary
// is its last warp's, and one record store per block at the end: the diagnosis build's own timing is
// reported beside the production figure, so what the instrument costs is seen.
#define LL_STAMPS 7
#define LL_PHASE_WORDS 16

struct LlStamps {
    unsigned long long ns[LL_STAMPS];
    long long cycles[LL_STAMPS];
};

__device__ __forceinline__ void ll_stamp(LlStamps& s, int i) {
    if (threadIdx.x == 0) {
        s.cycles[i] = clock64();
        s.ns[i] = globaltimer_ns();
    }
}

__device__ __forceinline__ unsigned int ll_smid() {
    unsigned int id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

// Thread 0: the block's record (see above); stamps `used` .. LL_STAMPS-1 are written as 0.
__device__ __forceinline__ void ll_record(unsigned long long* phases, int kernel, unsigned long long epoch,
                                          int phase_launches, int phase_blocks, const LlStamps& s, int used) {
    if (threadIdx.x != 0 || phases == 0 || phase_launches < 1 || (int)blockIdx.x >= phase_blocks) {
        return;
    }
    const unsigned long long slot = epoch % (unsigned long long)phase_launches;
    unsigned long long* r = phases + ((slot * 2ull + (unsigned long long)kernel) * (unsigned long long)phase_blocks +
                                      blockIdx.x) * LL_PHASE_WORDS;
    for (int i = 0; i < LL_STAMPS; ++i) {
        r[i] = i < used ? s.ns[i] : 0ull;
        r[LL_STAMPS + i] = i < used ? (unsigned long long)s.cycles[i] : 0ull;
    }
    r[2 * LL_STAMPS] = ll_smid();
    r[2 * LL_STAMPS + 1] = epoch;
}

// The SM clock against %globaltimer, to convert the records' cycles: one thread spins from a globaltimer tick to
// the first tick at least spin_ns later and writes out[0..3] = {ns0, cycles0, ns1, cycles1}. Both ends are taken
// at a tick (the first read after the value changed), so the coarse update granularity costs only a read's few
// ns: over 1 ms, well under 0.1 % at 1 us granularity.
extern "C" __global__ void ep_ll_clock(unsigned long long* out, unsigned long long spin_ns) {
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    const unsigned long long first = globaltimer_ns();
    unsigned long long ns0, ns1;
    long long c0, c1;
    do {
        c0 = clock64();
        ns0 = globaltimer_ns();
    } while (ns0 == first);
    do {
        c1 = clock64();
        ns1 = globaltimer_ns();
    } while (ns1 - ns0 < spin_ns);
    out[0] = ns0;
    out[1] = (unsigned long long)c0;
    out[2] = ns1;
    out[3] = (unsigned long long)c1;
}
#endif

// The kernels' hooks for the diagnosis build, empty in production: its extra arguments, thread 0's stamps in shared
// memory (no registers held across the phases) with the entry stamp, a stamp by thread 0, and a stamp once every
// warp of the block is past the point (a block barrier first).
#if LL_PHASES
#define LL_PHASE_PARAMS , unsigned long long* phases, int phase_blocks, int phase_launches
#define LL_PHASES_BEGIN   \
    __shared__ LlStamps stamps; \
    ll_stamp(stamps, 0)
#define LL_STAMP(i) ll_stamp(stamps, (i))
#define LL_STAMP_BLOCK(i) \
    do {                  \
        __syncthreads();  \
        ll_stamp(stamps, (i)); \
    } while (0)
#else
#define LL_PHASE_PARAMS
#define LL_PHASES_BEGIN ((void)0)
#define LL_STAMP(i) ((void)0)
#define LL_STAMP_BLOCK(i) ((void)0)
#endif

// dispatch_ll: ep_dispatch, then (after every member's rows and routing arrived) the layout of ep_layout_*
// (route_row, slot_src, expert_rows, err), and with a slab (the cuBLAS baseline) the fanout of ep_fanout,
// in one kernel. Arguments as those kernels', plus
//   flag_peers  u64[G]: member g's ll_flags;  flags: this rank's ll_flags (u64[2 * G])
//   state       u64[2] local (ll_state);       grid_counter: u32 local (ll_grid[0])
//   meta, recv  this rank's receive buffers (what meta_peers / recv_peers map at index me)
//   slab        null: no fanout (the masked GEMMs gather through slot_src), and the kernel ends after the
//               layout (one grid barrier); else the fanout follows a second grid barrier
// Layout: block b lays out local experts b, b + gridDim.x, ...: it walks the G * tokens * topk words in
// rounds of blockDim.x * LL_LAYOUT_WORDS (LL_LAYOUT_WORDS consecutive words a thread, loaded at once), and
// numbers its expert's pairs by a block-wide prefix of the threads' counts (a warp scan, then the warps'
// totals), round after round: global order (source, token, top-k slot), as ep_layout_place.
// Every block also writes -1 for the words of other ranks' experts (a grid-stride share). A grid barrier
// then makes route_row whole before the fanout reads it.
extern "C" __global__ void __launch_bounds__(512) ep_dispatch_ll(const uint4* __restrict__ x,
                                                                const int* __restrict__ topk_idx,
                                                                const unsigned short* __restrict__ topk_w,
                                                                unsigned char* const* recv_peers,
                                                                unsigned int* const* meta_peers,
                                                                unsigned long long* const* flag_peers,
                                                                unsigned long long* flags,
                                                                unsigned long long* state,
                                                                unsigned int* grid_counter,
                                                                const unsigned int* meta,
                                                                const uint4* recv,
                                                                int* route_row,
                                                                int* slot_src,
                                                                int* expert_rows,
                                                                unsigned char* slab,
                                                                unsigned int* err,
                                                                int tokens,
                                                                int topk,
                                                                int hidden,
                                                                int experts,
                                                                int G,
                                                                int me,
                                                                int cap LL_PHASE_PARAMS) {
    LL_PHASES_BEGIN;
    __shared__ int wcount[16];
    __shared__ unsigned long long epoch_s;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int warps = blockDim.x >> 5;
    if (tid == 0) {
        epoch_s = state[0] + 1ull;  // every block reads it before it arrives at the first grid barrier
    }
    dispatch_rows(x, topk_idx, topk_w, recv_peers, meta_peers, 0, 0, err, tokens, topk, hidden, experts, G, me);
    publish(lane);
    LL_STAMP_BLOCK(1);
    grid_sync(grid_counter, err);  // its __syncthreads also hands epoch_s to the block
    const unsigned long long epoch = epoch_s;
    LL_STAMP(2);
    if (blockIdx.x == 0 && tid == 0) {
        state[0] = epoch;
    }
    announce(flag_peers, 0, epoch, G, me);
    LL_STAMP(3);
    wait_members(flags, epoch, G, err);
    LL_STAMP(4);

    const int local = experts / G;
    const unsigned int lo = (unsigned int)(me * local);
    const unsigned int hi = lo + (unsigned int)local;
    const long long words = (long long)G * tokens * topk;
    const long long gtid = (long long)blockIdx.x * blockDim.x + tid;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    for (long long w = gtid; w < words; w += nthreads) {
        const unsigned int e = meta[w] & 0xFFFFu;
        if (e < lo || e >= hi) {
            route_row[w] = -1;
        }
    }
    for (int el = blockIdx.x; el < local; el += gridDim.x) {
        const unsigned int e = lo + (unsigned int)el;
        int run = 0;  // pairs of e before this round (the same value in every thread)
        // A round: thread tid holds the LL_LAYOUT_WORDS consecutive words w0 .. (all its loads issued at once);
        // its hits are numbered after every lower thread's: a warp scan of the per-thread counts, then the warps'
        // totals in order.
        for (long long r0 = 0; r0 < words; r0 += (long long)blockDim.x * LL_LAYOUT_WORDS) {
            const long long w0 = r0 + (long long)tid * LL_LAYOUT_WORDS;
            unsigned int e_of[LL_LAYOUT_WORDS];
#pragma unroll
            for (int j = 0; j < LL_LAYOUT_WORDS; ++j) {
                e_of[j] = w0 + j < words ? meta[w0 + j] & 0xFFFFu : NO_EXPERT;
            }
            unsigned int mine = 0u;  // bit j: word w0 + j is a pair of e
#pragma unroll
            for (int j = 0; j < LL_LAYOUT_WORDS; ++j) {
                mine |= (e_of[j] == e ? 1u : 0u) << j;
            }
            const int count = __popc(mine);
            int incl = count;  // inclusive scan of the counts over the warp's lanes
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int up = __shfl_up_sync(LL_FULL, incl, d);
                incl += lane >= d ? up : 0;
            }
            if (lane == 31) {
                wcount[warp] = incl;
            }
            __syncthreads();
            int before = run + incl - count;
            int total = run;
            for (int i = 0; i < warps; ++i) {
                const int c = wcount[i];
                before += i < warp ? c : 0;
                total += c;
            }
            for (int j = 0; mine != 0u; ++j, mine >>= 1) {
                if (mine & 1u) {
                    const long long w = w0 + j;
                    const int pos = before++;
                    route_row[w] = pos < cap ? el * cap + pos : -1;
                    if (pos < cap) {
                        slot_src[el * cap + pos] = (int)(w / topk);
                    }
                }
            }
            run = total;
            __syncthreads();  // wcount is rewritten by the next round
        }
        if (tid == 0) {
            expert_rows[el] = run < cap ? run : cap;
            if (run > cap) {
                atomicOr(&err[0], 2u);
                atomicAdd(&err[2], (unsigned int)(run - cap));
            }
        }
    }
#if LL_PHASES
    __syncthreads();
    ll_stamp(stamps, 5);
    if (!slab) {
        ll_record(phases, 0, epoch, phase_launches, phase_blocks, stamps, 6);
        return;
    }
#endif
    if (!slab) {
        return;  // the kernel boundary publishes the layout to the expert GEMMs
    }
    grid_sync(grid_counter, err);  // route_row is whole

    const int nvec = hidden / 8;
    const size_t row_bytes = (size_t)hidden * 2;
    const WarpItems it = warp_items(words, nvec);
    for (long long item = it.first; item < it.count; item += it.stride) {
        const long long w = item / it.chunks;
        const int chunk = (int)(item - w * it.chunks);
        const int row = route_row[w];
        if (row < 0) {
            continue;
        }
        copy_chunk((uint4*)(slab + (size_t)row * row_bytes), recv + (size_t)(w / topk) * nvec, nvec, chunk, lane);
    }
#if LL_PHASES
    __syncthreads();
    ll_stamp(stamps, 6);
    ll_record(phases, 0, epoch, phase_launches, phase_blocks, stamps, 7);
#endif
}

// combine_ll's reduce: LL_REDUCE_ITEMS items a thread at a time, the rows of their first LL_REDUCE_GROUPS groups
// loaded together (2 and 4: EP2 / EP4 at 128 tokens in one trip of 2 items, within the registers of 512 threads)
#define LL_REDUCE_ITEMS 2
#define LL_REDUCE_GROUPS 4

// acc[0..7] += the 8 bf16 values of v, in order
__device__ __forceinline__ void add8(float* acc, uint4 v) {
    const unsigned int wd[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        acc[2 * j] = __fadd_rn(acc[2 * j], bf16_to_f32(wd[j] & 0xFFFFu));
        acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], bf16_to_f32(wd[j] >> 16));
    }
}

// combine_ll: ep_combine, then (after every member's combine rows arrived) ep_reduce's sum, in one
// kernel. Arguments as those kernels', plus flag_peers / flags / state / grid_counter as dispatch_ll's
// (flags slot [1], state[1], ll_grid[1]) and `comb`, this rank's combine rows (what comb_peers maps at
// index me). The reduce: out[t] = bf16(sum over the groups q the token uses, ascending, of comb[q][t]),
// float32 from 0: ep_reduce's operations in ep_reduce's order. Unlike ep_combine, the combine here also writes +0
// rows for the (token, group) pairs whose token uses no expert of the group (one token in ~130 at EP2, top-8 of
// 256), so the reduce adds every group's row without working out which the token uses (topk_idx is not read).
extern "C" __global__ void __launch_bounds__(512) ep_combine_ll(const uint4* __restrict__ y,
                                                               const unsigned int* meta,
                                                               const int* route_row,
                                                               unsigned char* const* comb_peers,
                                                               unsigned long long* const* flag_peers,
                                                               unsigned long long* flags,
                                                               unsigned long long* state,
                                                               unsigned int* grid_counter,
                                                               const uint4* comb,
                                                               const int* __restrict__ topk_idx,
                                                               uint4* out,
                                                               unsigned int* err,
                                                               int tokens,
                                                               int topk,
                                                               int hidden,
                                                               int experts,
                                                               int G,
                                                               int me,
                                                               int groups LL_PHASE_PARAMS) {
    LL_PHASES_BEGIN;
    __shared__ unsigned long long epoch_s;
    const int tid = threadIdx.x;
    if (tid == 0) {
        epoch_s = state[1] + 1ull;  // every block reads it before it arrives at the grid barrier
    }
    combine_rows(y, meta, route_row, comb_peers, 0, tokens, topk, hidden, experts, G, me, groups, true);
    publish(tid & 31);
    LL_STAMP_BLOCK(1);
    grid_sync(grid_counter, err);
    const unsigned long long epoch = epoch_s;
    LL_STAMP(2);
    if (blockIdx.x == 0 && tid == 0) {
        state[1] = epoch;
    }
    announce(flag_peers, G, epoch, G, me);
    LL_STAMP(3);
    wait_members(flags + G, epoch, G, err);
    LL_STAMP(4);

    // LL_REDUCE_ITEMS items at a time (this thread's items first, first + stride, ..., as one item a trip would
    // take them): the rows of their first LL_REDUCE_GROUPS groups all loaded before any is added; groups past
    // those (more than LL_REDUCE_GROUPS ranks) one at a time. Every group's row is added, in ascending order: a
    // group the token uses holds its pre-reduced row, one it does not holds +0 (written by the combine above), and
    // adding +0 to a float32 sum that starts at +0 changes nothing (the sum is never -0), so the bytes are
    // ep_reduce's over the groups the token uses, without reading topk_idx here.
    const long long nvec = hidden / 8;
    const long long total = (long long)tokens * nvec;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i0 = (long long)blockIdx.x * blockDim.x + tid; i0 < total; i0 += stride * LL_REDUCE_ITEMS) {
        uint4 p[LL_REDUCE_ITEMS][LL_REDUCE_GROUPS];
#pragma unroll
        for (int r = 0; r < LL_REDUCE_ITEMS; ++r) {
            const long long i = i0 + r * stride;
            const long long t = i / nvec;
            const long long c = i - t * nvec;
#pragma unroll
            for (int q = 0; q < LL_REDUCE_GROUPS; ++q) {
                if (i < total && q < groups) {
                    p[r][q] = comb[((long long)q * tokens + t) * nvec + c];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < LL_REDUCE_ITEMS; ++r) {
            const long long i = i0 + r * stride;
            if (i >= total) {
                break;
            }
            const long long t = i / nvec;
            const long long c = i - t * nvec;
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int q = 0; q < LL_REDUCE_GROUPS; ++q) {
                if (q < groups) {
                    add8(acc, p[r][q]);
                }
            }
            for (int q = LL_REDUCE_GROUPS; q < groups; ++q) {
                add8(acc, comb[((long long)q * tokens + t) * nvec + c]);
            }
            uint4 o;
            o.x = f32_to_bf16(acc[0]) | (f32_to_bf16(acc[1]) << 16);
            o.y = f32_to_bf16(acc[2]) | (f32_to_bf16(acc[3]) << 16);
            o.z = f32_to_bf16(acc[4]) | (f32_to_bf16(acc[5]) << 16);
            o.w = f32_to_bf16(acc[6]) | (f32_to_bf16(acc[7]) << 16);
            out[i] = o;
        }
    }
#if LL_PHASES
    __syncthreads();
    ll_stamp(stamps, 5);
    ll_record(phases, 1, epoch, phase_launches, phase_blocks, stamps, 6);
#endif
}

// --- FP8 dispatch (e4m3, one float32 scale per 128 values) --------------------------------------------------
// ep_dispatch_fp8 sends what ep_dispatch sends (routing words to every member; each token once to every member
// owning one of its experts), the row quantized: each 128-value block b of a row goes as 128 e4m3 bytes
// (recv8[row][b * 128 ..]) and one float32 scale (recv8_scale[row][b]), scale = amax / 448 of the block (1 for
// an all-zero block), byte = e4m3(x / scale) rounded to nearest even and saturated to +-448 (a NaN input goes
// as the e4m3 NaN 0x7F, sign kept). ep_dequant_fp8 then rebuilds, on the receiver, recv = bf16(e4m3 * scale)
// for the rows the routing words say were sent here, so layout, experts and combine run unchanged. hidden must
// be a multiple of 128 (the host checks it). The conversions are written out in integer and IEEE float
// operations (no cuda_fp8.h), so the CPU build of this file computes the same bytes.

#define FP8_BLOCK 128
#define FP8_MAX 448.0f

// float32 -> e4m3fn bits: round to nearest even, saturating to +-448 (0x7E); NaN -> 0x7F with the sign.
__device__ __forceinline__ unsigned int f32_to_e4m3(float f) {
    const unsigned int u = __float_as_uint(f);
    const unsigned int sign = (u >> 24) & 0x80u;
    const unsigned int a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) {
        return sign | 0x7Fu;
    }
    if (a < 0x3C800000u) {  // below 2^-6, the smallest normal: multiples of 2^-9 (8 * 2^-9 is 2^-6: code 0x08)
        return sign | (unsigned int)__float2int_rn(__fmul_rn(__uint_as_float(a), 512.0f));
    }
    // keep 3 of the 23 mantissa bits, nearest even (a carry into the exponent is the right result)
    const unsigned int r = (a + 0x7FFFFu + ((a >> 20) & 1u)) & ~0xFFFFFu;
    const int e = (int)(r >> 23) - 127;
    const unsigned int m = (r >> 20) & 7u;
    if (e > 8 || (e == 8 && m == 7u)) {  // above 448 (e 8, m 7 is the NaN code)
        return sign | 0x7Eu;
    }
    return sign | ((unsigned int)(e + 7) << 3) | m;
}

// e4m3fn bits -> float32, exactly (0x7F / 0xFF: NaN).
__device__ __forceinline__ float e4m3_to_f32(unsigned int c) {
    const unsigned int sign = (c & 0x80u) << 24;
    const unsigned int e = (c >> 3) & 15u;
    const unsigned int m = c & 7u;
    if (e == 15u && m == 7u) {
        return __uint_as_float(0x7FC00000u);
    }
    if (e == 0u) {  // subnormal: m * 2^-9
        return __uint_as_float(sign | __float_as_uint(__fmul_rn((float)m, 0.001953125f)));
    }
    return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// On the GPU (sm_89 and later) the conversions run on the hardware's fp8 instructions, which compute the same
// bytes: cvt.rn.satfinite.e4m3x2.f32 rounds to nearest even and saturates to +-448 (its NaN, 0x7F, gets the
// input's sign here, as above), and cvt.rn.f16x2.e4m3x2 is exact, as is f16 -> f32. tests/gpu/test_ep_moe_cuda.py
// checks the GPU's bytes against the twin recipe; the CPU build runs the functions above.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(TRAY_EMULATED)
#define FP8_HW 1
#else
#define FP8_HW 0
#endif

// f32_to_e4m3(lo) | f32_to_e4m3(hi) << 8
__device__ __forceinline__ unsigned int f32x2_to_e4m3x2(float lo, float hi) {
#if FP8_HW
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));  // a: the upper byte
    unsigned int out = r;
    if (lo != lo) {
        out = (out & 0xFF00u) | ((__float_as_uint(lo) >> 24) & 0x80u) | 0x7Fu;
    }
    if (hi != hi) {
        out = (out & 0x00FFu) | ((((__float_as_uint(hi) >> 24) & 0x80u) | 0x7Fu) << 8);
    }
    return out;
#else
    return f32_to_e4m3(lo) | (f32_to_e4m3(hi) << 8);
#endif
}

// e4m3_to_f32 of the low and the high byte of `two`
__device__ __forceinline__ void e4m3x2_to_f32x2(unsigned int two, float* lo, float* hi) {
#if FP8_HW
    unsigned int h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)(two & 0xFFFFu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(*lo) : "h"((unsigned short)(h2 & 0xFFFFu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(*hi) : "h"((unsigned short)(h2 >> 16)));
#else
    *lo = e4m3_to_f32(two & 0xFFu);
    *hi = e4m3_to_f32((two >> 8) & 0xFFu);
#endif
}

//   x          [tokens][hidden] bf16 (u16 bits)     this rank's tokens
//   topk_idx, topk_w, meta_peers, err               as ep_dispatch
//   recv8_peers  u64[G]: member g's [G][tokens][hidden] e4m3 bytes; this rank writes block `me`
//   scale_peers  u64[G]: member g's [G][tokens][hidden / 128] f32 scales; this rank writes block `me`
// Work item: FP8_UNROLL consecutive 128-value blocks of one token, one warp, quantized once and stored to every
// member the token goes to. In each block lane l holds values 4 l .. 4 l + 3 (one 8-byte load; the item's
// loads are all issued before any is used, so several are in flight per warp), the block's amax is a warp
// max over the lanes' (integer compares of the magnitudes' bits, which order non-negative floats as float
// compares do; a NaN counts as 0 so it never wins), and lane l writes bytes 4 l .. 4 l + 3 of the block (one
// 4-byte store): the warp stores 128 contiguous bytes per block. Block counts must be multiples of 32 threads
// (warps whole; the manifest's "threads" are).
#define FP8_UNROLL 4
extern "C" __global__ void __launch_bounds__(512) ep_dispatch_fp8(const unsigned short* __restrict__ x,
                                       const int* __restrict__ topk_idx,
                                       const unsigned short* __restrict__ topk_w,
                                       unsigned char* const* recv8_peers,
                                       float* const* scale_peers,
                                       unsigned int* const* meta_peers,
                                       unsigned int* err,
                                       int tokens,
                                       int topk,
                                       int hidden,
                                       int experts,
                                       int G,
                                       int me) {
    send_routing(topk_idx, topk_w, meta_peers, 0, err, tokens, topk, experts, G, me);  // as ep_dispatch does
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    const int local = experts / G;
    const int nblk = hidden / FP8_BLOCK;
    const int groups = (nblk + FP8_UNROLL - 1) / FP8_UNROLL;
    const long long items = (long long)tokens * groups;
    for (long long i = warp; i < items; i += nwarps) {  // warp-uniform: every lane takes the same items
        const long long t = i / groups;
        const int b0 = (int)(i - t * groups) * FP8_UNROLL;
        const int nb = nblk - b0 < FP8_UNROLL ? nblk - b0 : FP8_UNROLL;
        const unsigned short* src = x + (size_t)t * hidden + (size_t)b0 * FP8_BLOCK + 4 * lane;
        uint2 in[FP8_UNROLL];
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; ++u) {
            if (u < nb) {
                in[u] = *(const uint2*)(src + u * FP8_BLOCK);
            }
        }
        unsigned int word[FP8_UNROLL];
        float scale[FP8_UNROLL];
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; ++u) {
            const unsigned int v[4] = {in[u].x & 0xFFFFu, in[u].x >> 16, in[u].y & 0xFFFFu, in[u].y >> 16};
            unsigned int amax_bits = 0;  // of the magnitudes as float32 bits
            for (int k = 0; k < 4; ++k) {
                const unsigned int a = (v[k] & 0x7FFFu) << 16;
                const unsigned int kept = a > 0x7F800000u ? 0u : a;  // NaN never wins
                amax_bits = kept > amax_bits ? kept : amax_bits;
            }
            for (int d = 16; d >= 1; d >>= 1) {
                const unsigned int other = (unsigned int)__shfl_sync(0xFFFFFFFFu, (int)amax_bits, lane ^ d);
                amax_bits = other > amax_bits ? other : amax_bits;
            }
            const float amax = __uint_as_float(amax_bits);
            scale[u] = amax > 0.0f ? __fdiv_rn(amax, FP8_MAX) : 1.0f;
            const float q0 = __fdiv_rn(bf16_to_f32(v[0]), scale[u]);
            const float q1 = __fdiv_rn(bf16_to_f32(v[1]), scale[u]);
            const float q2 = __fdiv_rn(bf16_to_f32(v[2]), scale[u]);
            const float q3 = __fdiv_rn(bf16_to_f32(v[3]), scale[u]);
            word[u] = f32x2_to_e4m3x2(q0, q1) | (f32x2_to_e4m3x2(q2, q3) << 16);
        }
        const size_t row = (size_t)me * tokens + t;
        for (int g = 0; g < G; ++g) {
            if (!token_goes_to(topk_idx, t, topk, g, local)) {
                continue;
            }
            unsigned char* dst = recv8_peers[g] + row * hidden + (size_t)b0 * FP8_BLOCK + 4 * lane;
#pragma unroll
            for (int u = 0; u < FP8_UNROLL; ++u) {
                if (u < nb) {
                    *(unsigned int*)(dst + u * FP8_BLOCK) = word[u];
                }
            }
            // the item's scales: one 16-byte store where they fill an aligned float4 (every lane holds them all),
            // else one 4-byte store each; small stores cost a link transaction apiece
            float* sdst = scale_peers[g] + row * nblk + b0;
            if (FP8_UNROLL == 4 && nb == 4 && ((size_t)sdst & 15u) == 0) {
                if (lane == 0) {
                    *(float4*)sdst = make_float4(scale[0], scale[1], scale[2], scale[FP8_UNROLL - 1]);
                }
            } else {
#pragma unroll
                for (int u = 0; u < FP8_UNROLL; ++u) {
                    if (u < nb && lane == u) {
                        sdst[u] = scale[u];
                    }
                }
            }
        }
    }
    publish(lane);
}

//   recv8      [G][tokens][hidden] e4m3 bytes, recv8_scale [G][tokens][hidden / 128] f32   received here
//   meta       [G][tokens][topk] u32 routing words received here (which rows were sent)
//   recv       [G][tokens][hidden] bf16 (u16 bits): row s * tokens + t rewritten when token t of member s has
//              an expert of this rank; the other rows are left alone, as ep_dispatch leaves them
// Work item: FP8_UNROLL consecutive 128-value blocks of one row, one warp: lane l turns bytes 4 l .. 4 l + 3
// of each block (one 4-byte load, all the item's loads issued first) into values 4 l .. 4 l + 3 (one 8-byte
// store). Block counts must be multiples of 32 threads.
extern "C" __global__ void __launch_bounds__(512) ep_dequant_fp8(const unsigned char* __restrict__ recv8,
                                       const float* __restrict__ recv8_scale,
                                       const unsigned int* __restrict__ meta,
                                       unsigned short* __restrict__ recv,
                                       int tokens,
                                       int topk,
                                       int hidden,
                                       int experts,
                                       int G,
                                       int me) {
    const unsigned int local = (unsigned int)(experts / G);
    const int nblk = hidden / FP8_BLOCK;
    const int groups = (nblk + FP8_UNROLL - 1) / FP8_UNROLL;
    const long long items = (long long)G * tokens * groups;
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long i = warp; i < items; i += nwarps) {
        const long long r = i / groups;
        const int b0 = (int)(i - r * groups) * FP8_UNROLL;
        const int nb = nblk - b0 < FP8_UNROLL ? nblk - b0 : FP8_UNROLL;
        if (!hits(meta + r * topk, topk, (unsigned int)me * local, (unsigned int)(me + 1) * local)) {
            continue;
        }
        const size_t base = (size_t)r * hidden + (size_t)b0 * FP8_BLOCK + 4 * lane;
        unsigned int q[FP8_UNROLL];
        float scale[FP8_UNROLL];
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; ++u) {
            if (u < nb) {
                q[u] = *(const unsigned int*)(recv8 + base + u * FP8_BLOCK);
                scale[u] = recv8_scale[r * nblk + b0 + u];
            }
        }
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; ++u) {
            if (u < nb) {
                float f[4];
                e4m3x2_to_f32x2(q[u] & 0xFFFFu, &f[0], &f[1]);
                e4m3x2_to_f32x2(q[u] >> 16, &f[2], &f[3]);
                unsigned int h[4];
                for (int k = 0; k < 4; ++k) {
                    h[k] = f32_to_bf16(__fmul_rn(f[k], scale[u]));
                }
                uint2 out;
                out.x = h[0] | (h[1] << 16);
                out.y = h[2] | (h[3] << 16);
                *(uint2*)(recv + base + u * FP8_BLOCK) = out;
            }
        }
    }
}
