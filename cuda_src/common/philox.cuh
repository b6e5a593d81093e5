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

// Attention dropout's draw. Element (row i, key j) of (batch, head) pair bh in the call whose
// generator position is (seed, offset) takes a 16-bit half of one of four words: the call
// counter (dropout_call(j), i, bh, offset), key seed; word (j / 8) % 4; the low half for an even
// j, the high for an odd one. So one Philox call serves the 8 keys an mma.sync thread holds of a
// row in 32 keys (j = 8 m + 2 t + c, m < 4, c < 2: thread t of a quad), and it is kept when its
// half is at least `threshold` (the drop probability times 2^16). A function of the indices
// alone: any tiling, forward or backward, on any kernel, draws the same mask.
CUK_PHILOX_FN unsigned int dropout_call(unsigned int j) { return ((j >> 5) << 2) | ((j >> 1) & 3u); }

CUK_PHILOX_FN unsigned int dropout_word(const Philox4& r, unsigned int j)
{
    const unsigned int w = (j >> 3) & 3u;
    return w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w;
}

// The keep bits of keys j and j + 1 (j even: one word) of row i: bits 0 and 1.
CUK_PHILOX_FN unsigned int dropout_keep2(unsigned long long seed, unsigned int offset, unsigned int bh, unsigned int i,
                                         unsigned int j, unsigned int threshold)
{
    const Philox4 r = philox4x32_10(Philox4{dropout_call(j), i, bh, offset}, static_cast<unsigned int>(seed),
                                    static_cast<unsigned int>(seed >> 32));
    const unsigned int w = dropout_word(r, j);
    return ((w & 0xFFFFu) >= threshold ? 1u : 0u) | ((w >> 16) >= threshold ? 2u : 0u);
}

}  // namespace cuk

#undef CUK_PHILOX_FN
