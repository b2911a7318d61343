// ep_gemm_wgmma: the experts' GEMMs of ep_gemm.cu (same entries' contract) on Hopper's warpgroup MMA
// (wgmma.mma_async, sm_90a only: compiled with --gpu-architecture=sm_90a, manifests/ep_moe.json
// "experts_wgmma"). For large batches, where ep_gemm.cu's mma.sync is bound by instruction issue; decode
// sizes stay on ep_gemm.cu (a few rows per expert stream weights, and 128-row tiles would only add zeros).
//
// One launch computes every local expert: C[e][r][n] = bf16( sum_k A_e[r][k] * B[e][n][k] ) for the rows
// r < rows[e] present (device counts), every n < N. B [experts][N][K] (nn.Linear weights), C [experts][cap][N],
// bf16 in and out, float32 accumulation, one round to nearest even at the end (ep_math.cu's recipe).
// K % 8 == 0, N % 2 == 0; partial tiles in M, N and K are masked (A rows past rows[e], B rows past N and
// columns past K are zero-filled in shared memory, so they add exactly nothing; stores are masked).
//   ep_wgmma_gemm         A_e[r] = A[e * cap + r]             (a dense [experts][cap][K] operand)
//   ep_wgmma_gemm_gather  A_e[r] = A[a_index[e * cap + r]]    (the received rows read in place)
// With -DWG_WS=1 both run the warp-specialized block (see "Warp-specialized mode" below: 384 threads, a producer
// warpgroup feeding the two consumer warpgroups through mbarriers), and two more entries take the same operands
// plus the expert count: ep_wgmma_gemm_tiles / ep_wgmma_gemm_tiles_gather, persistent blocks (one per SM)
// walking only the tiles that hold rows. With -DWG_TMA=1 as well (TMA mode, see wg_tma_b) the weights' stages
// come by tensor copies from a host-encoded tensor map whose address every entry takes as a last argument. The wgmma, their order and so the bytes are the same in every mode.
// Both run the same instructions over the same values, so the gather's bytes equal the dense entry's over
// the slab the index describes. wgmma's summation order inside one k16 step is the hardware's, not
// mma.sync's: the bytes need not equal ep_gemm.cu's (both are within bf16 rounding of float64), but they are
// the same on every run with the same counts (no atomics, no split K), which is what EP-N == EP1 needs (both
// use this kernel over the same rows per expert). A tile in half mode (below) runs a narrower wgmma, so an
// element's bytes may depend on whether its tile holds more than 64 rows.
//
// Block: 256 threads = 2 warpgroups over a 128 x WG_BN tile of C; warpgroup w owns rows 64 w .. 64 w + 63
// (one m64nWG_BNk16 wgmma per 16 of K, the whole tile width at once). Every thread also copies: K advances 64
// at a time through a ring of WG_STAGES shared-memory stages filled by cp.async (A rows are gathered through
// the index, so no TMA for A; B the same way, to keep launches plain pointers). Per K tile kt:
//   wait for this thread's copies of tile kt; fence.proxy.async (the generic-proxy writes of cp.async become
//   visible to wgmma's async proxy); __syncthreads (everyone's have); issue tile kt's 4 wgmma as one group;
//   wait until at most that group is in flight (tile kt - 1's has retired); __syncthreads (in both
//   warpgroups); issue the copies of tile kt + WG_STAGES - 1 into tile kt - 1's stage.
// So WG_STAGES - 1 tiles of copies are in flight, and the tensor cores hold tile kt's group while tile kt + 1's
// is prepared (the second barrier and the copies run under it).
// Tiles with at most 64 rows present (an expert's last, often) run in half mode (see wg_block): both
// warpgroups on the same 64 rows, each half the columns, so such a tile costs half the tensor-core time.
//
// Shared-memory layout (the canonical K-major 128-byte-swizzle layout of the PTX ISA's wgmma matrix
// descriptors): a stage holds A [128][64] then B [WG_BN][64] bf16, each row 128 bytes, 8-row atoms of 1024
// bytes; the 16-byte chunk c of row r lives at chunk c ^ (r % 8) of its row. Stages are 1024-byte aligned
// (the swizzle is a function of address bits 4-9, and the descriptors' base offset is 0). Descriptor:
// start address >> 4 (bits 0-13), leading byte offset >> 4 (16-29: unused by swizzled K-major layouts whose
// K step fits one 128-byte row; 1), stride byte offset >> 4 (32-45: 1024 B between 8-row atoms), swizzle
// mode (62-63: 1 = 128 B). The k16 step s of a K tile starts 32 s bytes into the row.
//
// Accumulator fragment of m64nNk16 with f32 D (PTX ISA, wgmma register fragments): thread l of warp w of
// the warpgroup (g = l / 4, t = l % 4) holds d[4 j + i] = D[16 w + g + 8 (i / 2)][8 j + 2 t + i % 2].
//
// SwiGLU mode (-DWG_SWIGLU=1, with WG_TMA 1): the gate/up GEMM and the activation in one kernel, so h13 never
// goes to memory. B is w13 [experts][2 ffn][K] (gate rows 0 .. ffn - 1, up rows ffn .. 2 ffn - 1), n = ffn,
// n_factor 2, and C is act [experts][cap][ffn]:
//   C[e][r][c] = bf16( silu(g) * u ),  g = bf16(sum_k A_e[r][k] B[e][c][k]),  u = bf16(sum_k A_e[r][k] B[e][ffn + c][k])
// with silu_mul in float32 as ep_math.cu computes it (wg_silu_mul below), so the bytes equal the GEMM into h13
// followed by ep_silu_mul_rows. A block covers WG_BN / 2 columns of C, c0 = blockIdx.x * WG_BN / 2 (the grid is
// the one over N = 2 ffn B rows: ceil(2 ffn / WG_BN) blocks in x). Its B stage holds four boxes of WG_BN / 4
// rows (one tensor copy each, the map's box {64, WG_BN / 4, 1}): gate c0 .., up c0 .., gate c0 + WG_BN / 4 ..,
// up c0 + WG_BN / 4 .., so a thread's accumulator holds each gate column next to its up column (fragment column
// 8 j + .. in box j / (WG_BN / 32); the up partner of j is j + WG_BN / 32) and the epilogue needs no exchange. In
// half mode (at most 64 rows) warpgroup wg multiplies boxes 2 wg and 2 wg + 1: C columns c0 + wg WG_BN / 4 ...
// Gate rows past ffn read up rows and up rows past 2 ffn read zeros; their columns are never stored.

