/*
 * nvme_io.c - Read commands (NVM-CS 1.0 §3.2.4), PRP lists (NVMe 2.0 §4.1.1), batches of
 * reads spread over the I/O queues with many commands in flight, polled completions with
 * phase tags (NVMe 2.0 §4.2.4) and deadlines.
 *
 * A batch is a caller-owned array of ntx_nvme_io. Each io is split into commands of at most
 * max_xfer_bytes (MDTS) and handed out round-robin to queues with a free command identifier;
 * completions may arrive in any order. When a command passes its deadline the device is
 * fenced: every pending io fails with -ETIMEDOUT, no new command is accepted, and no buffer
 * may be unmapped until ntx_nvme_reset() has disabled the controller - the late command could
 * still write into it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nvme_impl.h"

const char *nx_status_str(uint16_t code)
{
    switch (code) { /* SCT << 8 | SC, NVMe 2.0 §4.2.3.2 (generic), §4.2.3.3, §4.2.3.4 (media) */
    case 0x0000: return "Successful Completion";
    case 0x0001: return "Invalid Command Opcode";
    case 0x0002: return "Invalid Field in Command";
    case 0x0003: return "Command ID Conflict";
    case 0x0004: return "Data Transfer Error";
    case 0x0005: return "Commands Aborted due to Power Loss Notification";
    case 0x0006: return "Internal Error";
    case 0x0007: return "Command Abort Requested";
    case 0x0008: return "Command Aborted due to SQ Deletion";
    case 0x000b: return "Invalid Namespace or Format";
    case 0x000f: return "Invalid SGL/PRP Offset";
    case 0x0013: return "PRP Offset Invalid";
    case 0x0080: return "LBA Out of Range";
    case 0x0081: return "Capacity Exceeded";
    case 0x0082: return "Namespace Not Ready";
    case 0x0101: return "Invalid Queue Identifier";
    case 0x0102: return "Invalid Queue Size";
    case 0x0280: return "Write Fault";
    case 0x0281: return "Unrecovered Read Error";
    case 0x0282: return "End-to-end Guard Check Error";
    case 0x0286: return "Access Denied";
    case 0x0287: return "Deallocated or Unwritten Logical Block";
    default: return "unrecognised status";
    }
}

static struct nx_queue *pick_queue(struct ntx_nvme *d)
{
    for (uint32_t k = 0; k < d->nioq; k++) {
        struct nx_queue *q = &d->ioq[(d->rr + k) % d->nioq];
        if (q->nfree) {
            d->rr = (d->rr + k + 1) % d->nioq;
            return q;
        }
    }
    return NULL;
}

/* Fill PRP1/PRP2 (and the command's PRP list page) for len bytes at dst. */
static void build_prps(struct nx_queue *q, uint16_t cid, const struct nx_region *g,
                       uintptr_t dst, uint32_t len, struct nvme_sqe *c)
{
    uint32_t first = NVME_PAGE_SIZE - (uint32_t)(dst % NVME_PAGE_SIZE); /* bytes in page 1 */
    c->prp1 = nx_region_bus(g, dst);
    if (len <= first)
        return;
    uintptr_t page = dst + first;
    if (len - first <= NVME_PAGE_SIZE) {
        c->prp2 = nx_region_bus(g, page);
        return;
    }
    uint64_t *list = (uint64_t *)(q->prp_va + (size_t)cid * NVME_PAGE_SIZE);
    uint32_t n = 0;
    for (; page < dst + len; page += NVME_PAGE_SIZE)
        list[n++] = nx_region_bus(g, page);
    c->prp2 = q->prp_bus[cid];
}

