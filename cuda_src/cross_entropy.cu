// Cross-entropy over rows of logits with integer targets, forward and backward.
//
// A row is one token: logits x (V values, unit stride), target t. With softcap c > 0 the
// softmax sees z = c * tanh(x / c), else z = x. Per row that is not ignored:
//   lse  = log(sum_j exp(z_j))
//   loss = lse - (1 - eps) * z_t - (eps / V) * sum_j z_j + zl * lse^2     (eps: label smoothing,
//                                                                         zl: z-loss weight)
//   dz_j = p_j * (1 + 2 zl lse) - eps / V - (1 - eps) [j == t],  p_j = exp(z_j - lse)
//   dx_j = g * dz_j * (1 - (z_j / c)^2)   (the last factor with softcap only),
// g the row's share of the upstream gradient. Ignored rows (t == ignore_index) have loss 0 and
// a zero gradient; a target outside [0, V) is recorded as a fault and the row is ignored.
//
// cross_entropy_rows runs a block a row: pass 1 streams the row once (online softmax, a term
// one FFMA and one exp2 on a float32 base; the sum of z for label smoothing), reduces it over
// the block and writes the row's loss and lse; pass 2 (MODE 1, the training form, and MODE 2,
// the backward from a saved lse) streams the row again and writes the gradient. The logits and
// the gradient may be one buffer (the in-place training form): pass 2 reads each element before
// the same thread writes it, and the block's reduction separates the passes, so neither
// pointer is restrict.
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "common/reduce.cuh"
#include "common/fault.cuh"
#include "common/cluster.cuh"
#include "common/mma.cuh"

// The training form on sm_90 splits a row over a cluster of C CTAs (below: the kernel's template
// parameter C; above 8 the kernel must be allowed the non-portable size, as the front does).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CUK_CE_CLUSTER_DIMS __cluster_dims__(C, 1, 1)
#else
#define CUK_CE_CLUSTER_DIMS
#endif

namespace cuk {
namespace cross_entropy {

constexpr long long FAULT_TARGET = 2;   // the fault record's kind (cukern/_faults.py)

// The online-softmax state of a set of logits: m = the largest (in natural units), l = the sum of
// 2^(z * log2 e - b) over them, b = m * log2 e rounded to float32 (b_of). Each term is one FFMA and
// one exp2 (fmaf(z, LOG2E, -b) rounds once, so z - m stays exact to float32 at any |z|: a base
// kept in log2 units and subtracted after rounding z * log2 e lost its ulp, 0.13% at |z| ~ 1e4),
// and every thread, CTA and pass derives the same b from the same m.
__device__ __forceinline__ float b_of(float m) { return __fmul_rn(m, LOG2E); }   // (never contracted into an FMA)

struct NaturalMerge {
    __device__ static SoftmaxState identity() { return SoftmaxState::empty(); }
    __device__ __forceinline__ SoftmaxState operator()(SoftmaxState a, SoftmaxState b) const {
        const float m = fmaxf(a.m, b.m);
        const float bu = b_of(m == neg_inf() ? 0.f : m);   // (both empty: no (-inf) - (-inf))
        return {m, a.l * fast_exp2(b_of(a.m) - bu) + b.l * fast_exp2(b_of(b.m) - bu)};
    }
};

// Compile-time options of a row's loops, chosen once a kernel by a uniform branch (with_options):
// softcapping and label smoothing add work an element that the common case does not pay.
template <bool B> struct Flag { static constexpr bool value = B; };

template <typename F>
__device__ __forceinline__ void with_options(bool cap, bool smooth, F&& f) {
    if (cap) {
        if (smooth) f(Flag<true>{}, Flag<true>{}); else f(Flag<true>{}, Flag<false>{});
    } else {
        if (smooth) f(Flag<false>{}, Flag<true>{}); else f(Flag<false>{}, Flag<false>{});
    }
}

// The logit the softmax sees.
__device__ __forceinline__ float capped(float x, float cap, float inv_cap) {
    return cap > 0.f ? cap * tanhf(x * inv_cap) : x;
}

// The row's target, or -1 when the row is ignored (an out-of-range target is recorded).
template <typename IT>
__device__ __forceinline__ long long row_target(const IT* target, long long row, long long V,
                                                long long ignore_index, long long* fault, bool record) {
    const long long t = static_cast<long long>(target[row]);
    if (t == ignore_index) return -1;
    if (t < 0 || t >= V) {
        if (record) record_fault(fault, t, V, FAULT_TARGET);
        return -1;
    }
    return t;
}

// U vectors of a row, THREADS * VEC columns apart from column c0 on, as float32 (their loads
// issued together, for the bytes in flight; those past V are left unset).
template <typename T, int VEC, int U, int THREADS>
__device__ __forceinline__ void load_step(const T* x, long long c0, long long V, float (&f)[U][VEC]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const long long c = c0 + static_cast<long long>(u) * THREADS * VEC;
        if (c < V) unpack(load_vec<T, VEC>(x + c), f[u]);
    }
}

// A kept row's loss from its lse, its target's logit and (label smoothing) the sum of its logits.
__device__ __forceinline__ float row_loss(float lse, float zt, float sz, float smoothing, float eps_v, float z_loss) {
    float loss = lse - (1.f - smoothing) * zt + z_loss * lse * lse;
    if (smoothing > 0.f) loss -= eps_v * sz;
    return loss;
}

// One vector of a row into the online-softmax state and (SMOOTH) the sum of z: the logits are
// softcapped in place (CAP); the state is rescaled once a vector, then one FFMA and one exp2 an
// element.
template <bool CAP, bool SMOOTH, int VEC>
__device__ __forceinline__ void add_vector(SoftmaxState& st, float& sz, float (&f)[VEC], float softcap,
                                           float inv_cap) {
    float top = neg_inf();
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        if (CAP) f[j] = capped(f[j], softcap, inv_cap);
        if (SMOOTH) sz += f[j];
        top = fmaxf(top, f[j]);
    }
    if (top > st.m) {
        st.l *= fast_exp2(b_of(st.m) - b_of(top));   // (m = -inf: 2^-inf = 0)
        st.m = top;
    }
    if (st.m != neg_inf()) {
        const float b = b_of(st.m);
#pragma unroll
        for (int j = 0; j < VEC; ++j) st.l += fast_exp2(fmaf(f[j], LOG2E, -b));   // (NaN in, NaN out)
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) if (f[j] != f[j]) st.l = f[j];  // NaN among -infs
    }
}

