// Fused attention forward on Hopper (sm_90a) (docs/notes-attention.md, the Hopper steps): TMA
// tile loads and wgmma, with the scheduling options listed at the kernel.
//
// A block of CONSUMERS (2 or 3) warpgroups computes BM = 64 CONSUMERS query rows (64 a
// warpgroup) of one (batch, head) against all keys. Q and K have head dim D, V and O the value
// head size DV (D but for DeepSeek's MLA: 192 and 128). Thread 0 (with PRODUCER, a thread of a
// third warpgroup) brings Q once and each key/value tile of BN keys by TMA (128-byte swizzle, 64
// head-dim columns a box) into a ring of STAGES buffers, with "landed" and "released" mbarriers
// a buffer (no block barrier in the loop: the warpgroups drift apart). Each
// warpgroup computes S = Q K^T with wgmma from shared memory (both operands K-major), the online
// softmax in registers (the accumulator layout is mma.sync's, so the FA2 kernel's row logic
// carries over), and O += P V with P from registers and V read MN-major as stored. O is written
// by way of shared memory (store_tile_staged).
//
// OVERLAP is FlashAttention-3's intra-warpgroup overlap: the softmax of tile j runs while the
// tensor cores finish P V of tile j - 1. ptxas hoists a wgmma wait above arithmetic, so the
// softmax's row sums (and, with P_AHEAD, the packed P) are stored to shared memory before the
// wait (keep_before_wait), which it does not cross (docs/notes-attention.md, step 5).
#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/hopper.cuh"
#include "common/attn_tile.cuh"
#include "common/attn_mask.cuh"
#include "common/attn_params.cuh"
#include "common/attn_sink.cuh"
#include "common/attn_dropout.cuh"
#include "common/trace.cuh"

namespace cuk {
namespace attention {

// attention_fwd_sm90's parameters besides the tensor maps: O (B, Sq, H, D) with its strides in
// elements (batch, sequence, head), lse (B, H, Sq) float32 (null: not written), the sinks (H)
// float32 (null: none; common/attn_sink.cuh), the count of work tiles and the causal persistent walk's counter (zero at launch) and section size, the
// problem, and dropout's (DROPOUT instances; common/attn_dropout.cuh): the seed and offset (2,)
// int64, the drop threshold (p 2^16) and 1 / (1 - p).
template <typename T>
struct FwdSm90Params {
    T* out;
    float* lse;
    const float* sinks;
    long long o_sb, o_ss, o_sh;
    int tiles;
    int* tile_counter;
    int section_pairs;
    Problem problem;
    const long long* drop_rng;
    unsigned int drop_threshold;
    float drop_rescale;
};

}  // namespace attention
}  // namespace cuk
// (CUK_TRACE: phases of warpgroups 0 and 1 of each block, slots 6 wg + i, i = 0 entry, 1 Q landed,
// 2 the first S done, 3 its softmax done, 4 the last P V done, 5 O written)
#define CUK_STAMP(i) CUK_TRACE_STAMP(threadIdx.x % 128 == 0 && wg < 2, 6 * wg + (i), wg == 0 && (i) == 0)

