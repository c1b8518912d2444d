/*
 * cpu_matmul.c - kernel-table selection (CPUID, NTX_CPU_SIMD) and the threaded matmul:
 * activations quantized once per call, then output rows split over the pool, each worker
 * reading its weight rows straight from the raw GGUF blocks.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <strings.h>

#include "cpu_impl.h"

static struct ntx_kernels tables[3];
static int active_level = -1;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

NTX_EXPORT int ntx_cpu_simd_supported(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return NTX_CPU_PORTABLE;
    if (__builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return NTX_CPU_AVX512VNNI;
    return NTX_CPU_AVX2;
#else
    return NTX_CPU_PORTABLE;
#endif
}

/* NTX_CPU_SIMD=portable|avx2|vnni caps the level (the CI runs the portable path this way) */
static int env_level(void) {
    const char *v = getenv("NTX_CPU_SIMD");
    if (!v || !*v) return NTX_CPU_AVX512VNNI;
    if (!strcasecmp(v, "portable")) return NTX_CPU_PORTABLE;
    if (!strcasecmp(v, "avx2")) return NTX_CPU_AVX2;
    return NTX_CPU_AVX512VNNI;
}

static void init_tables(void) {
    for (int i = 0; i < 3; i++) tables[i] = ntx_kernels_portable;
    ntx_kernels_fill_avx2(&tables[NTX_CPU_AVX2]);
    ntx_kernels_fill_vnni(&tables[NTX_CPU_AVX512VNNI]);
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

struct mm_job {
    ntx_dot_fn dot;
    const uint8_t *w;     /* (rows, row_bytes) raw blocks */
    const uint8_t *act;   /* (n, act_bytes) quantized activations */
    int64_t row_bytes, act_bytes, n, rows, k;
    float *out;           /* (n, rows) */
};

#define ROW_TILE 8 /* rows kept hot in L1 while every token's activation row passes over them */

static void mm_items(void *arg, int64_t r0, int64_t r1) {
    const struct mm_job *j = arg;
    for (int64_t t0 = r0; t0 < r1; t0 += ROW_TILE) {
        int64_t t1 = t0 + ROW_TILE < r1 ? t0 + ROW_TILE : r1;
        for (int64_t t = 0; t < j->n; t++) {
            const uint8_t *a = j->act + t * j->act_bytes;
            float *o = j->out + t * j->rows;
            for (int64_t r = t0; r < t1; r++) o[r] = j->dot(j->k, j->w + r * j->row_bytes, a);
        }
    }
}

static int64_t grain_for(const struct ntx_cpu_pool *pool, int64_t rows) {
    int64_t nth = ntx_cpu_pool_threads(pool), g = rows / (nth * 8);
    g = (g + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
    return g < ROW_TILE ? ROW_TILE : g;
}

NTX_EXPORT int ntx_cpu_matmul(struct ntx_cpu_pool *pool, int weight_type, const void *w,
                              int64_t rows, int64_t k, const float *x, int64_t n, float *out) {
    int block, bytes;
    int64_t act_bytes = ntx_cpu_act_row_bytes(weight_type, k);
    if (act_bytes < 0) return (int)act_bytes;
    if (!w || !x || !out || rows <= 0 || n <= 0 || !ntx_type_block(weight_type, &block, &bytes))
        return -EINVAL;
    void *act = NULL;
    if (posix_memalign(&act, 64, (size_t)(n * act_bytes))) return -ENOMEM;
    int rc = ntx_cpu_quantize_act(weight_type, x, n, k, act);
    if (rc == 0) {
        struct mm_job job = {ntx_kernels_active()->dot[weight_type], w, act, k / block * bytes,
                             act_bytes, n, rows, k, out};
        rc = job.dot ? ntx_pool_run(pool, mm_items, &job, rows, grain_for(pool, rows)) : -EINVAL;
    }
    free(act);
    return rc;
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
