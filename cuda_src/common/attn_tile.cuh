// Shared-memory tiles of the attention kernels (forward and backward): the XOR swizzle, the
// cp.async tile loader and ldmatrix lane offsets (cuk::attention; cuk::fast_exp2 and
// cuk::neg_inf are in reduce.cuh).
#pragma once
#include "dtype.cuh"
#include "mma.cuh"

namespace cuk {
namespace attention {

// Shared-memory row length (elements) for head dim D: a power of two of at least 64 elements
// (8 chunks of 16 bytes), so that the XOR swizzle below stays inside the row and a row's start
// has no bit in common with a k-step's swizzle (addresses are (row start + lane) ^ (kk << 5));
// D = 32, 96 and 192 are padded.
__host__ __device__ constexpr int row_elems(int D) {
    int r = 64;
    while (r < D) r *= 2;
    return r;
}

// Element offset of (r, c) in a tile of ROW-element rows whose 16-byte chunks are
// XOR-permuted by row, so that ldmatrix's 8 row addresses of one column fall in 8 different
// bank groups.
template <int ROW>
__device__ __forceinline__ int swz(int r, int c) {
    return r * ROW + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7);
}

// cp.async of a ROWS x D tile into ROW-element swizzled rows: rows row0 .. row0+ROWS-1 of a
// (rows x D) matrix with the given row stride; rows at or past `nrows` are zero-filled (the
// padding columns D .. ROW of a row are never read). Fast path: a thread moves chunk column
// c of rows r0, r0 + RSTEP, ... — its swizzle key (row & 7) is the same for all of them when
// RSTEP is a multiple of 8, so the shared addresses are affine and one global pointer is live.
template <typename T, int ROWS, int D, int ROW, int THREADS>
__device__ __forceinline__ void load_tile(T* smem, const T* g, long long row_stride, int row0, int nrows) {
    constexpr int CPR = D / 8;  // 16-byte chunks a row
    if constexpr (THREADS % CPR == 0 && (THREADS / CPR) % 8 == 0 && ROWS % (THREADS / CPR) == 0) {
        constexpr int RSTEP = THREADS / CPR;
        const int r0 = threadIdx.x / CPR, c = (threadIdx.x % CPR) * 8;
        const T* p = g + static_cast<long long>(row0 + r0) * row_stride + c;
        T* dst = smem + swz<ROW>(r0, c);
#pragma unroll
        for (int j = 0; j < ROWS / RSTEP; ++j) {
            const bool ok = row0 + r0 + j * RSTEP < nrows;
            cp_async_16(dst + j * RSTEP * ROW, ok ? p : g, ok);
            p += RSTEP * row_stride;
        }
    } else {
#pragma unroll
        for (int i = threadIdx.x; i < ROWS * CPR; i += THREADS) {
            const int r = i / CPR, c = (i % CPR) * 8;
            const bool ok = row0 + r < nrows;
            cp_async_16(smem + swz<ROW>(r, c), ok ? g + static_cast<long long>(row0 + r) * row_stride + c : g, ok);
        }
    }
}

// dst[0..1] += (a, b) in global memory, no return value (one vector reduction on sm_90).
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(dst), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

__device__ __forceinline__ unsigned int pack_pair(float lo, float hi, bf16) { return pack2(lo, hi, bf16{}); }
__device__ __forceinline__ unsigned int pack_pair(float lo, float hi, half) { return pack2(lo, hi, half{}); }

// Byte offsets of this lane's ldmatrix row address within a tile of ROW_BYTES-byte rows, for
// k-step (or n-step) 0; step kk is (offset ^ (kk << 5)) (a lane's swizzle key, row & 7, is
// lane & 7 in every 8-row group, so the XOR commutes with whole-row offsets).
//   a_offset: A operands (rows = M, 16 columns = k) and transposed B operands (rows = k).
//   b_offset: B operands stored as [n][k] (rows = n, 16 columns = k).
__device__ __forceinline__ unsigned int a_offset(int lane, int row_bytes) {
    const int lo = lane % 8;
    return (lo + ((lane / 8) % 2) * 8) * row_bytes + (((lane / 16) ^ lo) << 4);
}
__device__ __forceinline__ unsigned int b_offset(int lane, int row_bytes) {
    const int lo = lane % 8;
    return (lo + (lane / 16) * 8) * row_bytes + ((((lane / 8) % 2) ^ lo) << 4);
}

}  // namespace attention
}  // namespace cuk

