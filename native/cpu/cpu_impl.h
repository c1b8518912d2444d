/*
 * cpu_impl.h - internals shared by the CPU kernel sources: GGML block layouts (ggml-common.h's
 * field order and sizes), fp16/bf16 conversions and the per-SIMD-level kernel tables.
 */
#ifndef NTX_CPU_IMPL_H
#define NTX_CPU_IMPL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ntx_cpu.h"

#define NTX_EXPORT __attribute__((visibility("default")))

/* GGML type ids (ggml.h enum ggml_type) */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q8_1 = 9, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_Q8_K = 15,
    T_BF16 = 30, T_COUNT = 31
};

#define QK 32    /* elements per legacy block */
#define QK_K 256 /* elements per K-quant super-block */

typedef uint16_t half_t;

typedef struct { half_t d; uint8_t qs[16]; } blk_q4_0;
typedef struct { half_t d, m; uint8_t qs[16]; } blk_q4_1;
typedef struct { half_t d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;
typedef struct { half_t d, m; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_1;
typedef struct { half_t d; int8_t qs[32]; } blk_q8_0;
typedef struct { half_t d, s; int8_t qs[32]; } blk_q8_1;  /* s = d * sum(qs) */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; half_t d, dmin; } blk_q2_K;
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; half_t d; } blk_q3_K;
typedef struct { half_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;
typedef struct { half_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; half_t d; } blk_q6_K;
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } blk_q8_K;

_Static_assert(sizeof(blk_q4_0) == 18 && sizeof(blk_q4_1) == 20, "legacy block size");
_Static_assert(sizeof(blk_q5_0) == 22 && sizeof(blk_q5_1) == 24, "legacy block size");
_Static_assert(sizeof(blk_q8_0) == 34 && sizeof(blk_q8_1) == 36, "legacy block size");
_Static_assert(sizeof(blk_q2_K) == 84 && sizeof(blk_q3_K) == 110, "k block size");
_Static_assert(sizeof(blk_q4_K) == 144 && sizeof(blk_q5_K) == 176, "k block size");
_Static_assert(sizeof(blk_q6_K) == 210 && sizeof(blk_q8_K) == 292, "k block size");

