// peer_barrier: the GPU barrier over peer-mapped flags of docs/design.md section 6. It never hangs and it
// names who is missing.
//
// Every member owns `own_flags`, a u64[G] mapped into every peer; `peer_flags[t]` is member t's flags
// as mapped here. The epoch comes from `counter`, a device-local u64 that only this kernel touches:
// launches on one stream run one after another, so a captured graph of K barriers replays with K fresh
// epochs and no host involvement.
//
// Launch: one block of 32 threads, G <= 32 (the host checks). After `griddepcontrol.wait`, every load
// the barrier needs is issued at once (thread t < G: member t's flags address; thread 0: the counter and
// the error word) and every thread runs one `fence.acq_rel.sys` while they fly. Thread 0 then hands
// epoch e = counter + 1 (or `broken`) to the warp by shuffles (no shared memory, no block barrier). Thread
// t < G announces e to member t (a relaxed store into peer_flags[t][me]: fence + store in one thread is a
// release) and waits for member t's announcement in own_flags[t], every poll an `ld.acquire.sys`, so the
// poll that sees it is the acquire that pairs with the member's release (2.23 against 2.35 µs captured for
// relaxed polling, a block barrier and one acquire after, stress clean: bench/results/h200x2/
// tune_variants.json, v12_shfl_acqpoll). Past `timeout_ns` (%globaltimer) it records the missing member in `err`:
// err[0] = the epoch that timed out (atomicMax), err[1] |= 1 << t, and sets *host_flag = 1 (mapped
// host memory, so the host learns of a timeout without a copy). No __trap: the process must live to
// report. On sm_90+ the host launches it with programmatic stream serialization: the next barrier is
// scheduled while this one runs and waits in `griddepcontrol.wait` (hides the launch latency in graphs
// and eager loops). A broken barrier stays broken: a launch that finds err[1] != 0 returns at once, so a graph of
// K barriers after a drop costs one timeout, not K.
//
// Why it is correct (PTX memory model). Contract: what this GPU wrote before the barrier (earlier kernels
// in stream order, local or through peer pointers) is visible to every member that passes it.
// - Release: member t passes only once it reads epoch >= e in its slot `me`, written by our thread t with
//   `st.relaxed.sys` after that same thread's `fence.acq_rel.sys`: a release pattern. Earlier kernels'
//   writes precede that fence in causality order (stream order, or `griddepcontrol.wait`, which returns
//   only once the previous grid ended and its writes are visible), and the fence is cumulative, so they
//   are ordered before the flag at system scope. Which thread fences does not matter, only that the
//   thread that stores to member t fenced first: no flag store is issued by a thread without a fence.
// - Acquire: our `ld.acquire.sys` poll read >= e, so it synchronizes with the member's release of that
//   epoch or a later one (a later one also follows the member's earlier writes). Every thread t < G acquires from member t
//   before the kernel ends, and the next kernel on the stream starts after the end (or, programmatic,
//   only past its own `griddepcontrol.wait`), so every member's writes are visible to it.
// - Epoch and error word: only thread 0 reads and writes `counter` and reads err[1], after
//   `griddepcontrol.wait` (the previous barrier's increment and timeout record are visible), and two
//   `__shfl_sync` from lane 0 hand e / broken to the other threads (the block is one full warp: every lane
//   reaches both) before any of them stores or waits. Epochs
//   grow by one per launch and flags only grow, so `>= e` is never satisfied by an old announcement.
// - Timeout / broken: thread t waits for member t alone and sets bit t alone, so the mask names exactly
//   the members whose announcement did not arrive in time; its own store went out first, so the others
//   are not held up by the waiting side. A broken barrier stores nothing and waits for nothing: err keeps
//   the first timeout's epoch and mask for the host to report.

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
    const int t = threadIdx.x;
#if __CUDA_ARCH__ >= 900
    // Launched with programmatic stream serialization, the next barrier may be scheduled now; it
    // waits here until this one has ended and its memory operations are visible. Without a
    // programmatic dependency both instructions do nothing.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    // Every load the barrier needs is issued at once: member t's flags address (thread t < G), the epoch
    // counter and the error word (thread 0).
    unsigned long long* const peer = t < G ? peer_flags[t] + me : nullptr;
    unsigned long long c = 0ull;
    unsigned long long missing = 0ull;
    if (t == 0) {
        c = *counter;
        missing = *(volatile unsigned long long*)&err[1];
    }
    // The release: each thread's fence orders what this GPU wrote before the barrier (earlier kernels
    // included) before that thread's flag store below (fence + store in one thread is a release). The
    // warp executes it once, while the loads above are still in flight.
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    // Thread 0 hands the epoch and `broken` to the warp in registers (the block is one full warp: every lane
    // reaches both shuffles): no shared-memory round trip, no block barrier.
    if (t == 0 && missing == 0ull) {
        *counter = c + 1ull;
    }
    const unsigned long long e = __shfl_sync(0xFFFFFFFFu, c + 1ull, 0);
    const unsigned long long broken = __shfl_sync(0xFFFFFFFFu, missing, 0);
    if (broken != 0ull || t >= G) {
        return;
    }
    st_relaxed_sys(peer, e);
    const unsigned long long* flag = own_flags + t;
    if (ld_acquire_sys(flag) < e) {
        const unsigned long long start = globaltimer_ns();
        while (ld_acquire_sys(flag) < e) {
            if (globaltimer_ns() - start > timeout_ns) {
                atomicOr(&err[1], 1ull << t);
                atomicMax(&err[0], e);
                *(volatile unsigned int*)host_flag = 1u;
                return;
            }
        }
    }
    // the acquire that saw epoch >= e pairs with member t's release: its earlier writes are visible now
}
