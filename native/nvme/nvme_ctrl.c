/*
 * nvme_ctrl.c - controller bring-up and teardown, NVMe 2.0 §3.5.1 (initialization) and
 * §3.6 (shutdown): disable, admin queues, CC, enable, Identify, Number of Queues,
 * I/O queue pairs; then the public open/close/reset entry points.
 *
 * All of the driver's own DMA memory (queues, PRP list pages, the identify page) comes from
 * one arena mapped once. Its layout is computed by the same code that carves it, so a
 * reset re-creates exactly the same queues at the same bus addresses.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "nvme_impl.h"

static void sleep_us(long us)
{
    struct timespec t = { .tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000 };
    nanosleep(&t, NULL);
}

int nx_ctrl_check(struct ntx_nvme *d)
{
    uint32_t csts = nx_rd32(d, NVME_REG_CSTS);
    if (d->gone)
        return nx_fail(d, ENODEV, "%s reads all ones: the device is gone (removed, or its link is down)",
                       d->bdf);
    if (csts & NVME_CSTS_CFS)
        return nx_fail(d, EIO, "%s reports Controller Fatal Status (CSTS.CFS): reset it", d->bdf);
    return 0;
}

/* Poll CSTS until (CSTS & mask) == want, for at most timeout_ms. */
static int wait_csts(struct ntx_nvme *d, uint32_t mask, uint32_t want, uint32_t timeout_ms,
                     const char *what, int ignore_cfs)
{
    uint64_t deadline = nx_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        uint32_t csts = nx_rd32(d, NVME_REG_CSTS);
        if (d->gone)
            return nx_ctrl_check(d);
        if ((csts & mask) == want)
            return 0;
        if (!ignore_cfs && (csts & NVME_CSTS_CFS))
            return nx_ctrl_check(d);
        if (nx_now_ns() > deadline)
            return nx_fail(d, ETIMEDOUT, "%s: timed out after %u ms waiting for %s (CSTS=0x%x)",
                           d->bdf, timeout_ms, what, csts);
        sleep_us(100);
    }
}

int nx_ctrl_disable(struct ntx_nvme *d)
{
    uint32_t cc = nx_rd32(d, NVME_REG_CC);
    uint32_t csts = nx_rd32(d, NVME_REG_CSTS);
    if (d->gone)
        return nx_ctrl_check(d);
    if ((cc & NVME_CC_EN) && !(csts & NVME_CSTS_RDY)) /* mid-enable: let it finish first */
        wait_csts(d, NVME_CSTS_RDY, NVME_CSTS_RDY, d->info.to_ms, "CSTS.RDY=1", 1);
    nx_wr32(d, NVME_REG_CC, cc & ~NVME_CC_EN);
    return wait_csts(d, NVME_CSTS_RDY, 0, d->info.to_ms, "CSTS.RDY=0 (disable)", 1);
}

/* Take size bytes of the arena, 4 KiB aligned, never straddling a 2 MiB boundary (in
 * no-IOMMU mode only a hugepage is physically contiguous). With a NULL arena it only counts. */
static uint8_t *carve(struct ntx_nvme *d, size_t size, uint64_t *bus)
{
    size_t off = (d->arena_used + NVME_PAGE_SIZE - 1) & ~(size_t)(NVME_PAGE_SIZE - 1);
    if (size <= NX_HUGE_SIZE && off / NX_HUGE_SIZE != (off + size - 1) / NX_HUGE_SIZE)
        off = (off + NX_HUGE_SIZE - 1) & ~(size_t)(NX_HUGE_SIZE - 1);
    d->arena_used = off + size;
    if (!d->arena)
        return NULL;
    const struct nx_region *g = nx_region_find(d, d->arena + off, size);
    *bus = nx_region_bus(g, (uintptr_t)(d->arena + off));
    memset(d->arena + off, 0, size);
    return d->arena + off;
}

