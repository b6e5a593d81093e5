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
// float32 x (Qwen3's rope takes its QK-norm's float32 result under autocast): PyTorch's separate
// products and sum, each rounded; a contracted fma would round once less.
template <typename T, bool BWD, bool PROMOTED>
__device__ __forceinline__ void rotate_pair(float xl, float xh, float cl, float ch, float sl, float sh,
                                            float& ol, float& oh) {
    if constexpr (!BWD && (PROMOTED || sizeof(T) == 4)) {
        ol = round_to<T>(__fsub_rn(__fmul_rn(xl, cl), __fmul_rn(xh, sl)));
        oh = round_to<T>(__fadd_rn(__fmul_rn(xh, ch), __fmul_rn(xl, sh)));
    } else if constexpr (BWD && sizeof(T) == 4) {
        ol = __fadd_rn(__fmul_rn(xl, cl), __fmul_rn(xh, sh));
        oh = __fsub_rn(__fmul_rn(xh, ch), __fmul_rn(xl, sl));
    } else if constexpr (!BWD) {
        ol = round_to<T>(round_to<T>(xl * cl) - round_to<T>(xh * sl));
        oh = round_to<T>(round_to<T>(xh * ch) + round_to<T>(xl * sh));
    } else {
        ol = round_to<T>(round_to<T>(xl * cl) + round_to<T>(xh * sh));
        oh = round_to<T>(round_to<T>(xh * ch) - round_to<T>(xl * sl));
    }
}

// Pairs of 16-bit values in a 32-bit word, with one fma.rn a pair (sm_80+), for T tables with
// 16-bit T: a product rounded once to T (x * c - 0) and a sum or difference of two T values
// rounded once (p2 * +-1 + p1) are what PyTorch's float32 arithmetic followed by a rounding to T
// gives (a product of two T values is exact in float32; a sum is exact in float32 unless its
// operands are more than 16 binades apart, and then it lies far from any midpoint of T). (Below
// 2^-126, in bfloat16's subnormals, PyTorch's float32 product is itself rounded first and can
// land one unit away; the float32 path here flushes those to zero.) 1.5 instructions an output
// element against ~8 for the float32 round trips (ncu: the kernel was 78% issue-bound, Liger's
// in-place Triton kernel 13%; docs/notes-rope.md).
template <typename T> __device__ __forceinline__ unsigned int fma2(unsigned int a, unsigned int b, unsigned int c);
template <> __device__ __forceinline__ unsigned int fma2<bf16>(unsigned int a, unsigned int b, unsigned int c) {
    unsigned int d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
template <> __device__ __forceinline__ unsigned int fma2<half>(unsigned int a, unsigned int b, unsigned int c) {
    unsigned int d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
template <typename T> __device__ __forceinline__ unsigned int mul2(unsigned int a, unsigned int b) {
    return fma2<T>(a, b, 0x80008000u);   // + (-0, -0): the product's own sign when it is zero
}
// (lo, hi) words of +-1: one is 0x3f80 in bfloat16 and 0x3c00 in float16; the sign bit 0x8000
template <typename T> __device__ __forceinline__ constexpr unsigned int one16();
template <> __device__ __forceinline__ constexpr unsigned int one16<bf16>() { return 0x3f80u; }
template <> __device__ __forceinline__ constexpr unsigned int one16<half>() { return 0x3c00u; }
template <typename T> __device__ __forceinline__ unsigned int signs2(bool lo_neg, bool hi_neg) {
    return (one16<T>() | (lo_neg ? 0x8000u : 0u)) | ((one16<T>() | (hi_neg ? 0x8000u : 0u)) << 16);
}
// A vector's 32-bit words and back
template <typename T, int N>
__device__ __forceinline__ void to_words(const Vec<T, N>& v, unsigned int (&w)[N / 2]) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) w[i] = reinterpret_cast<const unsigned int*>(&v)[i];
}
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> from_words(const unsigned int (&w)[N / 2]) {
    Vec<T, N> v;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) reinterpret_cast<unsigned int*>(&v)[i] = w[i];
    return v;
}
__device__ __forceinline__ unsigned int swap_halves(unsigned int w) { return __byte_perm(w, 0, 0x1032); }

// A vector of x (VEC 16-bit elements, VEC / 2 words) rotated with same-dtype tables.
// Half-split: xl, cl, sl the lo vectors and xh, ch, sh the hi ones; interleaved: pairs in words
// (xl the vector, xh unused).
template <typename T, bool INTERLEAVED, bool BWD, int W>
__device__ __forceinline__ void rotate_words(unsigned int (&xl)[W], unsigned int (&xh)[W], const unsigned int (&cl)[W],
                                             const unsigned int (&ch)[W], const unsigned int (&sl)[W],
                                             const unsigned int (&sh)[W]) {
#pragma unroll
    for (int i = 0; i < W; ++i) {
        if constexpr (INTERLEAVED) {
            // fwd: (x0 c0 - x1 s0, x1 c1 + x0 s1); bwd: (x0 c0 + x1 s1, x1 c1 - x0 s0)
            const unsigned int cross = BWD ? swap_halves(mul2<T>(xl[i], sl[i])) : mul2<T>(swap_halves(xl[i]), sl[i]);
            xl[i] = fma2<T>(cross, signs2<T>(!BWD, BWD), mul2<T>(xl[i], cl[i]));
        } else {
            // fwd: lo = xl cl - xh sl, hi = xh ch + xl sh; bwd: lo = xl cl + xh sh, hi = xh ch - xl sl
            const unsigned int lo = fma2<T>(mul2<T>(xh[i], BWD ? sh[i] : sl[i]), signs2<T>(!BWD, !BWD),
                                            mul2<T>(xl[i], cl[i]));
            const unsigned int hi = fma2<T>(mul2<T>(xl[i], BWD ? sl[i] : sh[i]), signs2<T>(BWD, BWD),
                                            mul2<T>(xh[i], ch[i]));
            xl[i] = lo;
            xh[i] = hi;
        }
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
        if constexpr (sizeof(T) == 2 && !PROMOTED && VEC % 2 == 0) {
            constexpr int W = VEC / 2;
            unsigned int xl[W], xh[W], cl[W], ch[W], sl[W], sh[W];
            to_words<T, VEC>(load_vec<T, VEC>(x + j), xl);
            to_words<T, VEC>(load_vec<C, VEC>(c + j), cl);
            to_words<T, VEC>(load_vec<C, VEC>(sn + j), sl);
            if constexpr (!INTERLEAVED) {
                to_words<T, VEC>(load_vec<T, VEC>(x + j + D / 2), xh);
                to_words<T, VEC>(load_vec<C, VEC>(c + j + D / 2), ch);
                to_words<T, VEC>(load_vec<C, VEC>(sn + j + D / 2), sh);
            }
            rotate_words<T, INTERLEAVED, BWD, W>(xl, xh, cl, ch, sl, sh);
            store_vec<T, VEC>(o + j, from_words<T, VEC>(xl));
            if constexpr (!INTERLEAVED) store_vec<T, VEC>(o + j + D / 2, from_words<T, VEC>(xh));
        } else if constexpr (INTERLEAVED) {
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
