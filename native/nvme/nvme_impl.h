/*
 * nvme_impl.h - the driver's internal layers, shared between its files:
 *   nvme_dev.c   public lifecycle: open/close/reset, info, DMA map/unmap
 *   nvme_ctrl.c  controller bring-up, admin commands, identify, I/O queue pairs, shutdown
 *   nvme_io.c    Read commands, PRP lists, batches, polling, deadlines and fencing
 *   nvme_vfio.c  VFIO container/group/device, BAR0, PCI config, DMA regions, IOVA allocator
 * Functions named nx_* are internal (hidden from the shared object); the public API is ntx_nvme_*.
 */
#ifndef NTX_NVME_IMPL_H
#define NTX_NVME_IMPL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "nvme.h"
#include "nvme_spec.h"

#define NX_INTERNAL __attribute__((visibility("hidden")))

#define NX_MAX_REGIONS   64
#define NX_MAX_IOVA_RANGES 16
#define NX_MAX_QUEUES    64
#define NX_ADMIN_DEPTH   32
#define NX_HUGE_SIZE     (2u << 20)
#define NX_MAX_XFER      (NVME_PRPS_PER_PAGE * NVME_PAGE_SIZE) /* one PRP list page: 2 MiB */
#define NX_IOVA_BASE     (1ull << 20) /* keep IOVA 0 unused so a zeroed PRP is never valid */

/* One range of process memory the controller may write to. */
struct nx_region {
    uintptr_t va;        /* page aligned */
    size_t len;          /* page multiple */
    uint64_t iova;       /* type1: bus address of va (contiguous); noiommu: unused */
    uint64_t *phys;      /* noiommu: bus (physical) address of every 4 KiB page */
    int internal;        /* the driver's own queues and PRP lists */
    int in_use;
};

struct nx_iova_range { uint64_t start, end; }; /* inclusive end, as VFIO reports it */

struct nx_vfio {
    int container, group, device;
    int noiommu;
    volatile uint8_t *bar0;
    size_t bar0_len;
    uint64_t cfg_offset;     /* file offset of PCI config space in the device fd */
    struct nx_iova_range iova[NX_MAX_IOVA_RANGES];
    int niova;
    struct nx_region regions[NX_MAX_REGIONS];
    int pagemap_fd;          /* noiommu only */
};

struct nx_slot {                     /* one command identifier of an I/O queue */
    struct ntx_nvme_batch *batch;    /* NULL when free, or abandoned after a fence */
    uint32_t io;                     /* index into batch->ios */
    int busy;
    uint64_t lba;
    uint32_t nlb;
    uint32_t len;                    /* bytes the controller writes at dst */
    uintptr_t dst;
    uint64_t deadline_ns;
};

struct nx_queue {                    /* a submission/completion queue pair */
    uint16_t qid;
    uint32_t depth;                  /* entries */
    struct nvme_sqe *sq;             /* (depth) entries */
    struct nvme_cqe *cq;             /* (depth) entries */
    uint64_t sq_bus, cq_bus;
    volatile uint32_t *sq_tdbl;      /* submission queue tail doorbell */
    volatile uint32_t *cq_hdbl;      /* completion queue head doorbell */
    uint32_t sq_tail, cq_head;
    uint16_t phase;                  /* expected phase tag of the next new completion */
    uint32_t inflight;
    uint32_t pending_doorbell;       /* entries written since the last tail doorbell */
    struct nx_slot *slots;           /* (depth) */
    uint16_t *free_cids;             /* stack of free command identifiers */
    uint32_t nfree;
    uint8_t *prp_va;                 /* (depth) PRP list pages, one per command identifier */
    uint64_t *prp_bus;               /* (depth) their bus addresses */
};

struct ntx_nvme_batch {
    struct ntx_nvme_batch *next;     /* the device's list of open batches */
    struct ntx_nvme_io *ios;         /* (n), owned by the caller until batch_close */
    uint32_t n;
    uint32_t next_io;                /* first io with blocks left to submit */
    uint32_t outstanding;            /* commands in flight */
    uint32_t failed;
    uint32_t unfinished;             /* ios whose result is still 1 */
};

