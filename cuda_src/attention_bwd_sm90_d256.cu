// Fused attention backward on Hopper (sm_90a) for head dim 256 (docs/notes-attention.md): TMA
// tile loads, wgmma, dQ added into dq_accum (float32) by TMA reduce-add. The rest of the backward
// is attention_bwd.cu's: attention_bwd_dot (Dsum, and lse_log2 and Dsum in `rows`, tiles of
// [2][64] floats loaded here by bulk copy with Q and dO; dq_accum zeroed) and
// attention_bwd_dq_convert.
//
// attention_bwd_sm90 keeps dK and dV of 64 keys x D in a warpgroup's registers: at D = 256 that
// is 256 floats a thread, more than a thread has. Here a block of two computing warpgroups owns
// 64 keys of one (batch, kv head) and splits dK and dV by head-dim halves: warpgroup w holds
// columns 128 w .. 128 w + 127 of both (128 floats a thread). The scores are not split: warpgroup 0
// computes S^T = K Q^T and warpgroup 1 dP^T = V dO^T (64 keys x 64 queries each, over all 256
// columns), and they meet in shared memory:
//   warpgroup 1 stores dP^T (float32, its accumulator layout) and arrives (dp_full);
//   warpgroup 0 makes P^T = exp2(S^T scale_log2 - lse_log2) and dS^T = P^T (dP^T - Dsum) (the
//   softcap's (1 - t^2) too), stores both as T by stmatrix in the 128-byte swizzle and arrives
//   (ps_full);
//   both then take their half: dV += P^T dO, dK += dS^T Q (A = P^T or dS^T read K-major, B = dO or
//   Q read MN-major, as TMA stored them), dQ_half = dS K (A = dS^T read transposed).
// dQ is staged in the step's own Q and dO buffers once the products that read them are done (64
// query rows x 256 columns float32: warpgroup w's half in the boxes of columns 128 w on); the
// computing warps arrive (dq_full, one a buffer) and the producer warpgroup's second warp adds the
// tile into dq_accum by TMA reduce-add, 16 rows x 32 floats a box, and releases the buffers to the
// producer once the adds have read them. (Added by each warp's lane 0, the adds' issue and the
// wait for their reads stalled the computing warps; red.global.add a pair of floats at a time, 32
// reductions a thread a step, was slower still: docs/notes-attention.md.)
// A third warpgroup loads: K and V once, then Q, dO, lse_log2 and Dsum a query tile into a ring of
// two buffers ("landed" and "released" mbarriers), and gives its registers to the other two.
// Steps walk (head of the group, query tile) pairs, head-major; MASK (common/attn_mask.cuh): 0
// none, 1 causal, 2 a window, whose block walks only the query tiles its keys' window reaches.
// dK is scaled at the end; dq_accum is scaled by attention_bwd_dq_convert.
// ORDERED (deterministic=True): dQ's adds into a query tile take turns in a fixed order of the key
// blocks, as attention_bwd_sm90's ORDERED instances do (common/attn_turns.cuh): the writer waits
// for the tile's turn before its adds and passes the turn on once they are complete. With a mask
// the highest key block goes first (the grid's key blocks launched that way); without one key
// block n starts its walk of a head at tile n M / N (all N of a group resident: checked by the
// front). Two writers (the producer warpgroup's second and third warps) take alternate steps,
// each its own buffer of the ring: one writer's wait for its turn, the adds' completion and the
// turn's release a step came to more than a step, and the computing warps waited on it (12% of
// the backward against 4% with two; docs/notes-attention.md).
#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/hopper.cuh"
#include "common/attn_tile.cuh"
#include "common/attn_mask.cuh"
#include "common/attn_params.cuh"
#include "common/attn_turns.cuh"
#include "common/attn_bwd_split.cuh"


