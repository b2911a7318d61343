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
// Low-latency one-shot (`tp_ll_allreduce`, below): one kernel, no barrier; the flags ride in the data.
// The same sum, the same bytes.
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

// ---------------------------------------------------------------------------------------------------
// Low-latency one-shot (`tp_ll_allreduce`): the synchronisation rides with the data (LL protocol), one
// kernel, no barrier launch, no host work between graph replays.
//
// A line is 4 bf16 of the message (8 bytes) sent as 16 bytes: two 64-bit words, each = 32 bits of data
// (2 bf16) | 32-bit flag << 32, stored with one `st.volatile.v2.u64` (each 8-byte element is one
// single-copy-atomic access, so a reader that sees the flag in a word sees that word's data).
// Member `me` writes line l of its input into every other member's receive slot (parity p, source me),
// then spins on its own slots (parity p, source g) until both words of line l carry the flag, sums the
// members in member order 0..G-1 (its own line from its input), float32 adds from 0, rounded once to
// bf16: the same bytes as `tp_sum_peers`, on every member. Then it zeroes the line in its slots.
//
//   in          [count] bf16, local: this member's partial
//   out         [count] bf16, local: the sum
//   recv_peers  u64[G]: member g's receive buffer (as mapped here), u64 words, laid out as
//               [2 parities][G sources][slot_lines][2 words], slot_lines = max_count / 4
//   state       u64[4] local, zero at allocation, touched only by this kernel:
//               [0] launch tickets: 2^20 per launch (see below); [1] the epoch that timed out (max);
//               [2] missing members (bit g: member g's lines did not arrive in time); [3] 1: a launch
//               was refused (count > 4 * slot_lines, G outside 1..64, me outside 0..G-1, grid > 2^20)
//   count       elements, 1 .. 4 * slot_lines; max_count sizes the slots (the manifest's ll_max_count)
//   timeout_ns  how long a thread waits for a peer's line before it records the peer missing
//
// Epoch: every block takes a ticket with one atomicAdd on state[0]: block 0 adds 2^20 - (gridDim.x - 1),
// every other block adds 1, so each launch adds exactly 2^20 and every ticket taken during launch E lies
// in [E * 2^20, (E + 1) * 2^20): all blocks compute E = ticket >> 20 without any inter-block sync, and
// launches with different grids keep counting. epoch = E + 1 (2^44 launches before the 64-bit ticket
// wraps); parity p = epoch & 1; flag = 1 + epoch % (2^32 - 1), never 0. Every member launches the same
// sequence (lockstep programs), so the members agree on the epoch of every launch.
//
// Why parity double-buffering is enough: member A's launch e+1 starts after its launch e ended, which
// needed every other member B's lines of launch e, which B sends only after its launch e-1 ended
// (stream order, or `griddepcontrol.wait` for a programmatic launch): B no longer reads parity
// (e+1) & 1 == (e-1) & 1 when A writes there. And A cannot reach launch e+2 before B sent launch e+1.
// Why a line never shows an old flag: the reader zeroes each line it consumed, and every line a member
// writes is consumed (same count on every member); 0 is never a flag. So the 32-bit flag may wrap. The
// zeroing store is local and lands before this launch ends, long before the writer's next store to the
// same line (two launches later, after a round trip through this member's next launch).
// Receive: a thread issues the loads of line l from up to TP_LOADS members at once and re-polls only those
// whose flag has not arrived, so the members' lines are awaited together, not one after the other.
// Timeout: thread-local, from %globaltimer after its sends; the thread records the members still missing
// (state[2] |= their bits, state[1] = max(epoch)) and returns. A later launch that finds state[2] != 0
// takes its ticket (the count stays whole) and returns (a broken allreduce stays broken; the host reads
// state after a sync and raises). A refused launch takes no ticket, on every member alike.
// No return before the second __syncthreads: every thread reaches both.

#define TP_LL_TICKET_BITS 20

