// Embedding lookup (forward) and the dense, deterministic weight gradient (backward).
//
// Forward: one block a token at a time (persistent grid), or a warp a token for narrow rows;
// rows move in 16-byte vectors. An index outside [0, V) writes a zero row and records a fault.
//
// Backward, in four launches (see cukern/embedding.py):
//  1. embedding_bwd_keys: key = (index << 32) | position for each token; tokens that give no
//     gradient (padding, out of range: the latter recorded as faults) get index V, so that
//     after the sort (done by the framework, keys are unique so any sort is deterministic)
//     they come last and equal indices are adjacent, in position order. Touched rows are
//     flagged, and embedding_bwd_zero zeroes the others.
//  2. embedding_bwd_chunks: block (b, y) sums the rows of sorted entries [b*C, b*C + C) in
//     float32, run by run (a run = equal indices), for column tile y. A run entirely inside
//     the chunk is written to dweight directly; a run that crosses a chunk boundary leaves a
//     float32 partial row (slot 0: the chunk's first run, slot 1: its last).
//  3. embedding_bwd_combine: the chunk where a crossing run starts adds the following chunks'
//     slot-0 partials in chunk order and writes the row. Long runs (a token repeated
//     thousands of times) are thus split over many blocks, and summed in a fixed order.
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "common/fault.cuh"

template <typename T, typename IdxT, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) embedding_fwd(
    const IdxT* __restrict__ indices, long long ntok,
    const T* __restrict__ weight, long long V, int D,
    T* __restrict__ out, long long* fault)
{
    using namespace cuk;
    for (long long t = blockIdx.x; t < ntok; t += gridDim.x) {
        const long long i = static_cast<long long>(indices[t]);
        const bool ok = i >= 0 && i < V;
        if (!ok && threadIdx.x == 0) record_fault(fault, i, V);
        const T* src = weight + (ok ? i : 0) * D;
        T* dst = out + t * D;
#pragma unroll 4
        for (int col = threadIdx.x * VEC; col < D; col += THREADS * VEC) {
            Vec<T, VEC> v = {};
            if (ok) v = load_vec<T, VEC>(src + col);
            store_vec<T, VEC>(dst + col, v);
        }
    }
}

// Forward for narrow rows (the front's choice, up to WARP_ROW_BYTES): a warp a token, so a
// block of THREADS copies THREADS/32 rows at once instead of leaving most of its threads
// idle. Measured 1.7x (D = 1024) to 3x (D = 64) faster than a block a token, bf16 on an
// H200; a block a token stays ahead from 4096 on (docs/notes-embedding.md).
template <typename T, typename IdxT, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS) embedding_fwd_warp(
    const IdxT* __restrict__ indices, long long ntok,
    const T* __restrict__ weight, long long V, int D,
    T* __restrict__ out, long long* fault)
{
    using namespace cuk;
    const int lane = threadIdx.x % 32;
    const long long nwarps = static_cast<long long>(gridDim.x) * (THREADS / 32);
    for (long long t = static_cast<long long>(blockIdx.x) * (THREADS / 32) + threadIdx.x / 32; t < ntok;
         t += nwarps) {
        const long long i = static_cast<long long>(indices[t]);
        const bool ok = i >= 0 && i < V;
        if (!ok && lane == 0) record_fault(fault, i, V);
        const T* src = weight + (ok ? i : 0) * D;
        T* dst = out + t * D;
        // All U loads are issued before the first store (written out, not left to an unroll
        // pragma: with `#pragma unroll 4` over load-store pairs this kernel ran 4x slower
        // as soon as a lane had more than one vector a row).
        constexpr int U = 4;
        for (int col0 = lane * VEC; col0 < D; col0 += 32 * VEC * U) {
            Vec<T, VEC> v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int col = col0 + u * 32 * VEC;
                v[u] = Vec<T, VEC>{};
                if (ok && col < D) v[u] = load_vec<T, VEC>(src + col);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int col = col0 + u * 32 * VEC;
                if (col < D) store_vec<T, VEC>(dst + col, v[u]);
            }
        }
    }
}

// padding < 0: none (the front normalizes a negative padding_idx to V + padding_idx).
template <typename IdxT>
__global__ void __launch_bounds__(256) embedding_bwd_keys(
    const IdxT* __restrict__ indices, long long ntok, long long V, long long padding,
    long long* __restrict__ keys, unsigned char* __restrict__ touched, long long* fault)
{
    using namespace cuk;
    for (long long t = blockIdx.x * 256LL + threadIdx.x; t < ntok; t += gridDim.x * 256LL) {
        long long i = static_cast<long long>(indices[t]);
        if (i < 0 || i >= V) {
            record_fault(fault, i, V);
            i = V;
        } else if (i == padding) {
            i = V;
        } else {
            touched[i] = 1;  // every writer stores the same value
        }
        keys[t] = (i << 32) | t;
    }
}

