/*
 * cpu_layer.c - one whole llama-family decoder layer (dense SwiGLU FFN, optional qwen2 q/k/v
 * biases) in one call: the op-by-op native path (model.py's block over NativeCpuBackend) costs
 * ~10 Python-level calls per layer, each a return to Python that must re-take the GIL; next to
 * the streaming pipeline's Python threads that wait, not the arithmetic, is what slowed the
 * CPU-computed layers. Here the same kernels run in the same order on the same buffers, so the
 * result is the op-by-op path's bit for bit (tests/cpu/test_layer.py):
 *
 *   h = rmsnorm(x, attn_norm); q, k, v = h @ {Wq, Wk, Wv}^T (+ biases); rope(q), rope(k);
 *   write k, v into the cache; a = attention(q); x += a @ Wo^T;
 *   h = rmsnorm(x, ffn_norm); g = silu(h @ Wg^T) * (h @ Wu^T); x += g @ Wd^T
 *
 * Q/K/V are one parallel region (matmul_many), gate/up another (matmul_swiglu).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>

#include "cpu_impl.h"

enum { W_Q, W_K, W_V, W_O, W_GATE, W_UP, W_DOWN };

static int layer_valid(const struct ntx_cpu_layer *L, int64_t n, int64_t start) {
    if (!L || n <= 0 || start < 0 || L->n_embd <= 0 || L->n_head <= 0 || L->n_kv <= 0 ||
        L->head_dim <= 0 || L->n_ff <= 0 || L->n_head % L->n_kv || start + n > L->n_ctx)
        return 0;
    if (!L->attn_norm || !L->ffn_norm || !L->k_cache || !L->v_cache) return 0;
    if ((L->bq != NULL) != (L->bk != NULL) || (L->bq != NULL) != (L->bv != NULL)) return 0;
    for (int i = 0; i < 7; i++)
        if (!L->w[i]) return 0;
    return L->rope_dim > 0 && L->rope_dim <= L->head_dim && L->rope_dim % 2 == 0;
}

/* out[t, :] += bias for each of n rows (numpy's broadcast add: one float add per element) */
static void add_bias(float *out, const float *bias, int64_t n, int64_t d) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < d; i++) out[t * d + i] = out[t * d + i] + bias[i];
}

static int attention_half(struct ntx_cpu_pool *pool, const struct ntx_cpu_layer *L, float *x,
                          int64_t n, int64_t start, const float *cos_t, const float *sin_t,
                          float *h, float *q, float *k, float *v, float *a, float *o) {
    const int64_t e = L->n_embd, qd = L->n_head * L->head_dim, kvd = L->n_kv * L->head_dim;
    int rc = ntx_cpu_rmsnorm(pool, x, L->attn_norm, n, e, L->eps, h);
    if (rc) return rc;
    const int types[3] = {L->types[W_Q], L->types[W_K], L->types[W_V]};
    const void *ws[3] = {L->w[W_Q], L->w[W_K], L->w[W_V]};
    const int64_t rows[3] = {qd, kvd, kvd};
    float *outs[3] = {q, k, v};
    rc = ntx_cpu_matmul_many(pool, 3, types, ws, rows, e, h, n, outs);
    if (rc) return rc;
    if (L->bq) {
        add_bias(q, L->bq, n, qd);
        add_bias(k, L->bk, n, kvd);
        add_bias(v, L->bv, n, kvd);
    }
    rc = ntx_cpu_rope(q, cos_t, sin_t, n, L->n_head, L->head_dim, L->rope_dim, L->neox);
    if (rc == 0) rc = ntx_cpu_rope(k, cos_t, sin_t, n, L->n_kv, L->head_dim, L->rope_dim, L->neox);
    if (rc == 0)
        rc = ntx_cpu_attention(pool, q, k, v, L->k_cache, L->v_cache, L->kv_f16, L->n_ctx, start, n,
                               L->n_head, L->n_kv, L->head_dim, a);
    if (rc == 0) rc = ntx_cpu_matmul(pool, L->types[W_O], L->w[W_O], e, qd, a, n, o);
    if (rc == 0) rc = ntx_cpu_add(x, o, n * e, x);
    return rc;
}

static int ffn_half(struct ntx_cpu_pool *pool, const struct ntx_cpu_layer *L, float *x, int64_t n,
                    float *h, float *g, float *o) {
    const int64_t e = L->n_embd;
    int rc = ntx_cpu_rmsnorm(pool, x, L->ffn_norm, n, e, L->eps, h);
    if (rc == 0)
        rc = ntx_cpu_matmul_swiglu(pool, L->types[W_GATE], L->w[W_GATE], L->types[W_UP], L->w[W_UP],
                                   L->n_ff, e, h, n, g);
    if (rc == 0) rc = ntx_cpu_matmul(pool, L->types[W_DOWN], L->w[W_DOWN], e, L->n_ff, g, n, o);
    if (rc == 0) rc = ntx_cpu_add(x, o, n * e, x);
    return rc;
}

NTX_EXPORT int ntx_cpu_layer_forward(struct ntx_cpu_pool *pool, const struct ntx_cpu_layer *layer,
                                     float *x, int64_t n, int64_t start, const float *cos_t,
                                     const float *sin_t) {
    if (!x || !cos_t || !sin_t || !layer_valid(layer, n, start)) return -EINVAL;
    const struct ntx_cpu_layer *L = layer;
    const int64_t e = L->n_embd, qd = L->n_head * L->head_dim, kvd = L->n_kv * L->head_dim;
    /* h (n, e) | q (n, qd) | k, v (n, kvd) | a (n, qd) | o (n, e) | g (n, n_ff) */
    const int64_t per_token = 2 * e + 2 * qd + 2 * kvd + L->n_ff;
    float *buf = NULL;
    if (posix_memalign((void **)&buf, 64, (size_t)(n * per_token) * sizeof(float))) return -ENOMEM;
    float *h = buf, *q = h + n * e, *k = q + n * qd, *v = k + n * kvd, *a = v + n * kvd;
    float *o = a + n * qd, *g = o + n * e;
    int rc = attention_half(pool, L, x, n, start, cos_t, sin_t, h, q, k, v, a, o);
    if (rc == 0) rc = ffn_half(pool, L, x, n, h, g, o);
    free(buf);
    return rc;
}