// SMEM: K, V, the Q and dO rings, P^T, dS^T, dP^T's exchange, lse_log2 and Dsum, 1 KB of slack.
template <typename T, int MASK, bool SOFTCAP, bool ORDERED, int SMEM>
__global__ void __launch_bounds__(384, 1) attention_bwd_sm90_d256(
    const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
    const __grid_constant__ CUtensorMap dq_map,   // dq_accum (B, Sq, H, 256) float32, boxes 16 x 32
    const __grid_constant__ cuk::attention::BwdWideParams<T> p)
{
    constexpr int D = 256, DB = 4, BN = 64, BM = 64, STAGES = 2;
    constexpr int BOX = 64 * 128;                    // one box: 64 rows x 128 bytes (64 columns)
    constexpr int TILE = DB * BOX;                   // a 64-row tile of 256 columns
    constexpr int PS_BYTES = 64 * 128;               // P^T or dS^T: 64 key rows x 64 queries
    constexpr int DP_BYTES = 128 * 32 * 4;           // dP^T: warpgroup 1's 32 floats a thread
    constexpr int ROWS_BYTES = STAGES * 2 * BM * 4;
    constexpr bool ROTATE = ORDERED && MASK == 0;   // (the unmasked walk's start, see the top)
    static_assert(SMEM == 2 * TILE + 2 * STAGES * TILE + 2 * PS_BYTES + DP_BYTES + ROWS_BYTES + 1024,
                  "SMEM: K, V, the Q and dO rings, P^T, dS^T, dP^T, lse and Dsum, alignment slack");
#if CUK_SM90A
    using namespace cuk;
    const cuk::attention::Problem& r = p.problem;
    const int H = r.H, Hkv = r.Hkv, sq = r.Sq, sk = r.Sk;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* const k_s = align_1024(smem_raw);   // [DB][64 key rows x 128 bytes]
    unsigned char* const v_s = k_s + TILE;
    unsigned char* const q_s = v_s + TILE;             // [STAGES][DB][64 query rows x 128 bytes]
    unsigned char* const do_s = q_s + STAGES * TILE;
    unsigned char* const pt_s = do_s + STAGES * TILE;  // P^T: [64 key rows x 128 bytes]
    unsigned char* const dst_s = pt_s + PS_BYTES;      // dS^T, likewise
    float4* const dp_x = reinterpret_cast<float4*>(dst_s + PS_BYTES);   // [8][128 threads] float4
    float* const rows_s = reinterpret_cast<float*>(dst_s + PS_BYTES + DP_BYTES);   // [STAGES][lse, Dsum][64]
    __shared__ unsigned long long bar_kv, bar_q[STAGES], bar_free[STAGES], dp_full, dp_free, ps_full, ps_free;
    __shared__ unsigned long long dq_full[STAGES];   // (a buffer's staged dQ rows, to their writer)

    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbarrier_init(&bar_q[i], 1);
            mbarrier_init(&bar_free[i], 1);   // (by dQ's writer)
            mbarrier_init(&dq_full[i], 8);
        }
        mbarrier_init(&bar_kv, 1);
        mbarrier_init(&dp_full, 128);
        mbarrier_init(&dp_free, 128);
        mbarrier_init(&ps_full, 128);
        mbarrier_init(&ps_free, 256);
        mbarrier_init_fence();
    }
    __syncthreads();

    const int kblock = ORDERED && MASK != 0 ? gridDim.x - 1 - blockIdx.x : blockIdx.x, group = blockIdx.y;
    const int b = group / Hkv, hk = group % Hkv, rep = H / Hkv;
    const int n0 = kblock * BN, diag = sk - sq;
    const attention::KeyMask<MASK> km(r.win_left, r.win_right, diag);
    const int m_first = km.first_query(n0) / BM;
    const int per_head = max(0, (km.stop_query(n0, BN, sq) + BM - 1) / BM - m_first);
    const int steps = per_head * rep;
    const int tiles = (sq + BM - 1) / BM;
    // ORDERED: this group's key blocks, and ROTATE's first query tile of a head (see the top)
    const int nblocks = (sk + BN - 1) / BN;
    const int rot = ROTATE ? static_cast<int>(static_cast<long long>(kblock) * per_head / nblocks) : 0;

    auto load_q = [&](int it) {   // (the producer) Q, dO, lse_log2 and Dsum of step it
        int i = it % per_head + rot;
        if (ROTATE && i >= per_head) i -= per_head;
        const int buf = it % STAGES, h = hk * rep + it / per_head, m = m_first + i;
        mbarrier_arrive_expect_tx(&bar_q[buf], 2 * TILE + 2 * BM * 4);
        bulk_load(rows_s + buf * 2 * BM, p.rows + ((static_cast<long long>(b) * H + h) * tiles + m) * 2 * BM, 2 * BM * 4,
                  &bar_q[buf]);
#pragma unroll
        for (int db = 0; db < DB; ++db) {
            tma_load_4d(q_s + buf * TILE + db * BOX, &q_map, db * 64, h, m * BM, b, &bar_q[buf]);
            tma_load_4d(do_s + buf * TILE + db * BOX, &do_map, db * 64, h, m * BM, b, &bar_q[buf]);
        }
    };
    if (threadIdx.x == 256) {
        mbarrier_arrive_expect_tx(&bar_kv, 2 * TILE);
#pragma unroll
        for (int db = 0; db < DB; ++db) {
            tma_load_4d(k_s + db * BOX, &k_map, db * 64, hk, n0, b, &bar_kv);
            tma_load_4d(v_s + db * BOX, &v_map, db * 64, hk, n0, b, &bar_kv);
        }
    }
    // dQ's stage: warpgroup wg's warp w's four boxes in buffer buf (see the dQ adds below)
    auto dq_stage = [&](int buf, int wg, int w) {
        return (w < 2 ? q_s : do_s) + buf * TILE + 2 * wg * BOX + (w % 2) * 4 * 2048;
    };
    {   // (the producer warpgroup's second warp, and third where ORDERED: dQ's writers, see the top)
        // ORDERED: two writers, taking alternate steps, each one buffer of the ring (see the top)
        constexpr int WRITERS = ORDERED ? 2 : 1;
        static_assert(STAGES % WRITERS == 0, "a writer's steps in one buffer");
        auto write = [&](int side) {   // (writer j: steps j, j + WRITERS, ...)
            const int j = WRITERS == 1 ? 0 : side;
            attention::dq_writer<MASK, BM, BN, ORDERED, WRITERS>(
                j, attention::TileWalk(m_first, rot, hk * rep, per_head), steps, p.turns, b * H, tiles, 0, kblock,
                nblocks, km.hi, [&](int it) { mbarrier_wait(&dq_full[it % STAGES], (it / STAGES) & 1); },
                [&](const attention::TileWalk& walk, int it) {
                    const int buf = it % STAGES;
#pragma unroll
                    for (int w = 0; w < 8; ++w)
#pragma unroll
                        for (int box = 0; box < 4; ++box)
                            tma_reduce_add_4d(&dq_map, dq_stage(buf, w / 4, w % 4) + box * 2048,
                                              128 * (w / 4) + 32 * box, walk.h, walk.m * BM + (w % 4) * 16, b);
                },
                [&](int it) { mbarrier_arrive(&bar_free[it % STAGES]); });   // (the adds have read the buffers)
        };
        if (!ring_loads<true, STAGES, 2, 240, WRITERS>(steps, bar_free, load_q, write))
            return;   // (the producer is done)
    }

    const int wg = warpgroup_index(), warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4, tid = threadIdx.x % 128;
    const int key0 = n0 + warp * 16 + g;   // this thread's keys in S^T and dP^T: key0 and key0 + 8
    float dv_acc[64], dk_acc[64];          // this warpgroup's half: 64 keys x 128 columns
