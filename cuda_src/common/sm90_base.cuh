// Hopper (sm_90a) primitives as inline PTX, the common part: CUK_SM90A (a kernel body built for
// sm_90a alone), the driver's tensor map, shared-memory addresses, stmatrix and 1024-byte
// alignment. The features are in sm90_barriers.cuh (mbarriers, named barriers, setmaxnreg, the
// load ring), sm90_tma.cuh (TMA loads, stores and reductions) and sm90_wgmma.cuh (warpgroup
// matrix products); hopper.cuh includes them all.
#pragma once
#include "dtype.cuh"

// (a kernel body built for sm_90a alone: wgmma and setmaxnreg are not in plain sm_90)
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUK_SM90A 1
#else
#define CUK_SM90A 0
#endif
// (a kernel body is `#if CUK_SM90A ... #elif defined(__CUDA_ARCH__) __trap(); #endif`: built
// for another architecture it traps rather than return an unwritten output)


// The driver's tensor map (cuTensorMapEncodeTiled), passed by value: const __grid_constant__.
struct alignas(64) CUtensorMap {
    unsigned long long opaque[16];
};

namespace cuk {

__device__ __forceinline__ unsigned int shared_address(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 b16 matrices in mma's accumulator-fragment layout (register k: matrix k, this lane's
// row lane / 4, columns 2 (lane % 4), +1) stored to shared memory; lane l gives the address of row
// l % 8 of matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(void* p, const unsigned int (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(shared_address(p)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// The same with each matrix transposed on its way: lane l's address is that of row l % 8 of
// matrix l / 8 as stored, which holds the matrix's column l % 8 (a tile of the accumulators stored
// as its transpose, as S's P is stored as P^T).
__device__ __forceinline__ void stmatrix_x4_trans(void* p, const unsigned int (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(shared_address(p)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// The first 1024-byte boundary at or after p (dynamic shared memory, for 128-byte-swizzled
// tiles; the launch gives 1 KB of slack).
__device__ __forceinline__ unsigned char* align_1024(unsigned char* p) {
    return p + ((1024 - (shared_address(p) & 1023)) & 1023);
}
}  // namespace cuk
