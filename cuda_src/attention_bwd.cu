// Fused attention backward on tensor cores, deterministic by construction (no atomics):
//  1. attention_bwd_dot: Dsum[b, h, i] = sum_d dO * O (float32), the softmax correction.
//  2. attention_bwd_dkdv: a block per key tile of one (batch, kv head) — FlashAttention-2's
//     split — walks every query tile of every query head that shares the kv head, in a fixed
//     order, recomputing P = exp(S - lse) and accumulating in registers
//        dV += P^T dO,   dS = P * (dO V^T - Dsum),   dK += dS^T Q * scale.
//     GQA's sum over the query heads of a group is this loop: no expanded buffers.
//  3. dQ += dS K * scale, one of two ways:
//     - DQ_ATOMIC (deterministic=False, FlashAttention-2's 5 products a tile pair): the dK/dV
//       block adds its dS K (dS is staged in shared memory anyway) into a float32
//       (B, Sq, H, D) buffer with atomics (the order of the additions varies run to run);
//       attention_bwd_dq_convert then scales it into dq.
//     - attention_bwd_dq (deterministic=True): a block per query tile (as the forward) walks
//       the key tiles, recomputing S and dP — two more matrix products, the same bits on every
//       run.
// Layouts as the forward: q, dq (B, Sq, H, D), out, dout (B, Sq, H, DV); k, dk (B, Sk, Hkv, D), v,
// dv (B, Sk, Hkv, DV) (DV, the value head size: D but for MLA's 192 / 128), each with element
// strides for batch, sequence and head and unit stride over the head dim; lse and Dsum
// (B, H, Sq) float32 (lse natural-log, +inf for a query that sees no key). Masks, the softcap
// and packed documents as the forward (attention_fwd.cu, common/attn_mask.cuh): packed, the
// kernels see one batch of Sq (Sk) tokens, cu_q / cu_k give a document's, and attention_bwd_dot
// and attention_bwd_dq_convert run on the packed tokens as they are (B = 1). With the softcap
// (t = tanh(s scale / c)) dS is P (dP - Dsum) (1 - t^2). DROPOUT (Z: the kept weights'
// 1 / (1 - p), 0 for the dropped, common/attn_dropout.cuh's draw): dV += (P Z)^T dO and
// dS = P (dP Z - Dsum), Dsum from the dropped output as it is.
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "common/mma.cuh"
#include "common/reduce.cuh"
#include "common/attn_tile.cuh"
#include "common/attn_mask.cuh"
#include "common/attn_dropout.cuh"
#include "common/attn_params.cuh"