__device__ __forceinline__ unsigned long long tp_ll_timer_ns() {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

__device__ __forceinline__ void tp_ll_store(unsigned long long* addr, unsigned long long w0, unsigned long long w1) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(addr), "l"(w0), "l"(w1) : "memory");
}

__device__ __forceinline__ void tp_ll_load(const unsigned long long* addr, unsigned long long& w0,
                                           unsigned long long& w1) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(w0), "=l"(w1) : "l"(addr) : "memory");
}

// Line l of `p` (4 bf16 as two u32), zero-padded past `count`; 8-byte loads when `p` allows.
__device__ __forceinline__ void tp_ll_read_line(const unsigned short* p, long long l, long long count, bool vec,
                                                unsigned int& d0, unsigned int& d1) {
    const long long e = l * 4;
    if (vec && e + 4 <= count) {
        const uint2 v = *(const uint2*)(p + e);
        d0 = v.x;
        d1 = v.y;
        return;
    }
    unsigned int h[4] = {0u, 0u, 0u, 0u};
    for (int j = 0; j < 4; ++j) {
        if (e + j < count) {
            h[j] = p[e + j];
        }
    }
    d0 = h[0] | (h[1] << 16);
    d1 = h[2] | (h[3] << 16);
}

__device__ __forceinline__ void tp_ll_write_line(unsigned short* p, long long l, long long count, bool vec,
                                                 unsigned int d0, unsigned int d1) {
    const long long e = l * 4;
    if (vec && e + 4 <= count) {
        uint2 v;
        v.x = d0;
        v.y = d1;
        *(uint2*)(p + e) = v;
        return;
    }
    const unsigned int h[4] = {d0 & 0xFFFFu, d0 >> 16, d1 & 0xFFFFu, d1 >> 16};
    for (int j = 0; j < 4; ++j) {
        if (e + j < count) {
            p[e + j] = (unsigned short)h[j];
        }
    }
}

__device__ __forceinline__ void tp_ll_add(float* acc, unsigned int d0, unsigned int d1) {
    acc[0] = __fadd_rn(acc[0], bf16_to_f32(d0 & 0xFFFFu));
    acc[1] = __fadd_rn(acc[1], bf16_to_f32(d0 >> 16));
    acc[2] = __fadd_rn(acc[2], bf16_to_f32(d1 & 0xFFFFu));
    acc[3] = __fadd_rn(acc[3], bf16_to_f32(d1 >> 16));
}

