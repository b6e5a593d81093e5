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

}  // namespace cuk