int nx_queue_init(struct ntx_nvme *d, struct nx_queue *q, uint16_t qid, uint32_t depth)
{
    uint64_t prp0 = 0;
    *q = (struct nx_queue){ .qid = qid, .depth = depth, .phase = 1 };
    q->sq = (struct nvme_sqe *)carve(d, (size_t)depth << NVME_SQES_LOG2, &q->sq_bus);
    q->cq = (struct nvme_cqe *)carve(d, (size_t)depth << NVME_CQES_LOG2, &q->cq_bus);
    if (qid) /* one PRP list page per command identifier */
        q->prp_va = carve(d, (size_t)depth * NVME_PAGE_SIZE, &prp0);
    if (!d->arena)
        return 0;
    q->sq_tdbl = (volatile uint32_t *)(d->vfio.bar0 + NVME_REG_DBS + (2u * qid) * d->dstrd);
    q->cq_hdbl = (volatile uint32_t *)(d->vfio.bar0 + NVME_REG_DBS + (2u * qid + 1) * d->dstrd);
    q->slots = calloc(depth, sizeof *q->slots);
    q->free_cids = calloc(depth, sizeof *q->free_cids);
    q->prp_bus = qid ? calloc(depth, sizeof *q->prp_bus) : NULL;
    if (!q->slots || !q->free_cids || (qid && !q->prp_bus))
        return nx_fail(d, ENOMEM, "out of memory for queue %u", qid);
    /* an SQ of depth entries holds at most depth - 1 commands: one entry always stays empty */
    for (uint32_t i = 0; i + 1 < depth; i++)
        q->free_cids[q->nfree++] = (uint16_t)(depth - 2 - i);
    const struct nx_region *g = nx_region_find(d, d->arena, d->arena_len);
    for (uint32_t i = 0; qid && i < depth; i++) /* pages apart: physical ones need not be contiguous */
        q->prp_bus[i] = nx_region_bus(g, (uintptr_t)(q->prp_va + (size_t)i * NVME_PAGE_SIZE));
    return 0;
}

void nx_queue_free(struct nx_queue *q)
{
    free(q->slots);
    free(q->free_cids);
    free(q->prp_bus);
    q->slots = NULL;
    q->free_cids = NULL;
    q->prp_bus = NULL;
}

/* Run one admin command synchronously (the admin queue is used by one command at a time). */
static int admin(struct ntx_nvme *d, struct nvme_sqe *c, uint32_t *dw0, const char *what)
{
    struct nx_queue *q = &d->admin;
    c->cid = d->admin_cid++;
    q->sq[q->sq_tail] = *c;
    q->sq_tail = (q->sq_tail + 1) % q->depth;
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the entry is in memory before the doorbell */
    *q->sq_tdbl = q->sq_tail;
    uint64_t deadline = nx_now_ns() + (uint64_t)d->opts.admin_timeout_ms * 1000000ull;
    for (uint32_t spins = 1;; spins++) {
        volatile struct nvme_cqe *e = &q->cq[q->cq_head];
        uint16_t st = e->status;
        if (NVME_CQE_PHASE(st) == q->phase) {
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            uint16_t cid = e->cid;
            uint32_t r = e->dw0;
            if (++q->cq_head == q->depth) {
                q->cq_head = 0;
                q->phase ^= 1;
            }
            *q->cq_hdbl = q->cq_head;
            if (cid != c->cid)
                continue; /* a late completion of an earlier, abandoned command */
            uint16_t code = (uint16_t)(NVME_CQE_SCT(st) << 8 | NVME_CQE_SC(st));
            if (code)
                return nx_fail(d, EIO, "%s: %s failed: %s (SCT %u SC 0x%02x)", d->bdf, what,
                               nx_status_str(code), NVME_CQE_SCT(st), NVME_CQE_SC(st));
            if (dw0)
                *dw0 = r;
            return 0;
        }
        if (spins % 256 == 0) {
            int rc = nx_ctrl_check(d);
            if (!rc && nx_now_ns() > deadline)
                rc = nx_fail(d, ETIMEDOUT, "%s: %s timed out after %u ms", d->bdf, what,
                             d->opts.admin_timeout_ms);
            if (rc) {
                d->fenced = 1; /* the admin queue state is unknown until a reset */
                return rc;
            }
            sched_yield();
        }
    }
}

static int identify(struct ntx_nvme *d, uint8_t cns, uint32_t nsid, const char *what)
{
    struct nvme_sqe c = { .opc = NVME_ADMIN_IDENTIFY, .nsid = nsid, .prp1 = d->idbuf_bus, .cdw10 = cns };
    memset(d->idbuf, 0, NVME_PAGE_SIZE);
    return admin(d, &c, NULL, what);
}

static void id_string(char *dst, const uint8_t *src, size_t n)
{
    memcpy(dst, src, n);
    dst[n] = 0;
}

