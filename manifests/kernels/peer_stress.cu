// peer_stress: producer -> barrier -> consumer through peer pointers, checked on the device, so the
// peer barrier's ordering contract is tested without any host synchronisation in between.
//
// The contract: what a member wrote (plain stores, earlier kernels on its stream, into any member's
// memory) before it entered a barrier is visible to every member's kernels launched after that
// barrier on their streams. One round r (r = 1, 2, ...) is
//
//     tray_stress_next      state[0] += 1                               (1 thread)
//     tray_stress_produce   spin a skew, then write round r's words into every member
//     peer barrier
//     tray_stress_check     compare own buffer with what every member must have written
//
// `buf` (u32) is [2 parities][G writers][words]; round r uses parity r & 1. Two parities make one
// barrier per round enough: a member can write round r + 1 while a slower one still checks round r
// (other parity), and cannot reach round r + 2 before everyone passed barrier r + 1, which comes after
// every check of round r.
//
// Word i that writer w puts into member g's buffer in round r (u32 arithmetic, wrapping):
//
//     stress_word(r, w, g, i) = (r * 0x9E3779B1u) ^ (w << 24) ^ (g << 16) ^ (i * 0x85EBCA6Bu)
//
// (the golden-ratio and a murmur constant: consecutive rounds and neighbouring words differ in many
// bits, so a stale word of round r - 2 never passes for round r).
//
// state (u64[4], device-local, zeroed by the host): [0] round, [1] words that did not match,
// [2] bit w set when writer w's words were wrong, [3] the first round that saw a wrong word (0: none).
// Skew: every block's thread 0 spins `skew_ns * ((r + me) % G)` of %globaltimer
// before the block writes, so each round another member is the late one and the others already wait
// in the barrier when its data is in flight: the case a missing release fence gets wrong.
// Fault injection: in round `corrupt_round` (0: never) this writer flips bit 0 of word 0 it sends to
// member (me + 1) % G, so a test can prove the check fails when data is wrong.
// Any grid and block shape works (grid-stride loops).

__device__ __forceinline__ unsigned int stress_word(unsigned long long r, int w, int g, unsigned long long i) {
    return ((unsigned int)r * 0x9E3779B1u) ^ ((unsigned int)w << 24) ^ ((unsigned int)g << 16) ^
           ((unsigned int)i * 0x85EBCA6Bu);
}

__device__ __forceinline__ unsigned long long stress_now_ns() {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

extern "C" __global__ void tray_stress_next(unsigned long long* state) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        state[0] += 1ull;
    }
}

extern "C" __global__ void tray_stress_produce(unsigned int* const* peers,
                                               const unsigned long long* state,
                                               int G,
                                               int me,
                                               unsigned long long words,
                                               unsigned long long skew_ns,
                                               unsigned long long corrupt_round) {
    const unsigned long long r = state[0];
    if (threadIdx.x == 0 && skew_ns != 0ull) {
        const unsigned long long wait_ns = skew_ns * ((r + (unsigned long long)me) % (unsigned long long)G);
        const unsigned long long start = stress_now_ns();
        while (stress_now_ns() - start < wait_ns) {
        }
    }
    __syncthreads();
    const unsigned long long slot = ((r & 1ull) * (unsigned long long)G + (unsigned long long)me) * words;
    const unsigned long long total = (unsigned long long)G * words;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += stride) {
        const int g = (int)(k / words);
        const unsigned long long i = k - (unsigned long long)g * words;
        unsigned int value = stress_word(r, me, g, i);
        if (r == corrupt_round && i == 0ull && g == (me + 1) % G) {
            value ^= 1u;
        }
        peers[g][slot + i] = value;
    }
}

extern "C" __global__ void tray_stress_check(const unsigned int* buf,
                                             unsigned long long* state,
                                             int G,
                                             int me,
                                             unsigned long long words) {
    const unsigned long long r = state[0];
    const unsigned long long base = (r & 1ull) * (unsigned long long)G * words;
    const unsigned long long total = (unsigned long long)G * words;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long bad = 0ull;
    unsigned long long writers = 0ull;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += stride) {
        const int w = (int)(k / words);
        const unsigned long long i = k - (unsigned long long)w * words;
        if (buf[base + k] != stress_word(r, w, me, i)) {
            bad += 1ull;
            writers |= 1ull << w;
        }
    }
    if (bad != 0ull) {
        atomicAdd(&state[1], bad);
        atomicOr(&state[2], writers);
        atomicCAS(&state[3], 0ull, r);
    }
}