#ifndef WG_BN
#define WG_BN 256
#endif
#ifndef WG_STAGES
#define WG_STAGES 4
#endif
#ifndef WG_WS
#define WG_WS 0
#endif
#ifndef WG_TMA
#define WG_TMA 0
#endif
#ifndef WG_SWIGLU
#define WG_SWIGLU 0
#endif
#ifndef WG_RASTER
#define WG_RASTER 0
#endif
#define WG_BM 128
#define WG_BK 64
#if WG_WS
#define WG_THREADS 384
#else
#define WG_THREADS 256
#endif
// blocks per SM the launch bounds promise: 2 where two rings fit in one SM's 228 KiB (n128s3's 97 KiB) and
// the registers allow (not with 384 threads: 85 each is below what one m64n128 wgmma needs)
#define WG_MINB ((!WG_WS && 2 * (WG_STAGES * (WG_BM + WG_BN) * WG_BK * 2 + 2048) <= 233472) ? 2 : 1)
#define WG_A_BYTES (WG_BM * WG_BK * 2)
#define WG_B_BYTES (WG_BN * WG_BK * 2)
#define WG_STAGE_BYTES (WG_A_BYTES + WG_B_BYTES)
// the ring, plus 1024 bytes so its start can be rounded up to the swizzle atom
#define WG_SMEM_BYTES (WG_STAGES * WG_STAGE_BYTES + 1024)
#if WG_WS
#define WG_COPIERS 128  // the producer warpgroup issues every copy
#else
#define WG_COPIERS 256  // every thread copies
#endif
#define WG_A_VECS (WG_BM * 8 / WG_COPIERS)  // 16-byte A copies per copying thread and stage
#define WG_B_VECS (WG_BN * 8 / WG_COPIERS)  // 16-byte B copies per copying thread and stage
#define WG_ROW_STEP (WG_COPIERS / 8)        // rows between one copying thread's vectors
#if WG_BN != 128 && WG_BN != 256
#error "WG_BN must be 128 or 256 (one m64nWG_BNk16 wgmma per warpgroup and k16 step)"
#endif
#if WG_WS != 0 && WG_WS != 1
#error "WG_WS must be 0 (every thread copies and multiplies) or 1 (a producer warpgroup and two consumers)"
#endif
#if WG_TMA != 0 && WG_TMA != 1
#error "WG_TMA must be 0 (B by cp.async) or 1 (B by the tensor memory accelerator, WG_WS 1 only)"
#endif
#if WG_TMA && !WG_WS
#error "WG_TMA 1 needs WG_WS 1: one thread of the producer warpgroup issues the tensor copies"
#endif
#if WG_SWIGLU != 0 && WG_SWIGLU != 1
#error "WG_SWIGLU must be 0 (C = A B^T) or 1 (C = silu(A B_gate^T) * (A B_up^T), see SwiGLU mode)"
#endif
#if WG_SWIGLU && !WG_TMA
#error "WG_SWIGLU 1 needs WG_TMA 1: the gate and up boxes of a stage come by four tensor copies"
#endif
#if WG_RASTER != 0 && WG_RASTER != 1
#error "WG_RASTER must be 0 (column tiles fastest) or 1 (row tiles fastest, see wg_tile_coords)"
#endif
#if WG_STAGES < 3
#error "WG_STAGES must be at least 3 (a stage being multiplied, one retiring, one or more loading)"
#endif
#if WG_SMEM_BYTES > 232448
#error "the ring is over a Hopper block's 227 KiB of shared memory: fewer WG_STAGES or a narrower WG_BN"
#endif

#if defined(__CUDA_ARCH__) && !defined(TRAY_EMULATED)

__device__ __forceinline__ unsigned int wg_f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        return 0x7FC0u;
    }
    u += 0x7FFFu + ((u >> 16) & 1u);
    return u >> 16;
}

// One 16-byte global -> shared copy (cp.async.cg: L2 only); `valid` false writes 16 zero bytes, reads nothing.
__device__ __forceinline__ void wg_cp16(unsigned int dst, const uint4* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

// The shared-memory matrix descriptor of a K-major, 128-byte-swizzled operand starting at `saddr` (a shared
// address; its atom 1024-byte aligned, plus 32 bytes per k16 step). See the top of this file.
__device__ __forceinline__ unsigned long long wg_desc(unsigned int saddr) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// The block's tile of C: column tile *tx, row tile *ty (of expert blockIdx.z). WG_RASTER 0: blockIdx as it is, so
// the blocks launched one after another (blockIdx.x fastest) share an expert's rows. WG_RASTER 1: an expert's blocks
// renumbered row tile fastest, so the blocks reading one column tile of B are launched side by side and its bytes
// come from DRAM about once (the gate/up GEMM at 4096 tokens per EP2 rank: 8.9 GB read from DRAM instead of 12.0,
// 8% faster; bench/results/h200/expert_gemm_raster.json). The bytes written do not change.
__device__ __forceinline__ void wg_tile_coords(int* tx, int* ty) {
#if WG_RASTER
    const int lin = (int)(blockIdx.x + gridDim.x * blockIdx.y);
    *ty = lin % (int)gridDim.y;
    *tx = lin / (int)gridDim.y;
#else
    *tx = (int)blockIdx.x;
    *ty = (int)blockIdx.y;
#endif
}

// Keeps the compiler from moving accumulator reads or writes across the wgmma fence / wait (the registers
// belong to the asynchronous MMA between the two).
template <int NACC>
__device__ __forceinline__ void wg_fence_acc(float* d) {
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
        asm volatile("" : "+f"(d[i])::"memory");
    }
}