// Waits for member g0 + u's line l (u < TP_LOADS, every u at once: their loads fly together) until both words
// carry `flag` in their top bits (from bit FLAG_SHIFT: 32 for `tp_ll_allreduce`'s lines, 48 for the dense
// ones), leaving them in w0[u], w1[u] (zero for member me and past G). Returns false after recording the members
// still missing at the timeout.
template <int FLAG_SHIFT>
__device__ __forceinline__ bool tp_ll_wait_lines(unsigned long long* w0, unsigned long long* w1,
                                                 const unsigned long long* own, long long slot_words, long long l,
                                                 int g0, int G, int me, unsigned long long flag,
                                                 unsigned long long epoch, unsigned long long start,
                                                 unsigned long long timeout_ns, unsigned long long* state) {
    unsigned int pending = 0u;
#pragma unroll
    for (int u = 0; u < TP_LOADS; ++u) {
        w0[u] = 0ull;
        w1[u] = 0ull;
        if (g0 + u < G && g0 + u != me) {
            pending |= 1u << u;
        }
    }
    while (pending != 0u) {
#pragma unroll
        for (int u = 0; u < TP_LOADS; ++u) {
            if (pending >> u & 1u) {
                tp_ll_load(own + (g0 + u) * slot_words + 2 * l, w0[u], w1[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < TP_LOADS; ++u) {
            if ((pending >> u & 1u) && (w0[u] >> FLAG_SHIFT) == flag && (w1[u] >> FLAG_SHIFT) == flag) {
                pending &= ~(1u << u);
            }
        }
        if (pending != 0u && tp_ll_timer_ns() - start > timeout_ns) {
            atomicOr(&state[2], (unsigned long long)pending << g0);
            atomicMax(&state[1], epoch);
            return false;
        }
    }
    return true;
}

// Waits for the chunk's lines (tp_ll_wait_lines), then adds them to acc in member order (member me: its own
// line d0, d1) and zeroes the consumed lines. Returns false after recording the members missing at the timeout.
__device__ __forceinline__ bool tp_ll_gather(float* acc, unsigned long long* own, long long slot_words, long long l,
                                             int g0, int G, int me, unsigned int d0, unsigned int d1,
                                             unsigned long long flag, unsigned long long epoch,
                                             unsigned long long start, unsigned long long timeout_ns,
                                             unsigned long long* state) {
    unsigned long long w0[TP_LOADS], w1[TP_LOADS];
    if (!tp_ll_wait_lines<32>(w0, w1, own, slot_words, l, g0, G, me, flag, epoch, start, timeout_ns, state)) {
        return false;
    }
#pragma unroll
    for (int u = 0; u < TP_LOADS; ++u) {
        if (g0 + u < G) {
            if (g0 + u == me) {
                tp_ll_add(acc, d0, d1);
            } else {
                tp_ll_add(acc, (unsigned int)w0[u], (unsigned int)w1[u]);
                tp_ll_store(own + (g0 + u) * slot_words + 2 * l, 0ull, 0ull);
            }
        }
    }
    return true;
}

// Thread 0 of each block: this launch's epoch, from the ticket counter state[0] (block 0 adds 2^TP_LL_TICKET_BITS
// less the other blocks' ones, every other block 1, so each launch moves the high bits by exactly one whatever its
// grid, and every block reads the same launch number).
__device__ __forceinline__ unsigned long long tp_ll_ticket(unsigned long long* state) {
    const unsigned long long add =
        blockIdx.x == 0 ? (1ull << TP_LL_TICKET_BITS) - (unsigned long long)(gridDim.x - 1) : 1ull;
    return (atomicAdd(&state[0], add) >> TP_LL_TICKET_BITS) + 1ull;
}

extern "C" __global__ void tp_ll_allreduce(const unsigned short* in, unsigned short* out,
                                           unsigned long long* const* recv_peers, unsigned long long* state,
                                           long long count, long long max_count, int G, int me,
                                           unsigned long long timeout_ns) {
    __shared__ unsigned long long s_epoch;
    __shared__ int s_go;
    const long long slot_lines = max_count / 4;
    const long long lines = (count + 3) / 4;
    // uniform over the grid and, in lockstep, over the members: every member refuses the same launch
    const bool refused = count < 1 || lines > slot_lines || G < 1 || G > 64 || me < 0 || me >= G ||
                         gridDim.x > (1u << TP_LL_TICKET_BITS);
    // The ticket is taken before `griddepcontrol.wait`, while the previous kernel may still run: it needs
    // only that the previous launch's blocks took theirs, and they did before they let this grid start
    // (`launch_dependents` below comes after the block's ticket, and a grid without it starts after the
    // previous one ended).
    if (threadIdx.x == 0 && !refused) {
        s_epoch = tp_ll_ticket(state);
    }
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    // programmatic launch: the next launch may be scheduled now (every block of this grid is resident and
    // has its ticket); it waits in `griddepcontrol.wait` until this one ended and its memory operations
    // are visible. This grid waits the same way for the kernel before it (its input, its sends).
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = ((((unsigned long long)in) | ((unsigned long long)out)) & 7ull) == 0ull;
    // the first line's input load flies while thread 0 reads the error words
    unsigned int a0 = 0u, a1 = 0u;
    if (!refused && first < lines) {
        tp_ll_read_line(in, first, count, vec, a0, a1);
    }
    if (threadIdx.x == 0) {
        s_go = !refused && *(volatile unsigned long long*)&state[2] == 0ull;
        if (refused && blockIdx.x == 0) {
            *(volatile unsigned long long*)&state[3] = 1ull;
        }
    }
    __syncthreads();
    if (!s_go) {
        return;
    }
    const unsigned long long epoch = s_epoch;
    const unsigned long long flag = (unsigned long long)(1u + (unsigned int)(epoch % 0xFFFFFFFFull));
    const long long parity = (long long)(epoch & 1ull);
    const long long slot_words = slot_lines * 2;
    // send: line l of the input into slot (parity, me) of every other member
    for (long long l = first; l < lines; l += stride) {
        unsigned int d0 = a0, d1 = a1;
        if (l != first) {
            tp_ll_read_line(in, l, count, vec, d0, d1);
        }
        const unsigned long long w0 = (unsigned long long)d0 | (flag << 32);
        const unsigned long long w1 = (unsigned long long)d1 | (flag << 32);
        for (int g = 0; g < G; ++g) {
            if (g != me) {
                tp_ll_store(recv_peers[g] + (parity * G + me) * slot_words + 2 * l, w0, w1);
            }
        }
    }
    // receive: wait for every member's line l, sum in member order, zero the consumed lines
    unsigned long long* const own = recv_peers[me] + parity * G * slot_words;
    const unsigned long long start = tp_ll_timer_ns();
    for (long long l = first; l < lines; l += stride) {
        unsigned int d0 = a0, d1 = a1;
        if (l != first) {
            tp_ll_read_line(in, l, count, vec, d0, d1);
        }
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int g0 = 0; g0 < G; g0 += TP_LOADS) {
            if (!tp_ll_gather(acc, own, slot_words, l, g0, G, me, d0, d1, flag, epoch, start, timeout_ns, state)) {
                return;
            }
        }
        tp_ll_write_line(out, l, count, vec, pack2(acc[0], acc[1]), pack2(acc[2], acc[3]));
    }
}

// ---------------------------------------------------------------------------------------------------
// Low-latency one-shot, dense lines (`tp_ll3_allreduce`): the protocol of `tp_ll_allreduce` with 6 bytes of
// data per 8-byte word instead of 4, so 1.5x fewer bytes cross NVLink and are zeroed. Same arguments, the same
// receive buffer and state words (the two kernels may follow each other on one ll_recv / ll_state: see below),
// the same sum, the same bytes in `out`.
//
// A line is 6 bf16 of the message (12 bytes) sent as 16 bytes: two 64-bit words, each = 48 bits of data
// (3 bf16, the lower element in the lower bits) | 16-bit flag << 48, stored with one `st.volatile.v2.u64`.
// Line l holds elements 6l .. 6l+5 (word 0: 6l .. 6l+2, word 1: 6l+3 .. 6l+5); past `count` it pads with
// zeros. For a message of S bytes each member sends 16 * ceil(S / 12) bytes to each of its G - 1 peers
// (`tp_ll_allreduce`: 16 * ceil(S / 8)); at 64 KiB 87,392 bytes per peer instead of 131,072.
//
// Why a word seen with its flag carries that launch's data (PTX memory model): each 8-byte element of the
// vector store and of the vector load is one single-copy-atomic access (naturally aligned 64-bit, .volatile
// = .relaxed.sys), so a load returns either the whole old word or the whole new one, never a mix of data from
// one and flag from another. Nothing relies on the two words of a line, or the lines of a warp, arriving
// together or in order: the reader checks the flag of every word it uses. No fence, no acquire: the data
// needed is inside the word whose flag was seen.
// Why a flag seen is this launch's: flag = 1 + epoch % 65535, never 0. A word in slot (parity p, source g)
// holds 0 or a word member g stored there; g stores into parity p only in launches e with e & 1 == p, and the
// reader zeroes every word it consumed (the same count on every member: every word stored is consumed), so
// between launches every slot is all zeros and, during launch e, a word holds 0 or launch e's word: a stale
// word of launch e - 2k could otherwise match when 65535 divides k (a line unused by smaller counts for 131070
// launches), which the zeroing rules out. The zeroing lands before the writer's next store to that word
// (launch e + 2), on the launch boundaries `tp_ll_allreduce` relies on: the zeroing store belongs to this
// member's launch e, whose memory operations are performed before its launch e + 1 passes `griddepcontrol.wait`
// (or starts, without a programmatic launch) and only then sends its lines; the writer's launch e + 1 cannot
// end before it has seen those lines, and its launch e + 2 starts after that. So the store of e + 2 reaches
// this member's memory after the zeroing (both go to the same location, in this member's memory).
// Parity double buffering, epochs (tickets), timeouts, refusals: exactly as `tp_ll_allreduce`, with its
// ticket word: both kernels count launches in one sequence, so they may share ll_recv and ll_state (a slot
// is all zeros between launches in either format; a line of the other format is never in flight during a
// launch, since every member runs the same program). The count limit is the same as `tp_ll_allreduce`'s
// (count <= 4 * slot_lines); lines here are at most ceil(count / 6), so they fit the same slots.
// One change of schedule besides the format: the peer table is copied into shared memory before
// `griddepcontrol.wait` (see there), so the first remote store after the wait needs only the input's load.
// At 8 B (one line, where the format changes nothing on the wire) `ar_ll3 - ar_ll` measures that alone.

__device__ __forceinline__ unsigned int tp_ll3_flag(unsigned long long epoch) {
    return 1u + (unsigned int)(epoch % 0xFFFFull);
}

// Line l of `p` (6 bf16 as three u32: e0 | e1 << 16, e2 | e3 << 16, e4 | e5 << 16), zero-padded past `count`;
// 4-byte loads when `p` is 4-byte aligned (line l starts at byte 12 l).
__device__ __forceinline__ void tp_ll3_read_line(const unsigned short* p, long long l, long long count, bool vec,
                                                 unsigned int* d) {
    const long long e = l * 6;
    if (vec && e + 6 <= count) {
        const unsigned int* q = (const unsigned int*)(p + e);
        d[0] = q[0];
        d[1] = q[1];
        d[2] = q[2];
        return;
    }
    unsigned int h[6] = {0u, 0u, 0u, 0u, 0u, 0u};
    for (int j = 0; j < 6; ++j) {
        if (e + j < count) {
            h[j] = p[e + j];
        }
    }
    d[0] = h[0] | (h[1] << 16);
    d[1] = h[2] | (h[3] << 16);
    d[2] = h[4] | (h[5] << 16);
}

__device__ __forceinline__ void tp_ll3_write_line(unsigned short* p, long long l, long long count, bool vec,
                                                  const unsigned int* d) {
    const long long e = l * 6;
    if (vec && e + 6 <= count) {
        unsigned int* q = (unsigned int*)(p + e);
        q[0] = d[0];
        q[1] = d[1];
        q[2] = d[2];
        return;
    }
    const unsigned int h[6] = {d[0] & 0xFFFFu, d[0] >> 16, d[1] & 0xFFFFu, d[1] >> 16, d[2] & 0xFFFFu, d[2] >> 16};
    for (int j = 0; j < 6; ++j) {
        if (e + j < count) {
            p[e + j] = (unsigned short)h[j];
        }
    }
}

// three u32 of data -> the line's two words with the flag; and back (the flag bits dropped)
__device__ __forceinline__ void tp_ll3_pack(const unsigned int* d, unsigned long long flag, unsigned long long& w0,
                                            unsigned long long& w1) {
    w0 = (unsigned long long)d[0] | ((unsigned long long)(d[1] & 0xFFFFu) << 32) | (flag << 48);
    w1 = (unsigned long long)(d[1] >> 16) | ((unsigned long long)d[2] << 16) | (flag << 48);
}

__device__ __forceinline__ void tp_ll3_add(float* acc, const unsigned int* d) {
#pragma unroll
    for (int j = 0; j < 3; ++j) {
        acc[2 * j] = __fadd_rn(acc[2 * j], bf16_to_f32(d[j] & 0xFFFFu));
        acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], bf16_to_f32(d[j] >> 16));
    }
}