// SMEM: the launch's dynamic shared memory: Q, STAGES K and V tiles, 1 KB of alignment slack.
// MASK: 0 none, 1 causal, 2 a window (win_left, win_right; its key tiles only, from kb0).
// DROPOUT: the weights, after their row sum is taken, are dropped by common/attn_dropout.cuh's
// draw (the accumulator layout is mma.sync's, so a Philox call serves a thread's 8 keys of a row
// in 32, as in attention_fwd) and O is scaled by drop_rescale at the end.
// Scheduling options (docs/notes-attention.md has what each measured):
//   PRODUCER  a third warpgroup, one thread of which issues every TMA load (K/V refills wait
//             for releases there, not in warpgroup 0's path); 384 threads, the producer down to
//             24 registers and the consumers up to 240 (setmaxnreg; PERSISTENT: 40 and 224, or 32 and
//             160 with three consumers, as its producer decodes work tiles).
//   BLOCKS    2: two blocks an SM of two consumers, so that one block's softmax and waits are
//             filled by the other's products. Without a producer every thread has 128 registers
//             (16 warps an SM: four a sub-partition), which hold 128-key tiles at d64; with one,
//             24 and 104 (the launch gives 80: six warps a sub-partition).
//   PINGPONG  the warpgroups take turns issuing S = Q K^T (FlashAttention-3's scheduler barriers).
//   OVERLAP   S of tile j is issued with P V of tile j - 1, and tile j's softmax runs between
//             their waits (a buffer is released a tile later: STAGES = 3, or PRODUCER).
//   PERSISTENT one block an SM walks the work tiles (`tiles` of them). Without a mask, round
//             robin, the row tile fastest (every tile costs the same); causal, handed out by an
//             atomic counter (`tile_counter`, zero at launch), in the order of `enter` (the longest
//             first within L2 sections, as blocks one a tile are). The K/V ring runs on across
//             tiles; the next tile's Q is loaded once every warpgroup's last S is done
//             (bar_q_free), and O is staged in the last key tile's K buffer instead of Q's and
//             written by a TMA store (o_map; unused otherwise), the buffer released once it is
//             read, after the next work tile's first S is issued. Where a K tile is shorter than
//             the block's rows, O has a buffer of its own instead (OWN_O).
template <typename T, int D, int DV, int BN, int STAGES, int CONSUMERS, int MASK, bool SOFTCAP, bool PRODUCER, bool PINGPONG, bool OVERLAP, bool PERSISTENT, int BLOCKS, int SMEM, bool VARLEN, bool DROPOUT>
__device__ __forceinline__ void attention_fwd_sm90_body(
    const CUtensorMap& q_map, const CUtensorMap& k_map,
    const CUtensorMap& v_map, const CUtensorMap& o_map, T* __restrict__ out,
    float* __restrict__ lse, const float* __restrict__ sinks,
    long long o_sb, long long o_ss, long long o_sh, int H, int Hkv, int Sq, int Sk, float scale_log2, int tiles,
    int* __restrict__ tile_counter, int section_pairs, float cap_in, float cap_out, int win_left, int win_right,
    const int* __restrict__ cu_q, const int* __restrict__ cu_k, int max_q, int max_k, long long* __restrict__ fault,
    const long long* __restrict__ drop_rng, unsigned int drop_threshold, float drop_rescale)
{
    // query rows a block; 64-column boxes of Q and K (D), of V and O (DV: the value head size)
    constexpr int BM = 64 * CONSUMERS, DB = D / 64, DBV = DV / 64;
    constexpr int THREADS = CONSUMERS * 128;                // the computing threads
    constexpr int Q_BOX = BM * 128, KV_BOX = BN * 128;      // bytes of one box (rows x 128 bytes)
    constexpr int Q_BYTES = DB * Q_BOX, K_BYTES = DB * KV_BOX, V_BYTES = DBV * KV_BOX;
    // (persistent, with key tiles shorter than the block's rows: O staged in a buffer of its own)
    constexpr bool OWN_O = PERSISTENT && BN < BM;
    static_assert(SMEM == Q_BYTES + (OWN_O ? DBV * Q_BOX : 0) + STAGES * (K_BYTES + V_BYTES) + 1024,
                  "SMEM: Q, the K and V ring, O's own buffer, alignment slack");
    static_assert(D % 64 == 0 && D <= 256 && DV % 64 == 0 && DV <= D && BN % 16 == 0 && BN <= 256, "tile shapes");
    static_assert(STAGES >= 2 && STAGES <= 4, "STAGES");
    static_assert((CONSUMERS == 2 || CONSUMERS == 3) && (!PINGPONG || CONSUMERS == 2), "CONSUMERS");
    static_assert(!PERSISTENT || (PRODUCER && OVERLAP), "PERSISTENT: a producer and the overlap");
    static_assert(BLOCKS == 1 || (BLOCKS == 2 && CONSUMERS == 2 && !PERSISTENT), "BLOCKS");
    static_assert(!VARLEN || !PERSISTENT, "VARLEN: one work tile a block");
    static_assert(!DROPOUT || (!SOFTCAP && BN <= 128), "DROPOUT: no softcap; a row's keep bits in one word");
    // The consumers' registers (setmaxnreg): what the producer's give-back allows. Two blocks an SM
    // with a producer launch at 80 a thread; the producer's 24 let the consumers have 104.
    constexpr int CONSUMER_REGS = BLOCKS == 2 ? 104 : CONSUMERS == 3 ? 160 : PERSISTENT ? 224 : 240;
    // MASK (common/attn_mask.cuh): 0 none, 1 causal, 2 a window (LOCAL: its key tiles only).
    constexpr bool CAUSAL = MASK == cuk::attention::MASK_CAUSAL, LOCAL = MASK == cuk::attention::MASK_LOCAL;
    // Causal work tiles cost different amounts: handed out by an atomic counter, longest first.
    constexpr bool DYNAMIC = PERSISTENT && CAUSAL;
    // OVERLAP, two consumers, no turns: P packed ahead of the P V wait into a second fragment
    // array (32 registers more; measured 1.2-1.9% fewer cycles at d128 without a mask, 0.6% more
    // with the turns, and three consumers have no registers for it).
    // (Not past d128: at 192 and 256 P is taken after the wait, as FlashAttention-4 does.)
    constexpr bool P_AHEAD = OVERLAP && CONSUMERS == 2 && !PINGPONG && D <= 128;
    // SPLIT_KV, the overlap with a producer, one work tile a block: K and V of a ring slot land
    // and are released on barriers of their own (bar_kv and bar_free K's, bar_v and bar_v_free
    // V's). With one barrier a slot the overlap holds a slot until the P V a tile behind its S, so
    // that the next tile's load waits for it; K is done with once its S is.
    constexpr bool SPLIT_KV = OVERLAP && PRODUCER && !PERSISTENT && !VARLEN;
    // Without the overlap, P packed as the softmax takes it (the S accumulators die as they go)
    // where the tile is wider than 64 keys: S, P and O do not fit two blocks' 128 registers at once.
    constexpr bool PACK_IN_SOFTMAX = !OVERLAP && BN > 64;
    // Without a producer, the thread that refills the ring: with the turns, the first of warpgroup
    // 1, which runs behind warpgroup 0, so that its wait for a buffer's release finds it done
    // (thread 0 waited there for the other warpgroup on every tile: 5-9% slower at d64).
    constexpr int REFILLER = PINGPONG ? 128 : 0;
    // VARLEN without the overlap, under NVRTC 12: V's rows past the document are zeroed after the
    // softmax, where S's registers are free, rather than before the mask (ptxas 12.9 spilled 4
    // bytes at d64 with a window and the softcap, 128 registers a thread; NVRTC 13 keeps the order)
#if __CUDACC_VER_MAJOR__ < 13
    constexpr bool ZERO_V_LATE = VARLEN && !OVERLAP;
#else
    constexpr bool ZERO_V_LATE = false;
#endif
#if CUK_SM90A
    using namespace cuk;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* const q_s = align_1024(smem_raw);
    unsigned char* const k_s = q_s + Q_BYTES;               // [STAGES][DB][BN rows x 128 bytes]
    unsigned char* const v_s = k_s + STAGES * K_BYTES;      // [STAGES][DBV][BN rows x 128 bytes]
    unsigned char* const o_s = v_s + STAGES * V_BYTES;      // OWN_O: [DBV][BM rows x 128 bytes]
    // bar_kv: a buffer's tile has landed (TMA's bytes); bar_free: every consumer thread is done with it
    __shared__ unsigned long long bar_q, bar_q_free, bar_kv[STAGES], bar_free[STAGES];
    __shared__ unsigned long long bar_v[SPLIT_KV ? STAGES : 1], bar_v_free[SPLIT_KV ? STAGES : 1];
    __shared__ unsigned int ov_sink[OVERLAP ? THREADS : 1];
    __shared__ int tile_of[2];   // DYNAMIC: the producer's work tile k at k % 2
    // (DROPOUT: the seed's halves and the offset, read at each draw rather than held in registers
    // across the key loop, as attention_fwd does)
    __shared__ unsigned int drop_sh[DROPOUT ? 3 : 1];

    const int wg = warpgroup_index(), warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    CUK_STAMP(0);
    // VARLEN (packed documents): the block's document is blockIdx.y / H, its queries rows q0 ..
    // q0 + sq - 1 and its keys rows k0 .. k0 + sk - 1 of the one batch, its mask aligned to its
    // own end; a document with bad offsets is recorded as a fault and computes nothing.
    const attention::DocSpan span =
        VARLEN ? attention::doc_span_uniform(cu_q, cu_k, blockIdx.y / H, gridDim.y / H, Sq, Sk, max_q, max_k, fault)
               : attention::DocSpan{0, Sq, 0, Sk};
    const int sq = span.sq, sk = span.sk;
    const int diag = sk - sq, m_tiles = ((VARLEN ? max_q : sq) + BM - 1) / BM;   // (VARLEN: the grid's)
    const cuk::attention::KeyMask<MASK> window(win_left, win_right, diag);   // (LOCAL)
    // A work tile's (query tile, batch, head) and its count of key tiles. Tiles are numbered
    // (PERSISTENT: walked by each block; otherwise one a block, blockIdx.y major) without a mask
    // the query tile fastest; causal in sections of `section_pairs` (batch, head) pairs whose K
    // and V fit L2, the last (longest) query tile first within a section, then the pair: blocks
    // have different amounts of work and the longest start first.
    // (LOCAL: the work tile's key tiles are kb0 .. kb0 + n_blocks - 1; nb counts from kb0)
    int m_block, b, h, hk, m0, n_blocks, kb0 = 0;
    // (the work tile's sink, loaded as the tile is entered: loaded at the rows' end, its address
    // made 128-register instances spill)
    float sink_log2;
    const int pairs_total = tiles / m_tiles;
    auto enter = [&](int tile) {
        int bh;
        if (VARLEN) {   // (the grid's axes; causal: the last query tile first)
            m_block = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
            bh = blockIdx.y;
        } else if (!CAUSAL && !PERSISTENT) {   // (the same numbering, from the grid's axes)
            m_block = blockIdx.x;
            bh = blockIdx.y;
        } else if (!CAUSAL) {
            m_block = tile % m_tiles;
            bh = tile / m_tiles;
        } else {
            const int per_section = m_tiles * section_pairs, section = tile / per_section;
            const int r = tile - section * per_section, pairs = min(section_pairs, pairs_total - section * section_pairs);
            const int mi = r / pairs;
            bh = section * section_pairs + (r - mi * pairs);
            m_block = m_tiles - 1 - mi;
        }
        b = VARLEN ? 0 : bh / H, h = bh % H, hk = h / (H / Hkv), m0 = m_block * BM;
        sink_log2 = cuk::attention::sink_log2_of(sinks, h);
        n_blocks = (sk + BN - 1) / BN;
        if (CAUSAL) {
            const int last_key = min(sk - 1, m0 + BM - 1 + diag);
            n_blocks = last_key < 0 ? 0 : min(n_blocks, last_key / BN + 1);
        } else if (LOCAL) {
            const int stop = window.stop_key(m0, BM, sk), first = min(window.first_key(m0), stop);
            kb0 = max(0, first) / BN;
            n_blocks = stop > first ? (stop + BN - 1) / BN - kb0 : 0;
        }
    };
    const int first_tile = PERSISTENT ? blockIdx.x : blockIdx.y * gridDim.x + blockIdx.x;
    const int tile_step = PERSISTENT ? gridDim.x : 1;   // (one tile a block: the loop runs once)
    enter(first_tile);
    if (VARLEN && m0 >= sq) return;   // (past the document's queries: the whole block, before any barrier)

    if (threadIdx.x == 0) {
        if constexpr (DROPOUT) {
            const attention::DropoutDraw d = attention::DropoutDraw::load(drop_rng, drop_threshold);
            d.stash(drop_sh);
        }
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbarrier_init(&bar_kv[i], 1);
            mbarrier_init(&bar_free[i], THREADS);
            if constexpr (SPLIT_KV) {
                mbarrier_init(&bar_v[i], 1);
                mbarrier_init(&bar_v_free[i], THREADS);
            }
        }
        mbarrier_init(&bar_q, 1);
        mbarrier_init(&bar_q_free, THREADS);
        mbarrier_init_fence();
    }
    __syncthreads();
    // (the loading thread) box db of K or V of key tile nb of the current work tile into ring
    // slot buf, completing on barrier `bar`
    auto k_box = [&](int buf, int nb, int db, unsigned long long* bar) {
        tma_load_4d(k_s + buf * K_BYTES + db * KV_BOX, &k_map, db * 64, hk, span.k0 + (kb0 + nb) * BN, b, bar);
    };
    auto v_box = [&](int buf, int nb, int db, unsigned long long* bar) {
        tma_load_4d(v_s + buf * V_BYTES + db * KV_BOX, &v_map, db * 64, hk, span.k0 + (kb0 + nb) * BN, b, bar);
    };
    // (one barrier a slot) key tile nb into ring slot i % STAGES, K's and V's boxes in turn
    auto load_kv_at = [&](int i, int nb) {
        const int buf = i % STAGES;
        mbarrier_arrive_expect_tx(&bar_kv[buf], K_BYTES + V_BYTES);
#pragma unroll
        for (int db = 0; db < DB; ++db) {
            k_box(buf, nb, db, &bar_kv[buf]);
            if (db < DBV) v_box(buf, nb, db, &bar_kv[buf]);
        }
    };
    auto load_kv = [&](int nb) { load_kv_at(nb, nb); };
    auto load_q = [&]() {
        mbarrier_arrive_expect_tx(&bar_q, Q_BYTES);
#pragma unroll
        for (int db = 0; db < DB; ++db) tma_load_4d(q_s + db * Q_BOX, &q_map, db * 64, h, span.q0 + m0, b, &bar_q);
    };
    if constexpr (PERSISTENT) {
        // The producer: each work tile's Q (once the last one's is read), then its key tiles
        // into the ring, which runs on across work tiles.
        if (threadIdx.x >= THREADS) {
            setmaxnreg_dec<!PERSISTENT ? 24 : CONSUMERS == 3 ? 32 : 40>();   // (PERSISTENT: the producer decodes work tiles)
            if (threadIdx.x == THREADS) {
                int i = 0, tile = first_tile;
                for (int k = 0;; ++k) {
                    if (k > 0) mbarrier_wait(&bar_q_free, (k - 1) & 1);
                    if (DYNAMIC) tile_of[k & 1] = tile;   // (published by bar_q's phase k)
                    if (tile >= tiles) {
                        if (DYNAMIC) mbarrier_arrive(&bar_q);   // (no more: the consumers wake to stop)
                        break;
                    }
                    enter(tile);
                    load_q();
                    // the next work tile claimed now, so that the atomic's latency passes under this one
                    const int next = DYNAMIC ? gridDim.x + atomicAdd(tile_counter, 1) : tile + tile_step;
                    for (int nb = 0; nb < n_blocks; ++nb, ++i) {
                        if (i >= STAGES) mbarrier_wait(&bar_free[i % STAGES], (i / STAGES - 1) & 1);
                        load_kv_at(i, nb);
                    }
                    tile = next;
                }
            }
            return;
        }
        setmaxnreg_inc<CONSUMER_REGS>();
    } else {
        if (threadIdx.x == (PRODUCER ? THREADS : 0)) load_q();
        if constexpr (SPLIT_KV) {
            // K of tile nb + 1 before V of tile nb, each behind its own slot's release: V's wait
            // (for the P V STAGES tiles back) never holds back the K that the next S needs.
            if (threadIdx.x >= THREADS) {
                setmaxnreg_dec<24>();
                if (threadIdx.x == THREADS) {
                    auto issue_k = [&](int nb) {
                        const int buf = nb % STAGES;
                        if (nb >= STAGES) mbarrier_wait(&bar_free[buf], (nb / STAGES - 1) & 1);
                        mbarrier_arrive_expect_tx(&bar_kv[buf], K_BYTES);
#pragma unroll
                        for (int db = 0; db < DB; ++db) k_box(buf, nb, db, &bar_kv[buf]);
                    };
                    if (n_blocks > 0) issue_k(0);
                    for (int nb = 0; nb < n_blocks; ++nb) {
                        if (nb + 1 < n_blocks) issue_k(nb + 1);
                        const int buf = nb % STAGES;
                        if (nb >= STAGES) mbarrier_wait(&bar_v_free[buf], (nb / STAGES - 1) & 1);
                        mbarrier_arrive_expect_tx(&bar_v[buf], V_BYTES);
#pragma unroll
                        for (int db = 0; db < DBV; ++db) v_box(buf, nb, db, &bar_v[buf]);
                    }
                }
                return;
            }
            setmaxnreg_inc<CONSUMER_REGS>();
        } else if (!ring_loads<PRODUCER, STAGES, CONSUMERS, CONSUMER_REGS>(n_blocks, bar_free, load_kv)) {
            return;   // (the producer is done)
        }
    }
    const unsigned long long q_desc = wgmma_desc_sw128(q_s + wg * 64 * 128);   // this warpgroup's 64 rows of Q
    int it0 = 0;   // the ring position of the current work tile's first key tile
    int staged = -1;   // PERSISTENT: the buffer that the last work tile's O is stored from, if any
    const bool o_storer = threadIdx.x % 128 == 0;
    for (int tile = first_tile, k = 0; DYNAMIC || (PERSISTENT ? tile < tiles : k == 0); tile += tile_step, ++k) {
    mbarrier_wait(&bar_q, k & 1);
    if (DYNAMIC) {
        tile = tile_of[k & 1];
        if (tile >= tiles) break;
    }
    if (PERSISTENT) enter(tile);
    const int row0 = m0 + wg * 64 + warp * 16 + g;    // this thread's rows: row0 and row0 + 8
    float o[DV / 2];
#pragma unroll
    for (int i = 0; i < DV / 2; ++i) o[i] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    CUK_STAMP(1);
    // PINGPONG: warpgroup w waits at barrier 1 + w for the other's arrival; warpgroup 1's first
    // arrival lets warpgroup 0 start, and warpgroup 0 takes warpgroup 1's last arrival after the
    // loop so that every barrier ends complete.
    if (PINGPONG && wg == 1 && n_blocks > 0) named_barrier_arrive(1, 256);

    // S = Q K^T of tile nb (this warpgroup's 64 rows x BN keys), a k16 step of the head dim at a
    // time; one commit group. PINGPONG: the turn ends here unless the caller issues P V in it
    // (ends_turn false; FlashAttention-3's order with OVERLAP: S of tile nb and P V of tile nb - 1
    // in one turn).
    auto issue_s = [&](int nb, float (&s)[BN / 2], bool ends_turn = true) {
        const int buf = (it0 + nb) % STAGES;
        mbarrier_wait(&bar_kv[buf], ((it0 + nb) / STAGES) & 1);
        if (PINGPONG) named_barrier_sync(1 + wg, 256);
        const unsigned long long k_desc = wgmma_desc_sw128(k_s + buf * K_BYTES);
        wgmma_zero_and_fence(s);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            Wgmma<T, BN>::ss(s, wgmma_desc_advance(q_desc, (ks / 4) * Q_BOX + (ks % 4) * 32),
                             wgmma_desc_advance(k_desc, (ks / 4) * KV_BOX + (ks % 4) * 32), ks > 0);
        }
        wgmma_commit();
        if (PINGPONG && ends_turn) named_barrier_arrive(2 - wg, 256);
    };

    // VARLEN: the tile's V rows past the document are the next document's: zeroed before P V reads
    // them (P is 0 there, but 0 x Inf is NaN: a document's results never depend on another's)
    auto zero_v_past_doc = [&](int nb) {
        if constexpr (VARLEN) {
            const int valid = sk - (kb0 + nb) * BN;
            if (valid < BN) {
                unsigned char* const v_tile = v_s + ((it0 + nb) % STAGES) * V_BYTES;
                zero_tile_rows(v_tile, v_tile, DBV, KV_BOX, max(valid, 0), BN, 12 + wg);   // (V alone: a = b)
            }
        }
    };
    // SOFTCAP: the scores become tanh(s scale / c) before the mask, and the softmax scales them
    // by cap_out = c log2(e) as it does scores by scale_log2 without it (cap_in = scale / c; one
    // multiply a score fewer than c tanh first: 3-5% of the softcap's forward). Keys past the
    // end and, causal, past the diagonal masked (only tiles that have any).
    auto mask = [&](int nb, float (&s)[BN / 2]) {
        if constexpr (!ZERO_V_LATE) zero_v_past_doc(nb);
        if constexpr (SOFTCAP) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) s[i] = attention::tanh_approx(s[i] * cap_in);
        }
        const int n0 = (kb0 + nb) * BN;
        if (LOCAL ? window.edge(n0, BN, m0, BM, sk) : n0 + BN > sk || (CAUSAL && n0 + BN - 1 > m0 + diag)) {
            if constexpr (LOCAL) {
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = n0 + 8 * j + 2 * t + (e & 1);
                        const int row = row0 + (e >> 1) * 8;
                        // (a window's tests combined by | and &, not || and &&: 3% at S8192, window 1024)
                        if (window.hidden_bits(row, key, sk)) s[4 * j + e] = neg_inf();
                    }
            } else {
                // Key n0 + 2 t + c (c = 8 j + (e & 1), a constant) is hidden from row r when it is
                // past the last key, or past the diagonal: c > min(sk - 1, r + diag) - n0 - 2 t. As
                // one bound a row, a score costs a compare with a constant and a select (before: the
                // key's sum and two tests; the whole mask was 4% of the d64 causal forward, and this
                // form gained 2% there).
                int last[2];
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    last[r] = (CAUSAL ? min(sk - 1, row0 + 8 * r + diag) : sk - 1) - n0 - 2 * t;
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (8 * j + (e & 1) > last[e >> 1]) s[4 * j + e] = neg_inf();
            }
        }
    };
    // Online softmax in the log2 domain (attention_fwd's) over rows g (e = 0, 1) and g + 8
    // (e = 2, 3): S becomes P in place, or with `a` P goes there instead, rounded to T as P V's
    // A fragments (accumulators_to_a's order) as each pair of exponentials is taken. alpha, O's
    // rescale factor, is applied by the caller. DROPOUT: key tile nb's weights dropped once summed
    // (drawn at the tokens' places: packed documents at theirs in the pack, batch 0).
    auto softmax = [&](int nb, float (&s)[BN / 2], float (&alpha)[2], unsigned int (*a)[4]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            unsigned int keep = 0;   // (DROPOUT: keys n0 + 8 j + 2 t + c at bit 2 j + c)
            if constexpr (DROPOUT) {
                const attention::DropoutDraw draw = attention::DropoutDraw::stashed(drop_sh, drop_threshold);
                // (dense: the tile's first key a multiple of 32, the draws' places known when compiled)
                keep = VARLEN ? draw.keep_pairs<BN / 8>(b * H + h, span.q0 + row0 + 8 * r, span.k0 + (kb0 + nb) * BN + 2 * t)
                              : draw.keep_pairs_aligned<BN / 8>(b * H + h, row0 + 8 * r, (kb0 + nb) * BN, t);
            }
            float mx = neg_inf();
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
            butterfly<1, 2>(Max{}, mx);   // over the row's quad
            const float new_max = fmaxf(row_max[r], mx * (SOFTCAP ? cap_out : scale_log2));
            const float m_use = new_max == neg_inf() ? 0.f : new_max;
            alpha[r] = fast_exp2(row_max[r] - m_use);
            row_max[r] = new_max;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                float p0 = fast_exp2(fmaf(s[4 * j + 2 * r], SOFTCAP ? cap_out : scale_log2, -m_use));
                float p1 = fast_exp2(fmaf(s[4 * j + 2 * r + 1], SOFTCAP ? cap_out : scale_log2, -m_use));
                sum += p0 + p1;
                if constexpr (DROPOUT) {
                    if (!((keep >> (2 * j)) & 1u)) p0 = 0.f;
                    if (!((keep >> (2 * j + 1)) & 1u)) p1 = 0.f;
                }
                if (a) {
                    a[j / 2][2 * (j % 2) + r] = pack2(p0, p1, T{});
                } else {
                    s[4 * j + 2 * r] = p0;
                    s[4 * j + 2 * r + 1] = p1;
                }
            }
            row_sum[r] = row_sum[r] * alpha[r] + sum;
        }
    };
    auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
        for (int j = 0; j < DV / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[4 * j + e] *= alpha[e >> 1];
    };
    // O += P V: P's A fragments from the S accumulators, V read MN-major as stored.
    auto issue_pv = [&](int nb, unsigned int (&a)[BN / 16][4]) {
        wgmma_rs_mn<T, DV>(o, a, v_s + ((it0 + nb) % STAGES) * V_BYTES, KV_BOX);
    };
    // Refill the buffer of tile nb (REFILLER, without PRODUCER) once every thread released it.
    auto refill = [&](int nb) {
        if (!PRODUCER && threadIdx.x == REFILLER && nb + STAGES < n_blocks) {
            mbarrier_wait(&bar_free[nb % STAGES], (nb / STAGES) & 1);
            load_kv(nb + STAGES);
        }
    };

    // (Tiles 0 .. STAGES - 2 were issued by ring_loads; without PRODUCER thread 0 adds the last.)
    if (!PRODUCER && threadIdx.x == 0 && STAGES - 1 < n_blocks) load_kv(STAGES - 1);
    if constexpr (!OVERLAP) {
        // Causal or a window: the key tiles this warpgroup's rows see (the block's last tiles
        // may be past the diagonal of its upper rows where BN < BM).
        int n_mine = n_blocks;
        if (CAUSAL) {
            const int last_key = min(sk - 1, m0 + wg * 64 + 63 + diag);
            n_mine = last_key < 0 ? 0 : min(n_blocks, last_key / BN + 1);
        } else if (LOCAL) {
            n_mine = max(0, min(n_blocks, (window.stop_key(m0 + wg * 64, 64, sk) + BN - 1) / BN - kb0));
        }
        for (int nb = 0; nb < n_blocks; ++nb) {
            // No block barrier: the two warpgroups drift apart by up to a tile, so that one's
            // softmax can run beside the other's products.
            if (nb > 0) refill(nb - 1);
            if ((CAUSAL || LOCAL) && nb >= n_mine) {
                // Nothing to compute: the turn is taken (PINGPONG) and the buffer released once
                // its tile landed (its previous tile's release, which the load waited on, done).
                const int buf = (it0 + nb) % STAGES;
                mbarrier_wait(&bar_kv[buf], ((it0 + nb) / STAGES) & 1);
                if (PINGPONG) {
                    named_barrier_sync(1 + wg, 256);
                    named_barrier_arrive(2 - wg, 256);
                }
                mbarrier_arrive(&bar_free[nb % STAGES]);
                continue;
            }
            float s[BN / 2], alpha[2];
            issue_s(nb, s);
            wgmma_wait<0>();
            wgmma_hold(s);
            mask(nb, s);
            unsigned int a[BN / 16][4];
            softmax(nb, s, alpha, PACK_IN_SOFTMAX ? a : nullptr);
            rescale(alpha);
            if constexpr (!PACK_IN_SOFTMAX) accumulators_to_a<T>(s, a);
            if constexpr (ZERO_V_LATE) zero_v_past_doc(nb);
            issue_pv(nb, a);
            wgmma_wait<0>();
            wgmma_hold(o);
            mbarrier_arrive(&bar_free[nb % STAGES]);   // (this thread's products have read the buffer)
        }
    } else if (n_blocks > 0) {
        // FlashAttention-3's intra-warpgroup overlap: S of tile nb is issued with P V of tile
        // nb - 1, and tile nb's softmax runs while the tensor cores finish that P V. P of tile
        // nb - 1 stays pinned until the P V's wait, so that ptxas cannot hand its registers to
        // the softmax (which would force the wait before the exponentials).
        unsigned int a[BN / 16][4];
        float alpha[2];
        {
            float s[BN / 2];
            issue_s(0, s);
            if (PERSISTENT && staged >= 0) {   // (the last work tile's O read out: its buffer released)
                if (o_storer) {
                    tma_store_wait_read<0>();
                    mbarrier_arrive(&bar_free[staged]);
                }
                staged = -1;
            }
            wgmma_wait<0>();
            wgmma_hold(s);
            if constexpr (SPLIT_KV) mbarrier_arrive(&bar_free[0]);   // (S is done with K)
            if (PERSISTENT && n_blocks == 1) mbarrier_arrive(&bar_q_free);   // (this thread's S products are done with Q)
            CUK_STAMP(2);
            mask(0, s);
            if constexpr (P_AHEAD) {
                softmax(0, s, alpha, a);
            } else {
                softmax(0, s, alpha, nullptr);
                accumulators_to_a<T>(s, a);
            }
        }
        CUK_STAMP(3);
        // P_AHEAD: P of tile nb is packed as the softmax takes it, into fragments of its own
        // (a_next) that P V of tile nb - 1 does not read, and kept ahead of that P V's wait (the
        // bits folded into the store). The next S then follows the wait at once, and P moves to
        // `a` among that S's products (a loop unrolled by two instead measured 24% slower).
        unsigned int a_next[P_AHEAD ? BN / 16 : 1][4];
#pragma unroll 1
        for (int nb = 1; nb < n_blocks; ++nb) {
            float s[BN / 2];
            if constexpr (SPLIT_KV) mbarrier_wait(&bar_v[(nb - 1) % STAGES], ((nb - 1) / STAGES) & 1);
            issue_s(nb, s, false);
            rescale(alpha);
            if constexpr (P_AHEAD) {
                if (nb > 1) {
                    wgmma_hold(a_next);
                    copy_fragments(a_next, a);
                }
            }
            issue_pv(nb - 1, a);
            if (PINGPONG) named_barrier_arrive(2 - wg, 256);
            wgmma_wait<1>();
            wgmma_hold(s);
            if constexpr (SPLIT_KV) mbarrier_arrive(&bar_free[nb % STAGES]);   // (S is done with K)
            if (PERSISTENT && nb == n_blocks - 1) mbarrier_arrive(&bar_q_free);
            mask(nb, s);
            softmax(nb, s, alpha, P_AHEAD ? a_next : nullptr);
            // (the exponentials, and P_AHEAD's P, before the wait)
            keep_before_wait(ov_sink, (P_AHEAD ? fold_bits(a_next) : 0u) ^ __float_as_uint(row_sum[0] + row_sum[1]));
            wgmma_wait<0>();
            wgmma_hold(a);
            wgmma_hold(o);
            mbarrier_arrive(SPLIT_KV ? &bar_v_free[(nb - 1) % STAGES] : &bar_free[(it0 + nb - 1) % STAGES]);
            refill(nb - 1);
            if constexpr (!P_AHEAD) accumulators_to_a<T>(s, a);
        }
        if constexpr (P_AHEAD) {
            if (n_blocks > 1) copy_fragments(a_next, a);
        }
        rescale(alpha);
        if constexpr (SPLIT_KV) mbarrier_wait(&bar_v[(n_blocks - 1) % STAGES], ((n_blocks - 1) / STAGES) & 1);
        issue_pv(n_blocks - 1, a);
        wgmma_wait<0>();
        wgmma_hold(o);
        CUK_STAMP(4);
        if constexpr (SPLIT_KV) mbarrier_arrive(&bar_v_free[(n_blocks - 1) % STAGES]);
        else if (!PERSISTENT) mbarrier_arrive(&bar_free[(n_blocks - 1) % STAGES]);   // (PERSISTENT: after O's staging)
    }
    if (PINGPONG && wg == 0 && n_blocks > 0) named_barrier_sync(1, 256);

    // Normalize; the log-sum-exp; O staged in this warpgroup's rows of Q (its products are done
    // with them, and no one else reads them) and written by whole rows (out is allocated dense
    // in some order of its dims, so its rows and strides are 16-byte multiples).
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        butterfly<1, 2>(Sum{}, sum);
        float row_lse;
        cuk::attention::finish_row(row_max[r], sum, sink_log2, inv[r], row_lse);
        if constexpr (DROPOUT) inv[r] *= drop_rescale;   // (the kept weights scaled; the lse stays the softmax's)
        const int row = row0 + r * 8;
        if (lse && t == 0 && row < sq)
            lse[(static_cast<long long>(b) * H + h) * Sq + span.q0 + row] = row_lse;
    }
    const int wg_row0 = m0 + wg * 64;
    if constexpr (OWN_O) {
        // O (zeros for causal rows that see no key) staged in this warpgroup's rows of its own
        // buffer, once the last work tile's store has read them, and stored by TMA.
        if (n_blocks == 0) mbarrier_arrive(&bar_q_free);
        else mbarrier_arrive(&bar_free[(it0 + n_blocks - 1) % STAGES]);
        if (o_storer) tma_store_wait_read<0>();
        named_barrier_sync(8 + wg, 128);
        unsigned char* const stage = o_s + wg * 64 * 128;
        stage_tile<T, DV, Q_BOX>(o, inv[0], inv[1], stage, 8 + wg, true);
        if (o_storer) {
#pragma unroll
            for (int db = 0; db < DBV; ++db) tma_store_4d(&o_map, stage + db * Q_BOX, db * 64, h, wg_row0, b);
            tma_store_commit();
        }
        it0 += n_blocks;
    } else if (PERSISTENT && n_blocks == 0) {
        // (causal rows that see no key: zeros, staged in this warpgroup's rows of Q, which no S
        // reads; the next Q may land there once the store has read them)
        if (staged >= 0 && o_storer) {
            tma_store_wait_read<0>();
            mbarrier_arrive(&bar_free[staged]);
        }
        staged = -1;
        unsigned char* const stage = q_s + wg * 64 * 128;
        stage_tile<T, DV, Q_BOX>(o, 0.f, 0.f, stage, 8 + wg, true);
        if (o_storer) {
#pragma unroll
            for (int db = 0; db < DBV; ++db) tma_store_4d(&o_map, stage + db * Q_BOX, db * 64, h, wg_row0, b);
            tma_store_commit();
            tma_store_wait_read<0>();
        }
        mbarrier_arrive(&bar_q_free);
    } else if constexpr (PERSISTENT) {
        // O staged in this warpgroup's rows of the last key tile's K buffer, once every thread's
        // last S is done with it (bar_q_free), and stored from there by TMA (rows past sq
        // skipped). One thread of the warpgroup waits for the store's reads before it releases
        // the buffer (at the next work tile's first S); the others release it now.
        staged = (it0 + n_blocks - 1) % STAGES;
        unsigned char* const stage = k_s + staged * K_BYTES + wg * 64 * 128;
        mbarrier_wait(&bar_q_free, k & 1);
        stage_tile<T, DV, KV_BOX>(o, inv[0], inv[1], stage, 8 + wg, true);
        if (o_storer) {
#pragma unroll
            for (int db = 0; db < DBV; ++db) tma_store_4d(&o_map, stage + db * KV_BOX, db * 64, h, wg_row0, b);
            tma_store_commit();
        } else {
            mbarrier_arrive(&bar_free[staged]);
        }
        it0 += n_blocks;
    } else {
        store_tile_staged<T, DV, Q_BOX>(o, inv[0], inv[1], q_s + wg * 64 * 128,
                                       out + b * o_sb + h * o_sh + static_cast<long long>(span.q0 + wg_row0) * o_ss, o_ss,
                                       sq - wg_row0, 8 + wg);
    }
    CUK_STAMP(5);
    }
    if (PERSISTENT && o_storer) tma_store_wait<0>();   // (shared memory stays until the last store has read it)
