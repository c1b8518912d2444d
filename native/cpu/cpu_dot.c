/*
 * cpu_dot.c - portable C dot products of one weight row with up to 8 activation rows, per type,
 * in the integer-then-scale form of ggml's vec_dot_* (each block's integer sum is exact; only
 * the float accumulation order differs from ggml's SIMD kernels).
 *
 * Each weight block is decoded once into plain integers (or floats) and applied to every
 * activation row of the pass; per row the float expression is the scalar one of ggml's
 * reference, so the one-row dot (the same body with nr = 1) is bit-identical to any row of a
 * multi-row pass.
 */
#include "cpu_impl.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

static half_t load_half(const uint8_t *p) {
    half_t h;
    memcpy(&h, p, 2);
    return h;
}

static uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---------------------------------------------------------------------------- F32, F16, BF16 */

/* every fp16 and bf16 value as float: one load per value instead of f16_to_f32's branches
   (which, for weight and activation, doubled the one-row F16 time) or bf16's integer shift and
   move to a float register (4 rows of BF16 took 1.5x the time of F16 through the table) */
static float f16_table[1 << 16], bf16_table[1 << 16];

void ntx_portable_init(void) {
    for (uint32_t h = 0; h < (1u << 16); h++) {
        f16_table[h] = f16_to_f32((half_t)h);
        bf16_table[h] = bf16_to_f32((uint16_t)h);
    }
}

/* value i of an F32/F16/BF16 array (weights, and activations rounded to the weight's type) */
ALWAYS_INLINE float p_value(int t, const uint8_t *p, int64_t i) {
    if (t == T_F16) return f16_table[load_half(p + 2 * i)];
    if (t == T_BF16) return bf16_table[load_half(p + 2 * i)];
    float x;
    memcpy(&x, p + 4 * i, 4);
    return x;
}

/* summed in element order */
ALWAYS_INLINE void p_float_body(int t, int64_t k, const uint8_t *w, const uint8_t *act, int64_t ab,
                                int nr, float *out, int64_t os) {
    float s[NTX_DOTN_MAX] = {0};
    for (int64_t i = 0; i < k; i++) {
        float x = p_value(t, w, i);
#pragma GCC unroll 8  /* s[] stays in registers only when unrolled */
        for (int r = 0; r < nr; r++) s[r] += x * p_value(t, act + r * ab, i);
    }
    for (int r = 0; r < nr; r++) out[r * os] = s[r];
}

/* a type's body: its family's body with the type fixed (NTX_DOTN makes the 1..8-row kernels) */
#define P_TYPED(name, family, t)                                                               \
    ALWAYS_INLINE void name(int64_t k, const uint8_t *w, const uint8_t *act, int64_t ab, int nr, \
                            float *out, int64_t os) { family(t, k, w, act, ab, nr, out, os); }
P_TYPED(p_f32_body, p_float_body, T_F32)
P_TYPED(p_f16_body, p_float_body, T_F16)
P_TYPED(p_bf16_body, p_float_body, T_BF16)

/* ---------------------------------------------------------------------------- Q4_0 ... Q8_0 */

/* block bytes of a legacy weight type and of its activation block (Q8_0, or Q8_1 with s) */
static inline int legacy_bytes(int t) {
    return t == T_Q4_0 ? 18 : t == T_Q4_1 ? 20 : t == T_Q5_0 ? 22 : t == T_Q5_1 ? 24 : 34;
}

static inline int has_min(int t) { return t == T_Q4_1 || t == T_Q5_1; }

/* the 32 integers of a legacy block (Q4_0: q - 8, Q5_0: q - 16; Q4_1, Q5_1: q; Q8_0: q) */
ALWAYS_INLINE void legacy_decode(int t, const uint8_t *x, int8_t q[QK]) {
    int off = has_min(t) ? 4 : 2;  /* qs (or qh) follow d, or d and m */
    if (t == T_Q8_0) {
        memcpy(q, x + 2, QK);
        return;
    }
    if (t == T_Q4_0 || t == T_Q4_1) {
        const uint8_t *qs = x + off;
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)((qs[j] & 0x0f) - (t == T_Q4_0 ? 8 : 0));
            q[j + 16] = (int8_t)((qs[j] >> 4) - (t == T_Q4_0 ? 8 : 0));
        }
        return;
    }
    uint32_t qh = load_u32(x + off);
    const uint8_t *qs = x + off + 4;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
        int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
        q[j] = (int8_t)(lo - (t == T_Q5_0 ? 16 : 0));
        q[j + 16] = (int8_t)(hi - (t == T_Q5_0 ? 16 : 0));
    }
}

