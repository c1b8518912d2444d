/*
 * nvme_spec.h - the subset of the NVMe specification the read-only driver uses.
 *
 * Names follow the specification. Section numbers refer to the NVM Express Base
 * Specification 2.0 ("NVMe 2.0"), the NVM Command Set Specification 1.0 ("NVM-CS 1.0")
 * and the NVMe over PCIe Transport Specification 1.0 ("NVMe-PCIe 1.0").
 *
 * Only read-side opcodes are defined here on purpose: no opcode that writes to media
 * (Write, Write Zeroes, Dataset Management, Format, Sanitize, ...) exists in the driver.
 */
#ifndef NTX_NVME_SPEC_H
#define NTX_NVME_SPEC_H

#include <stdint.h>

/* Controller properties (memory-mapped registers in BAR0), NVMe 2.0 §3.1.3 */
#define NVME_REG_CAP   0x00 /* Controller Capabilities, NVMe 2.0 §3.1.3.1 */
#define NVME_REG_VS    0x08 /* Version, NVMe 2.0 §3.1.3.2 */
#define NVME_REG_INTMS 0x0c /* Interrupt Mask Set, NVMe 2.0 §3.1.3.3 */
#define NVME_REG_CC    0x14 /* Controller Configuration, NVMe 2.0 §3.1.3.5 */
#define NVME_REG_CSTS  0x1c /* Controller Status, NVMe 2.0 §3.1.3.6 */
#define NVME_REG_AQA   0x24 /* Admin Queue Attributes, NVMe 2.0 §3.1.3.8 */
#define NVME_REG_ASQ   0x28 /* Admin Submission Queue Base Address, NVMe 2.0 §3.1.3.9 */
#define NVME_REG_ACQ   0x30 /* Admin Completion Queue Base Address, NVMe 2.0 §3.1.3.10 */
#define NVME_REG_DBS   0x1000 /* first doorbell, NVMe-PCIe 1.0 §3.1.2 */

/* CAP fields, NVMe 2.0 §3.1.3.1 */
#define NVME_CAP_MQES(cap)   ((uint32_t)((cap) & 0xffff))         /* 0's based max queue entries */
#define NVME_CAP_CQR(cap)    ((uint32_t)(((cap) >> 16) & 0x1))    /* contiguous queues required */
#define NVME_CAP_TO(cap)     ((uint32_t)(((cap) >> 24) & 0xff))   /* ready timeout, 500 ms units */
#define NVME_CAP_DSTRD(cap)  ((uint32_t)(((cap) >> 32) & 0xf))    /* doorbell stride 2^(2+DSTRD) */
#define NVME_CAP_CSS(cap)    ((uint32_t)(((cap) >> 37) & 0xff))   /* command sets supported */
#define NVME_CAP_MPSMIN(cap) ((uint32_t)(((cap) >> 48) & 0xf))    /* min page 2^(12+MPSMIN) */
#define NVME_CAP_MPSMAX(cap) ((uint32_t)(((cap) >> 52) & 0xf))

/* CC fields, NVMe 2.0 §3.1.3.5 */
#define NVME_CC_EN            (1u << 0)
#define NVME_CC_CSS_NVM       (0u << 4)
#define NVME_CC_MPS(shift)    ((uint32_t)((shift) - 12) << 7)
#define NVME_CC_AMS_RR        (0u << 11)
#define NVME_CC_SHN_MASK      (3u << 14)
#define NVME_CC_SHN_NORMAL    (1u << 14)
#define NVME_CC_IOSQES(log2)  ((uint32_t)(log2) << 16)
#define NVME_CC_IOCQES(log2)  ((uint32_t)(log2) << 20)

/* CSTS fields, NVMe 2.0 §3.1.3.6 */
#define NVME_CSTS_RDY           (1u << 0)
#define NVME_CSTS_CFS           (1u << 1)
#define NVME_CSTS_SHST_MASK     (3u << 2)
#define NVME_CSTS_SHST_COMPLETE (2u << 2)

/* AQA, NVMe 2.0 §3.1.3.8: 0's based sizes */
#define NVME_AQA(asqs, acqs) ((uint32_t)(((acqs) - 1) << 16) | (uint32_t)((asqs) - 1))

/* Entry sizes chosen in CC.IOSQES / CC.IOCQES (log2 bytes) */
#define NVME_SQES_LOG2 6 /* 64-byte submission queue entry, NVMe 2.0 §4.1 */
#define NVME_CQES_LOG2 4 /* 16-byte completion queue entry, NVMe 2.0 §4.2 */