static int identify_controller(struct ntx_nvme *d)
{
    int rc = identify(d, NVME_CNS_CTRL, 0, "Identify Controller");
    if (rc)
        return rc;
    const uint8_t *b = d->idbuf;
    struct ntx_nvme_info *i = &d->info;
    memcpy(&i->vid, b + NVME_IDCTL_VID, 2);
    memcpy(&i->ssvid, b + NVME_IDCTL_SSVID, 2);
    id_string(i->sn, b + NVME_IDCTL_SN, 20);
    id_string(i->mn, b + NVME_IDCTL_MN, 40);
    id_string(i->fr, b + NVME_IDCTL_FR, 8);
    memcpy(&d->rtd3e_us, b + NVME_IDCTL_RTD3E, 4);
    memcpy(&i->nn, b + NVME_IDCTL_NN, 4);
    uint8_t mdts = b[NVME_IDCTL_MDTS];
    i->mdts_bytes = mdts ? (mdts + __builtin_ctz(i->mpsmin_bytes) >= 32 ? 0 : i->mpsmin_bytes << mdts) : 0;
    i->max_xfer_bytes = NX_MAX_XFER;
    if (i->mdts_bytes && i->mdts_bytes < i->max_xfer_bytes)
        i->max_xfer_bytes = i->mdts_bytes;
    return 0;
}

static int identify_namespace(struct ntx_nvme *d)
{
    struct ntx_nvme_info *i = &d->info;
    uint32_t nsid = d->opts.nsid;
    if (!nsid) { /* the first active namespace; controllers without the list answer NSID 1 */
        nsid = 1;
        if (!identify(d, NVME_CNS_ACTIVE_NSID, 0, "Identify Active Namespace ID list"))
            memcpy(&nsid, d->idbuf, 4);
        if (!nsid)
            return nx_fail(d, ENODEV, "%s has no active namespace", d->bdf);
    }
    int rc = identify(d, NVME_CNS_NS, nsid, "Identify Namespace");
    if (rc)
        return rc;
    const uint8_t *b = d->idbuf;
    memcpy(&i->nsze, b + NVME_IDNS_NSZE, 8);
    memcpy(&i->ncap, b + NVME_IDNS_NCAP, 8);
    uint8_t flbas = b[NVME_IDNS_FLBAS];
    uint32_t fmt = (flbas & 0xfu) | ((uint32_t)(flbas >> 5) & 0x3u) << 4;
    uint32_t lbaf;
    memcpy(&lbaf, b + NVME_IDNS_LBAF0 + 4 * fmt, 4);
    uint32_t lbads = (lbaf >> 16) & 0xff, ms = lbaf & 0xffff;
    if (i->nsze == 0)
        return nx_fail(d, ENODEV, "%s: namespace %u is inactive (size 0)", d->bdf, nsid);
    if (lbads < 9 || lbads > 16 || (ms && (flbas & 0x10)))
        return nx_fail(d, ENOTSUP, "%s: namespace %u uses an unsupported LBA format "
                       "(LBADS %u, %u metadata bytes)", d->bdf, nsid, lbads, ms);
    i->nsid = nsid;
    i->lba_bytes = 1u << lbads;
    d->max_xfer_blocks = i->max_xfer_bytes / i->lba_bytes;
    return 0;
}

static int create_io_queues(struct ntx_nvme *d, uint32_t nq, uint32_t depth)
{
    uint32_t granted = 0;
    struct nvme_sqe f = { .opc = NVME_ADMIN_SET_FEATURES, .cdw10 = NVME_FEAT_NUM_QUEUES,
                          .cdw11 = (nq - 1) | (nq - 1) << 16 };
    int rc = admin(d, &f, &granted, "Set Features (Number of Queues)");
    if (rc)
        return rc;
    uint32_t nsqa = (granted & 0xffff) + 1, ncqa = (granted >> 16) + 1;
    nq = nq < nsqa ? nq : nsqa;
    nq = nq < ncqa ? nq : ncqa;
    for (uint32_t i = 1; i <= nq; i++) {
        struct nx_queue *q = &d->ioq[i - 1];
        if ((rc = nx_queue_init(d, q, (uint16_t)i, depth)))
            return rc;
        d->nioq = i;
        struct nvme_sqe cq = { .opc = NVME_ADMIN_CREATE_CQ, .prp1 = q->cq_bus,
                               .cdw10 = i | (depth - 1) << 16, .cdw11 = 1 /* PC, no IEN */ };
        struct nvme_sqe sq = { .opc = NVME_ADMIN_CREATE_SQ, .prp1 = q->sq_bus,
                               .cdw10 = i | (depth - 1) << 16, .cdw11 = 1 | i << 16 /* PC, CQID */ };
        if ((rc = admin(d, &cq, NULL, "Create I/O Completion Queue")) ||
            (rc = admin(d, &sq, NULL, "Create I/O Submission Queue")))
            return rc;
    }
    d->info.nqueues = nq;
    d->info.qdepth = depth;
    return 0;
}