/* Queue the next command of io number i of batch b on q (the doorbell is rung later). */
static void submit_one(struct ntx_nvme *d, struct nx_queue *q, struct ntx_nvme_batch *b, uint32_t i)
{
    struct ntx_nvme_io *io = &b->ios[i];
    uint32_t left = io->nlb - io->priv_submitted;
    uint32_t nlb = left < d->max_xfer_blocks ? left : d->max_xfer_blocks;
    uint64_t lba = io->lba + io->priv_submitted;
    uintptr_t dst = (uintptr_t)io->dst + (uintptr_t)io->priv_submitted * d->info.lba_bytes;
    uint32_t len = nlb * d->info.lba_bytes;
    const struct nx_region *g = nx_region_find(d, (void *)dst, len);
    uint16_t cid = q->free_cids[--q->nfree];
    struct nvme_sqe c = { .opc = NVME_CMD_READ, .cid = cid, .nsid = d->info.nsid,
                          .cdw10 = (uint32_t)lba, .cdw11 = (uint32_t)(lba >> 32), .cdw12 = nlb - 1 };
    build_prps(q, cid, g, dst, len, &c);
    q->sq[q->sq_tail] = c;
    q->sq_tail = (q->sq_tail + 1) % q->depth;
    q->pending_doorbell++;
    q->slots[cid] = (struct nx_slot){ .batch = b, .io = i, .busy = 1, .lba = lba, .nlb = nlb,
                                      .len = len, .dst = dst, .deadline_ns = nx_now_ns() + d->opts.cmd_timeout_us * 1000ull };
    io->priv_submitted += nlb;
    io->priv_outstanding++;
    b->outstanding++;
    q->inflight++;
    if (++d->inflight > d->stats.max_inflight)
        d->stats.max_inflight = d->inflight;
}

/* Hand out as many commands of the open batches as the queues have room for. */
static void pump(struct ntx_nvme *d)
{
    for (struct ntx_nvme_batch *b = d->batches; b && !d->fenced; b = b->next) {
        while (b->next_io < b->n) {
            struct ntx_nvme_io *io = &b->ios[b->next_io];
            if (io->result != 1 || io->priv_submitted == io->nlb) {
                b->next_io++;
                continue;
            }
            struct nx_queue *q = pick_queue(d);
            if (!q)
                goto ring;
            submit_one(d, q, b, b->next_io);
        }
    }
ring:
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* entries are in memory before any doorbell */
    for (uint32_t k = 0; k < d->nioq; k++) {
        struct nx_queue *q = &d->ioq[k];
        if (q->pending_doorbell) {
            *q->sq_tdbl = q->sq_tail;
            q->pending_doorbell = 0;
        }
    }
}

static void complete(struct ntx_nvme *d, struct nx_slot *s, uint16_t code)
{
    struct ntx_nvme_batch *b = s->batch;
    if (!b) /* abandoned by a fence */
        return;
    struct ntx_nvme_io *io = &b->ios[s->io];
    io->priv_outstanding--;
    b->outstanding--;
    if (code && io->result == 1) {
        io->result = -EIO;
        io->nvme_status = code;
        io->fail_lba = s->lba;
        io->fail_nlb = s->nlb;
        b->failed++;
        b->unfinished--;
        nx_fail(d, EIO, "%s: read of LBA %llu..%llu (namespace %u) failed: %s (SCT %u SC 0x%02x)",
                d->bdf, (unsigned long long)s->lba, (unsigned long long)(s->lba + s->nlb - 1),
                d->info.nsid, nx_status_str(code), code >> 8, code & 0xff);
    } else if (!code) {
        d->stats.commands++;
        d->stats.blocks += s->nlb;
    }
    if (io->result == 1 && io->priv_outstanding == 0 && io->priv_submitted == io->nlb) {
        io->result = 0;
        b->unfinished--;
    }
}

/* Command s passed its deadline: count it, say which read, fence the device (every pending
 * io fails with -ETIMEDOUT, s's own io included). Returns the error. */
static int time_out(struct ntx_nvme *d, const struct nx_slot *s)
{
    d->stats.timeouts++;
    int rc = nx_fail(d, ETIMEDOUT, "%s: read of LBA %llu..%llu timed out after %u us; the "
                     "device is fenced (its buffers stay reserved) until reset()", d->bdf,
                     (unsigned long long)s->lba, (unsigned long long)(s->lba + s->nlb - 1),
                     d->opts.cmd_timeout_us);
    nx_fence(d, -ETIMEDOUT);
    return rc;
}

