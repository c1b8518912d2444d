// Element math shared by ops.cu and fused.cu, so the fused kernels round exactly as the ones
// they replace.
#pragma once
#include "ntx_half.cuh"

// silu(g) * u, as the numpy backend computes it: g / (1 + exp(-g)) * u.
__device__ __forceinline__ float ntx_swiglu(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// RoPE of pair idx (0 .. n_heads*head_dim/2) of one token's row x (n_heads*head_dim). theta_i =
// pos * scale^i as a running float32 product (ggml's rope cache), angle = theta_i / ff[i] *
// freq_scale. neox != 0 pairs (i, i + rope_dim/2), else adjacent (2i, 2i+1); pairs past rope_dim
// are copied. Returns the two offsets in the row (*a, *b) and their rotated values.
__device__ __forceinline__ void ntx_rope_pair(const float* __restrict__ x, int idx, int head_dim, int rope_dim,
                                              int pos, const float* __restrict__ ff, float scale, float freq_scale,
                                              int neox, int* a, int* b, float* o0, float* o1) {
    const int half_hd = head_dim / 2, h = idx / half_hd, i = idx % half_hd, rd2 = rope_dim / 2;
    const int base = h * head_dim;
    if (i >= rd2) {
        *a = base + (neox ? rope_dim + 2 * (i - rd2) : 2 * i);
        *b = *a + 1;
        *o0 = x[*a];
        *o1 = x[*b];
        return;
    }
    float theta = (float)pos;
    for (int m = 0; m < i; ++m) theta = __fmul_rn(theta, scale);
    const float angle = __fmul_rn(__fdiv_rn(theta, ff ? ff[i] : 1.0f), freq_scale);
    const float c = cosf(angle), s = sinf(angle);
    *a = base + (neox ? i : 2 * i);
    *b = base + (neox ? i + rd2 : 2 * i + 1);
    const float x0 = x[*a], x1 = x[*b];
    *o0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    *o1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}
