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

// The two halves of a cluster barrier, for a CTA that only needs its peers to be past a point
// (e.g. done reading its shared memory before it leaves). The arrival is relaxed: it orders none
// of this thread's memory operations, so it does not wait for its global stores to complete, as
// a release would. (A peer's loads whose values it has used before arriving are complete.)
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

// The float at `p` (this CTA's shared memory) in the shared memory of CTA `rank` of the cluster.
__device__ __forceinline__ float load_peer(const float* p, unsigned int rank) {
    float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned long long generic = reinterpret_cast<unsigned long long>(p), local;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(local) : "l"(generic));
    unsigned int remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(static_cast<unsigned int>(local)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
    return v;
}

}  // namespace cuk