ALWAYS_INLINE void p_legacy_body(int t, int64_t k, const uint8_t *w, const uint8_t *act, int64_t ab,
                                 int nr, float *out, int64_t os) {
    const int bytes = legacy_bytes(t), abytes = has_min(t) ? 36 : 34, aq = has_min(t) ? 4 : 2;
    float s[NTX_DOTN_MAX] = {0};
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *x = w + b * bytes;
        int8_t q[QK];
        legacy_decode(t, x, q);
        float xd = f16_to_f32(load_half(x));
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) {
            const uint8_t *y = act + r * ab + b * abytes;  /* blk_q8_0 or blk_q8_1 */
            const int8_t *yq = (const int8_t *)(y + aq);
            int sum = 0;
            for (int j = 0; j < QK; j++) sum += q[j] * yq[j];
            if (has_min(t))
                s[r] += xd * f16_to_f32(load_half(y)) * (float)sum
                        + f16_to_f32(load_half(x + 2)) * f16_to_f32(load_half(y + 2));
            else
                s[r] += xd * f16_to_f32(load_half(y)) * (float)sum;
        }
    }
    for (int r = 0; r < nr; r++) out[r * os] = s[r];
}

P_TYPED(p_q4_0_body, p_legacy_body, T_Q4_0)
P_TYPED(p_q4_1_body, p_legacy_body, T_Q4_1)
P_TYPED(p_q5_0_body, p_legacy_body, T_Q5_0)
P_TYPED(p_q5_1_body, p_legacy_body, T_Q5_1)
P_TYPED(p_q8_0_body, p_legacy_body, T_Q8_0)

/* ---------------------------------------------------------------------------- K-quants */

/* a super-block as 16 groups of 16: value e = d * sc[e/16] * q[e] - dmin * m[e/16] (a Q4_K/Q5_K
   scale of 32 values is the scale of two groups; Q3_K's -4 and Q6_K's -32 are inside q) */
struct kblock {
    int8_t q[QK_K];
    int sc[16], m[16];
    half_t d, dmin;
};

/* 2-bit layout shared by Q2_K and Q3_K: element h*128 + s*32 + l is bits 2s..2s+1 of qs[h*32+l] */
static inline int k_2bit(const uint8_t *qs, int e) {
    int h = e / 128, s = (e % 128) / 32, l = e % 32;
    return (qs[h * 32 + l] >> (2 * s)) & 3;
}

/* 4-bit K layout: element e is the low (e%64 < 32) or high nibble of qs[(e/64)*32 + e%32] */
static inline int k_4bit(const uint8_t *qs, int e) {
    uint8_t v = qs[(e / 64) * 32 + e % 32];
    return (e % 64) < 32 ? (v & 0x0f) : (v >> 4);
}

static void decode_q2_k(const blk_q2_K *x, struct kblock *u) {
    for (int e = 0; e < QK_K; e++) u->q[e] = (int8_t)k_2bit(x->qs, e);
    for (int j = 0; j < 16; j++) {
        u->sc[j] = x->scales[j] & 0x0f;
        u->m[j] = x->scales[j] >> 4;
    }
    u->d = x->d;
    u->dmin = x->dmin;
}

static void decode_q3_k(const blk_q3_K *x, struct kblock *u) {
    int8_t sc[16];
    q3_k_scales(x->scales, sc);
    for (int e = 0; e < QK_K; e++) {
        int hbit = (x->hmask[e % 32] >> (e / 32)) & 1;
        u->q[e] = (int8_t)(k_2bit(x->qs, e) - (hbit ? 0 : 4));
    }
    for (int j = 0; j < 16; j++) {
        u->sc[j] = sc[j];
        u->m[j] = 0;
    }
    u->d = x->d;
    u->dmin = 0;
}

/* Q4_K, or Q5_K when qh is given (the fifth bit of element e: bit e/32 of qh[e%32]) */
static void decode_q45_k(const uint8_t *scales, const uint8_t *qs, const uint8_t *qh, half_t d,
                         half_t dmin, struct kblock *u) {
    for (int e = 0; e < QK_K; e++)
        u->q[e] = (int8_t)(k_4bit(qs, e) | (qh ? ((qh[e % 32] >> (e / 32)) & 1) << 4 : 0));
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k_scale_min(scales, j, &sc, &m);
        u->sc[2 * j] = u->sc[2 * j + 1] = sc;
        u->m[2 * j] = u->m[2 * j + 1] = m;
    }
    u->d = d;
    u->dmin = dmin;
}

