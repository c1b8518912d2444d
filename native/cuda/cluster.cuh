// Thread-block cluster helpers (sm_90): barriers and distributed shared memory (attn_grid.cu's
// cluster form). On older architectures NTX_CLUSTERS is 0 and the helpers are empty (no kernel
// there uses a cluster).
#pragma once

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define NTX_CLUSTERS 1
// Every thread of every block of the cluster: the shared-memory writes before it are visible to
// the cluster's blocks after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// The address of the same shared variable in block `rank` of the cluster (a generic pointer).
template <typename T>
__device__ __forceinline__ const T* cluster_peer(const T* p, int rank) {
    unsigned long long r;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(p), "r"(rank));
    return reinterpret_cast<const T*>(r);
}
#else
#define NTX_CLUSTERS 0
__device__ __forceinline__ void cluster_sync() {}
__device__ __forceinline__ void cluster_arrive() {}
__device__ __forceinline__ void cluster_wait() {}
template <typename T>
__device__ __forceinline__ const T* cluster_peer(const T* p, int) { return p; }
#endif