/* Consume new completion entries of every I/O queue; returns how many. */
static uint32_t reap(struct ntx_nvme *d)
{
    uint32_t total = 0;
    uint64_t now = 0;
    for (uint32_t k = 0; k < d->nioq; k++) {
        struct nx_queue *q = &d->ioq[k];
        uint32_t n = 0;
        for (;;) {
            volatile struct nvme_cqe *e = &q->cq[q->cq_head];
            uint16_t st = e->status;
            if (NVME_CQE_PHASE(st) != q->phase)
                break;
            __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the rest of the entry after its phase */
            uint16_t cid = e->cid;
            if (++q->cq_head == q->depth) {
                q->cq_head = 0;
                q->phase ^= 1;
            }
            n++;
            if (cid >= q->depth || !q->slots[cid].busy)
                continue; /* not ours (stale after a reset): ignore */
            if (!now)
                now = nx_now_ns();
            if (q->slots[cid].batch && now > q->slots[cid].deadline_ns)
                time_out(d, &q->slots[cid]); /* seen late: a timeout, however the poller ran */
            complete(d, &q->slots[cid], (uint16_t)(NVME_CQE_SCT(st) << 8 | NVME_CQE_SC(st)));
            q->slots[cid] = (struct nx_slot){ 0 };
            q->free_cids[q->nfree++] = cid;
            q->inflight--;
            d->inflight--;
        }
        if (n)
            *q->cq_hdbl = q->cq_head;
        total += n;
    }
    return total;
}

void nx_fence(struct ntx_nvme *d, int result)
{
    d->fenced = 1;
    for (struct ntx_nvme_batch *b = d->batches; b; b = b->next) {
        for (uint32_t i = 0; i < b->n; i++) {
            if (b->ios[i].result == 1) {
                b->ios[i].result = result;
                b->failed++;
                b->unfinished--;
            }
        }
        b->outstanding = 0;
        b->next_io = b->n;
    }
    for (uint32_t k = 0; k < d->nioq; k++) /* keep the slots busy: their CIDs stay unusable */
        for (uint32_t c = 0; c < d->ioq[k].depth; c++)
            d->ioq[k].slots[c].batch = NULL;
}

/* Every ~millisecond: device health and command deadlines. */
static int check_deadlines(struct ntx_nvme *d, uint64_t now)
{
    int rc = nx_ctrl_check(d);
    if (rc) {
        nx_fence(d, rc);
        return rc;
    }
    for (uint32_t k = 0; k < d->nioq; k++) {
        const struct nx_queue *q = &d->ioq[k];
        for (uint32_t c = 0; c < q->depth; c++) {
            const struct nx_slot *s = &q->slots[c];
            if (!s->busy || !s->batch || now < s->deadline_ns)
                continue;
            return time_out(d, s);
        }
    }
    return 0;
}

static int validate_io(struct ntx_nvme *d, struct ntx_nvme_io *io, uint32_t i)
{
    uint64_t end = io->lba + io->nlb;
    if (io->nlb == 0)
        return nx_fail(d, EINVAL, "io %u: zero blocks", i);
    if (d->opts.range_check && (end < io->lba || end > d->info.nsze))
        return nx_fail(d, ERANGE, "io %u: LBA %llu..%llu is outside namespace %u of %s (%llu blocks)",
                       i, (unsigned long long)io->lba, (unsigned long long)(end - 1), d->info.nsid,
                       d->bdf, (unsigned long long)d->info.nsze);
    if ((uintptr_t)io->dst % 4)
        return nx_fail(d, EINVAL, "io %u: destination %p is not 4-byte aligned (PRP rule)", i, io->dst);
    if (!nx_region_find(d, io->dst, (size_t)io->nlb * d->info.lba_bytes))
        return nx_fail(d, EFAULT, "io %u: destination %p + %llu bytes is not inside a mapped DMA "
                       "buffer (map it first)", i, io->dst,
                       (unsigned long long)io->nlb * d->info.lba_bytes);
    io->result = 1;
    io->nvme_status = 0;
    io->priv_outstanding = io->priv_submitted = 0;
    io->fail_lba = 0;
    io->fail_nlb = 0;
    return 0;
}