// The gradient of a row, an element: dx = (p * ga - geps - [j == t] ghit) * (1 - (z / c)^2) (the
// last factor with softcap), p * l = 2^(z log2 e - hi - lo): g, 1 / l and the z-loss factor folded
// into ga, g into geps and ghit. hi + lo is the base in log2 units: b_of(m) and 0 after a forward
// pass, or a saved lse times log2 e split into a float and its rounding error (exact).
struct GradTerms {
    float hi, lo, ga, geps, ghit, softcap, inv_cap;
    long long t;   // the target (< 0: the row is ignored; its gradient is zero)

    __device__ static GradTerms make(float hi, float lo, float inv_l, float a, float eps_v, float smoothing,
                                     float g, float softcap, float inv_cap, long long t) {
        return {hi, lo, g * a * inv_l, g * eps_v, g * (1.f - smoothing), softcap, inv_cap, t};
    }
};

// One vector of logits f (columns c ..) into its gradient, in place (the row is not ignored).
// Returns whether the target's column is in the vector; its gradient, which differs by the hit
// term, is then in `at_target`, for the caller to store over the vector's (modifying f itself
// there made the compiler split the vector's store into scalar ones).
template <bool CAP, int VEC>
__device__ __forceinline__ bool grad_vector(float (&f)[VEC], long long c, const GradTerms& k, float& at_target) {
    const long long jt = k.t - c;
    const bool hit = jt >= 0 && jt < VEC;   // (checked once a vector)
    at_target = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const float z = CAP ? capped(f[j], k.softcap, k.inv_cap) : f[j];
        const float dz = fmaf(fast_exp2(fmaf(z, LOG2E, -k.hi) - k.lo), k.ga, -k.geps);
        const float cap_factor = CAP ? 1.f - (z * k.inv_cap) * (z * k.inv_cap) : 1.f;
        if (hit && j == jt) at_target = (dz - k.ghit) * cap_factor;
        f[j] = dz * cap_factor;
    }
    return hit;
}

}  // namespace cross_entropy
}  // namespace cuk

