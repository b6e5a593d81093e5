// Fused attention backward on Hopper (sm_90a) for DeepSeek's MLA head sizes, q and k of 192 and v
// of 128 (docs/notes-attention.md): TMA tile loads, wgmma, dQ added into dq_accum (float32) by TMA
// reduce-add. The rest of the backward is attention_bwd.cu's: attention_bwd_dot (Dsum, lse_log2
// and Dsum in `rows`, tiles of [2][64] floats loaded here by bulk copy with Q and dO; dq_accum
// zeroed) and attention_bwd_dq_convert.
//
// attention_bwd_sm90 keeps dK and dV of 64 keys in one warpgroup's registers: at 192 + 128
// columns that is 160 floats a thread beside the step's scores, more than it has. Here a block of
// two computing warpgroups owns 96 keys of one (batch, kv head), 48 a warpgroup, and each
// warpgroup computes every product for its own keys (FlashAttention-4's layout), so neither waits
// on the other's products within a step but for dQ. A step:
//   S = Q K^T, then dP = dO V^T, 64 queries x 48 keys (M = queries: a warpgroup's M is 64, its keys
//   48); P = exp2(S scale_log2 - lse_log2) while dP is computed, stored as P^T (key rows x 64
//   queries, the 128-byte swizzle) by transposing stmatrix; dV^T += dO^T P issued (M = the
//   value's 128 dims, N = 48 keys, K = 64 queries; dO read MN-major, P^T K-major);
//   dS = P (dP - Dsum) (the softcap's (1 - t^2) too) stored as dS^T in a buffer a step in turn;
//   once both warpgroups have stored theirs (a barrier of the two), dQ = dS K over the block's
//   96 keys, warpgroup 0 taking dims 0 .. 95 and warpgroup 1 dims 96 .. 191, each as one product
//   of 64 columns and one of 32 (K read MN-major, the 32 from one half of its second box), and
//   dK^T += Q^T dS; dV^T and dK^T are held as dims x keys (2 x 24 and 3 x 24 floats a thread).
// dQ is staged in a buffer of its own (64 rows x 192 floats: the step's Q and dO tiles are 40 KB)
// and added by the producer warpgroup's second warp, 16 rows x 32 floats a box. The warpgroups
// wait for the adds to have read the step before's (dq_empty) only when they stage the next:
// waited for at the step's start, that read (48 KB) stalled every step (docs/notes-attention.md).
// A third warpgroup loads K and V once (boxes of 96 key rows), then Q, dO, lse_log2 and Dsum a
// query tile into a ring of two buffers, released by every computing thread once its products
// have read them.
// Steps walk (head of the group, query tile) pairs, head-major; MASK (common/attn_mask.cuh): 0
// none, 1 causal, 2 a window, whose block walks only the query tiles its keys' window reaches.
// dK is scaled at the end; dq_accum is scaled by attention_bwd_dq_convert. dK^T and dV^T go out
// through K's and V's buffers, as keys x dims, whole rows.
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

