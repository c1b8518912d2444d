/*
 * nvme.h - public API of ntx's userspace, read-only NVMe driver over VFIO.
 *
 * Every function returns 0 or a negative errno; none aborts or exits. Resources come in
 * pairs: ntx_nvme_open/close, ntx_nvme_dma_map/unmap, ntx_nvme_batch_open/close.
 * A device handle is not thread-safe: one thread drives it at a time (the Python wrapper
 * holds a lock). Every wait has a deadline.
 *
 * The block between the cdef markers is fed verbatim to cffi's cdef(), so it holds
 * plain declarations only (no macros, no includes).
 */
#ifndef NTX_NVME_H
#define NTX_NVME_H

#include <stddef.h>
#include <stdint.h>

/* cdef-begin */
struct ntx_nvme;
struct ntx_nvme_batch;

struct ntx_nvme_opts {
    int iommu;               /* 1: VFIO type1 container (default); 0: no-IOMMU group (unsafe DMA) */
    uint32_t nqueues;        /* I/O queue pairs wanted; clamped to what the controller grants */
    uint32_t qdepth;         /* entries per I/O queue; clamped to CAP.MQES + 1 */
    uint32_t nsid;           /* namespace to read; 0 = the first active one */
    uint32_t cmd_timeout_us; /* deadline of one I/O command; past it the device is fenced */
    uint32_t admin_timeout_ms; /* deadline of one admin command */
    int range_check;         /* 1 (default): refuse LBA ranges outside the namespace before
                                submitting; 0 lets the controller judge them (tests only) */
};

struct ntx_nvme_info {
    uint16_t vid;            /* PCI vendor id (Identify Controller VID) */
    uint16_t ssvid;
    char sn[21];             /* serial number, NUL-terminated, trailing spaces kept */
    char mn[41];             /* model number */
    char fr[9];              /* firmware revision */
    uint32_t vs;             /* VS register: major << 16 | minor << 8 | tertiary */
    uint64_t cap;            /* CAP register */
    uint32_t mqes;           /* max entries per queue (1-based) */
    uint32_t dstrd_bytes;    /* doorbell stride */
    uint32_t to_ms;          /* CAP.TO in milliseconds */
    uint32_t mpsmin_bytes;
    uint32_t mdts_bytes;     /* max data transfer size, 0 = no limit reported */
    uint32_t max_xfer_bytes; /* what one Read command of this driver moves at most */
    uint32_t nn;             /* number of namespaces */
    uint32_t nsid;           /* namespace in use */
    uint64_t nsze;           /* namespace size in logical blocks */
    uint64_t ncap;
    uint32_t lba_bytes;      /* logical block size */
    uint32_t nqueues;        /* I/O queue pairs created */
    uint32_t qdepth;         /* entries per I/O queue */
    int noiommu;             /* 1 when DMA addresses are physical (no-IOMMU group) */
};

/* One read of nlb logical blocks at lba into dst (inside a region given to dma_map).
 * The driver splits it into commands of at most max_xfer_bytes. */
struct ntx_nvme_io {
    uint64_t lba;
    uint32_t nlb;
    int32_t result;          /* out: 1 pending, 0 done, -errno failed (-EIO: NVMe status) */
    void *dst;
    uint16_t nvme_status;    /* out: SCT << 8 | SC of the first failed command, 0 if none */
    uint16_t priv_pad;
    uint32_t priv_outstanding; /* driver-private: commands in flight */
    uint64_t fail_lba;       /* out: first LBA of the failed command */
    uint32_t fail_nlb;       /* out: its block count */
    uint32_t priv_submitted; /* driver-private: blocks handed to the controller */
};

struct ntx_nvme_stats {
    uint64_t commands;       /* I/O commands completed */
    uint64_t blocks;         /* logical blocks read */
    uint64_t timeouts;
    uint32_t max_inflight;   /* most I/O commands in flight at once */
    uint32_t regions;        /* DMA regions mapped now (including the driver's own) */
    uint64_t mapped_bytes;   /* bytes mapped now */
    int fenced;              /* 1 after a timeout or fatal status until ntx_nvme_reset */
};

void ntx_nvme_default_opts(struct ntx_nvme_opts *opts);
int ntx_nvme_open(const char *bdf, const struct ntx_nvme_opts *opts, struct ntx_nvme **out,
                  char *err, size_t errlen);
int ntx_nvme_close(struct ntx_nvme *dev);
int ntx_nvme_get_info(struct ntx_nvme *dev, struct ntx_nvme_info *info);
int ntx_nvme_get_stats(struct ntx_nvme *dev, struct ntx_nvme_stats *stats);
const char *ntx_nvme_last_error(struct ntx_nvme *dev);
int ntx_nvme_reset(struct ntx_nvme *dev);

int ntx_nvme_dma_map(struct ntx_nvme *dev, void *va, size_t len);
int ntx_nvme_dma_unmap(struct ntx_nvme *dev, void *va);

int ntx_nvme_batch_open(struct ntx_nvme *dev, struct ntx_nvme_io *ios, uint32_t n,
                        struct ntx_nvme_batch **out);
int ntx_nvme_batch_wait(struct ntx_nvme *dev, struct ntx_nvme_batch *batch, int64_t timeout_us);
int ntx_nvme_batch_close(struct ntx_nvme *dev, struct ntx_nvme_batch *batch);
int ntx_nvme_read(struct ntx_nvme *dev, uint64_t lba, uint32_t nlb, void *dst);
/* cdef-end */

#endif /* NTX_NVME_H */
