/*
 * ntx_cpu.h - public API of ntx's native CPU kernels: quantized matmul on raw GGUF blocks
 * and the other ops of one transformer layer (RMSNorm, RoPE, F16/F32 KV-cache attention,
 * SwiGLU, add).
 *
 * Every function returns 0 or a negative errno; none aborts or exits. Work is split over a
 * persistent thread pool (ntx_cpu_pool_open/close); the calling thread is worker 0. Every wait
 * has a deadline: a job not finished within the pool's deadline returns -ETIMEDOUT.
 * cffi releases the GIL around each call (out-of-line API mode).
 *
 * Activations are quantized exactly as ggml's CPU backend does before its integer dot
 * products (Q8_0 / Q8_1 / Q8_K by weight type; F16/BF16 rounding for float weights).
 *
 * The block between the cdef markers is fed verbatim to cffi's cdef(): declarations only.
 */
#ifndef NTX_CPU_H
#define NTX_CPU_H

#include <stddef.h>
#include <stdint.h>

/* cdef-begin */
struct ntx_cpu_pool;

/* SIMD levels of the kernel table */
enum {
    NTX_CPU_PORTABLE = 0,    /* plain C */
    NTX_CPU_AVX2 = 1,        /* AVX2 + FMA + F16C */
    NTX_CPU_AVX512VNNI = 2,  /* the AVX2 kernels with VNNI (vpdpbusd on 256-bit lanes) */
    NTX_CPU_AVX512 = 3       /* 512-bit Q4_K/Q6_K/Q8_0 kernels (AVX512F/BW/VL/DQ/VNNI), else level 2 */
};

int ntx_cpu_simd_supported(void);        /* the best level this CPU can run */
int ntx_cpu_simd_select(int level);      /* use min(level, supported); returns the level in use */
int ntx_cpu_simd_level(void);
/* 1 if the active table reads a weight row once for several activation rows of this type */
int ntx_cpu_multi_row(int weight_type);

int ntx_cpu_pool_open(struct ntx_cpu_pool **out, int n_threads, int spin_us, int deadline_ms);
void ntx_cpu_pool_close(struct ntx_cpu_pool *pool);
int ntx_cpu_pool_threads(const struct ntx_cpu_pool *pool);

/* bytes of one activation row of k values in the weight type's vec_dot format (< 0: bad type/k) */
int64_t ntx_cpu_act_row_bytes(int weight_type, int64_t k);
/* quantize n rows of k floats to the vec_dot format of weight_type (ggml's from_float) */
int ntx_cpu_quantize_act(int weight_type, const float *x, int64_t n, int64_t k, void *out);

/* out (n, rows) = x (n, k) @ W^T, W = rows x k raw GGUF blocks of weight_type */
int ntx_cpu_matmul(struct ntx_cpu_pool *pool, int weight_type, const void *w, int64_t rows,
                   int64_t k, const float *x, int64_t n, float *out);
/* up to 8 weights sharing x (q, k, v): x quantized once per format, one pass of the pool */
int ntx_cpu_matmul_many(struct ntx_cpu_pool *pool, int count, const int *types,
                        const void *const *ws, const int64_t *rows, int64_t k, const float *x,
                        int64_t n, float *const *outs);
/* out (n, rows) = silu(x @ Wg^T) * (x @ Wu^T): the FFN's gate and up in one pass */
int ntx_cpu_matmul_swiglu(struct ntx_cpu_pool *pool, int gate_type, const void *w_gate,
                          int up_type, const void *w_up, int64_t rows, int64_t k,
                          const float *x, int64_t n, float *out);
/* out (n, d) = x / sqrt(mean(x^2) + eps) * w, the mean summed in double as ggml does */
int ntx_cpu_rmsnorm(struct ntx_cpu_pool *pool, const float *x, const float *w, int64_t n,
                    int64_t d, float eps, float *out);
/* rotate x (n, n_heads, head_dim) in place by cos/sin (n, rope_dim/2); neox: 1 = halves, 0 = pairs */
int ntx_cpu_rope(float *x, const float *cos_t, const float *sin_t, int64_t n, int64_t n_heads,
                 int64_t head_dim, int64_t rope_dim, int neox);
/* out = gate * sigmoid(gate) * up, elementwise over count values */
int ntx_cpu_swiglu(struct ntx_cpu_pool *pool, const float *gate, const float *up, int64_t count,
                   float *out);
int ntx_cpu_add(const float *a, const float *b, int64_t count, float *out);

/* write k, v (n, n_kv*hd) at positions start.. of the cache (n_ctx, n_kv, hd), then causal GQA
   attention of q (n, n_head*hd) over positions 0..start+n-1 -> out (n, n_head*hd).
   kv_f16: 1 = caches hold fp16 (q and the probabilities rounded to fp16 as ggml does), 0 = f32 */
int ntx_cpu_attention(struct ntx_cpu_pool *pool, const float *q, const float *k, const float *v,
                      void *k_cache, void *v_cache, int kv_f16, int64_t n_ctx, int64_t start,
                      int64_t n, int64_t n_head, int64_t n_kv, int64_t hd, float *out);

/* rope (like ntx_cpu_rope, on copies) of q (n, n_head*hd) and k (n, n_kv*hd), then attention */
int ntx_cpu_rope_attention(struct ntx_cpu_pool *pool, const float *q, const float *k,
                           const float *v, const float *cos_t, const float *sin_t,
                           int64_t rope_dim, int neox, void *k_cache, void *v_cache, int kv_f16,
                           int64_t n_ctx, int64_t start, int64_t n, int64_t n_head, int64_t n_kv,
                           int64_t hd, float *out);

/* one llama-family decoder layer with a dense SwiGLU FFN (cpu_layer.c) */
struct ntx_cpu_layer {
    int64_t n_embd, n_head, n_kv, head_dim, n_ff;
    int64_t rope_dim;          /* rotated dims per head (even, <= head_dim) */
    int neox;                  /* RoPE: 1 = halves (neox), 0 = adjacent pairs */
    float eps;                 /* RMSNorm epsilon */
    int types[7];              /* ggml types of wq, wk, wv, wo, w_gate, w_up, w_down */
    const void *w[7];          /* their raw GGUF blocks: (n_head*hd, n_embd), (n_kv*hd, n_embd) x2,
                                  (n_embd, n_head*hd), (n_ff, n_embd) x2, (n_embd, n_ff) */
    const float *attn_norm;    /* (n_embd,) */
    const float *ffn_norm;     /* (n_embd,) */
    const float *bq, *bk, *bv; /* (n_head*hd,), (n_kv*hd,) x2: qwen2 biases, or all NULL */
    void *k_cache, *v_cache;   /* (n_ctx, n_kv, hd) of this layer, fp16 or f32 */
    int kv_f16;
    int64_t n_ctx;
};
/* x (n, n_embd) += the layer's attention, then += its FFN, for tokens at positions start..;
   cos/sin (n, rope_dim/2). The same kernels in the same order as the op-by-op calls above. */
int ntx_cpu_layer_forward(struct ntx_cpu_pool *pool, const struct ntx_cpu_layer *layer, float *x,
                          int64_t n, int64_t start, const float *cos_t, const float *sin_t);

/* NUMA nodes in /sys/devices/system/node (1 when the directory is absent) */
int ntx_cpu_numa_nodes(void);
/* cdef-end */

#endif
