// Fixed-order sums of float32 partial rows: the last, deterministic step of every weight
// gradient (norms, GroupNorm). Partial rows are written by the families' backward kernels.
#include "common/dtype.cuh"

// Sums `nparts` float32 partial rows of width `cols` into `out` (T), in a fixed order:
// thread (tx, ty) of a 32x8 block sums parts ty, ty+8, ... of column blockIdx.x*32+tx, then
// the eight slices are added in order of ty. Same bits on every run for the same nparts.
// Two gradients in one launch (dweight and dbias: one launch less a backward call): blocks
// with blockIdx.y = 1 sum the next nparts rows into `out2`.
template <typename T>
__global__ void __launch_bounds__(256) sum_partial_rows(
    const float* __restrict__ part, int nparts, int cols, T* __restrict__ out, T* __restrict__ out2)
{
    using namespace cuk;
    __shared__ float slice[8][33];
    if (blockIdx.y) {
        part += static_cast<long long>(nparts) * cols;
        out = out2;
    }
    const int col = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.f;
    if (col < cols) {
        for (int p = threadIdx.y; p < nparts; p += 8) acc += part[static_cast<long long>(p) * cols + col];
    }
    slice[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < cols) {
        float t = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) t += slice[k][threadIdx.x];
        out[col] = from_float<T>(t);
    }
}