// I: the row and element index type (int where B * Sq * H * D fits, else long long: 64-bit
// division and modulo a row cost more than the row's loads).
template <typename I, typename T, int D, int DV>
__device__ __forceinline__ void attention_bwd_dot_rows(
    const T* __restrict__ dout, const T* __restrict__ out,
    long long d_sb, long long d_ss, long long d_sh, long long o_sb, long long o_ss, long long o_sh,
    float* __restrict__ dsum, const float* __restrict__ lse, float* __restrict__ rows, int tile,
    float* __restrict__ dq_accum, int B, int Sq, int H)
{
    using namespace cuk;
    constexpr int V = DV / 8;                              // 16-byte vectors a row of dO and O
    constexpr int LANES = (V & 15) == 0 ? 16 : (V & 7) == 0 ? 8 : (V & 3) == 0 ? 4 : (V & 1) == 0 ? 2 : 1;
    constexpr int VPL = V / LANES;                         // vectors a lane
    const I nrows = static_cast<I>(B) * Sq * H;
    const int sub = threadIdx.x % LANES;
    // (the lanes of a row run the loop alike, so the shuffles name them alone: a warp's last
    // rows may end before its first)
    const unsigned int row_lanes = (LANES == 32 ? 0xffffffffu : (1u << LANES) - 1) << (threadIdx.x % 32 - sub);
    for (I r = (static_cast<I>(blockIdx.x) * 256 + threadIdx.x) / LANES; r < nrows;
         r += static_cast<I>(gridDim.x) * (256 / LANES)) {
        const int i = static_cast<int>(r % Sq);
        const I bh = r / Sq;
        const int h = static_cast<int>(bh % H), b = static_cast<int>(bh / H);
        const T* dp = dout + b * d_sb + i * d_ss + h * d_sh;
        const T* op = out + b * o_sb + i * o_ss + h * o_sh;
        float acc = 0.f;
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            float fd[8], fo[8];
            unpack(load_vec<T, 8>(dp + 8 * (sub + LANES * v)), fd);
            unpack(load_vec<T, 8>(op + 8 * (sub + LANES * v)), fo);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc = fmaf(fd[j], fo[j], acc);
        }
#pragma unroll
        for (int m = 1; m < LANES; m *= 2) acc += __shfl_xor_sync(row_lanes, acc, m);
        if (sub == 0) {
            dsum[static_cast<long long>(bh) * Sq + i] = acc;
            if (rows) {
                float* at = rows + (static_cast<long long>(bh) * ((Sq + tile - 1) / tile) + i / tile) * 2 * tile + i % tile;
                at[0] = lse[static_cast<long long>(bh) * Sq + i] * LOG2E;
                at[tile] = acc;
            }
        }
    }
    if (rows) {   // the last tile's rows past Sq, of every (b, h)
        const int tiles = (Sq + tile - 1) / tile, pad = tiles * tile - Sq;
        for (long long j = blockIdx.x * 256LL + threadIdx.x; j < static_cast<long long>(B) * H * pad;
             j += gridDim.x * 256LL) {
            const int i = Sq + static_cast<int>(j % pad);
            float* at = rows + ((j / pad) * tiles + i / tile) * 2 * tile + i % tile;
            at[0] = at[tile] = 0.f;
        }
    }
    if (dq_accum) {
        const I n4 = nrows * (D / 4);
        for (I j = static_cast<I>(blockIdx.x) * 256 + threadIdx.x; j < n4; j += static_cast<I>(gridDim.x) * 256)
            reinterpret_cast<float4*>(dq_accum)[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// Dsum over the value head size DV (dO and O's rows); dQ's partial sums have D columns.
// L = LANES lanes a row (b, h, i), rows numbered i fastest (so that Dsum, lse and `rows` are
// read and written in runs), each lane one or more 16-byte vectors of the row's dO and O (a
// warp reads 32 / L rows' whole vectors at once), the lanes' sums reduced by shuffles. With
// dq_accum (deterministic=False) also zeroes dQ's float32 partial sums, rows * D elements (saves
// a separate memset). With `rows` (the Hopper backward) also writes lse * log2(e) and Dsum as
// tiles of `tile` queries, (B, H, ceil(Sq / tile), 2, tile) float32, zeros past Sq: one TMA copy
// a query tile.
template <typename T, int D, int DV>
__global__ void __launch_bounds__(256) attention_bwd_dot(
    const T* __restrict__ dout, const T* __restrict__ out,
    long long d_sb, long long d_ss, long long d_sh, long long o_sb, long long o_ss, long long o_sh,
    float* __restrict__ dsum, const float* __restrict__ lse, float* __restrict__ rows, int tile,
    float* __restrict__ dq_accum, int B, int Sq, int H)
{
    // (every index below B * Sq * H * D, and the grid's threads plus one stride, fits an int:
    // the grid is at most 65535 blocks of 256)
    if (static_cast<long long>(B) * Sq * H * (D > DV ? D : DV) < (1LL << 31) - 65536LL * 256 * 2)
        attention_bwd_dot_rows<int, T, D, DV>(dout, out, d_sb, d_ss, d_sh, o_sb, o_ss, o_sh, dsum, lse, rows, tile,
                                          dq_accum, B, Sq, H);
    else
        attention_bwd_dot_rows<long long, T, D, DV>(dout, out, d_sb, d_ss, d_sh, o_sb, o_ss, o_sh, dsum, lse, rows,
                                                tile, dq_accum, B, Sq, H);
}

namespace cuk {
namespace attention {

// Dynamic shared memory of attention_bwd_dkdv: element offsets of its tiles from the aligned
// base (T tiles first, then the float32 rows), and smem_bytes, the launch's byte count, with
// 1 KB of slack for the kernel to align its base to 1 KB. The kernel's SMEM template argument
// must equal smem_bytes (the front computes the same number for the launch).
template <typename T, int D, int DV, int BM, int BN>
struct BwdTiles {
    static constexpr int ROW = row_elems(D), VROW = row_elems(DV), PROW = row_elems(BN);
    static constexpr int k_at = 0;                       // K   [BN][ROW]
    static constexpr int v_at = k_at + BN * ROW;         // V   [BN][VROW]
    static constexpr int q_at = v_at + BN * VROW;        // Q   [2][BM][ROW]
    static constexpr int do_at = q_at + 2 * BM * ROW;    // dO  [2][BM][VROW]
    static constexpr int p_at = do_at + 2 * BM * VROW;   // P   [BM][PROW]
    static constexpr int ds_at = p_at + BM * PROW;       // dS  [BM][PROW]
    static constexpr int elems = ds_at + BM * PROW;
    // float32, from base + elems: lse [2][BM] at lse_at, Dsum [2][BM] at dsum_at
    static constexpr int lse_at = 0, dsum_at = lse_at + 2 * BM, floats = dsum_at + 2 * BM;
    static constexpr int smem_bytes =
        elems * static_cast<int>(sizeof(T)) + floats * static_cast<int>(sizeof(float)) + 1024;
};

// Dynamic shared memory of attention_bwd_dq (BM = 16 * WARPS queries): element offsets from
// the (16-byte aligned) dynamic shared memory itself, no alignment slack.
template <typename T, int D, int DV, int WARPS, int BN>
struct DqTiles {
    static constexpr int BM = 16 * WARPS;
    static constexpr int ROW = row_elems(D), VROW = row_elems(DV);
    static constexpr int q_at = 0;                    // Q   [BM][ROW]
    static constexpr int do_at = q_at + BM * ROW;     // dO  [BM][VROW]
    static constexpr int k_at = do_at + BM * VROW;    // K   [2][BN][ROW]
    static constexpr int v_at = k_at + 2 * BN * ROW;  // V   [2][BN][VROW]
    static constexpr int elems = v_at + 2 * BN * VROW;
    static constexpr int smem_bytes = elems * static_cast<int>(sizeof(T));
};

// attention_bwd_dq's parameters: Q, K, V, dO (B, S, H, D), lse and Dsum (B, H, Sq) float32, dQ
// (B, Sq, H, D), the strides in elements (batch, sequence, head; d_ of dO), and the problem.
// (attention_bwd_dkdv keeps its list of parameters: with them read from a struct, ptxas spilled
// at 255 registers in 66 of its instances; docs/notes-attention.md.)
template <typename T>
struct BwdQParams {
    const T* q;
    const T* k;
    const T* v;
    const T* dout;
    const float* lse;
    const float* dsum;
    T* dq;
    long long q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, d_sb, d_ss, d_sh, dq_sb, dq_ss, dq_sh;
    Problem problem;
    const long long* drop_rng;   // (DROPOUT: as attention_fwd's)
    unsigned int drop_threshold;
    float drop_rescale;
};

}  // namespace attention
}  // namespace cuk

// dK, dV (and, DQ_ATOMIC, dQ's float32 partial sums): FlashAttention-2's backward block.
// Block (key tile n_block of BN keys, b * Hkv + hk), WARPS warps; K and V of the tile stay in
// shared memory while the block walks query tiles of BM rows (Q, dO double-buffered by
// cp.async; lse and Dsum alongside). Each step is five matrix products, each with its own
// warp layout so that every warp's fragments feed several MMAs:
//   S = Q K^T, dP = dO V^T   (BM x BN): WM_S warps over queries x WARPS / WM_S over keys;
//   P = exp(S - lse), dS = P (dP - Dsum), staged in shared memory as [query][key];
//   dV += P^T dO, dK += dS^T Q  (BN x D): WN_KV warps over keys x WARPS / WN_KV over D,
//     accumulated in registers across all steps;
//   dQ_partial = dS K   (BM x D): WM_Q warps over queries x WARPS / WM_Q over D, added
//     into dq_accum (B, Sq, H, D) float32 with atomics (DQ_ATOMIC; else attention_bwd_dq).
// DV: the value head size (dO, V, dV; D but for MLA). SMEM: the dynamic shared memory of the
// launch, in bytes (= BwdTiles<T, D, DV, BM, BN>::smem_bytes).
template <typename T, int D, int DV, int BM, int BN, int WARPS, int WM_S, int WN_KV, int WM_Q, int MASK,
          bool SOFTCAP, bool DROPOUT, bool DQ_ATOMIC, int SMEM>
__global__ void __launch_bounds__(WARPS * 32, 1) attention_bwd_dkdv(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
    T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_accum,
    long long q_sb, long long q_ss, long long q_sh,
    long long k_sb, long long k_ss, long long k_sh,
    long long v_sb, long long v_ss, long long v_sh,
    long long d_sb, long long d_ss, long long d_sh,
    long long dk_sb, long long dk_ss, long long dk_sh,
    long long dv_sb, long long dv_ss, long long dv_sh,
    int H, int Hkv, int Sq, int Sk, float scale, float scale_log2, int win_left, int win_right, float cap_in,
    float cap_out, const int* __restrict__ cu_q, const int* __restrict__ cu_k, int max_q, int max_k,
    long long* __restrict__ fault, const long long* __restrict__ drop_rng, unsigned int drop_threshold,
    float drop_rescale)
{
    using namespace cuk;
    using namespace cuk::attention;
    using Tiles = BwdTiles<T, D, DV, BM, BN>;
    static_assert(SMEM == Tiles::smem_bytes, "SMEM (the launch's dynamic shared memory) differs from BwdTiles::smem_bytes");
    constexpr int THREADS = WARPS * 32;
    constexpr int ROW = row_elems(D);   // shared-memory row of Q and K (D padded to 64)
    constexpr int ROW_BYTES = ROW * static_cast<int>(sizeof(T));
    constexpr int VROW = row_elems(DV);   // ... of dO and V
    constexpr int VROW_BYTES = VROW * static_cast<int>(sizeof(T));
    constexpr int PROW = row_elems(BN);  // shared-memory row of P and dS
    constexpr int PROW_BYTES = PROW * static_cast<int>(sizeof(T));
    // Warp tiles: S/dP SQ x SK (MS m-tiles); dK KN x KD and dV KN x KDV (KM m-tiles); dQ QM x QD
    // (QMT m-tiles). The products over D and over DV share their loops (one trip count where
    // D = DV, as the same code); MLA's longer one runs alone at its end.
    constexpr int SQ = BM / WM_S, SK = BN / (WARPS / WM_S), MS = SQ / 16;
    constexpr int KN = BN / WN_KV, KD = D / (WARPS / WN_KV), KDV = DV / (WARPS / WN_KV), KM = KN / 16;
    constexpr int KS = (D > DV ? D : DV) / 16, KDM = KD > KDV ? KD : KDV;
    constexpr int QM = BM / WM_Q, QD = D / (WARPS / WM_Q), QMT = QM / 16;
    constexpr int QDC = QD % 32 == 0 ? 32 : QD;   // dQ columns a pass
    static_assert(WARPS % WM_S == 0 && WARPS % WN_KV == 0 && WARPS % WM_Q == 0, "warp layouts");
    static_assert(SQ % 16 == 0 && SK % 16 == 0 && KN % 16 == 0 && KD % 16 == 0 && KDV % 16 == 0 && QM % 16 == 0 &&
                  QD % 16 == 0 && QD % QDC == 0 && BN % 64 == 0, "warp tiles");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // Tiles from a 1 KB-aligned base (the launch adds 1 KB): every tile then starts at a
    // multiple of its row length, so (tile + row offset + lane offset) ^ (kk << 5) is the
    // swizzled address of k-step kk: one XOR, with whole-tile offsets left as immediates.
    T* const base = reinterpret_cast<T*>(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));
    T* sK = base + Tiles::k_at;
    T* sV = base + Tiles::v_at;
    T* sQ = base + Tiles::q_at;
    T* sdO = base + Tiles::do_at;
    T* sP = base + Tiles::p_at;
    T* sS = base + Tiles::ds_at;   // dS
    float* sL = reinterpret_cast<float*>(base + Tiles::elems) + Tiles::lse_at;    // lse (natural log)
    float* sD = reinterpret_cast<float*>(base + Tiles::elems) + Tiles::dsum_at;   // Dsum

    const int n_block = blockIdx.x;
    const int b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv;
    const int rep = H / Hkv;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int n0 = n_block * BN;
    // This (batch, kv head)'s tokens: batch bq from token 0, or (packed) batch 0 from a
    // document's first tokens q0, k0. Kept in shared memory and read where used: registers
    // across the step loop are what this kernel has least of.
    __shared__ int span[5];   // bq, q0, k0, sq, sk
    block_span(span, b, gridDim.y / Hkv, cu_q, cu_k, Sq, Sk, max_q, max_k, fault);
    if (n0 >= span[4]) return;   // (packed: the grid covers the longest document)
    // (the mask from the span where used, as the span)
    auto mask = [&]() { return KeyMask<MASK>(win_left, win_right, span[4] - span[3]); };
    const unsigned int offA = a_offset(lane, ROW_BYTES), offB = b_offset(lane, ROW_BYTES);
    const unsigned int offAV = a_offset(lane, VROW_BYTES), offBV = b_offset(lane, VROW_BYTES);
    const unsigned int offPA = a_offset(lane, PROW_BYTES), offPB = b_offset(lane, PROW_BYTES);
    const unsigned int sKa = smem_addr(sK), sVa = smem_addr(sV), sQa = smem_addr(sQ), sdOa = smem_addr(sdO);
    const unsigned int sPa = smem_addr(sP), sSa = smem_addr(sS);
    const int ws_m = (warp % WM_S) * SQ, ws_n = (warp / WM_S) * SK;      // S/dP tile origin
    const int wk_n = (warp % WN_KV) * KN, wk_d = (warp / WN_KV) * KD;    // dK/dV tile origin
    const int wk_dv = (warp / WN_KV) * KDV;                              // (dV's columns)
    const int wq_m = (warp % WM_Q) * QM, wq_d = (warp / WM_Q) * QD;      // dQ tile origin

    // The query tiles whose rows see a key of this tile (the rows up to q_stop).
    const int q_first = mask().first_query(n0), q_stop = mask().stop_query(n0, BN, span[3]);
    const int m_first = q_first / BM;
    const int per_head = q_first < q_stop ? (q_stop + BM - 1) / BM - m_first : 0;
    const int steps = per_head * rep;

    load_tile<T, BN, D, ROW, THREADS>(sK, k + span[0] * k_sb + static_cast<long long>(span[2]) * k_ss + hk * k_sh, k_ss,
                                      n0, span[4]);
    load_tile<T, BN, DV, VROW, THREADS>(sV, v + span[0] * v_sb + static_cast<long long>(span[2]) * v_ss + hk * v_sh,
                                        v_ss, n0, span[4]);
    // Steps walk (head, query tile) pairs, head-major; kept as counters (no divisions).
    auto issue = [&](int h, int m0, int buf) {   // Q, dO, lse and Dsum of a step (zeros past sq)
        const int bq = span[0], q0 = span[1], sq = span[3];
        load_tile<T, BM, D, ROW, THREADS>(sQ + buf * BM * ROW, q + bq * q_sb + static_cast<long long>(q0) * q_ss + h * q_sh,
                                          q_ss, m0, sq);
        load_tile<T, BM, DV, VROW, THREADS>(sdO + buf * BM * VROW,
                                            dout + bq * d_sb + static_cast<long long>(q0) * d_ss + h * d_sh, d_ss, m0,
                                            sq);
        const long long rowbase = (static_cast<long long>(bq) * H + h) * Sq + q0;
        for (int i = threadIdx.x; i < BM; i += THREADS) {
            const bool ok = m0 + i < sq;
            cp_async_4(sL + buf * BM + i, ok ? lse + rowbase + m0 + i : lse, ok);
            cp_async_4(sD + buf * BM + i, ok ? dsum + rowbase + m0 + i : dsum, ok);
        }
    };
    auto advance = [&](int& h, int& m0) {
        if (m0 + BM >= q_stop) { ++h; m0 = m_first * BM; } else { m0 += BM; }
    };
    int h = hk * rep, m0 = m_first * BM;   // this step's head and first query
    if (steps > 0) issue(h, m0, 0);
    DropoutDraw draw{};
    if constexpr (DROPOUT) draw = DropoutDraw::load(drop_rng, drop_threshold);
    cp_async_commit();

    float dkacc[KM][KD / 8][4], dvacc[KM][KDV / 8][4];
#pragma unroll
    for (int mt = 0; mt < KM; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
#pragma unroll
            for (int i = 0; i < KD / 8; ++i) dkacc[mt][i][e] = 0.f;
#pragma unroll
            for (int i = 0; i < KDV / 8; ++i) dvacc[mt][i][e] = 0.f;
        }

    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        cp_async_wait<0>();
        __syncthreads();   // this step's tiles are in; every warp is done with the last step's
        if (step + 1 < steps) {
            int hn = h, mn = m0;
            advance(hn, mn);
            issue(hn, mn, buf ^ 1);
        }
        cp_async_commit();
        const unsigned int qb = sQa + buf * BM * ROW_BYTES, db = sdOa + buf * BM * VROW_BYTES;

        // S = Q K^T (over D) and dP = dO V^T (over DV) for this warp's SQ queries x SK keys.
        const unsigned int qw = qb + ws_m * ROW_BYTES + offA, dw = db + ws_m * VROW_BYTES + offAV;
        const unsigned int kw = sKa + ws_n * ROW_BYTES + offB, vw = sVa + ws_n * VROW_BYTES + offBV;
        float s[MS][SK / 8][4], dp[MS][SK / 8][4];
#pragma unroll
        for (int mt = 0; mt < MS; ++mt)
#pragma unroll
            for (int j = 0; j < SK / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][j][e] = dp[mt][j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            const bool on_d = kk < D / 16, on_dv = kk < DV / 16;   // (constants once unrolled)
            unsigned int aq[MS][4], ad[MS][4];
#pragma unroll
            for (int mt = 0; mt < MS; ++mt) {
                if (on_d) ldmatrix_x4(aq[mt], (qw ^ (kk << 5)) + mt * 16 * ROW_BYTES);
                if (on_dv) ldmatrix_x4(ad[mt], (dw ^ (kk << 5)) + mt * 16 * VROW_BYTES);
            }
#pragma unroll
            for (int nt = 0; nt < SK / 16; ++nt) {
                unsigned int rk[4], rv[4];
                if (on_d) ldmatrix_x4(rk, (kw ^ (kk << 5)) + nt * 16 * ROW_BYTES);
                if (on_dv) ldmatrix_x4(rv, (vw ^ (kk << 5)) + nt * 16 * VROW_BYTES);
#pragma unroll
                for (int mt = 0; mt < MS; ++mt) {
                    if (on_d) {
                        mma_16816<T>(s[mt][2 * nt], aq[mt], rk[0], rk[1]);
                        mma_16816<T>(s[mt][2 * nt + 1], aq[mt], rk[2], rk[3]);
                    }
                    if (on_dv) {
                        mma_16816<T>(dp[mt][2 * nt], ad[mt], rv[0], rv[1]);
                        mma_16816<T>(dp[mt][2 * nt + 1], ad[mt], rv[2], rv[3]);
                    }
                }
            }
        }

        // P = exp(S*scale - lse), dS = P * (dP - Dsum) (the softcap: P = exp(c tanh(S*scale / c)
        // - lse), dS times 1 - tanh^2); masked entries (queries past sq, keys past sk or
        // outside the mask) are 0. Stored as [query][key] pairs.
        const float* lrow = sL + buf * BM;
        const float* drow = sD + buf * BM;
        const int sq = span[3], sk = span[4];
        const KeyMask<MASK> mk = mask();
        const bool edge = m0 + BM > sq || mk.edge(n0, BN, m0, BM, sk);
#pragma unroll
        for (int mt = 0; mt < MS; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int qi = ws_m + mt * 16 + g + r * 8;   // query within the tile
                const float l2 = lrow[qi] * LOG2E, dsm = drow[qi];
                unsigned int keeps = ~0u;
                if constexpr (DROPOUT)
                    keeps = draw.keep_pairs<SK / 8>(span[0] * H + h, span[1] + m0 + qi, span[2] + n0 + ws_n + 2 * t);
#pragma unroll
                for (int j = 0; j < SK / 8; ++j) {
                    float pv[2];
                    const unsigned int keep = (keeps >> (2 * j)) & 3u;
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        float p, th = 0.f;
                        if constexpr (SOFTCAP) {
                            th = tanh_approx(s[mt][j][2 * r + c] * cap_in);
                            p = fast_exp2(fmaf(th, cap_out, -l2));
                        } else {
                            p = fast_exp2(fmaf(s[mt][j][2 * r + c], scale_log2, -l2));
                        }
                        if (edge) {
                            const int key = n0 + ws_n + j * 8 + 2 * t + c;
                            if (m0 + qi >= sq || mk.hidden(m0 + qi, key, sk)) p = 0.f;
                        }
                        float dpz = dp[mt][j][2 * r + c];
                        pv[c] = p;
                        if constexpr (DROPOUT) {
                            const bool kept = (keep >> c) & 1u;
                            pv[c] = kept ? p * drop_rescale : 0.f;
                            dpz = kept ? dpz * drop_rescale : 0.f;
                        }
                        dp[mt][j][2 * r + c] = p * (dpz - dsm);
                        if constexpr (SOFTCAP) dp[mt][j][2 * r + c] *= 1.f - th * th;
                    }
                    const int at = swz<PROW>(qi, ws_n + j * 8 + 2 * t);
                    *reinterpret_cast<unsigned int*>(sP + at) = pack_pair(pv[0], pv[1], T{});
                    *reinterpret_cast<unsigned int*>(sS + at) =
                        pack_pair(dp[mt][j][2 * r], dp[mt][j][2 * r + 1], T{});
                }
            }
        }
        __syncthreads();   // P and dS staged

        auto dq_pass = [&]() {
            // dQ[QM x QD] = dS K over the BN keys (k): A = dS [query][key] (ldmatrix), B = K
            // [key][d] (ldmatrix.trans); added into dq_accum QDC columns at a time (the
            // accumulators live beside dK and dV's).
#pragma unroll
            const unsigned int sw = sSa + wq_m * PROW_BYTES + offPA;
#pragma unroll
            for (int dc = 0; dc < QD; dc += QDC) {
                float acc[QMT][QDC / 8][4];
#pragma unroll
                for (int mt = 0; mt < QMT; ++mt)
#pragma unroll
                    for (int i = 0; i < QDC / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) {
                    unsigned int a[QMT][4];
#pragma unroll
                    for (int mt = 0; mt < QMT; ++mt)
                        ldmatrix_x4(a[mt], (sw ^ (kk << 5)) + mt * 16 * PROW_BYTES);
#pragma unroll
                    for (int dt = 0; dt < QDC / 16; ++dt) {
                        unsigned int r[4];
                        ldmatrix_x4_trans(r, sKa + kk * 16 * ROW_BYTES + (offA ^ (((wq_d + dc) / 16 + dt) << 5)));
#pragma unroll
                        for (int mt = 0; mt < QMT; ++mt) {
                            mma_16816<T>(acc[mt][2 * dt], a[mt], r[0], r[1]);
                            mma_16816<T>(acc[mt][2 * dt + 1], a[mt], r[2], r[3]);
                        }
                    }
                }
#pragma unroll
                for (int mt = 0; mt < QMT; ++mt) {
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = m0 + wq_m + mt * 16 + g + r * 8;
                        if (row < span[3]) {
                            float* dst = dq_accum + ((static_cast<long long>(span[0]) * Sq + span[1] + row) * H + h) * D + wq_d + dc + 2 * t;
#pragma unroll
                            for (int i = 0; i < QDC / 8; ++i) red_add2(dst + i * 8, acc[mt][i][2 * r], acc[mt][i][2 * r + 1]);
                        }
                    }
                }
            }
        };
        // dV += P^T dO and dK += dS^T Q over the BM queries (k); A = P^T, dS^T from their
        // [query][key] tiles (ldmatrix.trans), B = dO, Q from [query][d] (ldmatrix.trans);
        // dV's KDV columns and dK's KD in one loop.