// d[0..127] += A (64 x 16, descriptor a) * B (16 x 256, descriptor b), both K-major in shared memory
__device__ __forceinline__ void wg_mma_n256(float* d, unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b), "r"(1));
}

// d[0..63] += A (64 x 16, descriptor a) * B (16 x 128, descriptor b), both K-major in shared memory
__device__ __forceinline__ void wg_mma_n128(float* d, unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(1));
}

// d[0..31] += A (64 x 16, descriptor a) * B (16 x 64, descriptor b), both K-major in shared memory
__device__ __forceinline__ void wg_mma_n64(float* d, unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(1));
}

// The copies of K tile `kt` into stage `stage_addr` (a shared address): A's 128 rows (a_src[v]: this thread's
// row v's first vector of its chunk, fixed for the whole K loop), then B's WG_BN rows. Thread tid copies
// chunk c = tid % 8 of rows tid / 8 + WG_ROW_STEP v (tid: the copying thread's index); its swizzled chunk (c ^ (row % 8)) is the same for every v.
__device__ __forceinline__ void wg_issue(unsigned int stage_addr, const uint4* const* a_src, const bool* a_valid,
                                         const uint4* b_src, int b_limit, int K, int kt, int tid) {
    const int c = tid & 7;
    const int r0 = tid >> 3;
    const int k0 = kt * WG_BK;
    const bool in_k = k0 + c * 8 < K;
    const unsigned int col = (unsigned int)((c ^ (r0 & 7)) << 4);
#pragma unroll
    for (int v = 0; v < WG_A_VECS; ++v) {
        const int r = r0 + WG_ROW_STEP * v;
        const bool ok = a_valid[v] && in_k;
        wg_cp16(stage_addr + r * 128 + col, a_src[v] + (ok ? k0 / 8 : 0), ok);
    }
    if (WG_TMA) {
        return;  // B comes by one tensor copy per stage (wg_produce)
    }
    const unsigned int b_addr = stage_addr + WG_A_BYTES;
#pragma unroll
    for (int v = 0; v < WG_B_VECS; ++v) {
        const int r = r0 + WG_ROW_STEP * v;
        const bool ok = r < b_limit && in_k;
        // a row past N keeps the tile's first row (in bounds) as its address and copies nothing
        wg_cp16(b_addr + r * 128 + col, b_src + (ok ? ((long long)(WG_ROW_STEP * v) * K + k0) / 8 : 0), ok);
    }
}

// The sources of copying thread ctid (0 .. WG_COPIERS - 1) for the tile of expert e at rows m0 .., columns n0 ..
// (`present` rows of the expert): its A rows v (a_src[v], first vector of its chunk ctid % 8; a slot past the rows
// present keeps an in-bounds address, A's row 0 when gathering, the tile's first row otherwise, and copies nothing:
// a_valid[v] false) and its first B row (ctid / 8; the tile's first row when that is past N), chunk ctid % 8.
// Returns b_limit, the B rows of the tile that exist (N - n0).
__device__ __forceinline__ int wg_sources(const uint4* __restrict__ A, const int* __restrict__ a_index,
                                          const uint4* __restrict__ B, int cap, int N, int K, int e, int m0, int n0,
                                          int present, int ctid, const uint4** a_src, bool* a_valid,
                                          const uint4** b_src) {
    const int a_limit = present - m0;
    const long long a_slot0 = (long long)e * cap + m0;
#pragma unroll
    for (int v = 0; v < WG_A_VECS; ++v) {
        const int r = (ctid >> 3) + WG_ROW_STEP * v;
        a_valid[v] = r < a_limit;
        const long long row = a_index ? (a_valid[v] ? (long long)a_index[a_slot0 + r] : 0)
                                      : a_slot0 + (a_valid[v] ? r : 0);
        a_src[v] = A + (row * K) / 8 + (ctid & 7);
    }
    const int b_limit = N - n0;
    const long long b_row = (long long)e * N + n0 + ((ctid >> 3) < b_limit ? (ctid >> 3) : 0);
    *b_src = B + (b_row * K) / 8 + (ctid & 7);
    return b_limit;
}

// One m64 x NW x k16 wgmma per k16 step (NW = WG_BN or WG_BN / 2: the instruction the block's mode uses).
template <int NW>
__device__ __forceinline__ void wg_mma(float* d, unsigned long long a, unsigned long long b) {
    if (NW == 256) {
        wg_mma_n256(d, a, b);
    } else if (NW == 128) {
        wg_mma_n128(d, a, b);
    } else {
        wg_mma_n64(d, a, b);
    }
}

// The K loop and the epilogue of one block. HALF false: warpgroup wg multiplies rows 64 wg .. 64 wg + 63 of
// the tile by all WG_BN columns (m64nWG_BN). HALF true (at most 64 rows present, block-uniform): both
// warpgroups multiply rows 0 .. 63, warpgroup wg columns wg WG_BN / 2 .. (m64nWG_BN/2), so a tile with
// at most 64 rows costs half the tensor-core time. The branch is block-uniform and taken once, outside the
// loop: a warpgroup-dependent branch around wgmma makes ptxas serialize them (C7518).
template <bool HALF>
__device__ __forceinline__ void wg_block(unsigned int ring, const uint4* const* a_src, const bool* a_valid,
                                         const uint4* b_src, int b_limit, int K, int tid, unsigned int* C,
                                         long long c_row0, int present, int m0, int n0, int N) {
    constexpr int NW = HALF ? WG_BN / 2 : WG_BN;
    constexpr int NACC = NW / 2;
    const int wg = tid >> 7;
    const int k_tiles = (K + WG_BK - 1) / WG_BK;
    const unsigned int a_off = HALF ? 0u : (unsigned int)wg * 64u * 128u;
    const unsigned int b_off = WG_A_BYTES + (HALF ? (unsigned int)wg * (WG_BN / 2) * 128u : 0u);
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
        acc[i] = 0.0f;
    }
    // Prologue: K tiles 0 .. WG_STAGES - 2 in flight; every step commits a group, empty or not, so "at most
    // WG_STAGES - 2 pending" always means "tile kt has landed" below.
