// Fused attention backward on Hopper (sm_90a) (docs/notes-attention.md, the backward's steps):
// TMA tile loads, wgmma, dQ by TMA reduce-add. It replaces attention_bwd_dkdv
// (attention_bwd.cu) on sm_90 and shares the rest of that backward: attention_bwd_dot (Dsum,
// lse_log2 and Dsum in `rows`, tiles of [2][BM] floats this kernel loads by TMA with Q and dO,
// and dq_accum zeroed), attention_bwd_dq_convert (deterministic=False) or attention_bwd_dq
// (deterministic=True).
//
// A block of two warpgroups owns BN = 128 keys of one (batch, kv head), 64 a warpgroup, with K
// and V loaded once by TMA; it walks every query tile (BM = 64 or 128 rows) of every query head that
// shares the kv head, Q and dO brought by thread 0 (PRODUCER: by a third warpgroup, which gives
// its registers to the other two with setmaxnreg) into a ring of STAGES buffers ("landed" and
// "released" mbarriers, as the forward). Computed transposed, FlashAttention-3's way, so that
// P^T and dS^T come out of the accumulators as the A operands (registers) of the next products:
//   S^T = K Q^T, dP^T = V dO^T            (64 keys x BM queries a warpgroup; ss, K-major)
//   P^T = exp2(S^T scale_log2 - lse_log2), dS^T = P^T (dP^T - Dsum)   (lse_log2, Dsum: a column each)
//   dV += P^T dO, dK += dS^T Q            (rs: A from registers, B = dO, Q read MN-major)
//   dQ_partial = dS K                     (DQ_ATOMIC: dS^T staged in shared memory, read as a
//                                          transposed A; added into dq_accum (float32) by TMA
//                                          reduce-add through dq_map)
// dQ of a step needs both warpgroups' dS^T; it is computed one step later (behind an mbarrier
// that both warpgroups' dS^T stores complete), so the two warpgroups are never held in step by a
// block barrier and drift: one's softmax overlaps the other's products.
// dK is scaled at the end; dq_accum is scaled by attention_bwd_dq_convert.
// PERSISTENT (no mask, not packed, dQ by atomics, a producer): a grid of one block an SM walks the
// (group, key block) units in turn (see the unit loop), so a unit's first loads run under the end
// of the one before; 1.5-2.1% on the unmasked backward (A/B on an H200, docs/notes-attention.md).
// ORDERED (deterministic=True): dQ's reduce-adds into a query tile take turns in a fixed order
// of the key blocks (common/sm90_tma.cuh, turn_wait and turn_pass; a counter a tile, `turns`),
// so the sums have the same bits on every call. The adds are issued by the producer warpgroup's
// second warp (dq_write_unit): the computing warps stage their dQ rows and arrive (dq_full); that
// warp waits for the tile's turn, adds all eight warps' rows, frees the staging (dq_empty) once
// read, and passes the turn on once the adds are complete, before it waits for the next turn
// (holding a turn while waiting for the next one let blocks whose walks start one tile apart wait
// on each other in a ring). The release it takes (a gpu-scope fence) stays off the computing
// warps' path: at the warps' own adds it cost 25-30% of the backward. The order follows the
// walk, so that a block finds its turn come: with a mask, the highest key block first and the
// grid launched that way (a key block waits only on blocks launched before it); without one,
// key block n walks its query tiles from tile n M / N on (M tiles, N key blocks; the unmasked
// grid launches a group's blocks together and needs them all resident: N <= half the SMs,
// checked by the front), and a tile's turns go in the order the blocks reach it. (A turn waited
// for in vain spins without end: the front's residency check is what rules that out.)
// MASK (common/attn_mask.cuh): 0 none, 1 causal, 2 a window, whose block walks only the query
// tiles between its keys' window edges. SOFTCAP (t = tanh(s scale / c)): P^T = exp2(c log2(e) t -
// lse_log2) and dS^T = P^T (dP^T - Dsum) (1 - t^2) (see CAP_LATE for where 1 - t^2 is applied).
// The causal instances' tests are written out as they were before the masks: ptxas lays out
// KeyMask's form of the same tests differently there, measured 7% slower at d128 causal (and 7%
// with the softcap, which ran causal as the window (-1, 0) until 2026-11-26). Without a mask, the
// tests (queries past sq, keys past sk) run only on the tiles that cross those ends. A score's
// tests are combined by & and |, not && and ||: ptxas's layout of the short-circuit form cost
// 2-4% at d128 and 11-19% with a window (A/B on an H200, docs/notes-attention.md). Packed causal
// documents keep the short-circuit form (5% faster there); with a window they take | (9% faster).
// DROPOUT (dense, no softcap): common/attn_dropout.cuh's draw, the weights the forward dropped:
// dV += (P^T Z) dO (Z the keep bits; dV scaled by drop_rescale at the end) and dS^T = P^T (Z
// dP^T drop_rescale - Dsum), FlashAttention-2's algebra (Dsum from the dropped output). K's and
// V's rows are put in DropoutKeyOrder once loaded (common/attn_dropout.cuh: a warp's rows then
// hold every key of the Philox calls it draws, so the keep bits of the transposed scores,
// DropoutDraw::keep_rows, take an eighth of a call a score, as the forward's; in key order a
// warp held half of each call's keys, a quarter of a call a score), and dK and dV are written
// back in key order. The draws are issued beside S^T's and dP^T's products, which do not wait
// for them.
#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/hopper.cuh"
#include "common/attn_tile.cuh"
#include "common/attn_mask.cuh"
#include "common/attn_params.cuh"
#include "common/attn_turns.cuh"
#include "common/attn_dropout.cuh"
// (CUK_TRACE: warpgroup wg's stamps of the block and of its middle step, slots 10 wg + i: i = 0
// entry, then in step steps / 2: 1 start, 2 Q and dO landed, 3 S^T done, 4 dV issued, 5 dS^T
// stored, 6 dV done, 7 dK and dQ done, 8 step end; 9 dK written)
#define CUK_TRACE_SLOTS 32
#include "common/trace.cuh"
#define CUK_STAMP(i) CUK_TRACE_STAMP(threadIdx.x % 128 == 0 && wg < 2, 10 * wg + (i), wg == 0 && (i) == 0)
#define CUK_STEP_STAMP(i) CUK_TRACE_STAMP(threadIdx.x % 128 == 0 && wg < 2 && it == steps / 2, 10 * wg + (i), false)

