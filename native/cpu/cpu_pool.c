/*
 * cpu_pool.c - the persistent thread pool: created once, the caller is worker 0.
 *
 * Decode calls a few hundred small jobs per token, so waking sleeping threads through the
 * kernel for each (tens of microseconds) would cost more than the work. Workers therefore spin
 * on the job generation for `spin_us` after each job before sleeping on a condition variable;
 * every sleep and every wait for completion has a deadline.
 *
 * On a busy machine a worker may not get a core for milliseconds, so the caller never waits
 * for a worker that has not joined the job: workers join through one atomic word (generation,
 * closed bit, joined count); the caller claims chunks like any worker, then closes the job and
 * waits only for the workers that joined. A late worker finds the job closed and goes back.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "cpu_impl.h"

#define IDLE_SLICE_MS 200 /* a sleeping worker re-checks for shutdown this often */

/* The words every worker writes (next: each chunk claim; join, finished: once per job) sit on
   cache lines of their own, away from the job description they all read, so a claim does not
   invalidate every other worker's copy of fn/arg/grain (false sharing at 16 threads). */
struct ntx_cpu_pool {
    int n_threads;
    int spin_us;
    int deadline_ms;
    pthread_t *threads;
    int started;                /* worker threads created (threads[1..started]) */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    int stuck;                  /* a joined worker missed the deadline: refuse new jobs */
    ntx_item_fn fn;             /* the job: written by the caller before gen moves */
    void *arg;
    int64_t n_items, grain;
    _Alignas(64) atomic_uint gen;  /* bumped once per job: the wake-up signal */
    atomic_int sleeping;
    atomic_int stop;
    _Alignas(64) _Atomic uint64_t join;  /* gen << 32 | JOIN_CLOSED | workers joined */
    _Alignas(64) atomic_int finished;    /* joined workers done with the current job */
    _Alignas(64) atomic_llong next;      /* next unclaimed item of the current job */
};

#define JOIN_CLOSED (1ull << 31)
#define JOIN_COUNT (JOIN_CLOSED - 1)

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void deadline_in(struct timespec *ts, int ms) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* claim chunks of the current job until none is left */
static void run_items(struct ntx_cpu_pool *p) {
    for (;;) {
        int64_t begin = atomic_fetch_add(&p->next, p->grain);
        if (begin >= p->n_items) return;
        int64_t end = begin + p->grain < p->n_items ? begin + p->grain : p->n_items;
        p->fn(p->arg, begin, end);
    }
}

/* wait until the generation moves past `seen` or the pool stops; 1 if there is a job. The spin
   looks at the generation after every pause (a pause is ~40-140 cycles: a new job is seen within
   tens of ns, not after a batch of pauses) and at the clock every 256 pauses. */
static int wait_for_job(struct ntx_cpu_pool *p, unsigned seen) {
    int64_t spin_end = now_us() + p->spin_us;
    while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) {
        if (now_us() < spin_end) {
            for (int i = 0; i < 256 && atomic_load_explicit(&p->gen, memory_order_relaxed) == seen; i++)
                cpu_relax();
            continue;
        }
        atomic_fetch_add(&p->sleeping, 1);
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) {
            struct timespec ts;
            deadline_in(&ts, IDLE_SLICE_MS);
            pthread_cond_timedwait(&p->wake, &p->mu, &ts);  /* ETIMEDOUT: loop and re-check */
        }
        pthread_mutex_unlock(&p->mu);
        atomic_fetch_sub(&p->sleeping, 1);
    }
    return !atomic_load(&p->stop);
}

/* 1 if this worker joined job `gen` (still open); its fields are then stable until it finishes */
static int join_job(struct ntx_cpu_pool *p, unsigned gen) {
    uint64_t w = atomic_load(&p->join);
    while ((unsigned)(w >> 32) == gen && !(w & JOIN_CLOSED)) {
        if (atomic_compare_exchange_weak(&p->join, &w, w + 1)) return 1;
    }
    return 0;
}

