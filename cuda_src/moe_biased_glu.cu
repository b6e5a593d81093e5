// Biased experts with a clamped gate (GPT-OSS's), the parts around the grouped products: the
// gate on the up projection's output with its bias added, the gate's backward, a bias added to
// each expert's rows, and each expert's rows summed (the biases' gradients).
//
// Rows are grouped by expert as the grouped products take them: expert e's rows are
// offsets[e]:offsets[e + 1], the rows after offsets[E] get no bias (and no sum). A warp takes a
// row and finds its expert by a binary search of the offsets (in [0, E] whatever the offsets
// hold: never a read outside the bias). The up projection's output h (R, 2I) holds the gate's and
// the up projection's columns interleaved (g0, u0, g1, u1, ...), as GPT-OSS's weights do; a
// thread takes 8 of them (4 pairs) at a time. Everything is computed in float32 from h rounded
// to its dtype plus the bias (float32 or h's dtype), as autocast's float32 bias add does, and
// rounded once.
//
// The gate: g = min(h_g, limit), u = clamp(h_u, -limit, limit), z = (u + 1) g sigmoid(alpha g).
// A clamp passes the gradient where its input is within its bounds, ends included, and a NaN
// passes through the forward and stops the gradient, as torch.clamp does.
#include "common/dtype.cuh"
#include "common/moe_groups.cuh"
#include "common/vec.cuh"

namespace cuk {
namespace moe_glu {

// The expert of row r: e with offsets[e] <= r < offsets[e + 1], or E after offsets[E].
__device__ __forceinline__ int row_expert(const int* __restrict__ offsets, int experts, long long r) {
    int lo = 0, hi = experts;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (offsets[mid + 1] <= r) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Eight values as float32 (a float32 bias: two 16-byte loads).
template <typename B>
__device__ __forceinline__ void load8(const B* __restrict__ p, float (&f)[8]) {
    if constexpr (sizeof(B) == 4) {
        const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    } else {
        unpack(load_vec<B, 8>(p), f);
    }
}

__device__ __forceinline__ float clamp_max(float v, float limit) { return v > limit ? limit : v; }
__device__ __forceinline__ float clamp_both(float v, float limit) {
    return v < -limit ? -limit : v > limit ? limit : v;
}
__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

}  // namespace moe_glu
}  // namespace cuk

// z (R, I) = the gate of h (R, 2I) + bias[expert of the row] (E, 2I).
template <typename T, typename B, int THREADS>
__global__ void __launch_bounds__(THREADS) moe_biased_glu(
    const T* __restrict__ h, const B* __restrict__ bias, const int* __restrict__ offsets, T* __restrict__ z,
    int rows, int inter, int experts, float alpha, float limit)
{
    using namespace cuk;
    const int lane = threadIdx.x & 31;
    const long long r = static_cast<long long>(blockIdx.x) * (THREADS / 32) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int e = moe_glu::row_expert(offsets, experts, r);
    const T* hr = h + r * 2 * inter;
    const B* br = bias + static_cast<long long>(e) * 2 * inter;
    T* zr = z + r * inter;
    for (int v = lane; v < inter / 4; v += 32) {
        float x[8], b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, o[4];
        unpack(load_vec<T, 8>(hr + 8 * v), x);
        if (e < experts) moe_glu::load8(br + 8 * v, b);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float g = moe_glu::clamp_max(x[2 * j] + b[2 * j], limit);
            const float u = moe_glu::clamp_both(x[2 * j + 1] + b[2 * j + 1], limit);
            o[j] = (u + 1.f) * g * moe_glu::sigmoid(alpha * g);
        }
        store_vec<T, 4>(zr + 4 * v, pack<T, 4>(o));
    }
}

