// peer_fill: a test kernel. Member `me` writes a pattern into its own slot of every member's buffer.
//
// `peers[g]` is member g's buffer as mapped here (u32 words, G slots of `words_per_slot` each).
// For every member g and every i < words_per_slot, this kernel writes
//
//     peers[g][me * words_per_slot + i] = (seed * 0x9E3779B1u) ^ (me << 24) ^ (g << 16) ^ i
//
// in uint32 arithmetic (wrapping; i is truncated to 32 bits). 0x9E3779B1 is the 32-bit golden-ratio
// constant, so different seeds give unrelated patterns. After a barrier every member can check all G
// slots of its own buffer: slot s must hold the pattern of writer s with g = itself. Any grid and block
// shape works (grid-stride loop over G * words_per_slot words).

extern "C" __global__ void tray_peer_fill(unsigned int* const* peers,
                                          int G,
                                          int me,
                                          unsigned long long words_per_slot,
                                          unsigned int seed) {
    const unsigned long long total = (unsigned long long)G * words_per_slot;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned int base = (seed * 0x9E3779B1u) ^ ((unsigned int)me << 24);
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += stride) {
        const unsigned long long g = k / words_per_slot;
        const unsigned long long i = k - g * words_per_slot;
        const unsigned int value = base ^ ((unsigned int)g << 16) ^ (unsigned int)i;
        peers[g][(unsigned long long)me * words_per_slot + i] = value;
    }
}
