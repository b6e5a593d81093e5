// Mixture-of-experts routing and token permutation, forward and backward.
//
// Router: one warp a token. Lane l holds experts l, l + 32, ... (EPL of them: E <= 32 * EPL),
// the scores are softmax or sigmoid of the logits in float32, and the top k (k <= 32) are taken
// by k warp-wide argmax rounds on score + bias (ties: the lower expert, as a stable sort gives).
// Slot j's weight sits in lane j until the renormalization.
//
// Permutation: the T * k (token, slot) pairs are ordered stably by expert without a global sort
// and without a host synchronization. Pairs are cut into chunks of CHUNK; per chunk and expert a
// count (shared-memory histogram), then one block turns the counts into each expert's offset and
// each (chunk, expert)'s first row; then each chunk places its pairs, warp by warp in order, a
// pair's row being its (chunk, expert) base plus its rank among the pairs of its expert before
// it in the chunk. Every row is a function of the inputs alone: the same order every call.
//
// Gather / combine: rows of x copied to their permuted places; a token's rows of y summed with
// its weights in float32 and rounded once (transformers' loop adds them in x's dtype one expert
// at a time; the float32 sum is what its float32 reference computes). All integer counts are
// int32 (T * k < 2^31, checked on the host).
//
// Bad ids never reach memory: an expert id outside [0, E) is recorded as a fault (kind 4,
// cukern/_faults.py) and its pair placed in a bucket after the last expert's rows (offsets[E] on),
// so every row is still written; a row index outside the rows given (row_of) is recorded (kind
// 5) and its row not read.
#include "common/dtype.cuh"
#include "common/fault.cuh"
#include "common/vec.cuh"

namespace cuk {
namespace moe {

enum Score { SOFTMAX = 0, SIGMOID = 1 };

constexpr int MAX_EXPERTS = 1024;   // (the permutation's per-expert tables live in shared memory)

// An expert id, or E (the bucket after the last expert) for one out of range.
__device__ __forceinline__ int bucket(int e, int experts) {
    return e >= 0 && e < experts ? e : experts;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The scores of a token's experts held by this lane (-inf past the last expert for the choice;
// 0 as a score there).
template <typename T, int EPL, int SCORE>
__device__ __forceinline__ void scores(const T* __restrict__ row, int experts, int lane, float (&s)[EPL]) {
    float l[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int e = lane + 32 * i;
        l[i] = e < experts ? to_float(row[e]) : -__int_as_float(0x7f800000);
    }
    if constexpr (SCORE == SOFTMAX) {
        float m = l[0];
#pragma unroll
        for (int i = 1; i < EPL; ++i) m = fmaxf(m, l[i]);
        m = warp_max(m);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            s[i] = lane + 32 * i < experts ? expf(l[i] - m) : 0.f;
            sum += s[i];
        }
        const float inv = 1.f / warp_sum(sum);
#pragma unroll
        for (int i = 0; i < EPL; ++i) s[i] *= inv;
    } else {
#pragma unroll
        for (int i = 0; i < EPL; ++i) s[i] = lane + 32 * i < experts ? 1.f / (1.f + expf(-l[i])) : 0.f;
    }
}

}  // namespace moe
}  // namespace cuk