#pragma unroll
        for (int kq = 0; kq < BM / 16; ++kq) {
            unsigned int ap[KM][4], as[KM][4];
#pragma unroll
            for (int mt = 0; mt < KM; ++mt) {
                ldmatrix_x4_trans(ap[mt], sPa + kq * 16 * PROW_BYTES + (offPB ^ (((wk_n + mt * 16) / 16) << 5)));
                ldmatrix_x4_trans(as[mt], sSa + kq * 16 * PROW_BYTES + (offPB ^ (((wk_n + mt * 16) / 16) << 5)));
            }
#pragma unroll
            for (int dt = 0; dt < KDM / 16; ++dt) {
                const bool on_dv = dt < KDV / 16, on_d = dt < KD / 16;   // (constants once unrolled)
                const int dvt = on_dv ? dt : 0, dkt = on_d ? dt : 0;     // (indices in bounds where off)
                unsigned int rd[4], rq[4];
                if (on_dv) ldmatrix_x4_trans(rd, db + kq * 16 * VROW_BYTES + (offAV ^ ((wk_dv / 16 + dt) << 5)));
                if (on_d) ldmatrix_x4_trans(rq, qb + kq * 16 * ROW_BYTES + (offA ^ ((wk_d / 16 + dt) << 5)));
#pragma unroll
                for (int mt = 0; mt < KM; ++mt) {
                    if (on_dv) {
                        mma_16816<T>(dvacc[mt][2 * dvt], ap[mt], rd[0], rd[1]);
                        mma_16816<T>(dvacc[mt][2 * dvt + 1], ap[mt], rd[2], rd[3]);
                    }
                    if (on_d) {
                        mma_16816<T>(dkacc[mt][2 * dkt], as[mt], rq[0], rq[1]);
                        mma_16816<T>(dkacc[mt][2 * dkt + 1], as[mt], rq[2], rq[3]);
                    }
                }
            }
        }

        // dQ last (measured: 4% faster than first at d128).
        if constexpr (DQ_ATOMIC) dq_pass();
        advance(h, m0);
    }
    cp_async_wait<0>();   // (no copy may be in flight at exit, e.g. with no query tile)

    // Write this warp's dK, dV tile (zeros for keys no query sees).
    const int bq = span[0], k0 = span[2], sk = span[4];
    T* dkg = dk + bq * dk_sb + static_cast<long long>(k0) * dk_ss + hk * dk_sh;
    T* dvg = dv + bq * dv_sb + static_cast<long long>(k0) * dv_ss + hk * dv_sh;
