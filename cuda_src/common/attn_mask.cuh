// Which keys a query of attention sees, the softcap of the scores, and packed documents
// (cukern/_attention_mask.py is the host side of the same rules).
//
// Queries and keys are aligned at the bottom right: query i stands at key position
// i + diag (diag = Sk - Sq). MASK_CAUSAL lets it see keys j <= i + diag; MASK_LOCAL a window
// i + diag - left <= j <= i + diag + right (flash-attn's window_size; a side < 0 is
// unbounded). Key tiles wholly outside every row's range of a block are skipped, not masked.
#pragma once
#include "reduce.cuh"
#include "fault.cuh"

namespace cuk {
namespace attention {

enum MaskKind { MASK_NONE = 0, MASK_CAUSAL = 1, MASK_LOCAL = 2 };

// The mask of one (batch, head): query `row` sees keys row + lo .. row + hi (and < sk); a side
// without a bound is +-2^30, so that a window is two compares whatever it holds.
template <int MASK>
struct KeyMask {
    int lo, hi;
    static constexpr int UNBOUNDED = 1 << 30;
    __device__ __forceinline__ KeyMask(int left, int right, int diag)
        : lo(MASK == MASK_LOCAL && left >= 0 ? diag - left : -UNBOUNDED),
          hi(MASK == MASK_CAUSAL ? diag : MASK == MASK_LOCAL && right >= 0 ? diag + right : UNBOUNDED) {}
    // Keys [first, stop) that some row of rows row0 .. row0 + rows - 1 sees (first >= stop: none).
    __device__ __forceinline__ int first_key(int row0) const {
        return MASK == MASK_LOCAL ? max(0, row0 + lo) : 0;
    }
    __device__ __forceinline__ int stop_key(int row0, int rows, int sk) const {
        return MASK == MASK_NONE ? sk : min(sk, row0 + rows + hi);
    }
    // Queries [first, stop) that see some key of keys n0 .. n0 + n - 1 (the backward's walk).
    __device__ __forceinline__ int first_query(int n0) const {
        return MASK == MASK_NONE ? 0 : max(0, n0 - hi);
    }
    __device__ __forceinline__ int stop_query(int n0, int n, int sq) const {
        return MASK == MASK_LOCAL ? min(sq, n0 + n - lo) : sq;
    }
    // Whether a tile of keys [n0, n0 + n) needs per-element masking for rows row0 .. row0 + rows - 1.
    __device__ __forceinline__ bool edge(int n0, int n, int row0, int rows, int sk) const {
        return n0 + n > sk || (MASK != MASK_NONE && n0 + n - 1 > row0 + hi) ||
               (MASK == MASK_LOCAL && n0 < row0 + rows - 1 + lo);
    }
    // Whether query `row` does not see key `key`.
    __device__ __forceinline__ bool hidden(int row, int key, int sk) const {
        return key >= sk || (MASK != MASK_NONE && key > row + hi) || (MASK == MASK_LOCAL && key < row + lo);
    }
    // The same tests combined by | and & (no short-circuit): the Hopper kernels' per-score masks
    // run 2-19% faster this way in most instances (attention_bwd_sm90's top says where).
    __device__ __forceinline__ bool hidden_bits(int row, int key, int sk) const {
        return (key >= sk) | ((MASK != MASK_NONE) & (key > row + hi)) | ((MASK == MASK_LOCAL) & (key < row + lo));
    }
};

// tanh by the SFU (sm_75+; flash-attn's softcap takes the same), ~2^-11 relative error.
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Packed documents (varlen): document b's first token and length among q's and among k's,
// read from the offsets cu_q and cu_k (docs + 1 each, from 0 to total_q / total_k, none
// decreasing). A document whose offsets break that, or that is longer than the launch covers
// (max_q, max_k), is recorded as a fault (kind 3: the document, the count of documents) and
// taken as empty.
struct DocSpan {
    int q0, sq, k0, sk;
};
__device__ __forceinline__ DocSpan doc_span(const int* cu_q, const int* cu_k, int b, int docs, int total_q,
                                            int total_k, int max_q, int max_k, long long* fault) {
    const int q0 = cu_q[b], q1 = cu_q[b + 1], k0 = cu_k[b], k1 = cu_k[b + 1];
    const bool ends = (b > 0 || (q0 == 0 && k0 == 0)) && (b < docs - 1 || (q1 == total_q && k1 == total_k));
    const bool ok = ends && 0 <= q0 && q0 <= q1 && q1 <= total_q && q1 - q0 <= max_q &&
                    0 <= k0 && k0 <= k1 && k1 <= total_k && k1 - k0 <= max_k;
    if (!ok) {
        if (threadIdx.x == 0) record_fault(fault, b, docs, 3);
        return {0, 0, 0, 0};
    }
    return {q0, q1 - q0, k0, k1 - k0};
}
// doc_span, broadcast from lane 0: values loaded from memory are per-thread to ptxas, so loop
// bounds made from them run as divergent loops (BSSY/BSYNC) with wgmma descriptors moved to uniform
// registers (R2UR) a use; a full-warp shuffle from a fixed lane is known warp-uniform.
__device__ __forceinline__ DocSpan doc_span_uniform(const int* cu_q, const int* cu_k, int b, int docs, int total_q,
                                                    int total_k, int max_q, int max_k, long long* fault) {
    const DocSpan s = doc_span(cu_q, cu_k, b, docs, total_q, total_k, max_q, max_k, fault);
    return {__shfl_sync(0xffffffffu, s.q0, 0), __shfl_sync(0xffffffffu, s.sq, 0), __shfl_sync(0xffffffffu, s.k0, 0),
            __shfl_sync(0xffffffffu, s.sk, 0)};
}

// A block's tokens for the backward kernels: span = {batch (0 when packed), first query token,
// first key token, queries, keys}, written by thread 0 and published by a block barrier (the
// kernels read it from shared memory where they use it: they have no registers to keep it in).
__device__ __forceinline__ void block_span(int (&span)[5], int b, int docs, const int* cu_q, const int* cu_k,
                                           int Sq, int Sk, int max_q, int max_k, long long* fault) {
    if (threadIdx.x == 0) {
        DocSpan doc{0, Sq, 0, Sk};
        if (cu_q) doc = doc_span(cu_q, cu_k, b, docs, Sq, Sk, max_q, max_k, fault);
        span[0] = cu_q ? 0 : b, span[1] = doc.q0, span[2] = doc.k0, span[3] = doc.sq, span[4] = doc.sk;
    }
    __syncthreads();
}

}  // namespace attention
}  // namespace cuk
