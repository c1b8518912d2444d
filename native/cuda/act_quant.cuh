// Activation quantization exactly as ggml's CPU from_float does it (see ntx_engine/quants.py):
// the matvec kernels then multiply the dequantized weights by these x_hat values.
#pragma once
#include "ntx_half.cuh"

// Q8_0/Q8_1 of one 32-value block: x_hat = fp16(d) * q; *s_out = fp16(d * sum(q)).
NTX_HD void ntx_q8_block(const float* x, float* x_hat, float* s_out) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.f;
    const float inv = amax != 0.f ? 127.f / amax : 0.f;
    const float d16 = ntx_round_f16(d);
    float sum = 0.f;
    for (int i = 0; i < 32; ++i) {
        const float q = fminf(fmaxf(rintf(NTX_MUL(x[i], inv)), -128.f), 127.f);
        sum += q;  // small integers: exact in any order
        x_hat[i] = NTX_MUL(d16, q);
    }
    if (s_out) *s_out = ntx_round_f16(NTX_MUL(d, sum));
}

// Q8_K of one 256-value block (quantize_row_q8_K_ref): the signed value of largest magnitude,
// the first one on ties, sets iscale = -127 / max.
NTX_HD void ntx_q8k_block(const float* x, float* x_hat) {
    int best = 0;
    for (int i = 1; i < 256; ++i)
        if (fabsf(x[i]) > fabsf(x[best])) best = i;
    const float smax = x[best];
    const float iscale = smax != 0.f ? -127.f / smax : 0.f;
    const float d = iscale != 0.f ? 1.f / iscale : 0.f;
    for (int i = 0; i < 256; ++i) x_hat[i] = NTX_MUL(d, fminf(rintf(NTX_MUL(iscale, x[i])), 127.f));
}
