// A self-check of the fp8 conversions of common/dtype.cuh (cuk::pack_fp8x2): the hardware cvt of
// sm_89+ and the code sm_80 runs in its place (SOFT), both runnable on any GPU, so that the
// tests compare each with ml_dtypes bit for bit on a Hopper GPU (the sm_80 code included).
#include "common/dtype.cuh"

// y[2i], y[2i + 1] = fp8 codes of x[2i], x[2i + 1], for i < pairs.
template <typename F, bool SOFT>
__global__ void __launch_bounds__(256) fp8_convert(
    const float* __restrict__ x, unsigned char* __restrict__ y, long long pairs)
{
    const long long i = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
    if (i < pairs) {
        const unsigned int r = cuk::pack_fp8x2<F, SOFT>(x[2 * i], x[2 * i + 1]);
        y[2 * i] = static_cast<unsigned char>(r & 0xffu);
        y[2 * i + 1] = static_cast<unsigned char>(r >> 8);
    }
}