static void decode_q6_k(const blk_q6_K *x, struct kblock *u) {
    for (int e = 0; e < QK_K; e++) {
        int h = e / 128, r = e % 128;  /* r: 0-63 low nibbles, 64-127 high nibbles */
        uint8_t l = x->ql[h * 64 + r % 64];
        int lo = r < 64 ? (l & 0x0f) : (l >> 4);
        int hi = (x->qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
        u->q[e] = (int8_t)((lo | (hi << 4)) - 32);
    }
    for (int j = 0; j < 16; j++) {
        u->sc[j] = x->scales[j];
        u->m[j] = 0;
    }
    u->d = x->d;
    u->dmin = 0;
}

ALWAYS_INLINE void k_decode(int t, const uint8_t *w, int64_t b, struct kblock *u) {
    if (t == T_Q2_K) decode_q2_k((const blk_q2_K *)w + b, u);
    if (t == T_Q3_K) decode_q3_k((const blk_q3_K *)w + b, u);
    if (t == T_Q4_K) {
        const blk_q4_K *x = (const blk_q4_K *)w + b;
        decode_q45_k(x->scales, x->qs, NULL, x->d, x->dmin, u);
    }
    if (t == T_Q5_K) {
        const blk_q5_K *x = (const blk_q5_K *)w + b;
        decode_q45_k(x->scales, x->qs, x->qh, x->d, x->dmin, u);
    }
    if (t == T_Q6_K) decode_q6_k((const blk_q6_K *)w + b, u);
}

/* the block's term for one activation row; types without mins skip that product */
ALWAYS_INLINE float k_row(int t, const struct kblock *u, const blk_q8_K *y) {
    int isum = 0, summs = 0;
    for (int j = 0; j < 16; j++) {
        int g = 0;
        for (int e = j * 16; e < j * 16 + 16; e++) g += u->q[e] * y->qs[e];
        isum += u->sc[j] * g;
        summs += u->m[j] * y->bsums[j];
    }
    if (t == T_Q3_K || t == T_Q6_K) return y->d * f16_to_f32(u->d) * (float)isum;
    return y->d * f16_to_f32(u->d) * (float)isum - y->d * f16_to_f32(u->dmin) * (float)summs;
}

ALWAYS_INLINE void p_k_body(int t, int64_t k, const uint8_t *w, const uint8_t *act, int64_t ab,
                            int nr, float *out, int64_t os) {
    float s[NTX_DOTN_MAX] = {0};
    for (int64_t b = 0; b < k / QK_K; b++) {
        struct kblock u;
        k_decode(t, w, b, &u);
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) s[r] += k_row(t, &u, (const blk_q8_K *)(act + r * ab) + b);
    }
    for (int r = 0; r < nr; r++) out[r * os] = s[r];
}

P_TYPED(p_q2_k_body, p_k_body, T_Q2_K)
P_TYPED(p_q3_k_body, p_k_body, T_Q3_K)
P_TYPED(p_q4_k_body, p_k_body, T_Q4_K)
P_TYPED(p_q5_k_body, p_k_body, T_Q5_K)
P_TYPED(p_q6_k_body, p_k_body, T_Q6_K)

/* ---------------------------------------------------------------------------- table */

NTX_DOTN(p_f32, p_f32_body, uint8_t)
NTX_DOTN(p_f16, p_f16_body, uint8_t)
NTX_DOTN(p_bf16, p_bf16_body, uint8_t)
NTX_DOTN(p_q4_0, p_q4_0_body, uint8_t)
NTX_DOTN(p_q4_1, p_q4_1_body, uint8_t)
NTX_DOTN(p_q5_0, p_q5_0_body, uint8_t)
NTX_DOTN(p_q5_1, p_q5_1_body, uint8_t)
NTX_DOTN(p_q8_0, p_q8_0_body, uint8_t)
NTX_DOTN(p_q2_k, p_q2_k_body, uint8_t)
NTX_DOTN(p_q3_k, p_q3_k_body, uint8_t)
NTX_DOTN(p_q4_k, p_q4_k_body, uint8_t)
NTX_DOTN(p_q5_k, p_q5_k_body, uint8_t)
NTX_DOTN(p_q6_k, p_q6_k_body, uint8_t)

const struct ntx_kernels ntx_kernels_portable = {.dotn = {
    [T_F32] = p_f32, [T_F16] = p_f16, [T_BF16] = p_bf16,
    [T_Q4_0] = p_q4_0, [T_Q4_1] = p_q4_1, [T_Q5_0] = p_q5_0,
    [T_Q5_1] = p_q5_1, [T_Q8_0] = p_q8_0, [T_Q2_K] = p_q2_k,
    [T_Q3_K] = p_q3_k, [T_Q4_K] = p_q4_k, [T_Q5_K] = p_q5_k,
    [T_Q6_K] = p_q6_k,
}};
