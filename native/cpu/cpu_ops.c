/*
 * cpu_ops.c - the non-matmul ops of a layer, in the float32 operation order of the numpy
 * backend (ntx_engine/backends/numpy_backend.py): RMSNorm with a double sum, RoPE, SwiGLU,
 * add, and causal GQA attention over an F16 (or F32) KV cache with ggml's fp16 roundings.
 * Built with -ffp-contract=off so no multiply-add is fused behind our back.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#include "cpu_impl.h"

static float f16_table[65536];  /* fp16 bits -> float: the KV cache is read element by element */
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void fill_f16_table(void) {
    for (uint32_t i = 0; i < 65536; i++) f16_table[i] = f16_to_f32((half_t)i);
}

struct norm_job { const float *x, *w; int64_t d; float eps; float *out; };

static void norm_items(void *arg, int64_t r0, int64_t r1) {
    const struct norm_job *j = arg;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = j->x + r * j->d;
        double sum = 0.0;
        for (int64_t i = 0; i < j->d; i++) sum += (double)x[i] * (double)x[i];
        const float scale = 1.0f / sqrtf((float)(sum / (double)j->d) + j->eps);
        for (int64_t i = 0; i < j->d; i++) j->out[r * j->d + i] = (x[i] * scale) * j->w[i];
    }
}

NTX_EXPORT int ntx_cpu_rmsnorm(struct ntx_cpu_pool *pool, const float *x, const float *w, int64_t n,
                               int64_t d, float eps, float *out) {
    if (!x || !w || !out || n <= 0 || d <= 0) return -EINVAL;
    struct norm_job job = {x, w, d, eps, out};
    return ntx_pool_run(pool, norm_items, &job, n, 8);
}

NTX_EXPORT int ntx_cpu_rope(float *x, const float *cos_t, const float *sin_t, int64_t n,
                            int64_t n_heads, int64_t head_dim, int64_t rope_dim, int neox) {
    if (!x || !cos_t || !sin_t || n <= 0 || rope_dim <= 0 || rope_dim > head_dim || rope_dim % 2)
        return -EINVAL;
    const int64_t half = rope_dim / 2;
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int64_t h = 0; h < n_heads; h++) {
            float *v = x + (t * n_heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
                float x0 = v[a], x1 = v[b];
                v[a] = x0 * c[i] - x1 * s[i];
                v[b] = x0 * s[i] + x1 * c[i];
            }
        }
    }
    return 0;
}

struct swiglu_job { const float *gate, *up; float *out; };

static void swiglu_items(void *arg, int64_t i0, int64_t i1) {
    const struct swiglu_job *j = arg;
    for (int64_t i = i0; i < i1; i++) {
        float g = j->gate[i];
        j->out[i] = (g / (1.0f + expf(-g))) * j->up[i];
    }
}

NTX_EXPORT int ntx_cpu_swiglu(struct ntx_cpu_pool *pool, const float *gate, const float *up,
                              int64_t count, float *out) {
    if (!gate || !up || !out || count <= 0) return -EINVAL;
    struct swiglu_job job = {gate, up, out};
    return ntx_pool_run(pool, swiglu_items, &job, count, 4096);
}

NTX_EXPORT int ntx_cpu_add(const float *a, const float *b, int64_t count, float *out) {
    if (!a || !b || !out || count <= 0) return -EINVAL;
    for (int64_t i = 0; i < count; i++) out[i] = a[i] + b[i];
    return 0;
}

/* the two inner loops of attention over one cache row of hd values */
typedef float (*kv_dot_fn)(const float *q, const void *row, int64_t hd);
typedef void (*kv_axpy_fn)(float *o, float w, const void *row, int64_t hd);

static float dot_f16(const float *q, const void *row, int64_t hd) {
    const half_t *k = row;
    float s = 0.0f;
    for (int64_t d = 0; d < hd; d++) s += q[d] * f16_table[k[d]];
    return s;
}

static float dot_f32(const float *q, const void *row, int64_t hd) {
    const float *k = row;
    float s = 0.0f;
    for (int64_t d = 0; d < hd; d++) s += q[d] * k[d];
    return s;
}

static void axpy_f16(float *o, float w, const void *row, int64_t hd) {
    const half_t *v = row;
    for (int64_t d = 0; d < hd; d++) o[d] += w * f16_table[v[d]];
}

static void axpy_f32(float *o, float w, const void *row, int64_t hd) {
    const float *v = row;
    for (int64_t d = 0; d < hd; d++) o[d] += w * v[d];
}

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2,fma,f16c"))) static float dot_f16_avx2(const float *q, const void *row,
                                                                    int64_t hd) {
    const half_t *k = row;
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= hd; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + d))), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float s = _mm_cvtss_f32(h);
    for (; d < hd; d++) s += q[d] * f16_table[k[d]];
    return s;
}

__attribute__((target("avx2,fma,f16c"))) static void axpy_f16_avx2(float *o, float w, const void *row,
                                                                    int64_t hd) {
    const half_t *v = row;
    const __m256 wv = _mm256_set1_ps(w);
    int64_t d = 0;
    for (; d + 8 <= hd; d += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + d)));
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(wv, x, _mm256_loadu_ps(o + d)));
    }
    for (; d < hd; d++) o[d] += w * f16_table[v[d]];
}
#endif

struct attn_job {
    kv_dot_fn dot;
    kv_axpy_fn axpy;
    const float *q;
    const void *kc, *vc;
    int kv_f16;
    int64_t start, n, n_head, n_kv, hd;
    float scale;
    float *out;
    int failed;           /* set (atomically) when a score buffer could not be allocated */
};