#pragma unroll
    for (int s = 0; s < WG_STAGES - 1; ++s) {
        if (s < k_tiles) {
            wg_issue(ring + s * WG_STAGE_BYTES, a_src, a_valid, b_src, b_limit, K, s, tid);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(WG_STAGES - 2) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();  // every thread's copies of tile kt are in shared memory, visible to the async proxy
        const unsigned int stage = ring + (kt % WG_STAGES) * WG_STAGE_BYTES;
        const unsigned long long da = wg_desc(stage + a_off);
        const unsigned long long db = wg_desc(stage + b_off);
        wg_fence_acc<NACC>(acc);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < WG_BK / 16; ++s) {
            wg_mma<NW>(acc, da + 2 * s, db + 2 * s);  // 32 bytes per k16 step: 2 in the address field (>> 4)
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // tile kt - 1's group has retired
        wg_fence_acc<NACC>(acc);
        __syncthreads();  // in both warpgroups: tile kt - 1's stage is free while tile kt multiplies
        const int next = kt + WG_STAGES - 1;
        if (next < k_tiles) {
            wg_issue(ring + (next % WG_STAGES) * WG_STAGE_BYTES, a_src, a_valid, b_src, b_limit, K, next, tid);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    wg_fence_acc<NACC>(acc);
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // no copy outlives the block (all empty by now)
    const int warp = (tid >> 5) & 3;  // warp within the warpgroup: rows 16 warp .. 16 warp + 15 of its 64
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int row0 = m0 + (HALF ? 0 : 64 * wg) + 16 * warp + g;
    const int col0 = n0 + (HALF ? wg * (WG_BN / 2) : 0) + 2 * t;
#pragma unroll
    for (int j = 0; j < NW / 8; ++j) {
        const int col = col0 + 8 * j;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h;
            if (row < present && col < N) {
                const unsigned int lo = wg_f32_to_bf16(acc[4 * j + 2 * h]);
                const unsigned int hi = wg_f32_to_bf16(acc[4 * j + 2 * h + 1]);
                C[((c_row0 + row) * N + col) / 2] = lo | (hi << 16);
            }
        }
    }
}

#if WG_WS
// Warp-specialized mode (WG_WS 1, 384 threads): warpgroup 0 is the producer, warpgroups 1 and 2 the consumers
// of wg_block's two roles. Per stage s of the ring two mbarriers: full[s] (128 arrivals: each producer thread's
// cp.async.mbarrier.arrive.noinc, which fires once all that thread's earlier copies have landed) and empty[s]
// (8 arrivals: lane 0 of each consumer warp once the wgmma group that read the stage has retired). The ring's
// uses are numbered j = 0, 1, .. over the block's K tiles (over all its tiles when persistent): use j is stage
// j % WG_STAGES, phase u = j / WG_STAGES of its barriers. The producer waits empty[s] for phase u - 1 (parity
// (u & 1) ^ 1, which a fresh barrier reports complete), copies, arrives on full[s]; a consumer waits full[s]
// for phase u (parity u & 1), fences the generic-proxy copies to the async proxy (the fence the plain block
// runs before its barrier), issues the K tile's 4 wgmma as a group, waits until only that group is in flight,
// and frees the previous use's stage. So the consumers never issue copies or meet a block-wide barrier in the
// K loop, and the producer keeps all WG_STAGES stages loading (a stage is refilled one K tile after it was
// read, where the plain block waits for its slowest thread's copies). setmaxnreg moves registers from the
// producer (72) to the consumers (216; m64n256 holds 128 accumulators). No waiter can fall a whole phase
// behind: the producer never runs more than WG_STAGES uses ahead of the consumers' frees.
// Every wait is bounded (WG_WAIT_NS of %globaltimer): a wait that runs past it records the first such wait in
// wg_hang_word (barrier kind 1 full / 2 empty, stage, K tile) and traps, so a pipeline bug ends the launch with
// an error instead of hanging the GPU.
#ifndef WG_WAIT_NS
#define WG_WAIT_NS 2000000000ull
#endif
#define WG_PRODUCER_REGS 72
#define WG_CONSUMER_REGS 216

// the first wait that ran out: (kind << 28) | (stage << 20) | K tile; 0 while none has
__device__ unsigned int wg_hang_word;

__device__ __forceinline__ unsigned long long wg_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ bool wg_bar_test(unsigned int bar, unsigned int parity) {
    unsigned int done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// Records the first wait that ran out in wg_hang_word and traps (the launch fails instead of hanging). printf
// only with -DWG_HANG_PRINTF=1 (a diagnosis build): any call in this kernel makes ptxas serialize its wgmma
// (C7510), so the timed build says only that the launch failed.
#ifndef WG_HANG_PRINTF
#define WG_HANG_PRINTF 0
#endif
__device__ __forceinline__ void wg_hang(unsigned int word) {
    if (atomicCAS(&wg_hang_word, 0u, word) == 0u && WG_HANG_PRINTF) {
        printf("ep_gemm_wgmma: the %s barrier of stage %u (K tile %u of a tile) did not complete within %llu ns; "
               "block (%d, %d, %d) thread %d; WG_BN %d WG_STAGES %d\n",
               (word >> 28) == 1u ? "full (copies landed)" : "empty (stage read)", (word >> 20) & 0xFFu,
               word & 0xFFFFFu, (unsigned long long)WG_WAIT_NS, (int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z,
               (int)threadIdx.x, WG_BN, WG_STAGES);
    }
    asm volatile("trap;\n" ::: "memory");
}

// Waits until the phase of parity `parity` of mbarrier `bar` has completed. Returns 0, or the wait's word for
// wg_hang (kind 1 full, 2 empty; stage; K tile) once WG_WAIT_NS have passed without it.
__device__ __forceinline__ unsigned int wg_bar_wait(unsigned int bar, unsigned int parity, unsigned int kind,
                                                    int stage, int kt) {
    if (wg_bar_test(bar, parity)) {
        return 0u;
    }
    const unsigned long long t0 = wg_now();
    while (!wg_bar_test(bar, parity)) {
        if (wg_now() - t0 > WG_WAIT_NS) {
            return (kind << 28) | ((unsigned int)stage << 20) | ((unsigned int)kt & 0xFFFFFu);
        }
    }
    return 0u;
}

// exp and silu * up as ep_math.cu computes them (ep_exp, silu_mul there: the same text, which
// tests/unit/test_wgmma_tile.py compares, since NVRTC compiles each file alone), so SwiGLU mode's bytes equal
// the GEMM into h13 followed by ep_silu_mul_rows.
__device__ __forceinline__ float ep_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const int n = __float2int_rn(__fmul_rn(x, __uint_as_float(0x3FB8AA3Bu)));  // log2(e)
    const float fn = (float)n;
    float r = __fsub_rn(x, __fmul_rn(fn, __uint_as_float(0x3F317200u)));       // ln2 hi
    r = __fsub_rn(r, __fmul_rn(fn, __uint_as_float(0x35BFBE8Eu)));             // ln2 lo
    float p = __uint_as_float(0x39500D01u);                                     // 1/5040
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3AB60B61u));               // 1/720
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3C088889u));               // 1/120
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3D2AAAABu));               // 1/24
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3E2AAAABu));               // 1/6
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    return __fmul_rn(p, __uint_as_float((unsigned int)(n + 127) << 23));
}

