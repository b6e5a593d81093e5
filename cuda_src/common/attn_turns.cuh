// dQ's adds in turns (deterministic=True on Hopper): which turn a key block takes at a query tile.
// Shared by attention_bwd_sm90 and attention_bwd_sm90_d256 (see their ORDERED instances).
#pragma once

namespace cuk {
namespace attention {

// Key block `kblock`'s turn at query tile m of a head (see the kernels' tops): without a mask
// (MASK 0) the blocks in the order they reach the tile, counted from the last block whose walk
// starts at or before it; with one, from the highest key block that sees it (`hi`: KeyMask's,
// the last key a query row sees past its own index; the blocks that see a tile are consecutive,
// up to that one).
template <int MASK, int BM, int BN>
__device__ __forceinline__ int dq_turn(int m, int kblock, int nblocks, int per_head, int hi) {
    // (32-bit: query tiles times key blocks, and rows plus `hi`, stay far below 2^31; the 64-bit
    // division spilled the writer's 24 registers)
    int last;
    if constexpr (MASK == 0) {
        last = min(nblocks - 1, ((m + 1) * nblocks - 1) / per_head);
    } else {
        last = min(nblocks - 1, ((m + 1) * BM + hi - 1) / BN);
    }
    const int turn = last - kblock;
    return MASK == 0 && turn < 0 ? turn + nblocks : turn;
}

}  // namespace attention
}  // namespace cuk
