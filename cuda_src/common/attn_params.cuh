// The parameters of the attention kernels: one struct a kernel, passed by value as a
// __grid_constant__ (flash-attention's Flash_fwd_params). The host packs a struct field by field,
// by name, against its declaration here (cukern/_signatures.py reads it from the source), so a
// field added here is a name added at the launch, never a shifted argument list. A kernel is a
// thin __global__ wrapper handing the struct's fields to its body (<kernel>_body, inlined),
// whose parameters keep their names: the body's code is compiled as it was with a parameter list.
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

// The wide head sizes' Hopper backward kernels' parameters (attention_bwd_sm90_d256,
// attention_bwd_sm90_mla) besides the tensor maps: rows (B, H, ceil(Sq / 64), 2, 64) float32
// (lse * log2(e) and Dsum a query tile), dK and dV (B, Sk, Hkv, their head sizes) with their
// strides in elements (batch, sequence, head), the problem; ORDERED: a turn counter a `rows`
// query tile, zeroed (else null).
template <typename T>
struct BwdWideParams {
    const float* rows;
    T* dk;
    T* dv;
    int* turns;
    long long dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh;
    Problem problem;
};

}  // namespace attention
}  // namespace cuk
