// Expert groups of rows for the grouped products (moe_grouped_mm.cu, moe_grouped_mm_sm90.cu):
// expert e's rows are offsets[e]:offsets[e + 1] (moe_permute's offsets, on the device), and the
// rows after offsets[E] are a last group (E). A grid covers an upper bound of the groups' row
// tiles (rows / BM + experts + 1); a block finds its group and tile by one warp's scan of the
// tile counts, and blocks past the last tile get group -1.
#pragma once
#include "fault.cuh"

namespace cuk {
namespace moe_groups {

// Expert e's rows [lo, hi) (e == experts: the rows after the last expert), clamped to
// [0, rows]; offsets out of order or outside [0, rows] are recorded (kind 6) when `fault` is given.
__device__ __forceinline__ void group_rows(const int* __restrict__ offsets, int e, int experts, int rows,
                                           long long* __restrict__ fault, int& lo, int& hi) {
    const int a = e == 0 ? 0 : offsets[e];
    const int b = e == experts ? rows : offsets[e + 1];
    if (fault != nullptr && ((e == 0 && offsets[0] != 0) || a < 0 || b < a || b > rows))
        record_fault(fault, e, rows, 6);
    lo = min(max(a, 0), rows);
    hi = min(max(b, lo), rows);
}

// (one whole warp) The group and the row tile within it of tile number `target`, counting each
// group's ceil(rows / BM) tiles in order: group -1 when `target` is past the last tile.
template <int BM>
__device__ __forceinline__ void find_row_tile(const int* __restrict__ offsets, int experts, int rows, int target,
                                              long long* __restrict__ fault, int& found, int& tile) {
    const int lane = threadIdx.x & 31;
    int run = 0;
    found = -1;
    tile = 0;
    for (int base = 0; base <= experts; base += 32) {
        const int e = base + lane;
        int tiles = 0;
        if (e <= experts) {
            int lo, hi;
            group_rows(offsets, e, experts, rows, fault, lo, hi);
            tiles = (hi - lo + BM - 1) / BM;
        }
        int incl = tiles;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int excl = incl - tiles;
        const unsigned hit = __ballot_sync(0xffffffffu, tiles > 0 && target >= run + excl && target < run + incl);
        if (hit) {
            const int src = __ffs(hit) - 1;
            found = base + src;
            tile = target - run - __shfl_sync(0xffffffffu, excl, src);
            return;
        }
        run += __shfl_sync(0xffffffffu, incl, 31);
    }
}

}  // namespace moe_groups
}  // namespace cuk