// silu(g) * u = g / (1 + exp(-g)) * u, in float32, rounded once to bf16.
__device__ __forceinline__ float silu_mul(float g, float u) {
    const float s = __fdiv_rn(g, __fadd_rn(1.0f, ep_exp(-g)));
    return __fmul_rn(s, u);
}

// SwiGLU mode's epilogue (see the top of this file): fragment columns 8 j + .. of box j / Q (Q = WG_BN / 32
// fragment column groups a box) hold gate (even box) or up (odd box) values; gate group j pairs with up group
// j + Q. Group jj of the output (NW / 16 of them) is gate group jj + Q (jj / Q), C columns col0 + 8 jj + 0, 1
// (col0: the warpgroup's first C column of the tile plus 2 t). Each value is rounded to bf16 first, as h13 holds it.
template <int NW>
__device__ __forceinline__ void wg_store_swiglu(const float* acc, unsigned int* C, long long c_row0, int present,
                                                int row0, int col0, int ffn) {
    constexpr int Q = WG_BN / 32;
#pragma unroll
    for (int jj = 0; jj < NW / 16; ++jj) {
        const int jg = jj + Q * (jj / Q);
        const int col = col0 + 8 * jj;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h;
            if (row < present && col < ffn) {
                float v[2];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const float gate = __uint_as_float(wg_f32_to_bf16(acc[4 * jg + 2 * h + i]) << 16);
                    const float up = __uint_as_float(wg_f32_to_bf16(acc[4 * (jg + Q) + 2 * h + i]) << 16);
                    v[i] = silu_mul(gate, up);
                }
                C[((c_row0 + row) * ffn + col) / 2] = wg_f32_to_bf16(v[0]) | (wg_f32_to_bf16(v[1]) << 16);
            }
        }
    }
}

// The consumers' share of one tile of C (expert rows m0 .., columns n0 ..; `present` rows of the expert): its
// K tiles are the ring's uses it .. it + k_tiles - 1 (use j in stage j % WG_STAGES, phase j / WG_STAGES), each
// stage freed once its wgmma group has retired, the last one before the epilogue. Returns it + k_tiles.
// HALF as wg_block's.
template <bool HALF>
__device__ __forceinline__ int wg_consume(unsigned int ring, unsigned int full, unsigned int empty, int K, int ctid,
                                          unsigned int* C, long long c_row0, int present, int m0, int n0, int N,
                                          int it) {
    constexpr int NW = HALF ? WG_BN / 2 : WG_BN;
    constexpr int NACC = NW / 2;
    const int wg = ctid >> 7;
    const int lane = ctid & 31;
    const int k_tiles = (K + WG_BK - 1) / WG_BK;
    const unsigned int a_off = HALF ? 0u : (unsigned int)wg * 64u * 128u;
    const unsigned int b_off = WG_A_BYTES + (HALF ? (unsigned int)wg * (WG_BN / 2) * 128u : 0u);
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
        acc[i] = 0.0f;
    }
    unsigned int hung = 0u;
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int j = it + kt;
        const int s = j % WG_STAGES;
        hung = wg_bar_wait(full + 8 * s, (unsigned int)(j / WG_STAGES) & 1u, 1u, s, kt);
        if (hung) {
            break;  // reported below, once no wgmma is in flight
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the landed copies, to wgmma's proxy
        const unsigned int stage = ring + s * WG_STAGE_BYTES;
        const unsigned long long da = wg_desc(stage + a_off);
        const unsigned long long db = wg_desc(stage + b_off);
        wg_fence_acc<NACC>(acc);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int k = 0; k < WG_BK / 16; ++k) {
            wg_mma<NW>(acc, da + 2 * k, db + 2 * k);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // K tile kt - 1's group has retired
        wg_fence_acc<NACC>(acc);
        if (kt > 0 && lane == 0) {
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(empty + 8 * ((j - 1) % WG_STAGES))
                         : "memory");
        }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    wg_fence_acc<NACC>(acc);
    if (hung) {
        wg_hang(hung);
    }
    if (k_tiles > 0 && lane == 0) {  // the last K tile's stage: the producer may refill it while we store
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(empty + 8 * ((it + k_tiles - 1) % WG_STAGES))
                     : "memory");
    }
    const int warp = (ctid >> 5) & 3;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int row0 = m0 + (HALF ? 0 : 64 * wg) + 16 * warp + g;