namespace cuk {
namespace attention {

// attention_bwd_sm90's parameters besides the tensor maps: rows (B, H, ceil(Sq / BM), 2, BM)
// float32, lse * log2(e) and Dsum a query tile (VARLEN: (1, H, ceil(Sq / BM) + documents, 2,
// BM), see the end), dK and dV (B, Sk, Hkv, D) with their strides in elements (batch, sequence,
// head), the problem, the (batch, key head) groups of the persistent walk, and dropout's
// (DROPOUT instances): the seed and offset (2,) int64, the drop threshold (p 2^16) and
// 1 / (1 - p).
template <typename T>
struct BwdSm90Params {
    const float* rows;
    T* dk;
    T* dv;
    long long dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh;
    Problem problem;
    int groups;
    int* turns;   // ORDERED: a counter a `rows` query tile, zeroed (else null)
    const long long* drop_rng;
    unsigned int drop_threshold;
    float drop_rescale;
};

}  // namespace attention
}  // namespace cuk

namespace cuk {
namespace attention {

// ORDERED: the adds of one (group, key block)'s dQ tiles into dq_accum, in its walk's order
// (heads h0 .. h0 + rep - 1, each from tile m_first + rot through its per_head tiles and around),
// by the producer warpgroup's second warp (lane 0); `g` counts the block's tiles (the dq_full and
// dq_empty phases). The staging is the computing warps' [8 warps][2 boxes][16 rows x 32 floats]:
// warp w's rows m0 + 64 qhalf + 16 (w % 4), columns 64 dhalf on (dq_store's part).
template <int D, int BM, int MASK>
__device__ __forceinline__ void dq_write_unit(const CUtensorMap* dq_map, const unsigned char* dq_s, int* turns,
                                              unsigned long long* dq_full, unsigned long long* dq_empty, int b, int H,
                                              int h0, int rep, int m_first, int per_head, int rot, int kblock,
                                              int nblocks, int hi, int tiles, int tile0, int q0, int& g) {
#if CUK_SM90A
    const int steps = per_head * rep;
    dq_writer<MASK, BM, 128, true, 1>(
        0, TileWalk(m_first, rot, h0, per_head), steps, turns, b * H, tiles, tile0, kblock, nblocks, hi,
        [&](int) { mbarrier_wait(dq_full, g & 1); },
        [&](const TileWalk& walk, int) {
#pragma unroll
            for (int w = 0; w < 8; ++w)
#pragma unroll
                for (int box = 0; box < 2; ++box)
                    tma_reduce_add_4d(dq_map, dq_s + (2 * w + box) * 2048, (D == 128 ? w / 4 : 0) * 64 + 32 * box,
                                      walk.h, q0 + walk.m * BM + (BM == 128 ? w / 4 : 0) * 64 + (w % 4) * 16, b);
        },
        [&](int) {
            mbarrier_arrive(dq_empty);   // (the staging is free)
            ++g;
        });
#endif
}

}  // namespace attention
}  // namespace cuk

// SMEM: the launch's dynamic shared memory: K, V, the Q and dO rings, two dS^T buffers and the
// dQ staging boxes (DQ_ATOMIC), the lse_log2 and Dsum ring, 1 KB of alignment slack.
template <typename T, int D, int BM, int STAGES, int MASK, bool SOFTCAP, bool DQ_ATOMIC, bool PRODUCER, int SMEM,
          bool VARLEN, bool PERSISTENT, bool ORDERED, bool DROPOUT>