#pragma unroll
    for (int mt = 0; mt < KM; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = n0 + wk_n + mt * 16 + g + r * 8;
            if (key < sk) {
#pragma unroll
                for (int i = 0; i < KDM / 8; ++i) {
                    if (i < KD / 8)
                        *reinterpret_cast<unsigned int*>(dkg + key * dk_ss + wk_d + i * 8 + 2 * t) =
                            pack_pair(dkacc[mt][i < KD / 8 ? i : 0][2 * r] * scale,
                                      dkacc[mt][i < KD / 8 ? i : 0][2 * r + 1] * scale, T{});
                    if (i < KDV / 8)
                        *reinterpret_cast<unsigned int*>(dvg + key * dv_ss + wk_dv + i * 8 + 2 * t) =
                            pack_pair(dvacc[mt][i < KDV / 8 ? i : 0][2 * r], dvacc[mt][i < KDV / 8 ? i : 0][2 * r + 1],
                                      T{});
                }
            }
        }
    }
}

// dQ. Block (query tile m_block, b * H + h); WARPS warps of 16 queries: BM = 16 * WARPS.
// DV: the value head size (dO and V). SMEM: the dynamic shared memory of the launch, in bytes
// (= DqTiles<T, D, DV, WARPS, BN>::smem_bytes).
template <typename T, int D, int DV, int WARPS, int BN, int MASK, bool SOFTCAP, bool DROPOUT, int SMEM>
__device__ __forceinline__ void attention_bwd_dq_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
    T* __restrict__ dq,
    long long q_sb, long long q_ss, long long q_sh,
    long long k_sb, long long k_ss, long long k_sh,
    long long v_sb, long long v_ss, long long v_sh,
    long long d_sb, long long d_ss, long long d_sh,
    long long dq_sb, long long dq_ss, long long dq_sh,
    int H, int Hkv, int Sq, int Sk, float scale, float scale_log2, int win_left, int win_right, float cap_in,
    float cap_out, const int* __restrict__ cu_q, const int* __restrict__ cu_k, int max_q, int max_k,
    long long* __restrict__ fault, const long long* __restrict__ drop_rng, unsigned int drop_threshold,
    float drop_rescale)
{
    using namespace cuk;
    using namespace cuk::attention;
    using Tiles = DqTiles<T, D, DV, WARPS, BN>;
    static_assert(SMEM == Tiles::smem_bytes, "SMEM (the launch's dynamic shared memory) differs from DqTiles::smem_bytes");
    constexpr int BM = Tiles::BM;
    constexpr int THREADS = WARPS * 32;
    constexpr int ROW = row_elems(D);   // shared-memory row of Q and K (D padded to 64 elements)
    constexpr int ROW_BYTES = ROW * static_cast<int>(sizeof(T));
    constexpr int VROW = row_elems(DV);   // ... of dO and V
    constexpr int VROW_BYTES = VROW * static_cast<int>(sizeof(T));
    constexpr int NT = BN / 8;
    constexpr int DT = D / 8;
    constexpr int KS = (D > DV ? D : DV) / 16;   // S's and dP's k-steps, in one loop
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* const base = reinterpret_cast<T*>(smem_raw);
    T* sQ = base + Tiles::q_at;
    T* sdO = base + Tiles::do_at;
    T* sK = base + Tiles::k_at;
    T* sV = base + Tiles::v_at;

    const int m_block = MASK != MASK_NONE ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int hk = h / (H / Hkv);
    const int m0 = m_block * BM;
    // This (batch, head)'s tokens: batch bq from token 0, or (packed) batch 0 from a document's
    // first tokens q0, k0; in shared memory and read where used, as attention_bwd_dkdv's.
    __shared__ int span[5];   // bq, q0, k0, sq, sk
    block_span(span, b, gridDim.y / H, cu_q, cu_k, Sq, Sk, max_q, max_k, fault);
    if (m0 >= span[3]) return;   // (packed: the grid covers the longest document)
    auto mask = [&]() { return KeyMask<MASK>(win_left, win_right, span[4] - span[3]); };
    auto kv_load = [&](int buf, int nb) {   // key tile nb into buffer buf
        const long long at = span[0] * k_sb + static_cast<long long>(span[2]) * k_ss + hk * k_sh;
        const long long vat = span[0] * v_sb + static_cast<long long>(span[2]) * v_ss + hk * v_sh;
        load_tile<T, BN, D, ROW, THREADS>(sK + buf * BN * ROW, k + at, k_ss, nb * BN, span[4]);
        load_tile<T, BN, DV, VROW, THREADS>(sV + buf * BN * VROW, v + vat, v_ss, nb * BN, span[4]);
    };
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const unsigned int offA = a_offset(lane, ROW_BYTES), offB = b_offset(lane, ROW_BYTES);
    const unsigned int offAV = a_offset(lane, VROW_BYTES), offBV = b_offset(lane, VROW_BYTES);
    const unsigned int sQa = smem_addr(sQ), sdOa = smem_addr(sdO), sKa = smem_addr(sK), sVa = smem_addr(sV);

    // The key tiles nb_first .. n_blocks - 1 hold every key a row of the block sees.
    const int stop = mask().stop_key(m0, BM, span[4]), first = min(mask().first_key(m0), stop);
    const int nb_first = first / BN, n_blocks = stop > first ? (stop + BN - 1) / BN : nb_first;
    {
        const int bq = span[0], q0 = span[1], sq = span[3];
        load_tile<T, BM, D, ROW, THREADS>(sQ, q + bq * q_sb + static_cast<long long>(q0) * q_ss + h * q_sh, q_ss, m0, sq);
        load_tile<T, BM, DV, VROW, THREADS>(sdO, dout + bq * d_sb + static_cast<long long>(q0) * d_ss + h * d_sh, d_ss,
                                            m0, sq);
    }
    if (n_blocks > nb_first) kv_load(0, nb_first);
    cp_async_commit();

    // This thread's two rows: lse (log2 units) and Dsum.
    float lrow[2], drow[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = m0 + warp * 16 + g + r * 8;
        const long long idx = (static_cast<long long>(span[0]) * H + h) * Sq + span[1] + row;
        lrow[r] = row < span[3] ? lse[idx] * LOG2E : 0.f;
        drow[r] = row < span[3] ? dsum[idx] : 0.f;
    }

    float dqacc[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) dqacc[i][0] = dqacc[i][1] = dqacc[i][2] = dqacc[i][3] = 0.f;
    DropoutDraw draw{};
    if constexpr (DROPOUT) draw = DropoutDraw::load(drop_rng, drop_threshold);

    for (int nb = nb_first; nb < n_blocks; ++nb) {
        const int buf = (nb - nb_first) & 1;
        if (nb + 1 < n_blocks) kv_load(buf ^ 1, nb + 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const unsigned int kb = sKa + buf * BN * ROW_BYTES, vb = sVa + buf * BN * VROW_BYTES;

        // S = Q K^T (over D) and dP = dO V^T (over DV) for this warp's 16 queries.
        float s[NT][4], dp[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            const bool on_d = kk < D / 16, on_dv = kk < DV / 16;   // (constants once unrolled)
            unsigned int aq[4], ad[4];
            if (on_d) ldmatrix_x4(aq, sQa + warp * 16 * ROW_BYTES + (offA ^ (kk << 5)));
            if (on_dv) ldmatrix_x4(ad, sdOa + warp * 16 * VROW_BYTES + (offAV ^ (kk << 5)));
#pragma unroll
            for (int nt = 0; nt < BN / 16; ++nt) {
                unsigned int rk[4], rv[4];
                if (on_d) ldmatrix_x4(rk, kb + nt * 16 * ROW_BYTES + (offB ^ (kk << 5)));
                if (on_dv) ldmatrix_x4(rv, vb + nt * 16 * VROW_BYTES + (offBV ^ (kk << 5)));
                if (on_d) {
                    mma_16816<T>(s[2 * nt], aq, rk[0], rk[1]);
                    mma_16816<T>(s[2 * nt + 1], aq, rk[2], rk[3]);
                }
                if (on_dv) {
                    mma_16816<T>(dp[2 * nt], ad, rv[0], rv[1]);
                    mma_16816<T>(dp[2 * nt + 1], ad, rv[2], rv[3]);
                }
            }
        }

        // dS = P * (dP - Dsum), P = exp(S*scale - lse) (the softcap: as attention_bwd_dkdv), masked.
        const int n0 = nb * BN, sq = span[3], sk = span[4];
        const KeyMask<MASK> mk = mask();
        const bool edge = m0 + BM > sq || mk.edge(n0, BN, m0, BM, sk);
        unsigned int keeps[2] = {~0u, ~0u};   // (rows g and g + 8: bits 2 j, 2 j + 1 their keys of n-tile j)
        if constexpr (DROPOUT) {
            const unsigned int bh = span[0] * H + h, row = span[1] + m0 + warp * 16 + g;
            keeps[0] = draw.keep_pairs<NT>(bh, row, span[2] + n0 + 2 * t);
            keeps[1] = draw.keep_pairs<NT>(bh, row + 8, span[2] + n0 + 2 * t);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const unsigned int keep = ((keeps[0] >> (2 * j)) & 3u) | (((keeps[1] >> (2 * j)) & 3u) << 2);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                const int key = n0 + j * 8 + 2 * t + (e & 1);
                const int row = m0 + warp * 16 + g + r * 8;
                float p, th = 0.f;
                if constexpr (SOFTCAP) {
                    th = tanh_approx(s[j][e] * cap_in);
                    p = fast_exp2(fmaf(th, cap_out, -lrow[r]));
                } else {
                    p = fast_exp2(fmaf(s[j][e], scale_log2, -lrow[r]));
                }
                if (edge && (row >= sq || mk.hidden(row, key, sk))) p = 0.f;
                float dpz = dp[j][e];
                if constexpr (DROPOUT) dpz = (keep >> e) & 1u ? dpz * drop_rescale : 0.f;
                s[j][e] = p * (dpz - drow[r]);
                if constexpr (SOFTCAP) s[j][e] *= 1.f - th * th;
            }
        }

        // dQ += dS K: the key tile is the k dimension.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const unsigned int a[4] = {
                pack_pair(s[2 * kk][0], s[2 * kk][1], T{}), pack_pair(s[2 * kk][2], s[2 * kk][3], T{}),
                pack_pair(s[2 * kk + 1][0], s[2 * kk + 1][1], T{}), pack_pair(s[2 * kk + 1][2], s[2 * kk + 1][3], T{})};
#pragma unroll
            for (int dt = 0; dt < D / 16; ++dt) {
                unsigned int r[4];
                ldmatrix_x4_trans(r, kb + kk * 16 * ROW_BYTES + (offA ^ (dt << 5)));
                mma_16816<T>(dqacc[2 * dt], a, r[0], r[1]);
                mma_16816<T>(dqacc[2 * dt + 1], a, r[2], r[3]);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();   // (no copy may be in flight at exit, e.g. with no key tile)

    T* dqg = dq + span[0] * dq_sb + static_cast<long long>(span[1]) * dq_ss + h * dq_sh;
    const int sq = span[3];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = m0 + warp * 16 + g + r * 8;
        if (row < sq) {
#pragma unroll
            for (int i = 0; i < DT; ++i)
                *reinterpret_cast<unsigned int*>(dqg + static_cast<long long>(row) * dq_ss + i * 8 + 2 * t) =
                    pack_pair(dqacc[i][2 * r] * scale, dqacc[i][2 * r + 1] * scale, T{});
        }
    }
}

