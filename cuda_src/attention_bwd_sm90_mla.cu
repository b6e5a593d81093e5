// Fused attention backward on Hopper (sm_90a) for DeepSeek's MLA head sizes, q and k of 192 and v
// of 128 (docs/notes-attention.md): TMA tile loads, wgmma, dQ added into dq_accum (float32) by TMA
// reduce-add. The rest of the backward is attention_bwd.cu's: attention_bwd_dot (Dsum, lse_log2
// and Dsum in `rows`, tiles of [2][64] floats loaded here by bulk copy with Q and dO; dq_accum
// zeroed) and attention_bwd_dq_convert.
//
// attention_bwd_sm90 keeps dK and dV of 64 keys in one warpgroup's registers: at 192 + 128
// columns that is 160 floats a thread beside the step's scores, more than it has. Here a block of
// two computing warpgroups owns 64 keys of one (batch, kv head) and gives each product of a step
// to one warpgroup whole (in 64 x 64 x 64 units: S^T 3, dP^T 2, dV 2, dK 3, dQ 3):
//   warpgroup 0: S^T = K Q^T (over 192), P^T = exp2(S^T scale_log2 - lse_log2) and dS^T = P^T
//   (dP^T - Dsum) (the softcap's (1 - t^2) too), stored as T by stmatrix in the 128-byte swizzle
//   (ps_full), then dK += dS^T Q with dS^T from its registers (64 keys x 192: 96 floats a thread);
//   warpgroup 1: dP^T = V dO^T (over 128), handed to warpgroup 0 in float32 through shared memory
//   (dp_full), then dV += P^T dO (64 keys x 128: 64 floats) and dQ = dS K (64 queries x 192, A =
//   dS^T read transposed), both from the stored P^T and dS^T.
// So warpgroup 0 carries 6 units and the softmax, warpgroup 1 7 units. dQ is staged in a buffer of
// its own (64 rows x 192 floats: the step's Q and dO tiles are 40 KB) and added by the producer
// warpgroup's second warp, 16 rows x 32 floats a box; warpgroup 1 stages the next step's once the
// adds have read it (dq_empty). A products' 192 columns are one product of 128 and one of 64.
// A third warpgroup loads K and V once, then Q, dO, lse_log2 and Dsum a query tile into a ring of
// two buffers, released by every computing thread once its products have read them.
// Steps walk (head of the group, query tile) pairs, head-major; MASK (common/attn_mask.cuh): 0
// none, 1 causal, 2 a window, whose block walks only the query tiles its keys' window reaches.
// dK is scaled at the end; dq_accum is scaled by attention_bwd_dq_convert.
// ORDERED (deterministic=True): dQ's adds into a query tile take turns in a fixed order of the key
// blocks, as attention_bwd_sm90_d256's ORDERED instances do (common/attn_turns.cuh), by two
// writers taking alternate steps (dq_full and dq_empty a writer; the stage passes between them).
#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/hopper.cuh"
#include "common/attn_tile.cuh"
#include "common/attn_mask.cuh"
#include "common/attn_params.cuh"
#include "common/attn_turns.cuh"
#include "common/attn_bwd_split.cuh"

namespace cuk {
namespace attention {

// attention_bwd_sm90_mla's parameters besides the tensor maps: rows (B, H, ceil(Sq / 64), 2, 64)
// float32 (lse * log2(e) and Dsum a query tile), dK (B, Sk, Hkv, 192) and dV (B, Sk, Hkv, 128)
// with their strides in elements (batch, sequence, head), the problem; ORDERED: a turn counter a
// `rows` query tile, zeroed (else null).
template <typename T>
struct BwdMlaParams {
    const float* rows;
    T* dk;
    T* dv;
    int* turns;
    long long dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh;
    Problem problem;
};

}  // namespace attention
}  // namespace cuk