// MODE 0: loss (and lse) only. MODE 1: loss and gradient (upstream gradient 1). MODE 2: the
// gradient from the saved lse and the upstream gradient dloss (a scalar, dloss_stride 0, or a
// value a row, stride 1), rounded once.
//   loss_rows: float32 a row (0 for ignored rows); lse: float32 a row, written in MODEs 0 and
//   1 when not null, read in MODE 2; dloss: of the loss's dtype DT (float32 in MODEs 0 and 1,
//   where it is null); count: the number of rows not ignored (reduction "mean": the gradient is
//   divided by it), or null.
//   unit (MODE 2, or null): the gradient the training form wrote for an upstream gradient of 1,
//   laid out as dlogits. A row whose upstream gradient is exactly 1 takes it as it is (copied,
//   or left alone where dlogits is unit itself); any other row is computed from the logits, so
//   that the upstream gradient is applied before the one rounding, not after it.
template <typename T, typename IT, int VEC, int THREADS, int MODE, typename DT>
__global__ void __launch_bounds__(THREADS, 2) cross_entropy_rows(
    const T* logits, long long x_stride, const IT* __restrict__ target, long long rows, long long V,
    long long ignore_index, float smoothing, float z_loss, float softcap,
    float* __restrict__ loss_rows, float* lse, const DT* __restrict__ dloss, long long dloss_stride,
    const float* __restrict__ count, const T* unit, T* dlogits, long long d_stride, long long* fault)
{
    using namespace cuk;
    using namespace cuk::cross_entropy;
    static_assert(THREADS >= 64 && THREADS <= 1024 && (THREADS & (THREADS - 1)) == 0, "THREADS");
    using MergeState = GroupReduce<THREADS, 1, SoftmaxState>;
    using SumF = GroupReduce<THREADS, 1, float>;
    __shared__ typename MergeState::TempStorage merge_tmp;
    __shared__ typename SumF::TempStorage sum_tmp;
    constexpr int U = VEC >= 8 ? 2 : 4;   // (two blocks an SM: 64 registers)
    constexpr long long STEP = static_cast<long long>(U) * THREADS * VEC;
    const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
    const float eps_v = smoothing / static_cast<float>(V);

    // (a loss that is not scaled, the common case, costs the read of its gradient alone)
    if (MODE == 2 && unit == dlogits && dloss_stride == 0 && to_float(dloss[0]) == 1.f) return;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        if constexpr (MODE == 2) {
            if (unit && to_float(dloss[row * dloss_stride]) == 1.f) {
                if (unit != dlogits) {
                    for (long long c = static_cast<long long>(threadIdx.x) * VEC; c < V; c += THREADS * VEC)
                        store_vec_global<T, VEC>(dlogits + row * d_stride + c,
                                                 load_vec<T, VEC>(unit + row * d_stride + c));
                }
                continue;
            }
        }
        const T* x = logits + row * x_stride;
        const long long t = row_target(target, row, V, ignore_index, fault, MODE != 2 && threadIdx.x == 0);
        float row_lse, base, inv_l = 1.f;
        if constexpr (MODE == 2) {
            row_lse = base = lse[row];
        } else {
            SoftmaxState st = SoftmaxState::empty();
            float sz = 0.f;
            with_options(softcap > 0.f, smoothing > 0.f, [&](auto cap, auto smooth) {
                // U vectors a thread a step, their loads issued together (bytes in flight)
                for (long long c0 = static_cast<long long>(threadIdx.x) * VEC; c0 < V; c0 += STEP) {
                    float f[U][VEC];
                    load_step<T, VEC, U, THREADS>(x, c0, V, f);
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        if (c0 + static_cast<long long>(u) * THREADS * VEC < V) {
                            add_vector<decltype(cap)::value, decltype(smooth)::value>(st, sz, f[u], softcap, inv_cap);
                        }
                    }
                }
            });
            // (the target's logit is read before the reduction's barriers: in place, pass 2 may
            // overwrite it right after them)
            const float zt = (threadIdx.x == 0 && t >= 0) ? capped(to_float(x[t]), softcap, inv_cap) : 0.f;
            SoftmaxState sv[1] = {st};
            MergeState::reduce(sv, merge_tmp, NaturalMerge{});
            float s[1] = {sz};
            if (smoothing > 0.f) SumF::sum(s, sum_tmp);
            row_lse = sv[0].m + log2f(sv[0].l) * 0.6931471805599453f;
            base = sv[0].m;   // (pass 2: p = 2^(z log2 e - b_of(m)) / l, as pass 1 summed it)
            inv_l = 1.f / sv[0].l;
            if (threadIdx.x == 0) {
                const float loss = t >= 0 ? row_loss(row_lse, zt, s[0], smoothing, eps_v, z_loss) : 0.f;
                if (loss_rows) loss_rows[row] = loss;
                if (lse) lse[row] = row_lse;
            }
        }
        if constexpr (MODE != 0) {
            T* d = dlogits + row * d_stride;
            if (t < 0) {   // (an ignored row's gradient is zero, whatever its logits)
                for (long long c = static_cast<long long>(threadIdx.x) * VEC; c < V; c += THREADS * VEC) {
                    float f[VEC] = {};
                    store_vec_global<T, VEC>(d + c, pack<T, VEC>(f));
                }
                continue;
            }
            float g = dloss ? to_float(dloss[row * dloss_stride]) : 1.f;
            if (count) g /= *count;
            // the base in log2 units: b_of(m) after pass 1; a saved lse split into hi + lo exactly
            const float hi = b_of(base);
            const float lo = MODE == 2 && isfinite(hi) ? fmaf(base, LOG2E, -hi) : 0.f;
            const GradTerms k = GradTerms::make(hi, lo, inv_l, 1.f + 2.f * z_loss * row_lse, eps_v, smoothing, g,
                                                softcap, inv_cap, t);
            auto gradient = [&](auto cap) {
                for (long long c0 = static_cast<long long>(threadIdx.x) * VEC; c0 < V; c0 += STEP) {
                    float f[U][VEC];
                    load_step<T, VEC, U, THREADS>(x, c0, V, f);
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const long long c = c0 + static_cast<long long>(u) * THREADS * VEC;
                        if (c < V) {
                            float at_target;
                            const bool hit = grad_vector<decltype(cap)::value>(f[u], c, k, at_target);
                            store_vec_global<T, VEC>(d + c, pack<T, VEC>(f[u]));
                            if (hit) d[t] = from_float<T>(at_target);   // (after the vector: program order)
                        }
                    }
                }
            };
            if (softcap > 0.f) gradient(Flag<true>{}); else gradient(Flag<false>{});
        }
    }
}

