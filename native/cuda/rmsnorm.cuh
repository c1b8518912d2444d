// One row of RMSNorm, shared by ops.cu's rmsnorm and fused.cu's add_rmsnorm_quanti so both give
// bit-identical rows: out = x * (1 / sqrt(mean(x^2) + eps)) * w, the mean summed in double as
// ggml does. The whole block works on the row; part: 32 doubles of shared memory.
//
// A thread's elements are i = threadIdx.x + j * blockDim.x, summed in ascending j. Rows of at most
// NTX_NORM_REGS * blockDim.x values (8192 with 1024 threads) are read once into registers, all
// loads in flight together: a decode step's norm is one row, so its time is memory latency, and a
// loop that loads, adds and stores one element a turn pays it once a turn.
#pragma once
#include "ntx_half.cuh"

#define NTX_NORM_REGS 8
#define NTX_NORM_THREADS 1024  // cuda_kernels.NORM_THREADS: the kernels' launch bounds (64 registers a thread)

// The total of the partial sums s of `warps` warps' threads (warp butterflies, then warp 0's in order);
// sync() is their barrier (part: a double a warp).
template <class Sync>
__device__ __forceinline__ double ntx_warps_total(double s, double* part, int warps, Sync sync) {
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    sync();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int i = 0; i < warps; ++i) t += part[i];
        part[0] = t;
    }
    sync();
    return part[0];
}

// The block's total of the threads' partial sums s.
__device__ __forceinline__ double ntx_block_total(double s, double* part) {
    return ntx_warps_total(s, part, (int)(blockDim.x >> 5), [] { __syncthreads(); });
}

__device__ __forceinline__ float ntx_norm_scale(double total, int k, float eps) {
    const float mean = (float)(total / (double)k);
    return 1.0f / sqrtf(mean + eps);
}

// Whether a row of k values takes the register path with this block (ntx_add_rmsnorm_regs).
__device__ __forceinline__ bool ntx_norm_in_regs(int k) { return k <= NTX_NORM_REGS * (int)blockDim.x; }

// The thread's norm weights (wv[j]: element threadIdx.x + j * blockDim.x) for the register path:
// a model constant, so a kernel may load them before its PDL wait.
__device__ __forceinline__ void ntx_norm_weights(const float* __restrict__ w, int k, float* wv) {
#pragma unroll
    for (int j = 0; j < NTX_NORM_REGS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < k) wv[j] = w[i];
    }
}

// ntx_add_rmsnorm_row's register path (ntx_norm_in_regs(k)), which also leaves the thread's
// outputs in o (o[j]: element threadIdx.x + j * blockDim.x, where it exists). wpre: the weights
// already in registers (ntx_norm_weights), or null to load them here.
__device__ __forceinline__ void ntx_add_rmsnorm_regs(const float* __restrict__ xr, const float* __restrict__ dr,
                                                     float* __restrict__ s_out, const float* __restrict__ w,
                                                     float* __restrict__ outr, int k, float eps, double* part,
                                                     float* o, const float* wpre = nullptr) {
    const int bd = blockDim.x;
    float v[NTX_NORM_REGS], wv[NTX_NORM_REGS];
#pragma unroll
    for (int j = 0; j < NTX_NORM_REGS; ++j) {
        const int i = threadIdx.x + j * bd;
        if (i < k) {
            v[j] = dr != nullptr ? __fadd_rn(xr[i], dr[i]) : xr[i];
            wv[j] = wpre != nullptr ? wpre[j] : w[i];
        }
    }
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < NTX_NORM_REGS; ++j)
        if (threadIdx.x + j * bd < k) s += (double)v[j] * (double)v[j];
    const float scale = ntx_norm_scale(ntx_block_total(s, part), k, eps);
#pragma unroll
    for (int j = 0; j < NTX_NORM_REGS; ++j) {
        const int i = threadIdx.x + j * bd;
        if (i < k) {
            if (s_out != nullptr) s_out[i] = v[j];
            o[j] = __fmul_rn(__fmul_rn(v[j], scale), wv[j]);
            outr[i] = o[j];
        }
    }
}

// s = x + d (d null: s = x; s_out null: not stored), out = rmsnorm(s) * w. wpre: as
// ntx_add_rmsnorm_regs's (used on the register path only).
__device__ __forceinline__ void ntx_add_rmsnorm_row(const float* __restrict__ xr, const float* __restrict__ dr,
                                                    float* __restrict__ s_out, const float* __restrict__ w,
                                                    float* __restrict__ outr, int k, float eps, double* part,
                                                    const float* wpre = nullptr) {
    const int bd = blockDim.x;
    if (ntx_norm_in_regs(k)) {
        float o[NTX_NORM_REGS];
        ntx_add_rmsnorm_regs(xr, dr, s_out, w, outr, k, eps, part, o, wpre);
        return;
    }
    double s = 0.0;  // longer rows: the same sums, element by element
    for (int i = threadIdx.x; i < k; i += bd) {
        const float v = dr != nullptr ? __fadd_rn(xr[i], dr[i]) : xr[i];
        if (s_out != nullptr) s_out[i] = v;
        s += (double)v * (double)v;
    }
    const float scale = ntx_norm_scale(ntx_block_total(s, part), k, eps);
    for (int i = threadIdx.x; i < k; i += bd) {
        const float v = s_out != nullptr ? s_out[i] : xr[i];  // the thread's own stores: no barrier needed
        outr[i] = __fmul_rn(__fmul_rn(v, scale), w[i]);
    }
}

__device__ __forceinline__ void ntx_rmsnorm_row(const float* __restrict__ xr, const float* __restrict__ w,
                                                float* __restrict__ outr, int k, float eps, double* part) {
    ntx_add_rmsnorm_row(xr, nullptr, nullptr, w, outr, k, eps, part);
}