#if WG_SWIGLU
    wg_store_swiglu<NW>(acc, C, c_row0, present, row0, n0 / 2 + (HALF ? wg * (WG_BN / 4) : 0) + 2 * t, N / 2);
#else
    const int col0 = n0 + (HALF ? wg * (WG_BN / 2) : 0) + 2 * t;
#pragma unroll
    for (int jj = 0; jj < NW / 8; ++jj) {
        const int col = col0 + 8 * jj;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h;
            if (row < present && col < N) {
                const unsigned int lo = wg_f32_to_bf16(acc[4 * jj + 2 * h]);
                const unsigned int hi = wg_f32_to_bf16(acc[4 * jj + 2 * h + 1]);
                C[((c_row0 + row) * N + col) / 2] = lo | (hi << 16);
            }
        }
    }
#endif
    return it + k_tiles;
}

// TMA mode (WG_TMA 1): B's stage comes by one tensor copy (cp.async.bulk.tensor) issued by producer thread 0,
// from a tensor map the host encodes over B [experts][N][K] bf16 (dims innermost first {K, N, experts}, strides
// {2 K, 2 N K} bytes, box {64, WG_BN, 1}, element strides 1, the 128-byte swizzle, out-of-bounds elements zero:
// tray/programs/ep_moe/tma.py) and passes by its global address (b_map, 64-byte aligned, written before the
// launch; acquired once per block, wg_tma_acquire). The swizzle mode writes each 128-byte row r of a box at chunk
// c ^ (r % 8) of 1024-byte atoms, the layout the descriptors read (a stage's B starts 1024-byte aligned).
// Columns past K and rows past N (or past the last expert) arrive as zeros, as the cp.async path zero-fills
// them. Thread 0 arrives on full[s] with expect_tx for the box's bytes (the whole box is counted, zero-filled
// parts too) before the copy, so full[s] counts WG_COPIERS + 1 arrivals and completes once every A copy has
// landed and the tensor copy's bytes have. The host builds the box from the same WG_BN (WgmmaTile); a smaller
// box would never complete the barrier (the consumers' bounded wait traps), a larger one would overrun the stage.
__device__ __forceinline__ void wg_tma_box(unsigned int dst, const void* b_map, unsigned int bar, int k0, int row,
                                           int e) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(b_map), "r"(k0), "r"(row), "r"(e), "r"(bar)
        : "memory");
}

// B's stage of K tile k0 for the block's B rows n0 .. (SwiGLU mode: its four gate/up boxes, N = 2 ffn).
__device__ __forceinline__ void wg_tma_b(unsigned int dst, const void* b_map, unsigned int bar, int k0, int n0,
                                         int e, int N) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "n"(WG_B_BYTES)
                 : "memory");
#if WG_SWIGLU
    constexpr int BOX = WG_BN / 4;
    const int ffn = N / 2;
    const int c0 = n0 / 2;
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        wg_tma_box(dst + h * BOX * 128, b_map, bar, k0, (h & 1) * ffn + c0 + (h >> 1) * BOX, e);
    }
#else
    (void)N;
    wg_tma_box(dst, b_map, bar, k0, n0, e);
#endif
}

// Before thread 0's first tensor copy: the map was written through the generic proxy (a host copy into global
// memory), and the tensor copies read it through the tensormap proxy, so acquire it at system scope (the CUDA
// programming guide's recipe for a map in global memory written by the host), and start fetching it.
__device__ __forceinline__ void wg_tma_acquire(const void* b_map) {
    if (WG_TMA) {
        asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;\n" ::"l"(b_map) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(b_map) : "memory");
    }
}

// The producer's share of one tile (ptid: 0 .. 127): the copies of its K tiles into the ring's uses it .., each
// after the stage's previous use has been freed, each signalled on full[stage] when this thread's copies land.
// Returns it + k_tiles.
__device__ __forceinline__ int wg_produce(unsigned int ring, unsigned int full, unsigned int empty,
                                          const uint4* __restrict__ A, const int* __restrict__ a_index,
                                          const uint4* __restrict__ B, int cap, int N, int K, int e, int m0, int n0,
                                          int present, int ptid, int it, const void* b_map) {
    const uint4* a_src[WG_A_VECS];  // once per tile
    bool a_valid[WG_A_VECS];
    const uint4* b_src;
    const int b_limit = wg_sources(A, a_index, B, cap, N, K, e, m0, n0, present, ptid, a_src, a_valid, &b_src);
    const int k_tiles = (K + WG_BK - 1) / WG_BK;
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int j = it + kt;
        const int s = j % WG_STAGES;
        // use j / WG_STAGES waits for the stage's previous use to be freed (a fresh barrier passes parity 1)
        const unsigned int hung = wg_bar_wait(empty + 8 * s, ((unsigned int)(j / WG_STAGES) & 1u) ^ 1u, 2u, s, kt);
        if (hung) {
            wg_hang(hung);
        }
        if (WG_TMA && ptid == 0) {
            wg_tma_b(ring + s * WG_STAGE_BYTES + WG_A_BYTES, b_map, full + 8 * s, kt * WG_BK, n0, e, N);
        }
        wg_issue(ring + s * WG_STAGE_BYTES, a_src, a_valid, b_src, b_limit, K, kt, ptid);
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full + 8 * s) : "memory");
    }
    return it + k_tiles;
}