__device__ __forceinline__ void tp_ll3_add_words(float* acc, unsigned long long w0, unsigned long long w1) {
    // word 0 = e0 e1 e2 flag, word 1 = e3 e4 e5 flag (16 bits each, lowest first): the flags dropped
    const unsigned int d[3] = {(unsigned int)w0, ((unsigned int)(w0 >> 32) & 0xFFFFu) | ((unsigned int)w1 << 16),
                               (unsigned int)(w1 >> 16)};
    tp_ll3_add(acc, d);
}

// `tp_ll_gather` for dense lines: waits for the chunk's lines (tp_ll_wait_lines), adds them to acc in member
// order (member me: its own line d), zeroes the consumed lines. Returns false after recording the members still
// missing at the timeout.
__device__ __forceinline__ bool tp_ll3_gather(float* acc, unsigned long long* own, long long slot_words, long long l,
                                              int g0, int G, int me, const unsigned int* d, unsigned long long flag,
                                              unsigned long long epoch, unsigned long long start,
                                              unsigned long long timeout_ns, unsigned long long* state) {
    unsigned long long w0[TP_LOADS], w1[TP_LOADS];
    if (!tp_ll_wait_lines<48>(w0, w1, own, slot_words, l, g0, G, me, flag, epoch, start, timeout_ns, state)) {
        return false;
    }
#pragma unroll
    for (int u = 0; u < TP_LOADS; ++u) {
        if (g0 + u < G) {
            if (g0 + u == me) {
                tp_ll3_add(acc, d);
            } else {
                tp_ll3_add_words(acc, w0[u], w1[u]);
                tp_ll_store(own + (g0 + u) * slot_words + 2 * l, 0ull, 0ull);
            }
        }
    }
    return true;
}