template <typename T, int D, int DV, int WARPS, int BN, int MASK, bool SOFTCAP, bool DROPOUT, int SMEM>
__global__ void __launch_bounds__(WARPS * 32, 1) attention_bwd_dq(
    const __grid_constant__ cuk::attention::BwdQParams<T> p)
{
    const cuk::attention::Problem& r = p.problem;
    attention_bwd_dq_body<T, D, DV, WARPS, BN, MASK, SOFTCAP, DROPOUT, SMEM>(
        p.q, p.k, p.v, p.dout, p.lse, p.dsum, p.dq, p.q_sb, p.q_ss, p.q_sh, p.k_sb, p.k_ss, p.k_sh, p.v_sb,
        p.v_ss, p.v_sh, p.d_sb, p.d_ss, p.d_sh, p.dq_sb, p.dq_ss, p.dq_sh, r.H, r.Hkv, r.Sq, r.Sk, r.scale,
        r.scale_log2, r.win_left, r.win_right, r.cap_in, r.cap_out, r.cu_q, r.cu_k, r.max_q, r.max_k, r.fault,
        p.drop_rng, p.drop_threshold, p.drop_rescale);
}

// dq = acc * scale in T (deterministic=False). acc: dQ's float32 partial sums, contiguous
// (B, Sq, H, D); dq: (B, Sq, H, D) through element strides dq_sb, dq_ss, dq_sh of batch,
// sequence and head, unit stride over D. A thread converts 8 elements a step (two float4
// loads, one 16-byte store): D is a multiple of 16, and the front gives dq a 16-byte aligned
// base and strides that are multiples of 8 elements, so dq is an array of aligned 8-element
// vectors. Grid: blocks of 256 threads, any number (a grid-stride loop over the B*Sq*H*D/8
// vectors); the front launches min(ceil(B*Sq*H*D / (8*256)), 65535*16): one vector a thread
// where the grid allows.
template <typename T, int D>
__global__ void __launch_bounds__(256) attention_bwd_dq_convert(
    const float* __restrict__ acc, T* __restrict__ dq, int B, int Sq, int H,
    long long dq_sb, long long dq_ss, long long dq_sh, float scale)
{
    using namespace cuk;
    static_assert(D % 16 == 0, "head dim: a multiple of 16");
    constexpr int VPR = D / 8;   // vectors a row (b, i, h)
    // Indexed as vectors: with element offsets (+ a multiple of 8) the compiler was seen to
    // split the 16-byte store into 2- and 4-byte stores for power-of-two D.
    Vec<T, 8>* const dqv = reinterpret_cast<Vec<T, 8>*>(dq);
    const long long vsb = dq_sb / 8, vss = dq_ss / 8, vsh = dq_sh / 8;
    const long long n = static_cast<long long>(B) * Sq * H * VPR;
    for (long long c = blockIdx.x * 256LL + threadIdx.x; c < n; c += gridDim.x * 256LL) {
        const long long r = c / VPR;   // acc's row, (b * Sq + i) * H + h
        const int j = static_cast<int>(c - r * VPR);
        const int h = static_cast<int>(r % H);
        const long long bi = r / H;
        const int i = static_cast<int>(bi % Sq), b = static_cast<int>(bi / Sq);
        const float4 lo = *reinterpret_cast<const float4*>(acc + c * 8);
        const float4 hi = *reinterpret_cast<const float4*>(acc + c * 8 + 4);
        const float f[8] = {lo.x * scale, lo.y * scale, lo.z * scale, lo.w * scale,
                            hi.x * scale, hi.y * scale, hi.z * scale, hi.w * scale};
        dqv[b * vsb + i * vss + h * vsh + j] = pack<T, 8>(f);
    }
}

