// Helpers of the decode attention kernels (attention.cu's and attn_grid.cu's): a lane's share of
// an F16 K/V row as floats.
#pragma once
#include "ntx_half.cuh"
#include "warp.cuh"

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

// The scores s[g] = q_g . k of one K row for the G <= gmax query heads of a GQA group, by one
// warp: lane holds V values of the row (kf) and reads the fp16-rounded q of head g at
// qs + g * 32 * V + lane * V; the G butterflies run side by side (5 dependent steps, not 5 G),
// and every lane ends with every total.
template <int V, int GMAX>
__device__ __forceinline__ void group_dots(const float* qs, const float* kf, int G, int lane, float* s) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        if (g >= G) break;
        const float* qh = qs + g * 32 * V + lane * V;
        s[g] = 0.f;
#pragma unroll
        for (int i = 0; i < V; ++i) s[g] += qh[i] * kf[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            if (g >= G) break;
            s[g] += __shfl_xor_sync(0xffffffffu, s[g], o);
        }
    }
}
