// peer_barrier: the GPU barrier over peer-mapped flags of docs/design.md section 6. It never hangs and it
// names who is missing.
//
// Every member owns `own_flags`, a u64[G] mapped into every peer; `peer_flags[t]` is member t's flags
// as mapped here. The epoch comes from `counter`, a device-local u64 that only this kernel touches:
// launches on one stream run one after another, so a captured graph of K barriers replays with K fresh
// epochs and no host involvement.
//
// Launch: one block of 32 threads, G <= 32 (the host checks). Thread 0 makes this GPU's earlier writes
// visible system-wide (one `fence.acq_rel.sys`), then announces epoch e to every member t (a relaxed
// store into peer_flags[t][me]: fence + store in one thread is a release). Thread t < G waits for
// member t's announcement in own_flags[t] (relaxed polling, then one `ld.acquire.sys` that pairs with
// the member's release). Past `timeout_ns` (%globaltimer) it records the missing member in `err`:
// err[0] = the epoch that timed out (atomicMax), err[1] |= 1 << t, and sets *host_flag = 1 (mapped
// host memory, so the host learns of a timeout without a copy). No __trap: the process must live to
// report. On sm_90+ the host launches it with programmatic stream serialization: the next barrier is
// scheduled while this one runs and waits in `griddepcontrol.wait` (hides the launch latency in graphs
// and eager loops). A broken barrier stays broken: a launch that finds err[1] != 0 returns at once, so a graph of
// K barriers after a drop costs one timeout, not K.

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
#if __CUDA_ARCH__ >= 900
    // Launched with programmatic stream serialization, the next barrier may be scheduled now; it
    // waits here until this one has ended and its memory operations are visible. Without a
    // programmatic dependency both instructions do nothing.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (t == 0) {
        // counter and err[1] are independent loads: both are in flight at once.
        const unsigned long long c = *counter;
        broken = *(volatile unsigned long long*)&err[1] != 0ull;
        if (!broken) {
            const unsigned long long e = c + 1ull;
            *counter = e;
            epoch = e;
            asm volatile("fence.acq_rel.sys;" ::: "memory");
            for (int m = 0; m < G; ++m) {
                st_relaxed_sys(peer_flags[m] + me, e);
            }
        }
    }
    __syncthreads();
    if (broken || t >= G) {
        return;
    }
    const unsigned long long e = epoch;
    const unsigned long long* flag = own_flags + t;
    if (ld_relaxed_sys(flag) < e) {
        const unsigned long long start = globaltimer_ns();
        while (ld_relaxed_sys(flag) < e) {
            if (globaltimer_ns() - start > timeout_ns) {
                atomicOr(&err[1], 1ull << t);
                atomicMax(&err[0], e);
                *(volatile unsigned int*)host_flag = 1u;
                return;
            }
        }
    }
    (void)ld_acquire_sys(flag);  // pairs with member t's release: its earlier writes are visible now
}
