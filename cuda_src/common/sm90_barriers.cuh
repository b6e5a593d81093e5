// Hopper (sm_90a) synchronization as inline PTX: mbarriers (TMA completion, the stages of a
// ring), named barriers among warpgroups, setmaxnreg (warp specialization) and the load ring
// that a producer warpgroup or thread 0 drives.
#pragma once
#include "sm90_base.cuh"

namespace cuk {

// ---- mbarriers ----------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(shared_address(bar)), "r"(count) : "memory");
}
// (the initialization visible to the async proxy, i.e. to TMA, before any copy completes on it)
__device__ __forceinline__ void mbarrier_init_fence() {
#if CUK_SM90A || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Every given barrier initialized for one arrival by thread 0, made visible to TMA, and the
// block synchronized: the prologue of a kernel that copies by TMA.
template <typename... B>
__device__ __forceinline__ void mbarrier_init_block(B*... bars) {
    if (threadIdx.x == 0) {
        (mbarrier_init(bars, 1), ...);
        mbarrier_init_fence();
    }
    __syncthreads();
}
// This thread arrives and announces `bytes` more to come from copies completing on the barrier.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(shared_address(bar)), "r"(bytes)
                 : "memory");
#endif
}
// This thread arrives on the barrier (no bytes announced): a consumer releasing a buffer.
__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(shared_address(bar)) : "memory");
#endif
}
// Waits until the barrier's phase of the given parity (0, 1, 0, ...) has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" :: "r"(shared_address(bar)), "r"(parity) : "memory");
#endif
}

// A barrier among `count` threads (whole warps) under id 1..15 (0 is __syncthreads'): the
// warpgroups of a block meet without stopping the others.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
// Registers a thread of this warpgroup may hold from here on (warp specialization: a producer
// warpgroup gives registers back, the consumer warpgroups take them). All warps of the
// warpgroup execute it.
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
#if CUK_SM90A
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGS));
#endif
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
#if CUK_SM90A
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGS));
#endif
}
// Who loads a ring of STAGES shared-memory buffers holding `count` items in turn (item i in
// buffer i % STAGES; `load(i)` issues its TMA). The computing threads are the first CONSUMERS
// warpgroups. PRODUCER: the warpgroup after them is a producer that keeps 24 registers; its first
// thread issues every load, each once bar_free of its buffer (one phase an item) says the item
// before it there was released; it returns false (those threads are done) and the computing
// threads, with the registers the producer gave back (CONSUMER_REGS: 240 for two warpgroups,
// 160 for three, less where two blocks share the SM), true. Otherwise thread 0 issues the first
// STAGES - 1 loads (the computing threads refill the ring) and every thread returns true.
// `side` (PRODUCER): the work of the producer warpgroup's next SIDES warps (their lanes 0), if
// any, `side(j)` for the warp after the loader's j.
struct NoSide {
    __device__ __forceinline__ void operator()(int) const {}
};
template <bool PRODUCER, int STAGES, int CONSUMERS = 2, int CONSUMER_REGS = CONSUMERS == 2 ? 240 : 160, int SIDES = 1,
          typename Load, typename Side = NoSide>
__device__ __forceinline__ bool ring_loads(int count, unsigned long long* bar_free, Load load, Side side = Side{}) {
    static_assert(SIDES >= 1 && SIDES <= 3, "SIDES: warps of the producer warpgroup after the loader's");
    static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three computing warpgroups");
    if constexpr (PRODUCER) {
        if (threadIdx.x >= CONSUMERS * 128) {
            setmaxnreg_dec<24>();
            if (threadIdx.x == CONSUMERS * 128)
                for (int i = 0; i < count; ++i) {
                    if (i >= STAGES) mbarrier_wait(&bar_free[i % STAGES], (i / STAGES - 1) & 1);
                    load(i);
                }
            else if (threadIdx.x % 32 == 0 && threadIdx.x < CONSUMERS * 128 + 32 * (SIDES + 1))
                side(static_cast<int>(threadIdx.x - CONSUMERS * 128) / 32 - 1);
            return false;
        }
        setmaxnreg_inc<CONSUMER_REGS>();
    } else if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < STAGES - 1; ++i)
            if (i < count) load(i);
    }
    return true;
}
// Arrive at barrier `id` without waiting (the other side of a named_barrier_sync).
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}
}  // namespace cuk