// SMEM: K, V, the Q and dO rings, P^T, dS^T, dQ's stage, dP^T's exchange, lse_log2 and Dsum, 1 KB
// of slack.
template <typename T, int MASK, bool SOFTCAP, bool ORDERED, int SMEM>
__global__ void __launch_bounds__(384, 1) attention_bwd_sm90_mla(
    const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
    const __grid_constant__ CUtensorMap dq_map,   // dq_accum (B, Sq, H, 192) float32, boxes 16 x 32
    const __grid_constant__ cuk::attention::BwdMlaParams<T> p)
{
    constexpr int D = 192, DV = 128, BN = 64, BM = 64, STAGES = 2;
    constexpr int BOX = 64 * 128;                    // one box: 64 rows x 128 bytes (64 columns)
    constexpr int QK_TILE = D / 64 * BOX, VO_TILE = DV / 64 * BOX;   // 64-row tiles of Q or K, V or dO
    constexpr int PS_BYTES = 64 * 128;               // P^T or dS^T: 64 key rows x 64 queries
    constexpr int DQ_BOXES = D / 32;                 // a warp's dQ rows: boxes of 16 rows x 32 floats
    constexpr int DQ_BYTES = 4 * DQ_BOXES * 2048;    // 64 rows x 192 floats
    constexpr int DP_BYTES = 128 * 32 * 4;           // dP^T: warpgroup 1's 32 floats a thread
    constexpr int ROWS_BYTES = STAGES * 2 * BM * 4;
    constexpr bool ROTATE = ORDERED && MASK == 0;   // (the unmasked walk's start, see the top)
    static_assert(SMEM == QK_TILE + VO_TILE + STAGES * (QK_TILE + VO_TILE) + 2 * PS_BYTES + DQ_BYTES + DP_BYTES +
                              ROWS_BYTES + 1024,
                  "SMEM: K, V, the Q and dO rings, P^T, dS^T, dQ's stage, dP^T, lse and Dsum, alignment slack");
#if CUK_SM90A
    using namespace cuk;
    const cuk::attention::Problem& r = p.problem;
    const int H = r.H, Hkv = r.Hkv, sq = r.Sq, sk = r.Sk;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* const k_s = align_1024(smem_raw);   // [3][64 key rows x 128 bytes]
    unsigned char* const v_s = k_s + QK_TILE;          // [2][64 key rows x 128 bytes]
    unsigned char* const q_s = v_s + VO_TILE;          // [STAGES][3][64 query rows x 128 bytes]
    unsigned char* const do_s = q_s + STAGES * QK_TILE;   // [STAGES][2][64 query rows x 128 bytes]
    unsigned char* const pt_s = do_s + STAGES * VO_TILE;  // P^T: [64 key rows x 128 bytes]
    unsigned char* const dst_s = pt_s + PS_BYTES;      // dS^T, likewise
    unsigned char* const dq_s = dst_s + PS_BYTES;      // [4 warps][6 boxes of 16 rows x 32 floats]
    float4* const dp_x = reinterpret_cast<float4*>(dq_s + DQ_BYTES);   // [8][128 threads] float4
    float* const rows_s = reinterpret_cast<float*>(dq_s + DQ_BYTES + DP_BYTES);   // [STAGES][lse, Dsum][64]
    __shared__ unsigned long long bar_kv, bar_q[STAGES], bar_free[STAGES], dp_full, dp_free, ps_full, ps_free;
    // ORDERED: two writers, taking alternate steps (see the top)
    constexpr int WRITERS = ORDERED ? 2 : 1;
    __shared__ unsigned long long dq_full[WRITERS], dq_empty[WRITERS];   // (dQ's stage: to its writer, and back)

    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbarrier_init(&bar_q[i], 1);
            mbarrier_init(&bar_free[i], 256);   // (every computing thread, once its products read it)
        }
        mbarrier_init(&bar_kv, 1);
        mbarrier_init(&dp_full, 128);
        mbarrier_init(&dp_free, 128);
        mbarrier_init(&ps_full, 128);
        mbarrier_init(&ps_free, 128);
        for (int i = 0; i < WRITERS; ++i) {
            mbarrier_init(&dq_full[i], 4);
            mbarrier_init(&dq_empty[i], 1);
        }
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
        mbarrier_arrive_expect_tx(&bar_q[buf], QK_TILE + VO_TILE + 2 * BM * 4);
        bulk_load(rows_s + buf * 2 * BM, p.rows + ((static_cast<long long>(b) * H + h) * tiles + m) * 2 * BM, 2 * BM * 4,
                  &bar_q[buf]);