//   in, out, recv_peers, state, count, max_count, G, me, timeout_ns: as `tp_ll_allreduce` (the same buffers;
//   slots of slot_lines = max_count / 4 lines of 16 bytes, of which the first ceil(count / 6) are used here)
extern "C" __global__ void tp_ll3_allreduce(const unsigned short* in, unsigned short* out,
                                            unsigned long long* const* recv_peers, unsigned long long* state,
                                            long long count, long long max_count, int G, int me,
                                            unsigned long long timeout_ns) {
    __shared__ unsigned long long s_epoch;
    __shared__ int s_go;
    __shared__ unsigned long long* s_peers[64];
    const long long slot_lines = max_count / 4;
    const long long lines = (count + 5) / 6;
    // the refusals of `tp_ll_allreduce`, word for word: the same counts pass either kernel
    const bool refused = count < 1 || (count + 3) / 4 > slot_lines || G < 1 || G > 64 || me < 0 || me >= G ||
                         gridDim.x > (1u << TP_LL_TICKET_BITS);
    // the ticket before `griddepcontrol.wait`, as in `tp_ll_allreduce`; so is the peer table, into shared memory:
    // it is written once, when the tray maps its peers, never by a kernel, so it may be read while the previous
    // kernel still runs, and the first remote store after the wait waits for no global load of an address
    if (threadIdx.x == 0 && !refused) {
        s_epoch = tp_ll_ticket(state);
    }
    if (!refused) {
        for (int g = threadIdx.x; g < G; g += blockDim.x) {
            s_peers[g] = recv_peers[g];
        }
    }
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = ((((unsigned long long)in) | ((unsigned long long)out)) & 3ull) == 0ull;
    // the first line's input load flies while thread 0 reads the error words
    unsigned int a[3] = {0u, 0u, 0u};
    if (!refused && first < lines) {
        tp_ll3_read_line(in, first, count, vec, a);
    }
    if (threadIdx.x == 0) {
        s_go = !refused && *(volatile unsigned long long*)&state[2] == 0ull;
        if (refused && blockIdx.x == 0) {
            *(volatile unsigned long long*)&state[3] = 1ull;
        }
    }
    __syncthreads();
    if (!s_go) {
        return;
    }
    const unsigned long long epoch = s_epoch;
    const unsigned long long flag = (unsigned long long)tp_ll3_flag(epoch);
    const long long parity = (long long)(epoch & 1ull);
    const long long slot_words = slot_lines * 2;
    // send: line l of the input into slot (parity, me) of every other member
    for (long long l = first; l < lines; l += stride) {
        unsigned int d[3] = {a[0], a[1], a[2]};
        if (l != first) {
            tp_ll3_read_line(in, l, count, vec, d);
        }
        unsigned long long w0, w1;
        tp_ll3_pack(d, flag, w0, w1);
        for (int g = 0; g < G; ++g) {
            if (g != me) {
                tp_ll_store(s_peers[g] + (parity * G + me) * slot_words + 2 * l, w0, w1);
            }
        }
    }
    // receive: wait for every member's line l, sum in member order, zero the consumed lines
    unsigned long long* const own = s_peers[me] + parity * G * slot_words;
    const unsigned long long start = tp_ll_timer_ns();
    for (long long l = first; l < lines; l += stride) {
        unsigned int d[3] = {a[0], a[1], a[2]};
        if (l != first) {
            tp_ll3_read_line(in, l, count, vec, d);
        }
        float acc[6] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int g0 = 0; g0 < G; g0 += TP_LOADS) {
            if (!tp_ll3_gather(acc, own, slot_words, l, g0, G, me, d, flag, epoch, start, timeout_ns, state)) {
                return;
            }
        }
        const unsigned int o[3] = {pack2(acc[0], acc[1]), pack2(acc[2], acc[3]), pack2(acc[4], acc[5])};
        tp_ll3_write_line(out, l, count, vec, o);
    }
}

