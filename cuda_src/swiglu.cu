// Gated linear units of transformer MLPs: y = act(gate) * up, forward and backward, with act
// SiLU (SwiGLU: LLaMA, Mistral) or GELU, exact or tanh (GeGLU: Gemma).
//
// Elementwise over rows: gate and up are (rows, cols) with row strides of their own (so the two
// halves of one fused projection, (rows, 2 * cols), are read in place); y, dgate and dup are
// contiguous. A block of THREADS threads takes 1 << (log2(THREADS) - TPR_LOG2) rows, each with
// 1 << TPR_LOG2 threads striding over the row's vectors of VEC elements: no division an element.
// Where every array is dense (no row stride of its own), the _flat kernels take one vector a
// thread over the whole array instead: as fast as torch.compile's kernels, where the row loop
// ran 2-3% behind them (docs/notes-swiglu.md).
//
// Numerics follow PyTorch's eager code for act(gate) * up in the input dtype T: act(gate) is
// computed in float32 and rounded to T (the activation's own output), then multiplied by up in
// float32 and rounded once more. The backward rounds where autograd through those two ops
// does: dup = T(dy * T(act(gate))), dgate = T(T(dy * up) * act'(gate)). Activations in float32
// with the formulas of PyTorch's CUDA kernels (expf, erff, tanhf: no fast-math approximations).
// For float32 inputs every rounding is the identity.
#include "common/dtype.cuh"
#include "common/vec.cuh"

namespace cuk {
namespace swiglu {

enum Act { SILU = 0, GELU = 1, GELU_TANH = 2 };

constexpr float SQRT1_2 = 0.70710678118654752440f;        // 1 / sqrt(2)
constexpr float GELU_PDF = 0.39894228040143267794f;       // 1 / sqrt(2 pi)
constexpr float TANH_BETA = 0.79788456080286535588f;      // sqrt(2 / pi)
constexpr float TANH_KAPPA = 0.044715f;

template <int ACT>
__device__ __forceinline__ float act(float x) {
    if constexpr (ACT == SILU) {
        return x / (1.f + expf(-x));
    } else if constexpr (ACT == GELU) {
        return x * 0.5f * (1.f + erff(x * SQRT1_2));
    } else {
        const float inner = TANH_BETA * (x + TANH_KAPPA * (x * x * x));
        return 0.5f * x * (1.f + tanhf(inner));
    }
}

// d act / dx at x.
template <int ACT>
__device__ __forceinline__ float act_grad(float x) {
    if constexpr (ACT == SILU) {
        const float s = 1.f / (1.f + expf(-x));
        return s * (1.f + x * (1.f - s));
    } else if constexpr (ACT == GELU) {
        const float cdf = 0.5f * (1.f + erff(x * SQRT1_2));
        const float pdf = expf(-0.5f * x * x) * GELU_PDF;
        return cdf + x * pdf;
    } else {
        const float x2 = x * x;
        const float t = tanhf(TANH_BETA * (x + TANH_KAPPA * (x2 * x)));
        const float left = 0.5f * x;
        const float right = 1.f + t;
        return 0.5f * right + left * (1.f - t * t) * (TANH_BETA * (1.f + 3.f * TANH_KAPPA * x2));
    }
}

// One vector of VEC elements, at element `at` of each array, the forward: y = T(T(act(gate)) * up).
template <typename T, int ACT, int VEC>
__device__ __forceinline__ void glu_fwd_vector(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y,
                                               long long at) {
    float a[VEC], b[VEC];
    unpack(load_vec<T, VEC>(g + at), a);
    unpack(load_vec<T, VEC>(u + at), b);
#pragma unroll
    for (int j = 0; j < VEC; ++j) a[j] = round_to<T>(act<ACT>(a[j])) * b[j];
    store_vec<T, VEC>(y + at, pack<T, VEC>(a));
}

// ... and the backward: dgate = T(T(dy * up) * act'(gate)), dup = T(dy * T(act(gate))).
template <typename T, int ACT, int VEC>
__device__ __forceinline__ void glu_bwd_vector(const T* __restrict__ dy, const T* __restrict__ g,
                                               const T* __restrict__ u, T* __restrict__ dgate,
                                               T* __restrict__ dup, long long at) {
    float d[VEC], a[VEC], b[VEC];
    unpack(load_vec<T, VEC>(dy + at), d);
    unpack(load_vec<T, VEC>(g + at), a);
    unpack(load_vec<T, VEC>(u + at), b);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const float x = a[j];
        a[j] = round_to<T>(d[j] * b[j]) * act_grad<ACT>(x);   // dgate
        b[j] = d[j] * round_to<T>(act<ACT>(x));              // dup
    }
    store_vec<T, VEC>(dgate + at, pack<T, VEC>(a));
    store_vec<T, VEC>(dup + at, pack<T, VEC>(b));
}

}  // namespace swiglu
}  // namespace cuk