__device__ __forceinline__ void attention_bwd_sm90_body(
    const CUtensorMap& q_map, const CUtensorMap& k_map,
    const CUtensorMap& v_map, const CUtensorMap& do_map,
    const CUtensorMap& dq_map,   // dq_accum (B, Sq, H, D) float32, boxes 16 x 32 (unused unless DQ_ATOMIC)
    const float* __restrict__ rows,   // (B, H, ceil(Sq / BM), 2, BM): lse * log2(e) and Dsum a query tile
                                      // (VARLEN: (1, H, ceil(Sq / BM) + documents, 2, BM), see the end)
    T* __restrict__ dk, T* __restrict__ dv,
    long long dk_sb, long long dk_ss, long long dk_sh, long long dv_sb, long long dv_ss, long long dv_sh,
    int H, int Hkv, int Sq, int Sk, float scale, float scale_log2, int win_left, int win_right, float cap_in,
    float cap_out, const int* __restrict__ cu_q, const int* __restrict__ cu_k, int max_q, int max_k,
    long long* __restrict__ fault, int groups, int* __restrict__ turns, const long long* __restrict__ drop_rng,
    unsigned int drop_threshold, float drop_rescale)
{
    constexpr bool CAUSAL = MASK == 1;
    constexpr int BN = 128, DB = D / 64;            // DB: 64-column boxes of a row
    constexpr int Q_BOX = BM * 128, KV_BOX = BN * 128;          // bytes of one box (rows x 128 bytes)
    constexpr int Q_BYTES = DB * Q_BOX, KV_BYTES = DB * KV_BOX;
    constexpr int DS_BYTES = BM / 64 * BN * 128;                // dS^T: [BM / 64][BN key rows x 64 queries]
    constexpr int DS_BUFS = DQ_ATOMIC ? 2 : 0;
    constexpr int ROWS_BYTES = STAGES * 2 * BM * 4;             // lse_log2, Dsum [STAGES][2][BM]
    constexpr int DQ_STAGE = DQ_ATOMIC ? 8 * 2 * 16 * 128 : 0;  // dQ rows: [8 warps][2 boxes][16 rows x 128 bytes]
    static_assert(SMEM == 2 * KV_BYTES + 2 * STAGES * Q_BYTES + DS_BUFS * DS_BYTES + DQ_STAGE + ROWS_BYTES + 1024,
                  "SMEM: K, V, the Q and dO rings, the dS^T and dQ buffers, lse and Dsum, alignment slack");
    static_assert((D == 64 || D == 128) && (BM == 64 || BM == 128) && BM * D <= 128 * 64,
                  "tiles of this kernel (other head dims take attention_bwd_dkdv)");
    // dQ = dS K, BM x D: when that is two 64 x 64 halves (BM = 64, D = 128: columns; BM = 128,
    // D = 64: queries) a warpgroup takes half wg over all BN keys (both warpgroups' dS^T); with
    // BM = D = 64 it takes its own 64 keys (both warpgroups add into dq_accum).
    constexpr bool SPLIT_N = BM * D == 2 * 64 * 64;
    // ORDERED: each warp adds its own rows and columns (SPLIT_N), so the turns are a block's.
    // (not PERSISTENT: the writer's walk over the units spilled its warp's 24 registers)
    static_assert(!ORDERED || (DQ_ATOMIC && SPLIT_N && PRODUCER && !PERSISTENT),
                  "ORDERED: dQ by reduce-add, a warp's part of its own, a producer warpgroup to add it");
    constexpr bool ROTATE = ORDERED && MASK == 0;   // (the unmasked walk's start, see the top)
    // The softcap's dS^T needs 1 - t^2 (t = tanh(s scale / c)) from P^T's pass. CAP_LATE (d64):
    // P^T and dS^T in one pass once dP^T is in, so dV waits for dP^T. Else s keeps P^T (1 - t^2)
    // and dP^T's wait stays behind the exponentials: at d128 5% faster, at d64 8% slower (causal
    // run as a window; as MASK 1, d64 measures the same either way; A/B on an H200).
    constexpr bool CAP_LATE = SOFTCAP && D == 64;
    // DQ_FIRST: the step before's dQ issued ahead of dK, and stored while dK runs: 1.7% at d128
    // without a mask and at d64, 2-7% with the softcap; d128 causal without the softcap keeps dK
    // first (dQ first measured 0-3% slower there; A/B on an H200, docs/notes-attention.md).
    constexpr bool DQ_FIRST = D == 64 || SOFTCAP || MASK != 1;
    // ONE_FENCE: a step's dS^T published (ds_full) behind the step before's dQ staging, one proxy
    // fence for both stores: 1-4% at d128, 2-3% with the softcap, 0-2% with a window (A/B on an
    // H200); where dK runs first (d128 causal) the later publication cost 5-7% (on an H100).
    constexpr bool ONE_FENCE = DQ_FIRST;
    static_assert(!DROPOUT || (!SOFTCAP && !VARLEN), "DROPOUT: dense, no softcap");
    constexpr int ROW8 = DROPOUT ? 16 : 8;   // (the key of a thread's row g + 8, past its row g's)
#if CUK_SM90A
    using namespace cuk;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* const k_s = align_1024(smem_raw);       // [DB][BN rows x 128 bytes]
    unsigned char* const v_s = k_s + KV_BYTES;              // [DB][BN rows x 128 bytes]
    unsigned char* const q_s = v_s + KV_BYTES;              // [STAGES][DB][BM rows x 128 bytes]
    unsigned char* const do_s = q_s + STAGES * Q_BYTES;     // [STAGES][DB][BM rows x 128 bytes]
    unsigned char* const ds_s = do_s + STAGES * Q_BYTES;    // [2][BN rows x 128 bytes]
    unsigned char* const dq_s = ds_s + DS_BUFS * DS_BYTES;  // [8 warps][2 boxes][16 rows x 32 floats] (DQ_ATOMIC)
    float* const rows_s = reinterpret_cast<float*>(dq_s + DQ_STAGE);   // [STAGES][lse_log2, Dsum][BM]
    __shared__ unsigned long long bar_kv, bar_q[STAGES], bar_free[STAGES], ds_full[2], ds_free[2], kv_free;
    __shared__ unsigned long long dq_full, dq_empty;   // (ORDERED: the staged dQ rows, handed to their writer)
    __shared__ unsigned int drop_sh[DROPOUT ? 3 : 1];   // (DROPOUT: the seed's halves and the offset)
    static_assert(!PERSISTENT || (PRODUCER && DQ_ATOMIC && MASK == 0 && !VARLEN),
                  "PERSISTENT: no mask, not packed, dQ by atomics, a producer warpgroup");

    if (threadIdx.x == 0) {
        if constexpr (DROPOUT) {
            const attention::DropoutDraw d = attention::DropoutDraw::load(drop_rng, drop_threshold);
            d.stash(drop_sh);
        }
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbarrier_init(&bar_q[i], 1);
            mbarrier_init(&bar_free[i], 256);
        }
        mbarrier_init(&bar_kv, 1);
        mbarrier_init(&kv_free, 256);
        mbarrier_init(&dq_full, 8);
        mbarrier_init(&dq_empty, 1);
        for (int i = 0; i < 2; ++i) {
            mbarrier_init(&ds_full[i], 256);
            mbarrier_init(&ds_free[i], 256);
        }
        mbarrier_init_fence();
    }
    __syncthreads();
    // (thread 0, or the producer) Q, dO, lse_log2 and Dsum of query tile m0 of head h (batch bb;
    // its `rows` tile rt; document rows from q0) into ring buffer buf
    auto load_tile = [&](int buf, int bb, int h, int m0, long long rt, int q0) {
        mbarrier_arrive_expect_tx(&bar_q[buf], 2 * Q_BYTES + 2 * BM * 4);
        bulk_load(rows_s + buf * 2 * BM, rows + rt * 2 * BM, 2 * BM * 4, &bar_q[buf]);
#pragma unroll
        for (int db = 0; db < DB; ++db) {
            tma_load_4d(q_s + buf * Q_BYTES + db * Q_BOX, &q_map, db * 64, h, q0 + m0, bb, &bar_q[buf]);
            tma_load_4d(do_s + buf * Q_BYTES + db * Q_BOX, &do_map, db * 64, h, q0 + m0, bb, &bar_q[buf]);
        }
    };
    auto load_kv = [&](int bb, int hkk, int key0_) {   // K and V of keys key0_ .. + BN - 1 of kv head hkk
        mbarrier_arrive_expect_tx(&bar_kv, 2 * KV_BYTES);
#pragma unroll
        for (int db = 0; db < DB; ++db) {
            tma_load_4d(k_s + db * KV_BOX, &k_map, db * 64, hkk, key0_, bb, &bar_kv);
            tma_load_4d(v_s + db * KV_BOX, &v_map, db * 64, hkk, key0_, bb, &bar_kv);
        }
    };
    // PERSISTENT: one block an SM walks the units (group, key block) u = blockIdx.x + k gridDim.x,
    // the key block fastest, as the grid of one block a unit numbers them. The producer's thread
    // loads a unit's first STAGES Q and dO tiles as the unit before ends (their buffers free with
    // its last steps), then its K and V once that unit's dK and dV are stored (kv_free: they are
    // staged in K's and V's shared memory), then the rest; the ring's and the dS^T buffers'
    // phases run on over the block's units (gbase: the steps of the units before).
    const int kblocks_all = (Sk + BN - 1) / BN;
    const int units = PERSISTENT ? kblocks_all * groups : 1;
    if constexpr (PERSISTENT) {
        if (threadIdx.x >= 256) {
            setmaxnreg_dec<24>();
            if (threadIdx.x == 256) {
                const int rep_ = H / Hkv, per = (Sq + BM - 1) / BM, n = per * rep_;
                int g = 0, ui = 0;
                for (int u = blockIdx.x; u < units; u += gridDim.x, ++ui) {
                    const int grp = u / kblocks_all, bb = grp / Hkv, hkk = grp % Hkv;
                    const int first = min(n, STAGES);
                    for (int i = 0; i <= n; ++i) {
                        if (i == first) {
                            if (ui > 0) mbarrier_wait(&kv_free, (ui - 1) & 1);
                            load_kv(bb, hkk, (u % kblocks_all) * BN);
                        }
                        if (i == n) break;
                        if (g >= STAGES) mbarrier_wait(&bar_free[g % STAGES], (g / STAGES - 1) & 1);
                        const int h = hkk * rep_ + i / per, m = i % per;
                        load_tile(g % STAGES, bb, h, m * BM, (static_cast<long long>(bb) * H + h) * per + m, 0);
                        ++g;
                    }
                }
            }
            return;
        }
        setmaxnreg_inc<240>();
    }
    int gbase = 0;
    for (int ui = 0, u = PERSISTENT ? static_cast<int>(blockIdx.x) : 0; u < units;
         ++ui, u += PERSISTENT ? static_cast<int>(gridDim.x) : 1) {

        // The block's (group, key block): the grid's (y, x), except with a causal mask or a window
        // (dense), whose grid is (section_groups, key blocks, sections): blocks launch in sections of
        // `section_groups` groups (batch, kv head) whose Q, dO and dQ's float32 sums fit L2, key
        // block-major within a section. A causal key block's work falls with its index (GQA: times the
        // group's heads), so the longest blocks start first; group-major order left a group's long
        // blocks behind the groups before it (a tail of lone blocks). (Indices straight from blockIdx:
        // a launch index divided out spilled the softcap's instance.)
        int group = blockIdx.y, kblock = ORDERED && VARLEN && MASK != 0 ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
        if constexpr (PERSISTENT) {
            group = u / kblocks_all;
            kblock = u % kblocks_all;
        }
        if constexpr ((CAUSAL || MASK == 2) && !VARLEN) {
            group = blockIdx.z * gridDim.x + blockIdx.x;
            kblock = ORDERED ? gridDim.y - 1 - blockIdx.y : blockIdx.y;   // (ORDERED: the highest first)
            if (group >= groups) return;   // (the last section's missing groups, before any barrier)
        }
        const int doc = group / Hkv, b = VARLEN ? 0 : doc, hk = group % Hkv;
        const int rep = H / Hkv;
        const int wg = warpgroup_index(), warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
        const int g = lane / 4, t = lane % 4;
        const int n0 = kblock * BN;
        // this thread's keys: key0 and key0 + ROW8 (its rows g and g + 8; DROPOUT: DropoutKeyOrder)
        const int key0 = DROPOUT ? n0 + wg * 64 + attention::DropoutKeyOrder<>{}(warp * 16 + g)
                                 : n0 + wg * 64 + warp * 16 + g;
        // VARLEN (packed documents): the block's document is blockIdx.y / Hkv, its queries rows q0 ..
        // q0 + sq - 1 and its keys rows k0 .. k0 + sk - 1 of the one batch, its mask aligned to its
        // own end; a document with bad offsets is recorded as a fault and computes nothing.
        const attention::DocSpan span =
            VARLEN ? attention::doc_span_uniform(cu_q, cu_k, doc, gridDim.y / Hkv, Sq, Sk, max_q, max_k, fault)
                   : attention::DocSpan{0, Sq, 0, Sk};
        const int sq = span.sq, sk = span.sk;
        if (VARLEN && n0 >= sk) return;   // (past the document's keys: the whole block, before any barrier)
        const int diag = sk - sq;
        // Query tiles that see a key of this block (causal: query i sees key j iff j <= i + diag; a
        // window: i + lo .. i + hi); steps walk (head, query tile) pairs, head-major.
        const attention::KeyMask<MASK> km(win_left, win_right, diag);
        const int m_first = MASK == 2 ? km.first_query(n0) / BM : CAUSAL ? max(0, n0 - diag) / BM : 0;
        const int per_head = max(0, ((MASK == 2 ? km.stop_query(n0, BN, sq) : sq) + BM - 1) / BM - m_first);
        const int steps = per_head * rep;
        // ORDERED: this group's key blocks, and ROTATE's first query tile of a head (see the top)
        const int nblocks = (sk + BN - 1) / BN;
        const int rot = ROTATE ? static_cast<int>(static_cast<long long>(kblock) * per_head / nblocks) : 0;
        CUK_STAMP(0);

        // `rows`' query tiles a head (VARLEN: document d's tile m at q0 / BM + d + m, see
        // attention_bwd_rows_varlen)
        const int tiles = VARLEN ? (Sq + BM - 1) / BM + gridDim.y / Hkv : (sq + BM - 1) / BM;
        const int tile0 = VARLEN ? span.q0 / BM + doc : 0;
        auto load_q = [&](int it) {   // (thread 0) Q, dO, lse_log2 and Dsum of step it into buffer it % STAGES
            int i = it % per_head + rot;
            if (ROTATE && i >= per_head) i -= per_head;
            const int h = hk * rep + it / per_head, m = m_first + i;
            load_tile(it % STAGES, b, h, m * BM, (static_cast<long long>(b) * H + h) * tiles + tile0 + m, span.q0);
        };
        if constexpr (!PERSISTENT) {
            if (threadIdx.x == (PRODUCER ? 256 : 0)) load_kv(b, hk, span.k0 + n0);
            if constexpr (ORDERED) {   // (the producer warpgroup's second warp: dQ's writer, see the top)
                auto write = [&](int) {
                    int g = 0;
                    attention::dq_write_unit<D, BM, MASK>(&dq_map, dq_s, turns, &dq_full, &dq_empty, b, H, hk * rep, rep,
                                                          m_first, per_head, rot, kblock, nblocks, km.hi, tiles, tile0,
                                                          span.q0, g);
                };
                if (!ring_loads<PRODUCER, STAGES>(steps, bar_free, load_q, write)) return;
            } else if (!ring_loads<PRODUCER, STAGES>(steps, bar_free, load_q)) {
                return;   // (the producer is done)
            }
        }

        float dv_acc[D / 2], dk_acc[D / 2];   // this warpgroup's 64 keys x D (the accumulator layout)
#pragma unroll
        for (int i = 0; i < D / 2; ++i) dv_acc[i] = dk_acc[i] = 0.f;
        mbarrier_wait(&bar_kv, ui & 1);
        if constexpr (VARLEN) {
            // K and V rows past the document (the next one's) zeroed before any product reads them:
            // the hidden entries' P and dS are 0, but 0 x Inf is NaN (likewise Q and dO a step)
            if (sk - n0 < BN) {
                zero_tile_rows(k_s, v_s, DB, KV_BOX, max(sk - n0, 0), BN, 12 + wg);
            }
        }
        if constexpr (DROPOUT)   // (this warpgroup's 64 rows of K and V into DropoutKeyOrder, see the top)
            permute_tile_rows<DB>(k_s + wg * 64 * 128, v_s + wg * 64 * 128, KV_BOX, attention::DropoutKeyOrder<>{}, 8 + wg);
        // This warpgroup's 64 key rows of K and V (k16 steps and 64-column boxes advance from here)
        const unsigned long long k_desc = wgmma_desc_sw128(k_s + wg * 64 * 128), v_desc = wgmma_desc_sw128(v_s + wg * 64 * 128);

        // dQ of step si (DQ_ATOMIC): this warpgroup's 64 x 64 part (see SPLIT_N) of dS K, A = dS^T read
        // transposed from buffer si & 1, B = K read MN-major (key rows of D); one commit group.
        const int qhalf = SPLIT_N && BM == 128 ? wg : 0, dhalf = SPLIT_N && D == 128 ? wg : 0;
        auto dq_issue = [&](int si, float (&dq)[32]) {
            constexpr int KSTEPS = SPLIT_N ? BN / 16 : 64 / 16;
            const unsigned long long a0 = wgmma_desc_sw128_mn(
                ds_s + (si & 1) * DS_BYTES + qhalf * BN * 128 + (SPLIT_N ? 0 : wg * 64 * 128), 64 * 128);
            const unsigned long long b0 = wgmma_desc_sw128_mn(k_s + dhalf * KV_BOX + (SPLIT_N ? 0 : wg * 64 * 128), KV_BOX);
            wgmma_zero_and_fence(dq);
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk)
                Wgmma<T, 64>::template ss<1, 1>(dq, wgmma_desc_advance(a0, kk * 16 * 128), wgmma_desc_advance(b0, kk * 16 * 128),
                                                kk > 0);
            wgmma_commit();
        };
        // ... added into dq_accum (query head h, the tile at row m0): rows m0 + 64 qhalf + 16 warp + g
        // (+8), columns 64 dhalf + 8j + 2t (+1).
        // Each warp stages its 16 rows x 64 columns as two boxes of 16 rows x 32 floats (128-byte
        // swizzle: chunk c of row r at c ^ (r % 8), conflict-free stores), then lane 0 issues one TMA
        // reduce-add a box (rows past Sq are skipped by TMA; VARLEN: rows past the document add
        // zeros into the next document's: 0 staged there, since dS = 0 times this document's K is
        // NaN where K holds Inf). The step before's reduce has long read the boxes; lane 0 waits for
        // that before they are written again. ORDERED: the rows are staged for the writer (see the
        // top) once it has read the tile before (dq_empty), and handed over by dq_full; `gt` is the
        // block's count of the tile (its phases).
        auto dq_store = [&](int h, int m0, const float (&dq)[32], int gt) {
            unsigned char* const stage = dq_s + (wg * 4 + warp) * 2 * 2048;
            if constexpr (ORDERED) {
                if (gt > 0) mbarrier_wait(&dq_empty, (gt - 1) & 1);
            } else if (lane == 0) {
                tma_store_wait_read<0>();
            }
            __syncwarp();
            stage_rows_sw128(stage, dq, g, t);
            if constexpr (VARLEN) {
                // (the rows past the document zeroed once staged, dq's registers dead by then: a
                // test in the stores above spilled d128's producer instance)
                // (the warp index broadcast: known warp-uniform, the branch stays uniform; a branch
                // ptxas takes for divergent moved the step loop's counters and wgmma descriptors out of
                // the uniform registers, 30% slower)
                const int rows_in = sq - (m0 + qhalf * 64 + __shfl_sync(0xffffffffu, warp, 0) * 16);
                if (rows_in < 16) {
                    __syncwarp();
#pragma unroll
                    for (int c = 0; c < 8; ++c) {   // (16-byte chunk i: box i / 128, row (i / 8) % 16)
                        const int i = 32 * c + lane;
                        if ((i / 8) % 16 >= rows_in)
                            *reinterpret_cast<float4*>(stage + (i / 128) * 2048 + ((i / 8) % 16) * 128 + (i % 8) * 16) =
                                make_float4(0.f, 0.f, 0.f, 0.f);
                    }
                }
            }
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) {
                if constexpr (ORDERED) {
                    mbarrier_arrive(&dq_full);
                } else {
#pragma unroll
                    for (int box = 0; box < 2; ++box)
                        tma_reduce_add_4d(&dq_map, stage + box * 2048, dhalf * 64 + 32 * box, h,
                                          span.q0 + m0 + qhalf * 64 + warp * 16, b);
                    tma_store_commit();
                }
            }
        };
        // The step's query tile and head, and the step before's (its dQ is stored in this one), kept
        // by counting rather than divided out of the step number a step.
        int m_tile = m_first + rot, h_step = hk * rep, prev_m0 = 0, prev_h = 0;
        int in_head = 0;   // (ROTATE: the head's tiles done)
        const int G0 = PERSISTENT ? gbase : 0;   // (the ring's and dS^T buffers' count before this unit)
        for (int it = 0; it < steps; ++it) {
            const int G = G0 + it;
            const int buf = G % STAGES;
            const int m0 = m_tile * BM;
            CUK_STEP_STAMP(1);
            if (!PRODUCER && threadIdx.x == 0 && it + STAGES - 1 < steps) {
                if (it > 0) mbarrier_wait(&bar_free[(it - 1) % STAGES], ((it - 1) / STAGES) & 1);
                load_q(it + STAGES - 1);
            }
            const unsigned char* const qb = q_s + buf * Q_BYTES;
            const unsigned char* const dob = do_s + buf * Q_BYTES;
            const float* const lrow = rows_s + buf * 2 * BM;
            const float* const drow = lrow + BM;
            mbarrier_wait(&bar_q[buf], (G / STAGES) & 1);
            if constexpr (VARLEN) {
                if (sq - m0 < BM) {
                    zero_tile_rows(const_cast<unsigned char*>(qb), const_cast<unsigned char*>(dob), DB, Q_BOX,
                                   max(sq - m0, 0), BM, 12 + wg);
                }
            }
            CUK_STEP_STAMP(2);

            // S^T = K Q^T, then dP^T = V dO^T behind it (this warpgroup's 64 keys x BM queries)
            float s[BM / 2], dp[BM / 2];
            const unsigned long long q_desc = wgmma_desc_sw128(qb), do_desc = wgmma_desc_sw128(dob);
            wgmma_zero_and_fence(s);
            wgmma_zero_and_fence(dp);
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Wgmma<T, BM>::ss(s, wgmma_desc_advance(k_desc, (ks / 4) * KV_BOX + (ks % 4) * 32),
                                 wgmma_desc_advance(q_desc, (ks / 4) * Q_BOX + (ks % 4) * 32), ks > 0);
            wgmma_commit();
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Wgmma<T, BM>::ss(dp, wgmma_desc_advance(v_desc, (ks / 4) * KV_BOX + (ks % 4) * 32),
                                 wgmma_desc_advance(do_desc, (ks / 4) * Q_BOX + (ks % 4) * 32), ks > 0);
            wgmma_commit();

            // DROPOUT: the keep bits of this thread's scores, score 4 j + e of keep[j / 8] (see the top)
            unsigned int keep[DROPOUT ? BM / 64 : 1];
            if constexpr (DROPOUT) {
                attention::DropoutDraw::stashed(drop_sh, drop_threshold).keep_rows(keep, b * H + h_step, m0, key0, g, t);
            }
            auto kept = [&](int i) {
                return DROPOUT && ((keep[i / 32] >> attention::DropoutDraw::keep_rows_bit(i % 32)) & 1u);
            };

            wgmma_wait<1>();
            wgmma_hold(s);
            CUK_STEP_STAMP(3);

            // P^T = exp2(S^T scale_log2 - lse_log2) (this thread's query columns 8j + 2t, +1), 0 for
            // queries past sq, keys past sk and, causal, keys past the diagonal
            unsigned int pa[BM / 16][4];   // P^T as the A fragments of dV (k16 step kk: query columns 16kk..)
            if constexpr (CAP_LATE) {
                // (after dP^T: P^T and dS^T in one pass)
                const bool edge = m0 + BM > sq || km.edge(n0, BN, m0, BM, sk);
                wgmma_wait<0>();
                wgmma_hold(dp);
#pragma unroll
                for (int j = 0; j < BM / 8; ++j) {
                    const float2 l = *reinterpret_cast<const float2*>(lrow + 8 * j + 2 * t);
                    const float2 d = *reinterpret_cast<const float2*>(drow + 8 * j + 2 * t);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float th = attention::tanh_approx(s[4 * j + e] * cap_in);
                        float p = fast_exp2(fmaf(th, cap_out, -(e & 1 ? l.y : l.x)));
                        const int key = key0 + (e >> 1) * ROW8, q = m0 + 8 * j + 2 * t + (e & 1);
                        if (edge & ((q >= sq) | km.hidden_bits(q, key, sk))) p = 0.f;
                        s[4 * j + e] = p;
                        // (VARLEN: exactly 0 where P is, as in the pass without the softcap)
                        dp[4 * j + e] = VARLEN && p == 0.f ? 0.f
                                                            : p * (dp[4 * j + e] - (e & 1 ? d.y : d.x)) * (1.f - th * th);
                    }
                }
            } else if constexpr (SOFTCAP) {
                // P^T's fragments packed a column pair at a time, and s kept as P^T (1 - t^2) for
                // dS^T = (P^T (1 - t^2)) (dP^T - Dsum): t dies here, no registers held for it, and
                // dP^T's wait stays behind the exponentials as without the softcap
                const bool edge = m0 + BM > sq || (MASK == 2 ? km.edge(n0, BN, m0, BM, sk)
                                                               : n0 + BN > sk || (CAUSAL && n0 + BN - 1 > m0 + diag));
#pragma unroll
                for (int j = 0; j < BM / 8; ++j) {
                    const float2 l = *reinterpret_cast<const float2*>(lrow + 8 * j + 2 * t);
                    float p[4], u[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float th = attention::tanh_approx(s[4 * j + e] * cap_in);
                        p[e] = fast_exp2(fmaf(th, cap_out, -(e & 1 ? l.y : l.x)));
                        if constexpr (MASK == 2) {
                            const int key = key0 + (e >> 1) * ROW8, q = m0 + 8 * j + 2 * t + (e & 1);
                            if (edge & ((q >= sq) | km.hidden_bits(q, key, sk))) p[e] = 0.f;
                        } else {
                            // (with && and || ptxas branched a score here at causal d128 and spilled)
                            const int key = key0 + (e >> 1) * ROW8, q = m0 + 8 * j + 2 * t + (e & 1);
                            if (edge & ((q >= sq) | (key >= sk) | (CAUSAL & (key > q + diag)))) p[e] = 0.f;
                        }
                        u[e] = 1.f - th * th;
                    }
                    pa[j / 2][2 * (j % 2)] = pack2(p[0], p[1], T{});
                    pa[j / 2][2 * (j % 2) + 1] = pack2(p[2], p[3], T{});
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[4 * j + e] = p[e] * u[e];
                }
            } else if constexpr (MASK == 2) {
                const bool edge = m0 + BM > sq || km.edge(n0, BN, m0, BM, sk);
#pragma unroll
                for (int j = 0; j < BM / 8; ++j) {
                    const float2 l = *reinterpret_cast<const float2*>(lrow + 8 * j + 2 * t);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float p = fast_exp2(fmaf(s[4 * j + e], scale_log2, -(e & 1 ? l.y : l.x)));
                        const int key = key0 + (e >> 1) * ROW8, q = m0 + 8 * j + 2 * t + (e & 1);
                        if (edge & ((q >= sq) | km.hidden_bits(q, key, sk))) p = 0.f;
                        s[4 * j + e] = p;
                    }
                }
            } else if constexpr (VARLEN || CAUSAL) {
                // (causal: the window's loop written out, see the top; a tile-level branch to the
                // tests as below measured 3% slower at d128 causal. Packed causal documents: the
                // && form a score, 5% faster there.)
                const bool edge = m0 + BM > sq || n0 + BN > sk || (CAUSAL && n0 + BN - 1 > m0 + diag);
#pragma unroll
                for (int j = 0; j < BM / 8; ++j) {
                    const float2 l = *reinterpret_cast<const float2*>(lrow + 8 * j + 2 * t);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float p = fast_exp2(fmaf(s[4 * j + e], scale_log2, -(e & 1 ? l.y : l.x)));
                        if constexpr (VARLEN) {
                            if (edge) {
                                const int key = key0 + (e >> 1) * ROW8, q = m0 + 8 * j + 2 * t + (e & 1);
                                if (q >= sq || key >= sk || (CAUSAL && key > q + diag)) p = 0.f;
                            }
                        } else {
                            const int key = key0 + (e >> 1) * ROW8, q = m0 + 8 * j + 2 * t + (e & 1);
                            if (edge & ((q >= sq) | (key >= sk) | (CAUSAL & (key > q + diag)))) p = 0.f;
                        }
                        s[4 * j + e] = p;
                    }
                }
            } else {
                // No mask: P^T for every score, then, on the tiles past sq or sk only, the scores
                // outside zeroed. (The branch-free test a score that the causal form keeps ran on
                // every tile here, 3-4 instructions a score a step: 2.5% of the d128 backward.)
#pragma unroll
                for (int j = 0; j < BM / 8; ++j) {
                    const float2 l = *reinterpret_cast<const float2*>(lrow + 8 * j + 2 * t);
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[4 * j + e] = fast_exp2(fmaf(s[4 * j + e], scale_log2, -(e & 1 ? l.y : l.x)));
                }
                if (m0 + BM > sq || n0 + BN > sk) {
                    // Score (key row key0 + ROW8 r, query m0 + 2 t + c, c = 8 j + (e & 1)) is outside
                    // when the query is past sq or the key past sk: as one bound a row on the
                    // constant c, c >= q_end[r]
                    int q_end[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r) q_end[r] = key0 + ROW8 * r >= sk ? -1 : sq - m0 - 2 * t;
#pragma unroll
                    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (8 * j + (e & 1) >= q_end[e >> 1]) s[4 * j + e] = 0.f;
                }
            }
            // dV += P^T dO: P^T's A fragments from the accumulators (the softcap's packed above;
            // DROPOUT: the kept weights, unscaled)
            if constexpr (DROPOUT) {
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int e0 = 8 * kk + 2 * i;
                        pa[kk][i] = pack2(kept(e0) ? s[e0] : 0.f, kept(e0 + 1) ? s[e0 + 1] : 0.f, T{});
                    }
            } else if constexpr (!SOFTCAP || CAP_LATE) {
                accumulators_to_a<T>(s, pa);
            }
            wgmma_rs_mn<T, D>(dv_acc, pa, dob, Q_BOX);
            CUK_STEP_STAMP(4);

            if constexpr (!CAP_LATE) {
                wgmma_wait<1>();   // dP^T is in (dV may still run)
                wgmma_hold(dp);
#pragma unroll
                for (int j = 0; j < BM / 8; ++j) {
                    const float2 d = *reinterpret_cast<const float2*>(drow + 8 * j + 2 * t);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {   // (VARLEN: exactly 0 where P is, whatever dP^T holds there: rows
                        // past the document, whose dQ is added into the next one's rows, must add zeros)
                        if constexpr (DROPOUT) {
                            const float z = kept(4 * j + e) ? dp[4 * j + e] * drop_rescale : 0.f;
                            dp[4 * j + e] = s[4 * j + e] * (z - (e & 1 ? d.y : d.x));
                        } else {
                            dp[4 * j + e] = VARLEN && s[4 * j + e] == 0.f ? 0.f
                                                                          : s[4 * j + e] * (dp[4 * j + e] - (e & 1 ? d.y : d.x));
                        }
                    }
                }
            }
            unsigned int dsa[BM / 16][4];
            accumulators_to_a<T>(dp, dsa);
            if constexpr (DQ_ATOMIC) {
                // dS^T into shared memory as TMA would store it: boxes of 64 queries, key rows of 128
                // bytes, 16-byte chunk c of row r at chunk c ^ (r % 8). Two buffers, by step parity:
                // both warpgroups' dQ of step it - 2 must have read this one (ds_free). Published to
                // both warpgroups' dQ of this step by ds_full (256 arrivals). By stmatrix: 8 x 8
                // matrices of (key rows, 8 queries), four a store; lane l addresses row l % 8 of matrix
                // l / 8 (query chunk j + (l / 8) / 2, rows 8 ((l / 8) % 2) on). 4 stores against 16
                // 4-byte ones: +2-5% at d128 (docs/notes-attention.md, step 8).
                if (G >= 2) mbarrier_wait(&ds_free[G & 1], ((G - 2) >> 1) & 1);
                unsigned char* const dsb = ds_s + (G & 1) * DS_BYTES;
#pragma unroll
                for (int j = 0; j < BM / 8; j += 2) {
                    const int mat = lane / 8, jj = j + mat / 2, row = wg * 64 + warp * 16 + 8 * (mat % 2) + lane % 8;
                    stmatrix_x4(dsb + (jj / 8) * BN * 128 + row * 128 + (((jj % 8) ^ (lane % 8)) << 4), dsa[j / 2]);
                }
                // (generic-proxy stores, read next by wgmma. ONE_FENCE: published behind the step
                // before's dQ staging below, whose proxy fence covers both; step 0 stages no dQ)
                if (!ONE_FENCE || it == 0) {
                    fence_proxy_async();
                    mbarrier_arrive(&ds_full[G & 1]);
                }
            }
            CUK_STEP_STAMP(5);
            wgmma_wait<0>();   // dV done: P^T's fragments are free
            wgmma_hold(dv_acc);
            wgmma_hold(pa);
            CUK_STEP_STAMP(6);

            // dK += dS^T Q (Q read MN-major as stored), and dQ of the step before
            if (DQ_ATOMIC && it > 0) {
                mbarrier_wait(&ds_full[(G - 1) & 1], ((G - 1) >> 1) & 1);
                float dq[32];
                if constexpr (DQ_FIRST) {
                    dq_issue(G - 1, dq);
                    wgmma_rs_mn<T, D>(dk_acc, dsa, qb, Q_BOX);
                    wgmma_wait<1>();   // dQ done (dK may still run under its store)
                } else {
                    wgmma_rs_mn<T, D>(dk_acc, dsa, qb, Q_BOX);
                    dq_issue(G - 1, dq);
                    wgmma_wait<0>();
                }
                wgmma_hold(dq);
                CUK_STEP_STAMP(7);
                dq_store(prev_h, prev_m0, dq, G - 1);
                if constexpr (ONE_FENCE) mbarrier_arrive(&ds_full[G & 1]);   // (this step's dS^T, fenced with dQ's staging)
                mbarrier_arrive(&ds_free[(G - 1) & 1]);
                if constexpr (DQ_FIRST) wgmma_wait<0>();
            } else {
                wgmma_rs_mn<T, D>(dk_acc, dsa, qb, Q_BOX);
                wgmma_wait<0>();
            }
            wgmma_hold(dk_acc);
            wgmma_hold(dsa);
            mbarrier_arrive(&bar_free[buf]);   // (this thread's products have read Q and dO)
            CUK_STEP_STAMP(8);
            prev_m0 = m0;
            prev_h = h_step;
            if constexpr (ROTATE) {
                if (++m_tile == m_first + per_head) m_tile = m_first;
                if (++in_head == per_head) {   // (m_tile is back at the head's first, m_first + rot)
                    in_head = 0;
                    ++h_step;
                }
            } else if (++m_tile == m_first + per_head) {
                m_tile = m_first;
                ++h_step;
            }
        }
        if (DQ_ATOMIC && steps > 0) {   // the last step's dQ
            const int GL = G0 + steps - 1;
            mbarrier_wait(&ds_full[GL & 1], (GL >> 1) & 1);
            float dq[32];
            dq_issue(GL, dq);
            wgmma_wait<0>();
            wgmma_hold(dq);
            dq_store(prev_h, prev_m0, dq, GL);
            if constexpr (PERSISTENT) mbarrier_arrive(&ds_free[GL & 1]);   // (the next unit's steps reuse it)
        }
        if constexpr (DQ_ATOMIC && !ORDERED)   // (the reduces have read this block's shared memory: at its end)
            if (lane == 0 && (!PERSISTENT || u + static_cast<int>(gridDim.x) >= units)) tma_store_wait<0>();

        // dV and dK (scaled), this warpgroup's 64 keys of this (batch, kv head), staged in its own
        // rows of V and K and written by whole rows (dk and dv are allocated dense in some order of
        // their dims: 16-byte rows and strides; DROPOUT: a row to its key's). Only this warpgroup reads its rows of V; K's rows
        // are read by both warpgroups' dQ products (SPLIT_N), so dK waits for both to be done.
        const int wg_key0 = n0 + wg * 64;
        const float dv_scale = DROPOUT ? drop_rescale : 1.f;   // (DROPOUT: the kept weights' 1 / (1 - p))
        using RowOf = attention::DropoutKeyOrder<DROPOUT>;
        store_tile_staged<T, D, KV_BOX, RowOf>(dv_acc, dv_scale, dv_scale, v_s + wg * 64 * 128,
                                               dv + b * dv_sb + static_cast<long long>(span.k0 + wg_key0) * dv_ss + hk * dv_sh,
                                               dv_ss, sk - wg_key0, 8 + wg);
        named_barrier_sync(10, 256);
        store_tile_staged<T, D, KV_BOX, RowOf>(dk_acc, scale, scale, k_s + wg * 64 * 128,
                                               dk + b * dk_sb + static_cast<long long>(span.k0 + wg_key0) * dk_ss + hk * dk_sh,
                                               dk_ss, sk - wg_key0, 8 + wg);
        CUK_STAMP(9);
        if constexpr (PERSISTENT) {
            mbarrier_arrive(&kv_free);   // (this thread has read its rows of K's and V's buffers)
            gbase += steps;
        }
    }   // (the units)
