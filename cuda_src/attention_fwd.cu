// Fused attention forward (FlashAttention-2 work split) on tensor cores: mma.sync m16n8k16
// with float32 accumulators, ldmatrix from XOR-swizzled shared memory, cp.async double
// buffering of the key/value tiles, online softmax in float32 with exp2.
//
// One block computes BM = 16 * MT * WARPS query rows of one (batch, head) against all keys:
// each warp owns MT tiles of 16 rows (every K/V fragment it loads from shared memory feeds
// MT matrix products), keeps its O accumulator (16 MT x D) in registers, its Q fragments too
// when QREG (else it re-reads them from shared memory at each key tile), and walks the
// key/value tiles of BN keys that the block stages in shared memory.
// Grouped-query attention: query head h reads key/value head h / (H / Hkv), no copies.
// Masks are aligned to the bottom right (common/attn_mask.cuh: causal, query i sees keys
// j <= i + Sk - Sq, as FlashAttention >= 2.1; sliding windows): key tiles outside a block's
// rows' range are skipped; a row that sees no key gets zeros and lse = +inf (with a sink, its
// logit: common/attn_sink.cuh). SOFTCAP: the
// scaled scores s become c tanh(s / c) (cap_in = scale / c, cap_out = c log2(e)). DROPOUT:
// the weights, after their row sum is taken, are dropped by common/attn_dropout.cuh's draw and
// the output scaled by 1 / (1 - p) (the lse is the softmax's).
//
// Layout: q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, DV), out (B, Sq, H, DV), each with
// element strides for batch, sequence and head and a unit stride over the head dim; lse (B, H,
// Sq) float32. DV, the value head size, is D but for MLA (D 192, DV 128): S runs on D, O on DV.
// Packed documents (cu_q non-null): q (total Sq, H, D) and k, v (total Sk, Hkv, D / DV) with batch
// strides unused, blockIdx.y / H the document, its tokens from cu_q / cu_k; lse (H, total Sq).
#include "common/dtype.cuh"
#include "common/mma.cuh"
#include "common/reduce.cuh"
#include "common/attn_tile.cuh"
#include "common/attn_mask.cuh"
#include "common/attn_params.cuh"
#include "common/attn_sink.cuh"
#include "common/attn_dropout.cuh"

namespace cuk {
namespace attention {

// Dynamic shared memory of attention_fwd: element offsets of its tiles from the aligned base,
// and smem_bytes, the launch's byte count, which adds 1 KB of slack for the kernel to align
// its base to 1 KB. The kernel's SMEM template argument must equal smem_bytes: the front
// computes the same number for the launch (cukern/attention/configs.py), so the two cannot drift.
template <typename T, int D, int DV, int WARPS, int MT, int BN>
struct FwdTiles {
    static constexpr int BM = 16 * MT * WARPS;
    static constexpr int ROW = row_elems(D), VROW = row_elems(DV);
    static constexpr int q_at = 0;                    // Q   [BM][ROW]
    static constexpr int k_at = q_at + BM * ROW;      // K   [2][BN][ROW]
    static constexpr int v_at = k_at + 2 * BN * ROW;  // V   [2][BN][VROW]
    static constexpr int elems = v_at + 2 * BN * VROW;
    static constexpr int smem_bytes = elems * static_cast<int>(sizeof(T)) + 1024;
};

// attention_fwd's parameters: Q, K, V, O (B, S, H, D or DV) with their strides in elements (batch,
// sequence, head), lse (B, H, Sq) float32 (null: not written), the sinks (H) float32 (null:
// none), the problem, and dropout's (DROPOUT instances): the seed and offset (2,) int64 in
// device memory, the threshold of a kept word and 1 / (1 - p).
template <typename T>
struct FwdParams {
    const T* q;
    const T* k;
    const T* v;
    T* out;
    float* lse;
    const float* sinks;
    long long q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh;
    Problem problem;
    const long long* drop_rng;
    unsigned int drop_threshold;
    float drop_rescale;
};

}  // namespace attention
}  // namespace cuk

// SMEM: the dynamic shared memory of the launch, in bytes (= FwdTiles<...>::smem_bytes).
template <typename T, int D, int DV, int WARPS, int MT, int BN, int BNC, bool QREG, int MASK, bool SOFTCAP,
          bool DROPOUT, int SMEM>