// The ring (aligned), its mbarriers initialised (full: the producer's 128 threads, plus the tensor copy's
// arrival in TMA mode; empty: the consumers' 8 warps), every thread past the barrier that publishes them. Traps
// when the launch gave too little memory.
__device__ __forceinline__ void wg_ws_setup(unsigned char* smem, unsigned long long* bars, unsigned int* ring,
                                            unsigned int* full, unsigned int* empty) {
    unsigned int dyn;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < WG_SMEM_BYTES) {
        __trap();  // the ring would overrun the block's shared memory
    }
    *ring = ((unsigned int)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;
    *full = (unsigned int)__cvta_generic_to_shared(bars);
    *empty = *full + 8 * WG_STAGES;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < WG_STAGES; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(*full + 8 * s), "r"(WG_COPIERS + WG_TMA)
                         : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(*empty + 8 * s), "r"(8) : "memory");
        }
        // the initialised barriers, visible to the asynchronous arrivals (cp.async's) as well as to the threads
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}

// One tile per block (the grid of wgmma_gemm), warp-specialized.
__device__ __forceinline__ void wgmma_gemm_ws(const uint4* __restrict__ A, const int* __restrict__ a_index,
                                              const uint4* __restrict__ B, unsigned int* __restrict__ C,
                                              const int* __restrict__ rows, int cap, int n, int n_factor, int K,
                                              const void* b_map) {
    if (WG_SWIGLU && n_factor != 2) {
        __trap();  // SwiGLU mode reads gate and up rows of one B [experts][2 ffn][K]
    }
    const int N = n * n_factor;
    const int e = blockIdx.z;
    int tx, ty;
    wg_tile_coords(&tx, &ty);
    const int m0 = ty * WG_BM;
    const int n0 = tx * WG_BN;
    const int present = rows[e] < cap ? rows[e] : cap;
    if (m0 >= present) {
        return;  // the whole block: no thread has reached a barrier
    }
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    __shared__ __align__(8) unsigned long long wg_bars[2 * WG_STAGES];  // full[0 ..], then empty[0 ..]
    unsigned int ring, full, empty;
    wg_ws_setup(wg_smem, wg_bars, &ring, &full, &empty);
    const int tid = threadIdx.x;
    if (tid < WG_COPIERS) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WG_PRODUCER_REGS));
        if (tid == 0) {
            wg_tma_acquire(b_map);
        }
        wg_produce(ring, full, empty, A, a_index, B, cap, N, K, e, m0, n0, present, tid, 0, b_map);
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives the block
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WG_CONSUMER_REGS));
    if (present - m0 <= 64) {
        wg_consume<true>(ring, full, empty, K, tid - WG_COPIERS, C, (long long)e * cap, present, m0, n0, N, 0);
    } else {
        wg_consume<false>(ring, full, empty, K, tid - WG_COPIERS, C, (long long)e * cap, present, m0, n0, N, 0);
    }
}

// Persistent blocks over the tiles with rows (entries ep_wgmma_gemm_tiles*): the tiles of C that hold rows
// present, numbered expert by expert, row tile by row tile, column tile fastest (so the blocks working at
// once share an expert's A rows and its weight columns in L2); block b takes tiles b, b + gridDim.x, ...
// Tiles wholly past an expert's rows are never visited, and the producer fills the next tile's stages while
// the consumers store this one's. wg_units[e]: the row tiles of experts 0 .. e - 1.
#define WG_MAX_EXPERTS 1024

__device__ __forceinline__ void wgmma_gemm_tiles(const uint4* __restrict__ A, const int* __restrict__ a_index,
                                                 const uint4* __restrict__ B, unsigned int* __restrict__ C,
                                                 const int* __restrict__ rows, int cap, int n, int n_factor, int K,
                                                 int experts, const void* b_map) {
    if (experts > WG_MAX_EXPERTS || experts < 1 || (WG_SWIGLU && n_factor != 2)) {
        __trap();  // wg_units holds at most WG_MAX_EXPERTS experts' prefix; SwiGLU mode reads B [experts][2 ffn][K]
    }
    const int N = n * n_factor;
    const int tiles_n = (N + WG_BN - 1) / WG_BN;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    __shared__ __align__(8) unsigned long long wg_bars[2 * WG_STAGES];
    __shared__ int wg_units[WG_MAX_EXPERTS + 1];
    const int tid = threadIdx.x;
    for (int e = tid; e < experts; e += WG_THREADS) {
        const int present = rows[e] < cap ? (rows[e] > 0 ? rows[e] : 0) : cap;
        wg_units[e + 1] = (present + WG_BM - 1) / WG_BM;
    }
    unsigned int ring, full, empty;
    wg_ws_setup(wg_smem, wg_bars, &ring, &full, &empty);  // its barrier also publishes the counts
    if (tid < 32) {  // warp 0: the inclusive prefix of the row tiles, 32 experts a step
        int carry = 0;
        for (int base = 1; base <= experts; base += 32) {
            const int e = base + tid;
            int v = e <= experts ? wg_units[e] : 0;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int up = __shfl_up_sync(0xFFFFFFFFu, v, d);
                v += tid >= d ? up : 0;
            }
            if (e <= experts) {
                wg_units[e] = carry + v;
            }
            carry += __shfl_sync(0xFFFFFFFFu, v, 31);
        }
        if (tid == 0) {
            wg_units[0] = 0;
        }
    }
    __syncthreads();
    const int total = wg_units[experts] * tiles_n;
    // Both roles walk the same tiles in the same order, each in its own loop (one loop with both branches
    // keeps ptxas from honouring setmaxnreg, C7507).
    int it = 0;
    int e = 0;
    if (tid < WG_COPIERS) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WG_PRODUCER_REGS));
        if (tid == 0) {
            wg_tma_acquire(b_map);
        }
        for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
            const int unit = tile / tiles_n;
            while (wg_units[e + 1] <= unit) {
                ++e;  // tiles only grow, so the expert does too
            }
            const int present = rows[e] < cap ? rows[e] : cap;
            it = wg_produce(ring, full, empty, A, a_index, B, cap, N, K, e, (unit - wg_units[e]) * WG_BM,
                            (tile - unit * tiles_n) * WG_BN, present, tid, it, b_map);
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives the block
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WG_CONSUMER_REGS));
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        const int unit = tile / tiles_n;
        while (wg_units[e + 1] <= unit) {
            ++e;
        }
        const int m0 = (unit - wg_units[e]) * WG_BM;
        const int n0 = (tile - unit * tiles_n) * WG_BN;
        const int present = rows[e] < cap ? rows[e] : cap;
        if (present - m0 <= 64) {
            it = wg_consume<true>(ring, full, empty, K, tid - WG_COPIERS, C, (long long)e * cap, present, m0, n0, N,
                                  it);
        } else {
            it = wg_consume<false>(ring, full, empty, K, tid - WG_COPIERS, C, (long long)e * cap, present, m0, n0, N,
                                   it);
        }
    }
}
#endif  // WG_WS

