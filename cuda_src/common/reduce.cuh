// Reductions across threads: shuffle butterflies inside a warp, and group reductions over G
// consecutive threads that together own one row (sum, max, and the online-softmax merge).
//
// Values are floats or SoftmaxStates; a butterfly also takes arrays of them, and several
// values or arrays at once, and does all of them at one shuffle offset before the next.
// Every operation runs in an order fixed by the thread layout, so results are bitwise
// reproducible. op(own, other) always takes this thread's value first. Shuffles use the
// full mask: every lane of the warp must call.
#pragma once

namespace cuk {

// -inf (the identity of max) without <cuda/std/limits>: no include paths under NVRTC.
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// log2(e): natural-log values (lse, logits) into the log2 domain that fast_exp2 works in.
constexpr float LOG2E = 1.4426950408889634f;

// 2^x with the hardware approximation (2 ulp; ex2.approx(-inf) = +0), as FlashAttention's
// exp2f under fast math. The softmax state below and the attention kernels use it.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Online softmax of scores x in the log2 domain (x * log2(e) for natural-log scores):
// m = the largest score seen, l = the sum of 2^(x - m) over the scores seen. Two states of
// disjoint sets of scores merge into the state of their union, so partial states of a row
// can be reduced across threads in any fixed tree (GroupReduce<..., SoftmaxState>::merge).
struct SoftmaxState {
    float m;
    float l;

    __device__ static SoftmaxState empty() { return {neg_inf(), 0.f}; }

    // One more score, with one exp2: the smaller of m and x is rescaled to the larger.
    __device__ __forceinline__ void add(float x) {
        if (x > m) {
            l = l * fast_exp2(m - x) + 1.f;   // (m = -inf: 2^-inf = 0)
            m = x;
        } else if (x != neg_inf()) {   // (-inf adds 0; with m = -inf it would add 2^NaN)
            l += fast_exp2(x - m);       // (a NaN score makes l NaN)
        }
    }

