/*
 * nvme_dev.c - the public lifecycle of a device: open/close, reset, info and statistics,
 * and the DMA map/unmap pair for the caller's buffers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "nvme_impl.h"

void ntx_nvme_default_opts(struct ntx_nvme_opts *o)
{
    *o = (struct ntx_nvme_opts){
        .iommu = 1, .nqueues = 4, .qdepth = 256, .nsid = 0,
        .cmd_timeout_us = 10u * 1000u * 1000u, .admin_timeout_ms = 10u * 1000u, .range_check = 1,
    };
}

static int check_opts(struct ntx_nvme *d, const char *bdf)
{
    const struct ntx_nvme_opts *o = &d->opts;
    if (!bdf || strlen(bdf) >= sizeof d->bdf)
        return nx_fail(d, EINVAL, "bad PCI address (expected DDDD:BB:DD.F)");
    if (o->nqueues < 1 || o->nqueues > NX_MAX_QUEUES)
        return nx_fail(d, EINVAL, "nqueues must be 1..%d, got %u", NX_MAX_QUEUES, o->nqueues);
    if (o->qdepth < 2 || o->qdepth > 65536)
        return nx_fail(d, EINVAL, "qdepth must be 2..65536, got %u", o->qdepth);
    if (!o->cmd_timeout_us || !o->admin_timeout_ms)
        return nx_fail(d, EINVAL, "timeouts must be positive");
    return 0;
}

/* CAP and VS: what the controller can do, before touching its state (NVMe 2.0 §3.1.3.1). */
static int read_capabilities(struct ntx_nvme *d)
{
    struct ntx_nvme_info *i = &d->info;
    d->cap = nx_rd64(d, NVME_REG_CAP);
    i->vs = nx_rd32(d, NVME_REG_VS);
    if (d->gone)
        return nx_ctrl_check(d);
    i->cap = d->cap;
    i->mqes = NVME_CAP_MQES(d->cap) + 1;
    i->to_ms = NVME_CAP_TO(d->cap) ? NVME_CAP_TO(d->cap) * 500u : 500u;
    d->dstrd = 4u << NVME_CAP_DSTRD(d->cap);
    i->dstrd_bytes = d->dstrd;
    i->mpsmin_bytes = 1u << (12 + NVME_CAP_MPSMIN(d->cap));
    i->noiommu = d->vfio.noiommu;
    if (NVME_CAP_MPSMIN(d->cap) > 0)
        return nx_fail(d, ENOTSUP, "%s needs memory pages of at least %u bytes; this driver uses 4 KiB",
                       d->bdf, i->mpsmin_bytes);
    if (!(NVME_CAP_CSS(d->cap) & 1u))
        return nx_fail(d, ENOTSUP, "%s does not support the NVM command set (CAP.CSS=0x%x)",
                       d->bdf, NVME_CAP_CSS(d->cap));
    return 0;
}

static int arena_open(struct ntx_nvme *d)
{
    size_t len = nx_arena_size(d, d->want_nq, d->want_depth);
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, flags | MAP_HUGETLB, -1, 0);
    d->arena_huge = p != MAP_FAILED;
    if (p == MAP_FAILED && d->vfio.noiommu)
        return nx_fail(d, ENOMEM, "no-IOMMU mode needs %zu MiB of free 2 MiB hugepages for the "
                       "driver's queues (raise /proc/sys/vm/nr_hugepages)", len >> 20);
    if (p == MAP_FAILED)
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED)
        return nx_fail(d, errno, "cannot allocate %zu bytes for the queues: %s", len, strerror(errno));
    d->arena = p;
    d->arena_len = len;
    return nx_region_map(d, p, len, 1);
}