static void *worker_main(void *arg) {
    struct ntx_cpu_pool *p = arg;
    unsigned seen = atomic_load(&p->gen);
    while (wait_for_job(p, seen)) {
        seen = atomic_load(&p->gen);
        if (!join_job(p, seen)) continue;
        run_items(p);
        atomic_fetch_add(&p->finished, 1);
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->done);
        pthread_mutex_unlock(&p->mu);
    }
    ntx_cpu_thread_cleanup();
    return NULL;
}

static int init_sync(struct ntx_cpu_pool *p) {
    pthread_condattr_t ca;
    int rc = pthread_mutex_init(&p->mu, NULL);
    if (rc) return -rc;
    if ((rc = pthread_condattr_init(&ca)) != 0) goto fail_mu;
    if ((rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC)) != 0) goto fail_ca;
    if ((rc = pthread_cond_init(&p->wake, &ca)) != 0) goto fail_ca;
    if ((rc = pthread_cond_init(&p->done, &ca)) != 0) goto fail_wake;
    pthread_condattr_destroy(&ca);
    return 0;
fail_wake:
    pthread_cond_destroy(&p->wake);
fail_ca:
    pthread_condattr_destroy(&ca);
fail_mu:
    pthread_mutex_destroy(&p->mu);
    return -rc;
}

NTX_EXPORT int ntx_cpu_pool_open(struct ntx_cpu_pool **out, int n_threads, int spin_us,
                                 int deadline_ms) {
    if (!out || n_threads < 1 || n_threads > 1024 || spin_us < 0 || deadline_ms < 1) return -EINVAL;
    struct ntx_cpu_pool *p = NULL;
    if (posix_memalign((void **)&p, 64, sizeof(*p))) return -ENOMEM;
    memset(p, 0, sizeof(*p));
    p->n_threads = n_threads;
    p->spin_us = spin_us;
    p->deadline_ms = deadline_ms;
    p->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    int rc = p->threads ? init_sync(p) : -ENOMEM;
    if (rc) {
        free(p->threads);
        free(p);
        return rc;
    }
    for (int i = 1; i < n_threads; i++) {
        int err = pthread_create(&p->threads[i], NULL, worker_main, p);
        if (err) {
            ntx_cpu_pool_close(p);
            return -err;
        }
        p->started = i;
    }
    *out = p;
    return 0;
}

NTX_EXPORT void ntx_cpu_pool_close(struct ntx_cpu_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, 1);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i <= p->started; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p);
}

NTX_EXPORT int ntx_cpu_pool_threads(const struct ntx_cpu_pool *p) {
    return p ? p->n_threads : 1;
}

/* close the job to latecomers, then wait for the workers that joined it */
static int wait_done(struct ntx_cpu_pool *p) {
    int joined = (int)(atomic_fetch_or(&p->join, JOIN_CLOSED) & JOIN_COUNT);
    int64_t spin_end = now_us() + 200;
    while (atomic_load(&p->finished) < joined && now_us() < spin_end) cpu_relax();
    if (atomic_load(&p->finished) >= joined) return 0;
    struct timespec ts;
    deadline_in(&ts, p->deadline_ms);
    int rc = 0;
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&p->finished) < joined && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&p->done, &p->mu, &ts);
    int late = atomic_load(&p->finished) < joined;
    pthread_mutex_unlock(&p->mu);
    if (late) p->stuck = 1;  /* that worker may still read this job: never reuse the pool */
    return late ? -ETIMEDOUT : 0;
}

/* One job at a time per pool: the Python wrapper serializes calls with a lock. */
int ntx_pool_run(struct ntx_cpu_pool *p, ntx_item_fn fn, void *arg, int64_t n_items,
                 int64_t grain) {
    if (n_items <= 0) return 0;
    if (grain < 1) grain = 1;
    if (p && p->stuck) return -EBUSY;
    if (!p || p->started == 0 || n_items <= grain) {
        fn(arg, 0, n_items);
        return 0;
    }
    p->fn = fn;
    p->arg = arg;
    p->n_items = n_items;
    p->grain = grain;
    atomic_store(&p->next, 0);
    atomic_store(&p->finished, 0);
    unsigned gen = atomic_load(&p->gen) + 1;
    atomic_store(&p->join, (uint64_t)gen << 32);
    atomic_store(&p->gen, gen);
    if (atomic_load(&p->sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
    run_items(p);
    return wait_done(p);
}