#pragma unroll
        for (int db = 0; db < D / 64; ++db) {
            tma_load_4d(q_s + buf * QK_TILE + db * BOX, &q_map, db * 64, h, m * BM, b, &bar_q[buf]);
            if (db < DV / 64)
                tma_load_4d(do_s + buf * VO_TILE + db * BOX, &do_map, db * 64, h, m * BM, b, &bar_q[buf]);
        }
    };
    if (threadIdx.x == 256) {
        mbarrier_arrive_expect_tx(&bar_kv, QK_TILE + VO_TILE);
#pragma unroll
        for (int db = 0; db < D / 64; ++db) {
            tma_load_4d(k_s + db * BOX, &k_map, db * 64, hk, n0, b, &bar_kv);
            if (db < DV / 64) tma_load_4d(v_s + db * BOX, &v_map, db * 64, hk, n0, b, &bar_kv);
        }
    }
    {   // (the producer warpgroup's second warp, and third where ORDERED: dQ's writers, see the top)
        auto write = [&](int side) {   // (writer j: steps j, j + WRITERS, ...)
            const int j = WRITERS == 1 ? 0 : side;
            attention::TileWalk walk(m_first, rot, hk * rep, per_head);
            if (j > 0) walk.next();
            for (int it = j; it < steps; it += WRITERS) {
                mbarrier_wait(&dq_full[j], (it / WRITERS) & 1);
                const int at = (b * H + walk.h) * tiles + walk.m;
                if constexpr (ORDERED)
                    turn_wait(p.turns + at, attention::dq_turn<MASK, BM, BN>(walk.m, kblock, nblocks, per_head, km.hi));
#pragma unroll 1   // (unrolled, the 24 adds' addresses spilled the writer's 24 registers)
                for (int w = 0; w < 4; ++w)
#pragma unroll
                    for (int box = 0; box < DQ_BOXES; ++box)
                        tma_reduce_add_4d(&dq_map, dq_s + (w * DQ_BOXES + box) * 2048, 32 * box, walk.h,
                                          walk.m * BM + 16 * w, b);
                tma_store_commit();
                tma_store_wait_read<0>();
                mbarrier_arrive(&dq_empty[j]);   // (the adds have read the stage)
                if constexpr (ORDERED) {
                    tma_store_wait<0>();   // (the adds are complete: the turn passes on)
                    turn_pass(p.turns + at);
                }
#pragma unroll
                for (int i = 0; i < WRITERS; ++i) walk.next();
            }
        };
        if (!ring_loads<true, STAGES, 2, 240, WRITERS>(steps, bar_free, load_q, write))
            return;   // (the producer is done)
    }

    const int wg = warpgroup_index(), warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4, tid = threadIdx.x % 128;
    const int key0 = n0 + warp * 16 + g;   // this thread's keys in S^T and dP^T: key0 and key0 + 8
    // warpgroup 0: dK's columns 0 .. 127 (acc_a) and 128 .. 191 (acc_b); warpgroup 1: dV (acc_a)
    float acc_a[64], acc_b[32];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc_a[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) acc_b[i] = 0.f;
    mbarrier_wait(&bar_kv, 0);

    int m_tile = m_first + rot;
    for (int it = 0; it < steps; ++it) {
        const int buf = it % STAGES, m0 = m_tile * BM;
        const unsigned char* const qb = q_s + buf * QK_TILE;
        const unsigned char* const dob = do_s + buf * VO_TILE;
        const float* const lrow = rows_s + buf * 2 * BM;
        const float* const drow = lrow + BM;
        mbarrier_wait(&bar_q[buf], (it / STAGES) & 1);

        // S^T = K Q^T over 192 (warpgroup 0) or dP^T = V dO^T over 128 (warpgroup 1): 64 keys x 64 queries
        // (the fence in each branch, ahead of its products: before the branch, ptxas 12.9 injects
        // a warpgroup.arrive at each branch's first product)
        float s[32];
        if (wg == 0) {
            const unsigned long long a = wgmma_desc_sw128(k_s), bq = wgmma_desc_sw128(qb);
            wgmma_zero_and_fence(s);
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Wgmma<T, 64>::ss(s, wgmma_desc_advance(a, (ks / 4) * BOX + (ks % 4) * 32),
                                 wgmma_desc_advance(bq, (ks / 4) * BOX + (ks % 4) * 32), ks > 0);
            wgmma_commit();
        } else {
            const unsigned long long a = wgmma_desc_sw128(v_s), bdo = wgmma_desc_sw128(dob);
            wgmma_zero_and_fence(s);
#pragma unroll
            for (int ks = 0; ks < DV / 16; ++ks)
                Wgmma<T, 64>::ss(s, wgmma_desc_advance(a, (ks / 4) * BOX + (ks % 4) * 32),
                                 wgmma_desc_advance(bdo, (ks / 4) * BOX + (ks % 4) * 32), ks > 0);
            wgmma_commit();
        }
        wgmma_wait<0>();
        wgmma_hold(s);
        if (wg == 1) {
            attention::hand_over_dpt(s, dp_x, &dp_full, &dp_free, it, tid);

            // dV += P^T dO, dQ = dS K (columns 0 .. 127 and 128 .. 191), from the stored P^T and dS^T
            mbarrier_wait(&ps_full, it & 1);
            float dq_a[64], dq_b[32];
            {
                const unsigned long long pt = wgmma_desc_sw128(pt_s);
                const unsigned long long do_mn = wgmma_desc_sw128_mn(dob, BOX);
                const unsigned long long ds_mn = wgmma_desc_sw128_mn(dst_s, BOX);
                const unsigned long long k_mn = wgmma_desc_sw128_mn(k_s, BOX);
                const unsigned long long k_mn_hi = wgmma_desc_sw128_mn(k_s + 2 * BOX, BOX);
#pragma unroll
                for (int i = 0; i < 64; ++i) dq_a[i] = 0.f;
#pragma unroll
                for (int i = 0; i < 32; ++i) dq_b[i] = 0.f;
                wgmma_hold(dq_a);
                wgmma_hold(dq_b);
                wgmma_hold(acc_a);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk)
                    Wgmma<T, 128>::template ss<0, 1>(acc_a, wgmma_desc_advance(pt, kk * 32),
                                                     wgmma_desc_advance(do_mn, kk * 16 * 128), 1);
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk)
                    Wgmma<T, 128>::template ss<1, 1>(dq_a, wgmma_desc_advance(ds_mn, kk * 16 * 128),
                                                     wgmma_desc_advance(k_mn, kk * 16 * 128), kk > 0);
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk)
                    Wgmma<T, 64>::template ss<1, 1>(dq_b, wgmma_desc_advance(ds_mn, kk * 16 * 128),
                                                    wgmma_desc_advance(k_mn_hi, kk * 16 * 128), kk > 0);
                wgmma_commit();
                wgmma_wait<0>();
                wgmma_hold(acc_a);
                wgmma_hold(dq_a);
                wgmma_hold(dq_b);
            }
            mbarrier_arrive(&ps_free);          // (P^T and dS^T read)
            mbarrier_arrive(&bar_free[buf]);    // (dO read)
            // dQ: rows m0 + 16 warp + g (+8), columns 8 j + 2 t (+1), staged by the warp as six boxes
            // of 16 rows x 32 floats (128-byte swizzle) for the writer's TMA reduce-adds, once it
            // has read the step before's
            if (it > 0) mbarrier_wait(&dq_empty[(it - 1) % WRITERS], ((it - 1) / WRITERS) & 1);
            unsigned char* const stage = dq_s + warp * DQ_BOXES * 2048;
            stage_rows_sw128(stage, dq_a, g, t);
            stage_rows_sw128(stage + 4 * 2048, dq_b, g, t);
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&dq_full[it % WRITERS]);
        } else {
            unsigned int pa[4][4], dsa[4][4];
            attention::p_and_ds<T, MASK, SOFTCAP>(s, pa, dsa, lrow, drow, dp_x, &dp_full, &dp_free, it, km, r, sq, sk,
                                                  key0, m0, n0, tid, t);
            attention::publish_p_ds(pt_s, dst_s, pa, dsa, &ps_full, &ps_free, it, lane, warp);
            // dK += dS^T Q: dS^T from this warpgroup's registers, Q read MN-major (columns 0 .. 127, 128 .. 191)
            wgmma_rs_mn<T, 128>(acc_a, dsa, qb, BOX);
            wgmma_rs_mn<T, 64>(acc_b, dsa, qb + 2 * BOX, BOX);
            wgmma_wait<0>();
            wgmma_hold(acc_a);
            wgmma_hold(acc_b);
            mbarrier_arrive(&bar_free[buf]);   // (Q, lse and Dsum read)
        }
        if (++m_tile == m_first + per_head) m_tile = m_first;
    }

    // dK (scaled; warpgroup 0) and dV (warpgroup 1), staged in K's and V's own boxes (every product
    // has read them: warpgroup 1's last dQ reads K, the barrier below) and written by whole rows
    named_barrier_sync(10, 256);
    if (wg == 0) {
        T* const dk = p.dk + b * p.dk_sb + static_cast<long long>(n0) * p.dk_ss + hk * p.dk_sh;
        store_tile_staged<T, 128, BOX>(acc_a, r.scale, r.scale, k_s, dk, p.dk_ss, sk - n0, 8);
        store_tile_staged<T, 64, BOX>(acc_b, r.scale, r.scale, k_s + 2 * BOX, dk + 128, p.dk_ss, sk - n0, 8);
    } else {
        store_tile_staged<T, 128, BOX>(acc_a, 1.f, 1.f, v_s,
                                       p.dv + b * p.dv_sb + static_cast<long long>(n0) * p.dv_ss + hk * p.dv_sh,
                                       p.dv_ss, sk - n0, 9);
    }
#elif defined(__CUDA_ARCH__)
    __trap();   // (built without sm_90a's features: fail loudly, never return an unwritten output)
#endif
}