struct ntx_nvme {
    struct nx_vfio vfio;
    char bdf[32];
    struct ntx_nvme_opts opts;
    struct ntx_nvme_info info;
    uint64_t cap;
    uint32_t dstrd;                  /* doorbell stride in bytes */
    uint32_t rtd3e_us;
    uint8_t *arena;                  /* the driver's DMA memory: queues, PRP lists, identify page */
    size_t arena_len;
    int arena_huge;
    size_t arena_used;
    uint8_t *idbuf;                  /* 4 KiB identify data page */
    uint64_t idbuf_bus;
    struct nx_queue admin;
    struct nx_queue ioq[NX_MAX_QUEUES];
    uint32_t nioq;
    uint32_t want_nq, want_depth;    /* what open asked for (after clamping), reused by reset */
    uint32_t rr;                     /* round-robin cursor over I/O queues */
    uint16_t admin_cid;
    struct ntx_nvme_batch *batches;
    int fenced;
    int gone;                        /* all-ones reads: the device left the bus */
    uint32_t max_xfer_blocks;
    uint32_t inflight;
    struct ntx_nvme_stats stats;
    char err[256];
};

/* errors: record a message on the device and return -errnum */
NX_INTERNAL int nx_fail(struct ntx_nvme *d, int errnum, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
NX_INTERNAL uint64_t nx_now_ns(void);

/* nvme_vfio.c */
NX_INTERNAL int nx_vfio_open(struct ntx_nvme *d, const char *bdf, int want_iommu);
NX_INTERNAL void nx_vfio_close(struct nx_vfio *v);
NX_INTERNAL int nx_region_map(struct ntx_nvme *d, void *va, size_t len, int internal);
NX_INTERNAL int nx_region_unmap(struct ntx_nvme *d, void *va);
NX_INTERNAL const struct nx_region *nx_region_find(struct ntx_nvme *d, const void *va, size_t len);
NX_INTERNAL uint32_t nx_rd32(struct ntx_nvme *d, uint32_t off);
NX_INTERNAL uint64_t nx_rd64(struct ntx_nvme *d, uint32_t off);
NX_INTERNAL void nx_wr32(struct ntx_nvme *d, uint32_t off, uint32_t val);
NX_INTERNAL void nx_wr64(struct ntx_nvme *d, uint32_t off, uint64_t val);

/* Bus address of a in region g (a must lie inside g). */
static inline uint64_t nx_region_bus(const struct nx_region *g, uintptr_t a)
{
    uintptr_t off = a - g->va;
    return g->phys ? g->phys[off / NVME_PAGE_SIZE] + (off % NVME_PAGE_SIZE) : g->iova + off;
}

/* nvme_ctrl.c */
NX_INTERNAL int nx_ctrl_check(struct ntx_nvme *d);
NX_INTERNAL int nx_ctrl_start(struct ntx_nvme *d, uint32_t nq, uint32_t depth);
NX_INTERNAL size_t nx_arena_size(struct ntx_nvme *d, uint32_t nq, uint32_t depth);
NX_INTERNAL int nx_ctrl_disable(struct ntx_nvme *d);
NX_INTERNAL int nx_ctrl_shutdown(struct ntx_nvme *d);
NX_INTERNAL int nx_queue_init(struct ntx_nvme *d, struct nx_queue *q, uint16_t qid, uint32_t depth);
NX_INTERNAL void nx_queue_free(struct nx_queue *q);

/* nvme_io.c */
NX_INTERNAL void nx_batches_free(struct ntx_nvme *d);
NX_INTERNAL uint32_t nx_inflight_into(struct ntx_nvme *d, uintptr_t va, size_t len);
NX_INTERNAL void nx_fence(struct ntx_nvme *d, int result);
NX_INTERNAL const char *nx_status_str(uint16_t sct_sc);

#endif /* NTX_NVME_IMPL_H */