// dh (R, 2I), interleaved as h: the gate's backward from dz (R, I).
template <typename T, typename B, int THREADS>
__global__ void __launch_bounds__(THREADS) moe_biased_glu_bwd(
    const T* __restrict__ dz, const T* __restrict__ h, const B* __restrict__ bias, const int* __restrict__ offsets,
    T* __restrict__ dh, int rows, int inter, int experts, float alpha, float limit)
{
    using namespace cuk;
    const int lane = threadIdx.x & 31;
    const long long r = static_cast<long long>(blockIdx.x) * (THREADS / 32) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int e = moe_glu::row_expert(offsets, experts, r);
    const T* hr = h + r * 2 * inter;
    const B* br = bias + static_cast<long long>(e) * 2 * inter;
    for (int v = lane; v < inter / 4; v += 32) {
        float x[8], b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, d[4], o[8];
        unpack(load_vec<T, 8>(hr + 8 * v), x);
        unpack(load_vec<T, 4>(dz + r * inter + 4 * v), d);
        if (e < experts) moe_glu::load8(br + 8 * v, b);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float hg = x[2 * j] + b[2 * j], hu = x[2 * j + 1] + b[2 * j + 1];
            const float g = moe_glu::clamp_max(hg, limit), u = moe_glu::clamp_both(hu, limit);
            const float s = moe_glu::sigmoid(alpha * g);
            o[2 * j] = hg <= limit ? d[j] * (u + 1.f) * (s + alpha * g * s * (1.f - s)) : 0.f;
            o[2 * j + 1] = hu >= -limit && hu <= limit ? d[j] * g * s : 0.f;
        }
        store_vec<T, 8>(dh + r * 2 * inter + 8 * v, pack<T, 8>(o));
    }
}

// out (R, N) = y + bias[expert of the row] (E, N), in float32 and rounded once (the rows after
// the last expert: y's).
template <typename T, typename B, int THREADS>
__global__ void __launch_bounds__(THREADS) moe_group_bias(
    const T* __restrict__ y, const B* __restrict__ bias, const int* __restrict__ offsets, T* __restrict__ out,
    int rows, int cols, int experts)
{
    using namespace cuk;
    const int lane = threadIdx.x & 31;
    const long long r = static_cast<long long>(blockIdx.x) * (THREADS / 32) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int e = moe_glu::row_expert(offsets, experts, r);
    const B* br = bias + static_cast<long long>(e) * cols;
    for (int v = lane; v < cols / 8; v += 32) {
        float x[8], b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        unpack(load_vec<T, 8>(y + r * cols + 8 * v), x);
        if (e < experts) moe_glu::load8(br + 8 * v, b);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] += b[j];
        store_vec<T, 8>(out + r * cols + 8 * v, pack<T, 8>(x));
    }
}

// out (E, N) float32: expert e's rows of x (R, N) summed, in a fixed order (the same bits every
// call). A block takes one expert and 256 columns: its warps take every WARPS-th row, and the
// first warp adds their sums in warp order. An expert without rows gets zeros.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS) moe_group_sums(
    const T* __restrict__ x, const int* __restrict__ offsets, float* __restrict__ out, int rows, int cols,
    int experts)
{
    using namespace cuk;
    constexpr int WARPS = THREADS / 32;
    __shared__ float part[WARPS][32 * 8 + 4];   // (+4: a warp's rows start on other banks)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, e = blockIdx.y;
    const int col = (blockIdx.x * 32 + lane) * 8;
    int lo, hi;
    moe_groups::group_rows(offsets, e, experts, rows, nullptr, lo, hi);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (col < cols) {
        for (int r = lo + warp; r < hi; r += WARPS) {
            float f[8];
            unpack(load_vec<T, 8>(x + static_cast<long long>(r) * cols + col), f);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] += f[j];
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) part[warp][lane * 8 + j] = acc[j];
    __syncthreads();
    if (warp != 0 || col >= cols) return;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float s = part[0][lane * 8 + j];
        for (int w = 1; w < WARPS; ++w) s += part[w][lane * 8 + j];
        acc[j] = s;
    }
    float4* o = reinterpret_cast<float4*>(out + static_cast<long long>(e) * cols + col);
    o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}