// The number of rows whose target is not ignore_index and in range: one block, fixed order.
template <typename IT, int THREADS>
__global__ void __launch_bounds__(THREADS) cross_entropy_count(
    const IT* __restrict__ target, long long rows, long long V, long long ignore_index, float* __restrict__ count)
{
    using namespace cuk;
    using SumF = GroupReduce<THREADS, 1, float>;
    __shared__ typename SumF::TempStorage tmp;
    float n = 0.f;   // (exact below 2^24 a thread)
    for (long long r = threadIdx.x; r < rows; r += THREADS) {
        const long long t = static_cast<long long>(target[r]);
        n += (t != ignore_index && t >= 0 && t < V) ? 1.f : 0.f;
    }
    float v[1] = {n};
    SumF::sum(v, tmp);
    if (threadIdx.x == 0) *count = v[0];
}

// The reduced loss: the sum of the rows' losses in a fixed order, divided by count for
// "mean" (0 / 0 = NaN when every row is ignored, as PyTorch's), in the loss's dtype T.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS) cross_entropy_reduce(
    const float* __restrict__ loss_rows, long long rows, const float* __restrict__ count, T* __restrict__ out)
{
    using namespace cuk;
    using SumF = GroupReduce<THREADS, 1, float>;
    __shared__ typename SumF::TempStorage tmp;
    float s = 0.f;
    for (long long r = threadIdx.x; r < rows; r += THREADS) s += loss_rows[r];
    float v[1] = {s};
    SumF::sum(v, tmp);
    if (threadIdx.x == 0) out[0] = from_float<T>(count ? v[0] / *count : v[0]);
}

// The per-row losses (reduction "none") in a loss dtype other than float32.
template <typename T>
__global__ void __launch_bounds__(256) cross_entropy_cast(const float* __restrict__ src, long long n, T* __restrict__ dst)
{
    using namespace cuk;
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n; i += gridDim.x * 256LL) dst[i] = from_float<T>(src[i]);
}