int ntx_nvme_batch_open(struct ntx_nvme *d, struct ntx_nvme_io *ios, uint32_t n,
                        struct ntx_nvme_batch **out)
{
    if (d->fenced)
        return nx_fail(d, EIO, "%s is fenced after a timeout or fatal status: reset() it first", d->bdf);
    for (uint32_t i = 0; i < n; i++) {
        int rc = validate_io(d, &ios[i], i);
        if (rc)
            return rc;
    }
    struct ntx_nvme_batch *b = calloc(1, sizeof *b);
    if (!b)
        return nx_fail(d, ENOMEM, "out of memory for a batch");
    *b = (struct ntx_nvme_batch){ .ios = ios, .n = n, .unfinished = n };
    struct ntx_nvme_batch **tail = &d->batches;
    while (*tail)
        tail = &(*tail)->next;
    *tail = b;
    pump(d); /* start now: the caller may do other work before waiting */
    *out = b;
    return 0;
}

/* How often the wait loop looks at deadlines of commands still in flight: every millisecond,
 * or twice per deadline when commands get less than 2 ms. A completion seen after its
 * command's deadline is a timeout as well (reap), so a short deadline is caught even when
 * every command completes before the first look. */
static uint64_t check_interval_ns(const struct ntx_nvme *d)
{
    uint64_t half = (uint64_t)d->opts.cmd_timeout_us * 500ull;
    return half < 1000000ull ? half : 1000000ull;
}

int ntx_nvme_batch_wait(struct ntx_nvme *d, struct ntx_nvme_batch *b, int64_t timeout_us)
{
    uint64_t start = nx_now_ns(), last_check = start, interval = check_interval_ns(d);
    for (uint32_t spins = 1;; spins++) {
        if (b->outstanding == 0 && b->next_io >= b->n)
            return b->failed ? (d->fenced ? -ETIMEDOUT : -EIO) : 0;
        pump(d);
        int busy = reap(d) > 0;
        if (spins % 64 == 0) {
            uint64_t now = nx_now_ns();
            if (now - last_check > interval) {
                last_check = now;
                int rc = check_deadlines(d, now);
                if (rc)
                    return rc;
            }
            if (timeout_us >= 0 && now - start > (uint64_t)timeout_us * 1000ull)
                return -EAGAIN;
        }
        if (!busy && spins % 16 == 0)
            sched_yield(); /* polled completions: spin, but let other threads run */
    }
}

int ntx_nvme_batch_close(struct ntx_nvme *d, struct ntx_nvme_batch *b)
{
    if (b->outstanding)
        return nx_fail(d, EBUSY, "batch still has %u commands in flight: wait for it first",
                       b->outstanding);
    for (struct ntx_nvme_batch **p = &d->batches; *p; p = &(*p)->next) {
        if (*p == b) {
            *p = b->next;
            free(b);
            return 0;
        }
    }
    return nx_fail(d, ENOENT, "unknown batch");
}

/* Commands in flight that write into [va, va + len). */
uint32_t nx_inflight_into(struct ntx_nvme *d, uintptr_t va, size_t len)
{
    uint32_t n = 0;
    for (uint32_t k = 0; k < d->nioq; k++)
        for (uint32_t c = 0; c < d->ioq[k].depth; c++) {
            const struct nx_slot *s = &d->ioq[k].slots[c];
            n += s->busy && s->dst < va + len && va < s->dst + s->len;
        }
    return n;
}

void nx_batches_free(struct ntx_nvme *d)
{
    while (d->batches) {
        struct ntx_nvme_batch *b = d->batches;
        d->batches = b->next;
        free(b);
    }
}

int ntx_nvme_read(struct ntx_nvme *d, uint64_t lba, uint32_t nlb, void *dst)
{
    struct ntx_nvme_io io = { .lba = lba, .nlb = nlb, .dst = dst };
    struct ntx_nvme_batch *b;
    int rc = ntx_nvme_batch_open(d, &io, 1, &b);
    if (rc)
        return rc;
    rc = ntx_nvme_batch_wait(d, b, -1);
    ntx_nvme_batch_close(d, b);
    return rc;
}
