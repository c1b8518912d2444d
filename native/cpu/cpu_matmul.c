/*
 * cpu_matmul.c - kernel-table selection (CPUID, NTX_CPU_SIMD) and the threaded matmul:
 * activations quantized once per call, then output rows split over the pool, each worker
 * reading its weight rows straight from the raw GGUF blocks.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <strings.h>

#include "cpu_impl.h"

#define N_LEVELS 4
static struct ntx_kernels tables[N_LEVELS];
static int active_level = -1;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

NTX_EXPORT int ntx_cpu_simd_supported(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return NTX_CPU_PORTABLE;
    if (!__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512vnni")) return NTX_CPU_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq"))
        return NTX_CPU_AVX512;
    return NTX_CPU_AVX512VNNI;
#else
    return NTX_CPU_PORTABLE;
#endif
}

/* NTX_CPU_SIMD=portable|avx2|vnni|avx512 caps the level (the CI runs the portable path this way) */
static int env_level(void) {
    const char *v = getenv("NTX_CPU_SIMD");
    if (!v || !*v) return NTX_CPU_AVX512;
    if (!strcasecmp(v, "portable")) return NTX_CPU_PORTABLE;
    if (!strcasecmp(v, "avx2")) return NTX_CPU_AVX2;
    if (!strcasecmp(v, "vnni") || !strcasecmp(v, "avx512vnni")) return NTX_CPU_AVX512VNNI;
    return NTX_CPU_AVX512;
}

static void init_tables(void) {
    ntx_portable_init();
    for (int i = 0; i < N_LEVELS; i++) tables[i] = ntx_kernels_portable;
    ntx_kernels_fill_avx2(&tables[NTX_CPU_AVX2]);
    ntx_kernels_fill_vnni(&tables[NTX_CPU_AVX512VNNI]);
    tables[NTX_CPU_AVX512] = tables[NTX_CPU_AVX512VNNI];  /* the zmm kernels replace a few types */
    ntx_kernels_fill_avx512(&tables[NTX_CPU_AVX512]);
    int want = env_level(), have = ntx_cpu_simd_supported();
    active_level = want < have ? want : have;
}

NTX_EXPORT int ntx_cpu_simd_select(int level) {
    pthread_once(&init_once, init_tables);
    if (level < 0) return -EINVAL;
    int have = ntx_cpu_simd_supported();
    __atomic_store_n(&active_level, level < have ? level : have, __ATOMIC_SEQ_CST);
    return active_level;
}

NTX_EXPORT int ntx_cpu_simd_level(void) {
    pthread_once(&init_once, init_tables);
    return __atomic_load_n(&active_level, __ATOMIC_SEQ_CST);
}

const struct ntx_kernels *ntx_kernels_active(void) {
    return &tables[ntx_cpu_simd_level()];
}

NTX_EXPORT int ntx_cpu_multi_row(int weight_type) {
    if (weight_type < 0 || weight_type >= T_COUNT) return -EINVAL;
    return ntx_kernels_active()->dotn[weight_type] != NULL;
}

#define MAX_MANY 8 /* weights sharing one activation per call (q, k, v; gate, up) */

struct mm_part {
    ntx_dotn_fn dotn;     /* 1..NTX_DOTN_MAX activation rows per call */
    const uint8_t *w;     /* (rows, row_bytes) raw blocks */
    const uint8_t *act;   /* (n, act_bytes) quantized activations */
    int64_t row_bytes, act_bytes, rows, first;  /* first: its offset in the job's row space */
    float *out;           /* (n, rows) */
};

struct mm_job {
    int count;
    struct mm_part part[MAX_MANY];
    int64_t n, k;
    float *swiglu_out;    /* swiglu job: out = silu(part 0) * part 1, (n, rows) */
};

#define ROW_TILE 8 /* rows kept hot in L1 while every token's activation row passes over them */

/* out[(t - t0) * out_stride] for activation rows t0..t1 of weight row w: dotn reads the row's
   blocks once per NTX_DOTN_MAX activation rows (each value bit-identical to dot's) */
static void dot_rows(const struct mm_job *j, const struct mm_part *m, const uint8_t *w, int64_t t0,
                     int64_t t1, float *out, int64_t out_stride) {
    for (int64_t t = t0; t < t1; t += NTX_DOTN_MAX) {
        int nt = t1 - t < NTX_DOTN_MAX ? (int)(t1 - t) : NTX_DOTN_MAX;
        m->dotn(j->k, w, m->act + t * m->act_bytes, m->act_bytes, nt, out + (t - t0) * out_stride, out_stride);
    }
}

static void mm_rows(const struct mm_job *j, const struct mm_part *m, int64_t r0, int64_t r1) {
    for (int64_t t0 = r0; t0 < r1; t0 += ROW_TILE) {
        int64_t t1 = t0 + ROW_TILE < r1 ? t0 + ROW_TILE : r1;
        for (int64_t t = 0; t < j->n; t += NTX_DOTN_MAX) {
            int64_t te = t + NTX_DOTN_MAX < j->n ? t + NTX_DOTN_MAX : j->n;
            for (int64_t r = t0; r < t1; r++)
                dot_rows(j, m, m->w + r * m->row_bytes, t, te, m->out + t * m->rows + r, m->rows);
        }
    }
}

/* a chunk of the concatenated row space of all parts */
static void mm_items(void *arg, int64_t r0, int64_t r1) {
    const struct mm_job *j = arg;
    for (int i = 0; i < j->count; i++) {
        const struct mm_part *m = &j->part[i];
        int64_t lo = r0 > m->first ? r0 : m->first, hi = r1 < m->first + m->rows ? r1 : m->first + m->rows;
        if (lo < hi) mm_rows(j, m, lo - m->first, hi - m->first);
    }
}

