// Variant v0 (the first kernel): st.release.sys per thread, ld.acquire.sys polling.
// peer_barrier: the GPU barrier over peer-mapped flags of DESIGN section 6. It never hangs and it
// names who is missing.
//
// Every member owns `own_flags`, a u64[G] mapped into every peer; `peer_flags[t]` is member t's flags
// as mapped here. The epoch comes from `counter`, a device-local u64 that only this kernel touches:
// launches on one stream run one after another, so a captured graph of K barriers replays with K fresh
// epochs and no host involvement.
//
// Launch: one block of 32 threads, G <= 32 (the host checks). Thread t < G announces epoch e to member
// t (`st.release.sys` into peer_flags[t][me]), then waits for member t's announcement in own_flags[t]
// (`ld.acquire.sys` until >= e). Past `timeout_ns` (read from %globaltimer) it records the missing
// member in `err` and returns: err[0] = the epoch that timed out (atomicMax), err[1] |= 1 << t.
// No __trap: the process must live to report. A broken barrier stays broken: a launch that finds
// err[1] != 0 returns at once, so a graph of K barriers after a drop costs one timeout, not K.

__device__ __forceinline__ void st_release_sys(unsigned long long* addr, unsigned long long value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
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

extern "C" __global__ void tray_peer_barrier(unsigned long long* own_flags,
                                             unsigned long long* const* peer_flags,
                                             unsigned long long* counter,
                                             unsigned long long* err,
                                             unsigned int* host_flag,
                                             int G,
                                             int me,
                                             unsigned long long timeout_ns) {
    __shared__ unsigned long long epoch;
    __shared__ int broken;
    const int t = threadIdx.x;
    // Thread 0 alone reads the error word and bumps the counter, so every thread agrees on both.
    if (t == 0) {
        broken = *(volatile unsigned long long*)&err[1] != 0ull;
        if (!broken) {
            epoch = *counter + 1ull;
            *counter = epoch;
        }
    }
    __syncthreads();
    if (broken || t >= G) {
        return;
    }
    const unsigned long long e = epoch;
    // Release: this GPU's earlier writes (earlier kernels on the stream included) are visible to
    // member t before it can see epoch e.
    st_release_sys(peer_flags[t] + me, e);

    const unsigned long long start = globaltimer_ns();
    while (ld_acquire_sys(own_flags + t) < e) {
        if (globaltimer_ns() - start > timeout_ns) {
            atomicOr(&err[1], 1ull << t);
            atomicMax(&err[0], e);
            *(volatile unsigned int*)host_flag = 1u;
            return;
        }
    }
}