// SMEM: K, V, the Q and dO rings, P^T, dS^T, dQ's stage, lse_log2 and Dsum, 1 KB of slack.
template <typename T, int MASK, bool SOFTCAP, bool ORDERED, int SMEM>
__global__ void __launch_bounds__(384, 1) attention_bwd_sm90_mla(
    const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,   // k, v: boxes of 96 rows
    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
    const __grid_constant__ CUtensorMap dq_map,   // dq_accum (B, Sq, H, 192) float32, boxes 16 x 32
    const __grid_constant__ cuk::attention::BwdWideParams<T> p)
{
    constexpr int D = 192, DV = 128, BN = 96, KW = 48, BM = 64, STAGES = 2;
    constexpr int KBOX = BN * 128, QBOX = BM * 128;   // a box: 96 key or 64 query rows x 128 bytes (64 columns)
    constexpr int K_TILE = D / 64 * KBOX, V_TILE = DV / 64 * KBOX, Q_TILE = D / 64 * QBOX, DO_TILE = DV / 64 * QBOX;
    constexpr int PS_BYTES = BN * 128;               // P^T or dS^T: 96 key rows x 64 queries
    constexpr int DQ_WARP = 3 * 2048;                // a warp's dQ rows: 16 rows x 96 floats, boxes of 16 x 32
    constexpr int DQ_BYTES = 8 * DQ_WARP;            // 64 rows x 192 floats
    constexpr int ROWS_BYTES = STAGES * 2 * BM * 4;
    constexpr bool ROTATE = ORDERED && MASK == 0;   // (the unmasked walk's start, see the top)
    static_assert(SMEM == K_TILE + V_TILE + STAGES * (Q_TILE + DO_TILE) + 3 * PS_BYTES + DQ_BYTES + ROWS_BYTES + 1024,
                  "SMEM: K, V, the Q and dO rings, P^T, dS^T, dQ's stage, lse and Dsum, alignment slack");
#if CUK_SM90A
    using namespace cuk;
    const cuk::attention::Problem& r = p.problem;
    const int H = r.H, Hkv = r.Hkv, sq = r.Sq, sk = r.Sk;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* const k_s = align_1024(smem_raw);   // [3][96 key rows x 128 bytes]
    unsigned char* const v_s = k_s + K_TILE;           // [2][96 key rows x 128 bytes]
    unsigned char* const q_s = v_s + V_TILE;           // [STAGES][3][64 query rows x 128 bytes]
    unsigned char* const do_s = q_s + STAGES * Q_TILE;    // [STAGES][2][64 query rows x 128 bytes]
    unsigned char* const pt_s = do_s + STAGES * DO_TILE;  // P^T: [96 key rows x 128 bytes]
    unsigned char* const dst_s = pt_s + PS_BYTES;      // dS^T: [2 steps][96 key rows x 128 bytes]
    unsigned char* const dq_s = dst_s + 2 * PS_BYTES;  // [8 warps][3 boxes of 16 rows x 32 floats]
    float* const rows_s = reinterpret_cast<float*>(dq_s + DQ_BYTES);   // [STAGES][lse, Dsum][64]
    __shared__ unsigned long long bar_kv, bar_q[STAGES], bar_free[STAGES];
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
        for (int i = 0; i < WRITERS; ++i) {
            mbarrier_init(&dq_full[i], 8);   // (each computing warp's lane 0, its rows staged)
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

    attention::TileWalk loads(m_first, rot, hk * rep, per_head);   // (the steps in order: no divisions)
    auto load_q = [&](int it) {   // (the producer) Q, dO, lse_log2 and Dsum of step it
        const int buf = it % STAGES, h = loads.h, m = loads.m;
        loads.next();
        mbarrier_arrive_expect_tx(&bar_q[buf], Q_TILE + DO_TILE + 2 * BM * 4);
        // (the tile's index in 32 bits, widened once: the producer keeps 24 registers)
        bulk_load(rows_s + buf * 2 * BM, p.rows + static_cast<long long>((b * H + h) * tiles + m) * (2 * BM), 2 * BM * 4,
                  &bar_q[buf]);
#pragma unroll
        for (int db = 0; db < D / 64; ++db) {
            tma_load_4d(q_s + buf * Q_TILE + db * QBOX, &q_map, db * 64, h, m * BM, b, &bar_q[buf]);
            if (db < DV / 64)
                tma_load_4d(do_s + buf * DO_TILE + db * QBOX, &do_map, db * 64, h, m * BM, b, &bar_q[buf]);
        }
    };
    if (threadIdx.x == 256) {
        mbarrier_arrive_expect_tx(&bar_kv, K_TILE + V_TILE);
#pragma unroll
        for (int db = 0; db < D / 64; ++db) {
            tma_load_4d(k_s + db * KBOX, &k_map, db * 64, hk, n0, b, &bar_kv);
            if (db < DV / 64) tma_load_4d(v_s + db * KBOX, &v_map, db * 64, hk, n0, b, &bar_kv);
        }
    }
    {   // (the producer warpgroup's second warp, and third where ORDERED: dQ's writers, see the top)
        // (the writer's loop written out rather than attention::dq_writer's: through the lambdas,
        // NVRTC 12.9 spilled 4-8 B of the writer's 24 registers in the ordered masked instances)
        auto write = [&](int side) {   // (writer j: steps j, j + WRITERS, ...)
            const int j = WRITERS == 1 ? 0 : side;
            attention::TileWalk walk(m_first, rot, hk * rep, per_head);
            if (j > 0) walk.next();
            for (int it = j; it < steps; it += WRITERS) {
                mbarrier_wait(&dq_full[j], (it / WRITERS) & 1);
                const int at = (b * H + walk.h) * tiles + walk.m;
                if constexpr (ORDERED)
                    turn_wait(p.turns + at, attention::dq_turn<MASK, BM, BN>(walk.m, kblock, nblocks, per_head, km.hi));
#pragma unroll 1   // (unrolled, the adds' addresses spilled the writer's 24 registers)
                for (int w = 0; w < 8; ++w)
#pragma unroll 1
                    for (int box = 0; box < 3; ++box)
                        tma_reduce_add_4d(&dq_map, dq_s + w * DQ_WARP + box * 2048, 96 * (w / 4) + 32 * box, walk.h,
                                          walk.m * BM + 16 * (w % 4), b);
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
    const int g = lane / 4, t = lane % 4;
    const int kw0 = n0 + KW * wg;   // this warpgroup's first key
    // dV^T (dims 64 mt + 16 warp + g (+8) x keys kw0 + 8 j + 2 t (+1)) and dK^T, likewise
    float dv[DV / 64][24], dk[D / 64][24];
#pragma unroll
    for (int mt = 0; mt < DV / 64; ++mt)
#pragma unroll
        for (int i = 0; i < 24; ++i) dv[mt][i] = 0.f;
#pragma unroll
    for (int mt = 0; mt < D / 64; ++mt)
#pragma unroll
        for (int i = 0; i < 24; ++i) dk[mt][i] = 0.f;
    mbarrier_wait(&bar_kv, 0);
    // this warpgroup's keys of K, V, P^T and dS^T (48 rows on: 6 KB, a multiple of the swizzle's 1 KB)
    unsigned long long k_mine = wgmma_desc_sw128(k_s + KW * wg * 128);
    unsigned long long v_mine = wgmma_desc_sw128(v_s + KW * wg * 128);
    unsigned long long pt_mine = wgmma_desc_sw128(pt_s + KW * wg * 128);
    unsigned long long ds_mine = wgmma_desc_sw128(dst_s + KW * wg * 128);
    unsigned long long ds_mn = wgmma_desc_sw128_mn(dst_s, QBOX);   // dS (queries x 96 keys), read transposed
    // dQ's columns: warpgroup 0 0 .. 63 (dq_a) and 64 .. 95 (dq_b), warpgroup 1 96 .. 127 (dq_b) and 128 .. 191
    // (dq_a): K read MN-major, dq_b's from the first or second half of K's second box
    unsigned long long kq_a = wgmma_desc_sw128_mn(k_s + 2 * wg * KBOX, KBOX);
    unsigned long long kq_b = wgmma_desc_sw128_mn(k_s + KBOX + 64 * wg, KBOX);
    const int dq_a_at = wg ? 2048 : 0, dq_b_at = wg ? 0 : 2 * 2048;   // (their boxes in the warp's stage)
    const int r0 = 16 * warp + g;   // this thread's query rows of a tile: r0 and r0 + 8

    int m_tile = m_first + rot;
    for (int it = 0; it < steps; ++it) {
        const int buf = it % STAGES, m0 = m_tile * BM;
        const unsigned char* const qb = q_s + buf * Q_TILE;
        const unsigned char* const dob = do_s + buf * DO_TILE;
        const float* const lrow = rows_s + buf * 2 * BM;
        mbarrier_wait(&bar_q[buf], (it / STAGES) & 1);
        // (the base descriptors made opaque a step: else ptxas keeps every k-step's, hoisted out of
        // the loop, in registers, and spills)
        asm volatile("" : "+l"(k_mine), "+l"(v_mine), "+l"(pt_mine), "+l"(ds_mine), "+l"(ds_mn), "+l"(kq_a), "+l"(kq_b));

        // S = Q K^T over 192, then dP = dO V^T over 128: 64 queries x this warpgroup's 48 keys
        float s[24], dp[24];
        {
            const unsigned long long aq = wgmma_desc_sw128(qb), ado = wgmma_desc_sw128(dob);
#pragma unroll
            for (int i = 0; i < 24; ++i) dp[i] = 0.f;
            wgmma_hold(dp);
            wgmma_zero_and_fence(s);
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Wgmma<T, 48>::ss(s, wgmma_desc_advance(aq, (ks / 4) * QBOX + (ks % 4) * 32),
                                 wgmma_desc_advance(k_mine, (ks / 4) * KBOX + (ks % 4) * 32), ks > 0);
            wgmma_commit();
#pragma unroll
            for (int ks = 0; ks < DV / 16; ++ks)
                Wgmma<T, 48>::ss(dp, wgmma_desc_advance(ado, (ks / 4) * QBOX + (ks % 4) * 32),
                                 wgmma_desc_advance(v_mine, (ks / 4) * KBOX + (ks % 4) * 32), ks > 0);
            wgmma_commit();
        }
        // P (0 for queries past sq and hidden keys) while dP is computed, then dS = P (dP - Dsum)
        const float l0 = lrow[r0], l1 = lrow[r0 + 8], d0 = lrow[BM + r0], d1 = lrow[BM + r0 + 8];
        const bool edge = m0 + BM > sq || km.edge(kw0, KW, m0, BM, sk);
        float u[SOFTCAP ? 24 : 1];   // (the softcap's 1 - t^2, for dS)
        wgmma_wait<1>();
        wgmma_hold(s);
#pragma unroll
        for (int i = 0; i < 24; ++i) {
            const int h = (i >> 1) & 1, key = kw0 + 8 * (i / 4) + 2 * t + (i & 1), q = m0 + r0 + 8 * h;
            float x;
            if constexpr (SOFTCAP) {
                const float th = attention::tanh_approx(s[i] * r.cap_in);
                x = fmaf(th, r.cap_out, -(h ? l1 : l0));
                u[i] = 1.f - th * th;
            } else {
                x = fmaf(s[i], r.scale_log2, -(h ? l1 : l0));
            }
            float pe = fast_exp2(x);
            if (edge & ((q >= sq) | km.hidden_bits(q, key, sk))) pe = 0.f;
            s[i] = pe;
        }
        // P^T and dS^T are stored as TMA would store them (128-byte swizzle: query chunk c of key row k
        // at c ^ (k % 8)) by transposing stmatrix: the 8 x 8 matrix (h, j) of a warp's rows (8 h ..,
        // keys 8 j ..) to key rows 48 wg + 8 j .., query chunk 2 warp + h
        const int mat = lane / 8, mrow = lane % 8;
        auto store_t = [&](unsigned char* tile) {   // (s as T: P or dS)
#pragma unroll
            for (int j = 0; j < 6; j += 2) {
                const int jj = j + mat / 2, c = 2 * warp + mat % 2;
                const unsigned int m4[4] = {pack2(s[4 * j], s[4 * j + 1], T{}), pack2(s[4 * j + 2], s[4 * j + 3], T{}),
                                            pack2(s[4 * j + 4], s[4 * j + 5], T{}),
                                            pack2(s[4 * j + 6], s[4 * j + 7], T{})};
                stmatrix_x4_trans(tile + (KW * wg + 8 * jj + mrow) * 128 + ((c ^ mrow) << 4), m4);
            }
        };
        // P^T: this warpgroup's rows, read by its own dV alone (done: the step before waited for it)
        store_t(pt_s);
        fence_proxy_async();
        named_barrier_sync(2 + wg, 128);
        // dV^T += dO^T P, issued before dS is made
        {
#pragma unroll
            for (int mt = 0; mt < DV / 64; ++mt) wgmma_hold(dv[mt]);
            wgmma_fence();
#pragma unroll
            for (int mt = 0; mt < DV / 64; ++mt) {
                const unsigned long long a = wgmma_desc_sw128_mn(dob + mt * QBOX, QBOX);
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk)
                    Wgmma<T, 48>::template ss<1, 0>(dv[mt], wgmma_desc_advance(a, kk * 2048),
                                                    wgmma_desc_advance(pt_mine, kk * 32), 1);
            }
            wgmma_commit();
        }
        wgmma_wait<1>();   // (dP; dV in flight)
        wgmma_hold(dp);
#pragma unroll
        for (int i = 0; i < 24; ++i) {
            const float ds = s[i] * (dp[i] - ((i >> 1) & 1 ? d1 : d0));
            if constexpr (SOFTCAP)
                s[i] = ds * u[i];
            else
                s[i] = ds;
        }
        // dS^T: a buffer a step in turn (the other warpgroup's dQ of step it - 2 read this one before
        // it met the barrier of step it - 1); then both warpgroups' rows, for dQ
        const int ds_at = (it & 1) * PS_BYTES;
        store_t(dst_s + ds_at);
        fence_proxy_async();
        named_barrier_sync(1, 256);

        // dQ = dS K over the 96 keys (this warpgroup's 96 columns), then dK^T += Q^T dS
        float dq_a[32], dq_b[16];
        {
#pragma unroll
            for (int i = 0; i < 32; ++i) dq_a[i] = 0.f;
#pragma unroll
            for (int i = 0; i < 16; ++i) dq_b[i] = 0.f;
            wgmma_hold(dq_a);
            wgmma_hold(dq_b);
#pragma unroll
            for (int mt = 0; mt < D / 64; ++mt) wgmma_hold(dk[mt]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                Wgmma<T, 64>::template ss<1, 1>(dq_a, wgmma_desc_advance(ds_mn, ds_at + kk * 2048),
                                                wgmma_desc_advance(kq_a, kk * 2048), kk > 0);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                Wgmma<T, 32>::template ss<1, 1>(dq_b, wgmma_desc_advance(ds_mn, ds_at + kk * 2048),
                                                wgmma_desc_advance(kq_b, kk * 2048), kk > 0);
            wgmma_commit();
#pragma unroll
            for (int mt = 0; mt < D / 64; ++mt) {
                const unsigned long long a = wgmma_desc_sw128_mn(qb + mt * QBOX, QBOX);
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk)
                    Wgmma<T, 48>::template ss<1, 0>(dk[mt], wgmma_desc_advance(a, kk * 2048),
                                                    wgmma_desc_advance(ds_mine, ds_at + kk * 32), 1);
            }
            wgmma_commit();
        }
        wgmma_wait<1>();   // (dV and dQ; dK in flight)
        wgmma_hold(dq_a);
        wgmma_hold(dq_b);
#pragma unroll
        for (int mt = 0; mt < DV / 64; ++mt) wgmma_hold(dv[mt]);
        // dQ: rows m0 + 16 warp + g (+8), staged by the warp as three boxes of 16 rows x 32 floats
        // (128-byte swizzle) for the writer's TMA reduce-adds, once it has read the step before's
        // (waited for with dK in flight: ptxas keeps it queued here)
        if (it > 0) mbarrier_wait(&dq_empty[(it - 1) % WRITERS], ((it - 1) / WRITERS) & 1);
        {
            unsigned char* const stage = dq_s + (wg * 4 + warp) * DQ_WARP;
            stage_rows_sw128(stage + dq_a_at, dq_a, g, t);
            stage_rows_sw128(stage + dq_b_at, dq_b, g, t);
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&dq_full[it % WRITERS]);
        }
        wgmma_wait<0>();
#pragma unroll
        for (int mt = 0; mt < D / 64; ++mt) wgmma_hold(dk[mt]);
        mbarrier_arrive(&bar_free[buf]);    // (Q, dO, lse and Dsum read)
        if (++m_tile == m_first + per_head) m_tile = m_first;
    }

    // dK (scaled) and dV as keys x dims in K's and V's own boxes (every product has read them: the
    // other warpgroup's last dQ reads K, hence the barrier), 128-byte swizzle; then whole rows out
    named_barrier_sync(4, 256);
    {
        // element (dim 64 mt + 16 warp + g + 8 h, key 8 j + 2 t + e of the warpgroup's): key row k,
        // chunk (2 warp + h) ^ (k % 8), bytes 2 g on
#pragma unroll
        for (int i = 0; i < 24; ++i) {
            const int h = (i >> 1) & 1, k = KW * wg + 8 * (i / 4) + 2 * t + (i & 1);
            const int at = k * 128 + (((2 * warp + h) ^ (k % 8)) << 4) + 2 * g;
#pragma unroll
            for (int mt = 0; mt < D / 64; ++mt)
                *reinterpret_cast<T*>(k_s + mt * KBOX + at) = from_float<T>(dk[mt][i] * r.scale);
#pragma unroll
            for (int mt = 0; mt < DV / 64; ++mt)
                *reinterpret_cast<T*>(v_s + mt * KBOX + at) = from_float<T>(dv[mt][i]);
        }
    }
    named_barrier_sync(4, 256);
    {
        const int tid = threadIdx.x;   // (0 .. 255)
        T* const dkg = p.dk + b * p.dk_sb + static_cast<long long>(n0) * p.dk_ss + hk * p.dk_sh;
        T* const dvg = p.dv + b * p.dv_sb + static_cast<long long>(n0) * p.dv_ss + hk * p.dv_sh;
#pragma unroll 1
        for (int i = tid; i < BN * (D / 8); i += 256) {
            const int k = i / (D / 8), c = i % (D / 8);
            if (n0 + k < sk)
                *reinterpret_cast<uint4*>(dkg + k * p.dk_ss + 8 * c) =
                    *reinterpret_cast<const uint4*>(k_s + (c / 8) * KBOX + k * 128 + (((c % 8) ^ (k % 8)) << 4));
        }
#pragma unroll 1
        for (int i = tid; i < BN * (DV / 8); i += 256) {
            const int k = i / (DV / 8), c = i % (DV / 8);
            if (n0 + k < sk)
                *reinterpret_cast<uint4*>(dvg + k * p.dv_ss + 8 * c) =
                    *reinterpret_cast<const uint4*>(v_s + (c / 8) * KBOX + k * 128 + (((c % 8) ^ (k % 8)) << 4));
        }
    }
#elif defined(__CUDA_ARCH__)
    __trap();   // (built without sm_90a's features: fail loudly, never return an unwritten output)
#endif
}
