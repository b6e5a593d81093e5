// Phase timestamps for measuring a kernel from inside (tools/trace_attention.py): compiled in
// only when the source is built with CUK_TRACE defined (the tool prepends the define), else
// every stamp is empty. Block b's record is cuk_trace[b * 16 .. b * 16 + 15] (the first
// CUK_TRACE_BLOCKS blocks, numbered x fastest): slots 0 .. 13 are clock64() stamps the kernel
// names, 14 is the SM, 15 the global timer (ns) at the stamp the kernel marks as the first.
// A source that needs more stamps defines CUK_TRACE_SLOTS (the SM and the timer then take its
// last two slots).
#pragma once

#ifdef CUK_TRACE
#define CUK_TRACE_BLOCKS 16384
#ifndef CUK_TRACE_SLOTS
#define CUK_TRACE_SLOTS 16
#endif
__device__ unsigned long long cuk_trace[CUK_TRACE_BLOCKS * CUK_TRACE_SLOTS];

namespace cuk {
__device__ __forceinline__ void trace_stamp(int slot, bool first) {
    const long long blk = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
    if (blk >= CUK_TRACE_BLOCKS) return;
    unsigned long long* const rec = cuk_trace + blk * CUK_TRACE_SLOTS;
    rec[slot] = clock64();
    if (first) {
        unsigned int sm;
        unsigned long long ns;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
        rec[CUK_TRACE_SLOTS - 2] = sm;
        rec[CUK_TRACE_SLOTS - 1] = ns;
    }
}
}  // namespace cuk
#define CUK_TRACE_STAMP(cond, slot, first) do { if (cond) cuk::trace_stamp((slot), (first)); } while (0)
#else
#define CUK_TRACE_STAMP(cond, slot, first) do {} while (0)
#endif
