/*
 * cpu_act.c - activation rows in the format ggml's CPU backend feeds its dot products
 * (the weight type's vec_dot_type), bit-identical to ntx_engine/matmul.py:quantize_blocks:
 *   Q8_0 / Q8_1: d = amax/127, q = round-half-even(x * (127/amax)), d (and s = d*sum(q)) fp16;
 *   Q8_K: iscale = -127/max (the signed value of largest magnitude), q = min(127, round(iscale*x)),
 *         d = 1/iscale as f32, plus the 16 group sums;
 *   F16 / BF16 weights: the row rounded to that type and stored in it (2 bytes a value, half
 *         the traffic of float32 when several rows share a weight row); F32: the row as is.
 */
#include <errno.h>
#include <math.h>

#include "cpu_impl.h"

int ntx_type_block(int type, int *block, int *bytes) {
    static const int table[T_COUNT][2] = {
        [T_F32] = {1, 4}, [T_F16] = {1, 2}, [T_BF16] = {1, 2},
        [T_Q4_0] = {QK, 18}, [T_Q4_1] = {QK, 20}, [T_Q5_0] = {QK, 22}, [T_Q5_1] = {QK, 24},
        [T_Q8_0] = {QK, 34}, [T_Q8_1] = {QK, 36},
        [T_Q2_K] = {QK_K, 84}, [T_Q3_K] = {QK_K, 110}, [T_Q4_K] = {QK_K, 144},
        [T_Q5_K] = {QK_K, 176}, [T_Q6_K] = {QK_K, 210}, [T_Q8_K] = {QK_K, 292},
    };
    if (type < 0 || type >= T_COUNT || table[type][0] == 0) return 0;
    *block = table[type][0];
    *bytes = table[type][1];
    return 1;
}

/* the activation format of a weight type (ggml's type_traits_cpu vec_dot_type); -1: none */
int ntx_act_type(int weight_type) {
    switch (weight_type) {
    case T_F32: case T_F16: case T_BF16: return weight_type;
    case T_Q4_0: case T_Q5_0: case T_Q8_0: return T_Q8_0;
    case T_Q4_1: case T_Q5_1: return T_Q8_1;
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: return T_Q8_K;
    default: return -1;
    }
}

NTX_EXPORT int64_t ntx_cpu_act_row_bytes(int weight_type, int64_t k) {
    int act = ntx_act_type(weight_type), block, bytes;
    if (act < 0 || k <= 0 || !ntx_type_block(weight_type, &block, &bytes) || k % block) return -EINVAL;
    if (act == T_F32) return k * 4;
    if (act == T_F16 || act == T_BF16) return k * 2;
    ntx_type_block(act, &block, &bytes);
    return k / block * bytes;
}

/* one block of 32: d (before fp16 rounding), q, sum(q) as ggml's int32 lanes add it */
static float q8_block(const float *x, int8_t *q, int *qsum) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f;
    const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    if (isinf(inv)) {
        /* amax < ~3.7e-37: x * inf converts to INT_MIN, saturating to -128; the int32 lane
           sums wrap to 0 (see matmul.py:_q8_blocks) */
        memset(q, 0x80, QK);
        *qsum = 0;
        return d;
    }
    for (int j = 0; j < QK; j++) {
        q[j] = (int8_t)nearbyintf(x[j] * inv);
        sum += q[j];
    }
    *qsum = sum;
    return d;
}

static void quantize_q8_0(const float *x, int64_t k, blk_q8_0 *y) {
    for (int64_t b = 0; b < k / QK; b++) {
        int qsum;
        y[b].d = f32_to_f16(q8_block(x + b * QK, y[b].qs, &qsum));
    }
}

static void quantize_q8_1(const float *x, int64_t k, blk_q8_1 *y) {
    for (int64_t b = 0; b < k / QK; b++) {
        int qsum;
        float d = q8_block(x + b * QK, y[b].qs, &qsum);
        y[b].d = f32_to_f16(d);
        y[b].s = f32_to_f16(d * (float)qsum);
    }
}

static void quantize_q8_k(const float *x, int64_t k, blk_q8_K *y) {
    for (int64_t b = 0; b < k / QK_K; b++, x += QK_K) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        memset(&y[b], 0, sizeof(y[b]));
        if (amax == 0.0f) continue;
        const float iscale = -127.0f / max;
        y[b].d = 1.0f / iscale;
        if (isinf(iscale)) continue;  /* a tiny max: every q truncates to 0 in ggml */
        for (int j = 0; j < QK_K; j++) {
            float v = nearbyintf(iscale * x[j]);
            y[b].qs[j] = (int8_t)(v > 127.0f ? 127.0f : v);
            y[b].bsums[j / 16] = (int16_t)(y[b].bsums[j / 16] + y[b].qs[j]);
        }
    }
}

static void to_bf16(const float *x, int64_t k, uint16_t *h) {
    for (int64_t j = 0; j < k; j++) {
        uint32_t u;
        float f = round_bf16(x[j]);  /* its low 16 bits are zero */
        memcpy(&u, &f, 4);
        h[j] = (uint16_t)(u >> 16);
    }
}

static void quantize_row(int act, const float *x, int64_t k, void *out) {
    half_t *h = out;
    switch (act) {
    case T_Q8_0: quantize_q8_0(x, k, out); break;
    case T_Q8_1: quantize_q8_1(x, k, out); break;
    case T_Q8_K: quantize_q8_k(x, k, out); break;
    case T_F16: for (int64_t j = 0; j < k; j++) h[j] = f32_to_f16(x[j]); break;
    case T_BF16: to_bf16(x, k, out); break;
    default: memcpy(out, x, (size_t)k * sizeof(float)); break;
    }
}

NTX_EXPORT int ntx_cpu_quantize_act(int weight_type, const float *x, int64_t n, int64_t k,
                                    void *out) {
    int64_t row = ntx_cpu_act_row_bytes(weight_type, k);
    if (row < 0) return (int)row;
    if (!x || !out || n < 0) return -EINVAL;
    int act = ntx_act_type(weight_type);
    for (int64_t i = 0; i < n; i++) quantize_row(act, x + i * k, k, (uint8_t *)out + i * row);
    return 0;
}
