// The parameters of the attention kernels: one struct a kernel, passed by value as a
// __grid_constant__ (flash-attention's Flash_fwd_params). The host packs a struct field by field,
// by name, against its declaration here (cukern/_signatures.py reads it from the source), so a
// field added here is a name added at the launch, never a shifted argument list.
#pragma once

namespace cuk {
namespace attention {

// What every attention kernel is asked: H query heads over Hkv key/value heads, Sq queries and
// Sk keys a (batch, head) (packed documents: the token totals), the softmax scale (and times
// log2(e)), the mask's window (attn_mask.cuh), the softcap's two factors, packed documents'
// offsets cu_q and cu_k (null for a dense batch) with the longest document the launch covers,
// and where a fault is recorded (fault.cuh).
struct Problem {
    int H, Hkv, Sq, Sk;
    float scale, scale_log2;
    int win_left, win_right;
    float cap_in, cap_out;
    const int* cu_q;
    const int* cu_k;
    int max_q, max_k;
    long long* fault;
};

}  // namespace attention
}  // namespace cuk

// The problem's fields as the kernel's own constants under their names (the kernels' bodies
// read H, Sq, cu_q, ... as they read parameters).
#define CUK_ATTN_PROBLEM(pr)                                                                        \
    const int H = (pr).H, Hkv = (pr).Hkv, Sq = (pr).Sq, Sk = (pr).Sk;                               \
    const float scale = (pr).scale, scale_log2 = (pr).scale_log2;                                   \
    const int win_left = (pr).win_left, win_right = (pr).win_right;                                 \
    const float cap_in = (pr).cap_in, cap_out = (pr).cap_out;                                       \
    const int* const __restrict__ cu_q = (pr).cu_q;                                                 \
    const int* const __restrict__ cu_k = (pr).cu_k;                                                 \
    const int max_q = (pr).max_q, max_k = (pr).max_k;                                               \
    long long* const __restrict__ fault = (pr).fault;                                               \
    (void)H; (void)Hkv; (void)Sq; (void)Sk; (void)scale; (void)scale_log2; (void)win_left;          \
    (void)win_right; (void)cap_in; (void)cap_out; (void)cu_q; (void)cu_k; (void)max_q; (void)max_k; \
    (void)fault
