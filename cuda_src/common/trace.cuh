// Phase timestamps for measuring a kernel from inside (tools/trace_attention.py): compiled in
// only when the source is built with CUK_TRACE defined (the tool prepends the define), else
// every stamp is empty. Block b's record is the CUK_TRACE_SLOTS (default 16; a source that needs
// more stamps defines it first) values from cuk_trace[b * CUK_TRACE_SLOTS], for the first
// CUK_TRACE_BLOCKS blocks, numbered x fastest, then y, then z: the last two slots are the SM and
// the global timer (ns) at the stamp the kernel marks as the first, the others clock64() stamps
// it names.
#pragma once

#ifdef CUK_TRACE
#define CUK_TRACE_BLOCKS 16384
#ifndef CUK_TRACE_SLOTS
#define CUK_TRACE_SLOTS 16
#endif
__device__ unsigned long long cuk_trace[CUK_TRACE_BLOCKS * CUK_TRACE_SLOTS];

namespace cuk {
__device__ __forceinline__ void trace_stamp(int slot, bool first) {
    const long long blk =
        (static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
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