__device__ __forceinline__ void attention_fwd_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const float* __restrict__ sinks,
    long long q_sb, long long q_ss, long long q_sh,
    long long k_sb, long long k_ss, long long k_sh,
    long long v_sb, long long v_ss, long long v_sh,
    long long o_sb, long long o_ss, long long o_sh,
    int H, int Hkv, int Sq, int Sk, float scale_log2, int win_left, int win_right, float cap_in, float cap_out,
    const int* __restrict__ cu_q, const int* __restrict__ cu_k, int max_q, int max_k, long long* __restrict__ fault,
    const long long* __restrict__ drop_rng, unsigned int drop_threshold, float drop_rescale)
{
    using namespace cuk;
    using namespace cuk::attention;
    using Tiles = FwdTiles<T, D, DV, WARPS, MT, BN>;
    static_assert(SMEM == Tiles::smem_bytes, "SMEM (the launch's dynamic shared memory) differs from FwdTiles::smem_bytes");
    constexpr int BM = Tiles::BM;
    constexpr int THREADS = WARPS * 32;
    constexpr int ROW = row_elems(D);   // shared-memory row (D padded to 64 elements)
    constexpr int ROW_BYTES = ROW * static_cast<int>(sizeof(T));
    constexpr int VROW = row_elems(DV);   // V's shared-memory row
    constexpr int VROW_BYTES = VROW * static_cast<int>(sizeof(T));
    constexpr int NT = BNC / 8;     // key n-tiles a compute sub-tile (BNC keys of the BN staged)
    constexpr int DT = DV / 8;      // value head-dim n-tiles (O's)
    static_assert(D % 16 == 0 && DV % 16 == 0 && BNC % 16 == 0 && BN % BNC == 0, "tile shapes");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // Tiles from a 1 KB-aligned base (the launch adds 1 KB): each tile starts at a multiple of
    // its row length, so (tile + lane offset) ^ (kk << 5) is k-step kk's swizzled address, and
    // whole-row offsets stay ldmatrix immediates.
    T* const base = reinterpret_cast<T*>(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));
    T* sQ = base + Tiles::q_at;
    T* sK = base + Tiles::k_at;
    T* sV = base + Tiles::v_at;

    // Causal blocks have different amounts of work: the longest (last) are started first.
    const int m_block = MASK != MASK_NONE ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int hk = h / (H / Hkv);
    const int m0 = m_block * BM;
    // This (batch, head)'s rows: a batch's, or (packed) a document's tokens. (The epilogue
    // reads the document's offset again: nothing more stays live across the key loop.)
    int sq = Sq, sk = Sk;
    const T* qg = q + b * q_sb + h * q_sh;
    const T* kg = k + b * k_sb + hk * k_sh;
    const T* vg = v + b * v_sb + hk * v_sh;
    // Dropout draws at (b * H + h, token, token): packed, batch 0 and the pack's tokens.
    unsigned int drop_bh = b * H + h, drop_q0 = 0, drop_k0 = 0;
    if (cu_q) {
        const DocSpan doc = doc_span(cu_q, cu_k, b, gridDim.y / H, Sq, Sk, max_q, max_k, fault);
        if (m0 >= doc.sq) return;   // (the grid covers the longest document)
        sq = doc.sq, sk = doc.sk;
        drop_bh = h, drop_q0 = doc.q0, drop_k0 = doc.k0;
        qg = q + doc.q0 * q_ss + h * q_sh;   // (packed: no batch strides)
        kg = k + doc.k0 * k_ss + hk * k_sh;
        vg = v + doc.k0 * v_ss + hk * v_sh;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int diag = sk - sq;   // query i stands at key i + diag
    const KeyMask<MASK> mask(win_left, win_right, diag);
    // (with the softcap the scores arrive in the log2 domain already)
    const float sl2 = SOFTCAP ? 1.f : scale_log2;
    // Row of m-tile mt of this warp (the block's rows are m-tile-major: all warps' tile 0 first).
    auto tile_row = [&](int mt) { return mt * WARPS * 16 + warp * 16; };
    // ldmatrix addresses. A lane's row within an 8-row group is lane % 8, so its swizzle key
    // is fixed; the chunk index is 2*kk + (a lane bit), so the swizzled byte offset is
    // (base ^ (kk << 5)) plus a row offset: an XOR and an add, no per-kk registers.
    const unsigned int q_off = a_offset(lane, ROW_BYTES), k_off = b_offset(lane, ROW_BYTES);
    const unsigned int v_off = a_offset(lane, VROW_BYTES);
    const unsigned int sKa = smem_addr(sK), sVa = smem_addr(sV);
    const unsigned int qw = smem_addr(sQ) + warp * 16 * ROW_BYTES + q_off;   // this warp's Q rows

    // The key tiles nb_first .. n_blocks - 1 hold every key a row of the block sees.
    const int stop = mask.stop_key(m0, BM, sk), first = min(mask.first_key(m0), stop);
    const int nb_first = first / BN, n_blocks = stop > first ? (stop + BN - 1) / BN : nb_first;

    load_tile<T, BM, D, ROW, THREADS>(sQ, qg, q_ss, m0, sq);
    if (n_blocks > nb_first) {
        load_tile<T, BN, D, ROW, THREADS>(sK, kg, k_ss, nb_first * BN, sk);
        load_tile<T, BN, DV, VROW, THREADS>(sV, vg, v_ss, nb_first * BN, sk);
    }
    cp_async_commit();

    float o[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < DT; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        row_max[mt][0] = row_max[mt][1] = neg_inf();
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }
    unsigned int qf[QREG ? MT : 1][QREG ? D / 16 : 1][4];
    // Dropout's seed, offset and place, in shared memory: read at each draw, not held in
    // registers across the key loop (the O accumulators leave the d128 and d256 tiles none).
    __shared__ unsigned int drop_sh[DROPOUT ? 6 : 1];
    if constexpr (DROPOUT) {
        if (threadIdx.x == 0) {
            const DropoutDraw d = DropoutDraw::load(drop_rng, drop_threshold);
            d.stash(drop_sh);
            drop_sh[3] = drop_bh, drop_sh[4] = drop_q0, drop_sh[5] = drop_k0;
        }
    }

    for (int nb = nb_first; nb < n_blocks; ++nb) {
        const int buf = (nb - nb_first) & 1;
        if (nb + 1 < n_blocks) {
            load_tile<T, BN, D, ROW, THREADS>(sK + (buf ^ 1) * BN * ROW, kg, k_ss, (nb + 1) * BN, sk);
            load_tile<T, BN, DV, VROW, THREADS>(sV + (buf ^ 1) * BN * VROW, vg, v_ss, (nb + 1) * BN, sk);
        }
        cp_async_commit();
        cp_async_wait<1>();  // all but the group just issued: Q and this block's K, V
        __syncthreads();
        if (QREG && nb == nb_first) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk)
                    ldmatrix_x4(qf[QREG ? mt : 0][QREG ? kk : 0],
                                (qw ^ (kk << 5)) + mt * WARPS * 16 * ROW_BYTES);
        }

        for (int sub = 0; sub < BN / BNC; ++sub) {
            // S = Q K^T: each K fragment pair feeds MT m-tiles.
            float s[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < NT; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
            const unsigned int kw = sKa + (buf * BN + sub * BNC) * ROW_BYTES + k_off;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned int a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if constexpr (QREG) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) a[mt][e] = qf[QREG ? mt : 0][QREG ? kk : 0][e];
                    } else {
                        ldmatrix_x4(a[mt], (qw ^ (kk << 5)) + mt * WARPS * 16 * ROW_BYTES);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < BNC / 16; ++nt) {
                    unsigned int r[4];
                    ldmatrix_x4(r, (kw ^ (kk << 5)) + nt * 16 * ROW_BYTES);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816<T>(s[mt][2 * nt], a[mt], r[0], r[1]);
                        mma_16816<T>(s[mt][2 * nt + 1], a[mt], r[2], r[3]);
                    }
                }
            }

            if constexpr (SOFTCAP) {   // c tanh(s scale / c), in the log2 domain
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[mt][j][e] = tanh_approx(s[mt][j][e] * cap_in) * cap_out;
            }
            // Mask keys past the end and outside the rows' range (only tiles that have any).
            const int n0 = nb * BN + sub * BNC;
            if (mask.edge(n0, BNC, m0, BM, sk)) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = n0 + j * 8 + 2 * t + (e & 1);
                            const int row = m0 + tile_row(mt) + g + (e >> 1) * 8;
                            if (mask.hidden(row, key, sk)) s[mt][j][e] = neg_inf();
                        }
            }

            // Online softmax in the log2 domain, scale folded into one FMA: p = 2^(s*c - max*c).
            // Rows g (e = 0, 1) and g + 8 (e = 2, 3) of each m-tile; a row lives in a quad.
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float mx = neg_inf();
#pragma unroll
                    for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * r], s[mt][j][2 * r + 1]));
                    butterfly<1, 2>(Max{}, mx);   // over the row's quad
                    const float new_max = fmaxf(row_max[mt][r], mx * sl2);   // (scale > 0)
                    const float m_use = new_max == neg_inf() ? 0.f : new_max;      // a row with no key yet
                    const float alpha = fast_exp2(row_max[mt][r] - m_use);
                    row_max[mt][r] = new_max;
                    float sum = 0.f;
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        s[mt][j][2 * r] = fast_exp2(fmaf(s[mt][j][2 * r], sl2, -m_use));
                        s[mt][j][2 * r + 1] = fast_exp2(fmaf(s[mt][j][2 * r + 1], sl2, -m_use));
                        sum += s[mt][j][2 * r] + s[mt][j][2 * r + 1];
                    }
                    row_sum[mt][r] = row_sum[mt][r] * alpha + sum;   // this thread's columns; the quad adds up at the end
                    if constexpr (DROPOUT) {   // (after the sum: the softmax's denominator has every weight)
                        const DropoutDraw draw = DropoutDraw::stashed(drop_sh, drop_threshold);
                        const unsigned int row = drop_sh[4] + m0 + tile_row(mt) + g + r * 8;
                        const unsigned int keep = draw.keep_pairs<NT>(drop_sh[3], row, drop_sh[5] + n0 + 2 * t);
#pragma unroll
                        for (int j = 0; j < NT; ++j) {
                            if (!((keep >> (2 * j)) & 1u)) s[mt][j][2 * r] = 0.f;
                            if (!((keep >> (2 * j)) & 2u)) s[mt][j][2 * r + 1] = 0.f;
                        }
                    }
