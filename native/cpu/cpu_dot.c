/*
 * cpu_dot.c - portable C dot products of one weight row with one activation row, per type,
 * in the integer-then-scale form of ggml's vec_dot_* (each block's integer sum is exact; only
 * the float accumulation order differs from ggml's SIMD kernels).
 */
#include "cpu_impl.h"

static float dot_f32(int64_t k, const void *w, const void *a) {
    const float *x = w, *y = a;
    float s = 0.0f;
    for (int64_t i = 0; i < k; i++) s += x[i] * y[i];
    return s;
}

static float dot_f16(int64_t k, const void *w, const void *a) {
    const half_t *x = w;
    const float *y = a;
    float s = 0.0f;
    for (int64_t i = 0; i < k; i++) s += f16_to_f32(x[i]) * y[i];
    return s;
}

static float dot_bf16(int64_t k, const void *w, const void *a) {
    const uint16_t *x = w;
    const float *y = a;
    float s = 0.0f;
    for (int64_t i = 0; i < k; i++) s += bf16_to_f32(x[i]) * y[i];
    return s;
}

static float dot_q4_0(int64_t k, const void *w, const void *a) {
    const blk_q4_0 *x = w;
    const blk_q8_0 *y = a;
    float s = 0.0f;
    for (int64_t b = 0; b < k / QK; b++) {
        int sum = 0;
        for (int j = 0; j < 16; j++) {
            sum += ((x[b].qs[j] & 0x0f) - 8) * y[b].qs[j];
            sum += ((x[b].qs[j] >> 4) - 8) * y[b].qs[j + 16];
        }
        s += f16_to_f32(x[b].d) * f16_to_f32(y[b].d) * (float)sum;
    }
    return s;
}

static float dot_q4_1(int64_t k, const void *w, const void *a) {
    const blk_q4_1 *x = w;
    const blk_q8_1 *y = a;
    float s = 0.0f;
    for (int64_t b = 0; b < k / QK; b++) {
        int sum = 0;
        for (int j = 0; j < 16; j++) {
            sum += (x[b].qs[j] & 0x0f) * y[b].qs[j];
            sum += (x[b].qs[j] >> 4) * y[b].qs[j + 16];
        }
        s += f16_to_f32(x[b].d) * f16_to_f32(y[b].d) * (float)sum
             + f16_to_f32(x[b].m) * f16_to_f32(y[b].s);
    }
    return s;
}

static uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static float dot_q5_0(int64_t k, const void *w, const void *a) {
    const blk_q5_0 *x = w;
    const blk_q8_0 *y = a;
    float s = 0.0f;
    for (int64_t b = 0; b < k / QK; b++) {
        uint32_t qh = load_u32(x[b].qh);
        int sum = 0;
        for (int j = 0; j < 16; j++) {
            int lo = (x[b].qs[j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
            int hi = (x[b].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            sum += (lo - 16) * y[b].qs[j] + (hi - 16) * y[b].qs[j + 16];
        }
        s += f16_to_f32(x[b].d) * f16_to_f32(y[b].d) * (float)sum;
    }
    return s;
}

static float dot_q5_1(int64_t k, const void *w, const void *a) {
    const blk_q5_1 *x = w;
    const blk_q8_1 *y = a;
    float s = 0.0f;
    for (int64_t b = 0; b < k / QK; b++) {
        uint32_t qh = load_u32(x[b].qh);
        int sum = 0;
        for (int j = 0; j < 16; j++) {
            int lo = (x[b].qs[j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
            int hi = (x[b].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            sum += lo * y[b].qs[j] + hi * y[b].qs[j + 16];
        }
        s += f16_to_f32(x[b].d) * f16_to_f32(y[b].d) * (float)sum
             + f16_to_f32(x[b].m) * f16_to_f32(y[b].s);
    }
    return s;
}

static float dot_q8_0(int64_t k, const void *w, const void *a) {
    const blk_q8_0 *x = w, *y = a;
    float s = 0.0f;
    for (int64_t b = 0; b < k / QK; b++) {
        int sum = 0;
        for (int j = 0; j < QK; j++) sum += x[b].qs[j] * y[b].qs[j];
        s += f16_to_f32(x[b].d) * f16_to_f32(y[b].d) * (float)sum;
    }
    return s;
}

/* 2-bit layout shared by Q2_K and Q3_K: element h*128 + s*32 + l is bits 2s..2s+1 of qs[h*32+l] */
static inline int k_2bit(const uint8_t *qs, int e) {
    int h = e / 128, s = (e % 128) / 32, l = e % 32;
    return (qs[h * 32 + l] >> (2 * s)) & 3;
}

static float dot_q2_k(int64_t k, const void *w, const void *a) {
    const blk_q2_K *x = w;
    const blk_q8_K *y = a;
    float s = 0.0f;
    for (int64_t b = 0; b < k / QK_K; b++) {
        int isum = 0, summs = 0;
        for (int j = 0; j < 16; j++) {
            int g = 0;
            for (int e = j * 16; e < j * 16 + 16; e++) g += k_2bit(x[b].qs, e) * y[b].qs[e];
            isum += (x[b].scales[j] & 0x0f) * g;
            summs += (x[b].scales[j] >> 4) * y[b].bsums[j];
        }
        s += y[b].d * f16_to_f32(x[b].d) * (float)isum - y[b].d * f16_to_f32(x[b].dmin) * (float)summs;
    }
    return s;
}

static float dot_q3_k(int64_t k, const void *w, const void *a) {
    const blk_q3_K *x = w;
    const blk_q8_K *y = a;
    float s = 0.0f;
    for (int64_t b = 0; b < k / QK_K; b++) {
        int8_t sc[16];
        q3_k_scales(x[b].scales, sc);
        int isum = 0;
        for (int j = 0; j < 16; j++) {
            int g = 0;
            for (int e = j * 16; e < j * 16 + 16; e++) {
                int hbit = (x[b].hmask[e % 32] >> (e / 32)) & 1;
                g += (k_2bit(x[b].qs, e) - (hbit ? 0 : 4)) * y[b].qs[e];
            }
            isum += sc[j] * g;
        }
        s += y[b].d * f16_to_f32(x[b].d) * (float)isum;
    }
    return s;
}

/* 4-bit K layout: element e is the low (e%64 < 32) or high nibble of qs[(e/64)*32 + e%32] */
static inline int k_4bit(const uint8_t *qs, int e) {
    uint8_t v = qs[(e / 64) * 32 + e % 32];
    return (e % 64) < 32 ? (v & 0x0f) : (v >> 4);
}

static float k_quant_45(const uint8_t *scales, const uint8_t *qs, const uint8_t *qh,
                        const blk_q8_K *y, half_t d, half_t dmin) {
    int isum = 0, summs = 0;
    for (int j = 0; j < 8; j++) {
        int sc, m, g = 0;
        k_scale_min(scales, j, &sc, &m);
        for (int e = j * 32; e < j * 32 + 32; e++) {
            int q = k_4bit(qs, e) | (qh ? ((qh[e % 32] >> (e / 32)) & 1) << 4 : 0);
            g += q * y->qs[e];
        }
        isum += sc * g;
        summs += m * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
    }
    return y->d * f16_to_f32(d) * (float)isum - y->d * f16_to_f32(dmin) * (float)summs;
}

static float dot_q4_k(int64_t k, const void *w, const void *a) {
    const blk_q4_K *x = w;
    const blk_q8_K *y = a;
    float s = 0.0f;
    for (int64_t b = 0; b < k / QK_K; b++)
        s += k_quant_45(x[b].scales, x[b].qs, NULL, &y[b], x[b].d, x[b].dmin);
    return s;
}

static float dot_q5_k(int64_t k, const void *w, const void *a) {
    const blk_q5_K *x = w;
    const blk_q8_K *y = a;
    float s = 0.0f;
    for (int64_t b = 0; b < k / QK_K; b++)
        s += k_quant_45(x[b].scales, x[b].qs, x[b].qh, &y[b], x[b].d, x[b].dmin);
    return s;
}

static float dot_q6_k(int64_t k, const void *w, const void *a) {
    const blk_q6_K *x = w;
    const blk_q8_K *y = a;
    float s = 0.0f;
    for (int64_t b = 0; b < k / QK_K; b++) {
        int isum = 0;
        for (int j = 0; j < 16; j++) {
            int g = 0;
            for (int e = j * 16; e < j * 16 + 16; e++) {
                int h = e / 128, r = e % 128;  /* r: 0-63 low nibbles, 64-127 high nibbles */
                uint8_t l = x[b].ql[h * 64 + r % 64];
                int lo = r < 64 ? (l & 0x0f) : (l >> 4);
                int hi = (x[b].qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
                g += ((lo | (hi << 4)) - 32) * y[b].qs[e];
            }
            isum += x[b].scales[j] * g;
        }
        s += y[b].d * f16_to_f32(x[b].d) * (float)isum;
    }
    return s;
}

const struct ntx_kernels ntx_kernels_portable = {
    .dot = {
        [T_F32] = dot_f32, [T_F16] = dot_f16, [T_BF16] = dot_bf16,
        [T_Q4_0] = dot_q4_0, [T_Q4_1] = dot_q4_1, [T_Q5_0] = dot_q5_0, [T_Q5_1] = dot_q5_1,
        [T_Q8_0] = dot_q8_0, [T_Q2_K] = dot_q2_k, [T_Q3_K] = dot_q3_k, [T_Q4_K] = dot_q4_k,
        [T_Q5_K] = dot_q5_k, [T_Q6_K] = dot_q6_k,
    },
};