// weights (T, k) float32, experts (T, k) int32; counts (E,) int32 (zeroed before the launch) gets
// one atomic add a (token, slot). bias: (E,) float32 or null (shifts the choice, not the weights).
template <typename T, int EPL, int SCORE, bool RENORM, int THREADS>
__global__ void __launch_bounds__(THREADS) moe_router(
    const T* __restrict__ logits, const float* __restrict__ bias, float* __restrict__ weights,
    int* __restrict__ experts_out, int* __restrict__ counts, int tokens, int experts, int top_k, float scale)
{
    using namespace cuk;
    using namespace cuk::moe;
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
    if (t >= tokens) return;
    float s[EPL], sel[EPL];
    scores<T, EPL, SCORE>(logits + static_cast<long long>(t) * experts, experts, lane, s);
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int e = lane + 32 * i;
        sel[i] = e < experts ? s[i] + (bias != nullptr ? bias[e] : 0.f) : -__int_as_float(0x7f800000);
    }
    float mine = 0.f;   // slot `lane`'s score
    int mine_e = 0;
    for (int j = 0; j < top_k; ++j) {
        float best = -__int_as_float(0x7f800000), best_s = 0.f;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {   // (ascending experts: a tie keeps the lower)
            const int e = lane + 32 * i;
            if (e < experts && (sel[i] > best || best_e == 0x7fffffff)) {
                best = sel[i];
                best_s = s[i];
                best_e = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const float os = __shfl_xor_sync(0xffffffffu, best_s, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_s = os;
                best_e = oe;
            }
        }
#pragma unroll
        for (int i = 0; i < EPL; ++i)   // (taken: never chosen again)
            if (lane + 32 * i == best_e) sel[i] = -__int_as_float(0x7f800000);
        if (lane == j) {
            mine = best_s;
            mine_e = best_e;
        }
    }
    const float total = RENORM ? warp_sum(lane < top_k ? mine : 0.f) : 1.f;
    if (lane < top_k) {
        const long long at = static_cast<long long>(t) * top_k + lane;
        weights[at] = mine / total * scale;
        experts_out[at] = mine_e;
        atomicAdd(counts + mine_e, 1);
    }
}

// dlogits (T, E) of the logits' dtype from dweights (T, k) float32, the choice held fixed.
template <typename T, int EPL, int SCORE, bool RENORM, int THREADS>
__global__ void __launch_bounds__(THREADS) moe_router_bwd(
    const float* __restrict__ dweights, const T* __restrict__ logits, const int* __restrict__ experts_in,
    T* __restrict__ dlogits, int tokens, int experts, int top_k, float scale)
{
    using namespace cuk;
    using namespace cuk::moe;
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
    if (t >= tokens) return;
    const T* row = logits + static_cast<long long>(t) * experts;
    float s[EPL];
    scores<T, EPL, SCORE>(row, experts, lane, s);
    // Slot `lane`'s expert, weight gradient and score (its score read from the lane holding it).
    int e = 0;
    float dw = 0.f, se = 0.f;
    if (lane < top_k) {
        const long long at = static_cast<long long>(t) * top_k + lane;
        e = experts_in[at];
        dw = dweights[at] * scale;
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        for (int j = 0; j < top_k; ++j) {   // (slot j's expert e_j: its score from lane e_j % 32)
            const int ej = __shfl_sync(0xffffffffu, e, j);
            const float v = __shfl_sync(0xffffffffu, s[i], ej & 31);
            if (lane == j && ej >> 5 == i) se = v;
        }
    }
    float dc = dw;   // d score of slot `lane`
    if constexpr (RENORM) {   // w_j = s_j / S: ds_j = dw_j / S - sum_i dw_i s_i / S^2
        const float total = warp_sum(lane < top_k ? se : 0.f);
        const float dot = warp_sum(lane < top_k ? dw * se : 0.f);
        dc = dw / total - dot / (total * total);
    }
    float ds[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) ds[i] = 0.f;
    for (int j = 0; j < top_k; ++j) {
        const int ej = __shfl_sync(0xffffffffu, e, j);
        const float dj = __shfl_sync(0xffffffffu, dc, j);
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            if (lane + 32 * i == ej) ds[i] += dj;
    }
    T* out = dlogits + static_cast<long long>(t) * experts;
    if constexpr (SCORE == SOFTMAX) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) dot += ds[i] * s[i];
        dot = warp_sum(dot);
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            if (lane + 32 * i < experts) out[lane + 32 * i] = from_float<T>(s[i] * (ds[i] - dot));
    } else {
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            if (lane + 32 * i < experts) out[lane + 32 * i] = from_float<T>(ds[i] * s[i] * (1.f - s[i]));
    }
}

