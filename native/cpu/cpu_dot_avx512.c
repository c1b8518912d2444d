/*
 * cpu_dot_avx512.c - 512-bit (zmm) dot products for the types that dominate real models
 * (Q4_K, Q6_K, Q8_0), AVX512F/BW/VL/VNNI; every other type keeps the 256-bit VNNI kernel.
 *
 * Each kernel exists once, as a multi-row body: the weight block is unpacked into registers
 * once (nibbles, six-bit scales) and applied to `nr` activation rows. The one-row dot is the
 * same body with nr = 1, so a row's integer sums and float operations (order included) do not
 * depend on how many rows share the pass: n-row results equal the one-row ones bit for bit.
 *
 * Integer sums are exact as in cpu_dot_x86.inc: vpmaddubsw (u8 x s8 -> s16 pairs, no
 * saturation for 6-bit weights and |activation| <= 128) then vpdpwssd with the sub-block scale.
 */
#include "cpu_impl.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include <immintrin.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float h2f(half_t h) { return _cvtsh_ss(h); }

ALWAYS_INLINE float hsum128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS_INLINE float hsum256(__m256 h) {
    return hsum128(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

ALWAYS_INLINE float hsum512(__m512 v) {
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* scaled integer sum of 64 weight bytes (u8) with 64 activation bytes (s8), int16 scales */
ALWAYS_INLINE __m512i scaled_dot(__m512i acc, __m512i q, const int8_t *y, __m512i sc) {
    return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q, _mm512_loadu_si512(y)), sc);
}

/* ---------------------------------------------------------------------------- Q4_K */

struct q4k_unpacked {
    __m512i q[4];   /* chunk c: sub-blocks 2c (bytes 0-31) and 2c+1 (32-63), values 0..15 */
    __m512i sc[4];  /* their scales, int16: lanes 0-15 sub-block 2c, 16-31 sub-block 2c+1 */
    __m256i mins;   /* 8 mins, int16, each twice: pairs with the 16 bsums of 16 values */
    float d, dmin;
};

/* the 12 packed bytes -> 8 six-bit scales (low 64 bits of *sc) and 8 mins (of *mn) */
ALWAYS_INLINE void q4k_scales(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    uint32_t sc_lo = u0 & 0x3f3f3f3fu, mn_lo = u1 & 0x3f3f3f3fu;
    uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
    uint32_t mn_hi = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
    *sc = sc_lo | (uint64_t)sc_hi << 32;
    *mn = mn_lo | (uint64_t)mn_hi << 32;
}

ALWAYS_INLINE void q4k_unpack(const blk_q4_K *x, const __m512i pick[4], struct q4k_unpacked *u) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    uint64_t sc, mn;
    q4k_scales(x->scales, &sc, &mn);
    __m512i sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    #pragma GCC unroll 8
    for (int c = 0; c < 4; c++) u->sc[c] = _mm512_shuffle_epi8(sc16, pick[c]);
    __m128i m8 = _mm_cvtsi64_si128((long long)mn);
    u->mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    #pragma GCC unroll 8
    for (int h = 0; h < 2; h++) {
        __m512i a = _mm512_loadu_si512(x->qs + 64 * h);
        __m512i lo = _mm512_and_si512(a, m4), hi = _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
        u->q[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);      /* lanes lo0 lo1 hi0 hi1 */
        u->q[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xee);  /* lanes lo2 lo3 hi2 hi3 */
    }
    u->d = h2f(x->d);
    u->dmin = h2f(x->dmin);
}

/* pshufb controls: int16 scale 2c in the low 256 bits, 2c+1 in the high */
static void q4k_picks(__m512i pick[4]) {
    #pragma GCC unroll 8
    for (int c = 0; c < 4; c++) {
        int a = 4 * c, b = 4 * c + 2;
        __m512i lo = _mm512_set1_epi32(a | (a + 1) << 8 | a << 16 | (a + 1) << 24);
        __m512i hi = _mm512_set1_epi32(b | (b + 1) << 8 | b << 16 | (b + 1) << 24);
        pick[c] = _mm512_mask_blend_epi32(0xff00, lo, hi);
    }
}