static void release(struct ntx_nvme *d)
{
    for (uint32_t i = 0; i < NX_MAX_QUEUES; i++)
        nx_queue_free(&d->ioq[i]);
    nx_queue_free(&d->admin);
    for (int i = 0; i < NX_MAX_REGIONS; i++)
        if (d->vfio.regions[i].in_use)
            nx_region_unmap(d, (void *)d->vfio.regions[i].va);
    if (d->arena)
        munmap(d->arena, d->arena_len);
    nx_vfio_close(&d->vfio);
    nx_batches_free(d);
    free(d);
}

int ntx_nvme_open(const char *bdf, const struct ntx_nvme_opts *opts, struct ntx_nvme **out,
                  char *err, size_t errlen)
{
    struct ntx_nvme *d = calloc(1, sizeof *d);
    if (!d) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    d->vfio.container = d->vfio.group = d->vfio.device = d->vfio.pagemap_fd = -1;
    if (opts)
        d->opts = *opts;
    else
        ntx_nvme_default_opts(&d->opts);
    int rc = check_opts(d, bdf);
    if (!rc) {
        snprintf(d->bdf, sizeof d->bdf, "%s", bdf);
        rc = nx_vfio_open(d, bdf, d->opts.iommu);
    }
    if (!rc)
        rc = read_capabilities(d);
    if (!rc) {
        d->want_nq = d->opts.nqueues;
        d->want_depth = d->opts.qdepth < d->info.mqes ? d->opts.qdepth : d->info.mqes;
        rc = arena_open(d);
    }
    if (!rc)
        rc = nx_ctrl_start(d, d->want_nq, d->want_depth);
    if (rc) {
        if (err && errlen)
            snprintf(err, errlen, "%s", d->err);
        if (d->vfio.bar0 && !d->gone)
            nx_ctrl_disable(d); /* stop any DMA before the memory goes away */
        release(d);
        return rc;
    }
    *out = d;
    return 0;
}

int ntx_nvme_close(struct ntx_nvme *d)
{
    if (!d)
        return 0;
    int rc = nx_ctrl_shutdown(d);
    release(d);
    return rc;
}

/* Disable (which ends every outstanding command and all DMA) and bring the queues back. */
int ntx_nvme_reset(struct ntx_nvme *d)
{
    int rc = nx_ctrl_disable(d);
    if (rc)
        return rc;
    nx_fence(d, -ECANCELED);
    for (uint32_t i = 0; i < NX_MAX_QUEUES; i++)
        nx_queue_free(&d->ioq[i]);
    nx_queue_free(&d->admin);
    d->nioq = 0;
    d->inflight = 0;
    d->fenced = 0;
    rc = nx_ctrl_start(d, d->want_nq, d->want_depth);
    if (rc)
        d->fenced = 1;
    return rc;
}

int ntx_nvme_get_info(struct ntx_nvme *d, struct ntx_nvme_info *info)
{
    *info = d->info;
    return 0;
}

int ntx_nvme_get_stats(struct ntx_nvme *d, struct ntx_nvme_stats *stats)
{
    *stats = d->stats;
    stats->fenced = d->fenced;
    return 0;
}

const char *ntx_nvme_last_error(struct ntx_nvme *d)
{
    return d->err;
}

int ntx_nvme_dma_map(struct ntx_nvme *d, void *va, size_t len)
{
    return nx_region_map(d, va, len, 0);
}

int ntx_nvme_dma_unmap(struct ntx_nvme *d, void *va)
{
    if (d->fenced)
        return nx_fail(d, EBUSY, "%s is fenced after a timeout: the controller may still write "
                       "into this buffer; reset() the device before releasing it", d->bdf);
    for (int i = 0; i < NX_MAX_REGIONS; i++) {
        const struct nx_region *g = &d->vfio.regions[i];
        if (!g->in_use || g->va != (uintptr_t)va)
            continue;
        if (g->internal)
            return nx_fail(d, EINVAL, "%p is the driver's own memory", va);
        uint32_t n = nx_inflight_into(d, g->va, g->len);
        if (n)
            return nx_fail(d, EBUSY, "%u read commands in flight write into this buffer: wait for "
                           "them before releasing it", n);
    }
    return nx_region_unmap(d, va);
}