static inline float f16_to_f32(half_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {  /* zero or subnormal: man * 2^-24 is exact in float */
        float f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* round to nearest even, as numpy's astype(float16) and ggml's F16C conversion do */
static inline half_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (half_t)(sign | 0x7e00);     /* NaN stays NaN */
    if (ax >= 0x477ff000u) return (half_t)(sign | 0x7c00);    /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {                                    /* below 2^-14: subnormal */
        float a;
        memcpy(&a, &ax, 4);
        return (half_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    }
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
    return (half_t)(sign | ((r - (112u << 23)) >> 13));
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* nearest-even bf16, kept as float32 (ggml_compute_fp32_to_bf16; NaNs stay quiet) */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        u = ((u >> 16) | 64u) << 16;
    } else {
        u = (uint32_t)(((uint64_t)u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
    }
    memcpy(&f, &u, 4);
    return f;
}

/* Q4_K/Q5_K: the j-th of 8 six-bit scales and mins packed into 12 bytes */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q3_K: the 16 six-bit scales (offset 32) packed into 12 bytes */
static inline void q3_k_scales(const uint8_t *sc, int8_t out[16]) {
    for (int i = 0; i < 16; i++) {
        int low = (sc[i % 8] >> (4 * (i / 8))) & 0x0f;
        int high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        out[i] = (int8_t)((low | (high << 4)) - 32);
    }
}

/* Weight rows stream from DRAM; with several activation rows per block the core works longer per
   byte and the hardware prefetcher alone falls behind (measured, one thread: Q4_K x 4 rows 5.2 ->
   3.9, Q6_K 6.7 -> 4.7, Q8_0 8.9 -> 7.3 ns per super-block and row). With one row it cost up to
   10 % (Q6_K, Q8_0), so the multi-row bodies touch the lines of a block PF_AHEAD on only when
   nr > 1 (a constant in each instantiation). */
#define PF_AHEAD 2048
#define PREFETCH_BLOCK(nr, p, bytes)                                                          \
    do {                                                                                      \
        if ((nr) > 1)                                                                         \
            for (int pf_ = 0; pf_ < (int)(bytes); pf_ += 64)                                  \
                __builtin_prefetch((const char *)(p) + PF_AHEAD + pf_, 0, 3);                 \
    } while (0)

/* one weight row (k values) . n <= NTX_DOTN_MAX activation rows in the vec_dot format
   (act_bytes apart) -> out[r * out_stride], reading the weight blocks once. Decode is n = 1.
   8 rather than 4 (measured on Zen 4, 14336x4096 from DRAM, 8 activation rows, against two
   4-row passes): Q4_K 7.24 -> 6.72 ms on one thread (avx512; avx2 10.1 -> 9.3), Q5_K and Q6_K
   9-16 % faster, Q4_0/Q4_1 4-10 %, Q8_0 0-7 %, F16/F32 5-24 %; 1 and 4 rows unchanged. */
#define NTX_DOTN_MAX 8
typedef void (*ntx_dotn_fn)(int64_t k, const void *w, const void *act, int64_t act_bytes, int n,
                            float *out, int64_t out_stride);

struct ntx_kernels {
    ntx_dotn_fn dotn[T_COUNT];  /* NULL: the type is not supported */
};

/* A kernel exists once, as a multi-row body `body(k, w, act, act_bytes, nr, out, out_stride)`
   (always_inline, nr <= NTX_DOTN_MAX), instantiated by NTX_DOTN for each row count with a
   constant nr: a row's integer sums and float operations, order included, do not depend on how
   many rows share the pass, so n rows give n one-row results bit for bit. */
#define NTX_DOTN(name, body, wtype)                                                            \
    static void name(int64_t k, const void *w, const void *a, int64_t ab, int n, float *o,     \
                     int64_t os) {                                                             \
        const uint8_t *a8 = a;                                                                 \
        const wtype *w8 = w;                                                                   \
        switch (n) {                                                                           \
        case 1: body(k, w8, a8, ab, 1, o, os); break;                                          \
        case 2: body(k, w8, a8, ab, 2, o, os); break;                                          \
        case 3: body(k, w8, a8, ab, 3, o, os); break;                                          \
        case 4: body(k, w8, a8, ab, 4, o, os); break;                                          \
        case 5: body(k, w8, a8, ab, 5, o, os); break;                                          \
        case 6: body(k, w8, a8, ab, 6, o, os); break;                                          \
        case 7: body(k, w8, a8, ab, 7, o, os); break;                                          \
        default: body(k, w8, a8, ab, 8, o, os); break;                                         \
        }                                                                                      \
    }

_Static_assert(NTX_DOTN_MAX == 8, "NTX_DOTN instantiates row counts 1-8");

extern const struct ntx_kernels ntx_kernels_portable;
void ntx_portable_init(void);  /* its F16 table; before the first portable F16 kernel runs */
void ntx_kernels_fill_avx2(struct ntx_kernels *kt);
void ntx_kernels_fill_vnni(struct ntx_kernels *kt);
void ntx_kernels_fill_avx512(struct ntx_kernels *kt);
const struct ntx_kernels *ntx_kernels_active(void);

/* block geometry: elements and bytes per block of a weight type; 0 if unsupported */
int ntx_type_block(int type, int *block, int *bytes);
int ntx_act_type(int weight_type);

/* frees the calling thread's attention scratch (pool workers call it on exit) */
void ntx_cpu_thread_cleanup(void);

/* the pool runs fn(arg, i) for i in [0, n_items) over its threads */
typedef void (*ntx_item_fn)(void *arg, int64_t begin, int64_t end);
int ntx_pool_run(struct ntx_cpu_pool *pool, ntx_item_fn fn, void *arg, int64_t n_items,
                 int64_t grain);

#endif