// The sinks' gradient (common/attn_sink.cuh): dsinks[h] = -sum over (b, i) of
// exp(sinks[h] - lse[b, h, i]) Dsum[b, h, i], the sink's probability in each row times the
// row's softmax correction (the sink has no value, so dP is 0 there). lse and Dsum (B, H, Sq)
// float32, dense (packed documents: B = 1 over the token total). One block of 256 threads a
// head, summed in a fixed order: the same bits on every call.
__global__ void __launch_bounds__(256) attention_bwd_sink(
    const float* __restrict__ sinks, const float* __restrict__ lse, const float* __restrict__ dsum,
    float* __restrict__ dsinks, int B, int H, int Sq)
{
    using namespace cuk;
    __shared__ GroupReduce<256>::TempStorage tmp;
    const int h = blockIdx.x;
    const float s = sinks[h];
    float acc[1] = {0.f};
    for (int b = 0; b < B; ++b) {
        const long long at = (static_cast<long long>(b) * H + h) * Sq;
        for (int i = threadIdx.x; i < Sq; i += 256) acc[0] = fmaf(expf(s - lse[at + i]), dsum[at + i], acc[0]);
    }
    GroupReduce<256>::sum(acc, tmp);
    if (threadIdx.x == 0) dsinks[h] = -acc[0];
}