#elif defined(__CUDA_ARCH__)
    __trap();   // (built without sm_90a's features: fail loudly, never return an unwritten output)
#endif
}

template <typename T, int D, int BM, int STAGES, int MASK, bool SOFTCAP, bool DQ_ATOMIC, bool PRODUCER, int SMEM,
          bool VARLEN, bool PERSISTENT, bool ORDERED, bool DROPOUT>
__global__ void __launch_bounds__(PRODUCER ? 384 : 256, 1) attention_bwd_sm90(
    const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
    const __grid_constant__ CUtensorMap dq_map, const __grid_constant__ cuk::attention::BwdSm90Params<T> p)
{
    const cuk::attention::Problem& r = p.problem;
    attention_bwd_sm90_body<T, D, BM, STAGES, MASK, SOFTCAP, DQ_ATOMIC, PRODUCER, SMEM, VARLEN, PERSISTENT, ORDERED, DROPOUT>(
        q_map, k_map, v_map, do_map, dq_map, p.rows, p.dk, p.dv, p.dk_sb, p.dk_ss, p.dk_sh, p.dv_sb, p.dv_ss,
        p.dv_sh, r.H, r.Hkv, r.Sq, r.Sk, r.scale, r.scale_log2, r.win_left, r.win_right, r.cap_in, r.cap_out,
        r.cu_q, r.cu_k, r.max_q, r.max_k, r.fault, p.groups, p.turns, p.drop_rng, p.drop_threshold, p.drop_rescale);
}