// chunk_counts (chunks, E): how many of chunk c's pairs went to expert e.
// (E + 1 columns: the last counts the out-of-range ids.)
template <int THREADS, int CHUNK>
__global__ void __launch_bounds__(THREADS) moe_chunk_counts(
    const int* __restrict__ experts_in, int* __restrict__ chunk_counts, int pairs, int experts,
    long long* __restrict__ fault)
{
    __shared__ int hist[cuk::moe::MAX_EXPERTS + 1];
    for (int e = threadIdx.x; e <= experts; e += THREADS) hist[e] = 0;
    __syncthreads();
    const long long first = static_cast<long long>(blockIdx.x) * CHUNK;
    int bad = 0, bad_id = 0;   // (recorded once, after the loop: no atomics on the fault in it)
    for (int i = threadIdx.x; i < CHUNK; i += THREADS) {
        const long long p = first + i;
        if (p < pairs) {
            const int e = experts_in[p];
            const int k = cuk::moe::bucket(e, experts);
            if (k == experts) {
                bad = 1;
                bad_id = e;
            }
            atomicAdd(hist + k, 1);
        }
    }
    if (bad) cuk::record_fault(fault, bad_id, experts, 4);
    __syncthreads();
    for (int e = threadIdx.x; e <= experts; e += THREADS)
        chunk_counts[static_cast<long long>(blockIdx.x) * (experts + 1) + e] = hist[e];
}

// One block: offsets (E + 1,) (expert e's rows start at offsets[e]; offsets[E]: the valid
// pairs, the out-of-range ones after), counts (E,), and chunk_counts (chunks, E + 1) rewritten
// in place as each (chunk, bucket)'s first row.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) moe_offsets(
    int* __restrict__ chunk_counts, int* __restrict__ offsets, int* __restrict__ counts, int chunks, int experts)
{
    __shared__ int total[cuk::moe::MAX_EXPERTS + 1];
    const int buckets = experts + 1;
    for (int e = threadIdx.x; e < buckets; e += THREADS) {
        int n = 0;
        for (int c = 0; c < chunks; ++c) n += chunk_counts[static_cast<long long>(c) * buckets + e];
        total[e] = n;
        if (e < experts) counts[e] = n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {   // (E is small: a serial exclusive scan)
        int run = 0;
        for (int e = 0; e < buckets; ++e) {
            const int n = total[e];
            total[e] = run;
            offsets[e] = run;
            run += n;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < buckets; e += THREADS) {
        int run = total[e];
        for (int c = 0; c < chunks; ++c) {
            const long long at = static_cast<long long>(c) * buckets + e;
            const int n = chunk_counts[at];
            chunk_counts[at] = run;
            run += n;
        }
    }
}

// order (P,): row r holds pair order[r]; row_of (P,): pair p's row.
template <int THREADS, int CHUNK>
__global__ void __launch_bounds__(THREADS) moe_place(
    const int* __restrict__ experts_in, const int* __restrict__ chunk_base, int* __restrict__ order,
    int* __restrict__ row_of, int pairs, int experts)
{
    __shared__ int base[cuk::moe::MAX_EXPERTS + 1];
    for (int e = threadIdx.x; e <= experts; e += THREADS)
        base[e] = chunk_base[static_cast<long long>(blockIdx.x) * (experts + 1) + e];
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned below = (1u << lane) - 1u;
    const long long first = static_cast<long long>(blockIdx.x) * CHUNK;
    for (int i0 = 0; i0 < CHUNK; i0 += THREADS) {
        const long long p = first + i0 + threadIdx.x;
        const int e = p < pairs ? cuk::moe::bucket(experts_in[p], experts) : -1;   // (recorded by the count)
        const unsigned same = __match_any_sync(0xffffffffu, e);
        // the warps in order: each reads its experts' next rows, then its leaders advance them
        for (int w = 0; w < THREADS / 32; ++w) {
            if (warp == w && e >= 0) {
                const int row = base[e] + __popc(same & below);
                order[row] = static_cast<int>(p);
                row_of[p] = row;
            }
            __syncwarp();
            if (warp == w && e >= 0 && (same & below) == 0) base[e] += __popc(same);
            __syncthreads();
        }
    }
}

// x_perm (P, H): row r is x's token order[r] / k. A row's vectors are strided over
// 1 << tpr_log2 threads.
template <typename T, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS) moe_gather(
    const T* __restrict__ x, long long x_stride, const int* __restrict__ order, T* __restrict__ x_perm,
    int pairs, int cols, int top_k, int tpr_log2)
{
    using namespace cuk;
    const int lane = threadIdx.x & ((1 << tpr_log2) - 1);
    const long long r = static_cast<long long>(blockIdx.x) * (THREADS >> tpr_log2) + (threadIdx.x >> tpr_log2);
    if (r >= pairs) return;
    const T* src = x + static_cast<long long>(order[r] / top_k) * x_stride;   // (moe_place's: in range)
    T* dst = x_perm + r * cols;
    for (int v = lane; v < cols / VEC; v += 1 << tpr_log2)
        store_vec<T, VEC>(dst + v * VEC, load_vec<T, VEC>(src + v * VEC));
}

// out (T, H): token t's rows of y (row_of[t * k + j]) summed, times weights[t, j] (float32) where
// WEIGHTED, in float32, rounded once. Without weights it is the gather's backward (dx).
template <typename T, int VEC, int THREADS, bool WEIGHTED>
__global__ void __launch_bounds__(THREADS) moe_combine(
    const T* __restrict__ y, const int* __restrict__ row_of, const float* __restrict__ weights,
    T* __restrict__ out, int tokens, int cols, int top_k, int tpr_log2, long long* __restrict__ fault)
{
    using namespace cuk;
    const int lane = threadIdx.x & ((1 << tpr_log2) - 1);
    const long long t = static_cast<long long>(blockIdx.x) * (THREADS >> tpr_log2) + (threadIdx.x >> tpr_log2);
    if (t >= tokens) return;
    const long long rows = static_cast<long long>(tokens) * top_k;
    bool bad = false;
    long long bad_row = 0;
    for (int v = lane; v < cols / VEC; v += 1 << tpr_log2) {
        float acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
#pragma unroll 1
        for (int j = 0; j < top_k; ++j) {
            const long long pair = t * top_k + j;
            const long long row = row_of[pair];
            if (row < 0 || row >= rows) {   // (not read; recorded after the loop)
                bad = true;
                bad_row = row;
                continue;
            }
            const float w = WEIGHTED ? weights[pair] : 1.f;
            float f[VEC];
            unpack(load_vec<T, VEC>(y + row * cols + v * VEC), f);
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] += w * f[i];
        }
        store_vec<T, VEC>(out + t * cols + v * VEC, pack<T, VEC>(acc));
    }
    if (bad && lane == 0) record_fault(fault, bad_row, rows, 5);
}