static void swiglu_items(void *arg, int64_t r0, int64_t r1) {
    const struct mm_job *j = arg;
    const struct mm_part *g = &j->part[0], *u = &j->part[1];
    float gv[NTX_DOTN_MAX], uv[NTX_DOTN_MAX];
    for (int64_t t = 0; t < j->n; t += NTX_DOTN_MAX) {
        int64_t te = t + NTX_DOTN_MAX < j->n ? t + NTX_DOTN_MAX : j->n;
        for (int64_t r = r0; r < r1; r++) {
            dot_rows(j, g, g->w + r * g->row_bytes, t, te, gv, 1);
            dot_rows(j, u, u->w + r * u->row_bytes, t, te, uv, 1);
            for (int64_t i = t; i < te; i++)
                j->swiglu_out[i * g->rows + r] = (gv[i - t] / (1.0f + expf(-gv[i - t]))) * uv[i - t];
        }
    }
}

static int64_t grain_for(const struct ntx_cpu_pool *pool, int64_t rows) {
    int64_t nth = ntx_cpu_pool_threads(pool), g = rows / (nth * 8);
    g = (g + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
    return g < ROW_TILE ? ROW_TILE : g;
}

/* fill the parts and quantize x once per distinct activation format; *acts to free */
static int mm_prepare(struct mm_job *j, int count, const int *types, const void *const *ws,
                      const int64_t *rows, const float *x, void **acts) {
    const struct ntx_kernels *kt = ntx_kernels_active();
    int64_t first = 0;
    for (int i = 0; i < count; i++) {
        struct mm_part *m = &j->part[i];
        int block, bytes, t = types[i];
        m->act_bytes = ntx_cpu_act_row_bytes(t, j->k);
        if (m->act_bytes < 0 || !ws[i] || rows[i] <= 0 || !ntx_type_block(t, &block, &bytes) || !kt->dotn[t])
            return -EINVAL;
        m->dotn = kt->dotn[t];
        m->w = ws[i];
        m->row_bytes = j->k / block * bytes;
        m->rows = rows[i];
        m->first = first;
        first += rows[i];
        m->act = NULL;
        for (int p = 0; p < i; p++)
            if (ntx_act_type(types[p]) == ntx_act_type(t)) m->act = j->part[p].act;
        if (m->act) continue;
        if (posix_memalign(&acts[i], 64, (size_t)(j->n * m->act_bytes))) return -ENOMEM;
        m->act = acts[i];
        int rc = ntx_cpu_quantize_act(t, x, j->n, j->k, acts[i]);
        if (rc) return rc;
    }
    return 0;
}

static int mm_run(struct ntx_cpu_pool *pool, int count, const int *types, const void *const *ws,
                  const int64_t *rows, int64_t k, const float *x, int64_t n, float *const *outs,
                  float *swiglu_out) {
    if (count < 1 || count > MAX_MANY || !types || !ws || !rows || !x || k <= 0 || n <= 0)
        return -EINVAL;
    struct mm_job job = {.count = count, .n = n, .k = k, .swiglu_out = swiglu_out};
    void *acts[MAX_MANY] = {0};
    int rc = mm_prepare(&job, count, types, ws, rows, x, acts);
    int64_t total = 0;
    for (int i = 0; i < count && rc == 0; i++) {
        job.part[i].out = outs ? outs[i] : NULL;
        if (!swiglu_out && !outs[i]) rc = -EINVAL;
        total += rows[i];
    }
    if (rc == 0 && swiglu_out)
        rc = ntx_pool_run(pool, swiglu_items, &job, rows[0], grain_for(pool, rows[0]));
    else if (rc == 0)
        rc = ntx_pool_run(pool, mm_items, &job, total, grain_for(pool, total));
    for (int i = 0; i < count; i++) free(acts[i]);
    return rc;
}

NTX_EXPORT int ntx_cpu_matmul(struct ntx_cpu_pool *pool, int weight_type, const void *w,
                              int64_t rows, int64_t k, const float *x, int64_t n, float *out) {
    if (!out) return -EINVAL;
    return mm_run(pool, 1, &weight_type, &w, &rows, k, x, n, &out, NULL);
}

NTX_EXPORT int ntx_cpu_matmul_many(struct ntx_cpu_pool *pool, int count, const int *types,
                                   const void *const *ws, const int64_t *rows, int64_t k,
                                   const float *x, int64_t n, float *const *outs) {
    if (!outs) return -EINVAL;
    return mm_run(pool, count, types, ws, rows, k, x, n, outs, NULL);
}

NTX_EXPORT int ntx_cpu_matmul_swiglu(struct ntx_cpu_pool *pool, int gate_type, const void *w_gate,
                                     int up_type, const void *w_up, int64_t rows, int64_t k,
                                     const float *x, int64_t n, float *out) {
    if (!out) return -EINVAL;
    const int types[2] = {gate_type, up_type};
    const void *ws[2] = {w_gate, w_up};
    const int64_t rr[2] = {rows, rows};
    return mm_run(pool, 2, types, ws, rr, k, x, n, NULL, out);
}

NTX_EXPORT int ntx_cpu_numa_nodes(void) {
    DIR *d = opendir("/sys/devices/system/node");
    if (!d) return 1;
    int nodes = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (!strncmp(e->d_name, "node", 4) && e->d_name[4] >= '0' && e->d_name[4] <= '9') nodes++;
    closedir(d);
    return nodes > 0 ? nodes : 1;
}
