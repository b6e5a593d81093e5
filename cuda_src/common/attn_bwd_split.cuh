// The Hopper backward kernel that splits a step's products between two computing warpgroups
// (attention_bwd_sm90_d256): a block of 64 keys walks query tiles of 64 rows; warpgroup 1
// computes dP^T = V dO^T and hands it to warpgroup 0 in float32 through shared memory, warpgroup
// 0 computes S^T = K Q^T, makes P^T and dS^T of it and stores both as T for the
// products that read them. Both accumulator tiles are 64 keys x 64 queries in the wgmma layout
// (common/sm90_wgmma.cuh): this thread's keys key0 and key0 + 8, queries m0 + 8 j + 2 t (+1).
#pragma once
#include "dtype.cuh"
#include "reduce.cuh"
#include "hopper.cuh"
#include "attn_mask.cuh"
#include "attn_params.cuh"

namespace cuk {
namespace attention {

// (the helpers take the thread's coordinates as the kernels have them: tid = threadIdx.x % 128,
// lane, warp (of the warpgroup), t = lane % 4, and the problem's sq and sk)

// (warpgroup 1) dP^T to warpgroup 0 through `dp_x` ([8][128 threads] float4), thread for thread
// (the same accumulator layout), once warpgroup 0 has read step it - 1's (dp_free); then dp_full.
__device__ __forceinline__ void hand_over_dpt(const float (&s)[32], float4* dp_x, unsigned long long* dp_full,
                                              unsigned long long* dp_free, int it, int tid) {
    if (it > 0) mbarrier_wait(dp_free, (it - 1) & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) dp_x[i * 128 + tid] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
    mbarrier_arrive(dp_full);
}

// (warpgroup 0) P^T from S^T in `s` (0 for queries past sq and hidden keys), packed into `pa`;
// then dS^T = P^T (dP^T - Dsum) in `s` and packed into `dsa`, dP^T read from warpgroup 1's
// hand-over of step it (dp_full; dp_free once read). The softcap's P^T = exp2(c log2(e) t -
// lse_log2) with t = tanh(s scale / c), its dS^T times 1 - t^2. `lrow`, `drow`: the step's
// lse_log2 and Dsum a query.
template <typename T, int MASK, bool SOFTCAP>
__device__ __forceinline__ void p_and_ds(float (&s)[32], unsigned int (&pa)[4][4], unsigned int (&dsa)[4][4],
                                         const float* lrow, const float* drow, const float4* dp_x,
                                         unsigned long long* dp_full, unsigned long long* dp_free, int it,
                                         const KeyMask<MASK>& km, const Problem& r, int sq, int sk, int key0, int m0,
                                         int n0, int tid, int t) {
    constexpr int BM = 64, BN = 64;
    const bool edge = m0 + BM > sq || km.edge(n0, BN, m0, BM, sk);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float2 l = *reinterpret_cast<const float2*>(lrow + 8 * j + 2 * t);
        float pp[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float u = 1.f, x;
            if constexpr (SOFTCAP) {
                const float th = tanh_approx(s[4 * j + e] * r.cap_in);
                x = fmaf(th, r.cap_out, -(e & 1 ? l.y : l.x));
                u = 1.f - th * th;
            } else {
                x = fmaf(s[4 * j + e], r.scale_log2, -(e & 1 ? l.y : l.x));
            }
            float pe = fast_exp2(x);
            const int key = key0 + (e >> 1) * 8, q = m0 + 8 * j + 2 * t + (e & 1);
            if (edge & ((q >= sq) | km.hidden_bits(q, key, sk))) pe = 0.f;
            pp[e] = pe;
            s[4 * j + e] = pe * u;
        }
        pa[j / 2][2 * (j % 2)] = pack2(pp[0], pp[1], T{});
        pa[j / 2][2 * (j % 2) + 1] = pack2(pp[2], pp[3], T{});
    }
    mbarrier_wait(dp_full, it & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float4 dp = dp_x[i * 128 + tid];
        const float2 d = *reinterpret_cast<const float2*>(drow + 8 * i + 2 * t);   // (float4 i: column block i)
        s[4 * i] *= dp.x - d.x;
        s[4 * i + 1] *= dp.y - d.y;
        s[4 * i + 2] *= dp.z - d.x;
        s[4 * i + 3] *= dp.w - d.y;
    }
    mbarrier_arrive(dp_free);
    accumulators_to_a<T>(s, dsa);
}

// (warpgroup 0) P^T and dS^T into `pt_s` and `dst_s` (64 key rows x 128 bytes each) as TMA would
// store them (128-byte swizzle: chunk c of key row r at c ^ (r % 8)), once the products of step
// it - 1 that read them are done (ps_free); by stmatrix (lane l addresses row l % 8 of matrix
// l / 8: query chunk j + (l / 8) / 2, rows 8 ((l / 8) % 2) on); fenced for the async proxy, then
// ps_full.
__device__ __forceinline__ void publish_p_ds(unsigned char* pt_s, unsigned char* dst_s, const unsigned int (&pa)[4][4],
                                             const unsigned int (&dsa)[4][4], unsigned long long* ps_full,
                                             unsigned long long* ps_free, int it, int lane, int warp) {
    if (it > 0) mbarrier_wait(ps_free, (it - 1) & 1);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
        const int mat = lane / 8, jj = j + mat / 2, row = warp * 16 + 8 * (mat % 2) + lane % 8;
        const int at = row * 128 + ((jj ^ (lane % 8)) << 4);
        stmatrix_x4(pt_s + at, pa[j / 2]);
        stmatrix_x4(dst_s + at, dsa[j / 2]);
    }
    fence_proxy_async();
    mbarrier_arrive(ps_full);
}

}  // namespace attention
}  // namespace cuk