#pragma unroll
    for (int i = 0; i < 64; ++i) dv_acc[i] = dk_acc[i] = 0.f;
    mbarrier_wait(&bar_kv, 0);
    const unsigned long long kv_desc = wgmma_desc_sw128(wg == 0 ? k_s : v_s);   // (S^T from K, dP^T from V)

    int m_tile = m_first + rot;
    for (int it = 0; it < steps; ++it) {
        const int buf = it % STAGES, m0 = m_tile * BM;
        const unsigned char* const qb = q_s + buf * TILE;
        const unsigned char* const dob = do_s + buf * TILE;
        const float* const lrow = rows_s + buf * 2 * BM;
        const float* const drow = lrow + BM;
        mbarrier_wait(&bar_q[buf], (it / STAGES) & 1);

        // S^T = K Q^T (warpgroup 0) or dP^T = V dO^T (warpgroup 1): 64 keys x 64 queries
        float s[32];
        {
            const unsigned long long b_desc = wgmma_desc_sw128(wg == 0 ? qb : dob);
            wgmma_zero_and_fence(s);
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Wgmma<T, 64>::ss(s, wgmma_desc_advance(kv_desc, (ks / 4) * BOX + (ks % 4) * 32),
                                 wgmma_desc_advance(b_desc, (ks / 4) * BOX + (ks % 4) * 32), ks > 0);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_hold(s);
        }
        if (wg == 1) {
            attention::hand_over_dpt(s, dp_x, &dp_full, &dp_free, it, tid);
        } else {
            unsigned int pa[4][4], dsa[4][4];
            attention::p_and_ds<T, MASK, SOFTCAP>(s, pa, dsa, lrow, drow, dp_x, &dp_full, &dp_free, it, km, r, sq, sk,
                                                  key0, m0, n0, tid, t);
            attention::publish_p_ds(pt_s, dst_s, pa, dsa, &ps_full, &ps_free, it, lane, warp);
        }

        // This warpgroup's half: dV += P^T dO, dK += dS^T Q, dQ = dS K (columns 128 wg ..)
        mbarrier_wait(&ps_full, it & 1);
        {
            const unsigned long long pt = wgmma_desc_sw128(pt_s), dst = wgmma_desc_sw128(dst_s);
            const unsigned long long dob_half = wgmma_desc_sw128_mn(dob + 2 * wg * BOX, BOX);
            const unsigned long long qb_half = wgmma_desc_sw128_mn(qb + 2 * wg * BOX, BOX);
            wgmma_hold(dv_acc);
            wgmma_hold(dk_acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                Wgmma<T, 128>::template ss<0, 1>(dv_acc, wgmma_desc_advance(pt, kk * 32),
                                                 wgmma_desc_advance(dob_half, kk * 16 * 128), 1);
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                Wgmma<T, 128>::template ss<0, 1>(dk_acc, wgmma_desc_advance(dst, kk * 32),
                                                 wgmma_desc_advance(qb_half, kk * 16 * 128), 1);
            wgmma_commit();
        }
        float dq[64];
        {
            const unsigned long long a0 = wgmma_desc_sw128_mn(dst_s, BOX);
            const unsigned long long b0 = wgmma_desc_sw128_mn(k_s + 2 * wg * BOX, BOX);
            wgmma_zero_and_fence(dq);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                Wgmma<T, 128>::template ss<1, 1>(dq, wgmma_desc_advance(a0, kk * 16 * 128),
                                                 wgmma_desc_advance(b0, kk * 16 * 128), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_hold(dq);
            wgmma_hold(dv_acc);
            wgmma_hold(dk_acc);
        }
        mbarrier_arrive(&ps_free);          // (P^T and dS^T read)
        // dQ: rows m0 + 16 warp + g (+8), columns 128 wg + 8 j + 2 t (+1), staged by the warp as four
        // boxes of 16 rows x 32 floats (128-byte swizzle: chunk c of row r at c ^ (r % 8)) for the
        // writer's TMA reduce-adds, one a box (rows past sq are skipped by TMA). The staging is this warpgroup's
        // own boxes of the step's Q and dO (columns 128 wg on: only its products read them, and
        // those are done; the other warpgroup's S^T or dP^T read all four before ps_full): warps 0
        // and 1 in Q's, 2 and 3 in dO's, 8 KB each.
        {
            unsigned char* const stage = dq_stage(buf, wg, warp);
            stage_rows_sw128(stage, dq, g, t);
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&dq_full[buf]);
        }
        if (++m_tile == m_first + per_head) m_tile = m_first;
    }

    // dV and dK (scaled): this warpgroup's 64 keys x 128 columns, staged in its own two boxes of V
    // and K (every product has read them: the last step's dQ reads K's, the barrier below) and
    // written by whole rows
    named_barrier_sync(10, 256);
    store_tile_staged<T, 128, BOX>(dv_acc, 1.f, 1.f, v_s + 2 * wg * BOX,
                                   p.dv + b * p.dv_sb + static_cast<long long>(n0) * p.dv_ss + hk * p.dv_sh + 128 * wg,
                                   p.dv_ss, sk - n0, 8 + wg);
    store_tile_staged<T, 128, BOX>(dk_acc, r.scale, r.scale, k_s + 2 * wg * BOX,
                                   p.dk + b * p.dk_sb + static_cast<long long>(n0) * p.dk_ss + hk * p.dk_sh + 128 * wg,
                                   p.dk_ss, sk - n0, 8 + wg);
#elif defined(__CUDA_ARCH__)
    __trap();   // (built without sm_90a's features: fail loudly, never return an unwritten output)
#endif
}
