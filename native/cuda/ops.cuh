// Element math shared by ops.cu and fused.cu, so the fused kernels round exactly as the ones
// they replace.
#pragma once
#include "ntx_half.cuh"

// silu(g) * u, as the numpy backend computes it: g / (1 + exp(-g)) * u.
__device__ __forceinline__ float ntx_swiglu(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// Where pair i (0 .. head_dim/2) of a head row sits: neox != 0 pairs (i, i + rope_dim/2), else
// adjacent (2i, 2i+1); pairs past rope_dim are copied (false), the others rotated (true).
__device__ __forceinline__ bool ntx_rope_offsets(int i, int rope_dim, int neox, int* a, int* b) {
    const int rd2 = rope_dim / 2;
    if (i >= rd2) {
        *a = neox ? rope_dim + 2 * (i - rd2) : 2 * i;
        *b = *a + 1;
        return false;
    }
    *a = neox ? i : 2 * i;
    *b = neox ? i + rd2 : 2 * i + 1;
    return true;
}

// (x0, x1) rotated as pair i at pos: theta_i = pos * scale^i as a running float32 product (ggml's
// rope cache), angle = theta_i / ff[i] * freq_scale.
__device__ __forceinline__ void ntx_rope_rotate(float x0, float x1, int i, int pos, const float* __restrict__ ff,
                                                float scale, float freq_scale, float* o0, float* o1) {
    float theta = (float)pos;
    for (int m = 0; m < i; ++m) theta = __fmul_rn(theta, scale);
    const float angle = __fmul_rn(__fdiv_rn(theta, ff ? ff[i] : 1.0f), freq_scale);
    const float c = cosf(angle), s = sinf(angle);
    *o0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    *o1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// RoPE of pair idx (0 .. n_heads*head_dim/2) of one token's row x (n_heads*head_dim)
// (ntx_rope_offsets, ntx_rope_rotate). Returns the two offsets in the row (*a, *b) and their values.
__device__ __forceinline__ void ntx_rope_pair(const float* __restrict__ x, int idx, int head_dim, int rope_dim,
                                              int pos, const float* __restrict__ ff, float scale, float freq_scale,
                                              int neox, int* a, int* b, float* o0, float* o1) {
    const int half_hd = head_dim / 2, h = idx / half_hd, i = idx % half_hd;
    const int base = h * head_dim;
    const bool rot = ntx_rope_offsets(i, rope_dim, neox, a, b);
    *a += base;
    *b += base;
    if (!rot) {
        *o0 = x[*a];
        *o1 = x[*b];
        return;
    }
    ntx_rope_rotate(x[*a], x[*b], i, pos, ff, scale, freq_scale, o0, o1);
}