// Zero rows no token touched (the others are written by the chunk and combine kernels), so
// dweight is written once: V*D elements, not a zero fill plus the touched rows again.
template <typename T, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) embedding_bwd_zero(
    const unsigned char* __restrict__ touched, long long V, int D, T* __restrict__ dweight)
{
    using namespace cuk;
    for (long long r = blockIdx.x; r < V; r += gridDim.x) {
        if (touched[r]) continue;
        for (int col = threadIdx.x * VEC; col < D; col += THREADS * VEC)
            store_vec<T, VEC>(dweight + r * D + col, Vec<T, VEC>{});
    }
}

// part: [nchunks][2][D] float32; pidx: [nchunks][2] (run index or -1); pcnt: [nchunks][2];
// own: [nchunks], the slot of the crossing run that starts in this chunk, or -1.
template <typename T, int VEC, int NV, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) embedding_bwd_chunks(
    const long long* __restrict__ keys, long long n, int C,
    const T* __restrict__ grad, long long V, int D, int scale_by_freq,
    T* __restrict__ dweight, float* __restrict__ part, long long* __restrict__ pidx,
    int* __restrict__ pcnt, int* __restrict__ own)
{
    using namespace cuk;
    const long long b = blockIdx.x;
    const int col0 = blockIdx.y * THREADS * NV * VEC;
    const bool meta = blockIdx.y == 0 && threadIdx.x == 0;
    const long long e0 = b * C;
    const long long e1 = e0 + C < n ? e0 + C : n;
    const long long prev = e0 > 0 ? (keys[e0 - 1] >> 32) : -1;
    const long long next = e1 < n ? (keys[e1] >> 32) : -1;
    if (meta) {
        pidx[2 * b] = pidx[2 * b + 1] = -1;
        own[b] = -1;
    }
    float acc[NV][VEC];
    long long cur = -1;
    int cnt = 0;
    bool first = true;

    auto flush = [&](bool spans_out) {
        const bool spans_in = first && prev == cur;
        if (!spans_in && !spans_out) {
            const float s = scale_by_freq ? 1.f / static_cast<float>(cnt) : 1.f;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = col0 + (k * THREADS + threadIdx.x) * VEC;
                if (col < D) {
                    Vec<T, VEC> o;
#pragma unroll
                    for (int j = 0; j < VEC; ++j) o.v[j] = from_float<T>(acc[k][j] * s);
                    store_vec<T, VEC>(dweight + cur * D + col, o);
                }
            }
        } else {
            const int slot = first ? 0 : 1;
            float* p = part + (2 * b + slot) * static_cast<long long>(D);
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = col0 + (k * THREADS + threadIdx.x) * VEC;
                if (col < D) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) p[col + j] = acc[k][j];
                }
            }
            if (meta) {
                pidx[2 * b + slot] = cur;
                pcnt[2 * b + slot] = cnt;
                if (!spans_in && spans_out) own[b] = slot;
            }
        }
    };

    for (long long e = e0; e < e1; ++e) {
        const long long key = keys[e];
        const long long idx = key >> 32;
        if (idx >= V) break;  // padding / out of range: sorted last
        if (idx != cur) {
            if (cur >= 0) {
                flush(false);
                first = false;
            }
            cur = idx;
            cnt = 0;
#pragma unroll
            for (int k = 0; k < NV; ++k)
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[k][j] = 0.f;
        }
        const T* g = grad + (key & 0xffffffffLL) * D;
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int col = col0 + (k * THREADS + threadIdx.x) * VEC;
            if (col < D) {
                const Vec<T, VEC> v = load_vec<T, VEC>(g + col);
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[k][j] += to_float(v.v[j]);
            }
        }
        ++cnt;
    }
    if (cur >= 0) flush(next == cur);
}

// Block (b, y) with THREADS threads, one column each: the crossing run owned by chunk b.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) embedding_bwd_combine(
    const float* __restrict__ part, const long long* __restrict__ pidx,
    const int* __restrict__ pcnt, const int* __restrict__ own, long long nchunks, int D,
    int scale_by_freq, T* __restrict__ dweight)
{
    using namespace cuk;
    const long long b = blockIdx.x;
    const int slot = own[b];
    if (slot < 0) return;
    const int col = blockIdx.y * THREADS + threadIdx.x;
    if (col >= D) return;
    const long long idx = pidx[2 * b + slot];
    float acc = part[(2 * b + slot) * static_cast<long long>(D) + col];
    long long cnt = pcnt[2 * b + slot];
    for (long long c = b + 1; c < nchunks && pidx[2 * c] == idx; ++c) {
        acc += part[(2 * c) * static_cast<long long>(D) + col];
        cnt += pcnt[2 * c];
    }
    if (scale_by_freq) acc *= 1.f / static_cast<float>(cnt);
    dweight[idx * D + col] = from_float<T>(acc);
}