ALWAYS_INLINE void q4k_row(const struct q4k_unpacked *u, const blk_q8_K *y, __m512 *acc, __m256 *accm) {
    /* two chains: shorter dependency, and the integer sum is exact in any order */
    __m512i s0 = scaled_dot(_mm512_setzero_si512(), u->q[0], y->qs, u->sc[0]);
    __m512i s1 = scaled_dot(_mm512_setzero_si512(), u->q[1], y->qs + 64, u->sc[1]);
    s0 = scaled_dot(s0, u->q[2], y->qs + 128, u->sc[2]);
    s1 = scaled_dot(s1, u->q[3], y->qs + 192, u->sc[3]);
    *acc = _mm512_fmadd_ps(_mm512_set1_ps(y->d * u->d), _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), *acc);
    /* mins x bsums: min j against bsums 2j and 2j+1, 8 int32 */
    __m256i m = _mm256_madd_epi16(u->mins, _mm256_loadu_si256((const __m256i *)y->bsums));
    *accm = _mm256_fmadd_ps(_mm256_set1_ps(y->d * u->dmin), _mm256_cvtepi32_ps(m), *accm);
}

ALWAYS_INLINE void q4k_body(int64_t k, const blk_q4_K *x, const uint8_t *act, int64_t act_bytes,
                            int nr, float *out, int64_t out_stride) {
    __m512i pick[4];
    q4k_picks(pick);
    __m512 acc[NTX_DOTN_MAX];
    __m256 accm[NTX_DOTN_MAX];
    #pragma GCC unroll 8
    for (int r = 0; r < nr; r++) {
        acc[r] = _mm512_setzero_ps();
        accm[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < k / QK_K; b++) {
        struct q4k_unpacked u;
        PREFETCH_BLOCK(nr, &x[b], sizeof(blk_q4_K));
        q4k_unpack(&x[b], pick, &u);
        #pragma GCC unroll 8
        for (int r = 0; r < nr; r++)
            q4k_row(&u, (const blk_q8_K *)(act + r * act_bytes) + b, &acc[r], &accm[r]);
    }
    #pragma GCC unroll 8
    for (int r = 0; r < nr; r++) out[r * out_stride] = hsum512(acc[r]) - hsum256(accm[r]);
}

/* ---------------------------------------------------------------------------- Q6_K */

struct q6k_unpacked {
    __m512i q[4];   /* chunk c: elements 64c..64c+63, values 0..63 */
    __m512i sc[4];  /* int16 scales: 128-bit lane i of chunk c is group 4c+i (16 elements) */
    __m256i sc16;   /* the 16 scales as int16 (the -32 offset through the group sums) */
    float d;
};

ALWAYS_INLINE void q6k_unpack(const blk_q6_K *x, const __m512i pick[4], struct q6k_unpacked *u) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi8(3);
    const __m512i shift_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift_hi = _mm512_add_epi16(shift_lo, _mm512_set1_epi16(4));
    u->sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
    __m512i sc = _mm512_castsi256_si512(u->sc16);
    #pragma GCC unroll 8
    for (int c = 0; c < 4; c++) u->sc[c] = _mm512_permutexvar_epi16(pick[c], sc);
    #pragma GCC unroll 8
    for (int h = 0; h < 2; h++) {
        __m512i l = _mm512_loadu_si512(x->ql + 64 * h);
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->qh + 32 * h)));
        /* elements h*128 + 0..63: low nibbles, qh bits 0-1 (first 32) and 2-3 (next 32) */
        __m512i hb0 = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_lo), m3);
        __m512i hb1 = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_hi), m3);
        u->q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_slli_epi16(hb0, 4));
        u->q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                          _mm512_slli_epi16(hb1, 4));
    }
    u->d = h2f(x->d);
}

/* vpermw indices: int16 lane j of chunk c takes scale 4c + j/8 */
static void q6k_picks(__m512i pick[4]) {
    #pragma GCC unroll 8
    for (int c = 0; c < 4; c++) {
        int16_t idx[32];
        #pragma GCC unroll 8
        for (int j = 0; j < 32; j++) idx[j] = (int16_t)(4 * c + j / 8);
        pick[c] = _mm512_loadu_si512(idx);
    }
}