/* thread-local score row: grows to the longest context seen, kept for the thread's life */
static __thread float *tls_scores;
static __thread int64_t tls_cap;

static float *score_buf(int64_t len) {
    if (len > tls_cap) {
        float *p = realloc(tls_scores, (size_t)len * 2 * sizeof(float));
        if (!p) return NULL;
        tls_scores = p;
        tls_cap = len;
    }
    return tls_scores;
}

static inline const void *kv_row(const struct attn_job *j, const void *cache, int64_t base) {
    return (const uint8_t *)cache + base * (j->kv_f16 ? 2 : 4);
}

/* one (token, head): scores over positions 0..start+t, softmax, weighted sum of values */
static int attend_one(const struct attn_job *j, int64_t t, int64_t h) {
    const int64_t end = j->start + t + 1, g = h / (j->n_head / j->n_kv), hd = j->hd;
    float *sc = score_buf(end + hd), *qh = sc + end;
    if (!sc) return -ENOMEM;
    const float *q = j->q + (t * j->n_head + h) * hd;
    for (int64_t d = 0; d < hd; d++) qh[d] = j->kv_f16 ? f16_to_f32(f32_to_f16(q[d])) : q[d];
    float m = -INFINITY;
    for (int64_t p = 0; p < end; p++) {
        const int64_t base = (p * j->n_kv + g) * hd;
        sc[p] = j->dot(qh, kv_row(j, j->kc, base), hd) * j->scale;
        m = sc[p] > m ? sc[p] : m;
    }
    double sum = 0.0;
    for (int64_t p = 0; p < end; p++) {
        sc[p] = expf(sc[p] - m);
        sum += sc[p];
    }
    float *o = j->out + (t * j->n_head + h) * hd;
    for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
    for (int64_t p = 0; p < end; p++) {
        float w = (float)((double)sc[p] / sum);
        if (j->kv_f16) w = f16_to_f32(f32_to_f16(w));
        const int64_t base = (p * j->n_kv + g) * hd;
        j->axpy(o, w, kv_row(j, j->vc, base), hd);
    }
    return 0;
}

static void attn_items(void *arg, int64_t i0, int64_t i1) {
    struct attn_job *j = arg;
    for (int64_t i = i0; i < i1; i++)
        if (attend_one(j, i / j->n_head, i % j->n_head)) __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
}

void ntx_cpu_thread_cleanup(void) {
    free(tls_scores);
    tls_scores = NULL;
    tls_cap = 0;
}

static void store_kv(void *cache, int kv_f16, const float *src, int64_t off, int64_t count) {
    if (kv_f16) {
        half_t *c = (half_t *)cache + off;
        for (int64_t i = 0; i < count; i++) c[i] = f32_to_f16(src[i]);
    } else {
        memcpy((float *)cache + off, src, (size_t)count * sizeof(float));
    }
}

NTX_EXPORT int ntx_cpu_attention(struct ntx_cpu_pool *pool, const float *q, const float *k,
                                 const float *v, void *k_cache, void *v_cache, int kv_f16,
                                 int64_t n_ctx, int64_t start, int64_t n, int64_t n_head,
                                 int64_t n_kv, int64_t hd, float *out) {
    if (!q || !k || !v || !k_cache || !v_cache || !out || n <= 0 || start < 0 || hd <= 0 ||
        n_kv <= 0 || n_head % n_kv || start + n > n_ctx)
        return -EINVAL;
    pthread_once(&table_once, fill_f16_table);
    const int64_t row = n_kv * hd;
    store_kv(k_cache, kv_f16, k, start * row, n * row);
    store_kv(v_cache, kv_f16, v, start * row, n * row);
    struct attn_job job = {kv_f16 ? dot_f16 : dot_f32, kv_f16 ? axpy_f16 : axpy_f32, q, k_cache,
                           v_cache, kv_f16, start, n, n_head, n_kv, hd,
                           (float)(1.0 / sqrt((double)hd)), out, 0};
#if defined(__x86_64__)
    if (kv_f16 && ntx_cpu_simd_level() >= NTX_CPU_AVX2) {
        job.dot = dot_f16_avx2;
        job.axpy = axpy_f16_avx2;
    }
#endif
    int rc = ntx_pool_run(pool, attn_items, &job, n * n_head, 1);
    return rc ? rc : job.failed ? -ENOMEM : 0;
}

NTX_EXPORT int ntx_cpu_rope_attention(struct ntx_cpu_pool *pool, const float *q, const float *k,
                                      const float *v, const float *cos_t, const float *sin_t,
                                      int64_t rope_dim, int neox, void *k_cache, void *v_cache,
                                      int kv_f16, int64_t n_ctx, int64_t start, int64_t n,
                                      int64_t n_head, int64_t n_kv, int64_t hd, float *out) {
    if (!q || !k || n <= 0 || n_head <= 0 || n_kv <= 0 || hd <= 0) return -EINVAL;
    const size_t qn = (size_t)(n * n_head * hd), kn = (size_t)(n * n_kv * hd);
    float *buf = malloc((qn + kn) * sizeof(float));
    if (!buf) return -ENOMEM;
    memcpy(buf, q, qn * sizeof(float));
    memcpy(buf + qn, k, kn * sizeof(float));
    int rc = ntx_cpu_rope(buf, cos_t, sin_t, n, n_head, hd, rope_dim, neox);
    if (rc == 0) rc = ntx_cpu_rope(buf + qn, cos_t, sin_t, n, n_kv, hd, rope_dim, neox);
    if (rc == 0)
        rc = ntx_cpu_attention(pool, buf, buf + qn, v, k_cache, v_cache, kv_f16, n_ctx, start, n,
                               n_head, n_kv, hd, out);
    free(buf);
    return rc;
}
