// One row of RMSNorm, shared by ops.cu's rmsnorm and matvec_fast.cu's rmsnorm_quanti so both
// give bit-identical rows: out = x * (1 / sqrt(mean(x^2) + eps)) * w, the mean summed in double
// as ggml does. The whole block works on the row; part: 32 doubles of shared memory.
#pragma once
#include "ntx_half.cuh"

__device__ __forceinline__ void ntx_rmsnorm_row(const float* __restrict__ xr, const float* __restrict__ w,
                                                float* __restrict__ outr, int k, float eps, double* part) {
    double s = 0.0;
    for (int i = threadIdx.x; i < k; i += blockDim.x) s += (double)xr[i] * (double)xr[i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int i = 0; i < (int)(blockDim.x >> 5); ++i) t += part[i];
        part[0] = t;
    }
    __syncthreads();
    const float mean = (float)(part[0] / (double)k);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int i = threadIdx.x; i < k; i += blockDim.x) outr[i] = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
}
