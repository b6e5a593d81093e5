// Hopper (sm_90a) TMA as inline PTX: tile loads (cp.async.bulk.tensor) completing on an
// mbarrier, bulk loads, stores and reductions through tensor maps, the async-proxy fence,
// reductions in turns, and zeroing tile rows for a warpgroup's next product.
#pragma once
#include "sm90_barriers.cuh"

namespace cuk {

// ---- TMA ----------------------------------------------------------------------------------
// A box of the tensor map at coordinates (x innermost, y) into shared memory, completing (bytes
// counted) on `bar`.
__device__ __forceinline__ void tma_load_2d(void* smem, const CUtensorMap* map, int x, int y, unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        :: "r"(shared_address(smem)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y),
           "r"(shared_address(bar)) : "memory");
#endif
}
__device__ __forceinline__ void tma_load_3d(void* smem, const CUtensorMap* map, int x, int y, int z,
                                            unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        :: "r"(shared_address(smem)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z),
           "r"(shared_address(bar)) : "memory");
#endif
}
__device__ __forceinline__ void tma_load_4d(void* smem, const CUtensorMap* map, int x, int y, int z, int w,
                                            unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
        :: "r"(shared_address(smem)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(w),
           "r"(shared_address(bar)) : "memory");
#endif
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into shared
// memory, completing (bytes counted) on `bar`.
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, unsigned int bytes, unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(shared_address(smem)), "l"(reinterpret_cast<unsigned long long>(gmem)), "r"(bytes),
                    "r"(shared_address(bar)) : "memory");
#endif
}
// The box of shared memory at `smem` added (float32 +) into the tensor map's box at (x innermost,
// y, z, w); elements outside the tensor are skipped. One bulk group a call (tma_store_commit).
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, const void* smem, int x, int y, int z, int w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
        :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(shared_address(smem)), "r"(x), "r"(y), "r"(z), "r"(w)
        : "memory");
#endif
}
// The box of shared memory at `smem` stored into the tensor map's box at (x innermost, y, z, w);
// elements outside the tensor are skipped.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* smem, int x, int y, int z, int w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(shared_address(smem)), "r"(x), "r"(y), "r"(z),
                    "r"(w) : "memory");
#endif
}
__device__ __forceinline__ void tma_store_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}
// Wait (the issuing thread) until at most PENDING of its bulk groups still read shared memory
// (the buffer may be written again), or, with `.read` dropped, until their writes are done.
template <int PENDING>
__device__ __forceinline__ void tma_store_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(PENDING) : "memory");
#endif
}
template <int PENDING>
__device__ __forceinline__ void tma_store_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(PENDING) : "memory");
#endif
}
// Shared memory written by ordinary stores, next read by TMA or wgmma (each writing thread,
// before the barrier that publishes it).
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Reductions in turns (a deterministic sum by TMA reduce-add): a counter in global memory a
// destination tile, zeroed before the launch; a writer waits until the count reaches its turn
// times the writers of a turn, adds, and once its add is complete (cp.async.bulk.wait_group 0)
// passes the turn on by one. The proxy fences order the async-proxy adds against the counter's
// generic-proxy release and acquire.
__device__ __forceinline__ void turn_wait(const int* counter, int target) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    int v;
    do {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    } while (v < target);
    asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
}
__device__ __forceinline__ void turn_pass(int* counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(counter) : "memory");
#endif
}

// A warp's 16 rows of float32 accumulators in the wgmma layout (rows g and g + 8, columns
// 8 j + 2 t (+1), j < N / 4) staged as N / 16 boxes of 16 rows x 32 floats, 2048 bytes apart, in
// the 128-byte swizzle (chunk c of row r at c ^ (r % 8): conflict-free stores), as a TMA store or
// reduce-add of such boxes reads them.
template <int N>
__device__ __forceinline__ void stage_rows_sw128(unsigned char* stage, const float (&acc)[N], int g, int t) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r)
            *reinterpret_cast<float2*>(stage + (j / 4) * 2048 + (g + 8 * r) * 128 +
                                       (((2 * (j % 4) + t / 2) ^ g) << 4) + 8 * (t & 1)) =
                make_float2(acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1]);
}

// Rows first .. rows - 1 of two tiles `a` and `b`, each of `boxes` boxes of `rows` 128-byte rows
// (box_bytes apart), set to zero by the 128 threads of a warpgroup and made visible to its own
// next wgmma (fenced for the async proxy, then its barrier `bar`). A whole row of a
// 128-byte-swizzled box is one row of bytes, so the swizzle does not matter. Several warpgroups
// may zero the same rows: they write the same zeros, each before its own reads. (Inlined: as a
// call, its ABI spilled attention_bwd_sm90's 255-register deterministic instances 4-8 bytes.)
__device__ __forceinline__ void zero_tile_rows(unsigned char* a, unsigned char* b, int boxes, int box_bytes, int first,
                                               int rows, int bar) {
    const int tid = threadIdx.x % 128, n = (rows - first) * 8;   // 16-byte chunks a box
#pragma unroll 1
    for (int box = 0; box < boxes; ++box)
#pragma unroll 1
        for (int i = tid; i < n; i += 128) {
            const int at = box * box_bytes + first * 128 + 16 * i;
            *reinterpret_cast<uint4*>(a + at) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4*>(b + at) = make_uint4(0u, 0u, 0u, 0u);
        }
    fence_proxy_async();
    named_barrier_sync(bar, 128);
}

// Rows s < 64 of a warpgroup's part of two tiles `a` and `b` (`BOXES` boxes of 128-byte,
// 128-byte-swizzled rows, box_bytes apart) replaced by rows from(s) of the same part, a
// permutation, by its 128 threads: a box's rows read, the barrier `bar`, written; fenced for the
// async proxy and published by `bar` for the wgmma reads that follow.
template <int BOXES, typename From>
__device__ __forceinline__ void permute_tile_rows(unsigned char* a, unsigned char* b, int box_bytes, From from, int bar) {
    const int tid = threadIdx.x % 128, c = tid % 8;
#pragma unroll
    for (int part = 0; part < 2 * BOXES; ++part) {
        unsigned char* const base = (part & 1 ? b : a) + (part / 2) * box_bytes;
        uint4 v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int s = tid / 8 + 16 * i, src = from(s);
            v[i] = *reinterpret_cast<const uint4*>(base + src * 128 + ((c ^ (src & 7)) << 4));
        }
        named_barrier_sync(bar, 128);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int s = tid / 8 + 16 * i;
            *reinterpret_cast<uint4*>(base + s * 128 + ((c ^ (s & 7)) << 4)) = v[i];
        }
    }
    fence_proxy_async();
    named_barrier_sync(bar, 128);
}
}  // namespace cuk
