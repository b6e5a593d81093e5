// Attention dropout in the sm_80 kernels, forward and backward. An element's keep bit is
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

    // The keep bits of keys `key` and key + 1 of query `row` in (batch, head) pair bh: bits 0
    // and 1. One Philox call serves four keys; a pair that straddles two calls' keys (an odd
    // first key: packed documents) takes two.
    __device__ __forceinline__ unsigned int keep2(unsigned int bh, unsigned int row, unsigned int key) const
    {
        const unsigned int w = dropout_keep4(seed, offset, bh, row, key, threshold) >> (key & 3u);
        if ((key & 3u) != 3u) return w & 3u;
        return (w & 1u) | ((dropout_keep4(seed, offset, bh, row, key + 1u, threshold) & 1u) << 1);
    }
};

}  // namespace attention
}  // namespace cuk
