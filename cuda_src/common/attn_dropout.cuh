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

    // The keep bits of the Hopper backward's transposed scores (S^T: key rows), its K and V rows
    // in DropoutKeyOrder (below): a thread of quad row g, column t holds keys key0 (its row g's)
    // and key0 + 16 (row g + 8's) of queries m0 + 8 j + 2 t + c, score e = 2 row + c of column
    // group j. The four threads of a column whose keys share their calls (rows g, g ^ 1, g ^ 4,
    // g ^ 5: lanes 4 and 16 apart) hold the eight keys of each: each draws one of the four calls
    // of a pair of column groups (its `me`: j's parity, c), an eighth of a call a score, keeps
    // the bits for each of the four as one byte (two a call: the word and half of each of its
    // keys) and a 4 x 4 transpose of the bytes, two shuffles, hands them out. Score i = 4 j + e
    // (j < BM / 8) at bit keep_rows_bit(i % 32) of keep[i / 32]. A warp-wide call.
    template <int KW>
    __device__ __forceinline__ void keep_rows(unsigned int (&keep)[KW], unsigned int bh, int m0, int key0, int g,
                                              int t) const
    {
        const unsigned int lo = static_cast<unsigned int>(seed), hi = static_cast<unsigned int>(seed >> 32);
        const int me = 2 * (g >> 2) + (g & 1);
        const unsigned int call = dropout_call(static_cast<unsigned int>(key0));
        const unsigned int pick1 = me & 1 ? 0x3715u : 0x6240u, pick2 = me & 2 ? 0x3276u : 0x5410u;
#pragma unroll
        for (int w = 0; w < KW; ++w) {
            unsigned int bytes = 0;   // (byte `to`: the bits for thread `to` of the four)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const unsigned int q = m0 + 8 * (8 * w + 2 * jj + (me >> 1)) + 2 * t + (me & 1);
                const Philox4 r = philox4x32_10(Philox4{call, q, bh, offset}, lo, hi);
                const unsigned int word[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
                for (int to = 0; to < 4; ++to) {
                    bytes |= kept_half(word[to >> 1], 16 * (to & 1)) << (8 * to + 2 * jj);
                    bytes |= kept_half(word[(to >> 1) + 2], 16 * (to & 1)) << (8 * to + 2 * jj + 1);
                }
            }
            // (byte b of thread me <-> byte me of thread b: the index bits swapped one at a time)
            bytes = __byte_perm(bytes, __shfl_xor_sync(0xffffffffu, bytes, 4), pick1);
            keep[w] = __byte_perm(bytes, __shfl_xor_sync(0xffffffffu, bytes, 16), pick2);
        }
    }

    // keep_rows' bit of score i = 4 j + e (j < 8) of a word: byte 2 (j % 2) + e % 2 (the thread
    // that drew it), bit 2 (j / 2) + e / 2 of it
    __host__ __device__ static constexpr int keep_rows_bit(int i)
    {
        return 8 * (2 * ((i >> 2) & 1) + (i & 1)) + 2 * ((i >> 3) & 3) + ((i >> 1) & 1);
    }
};

// The Hopper backward's order of K's and V's rows under dropout: row s = 32 a + 16 h + 4 m + r
// of a tile holds key 32 a + 8 m + 4 h + r, so that a warp's 16 rows (h: its index's parity)
// hold all eight keys of every Philox call it needs (keys 8 m + 2 t' + c of a 32, t' = 2 h + r /
// 2), and each thread's two rows hold keys 16 apart of one call (DropoutDraw::keep_rows). A
// permutation within each 32 rows; the row's key (ON = false: the row's own, key order).
template <bool ON = true>
struct DropoutKeyOrder {
    __host__ __device__ constexpr int operator()(int s) const
    {
        return ON ? (s & ~31) | ((s & 12) << 1) | ((s >> 2) & 4) | (s & 3) : s;
    }
};

}  // namespace attention
}  // namespace cuk