// The combine's backward, one warp a (token, slot): dy_perm[row] = dout[t] * w (rounded to T)
// and dweights[t, j] = <y[row], dout[t]> in float32.
template <typename T, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS) moe_combine_bwd(
    const T* __restrict__ dout, const T* __restrict__ y, const int* __restrict__ row_of,
    const float* __restrict__ weights, T* __restrict__ dy_perm, float* __restrict__ dweights,
    int pairs, int cols, int top_k, long long* __restrict__ fault)
{
    using namespace cuk;
    using namespace cuk::moe;
    const int lane = threadIdx.x & 31;
    const long long pair = static_cast<long long>(blockIdx.x) * (THREADS / 32) + (threadIdx.x >> 5);
    if (pair >= pairs) return;
    const long long t = pair / top_k;
    const long long row = row_of[pair];
    if (row < 0 || row >= pairs) {   // (its row of dy_perm is left as it was: a recorded fault)
        if (lane == 0) {
            record_fault(fault, row, pairs, 5);
            dweights[pair] = 0.f;
        }
        return;
    }
    const float w = weights[pair];
    float dot = 0.f;
    for (int v = lane; v < cols / VEC; v += 32) {
        float d[VEC], f[VEC];
        unpack(load_vec<T, VEC>(dout + t * cols + v * VEC), d);
        unpack(load_vec<T, VEC>(y + row * cols + v * VEC), f);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            dot += d[i] * f[i];
            d[i] *= w;
        }
        store_vec<T, VEC>(dy_perm + row * cols + v * VEC, pack<T, VEC>(d));
    }
    dot = warp_sum(dot);
    if (lane == 0) dweights[pair] = dot;
}
