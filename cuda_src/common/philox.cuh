// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC'11; Random123's constants): four 32-bit words
// from a 128-bit counter and a 64-bit key, a pure function, so a kernel draws any element's
// random word without state and a second kernel (the backward) draws the same one. The same code
// compiles for the device and, without CUDA, for the host (tests/test_philox.py holds it to the
// published known answers and to cukern/_philox.py, the NumPy twin the references use).
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define CUK_PHILOX_FN __host__ __device__ __forceinline__
#else
#define CUK_PHILOX_FN inline
#endif

namespace cuk {

struct Philox4 {
    unsigned int x, y, z, w;
};

CUK_PHILOX_FN void philox_mulhilo(unsigned int a, unsigned int b, unsigned int& hi, unsigned int& lo)
{
    const unsigned long long p = static_cast<unsigned long long>(a) * b;
    hi = static_cast<unsigned int>(p >> 32);
    lo = static_cast<unsigned int>(p);
}

// The ten rounds: each multiplies two words by the round constants, swaps halves and mixes in
// the key, which is bumped by the Weyl constants between rounds.
CUK_PHILOX_FN Philox4 philox4x32_10(Philox4 c, unsigned int k0, unsigned int k1)
{
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned int hi0, lo0, hi1, lo1;
        philox_mulhilo(0xD2511F53u, c.x, hi0, lo0);
        philox_mulhilo(0xCD9E8D57u, c.z, hi1, lo1);
        c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    }
    return c;
}

// Attention dropout's keep bits: element (row i, key j) of (batch, head) pair bh in the call whose
// generator position is (seed, offset) is kept when word j % 4 of
// philox(counter (j / 4, i, bh, offset), key seed) is at least `threshold` (= the drop
// probability times 2^32). A function of the indices alone: any tiling, forward or backward, on
// any kernel, draws the same mask. Returns the keep bits of keys 4 * (j / 4) ... + 3 in bits 0..3.
CUK_PHILOX_FN unsigned int dropout_keep4(unsigned long long seed, unsigned int offset, unsigned int bh, unsigned int i,
                                         unsigned int j, unsigned int threshold)
{
    const Philox4 r = philox4x32_10(Philox4{j >> 2, i, bh, offset}, static_cast<unsigned int>(seed),
                                    static_cast<unsigned int>(seed >> 32));
    return (r.x >= threshold ? 1u : 0u) | (r.y >= threshold ? 2u : 0u) | (r.z >= threshold ? 4u : 0u) |
           (r.w >= threshold ? 8u : 0u);
}

}  // namespace cuk

#undef CUK_PHILOX_FN
