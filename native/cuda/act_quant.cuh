// Activation quantization exactly as ggml's CPU from_float does it (see ntx_engine/quants.py):
// the matvec kernels then multiply the dequantized weights by these x_hat values. The scalar
// steps are shared by the warp-parallel kernels (matvec.cu) and the host block functions below
// (tested bit-exact against numpy by tests/cuda/test_host_decoders.py).
#pragma once
#include "ntx_quants.cuh"  // NTX_MUL, ntx_round_f16

// Q8_0/Q8_1: d = amax/127, inverse 127/amax (0 for an all-zero block), q = clamp(rint(x*inv)).
NTX_HD void ntx_q8_scale(float amax, float* d, float* inv) {
    *d = amax / 127.f;
    *inv = amax != 0.f ? 127.f / amax : 0.f;
}

NTX_HD float ntx_q8_q(float x, float inv) { return fminf(fmaxf(rintf(NTX_MUL(x, inv)), -128.f), 127.f); }

// Q8_K (quantize_row_q8_K_ref): iscale = -127 / (signed value of largest magnitude).
NTX_HD void ntx_q8k_scale(float smax, float* iscale, float* d) {
    *iscale = smax != 0.f ? -127.f / smax : 0.f;
    *d = *iscale != 0.f ? 1.f / *iscale : 0.f;
    // a tiny max overflows iscale: ggml's int8 truncation then gives all-zero quants
    if (isinf(*iscale)) *iscale = 0.f;
}

NTX_HD float ntx_q8k_q(float x, float iscale) { return fminf(rintf(NTX_MUL(iscale, x)), 127.f); }

// One 32-value block: x_hat = fp16(d) * q; *s_out = fp16(d * sum(q)).
NTX_HD void ntx_q8_block(const float* x, float* x_hat, float* s_out) {
    float amax = 0.f, d, inv;
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
    ntx_q8_scale(amax, &d, &inv);
    const float d16 = ntx_round_f16(d);
    float sum = 0.f;
    for (int i = 0; i < 32; ++i) {
        const float q = ntx_q8_q(x[i], inv);
        sum += q;  // small integers: exact in any order
        x_hat[i] = NTX_MUL(d16, q);
    }
    if (s_out) *s_out = ntx_round_f16(NTX_MUL(d, sum));
}

// One 256-value block; the first value of largest magnitude sets the scale (numpy argmax).
NTX_HD void ntx_q8k_block(const float* x, float* x_hat) {
    int best = 0;
    for (int i = 1; i < 256; ++i)
        if (fabsf(x[i]) > fabsf(x[best])) best = i;
    float iscale, d;
    ntx_q8k_scale(x[best], &iscale, &d);
    for (int i = 0; i < 256; ++i) x_hat[i] = NTX_MUL(d, ntx_q8k_q(x[i], iscale));
}

#ifdef __CUDACC__
// The Q8_K pivot of one 256-value block read by a warp (8 values per lane, returned in v): the
// index of the largest |x|, the first one on ties, as ggml's reference scan picks it.
__device__ __forceinline__ int ntx_q8k_pivot_warp(const float* xb, float v[8], int lane) {
    float best = -1.f;
    int idx = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = xb[lane + 32 * i];
        if (fabsf(v[i]) > best) { best = fabsf(v[i]); idx = lane + 32 * i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ob > best || (ob == best && oi < idx)) { best = ob; idx = oi; }
    }
    return idx;
}
#endif