ALWAYS_INLINE void q6k_row(const struct q6k_unpacked *u, const blk_q8_K *y, __m512 *acc) {
    __m512i s0 = scaled_dot(_mm512_setzero_si512(), u->q[0], y->qs, u->sc[0]);
    __m512i s1 = scaled_dot(_mm512_setzero_si512(), u->q[1], y->qs + 64, u->sc[1]);
    s0 = scaled_dot(s0, u->q[2], y->qs + 128, u->sc[2]);
    __m512i s = _mm512_add_epi32(s0, scaled_dot(s1, u->q[3], y->qs + 192, u->sc[3]));
    /* q6 - 32: minus 32 x sum of scale x group sum, exact in int32 */
    __m256i off = _mm256_madd_epi16(u->sc16, _mm256_loadu_si256((const __m256i *)y->bsums));
    s = _mm512_sub_epi32(s, _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
    *acc = _mm512_fmadd_ps(_mm512_set1_ps(y->d * u->d), _mm512_cvtepi32_ps(s), *acc);
}

ALWAYS_INLINE void q6k_body(int64_t k, const blk_q6_K *x, const uint8_t *act, int64_t act_bytes,
                            int nr, float *out, int64_t out_stride) {
    __m512i pick[4];
    q6k_picks(pick);
    __m512 acc[NTX_DOTN_MAX];
    #pragma GCC unroll 8
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / QK_K; b++) {
        struct q6k_unpacked u;
        PREFETCH_BLOCK(nr, &x[b], sizeof(blk_q6_K));
        q6k_unpack(&x[b], pick, &u);
        #pragma GCC unroll 8
        for (int r = 0; r < nr; r++) q6k_row(&u, (const blk_q8_K *)(act + r * act_bytes) + b, &acc[r]);
    }
    #pragma GCC unroll 8
    for (int r = 0; r < nr; r++) out[r * out_stride] = hsum512(acc[r]);
}

/* ---------------------------------------------------------------------------- Q8_0 */

/* two blocks per zmm: |x| as u8 and x's sign moved onto the activation (no vpsignb in 512) */
ALWAYS_INLINE __m512i q8_pair(const blk_q8_0 *y, __m512i ax, __mmask64 neg) {
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y[0].qs)),
                                   _mm256_loadu_si256((const __m256i *)y[1].qs), 1);
    v = _mm512_mask_sub_epi8(v, neg, _mm512_setzero_si512(), v);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), ax, v);
}

/* the fp16 scales of two consecutive Q8_0 blocks (34 bytes apart) as floats in lanes 0 and 1 */
ALWAYS_INLINE __m128 q8_scales2(const blk_q8_0 *p) {
    uint32_t h = (uint32_t)p[0].d | (uint32_t)p[1].d << 16;
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)h));
}

ALWAYS_INLINE void q80_body(int64_t k, const blk_q8_0 *x, const uint8_t *act, int64_t act_bytes,
                            int nr, float *out, int64_t out_stride) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[NTX_DOTN_MAX];
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    int64_t nb = k / QK, b = 0;
    for (; b + 2 <= nb; b += 2) {
        PREFETCH_BLOCK(nr, &x[b], 2 * sizeof(blk_q8_0));
        __m512i xv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x[b].qs)),
                                        _mm256_loadu_si256((const __m256i *)x[b + 1].qs), 1);
        __mmask64 neg = _mm512_movepi8_mask(xv);
        __m512i ax = _mm512_abs_epi8(xv);
        __m128 xd = q8_scales2(&x[b]);
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) {
            const blk_q8_0 *y = (const blk_q8_0 *)(act + r * act_bytes) + b;
            __m128 d2 = _mm_mul_ps(xd, q8_scales2(y));  /* x.d * y.d per block, as the scalar form */
            __m512 d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d2));
            acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q8_pair(y, ax, neg)), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) {
        float s = hsum512(acc[r]);
        if (b < nb) {  /* an odd last block: scalar sum, exact */
            const blk_q8_0 *y = (const blk_q8_0 *)(act + r * act_bytes) + b;
            int sum = 0;
            for (int j = 0; j < QK; j++) sum += x[b].qs[j] * y->qs[j];
            s += h2f(x[b].d) * h2f(y->d) * (float)sum;
        }
        out[r * out_stride] = s;
    }
}

/* ---------------------------------------------------------------------------- tables */

NTX_DOTN(z_q4_k, q4k_body, blk_q4_K)
NTX_DOTN(z_q6_k, q6k_body, blk_q6_K)
NTX_DOTN(z_q8_0, q80_body, blk_q8_0)

void ntx_kernels_fill_avx512(struct ntx_kernels *kt) {
    kt->dotn[T_Q4_K] = z_q4_k;
    kt->dotn[T_Q6_K] = z_q6_k;
    kt->dotn[T_Q8_0] = z_q8_0;
}
#pragma GCC pop_options
#else
void ntx_kernels_fill_avx512(struct ntx_kernels *kt) { (void)kt; }
#endif
