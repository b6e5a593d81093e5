// Attention dropout in the sm_80 and Hopper kernels, forward and backward. An element's keep bit is
// philox.cuh's draw at its place (the (batch, head) pair, the query's and the key's token), so
// every kernel and every tiling drops the same weights; the kept ones are scaled by 1 / (1 - p)
// (the kernels' drop_rescale). The call's seed and Philox offset are read from device memory
// (rng[0], the low 32 bits of rng[1]) as each block starts: a replayed plan or a captured CUDA
// graph draws with the values there at the launch.
#pragma once
#include "philox.cuh"

namespace cuk {
namespace attention {

struct DropoutDraw {
    unsigned long long seed;
    unsigned int offset, threshold;

    __device__ __forceinline__ static DropoutDraw load(const long long* rng, unsigned int threshold)
    {
        return DropoutDraw{static_cast<unsigned long long>(rng[0]), static_cast<unsigned int>(rng[1]), threshold};
    }

    // Whether the 16-bit half of word w at bit `shift` (0 or 16) keeps its weight; both halves
    // (bits 0 and 1).
    __device__ __forceinline__ unsigned int kept_half(unsigned int w, unsigned int shift) const
    {
        return ((w >> shift) & 0xFFFFu) >= threshold ? 1u : 0u;
    }

    __device__ __forceinline__ unsigned int kept_halves(unsigned int w) const
    {
        return ((w & 0xFFFFu) >= threshold ? 1u : 0u) | ((w >> 16) >= threshold ? 2u : 0u);
    }

    // The seed's halves and the offset as three words of shared memory, written once a block and
    // read at each draw (held in registers across the kernels' loops they spilled), and back.
    __device__ __forceinline__ void stash(unsigned int* words) const
    {
        words[0] = static_cast<unsigned int>(seed), words[1] = static_cast<unsigned int>(seed >> 32);
        words[2] = offset;
    }

    __device__ __forceinline__ static DropoutDraw stashed(const unsigned int* words, unsigned int threshold)
    {
        return DropoutDraw{words[0] | static_cast<unsigned long long>(words[1]) << 32, words[2], threshold};
    }

    // The keep bits of keys base + 8 j and base + 8 j + 1, j < NJ, of query `row` in (batch, head)
    // pair bh: bits 2 j and 2 j + 1 (a thread's keys of a row in mma.sync's layout, base = the
    // first key + 2 t). A Philox call serves the pairs of 32 keys: it is drawn again only where
    // the pairs cross into the next 32 (a sub-tile of 16 keys draws once for two pairs). An odd
    // base (packed documents that start at an odd token) draws each key on its own.
    template <int NJ>
    __device__ __forceinline__ unsigned int keep_pairs(unsigned int bh, unsigned int row, unsigned int base) const
    {
        const unsigned int lo = static_cast<unsigned int>(seed), hi = static_cast<unsigned int>(seed >> 32);
        unsigned int bits = 0;
        if (base & 1u) {
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const unsigned int key = base + 8u * j;
                const unsigned int odd = dropout_keep2(seed, offset, bh, row, key - 1u, threshold) >> 1;
                const unsigned int even = dropout_keep2(seed, offset, bh, row, key + 1u, threshold) & 1u;
                bits |= (odd | (even << 1)) << (2 * j);
            }
            return bits;
        }
        Philox4 r{0u, 0u, 0u, 0u};
        unsigned int drawn = ~0u;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const unsigned int key = base + 8u * j;
            const unsigned int call = dropout_call(key);
            if (call != drawn) {
                r = philox4x32_10(Philox4{call, row, bh, offset}, lo, hi);
                drawn = call;
            }
            const unsigned int w = dropout_word(r, key);
            bits |= kept_halves(w) << (2 * j);
        }
        return bits;
    }

    // keep_pairs where the first key is a multiple of 32 (dense tiles of 64 or 128 keys): the
    // calls fall at every fourth pair and pair j takes word j % 4, both known when compiled, so
    // nothing is tested between draws (the general form's tests were a third of its work a key
    // in the Hopper forward). base = key0 + 2 t.
    template <int NJ>
    __device__ __forceinline__ unsigned int keep_pairs_aligned(unsigned int bh, unsigned int row, unsigned int key0,
                                                               unsigned int t) const
    {
        static_assert(NJ % 4 == 0, "whole calls: 32 keys each");
        const unsigned int lo = static_cast<unsigned int>(seed), hi = static_cast<unsigned int>(seed >> 32);
        unsigned int bits = 0;
#pragma unroll
        for (int c = 0; c < NJ / 4; ++c) {
            const Philox4 r = philox4x32_10(Philox4{((key0 >> 5) + c) * 4 + t, row, bh, offset}, lo, hi);
            const unsigned int w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int m = 0; m < 4; ++m)
                bits |= kept_halves(w[m]) << (8 * c + 2 * m);
        }
        return bits;
    }

    // The keep bits of the Hopper backward's transposed scores (S^T: key rows): a thread of
    // quad row g, column t holds keys key0 and key0 + 8 (key0 = 16 k + g) of queries
    // m0 + 8 j + 2 t + c, score 4 j + 2 r + c at bit (4 j + 2 r + c) % 32 of keep[j / 8]. One call
    // (query, key0's 32) serves both keys of a column and those of the quad partner g ^ 1 (the
    // other half of each word): each of the two draws the calls of its own column parity c = g & 1
    // and hands the partner's bits over by one shuffle a word. A warp-wide call.
    template <int KW>
    __device__ __forceinline__ void keep_transposed(unsigned int (&keep)[KW], unsigned int bh, int m0, int key0, int g,
                                                    int t) const
    {
        const unsigned int lo = static_cast<unsigned int>(seed), hi = static_cast<unsigned int>(seed >> 32);
        const unsigned int par = g & 1, mine = 16 * par, theirs = 16 - mine;
        const unsigned int call = dropout_call(static_cast<unsigned int>(key0));
        const bool upper = (key0 >> 4) & 1;   // (words z and w: keys 16.. of the 32)
#pragma unroll
        for (int w = 0; w < KW; ++w) {
            unsigned int own = 0, give = 0;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                const unsigned int q = m0 + 8 * (8 * w + jj) + 2 * t + par;
                const Philox4 r = philox4x32_10(Philox4{call, q, bh, offset}, lo, hi);
                const unsigned int wa = upper ? r.z : r.x, wb = upper ? r.w : r.y;
                const int bit = 4 * jj + par;
                own |= kept_half(wa, mine) << bit;
                own |= kept_half(wb, mine) << (bit + 2);
                give |= kept_half(wa, theirs) << bit;
                give |= kept_half(wb, theirs) << (bit + 2);
            }
            keep[w] = own | __shfl_xor_sync(0xffffffffu, give, 4);
        }
    }
};

}  // namespace attention
}  // namespace cuk