#elif defined(__CUDA_ARCH__)
    __trap();   // (built without sm_90a's features: fail loudly, never return an unwritten output)
#endif
}

template <typename T, int D, int DV, int BN, int STAGES, int CONSUMERS, int MASK, bool SOFTCAP, bool PRODUCER, bool PINGPONG, bool OVERLAP, bool PERSISTENT, int BLOCKS, int SMEM, bool VARLEN, bool DROPOUT>
__global__ void __launch_bounds__(CONSUMERS * 128 + PRODUCER * 128, BLOCKS) attention_fwd_sm90(
    const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap o_map,
    const __grid_constant__ cuk::attention::FwdSm90Params<T> p)
{
    const cuk::attention::Problem& r = p.problem;
    attention_fwd_sm90_body<T, D, DV, BN, STAGES, CONSUMERS, MASK, SOFTCAP, PRODUCER, PINGPONG, OVERLAP, PERSISTENT, BLOCKS, SMEM, VARLEN, DROPOUT>(
        q_map, k_map, v_map, o_map, p.out, p.lse, p.sinks, p.o_sb, p.o_ss, p.o_sh, r.H, r.Hkv, r.Sq, r.Sk, r.scale_log2,
        p.tiles, p.tile_counter, p.section_pairs, r.cap_in, r.cap_out, r.win_left, r.win_right, r.cu_q, r.cu_k,
        r.max_q, r.max_k, r.fault, p.drop_rng, p.drop_threshold, p.drop_rescale);
}