    // The natural log of sum(2^x) = ln(sum(e^score)): the log-sum-exp of the scores.
    __device__ __forceinline__ float log_sum_exp() const { return (m + log2f(l)) * 0.6931471805599453f; }
};

__device__ __forceinline__ SoftmaxState merge(SoftmaxState a, SoftmaxState b) {
    const float m = fmaxf(a.m, b.m);
    const float mu = m == neg_inf() ? 0.f : m;   // both empty: no (-inf) - (-inf)
    return {m, a.l * fast_exp2(a.m - mu) + b.l * fast_exp2(b.m - mu)};
}

// Binary operations with their identities (the value of lanes that hold nothing).
struct Sum {
    __device__ static float identity() { return 0.f; }
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
    __device__ static float identity() { return neg_inf(); }
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SoftmaxMerge {
    __device__ static SoftmaxState identity() { return SoftmaxState::empty(); }
    __device__ __forceinline__ SoftmaxState operator()(SoftmaxState a, SoftmaxState b) const { return merge(a, b); }
};

// The value of lane (this lane ^ offset); every lane of the warp must take part.
__device__ __forceinline__ float shfl_xor(float v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
__device__ __forceinline__ SoftmaxState shfl_xor(SoftmaxState s, int offset) {
    return {shfl_xor(s.m, offset), shfl_xor(s.l, offset)};
}

namespace detail {
// One butterfly step at `offset` of values, or of arrays of one length taken element by
// element (element i of each array in turn, then element i + 1).
template <typename Op, typename... V>
__device__ __forceinline__ void xor_step(int offset, Op op, V&... v) {
    ((v = op(v, shfl_xor(v, offset))), ...);
}
template <typename Op, typename V, int N, typename... R>
__device__ __forceinline__ void xor_step(int offset, Op op, V (&v)[N], R&... r) {
#pragma unroll
    for (int i = 0; i < N; ++i) xor_step(offset, op, v[i], r[i]...);
}
}  // namespace detail

// v = op(v, v of lane ^ offset) for offset = FIRST, ..., LAST in powers of two: halving when
// FIRST >= LAST (the usual tree), doubling otherwise; v: one or more values or arrays of one
// length (see detail::xor_step for the order). The lanes that differ only in those bits end
// with the same results, in an order of operations the offsets' order fixes.
template <int FIRST, int LAST, typename Op, typename... V>
__device__ __forceinline__ void butterfly(Op op, V&... v) {
    static_assert(FIRST >= 1 && LAST >= 1 && FIRST <= 16 && LAST <= 16 &&
                  (FIRST & (FIRST - 1)) == 0 && (LAST & (LAST - 1)) == 0, "offsets: powers of two < 32");
    if constexpr (FIRST >= LAST) {
#pragma unroll
        for (int offset = FIRST; offset >= LAST; offset /= 2) detail::xor_step(offset, op, v...);
    } else {
#pragma unroll
        for (int offset = FIRST; offset <= LAST; offset *= 2) detail::xor_step(offset, op, v...);
    }
}

// Halving from FIRST down to a run-time `last` (a power of two): lanes that agree in the bits
// below `last` combine (e.g. the lanes of a warp that hold the same columns).
template <int FIRST, typename Op, typename... V>
__device__ __forceinline__ void butterfly_down_to(int last, Op op, V&... v) {
    for (int offset = FIRST; offset >= last; offset /= 2) detail::xor_step(offset, op, v...);
}

// Reduction over a group of G consecutive threads (G a power of two) that together own one
// row, for up to K values of type T at once (as CUB's block primitives, the caller declares
// the shared memory: `__shared__ typename GroupReduce<G, K>::TempStorage tmp;`):
//   G <= 32: the group lives inside one warp and reduces with shuffles (offsets G/2, ..., 1);
//            TempStorage is a placeholder that is never touched.
//   G  > 32: the group is the whole block (G == blockDim.x, every thread calls): warps reduce
//            as above, then every warp reduces the G/32 per-warp results with offsets 16..1.
// Every thread of the group gets the results. The G > 32 path starts with a barrier (a
// previous call may still be reading tmp) and has none after its reads of tmp: a caller that
// reuses tmp's memory for anything else must synchronize first.
template <int G, int K = 1, typename T = float>
struct GroupReduce {
    static_assert(G >= 1 && G <= 1024 && (G & (G - 1)) == 0, "G: a power of two <= 1024");
    static constexpr int WARPS = G > 32 ? G / 32 : 1;
    struct TempStorage {
        T partial[G > 32 ? K : 1][WARPS];
    };

    // Any G; N <= K values.
    template <typename Op, int N>
    __device__ __forceinline__ static void reduce(T (&v)[N], TempStorage& tmp, Op op) {
        static_assert(N <= K, "more values than TempStorage holds");
        if constexpr (G > 1) butterfly<(G < 32 ? G : 32) / 2, 1>(op, v);
        if constexpr (G > 32) {
            const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
            __syncthreads();
            if (lane == 0) {
#pragma unroll
                for (int k = 0; k < N; ++k) tmp.partial[k][warp] = v[k];
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < N; ++k) {
                T t = lane < WARPS ? tmp.partial[k][lane] : Op::identity();
                butterfly<16, 1>(op, t);   // the same tree in every warp
                v[k] = t;
            }
        }
    }
    // G <= 32 only: no storage.
    template <typename Op, int N>
    __device__ __forceinline__ static void reduce(T (&v)[N], Op op) {
        static_assert(G <= 32 && N <= K, "a block-wide group needs TempStorage");
        if constexpr (G > 1) butterfly<G / 2, 1>(op, v);
    }

    template <int N> __device__ __forceinline__ static void sum(T (&v)[N], TempStorage& tmp) { reduce(v, tmp, Sum{}); }
    template <int N> __device__ __forceinline__ static void max(T (&v)[N], TempStorage& tmp) { reduce(v, tmp, Max{}); }
    template <int N> __device__ __forceinline__ static void merge(T (&v)[N], TempStorage& tmp) {
        reduce(v, tmp, SoftmaxMerge{});
    }
    template <int N> __device__ __forceinline__ static void sum(T (&v)[N]) { reduce(v, Sum{}); }
    template <int N> __device__ __forceinline__ static void max(T (&v)[N]) { reduce(v, Max{}); }
    template <int N> __device__ __forceinline__ static void merge(T (&v)[N]) { reduce(v, SoftmaxMerge{}); }
};

// ---- amax: the largest magnitude, as float32 bits ------------------------------------------
// An integer max of non-negative floats' bits is their float max, and a NaN (bits above +inf)
// wins, as torch's amax propagates it. Exact, so independent of the order of reduction.
//
// AmaxBits takes no |v|: a signed max of the bits finds the largest positive value (or, with
// none, the negative one of largest magnitude), an unsigned max the negative value of largest
// magnitude (or, with none, the largest positive). Whichever sign holds the amax, one of the two
// ends on it; a NaN wins the max of its sign's order. Both maxima take two values an instruction
// (VIMNMX3), where |v| cost an FADD a value on top of one max for two.
struct AmaxBits {
    int s = static_cast<int>(0x80000000u);   // -0.0
    unsigned int u = 0u;                      // +0.0
    __device__ __forceinline__ void add2(float a, float b) {
        s = max(s, max(__float_as_int(a), __float_as_int(b)));
        u = max(u, max(__float_as_uint(a), __float_as_uint(b)));
    }
    // max |v| over the values added, as float32 bits
    __device__ __forceinline__ unsigned int bits() const {
        return max(static_cast<unsigned int>(s) & 0x7fffffffu, u & 0x7fffffffu);
    }
};

// The warp's largest of every lane's `m` merged into *amax (float32, >= 0, set to 0 before the
// launch): one atomic a warp, skipped where *amax already holds as much; no barrier, so a
// block's warps leave as they finish. Every lane of the warp must call.
__device__ __forceinline__ void warp_amax(unsigned int m, float* amax) {
    asm("redux.sync.max.u32 %0, %0, 0xffffffff;" : "+r"(m));
    if (threadIdx.x % 32 == 0) {
        unsigned int* p = reinterpret_cast<unsigned int*>(amax);
        if (m > *reinterpret_cast<volatile unsigned int*>(p)) atomicMax(p, m);
    }
}

}  // namespace cuk
