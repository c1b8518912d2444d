// Helpers of the decode attention kernels (attention.cu's and attn_grid.cu's): warp reductions
// and a lane's share of an F16 K/V row as floats.
#pragma once
#include "ntx_half.cuh"

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// V = head_dim / 32 consecutive fp16 values of a K row, lane's share, as floats (vector loads:
// rows start 64-byte aligned since kv_dim is a multiple of 32).
template <int V>
__device__ __forceinline__ void ld_halves(const uint16_t* p, float* f) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int i = 0; i < V; i += 4) {
            const uint2 w = *reinterpret_cast<const uint2*>(p + i);
            f[i] = ntx_h2f((uint16_t)(w.x & 0xffffu)); f[i + 1] = ntx_h2f((uint16_t)(w.x >> 16));
            f[i + 2] = ntx_h2f((uint16_t)(w.y & 0xffffu)); f[i + 3] = ntx_h2f((uint16_t)(w.y >> 16));
        }
    } else if constexpr (V % 2 == 0) {
#pragma unroll
        for (int i = 0; i < V; i += 2) {
            const uint32_t w = *reinterpret_cast<const uint32_t*>(p + i);
            f[i] = ntx_h2f((uint16_t)(w & 0xffffu)); f[i + 1] = ntx_h2f((uint16_t)(w >> 16));
        }
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] = ntx_h2f(p[i]);
    }
}
