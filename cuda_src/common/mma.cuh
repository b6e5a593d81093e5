// Tensor-core and asynchronous-copy primitives of sm_80+ as inline PTX: cp.async (16 and 4 bytes,
// zero-filled past the end of the data), ldmatrix (x4, plain and transposed), and
// mma.sync m16n8k16 with float32 accumulators for bf16 and fp16 operands.
//
// Fragment layouts of m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16x16, row-major) a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
//   B (16x8, "col")      b0: (k 2t..2t+1, n g)   b1: (k 2t+8.., n g)
//   C (16x8, float32)    c0,c1: (g, 2t..2t+1)    c2,c3: (g+8, 2t..2t+1)
#pragma once
#include "dtype.cuh"

namespace cuk {

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes global -> shared; when !valid, writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 16 : 0));
}
// Copies 4 bytes global -> shared (through L1); when !valid, writes 4 zero bytes.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// (shared-space byte addresses, for address arithmetic that stays in 32 bits)
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], unsigned int addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], unsigned int addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}

// c += a * b for one m16n8k16 tile. (One asm text for both element types: the macro only
// fills in the PTX type name, which must be part of the string literal.)
#define CUK_MMA_16816_ASM(TYPE)                                                                    \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0, %1, %2, %3}, " \
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                                \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned int (&a)[4], unsigned int b0,
                                          unsigned int b1);
template <>
__device__ __forceinline__ void mma_16816<bf16>(float (&c)[4], const unsigned int (&a)[4],
                                                unsigned int b0, unsigned int b1) {
    CUK_MMA_16816_ASM("bf16");
}
template <>
__device__ __forceinline__ void mma_16816<half>(float (&c)[4], const unsigned int (&a)[4],
                                                unsigned int b0, unsigned int b1) {
    CUK_MMA_16816_ASM("f16");
}
#undef CUK_MMA_16816_ASM

}  // namespace cuk
