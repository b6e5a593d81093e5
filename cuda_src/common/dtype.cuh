// Storage types and float32 conversion for the three element types cukern supports.
//
// Naming convention of cuda_src (one NVRTC program per family: every name shares one scope):
//  * Shared device helpers and types (common/*.cuh) live in namespace cuk: cuk::bf16,
//    cuk::to_float, cuk::Vec, cuk::GroupReduce, cuk::mma_16816, cuk::record_fault, ...
//  * A family's private helpers live in namespace cuk::<family> (cuk::group_norm,
//    cuk::attention).
//  * Kernels (__global__ templates) stay at global scope under their own names, since the
//    Python fronts ask for them by name expression ("norm_fwd<cuk::bf16, ...>"); a kernel
//    opens the namespaces it uses with a using-directive inside its body, never at file scope.
//  * Macros are prefixed CUK_ (and #undef'd after use where they are local to a header).
//
// Kept free of <cuda_fp16.h>/<cuda_bf16.h> on purpose: the sources must compile under NVRTC
// with no include paths (CI compiles them on a machine with no CUDA toolkit headers), and all
// arithmetic is done in float32 anyway. Conversions use the PTX cvt instructions of sm_80+.
#pragma once

namespace cuk {

struct half { unsigned short bits; };
struct bf16 { unsigned short bits; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) {
    return __uint_as_float(static_cast<unsigned int>(v.bits) << 16);  // exact
}
__device__ __forceinline__ float to_float(half v) {
    // Through a 32-bit operand: with a 16-bit ("h") operand ptxas was seen to spill 4 bytes.
    float f;
    asm("{.reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo;}"
        : "=f"(f) : "r"(static_cast<unsigned int>(v.bits)));
    return f;
}

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float f) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));  // round to nearest even
    return r;
}
template <> __device__ __forceinline__ half from_float<half>(float f) {
    half r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
    return r;
}

// Two 16-bit elements in one 32-bit word (the lower address in the low half), to float32
// and back with the paired cvt of sm_80+ (round to nearest even, as from_float).
__device__ __forceinline__ void unpack2(unsigned int w, float& lo, float& hi, bf16) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack2(unsigned int w, float& lo, float& hi, half) {
    asm("{.reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi) : "r"(w));
}
// One of the two (hi: the upper one), as unpack2 gives it.
__device__ __forceinline__ float half_of_word(unsigned int w, bool hi, bf16) {
    return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16));
}
__device__ __forceinline__ float half_of_word(unsigned int w, bool hi, half) {
    float f;
    if (hi) asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(w));
    else asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l;}" : "=f"(f) : "r"(w));
    return f;
}
__device__ __forceinline__ unsigned int pack2(float lo, float hi, bf16) {
    unsigned int w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));  // first operand -> high half
    return w;
}
__device__ __forceinline__ unsigned int pack2(float lo, float hi, half) {
    unsigned int w;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
}

// A value rounded to T and read back (exact for float): the intermediate roundings of the
// norms' casting modes.
template <typename T>
__device__ __forceinline__ float round_to(float f) { return to_float(from_float<T>(f)); }

// ---- fp8 (OCP FP8: E4M3 "fn", no infinities; E5M2), written only --------------------------------
// From float32: round to nearest even, saturating to the largest finite value (infinities
// too, as cvt's .satfinite), NaN to NaN (0x7f). sm_89+ has the conversion in hardware; sm_80
// takes fp8_bits_soft, which gives the same bits (a GPU test compares the two on every
// boundary).
struct fp8e4m3 { unsigned char bits; };
struct fp8e5m2 { unsigned char bits; };

template <typename F> struct Fp8Format;
template <> struct Fp8Format<fp8e4m3> {   // bias 7, 3 mantissa bits, largest 448
    static constexpr int MANT = 3, BIAS = 7;
    static constexpr float MAX = 448.f, MIN_NORMAL = 0.015625f /* 2^-6 */, SUB_STEPS = 512.f /* 2^9 */;
};
template <> struct Fp8Format<fp8e5m2> {   // bias 15, 2 mantissa bits, largest 57344
    static constexpr int MANT = 2, BIAS = 15;
    static constexpr float MAX = 57344.f, MIN_NORMAL = 6.103515625e-05f /* 2^-14 */, SUB_STEPS = 65536.f;
};

template <typename F>
__device__ __forceinline__ unsigned int fp8_bits_soft(float f) {
    using Fmt = Fp8Format<F>;
    const unsigned int sign = (__float_as_uint(f) >> 24) & 0x80u;
    const float a = fabsf(f);
    if (a != a) return 0x7fu;
    const float s = fminf(a, Fmt::MAX);
    unsigned int r;
    if (s < Fmt::MIN_NORMAL) {   // subnormal: a multiple of the smallest step (the top one, 2^-6 or 2^-14, is the first normal's code)
        r = static_cast<unsigned int>(__float2int_rn(s * Fmt::SUB_STEPS));
    } else {                     // the float's exponent and top mantissa bits, rounded to nearest even
        constexpr int DROP = 23 - Fmt::MANT;
        unsigned int b = __float_as_uint(s);
        b += (1u << (DROP - 1)) - 1u + ((b >> DROP) & 1u);
        r = (b >> DROP) - ((127u - Fmt::BIAS) << Fmt::MANT);
    }
    return r | sign;
}

// Two values to two fp8 codes in 16 bits (lo at the lower address). SOFT: the sm_80 code on
// any GPU (what the GPU test compares).
template <typename F, bool SOFT = false>
__device__ __forceinline__ unsigned int pack_fp8x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if constexpr (!SOFT) {
        unsigned short r;
        if constexpr (Fp8Format<F>::MANT == 3)
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
        else
            asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
        return r;
    }
#endif
    return fp8_bits_soft<F>(lo) | (fp8_bits_soft<F>(hi) << 8);
}

template <> __device__ __forceinline__ fp8e4m3 from_float<fp8e4m3>(float f) {
    return {static_cast<unsigned char>(pack_fp8x2<fp8e4m3>(f, 0.f) & 0xffu)};
}
template <> __device__ __forceinline__ fp8e5m2 from_float<fp8e5m2>(float f) {
    return {static_cast<unsigned char>(pack_fp8x2<fp8e5m2>(f, 0.f) & 0xffu)};
}

template <typename T> struct is_fp8 { static constexpr bool value = false; };
template <> struct is_fp8<fp8e4m3> { static constexpr bool value = true; };
template <> struct is_fp8<fp8e5m2> { static constexpr bool value = true; };

}  // namespace cuk