#pragma unroll
                    for (int i = 0; i < DT; ++i) {
                        o[mt][i][2 * r] *= alpha;
                        o[mt][i][2 * r + 1] *= alpha;
                    }
                }
            }

            // O += P V: P from the S accumulators (C layout = A layout in pairs of n-tiles); each
            // V fragment pair feeds MT m-tiles.
            const unsigned int vw = sVa + (buf * BN + sub * BNC) * VROW_BYTES + v_off;
#pragma unroll
            for (int kk = 0; kk < BNC / 16; ++kk) {
                unsigned int a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    a[mt][0] = pack_pair(s[mt][2 * kk][0], s[mt][2 * kk][1], T{});
                    a[mt][1] = pack_pair(s[mt][2 * kk][2], s[mt][2 * kk][3], T{});
                    a[mt][2] = pack_pair(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1], T{});
                    a[mt][3] = pack_pair(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3], T{});
                }
#pragma unroll
                for (int dt = 0; dt < DV / 16; ++dt) {
                    unsigned int r[4];
                    ldmatrix_x4_trans(r, (vw ^ (dt << 5)) + kk * 16 * VROW_BYTES);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816<T>(o[mt][2 * dt], a[mt], r[0], r[1]);
                        mma_16816<T>(o[mt][2 * dt + 1], a[mt], r[2], r[3]);
                    }
                }
            }
        }
        __syncthreads();  // the next iteration's loads overwrite the buffer read here
    }
    cp_async_wait<0>();   // (no copy may be in flight at exit, e.g. with no key tile)

    // Normalize, write O and the log-sum-exp.
    const int q0 = cu_q ? cu_q[b] : 0;   // (a faulty document returned before its loads)
    T* og = out + (cu_q ? q0 * o_ss : b * o_sb) + h * o_sh;
    const long long lse_at = cu_q ? static_cast<long long>(h) * Sq + q0 : (static_cast<long long>(b) * H + h) * Sq;
    const float sink_log2 = sink_log2_of(sinks, h);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = row_sum[mt][r];
            butterfly<1, 2>(Sum{}, sum);   // over the row's quad, offset 1 first
            float inv, row_lse;
            finish_row(row_max[mt][r], sum, sink_log2, inv, row_lse);
            if constexpr (DROPOUT) inv *= drop_rescale;
            const int row = m0 + tile_row(mt) + g + r * 8;
            if (row < sq) {
                T* orow = og + static_cast<long long>(row) * o_ss;
#pragma unroll
                for (int i = 0; i < DT; ++i)
                    *reinterpret_cast<unsigned int*>(orow + i * 8 + 2 * t) =
                        pack_pair(o[mt][i][2 * r] * inv, o[mt][i][2 * r + 1] * inv, T{});
                if (lse && t == 0)
                    lse[lse_at + row] = row_lse;
            }
        }
    }
}

template <typename T, int D, int DV, int WARPS, int MT, int BN, int BNC, bool QREG, int MASK, bool SOFTCAP,
          bool DROPOUT, int SMEM>
__global__ void __launch_bounds__(WARPS * 32, 1) attention_fwd(
    const __grid_constant__ cuk::attention::FwdParams<T> p)
{
    const cuk::attention::Problem& r = p.problem;
    attention_fwd_body<T, D, DV, WARPS, MT, BN, BNC, QREG, MASK, SOFTCAP, DROPOUT, SMEM>(
        p.q, p.k, p.v, p.out, p.lse, p.sinks, p.q_sb, p.q_ss, p.q_sh, p.k_sb, p.k_ss, p.k_sh, p.v_sb, p.v_ss, p.v_sh,
        p.o_sb, p.o_ss, p.o_sh, r.H, r.Hkv, r.Sq, r.Sk, r.scale_log2, r.win_left, r.win_right, r.cap_in,
        r.cap_out, r.cu_q, r.cu_k, r.max_q, r.max_k, r.fault, p.drop_rng, p.drop_threshold, p.drop_rescale);
}
