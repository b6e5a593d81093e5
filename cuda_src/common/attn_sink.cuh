// The end of a forward row: O's normalizing factor and the row's log-sum-exp, with an optional
// attention sink (GPT-OSS, StreamingLLM): a learned logit per head, in the units of the scaled
// (and capped) scores, that joins each row's softmax denominator and carries no value. The
// backward needs nothing else from it: P = exp(S - lse) with the sink's lse is the probability
// it trains, and the sink's own gradient, -sum_rows exp(sink - lse) Dsum, is attention_bwd_sink's.
#pragma once

#include "reduce.cuh"

namespace cuk {
namespace attention {

// max_log2: the row's running maximum (log2 units); sum: its sum of exp2(s - max_log2) (0 for a
// row that sees no key); sink_log2: the sink times log2(e), -inf for none. inv multiplies O's
// accumulator; lse is natural-log, +inf for a row with neither a key nor a sink (zeros out).
__device__ __forceinline__ void finish_row(float max_log2, float sum, float sink_log2, float& inv, float& lse)
{
    if (!(sink_log2 > neg_inf())) {
        inv = sum > 0.f ? 1.f / sum : 0.f;
        lse = sum > 0.f ? (max_log2 + log2f(sum)) * 0.6931471805599453f : __int_as_float(0x7f800000);
        return;
    }
    const float m = sum > 0.f ? fmaxf(max_log2, sink_log2) : sink_log2;
    const float keep = sum > 0.f ? exp2f(max_log2 - m) : 0.f;   // the keys' share, rescaled to m
    const float total = sum * keep + exp2f(sink_log2 - m);
    inv = keep / total;
    lse = (m + log2f(total)) * 0.6931471805599453f;
}

// The sink of head h times log2(e), or -inf where there are none (sinks null).
__device__ __forceinline__ float sink_log2_of(const float* __restrict__ sinks, int h)
{
    return sinks ? sinks[h] * LOG2E : neg_inf();
}

}  // namespace attention
}  // namespace cuk