// TMA mode's entries take one more, last argument: b_map, the global address of B's tensor map (a 128-byte
// CUtensorMap, 64-byte aligned; see wg_tma_b). B stays an argument (the contract is the other modes'); its
// bytes come through the map.
#if WG_TMA
#define WG_MAP_PARAM , const void* __restrict__ b_map
#define WG_MAP_ARG b_map
#else
#define WG_MAP_PARAM
#define WG_MAP_ARG 0
#endif

// wgmma_gemm: see the top of this file.
//   A        [.][K] bf16          the received rows (a_index given) or [experts][cap][K] (a_index null)
//   a_index  [experts][cap] i32   row of A for each slot r < rows[e], or null; slots at or beyond rows[e]
//                                 are never read
//   B        [experts][N][K] bf16, C [experts][cap][N] bf16, rows [experts] i32 (<= cap; more counts as cap)
//   N = n * n_factor; K % 8 == 0, N % 2 == 0
// grid (ceil(N / WG_BN), ceil(cap / 128), experts), block 256, dynamic shared memory WG_SMEM_BYTES (a
// launch with less traps: the tile shape and the manifest disagree).
__device__ __forceinline__ void wgmma_gemm(const uint4* __restrict__ A, const int* __restrict__ a_index,
                                           const uint4* __restrict__ B, unsigned int* __restrict__ C,
                                           const int* __restrict__ rows, int cap, int n, int n_factor, int K,
                                           const void* b_map) {
#if WG_WS
    wgmma_gemm_ws(A, a_index, B, C, rows, cap, n, n_factor, K, b_map);
    return;
#endif
    const int N = n * n_factor;
    const int e = blockIdx.z;
    int tx, ty;
    wg_tile_coords(&tx, &ty);
    const int m0 = ty * WG_BM;
    const int n0 = tx * WG_BN;
    const int present = rows[e] < cap ? rows[e] : cap;
    if (m0 >= present) {
        return;  // the whole block: no thread has reached a barrier
    }
    unsigned int dyn;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < WG_SMEM_BYTES) {
        __trap();  // the ring would overrun the block's shared memory
    }
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    const unsigned int ring = ((unsigned int)__cvta_generic_to_shared(wg_smem) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const uint4* a_src[WG_A_VECS];
    bool a_valid[WG_A_VECS];
    const uint4* b_src;
    const int b_limit = wg_sources(A, a_index, B, cap, N, K, e, m0, n0, present, tid, a_src, a_valid, &b_src);
    if (present - m0 <= 64) {  // at most 64 rows of the tile present: half mode
        wg_block<true>(ring, a_src, a_valid, b_src, b_limit, K, tid, C, (long long)e * cap, present, m0, n0, N);
    } else {
        wg_block<false>(ring, a_src, a_valid, b_src, b_limit, K, tid, C, (long long)e * cap, present, m0, n0, N);
    }
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, WG_MINB) ep_wgmma_gemm(const uint4* __restrict__ A,
                                                                        const uint4* __restrict__ B,
                                                                        unsigned int* __restrict__ C,
                                                                        const int* __restrict__ rows, int cap,
                                                                        int n, int n_factor,
                                                                        int K WG_MAP_PARAM) {
    wgmma_gemm(A, 0, B, C, rows, cap, n, n_factor, K, WG_MAP_ARG);
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, WG_MINB) ep_wgmma_gemm_gather(const uint4* __restrict__ A,
                                                                               const int* __restrict__ a_index,
                                                                               const uint4* __restrict__ B,
                                                                               unsigned int* __restrict__ C,
                                                                               const int* __restrict__ rows,
                                                                               int cap, int n, int n_factor,
                                                                               int K WG_MAP_PARAM) {
    wgmma_gemm(A, a_index, B, C, rows, cap, n, n_factor, K, WG_MAP_ARG);
}

#if WG_WS
// Persistent, warp-specialized (WG_WS 1 only): grid (blocks, 1, 1), any count (the GPU's SM count keeps one
// per SM), block 384, dynamic shared memory WG_SMEM_BYTES; `experts` <= WG_MAX_EXPERTS, the length of rows.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) ep_wgmma_gemm_tiles(const uint4* __restrict__ A,
                                                                              const uint4* __restrict__ B,
                                                                              unsigned int* __restrict__ C,
                                                                              const int* __restrict__ rows, int cap,
                                                                              int n, int n_factor, int K,
                                                                              int experts WG_MAP_PARAM) {
    wgmma_gemm_tiles(A, 0, B, C, rows, cap, n, n_factor, K, experts, WG_MAP_ARG);
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
    ep_wgmma_gemm_tiles_gather(const uint4* __restrict__ A, const int* __restrict__ a_index,
                               const uint4* __restrict__ B, unsigned int* __restrict__ C,
                               const int* __restrict__ rows, int cap, int n, int n_factor, int K,
                               int experts WG_MAP_PARAM) {
    wgmma_gemm_tiles(A, a_index, B, C, rows, cap, n, n_factor, K, experts, WG_MAP_ARG);
}
#endif  // WG_WS

#endif  // __CUDA_ARCH__