// VARLEN (attention_bwd_sm90 over packed documents): lse * log2(e) and Dsum of each document's
// query tiles, laid out as that kernel loads them: document d's tile m of head h is tile
// q0 / BM + d + m of (H, ceil(total_q / BM) + documents, 2, BM) (a document's tiles never reach
// the next one's), zeros past the document's end. A block a (tile, document x head); documents
// with bad offsets are skipped (attention_bwd_sm90 records them).
template <int BM>
__global__ void __launch_bounds__(BM) attention_bwd_rows_varlen(
    const float* __restrict__ lse, const float* __restrict__ dsum, float* __restrict__ rows,
    const int* __restrict__ cu_q, int H, int total_q)
{
    const int doc = blockIdx.y / H, h = blockIdx.y % H, docs = gridDim.y / H;
    const int q0 = cu_q[doc], q1 = cu_q[doc + 1], m0 = blockIdx.x * BM;
    if (q0 < 0 || q1 < q0 || q1 > total_q || m0 >= q1 - q0) return;
    const int tiles = (total_q + BM - 1) / BM + docs, i = m0 + threadIdx.x;
    float* const at = rows + (static_cast<long long>(h) * tiles + q0 / BM + doc + blockIdx.x) * 2 * BM + threadIdx.x;
    const long long src = static_cast<long long>(h) * total_q + q0 + i;
    at[0] = i < q1 - q0 ? lse[src] * 1.4426950408889634f : 0.f;
    at[BM] = i < q1 - q0 ? dsum[src] : 0.f;
}