/* Byte size of the arena for nq queue pairs of depth entries (a dry run of carve()). */
size_t nx_arena_size(struct ntx_nvme *d, uint32_t nq, uint32_t depth)
{
    struct nx_queue tmp;
    uint64_t bus;
    uint8_t *saved = d->arena;
    d->arena = NULL;
    d->arena_used = 0;
    carve(d, NVME_PAGE_SIZE, &bus);
    nx_queue_init(d, &tmp, 0, NX_ADMIN_DEPTH);
    for (uint32_t i = 1; i <= nq; i++)
        nx_queue_init(d, &tmp, (uint16_t)i, depth);
    d->arena = saved;
    return (d->arena_used + NX_HUGE_SIZE - 1) & ~(size_t)(NX_HUGE_SIZE - 1);
}

/* Reset the controller and bring it up with admin and I/O queues (NVMe 2.0 §3.5.1). */
int nx_ctrl_start(struct ntx_nvme *d, uint32_t nq, uint32_t depth)
{
    int rc = nx_ctrl_disable(d);
    if (rc)
        return rc;
    d->arena_used = 0;
    d->idbuf = carve(d, NVME_PAGE_SIZE, &d->idbuf_bus);
    if ((rc = nx_queue_init(d, &d->admin, 0, NX_ADMIN_DEPTH)))
        return rc;
    nx_wr32(d, NVME_REG_AQA, NVME_AQA(NX_ADMIN_DEPTH, NX_ADMIN_DEPTH));
    nx_wr64(d, NVME_REG_ASQ, d->admin.sq_bus);
    nx_wr64(d, NVME_REG_ACQ, d->admin.cq_bus);
    uint32_t cc = NVME_CC_CSS_NVM | NVME_CC_MPS(NVME_PAGE_SHIFT) | NVME_CC_AMS_RR |
                  NVME_CC_IOSQES(NVME_SQES_LOG2) | NVME_CC_IOCQES(NVME_CQES_LOG2);
    nx_wr32(d, NVME_REG_CC, cc); /* configuration first, then EN in its own write */
    nx_wr32(d, NVME_REG_CC, cc | NVME_CC_EN);
    if ((rc = wait_csts(d, NVME_CSTS_RDY, NVME_CSTS_RDY, d->info.to_ms, "CSTS.RDY=1 (enable)", 0)))
        return rc;
    d->admin_cid = 0;
    if ((rc = identify_controller(d)) || (rc = identify_namespace(d)))
        return rc;
    return create_io_queues(d, nq, depth);
}

/* Orderly shutdown, NVMe 2.0 §3.6: delete the I/O queues, CC.SHN, wait CSTS.SHST, disable. */
int nx_ctrl_shutdown(struct ntx_nvme *d)
{
    if (d->gone || !d->vfio.bar0)
        return d->gone ? -ENODEV : 0;
    int rc = 0;
    for (uint32_t i = d->nioq; i >= 1 && !d->fenced; i--) {
        struct nvme_sqe sq = { .opc = NVME_ADMIN_DELETE_SQ, .cdw10 = i };
        struct nvme_sqe cq = { .opc = NVME_ADMIN_DELETE_CQ, .cdw10 = i };
        if (!rc)
            rc = admin(d, &sq, NULL, "Delete I/O Submission Queue");
        if (!rc)
            rc = admin(d, &cq, NULL, "Delete I/O Completion Queue");
    }
    uint32_t cc = nx_rd32(d, NVME_REG_CC);
    if (d->gone || !(cc & NVME_CC_EN))
        return d->gone ? -ENODEV : rc;
    uint32_t ms = d->rtd3e_us / 1000 > d->info.to_ms ? d->rtd3e_us / 1000 : d->info.to_ms;
    nx_wr32(d, NVME_REG_CC, (cc & ~NVME_CC_SHN_MASK) | NVME_CC_SHN_NORMAL);
    int wrc = wait_csts(d, NVME_CSTS_SHST_MASK, NVME_CSTS_SHST_COMPLETE, ms, "CSTS.SHST=complete", 1);
    int drc = nx_ctrl_disable(d); /* and leave it disabled: no DMA once our memory is gone */
    return rc ? rc : wrc ? wrc : drc;
}