// y = T(T(act(gate)) * up), a row at a time.
template <typename T, int ACT, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS) glu_fwd(
    const T* __restrict__ gate, long long gate_stride,
    const T* __restrict__ up, long long up_stride,
    T* __restrict__ y, long long rows, int cols, int tpr_log2)
{
    using namespace cuk;
    using namespace cuk::swiglu;
    const int lane = threadIdx.x & ((1 << tpr_log2) - 1);
    const long long row = static_cast<long long>(blockIdx.x) * (THREADS >> tpr_log2) + (threadIdx.x >> tpr_log2);
    if (row >= rows) return;
    const int nvec = cols / VEC;
    const T* g = gate + row * gate_stride;
    const T* u = up + row * up_stride;
    T* out = y + row * cols;
#pragma unroll 4
    for (int v = lane; v < nvec; v += 1 << tpr_log2) glu_fwd_vector<T, ACT, VEC>(g, u, out, v * VEC);
}

// dgate = T(T(dy * up) * act'(gate)), dup = T(dy * T(act(gate))); dy contiguous.
template <typename T, int ACT, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS) glu_bwd(
    const T* __restrict__ dy,
    const T* __restrict__ gate, long long gate_stride,
    const T* __restrict__ up, long long up_stride,
    T* __restrict__ dgate, T* __restrict__ dup, long long rows, int cols, int tpr_log2)
{
    using namespace cuk;
    using namespace cuk::swiglu;
    const int lane = threadIdx.x & ((1 << tpr_log2) - 1);
    const long long row = static_cast<long long>(blockIdx.x) * (THREADS >> tpr_log2) + (threadIdx.x >> tpr_log2);
    if (row >= rows) return;
    const int nvec = cols / VEC;
    const T* g = gate + row * gate_stride;
    const T* u = up + row * up_stride;
    const long long base = row * cols;
#pragma unroll 2
    for (int v = lane; v < nvec; v += 1 << tpr_log2)
        glu_bwd_vector<T, ACT, VEC>(dy + base, g, u, dgate + base, dup + base, v * VEC);
}

// glu_fwd over dense arrays: vector v of n / VEC, one a thread.
template <typename T, int ACT, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS) glu_fwd_flat(
    const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ y, long long nvec)
{
    using namespace cuk;
    using namespace cuk::swiglu;
    const long long v = static_cast<long long>(blockIdx.x) * THREADS + threadIdx.x;
    if (v >= nvec) return;
    glu_fwd_vector<T, ACT, VEC>(gate, up, y, v * VEC);
}

// glu_bwd over dense arrays, likewise.
template <typename T, int ACT, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS) glu_bwd_flat(
    const T* __restrict__ dy, const T* __restrict__ gate, const T* __restrict__ up,
    T* __restrict__ dgate, T* __restrict__ dup, long long nvec)
{
    using namespace cuk;
    using namespace cuk::swiglu;
    const long long v = static_cast<long long>(blockIdx.x) * THREADS + threadIdx.x;
    if (v >= nvec) return;
    glu_bwd_vector<T, ACT, VEC>(dy, gate, up, dgate, dup, v * VEC);
}