/* Submission Queue Entry (common command format), NVMe 2.0 §4.1 */
struct nvme_sqe {
    uint8_t  opc;      /* CDW0 7:0  opcode */
    uint8_t  flags;    /* CDW0 15:8 FUSE (9:8), PSDT (15:14) = 0: PRPs */
    uint16_t cid;      /* CDW0 31:16 command identifier */
    uint32_t nsid;     /* namespace identifier */
    uint32_t cdw2, cdw3;
    uint64_t mptr;     /* metadata pointer (unused) */
    uint64_t prp1;     /* data pointer: PRP entry 1, NVMe 2.0 §4.1.1 */
    uint64_t prp2;     /* PRP entry 2 or pointer to a PRP list */
    uint32_t cdw10, cdw11, cdw12, cdw13, cdw14, cdw15;
};

/* Completion Queue Entry, NVMe 2.0 §4.2 */
struct nvme_cqe {
    uint32_t dw0;      /* command specific */
    uint32_t dw1;
    uint16_t sqhd;     /* SQ head pointer */
    uint16_t sqid;     /* SQ identifier */
    uint16_t cid;      /* command identifier */
    uint16_t status;   /* bit 0: phase tag P; 15:1 status field, NVMe 2.0 §4.2.3 */
};

#define NVME_CQE_PHASE(st) ((st) & 1u)
#define NVME_CQE_SC(st)    (((st) >> 1) & 0xffu)  /* status code */
#define NVME_CQE_SCT(st)   (((st) >> 9) & 0x7u)   /* status code type */
#define NVME_CQE_DNR(st)   (((st) >> 15) & 0x1u)  /* do not retry */

/* Status code types, NVMe 2.0 §4.2.3.1 */
#define NVME_SCT_GENERIC  0x0
#define NVME_SCT_CMD_SPEC 0x1
#define NVME_SCT_MEDIA    0x2
#define NVME_SCT_PATH     0x3

/* Admin command set opcodes, NVMe 2.0 §5 (Figure 139): read-side subset only */
#define NVME_ADMIN_DELETE_SQ    0x00 /* §5.7 */
#define NVME_ADMIN_CREATE_SQ    0x01 /* §5.5 */
#define NVME_ADMIN_DELETE_CQ    0x04 /* §5.6 */
#define NVME_ADMIN_CREATE_CQ    0x05 /* §5.4 */
#define NVME_ADMIN_IDENTIFY     0x06 /* §5.17 */
#define NVME_ADMIN_SET_FEATURES 0x09 /* §5.27 */

/* NVM command set I/O opcodes, NVM-CS 1.0 §3: Read only */
#define NVME_CMD_READ 0x02 /* NVM-CS 1.0 §3.2.4 */

/* Identify CNS values, NVMe 2.0 §5.17.1 */
#define NVME_CNS_NS          0x00 /* Identify Namespace (NVM-CS 1.0 §4.1.5.1) */
#define NVME_CNS_CTRL        0x01 /* Identify Controller, NVMe 2.0 §5.17.2.1 */
#define NVME_CNS_ACTIVE_NSID 0x02 /* Active Namespace ID list, NVMe 2.0 §5.17.2.2 */

/* Feature identifiers, NVMe 2.0 §5.27.1 */
#define NVME_FEAT_NUM_QUEUES 0x07 /* Number of Queues, §5.27.1.5 */

/* Identify Controller byte offsets, NVMe 2.0 §5.17.2.1 (Figure 275) */
#define NVME_IDCTL_VID   0
#define NVME_IDCTL_SSVID 2
#define NVME_IDCTL_SN    4   /* 20 bytes ASCII */
#define NVME_IDCTL_MN    24  /* 40 bytes ASCII */
#define NVME_IDCTL_FR    64  /* 8 bytes ASCII */
#define NVME_IDCTL_MDTS  77  /* max data transfer size, 2^n units of CAP.MPSMIN; 0 = no limit */
#define NVME_IDCTL_VER   80
#define NVME_IDCTL_RTD3E 88  /* RTD3 entry latency, microseconds */
#define NVME_IDCTL_NN    516 /* number of namespaces */

/* Identify Namespace (NVM command set) byte offsets, NVM-CS 1.0 §4.1.5.1 */
#define NVME_IDNS_NSZE  0   /* namespace size in logical blocks, 64-bit */
#define NVME_IDNS_NCAP  8
#define NVME_IDNS_NLBAF 25  /* number of LBA formats, 0's based */
#define NVME_IDNS_FLBAS 26  /* formatted LBA size: bits 3:0 low index, 6:5 high index */
#define NVME_IDNS_LBAF0 128 /* LBA format descriptors, 4 bytes each: LBADS in bits 23:16 */

/* PRP entries describe memory pages of CC.MPS bytes (4 KiB here), NVMe 2.0 §4.1.1 */
#define NVME_PAGE_SHIFT 12
#define NVME_PAGE_SIZE  (1u << NVME_PAGE_SHIFT)
#define NVME_PRPS_PER_PAGE (NVME_PAGE_SIZE / 8u)

#endif /* NTX_NVME_SPEC_H */
