// Sums over a group of G consecutive threads that together own one row.
//
// G <= 32: the group lives inside one warp and reduces with shuffles.
// G  > 32: the group is the whole block (G == blockDim.x) and reduces through shared memory.
// The order of additions is fixed by the thread layout, so results are bitwise reproducible.
#pragma once

namespace cuk {

// -inf (the identity of max) without <cuda/std/limits>: no include paths under NVRTC.
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

template <int G, int K>
__device__ __forceinline__ void warp_group_sum(float (&v)[K]) {
#pragma unroll
    for (int offset = (G < 32 ? G : 32) / 2; offset > 0; offset /= 2) {
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
    }
}

// Sums K values over the group; every thread of the group gets the totals.
// For G > 32, `scratch` must hold K * (G / 32) floats and no other thread of the block may
// be using it; the function begins and ends with a barrier so it can be called repeatedly.
template <int G, int K>
__device__ __forceinline__ void group_sum(float (&v)[K], float* scratch) {
    warp_group_sum<G, K>(v);
    if constexpr (G > 32) {
        constexpr int WARPS = G / 32;
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        __syncthreads();  // scratch may still be read by a previous call
        if (lane == 0) {
#pragma unroll
            for (int k = 0; k < K; ++k) scratch[k * WARPS + warp] = v[k];
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < K; ++k) {
            float t = lane < WARPS ? scratch[k * WARPS + lane] : 0.f;
            // WARPS <= 32: a second shuffle tree over the per-warp partials, same in every warp.
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) t += __shfl_xor_sync(0xffffffffu, t, offset);
            v[k] = t;
        }
    }
}

}  // namespace cuk