// dst = src * g a row, g = dloss[row * dloss_stride] (the loss's dtype DT), rounded once to
// dst's dtype T: the upstream gradient applied to a gradient kept unrounded (src float32, S)
// for an upstream gradient of 1 (the linear cross-entropy's). dst may be src (S = T); then rows
// whose g is exactly 1 are left as they are (a loss that is not scaled costs a read of g).
template <typename S, typename T, typename DT, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS) cross_entropy_scale(
    const S* src, T* dst, long long rows, long long V, long long stride,
    const DT* __restrict__ dloss, long long dloss_stride)
{
    using namespace cuk;
    const bool in_place = static_cast<const void*>(src) == static_cast<const void*>(dst);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float g = to_float(dloss[row * dloss_stride]);
        if (g == 1.f && in_place) {
            if (dloss_stride == 0) return;
            continue;
        }
        for (long long c = static_cast<long long>(threadIdx.x) * VEC; c < V; c += THREADS * VEC) {
            float f[VEC];
            unpack(load_vec<S, VEC>(src + row * stride + c), f);
#pragma unroll
            for (int j = 0; j < VEC; ++j) f[j] *= g;
            store_vec<T, VEC>(dst + row * stride + c, pack<T, VEC>(f));
        }
    }
}

// The training form reading the logits once (sm_90): a row is split over a cluster of
// C CTAs, each holding its part of the row in registers (NV vectors a thread). Each CTA
// reduces its part to an online-softmax state (and the sum of z for label smoothing), publishes
// it in its shared memory, and after one cluster barrier every CTA merges the C states
// in rank order (the same result in each) and writes its part of the gradient from registers.
// The states are double-buffered by row parity, so one barrier a row suffices: a CTA can
// overwrite a buffer only after the next row's barrier, which its peers pass only once they
// have read it. Same arguments and results as cross_entropy_rows in MODE 1 (dloss null).
// STAGE: the part is staged in shared memory by cp.async instead of registers (no registers hold
// it, so more CTAs fit an SM: six of 256 threads against four); each thread reads back only the
// vectors it copied, so no barrier separates the copy from the use.
// The kernel is short of the memory floor by its CTAs' lives more than by its arithmetic: its
// gradient stores are explicit 16-byte stores (the compiler had split one vector's into pieces)
// and a CTA leaves without waiting for them (docs/notes-cross-entropy.md, v3).
template <typename T, typename IT, int VEC, int THREADS, int NV, int C, int STAGE>
__global__ void __launch_bounds__(THREADS, (STAGE ? 1536 : 1024) / THREADS) CUK_CE_CLUSTER_DIMS cross_entropy_train_cluster(
    const T* logits, long long x_stride, const IT* __restrict__ target, long long rows, long long V,
    long long ignore_index, float smoothing, float z_loss, float softcap,
    float* __restrict__ loss_rows, float* lse, const float* __restrict__ count,
    T* dlogits, long long d_stride, long long* fault)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using namespace cuk;
    using namespace cuk::cross_entropy;
    static_assert(C >= 2 && C <= 16 && (C & (C - 1)) == 0, "C: 2 to 16 CTAs, a power of two");
    using MergeState = GroupReduce<THREADS, 1, SoftmaxState>;
    using SumF = GroupReduce<THREADS, 1, float>;
    __shared__ typename MergeState::TempStorage merge_tmp;
    __shared__ typename SumF::TempStorage sum_tmp;
    __shared__ float part[2][3];   // this CTA's (m, l, sum z), by row parity
    __shared__ float whole[3];     // the row's merged state
    __shared__ __align__(16) uint4 stage[STAGE ? NV * THREADS : 1];
    const unsigned int rank = cluster_rank();
    const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
    const float eps_v = smoothing / static_cast<float>(V);
    const long long per = ((V + C - 1) / C + VEC - 1) / VEC * VEC;   // columns a CTA (the front: <= THREADS*NV*VEC)
    const long long c_begin = rank * per;
    const long long c_end = c_begin + per < V ? c_begin + per : V;
    int parity = 0;
    for (long long row = cluster_index(); row < rows; row += cluster_count(), parity ^= 1) {
        const T* x = logits + row * x_stride;
        const long long t = row_target(target, row, V, ignore_index, fault, rank == 0 && threadIdx.x == 0);
        // (the target's logit is loaded with the row, not after it: its latency then overlaps
        // the row's instead of delaying rank 0 on the way to the barrier; and before the barrier:
        // in place, a peer may overwrite it right after)
        const float xt = (rank == 0 && threadIdx.x == 0 && t >= 0) ? to_float(x[t]) : 0.f;
        Vec<T, VEC> v[STAGE ? 1 : NV];
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            const long long c = c_begin + (static_cast<long long>(i) * THREADS + threadIdx.x) * VEC;
            if (STAGE && c < c_end) {   // (slots past the part are never read: no copy at all)
                cp_async_16(&stage[i * THREADS + threadIdx.x], x + c, true);
            } else if (!STAGE && c < c_end) {
                v[STAGE ? 0 : i] = load_vec<T, VEC>(x + c);
            }
        }
        if (STAGE) {
            cp_async_commit();
            cp_async_wait<0>();
        }
        // (vector i of this thread's part)
        auto part_of = [&](int i) -> Vec<T, VEC> {
            return STAGE ? *reinterpret_cast<const Vec<T, VEC>*>(&stage[i * THREADS + threadIdx.x]) : v[STAGE ? 0 : i];
        };
        SoftmaxState st = SoftmaxState::empty();
        float sz = 0.f;
        with_options(softcap > 0.f, smoothing > 0.f, [&](auto cap, auto smooth) {
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const long long c = c_begin + (static_cast<long long>(i) * THREADS + threadIdx.x) * VEC;
                if (c < c_end) {
                    float f[VEC];
                    unpack(part_of(i), f);
                    add_vector<decltype(cap)::value, decltype(smooth)::value>(st, sz, f, softcap, inv_cap);
                }
            }
        });
        const float zt = capped(xt, softcap, inv_cap);
        SoftmaxState sv[1] = {st};
        MergeState::reduce(sv, merge_tmp, NaturalMerge{});
        float s[1] = {sz};
        if (smoothing > 0.f) SumF::sum(s, sum_tmp);
        if (threadIdx.x == 0) {
            part[parity][0] = sv[0].m;
            part[parity][1] = sv[0].l;
            part[parity][2] = s[0];
        }
        cluster_sync();
        if (threadIdx.x < 32) {   // lanes 0..C-1 fetch one CTA's state each, then merge in a fixed tree
            SoftmaxState p = SoftmaxState::empty();
            float q = 0.f;
            if (threadIdx.x < C) {
                p = {load_peer(&part[parity][0], threadIdx.x), load_peer(&part[parity][1], threadIdx.x)};
                q = load_peer(&part[parity][2], threadIdx.x);
            }
            SoftmaxState pv[1] = {p};
            float qv[1] = {q};
            butterfly<C / 2, 1>(NaturalMerge{}, pv);
            butterfly<C / 2, 1>(Sum{}, qv);
            if (threadIdx.x == 0) {
                whole[0] = pv[0].m;
                whole[1] = pv[0].l;
                whole[2] = qv[0];
            }
        }
        __syncthreads();
        const float m = whole[0], l = whole[1];
        const float row_lse = m + log2f(l) * 0.6931471805599453f;
        if (rank == 0 && threadIdx.x == 0) {
            const float loss = t >= 0 ? row_loss(row_lse, zt, whole[2], smoothing, eps_v, z_loss) : 0.f;
            if (loss_rows) loss_rows[row] = loss;
            if (lse) lse[row] = row_lse;
        }
        T* d = dlogits + row * d_stride;
        if (t < 0) {   // (an ignored row's gradient is zero, whatever its logits)
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const long long c = c_begin + (static_cast<long long>(i) * THREADS + threadIdx.x) * VEC;
                float f[VEC] = {};
                if (c < c_end) store_vec_global<T, VEC>(d + c, pack<T, VEC>(f));
            }
            continue;
        }
        const GradTerms k = GradTerms::make(b_of(m), 0.f, 1.f / l, 1.f + 2.f * z_loss * row_lse, eps_v, smoothing,
                                            count ? 1.f / *count : 1.f, softcap, inv_cap, t);
        auto gradient = [&](auto cap) {
            // (softcapped and staged: a loop, not unrolled, within the registers of six CTAs an SM)
            constexpr int UNROLL = decltype(cap)::value && STAGE ? 1 : NV;
#pragma unroll UNROLL
            for (int i = 0; i < NV; ++i) {
                const long long c = c_begin + (static_cast<long long>(i) * THREADS + threadIdx.x) * VEC;
                if (c < c_end) {
                    float f[VEC], at_target;
                    unpack(part_of(i), f);
                    const bool hit = grad_vector<decltype(cap)::value>(f, c, k, at_target);
                    store_vec_global<T, VEC>(d + c, pack<T, VEC>(f));
                    if (hit) d[t] = from_float<T>(at_target);   // (after the vector: program order)
                }
            }
        };
        if (softcap > 0.f) gradient(Flag<true>{}); else gradient(Flag<false>{});
    }
    // No CTA leaves while a peer may still read its shared memory. A relaxed arrival: a release
    // would first wait for this thread's gradient stores to complete (measured 4% slower).
    cluster_arrive_relaxed();
    cluster_wait();
#endif
}
