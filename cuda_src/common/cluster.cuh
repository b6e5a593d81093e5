// Thread-block clusters (sm_90): a CTA's rank and its cluster's place in the grid, the
// cluster-wide barrier, and loads from a peer CTA's shared memory (distributed shared memory).
// Compiled for every architecture so that kernels using them exist everywhere; their callers
// run them only on sm_90 and newer (__CUDA_ARCH__ guards inside).
#pragma once

namespace cuk {

__device__ __forceinline__ unsigned int cluster_rank() {
    unsigned int r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

__device__ __forceinline__ unsigned int cluster_index() {
    unsigned int r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
#endif
    return r;
}

__device__ __forceinline__ unsigned int cluster_count() {
    unsigned int r = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
#endif
    return r;
}

// Every thread of every CTA of the cluster arrives; shared-memory writes before it are visible
// to the cluster's loads after it (release / acquire).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The address of `p` (this CTA's shared memory) in the shared memory of CTA `rank` of the
// cluster (shared::cluster space, for ld/st.shared::cluster and st.async).
__device__ __forceinline__ unsigned int peer_address(const void* p, unsigned int rank) {
    unsigned int remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned int local = static_cast<unsigned int>(__cvta_generic_to_shared(p));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
#endif
    return remote;
}

// The float at `p` (this CTA's shared memory) in the shared memory of CTA `rank` of the cluster.
__device__ __forceinline__ float load_peer(const float* p, unsigned int rank) {
    float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(peer_address(p, rank)) : "memory");
#endif
    return v;
}

// The cluster barrier in two halves: every thread of every CTA arrives (relaxed: orders
// nothing but the arrival, e.g. after initializing the mbarriers peers will signal), and later
// waits for all arrivals. One wait per arrive.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

// One-sided: four floats into `slot` of CTA `rank` (the same offset as `slot` here), their 16
// bytes completing on that CTA's mbarrier at the offset of `bar` (st.async: the receiver waits
// on its barrier, with acquire at cluster scope, instead of the cluster meeting at a barrier).
__device__ __forceinline__ void push_peer(float4 v, const float4* slot, const unsigned long long* bar,
                                          unsigned int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(peer_address(slot, rank)), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w),
                    "r"(peer_address(bar, rank)) : "memory");
#endif
}

}  // namespace cuk