// ---------------------------------------------------------------------------------------------------
// Stress of tp_ll_allreduce (checked, not timed): rounds of different inputs through the same slots, so a
// line read from the wrong launch (a parity reused too early, an old flag taken for new) shows as a wrong
// sum. Round r = stress[0] (local u64[4]: [0] round, [1] wrong elements summed over rounds).
//   tp_ll_stress_step: (r > 0) checks `out` against the sum of round r-1's inputs, adds the mismatches to
//                      stress[1]; writes round r's input into `in`. Any grid.
//   tp_ll_stress_next: one thread: round r+1; member r % G then holds its stream for skew_ns, so the others
//                      run ahead into the next launch and wait there.
// Inputs are small integers (-8 .. 8): every member-order float32 sum is exact and so is its bf16.

__device__ __forceinline__ int tp_ll_stress_value(unsigned long long r, int g, long long i) {
    return (int)((r * 131ull + (unsigned long long)g * 31ull + (unsigned long long)i * 7ull) % 17ull) - 8;
}

extern "C" __global__ void tp_ll_stress_step(unsigned short* in, const unsigned short* out,
                                             unsigned long long* stress, long long count, int G, int me) {
    const unsigned long long r = stress[0];
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned long long wrong = 0ull;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        if (r > 0ull) {
            int want = 0;
            for (int g = 0; g < G; ++g) {
                want += tp_ll_stress_value(r - 1ull, g, i);
            }
            wrong += out[i] != (unsigned short)f32_to_bf16((float)want) ? 1ull : 0ull;
        }
        in[i] = (unsigned short)f32_to_bf16((float)tp_ll_stress_value(r, me, i));
    }
    if (wrong != 0ull) {
        atomicAdd(&stress[1], wrong);
    }
}

extern "C" __global__ void tp_ll_stress_next(unsigned long long* stress, int G, int me, unsigned long long skew_ns) {
    const unsigned long long r = stress[0];
    stress[0] = r + 1ull;
    if ((int)(r % (unsigned long long)G) == me && skew_ns != 0ull) {
        const unsigned long long start = tp_ll_timer_ns();
        while (tp_ll_timer_ns() - start < skew_ns) {
        }
    }
}
