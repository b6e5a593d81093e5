// dQ's adds in turns (deterministic=True on Hopper): which turn a key block takes at a query tile,
// the walk its writers follow, and a writer's loop. Shared by attention_bwd_sm90,
// attention_bwd_sm90_d256 and attention_bwd_sm90_mla (see their ORDERED instances).
#pragma once
#include "sm90_tma.cuh"

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

// A block's walk of its (head, query tile) steps as its dQ writers follow it: tile m of head h,
// from m_first + rot around the head's per_head tiles, then the next head's.
struct TileWalk {
    int m, h, in_head, m_first, per_head;
    __device__ __forceinline__ TileWalk(int m_first_, int rot, int h0, int per_head_)
        : m(m_first_ + rot), h(h0), in_head(0), m_first(m_first_), per_head(per_head_) {}
    __device__ __forceinline__ void next() {   // (m is back at the head's first tile at its end)
        if (++m == m_first + per_head) m = m_first;
        if (++in_head == per_head) {
            in_head = 0;
            ++h;
        }
    }
};

// A dQ writer (a lane of the producer warpgroup): writer j of WRITERS takes steps j, j + WRITERS,
// ... of the block's `steps`, walking its tiles with `walk` (at the block's first step). A step:
// `full(it)` waits for the staged rows; ORDERED waits for the tile's turn (its counter at
// turns[(bh + walk.h) * tiles + tile0 + walk.m], bh = b * H); `adds(walk, it)` issues the TMA
// reduce-adds; once they have read the stage, `freed(it)`; ORDERED, once they are complete, the
// turn passes on.
template <int MASK, int BM, int BN, bool ORDERED, int WRITERS, typename Full, typename Adds, typename Freed>
__device__ __forceinline__ void dq_writer(int j, TileWalk walk, int steps, int* turns, int bh, int tiles, int tile0,
                                          int kblock, int nblocks, int hi, Full full, Adds adds, Freed freed) {
    if (j > 0) walk.next();
    for (int it = j; it < steps; it += WRITERS) {
        full(it);
        const int at = (bh + walk.h) * tiles + tile0 + walk.m;
        if constexpr (ORDERED)
            turn_wait(turns + at, dq_turn<MASK, BM, BN>(walk.m, kblock, nblocks, walk.per_head, hi));
        adds(walk, it);
        tma_store_commit();
        tma_store_wait_read<0>();
        freed(it);
        if constexpr (ORDERED) {
            tma_store_wait<0>();   // (the adds are complete: the turn passes on)
            turn_pass(turns + at);
        }
#pragma unroll
        for (int i = 0; i < WRITERS; ++i) walk.next();
    }
}

}  // namespace attention
}  // namespace cuk
