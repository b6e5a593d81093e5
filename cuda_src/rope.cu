// Rotary position embedding of queries and keys, forward and backward, in the half-split
// layout (GPT-NeoX, Hugging Face's LLaMA / Mistral: pairs (j, j + D/2)) or interleaved (GPT-J,
// Meta's LLaMA: pairs (2i, 2i + 1)).
//
// With cos and sin given for every element of a position's row (D values, as Hugging Face's
// rotary embedding makes them), the forward is  out = x * cos + rotate(x) * sin  with
// rotate(x)[lo] = -x[hi], rotate(x)[hi] = x[lo] for each pair (lo, hi); the backward is the
// transpose:  dx[lo] = g[lo] cos[lo] + g[hi] sin[hi],  dx[hi] = g[hi] cos[hi] - g[lo] sin[lo].
// Numerics are PyTorch eager's for that expression in the input dtype T: each product rounded
// to T, then their sum (three roundings; the backward's likewise, as autograd does). float32
// rounds nothing extra.
//
// One block a (batch, position): its rows of q (HQ heads) and k (HK heads), D elements each;
// cos / sin rows are read once a block (they stay in L1). q, k, dq, dk may have any strides
// but a unit one along D; outputs take their own strides (the plan makes them like the inputs').
#include "common/dtype.cuh"
#include "common/vec.cuh"

namespace cuk {
namespace rope {

// One pair: (lo, hi) of x to the outputs, with the cos / sin of both elements.
// PROMOTED: float32 cos and sin with 16-bit x, as Hugging Face's models under autocast call it:
// PyTorch promotes the forward's products to float32 (each rounded, then their sum) and the
// caller's autocast rounds the result once to the 16-bit dtype; the backward's per-term
// roundings (to x's dtype, where autograd casts each gradient) are the same as unpromoted.
template <typename T, bool BWD, bool PROMOTED>
__device__ __forceinline__ void rotate_pair(float xl, float xh, float cl, float ch, float sl, float sh,
                                            float& ol, float& oh) {
    if constexpr (!BWD && PROMOTED) {
        ol = round_to<T>(__fsub_rn(__fmul_rn(xl, cl), __fmul_rn(xh, sl)));
        oh = round_to<T>(__fadd_rn(__fmul_rn(xh, ch), __fmul_rn(xl, sh)));
    } else if constexpr (!BWD) {
        ol = round_to<T>(round_to<T>(xl * cl) - round_to<T>(xh * sl));
        oh = round_to<T>(round_to<T>(xh * ch) + round_to<T>(xl * sh));
    } else {
        ol = round_to<T>(round_to<T>(xl * cl) + round_to<T>(xh * sh));
        oh = round_to<T>(round_to<T>(xh * ch) - round_to<T>(xl * sl));
    }
}

// VEC elements of a cos / sin table as float32, in loads of at most 16 bytes.
template <typename C, int VEC>
__device__ __forceinline__ void load_table(const C* __restrict__ p, float (&f)[VEC]) {
    constexpr int PIECE = (VEC * (int)sizeof(C) > 16) ? 16 / (int)sizeof(C) : VEC;
#pragma unroll
    for (int i = 0; i < VEC / PIECE; ++i) {
        float part[PIECE];
        unpack(load_vec<C, PIECE>(p + i * PIECE), part);
#pragma unroll
        for (int e = 0; e < PIECE; ++e) f[i * PIECE + e] = part[e];
    }
}

}  // namespace rope
}  // namespace cuk

// x (q, then k): rows [0, HQ) of q and [0, HK) of k at position (b, s) = blockIdx.x / S, % S.
// cos / sin: (CB, S, D) with CB 1 or B (cos_b: 0 for a shared table). VEC elements a thread step
// (a vector of lo elements and one of hi ones for half-split; pairs inside the vector when
// interleaved).
template <typename T, typename C, bool INTERLEAVED, bool BWD, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS) rope_apply(
    const T* __restrict__ q, long long q_sb, long long q_sh, long long q_ss,
    const T* __restrict__ k, long long k_sb, long long k_sh, long long k_ss,
    const C* __restrict__ cos, const C* __restrict__ sin, long long cs_sb, long long cs_ss,
    T* __restrict__ q_out, long long qo_sb, long long qo_sh, long long qo_ss,
    T* __restrict__ k_out, long long ko_sb, long long ko_sh, long long ko_ss,
    int S, int HQ, int HK, int D)
{
    using namespace cuk;
    using namespace cuk::rope;
    const long long b = blockIdx.x / S;
    const long long s = blockIdx.x % S;
    constexpr bool PROMOTED = sizeof(C) > sizeof(T);
    const C* c = cos + b * cs_sb + s * cs_ss;
    const C* sn = sin + b * cs_sb + s * cs_ss;
    // steps a row: vectors of lo elements (half-split) or of whole pairs (interleaved)
    const int per_row = INTERLEAVED ? D / VEC : D / 2 / VEC;
    const int total = (HQ + HK) * per_row;
    for (int t = threadIdx.x; t < total; t += THREADS) {
        const int row = t / per_row;
        const int j = (t - row * per_row) * VEC;
        const bool is_q = row < HQ;
        const int h = is_q ? row : row - HQ;
        const T* x = is_q ? q + b * q_sb + h * q_sh + s * q_ss : k + b * k_sb + h * k_sh + s * k_ss;
        T* o = is_q ? q_out + b * qo_sb + h * qo_sh + s * qo_ss : k_out + b * ko_sb + h * ko_sh + s * ko_ss;
        if constexpr (INTERLEAVED) {
            float xv[VEC], cv[VEC], sv[VEC];
            unpack(load_vec<T, VEC>(x + j), xv);
            load_table<C, VEC>(c + j, cv);
            load_table<C, VEC>(sn + j, sv);
#pragma unroll
            for (int i = 0; i < VEC; i += 2) {
                float lo, hi;
                rotate_pair<T, BWD, PROMOTED>(xv[i], xv[i + 1], cv[i], cv[i + 1], sv[i], sv[i + 1], lo, hi);
                xv[i] = lo;
                xv[i + 1] = hi;
            }
            store_vec<T, VEC>(o + j, pack<T, VEC>(xv));
        } else {
            const int half = D / 2;
            float xl[VEC], xh[VEC], cl[VEC], ch[VEC], sl[VEC], sh[VEC];
            unpack(load_vec<T, VEC>(x + j), xl);
            unpack(load_vec<T, VEC>(x + j + half), xh);
            load_table<C, VEC>(c + j, cl);
            load_table<C, VEC>(c + j + half, ch);
            load_table<C, VEC>(sn + j, sl);
            load_table<C, VEC>(sn + j + half, sh);
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                float lo, hi;
                rotate_pair<T, BWD, PROMOTED>(xl[i], xh[i], cl[i], ch[i], sl[i], sh[i], lo, hi);
                xl[i] = lo;
                xh[i] = hi;
            }
            store_vec<T, VEC>(o + j, pack<T, VEC>(xl));
            store_vec<T, VEC>(o + j + half, pack<T, VEC>(xh));
        }
    }
}
