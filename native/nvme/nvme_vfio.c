/*
 * nvme_vfio.c - the VFIO and memory layer: container/group/device, BAR0, PCI config space,
 * DMA regions and the IOVA allocator.
 *
 * Type1 (the default) maps each region into the IOMMU at an IOVA chosen here from the ranges
 * the kernel reports as usable. No-IOMMU mode (only when asked for) has no translation: the
 * controller is handed physical addresses read from /proc/self/pagemap, so regions must be
 * pinned and must not move (hugepages) - the caller is responsible for that choice.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <linux/vfio.h>

#include "nvme_impl.h"

#ifndef VFIO_NOIOMMU_IOMMU
#define VFIO_NOIOMMU_IOMMU 8
#endif

#define PCI_COMMAND          0x04     /* PCI configuration space command register */
#define PCI_COMMAND_MEMORY   (1u << 1)
#define PCI_COMMAND_MASTER   (1u << 2)  /* bus master enable: vfio-pci leaves it clear */
#define PCI_COMMAND_INTX_OFF (1u << 10) /* we poll; no legacy interrupts */

#define PAGEMAP_PRESENT  (1ull << 63)
#define PAGEMAP_PFN_MASK ((1ull << 55) - 1)

int nx_fail(struct ntx_nvme *d, int errnum, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->err, sizeof d->err, fmt, ap);
    va_end(ap);
    return -errnum;
}

uint64_t nx_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Register access. A read of all ones means the function is gone from the bus (surprise
 * removal, or a dead link); callers test d->gone after every wait. */
uint32_t nx_rd32(struct ntx_nvme *d, uint32_t off)
{
    uint32_t v = *(volatile uint32_t *)(d->vfio.bar0 + off);
    if (v == 0xffffffffu)
        d->gone = 1;
    return v;
}

uint64_t nx_rd64(struct ntx_nvme *d, uint32_t off)
{
    uint64_t lo = nx_rd32(d, off), hi = nx_rd32(d, off + 4);
    return lo | (hi << 32);
}

void nx_wr32(struct ntx_nvme *d, uint32_t off, uint32_t val)
{
    *(volatile uint32_t *)(d->vfio.bar0 + off) = val;
}

void nx_wr64(struct ntx_nvme *d, uint32_t off, uint64_t val)
{
    nx_wr32(d, off, (uint32_t)val);
    nx_wr32(d, off + 4, (uint32_t)(val >> 32));
}

static int sysfs_link_name(const char *bdf, const char *what, char *out, size_t outlen)
{
    char path[PATH_MAX], link[PATH_MAX];
    snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/%s", bdf, what);
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n < 0)
        return -errno;
    link[n] = 0;
    const char *base = strrchr(link, '/');
    base = base ? base + 1 : link;
    if (strlen(base) >= outlen)
        return -ENAMETOOLONG;
    memcpy(out, base, strlen(base) + 1);
    return 0;
}

static int open_group(struct ntx_nvme *d, const char *bdf, int want_iommu)
{
    char grp[64], drv[64], path[PATH_MAX];
    if (sysfs_link_name(bdf, "driver", drv, sizeof drv) || strcmp(drv, "vfio-pci") != 0)
        return nx_fail(d, ENODEV, "%s is not bound to vfio-pci (bind it first: ntx-setup bind %s)",
                       bdf, bdf);
    int rc = sysfs_link_name(bdf, "iommu_group", grp, sizeof grp);
    if (rc)
        return nx_fail(d, -rc, "%s has no iommu_group in sysfs: %s", bdf, strerror(-rc));
    snprintf(path, sizeof path, "/dev/vfio/%s", grp);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
        if (!want_iommu) {
            close(fd);
            return nx_fail(d, EINVAL, "%s is behind an IOMMU (group %s): open it in IOMMU mode", bdf, grp);
        }
        d->vfio.group = fd;
        return 0;
    }
    snprintf(path, sizeof path, "/dev/vfio/noiommu-%s", grp);
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return nx_fail(d, errno, "cannot open the VFIO group of %s (/dev/vfio/%s): %s", bdf, grp,
                       strerror(errno));
    if (want_iommu) {
        close(fd);
        return nx_fail(d, EPERM, "%s is in a no-IOMMU group (%s): DMA would be unprotected; "
                       "open with iommu=False only if you accept that", bdf, path);
    }
    d->vfio.group = fd;
    d->vfio.noiommu = 1;
    return 0;
}

static int read_iova_ranges(struct ntx_nvme *d)
{
    struct nx_vfio *v = &d->vfio;
    struct vfio_iommu_type1_info probe = { .argsz = sizeof probe };
    v->niova = 0;
    if (ioctl(v->container, VFIO_IOMMU_GET_INFO, &probe))
        return nx_fail(d, errno, "VFIO_IOMMU_GET_INFO failed: %s", strerror(errno));
    struct vfio_iommu_type1_info *info = calloc(1, probe.argsz);
    if (!info)
        return nx_fail(d, ENOMEM, "out of memory reading IOMMU info");
    info->argsz = probe.argsz;
    int rc = 0;
    if (ioctl(v->container, VFIO_IOMMU_GET_INFO, info)) {
        rc = nx_fail(d, errno, "VFIO_IOMMU_GET_INFO failed: %s", strerror(errno));
    } else if ((info->flags & VFIO_IOMMU_INFO_CAPS) && info->cap_offset) {
        uint32_t off = info->cap_offset;
        while (off && off + sizeof(struct vfio_info_cap_header) <= info->argsz) {
            struct vfio_info_cap_header *h = (void *)((uint8_t *)info + off);
            if (h->id == VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE) {
                struct vfio_iommu_type1_info_cap_iova_range *r = (void *)h;
                for (uint32_t i = 0; i < r->nr_iovas && v->niova < NX_MAX_IOVA_RANGES; i++) {
                    v->iova[v->niova].start = r->iova_ranges[i].start;
                    v->iova[v->niova].end = r->iova_ranges[i].end;
                    v->niova++;
                }
            }
            off = h->next;
        }
    }
    free(info);
    if (!rc && v->niova == 0) { /* old kernels: assume a 39-bit space (the smallest VT-d width) */
        v->iova[0].start = 0;
        v->iova[0].end = (1ull << 39) - 1;
        v->niova = 1;
    }
    return rc;
}

static int setup_container(struct ntx_nvme *d, const char *bdf)
{
    struct nx_vfio *v = &d->vfio;
    v->container = open("/dev/vfio/vfio", O_RDWR | O_CLOEXEC);
    if (v->container < 0)
        return nx_fail(d, errno, "cannot open /dev/vfio/vfio: %s (is the vfio module loaded?)",
                       strerror(errno));
    if (ioctl(v->container, VFIO_GET_API_VERSION) != VFIO_API_VERSION)
        return nx_fail(d, EINVAL, "unexpected VFIO API version");
    unsigned long type = v->noiommu ? VFIO_NOIOMMU_IOMMU : VFIO_TYPE1v2_IOMMU;
    if (ioctl(v->container, VFIO_CHECK_EXTENSION, type) <= 0)
        return nx_fail(d, ENOTSUP, "VFIO does not offer the %s IOMMU type",
                       v->noiommu ? "no-IOMMU" : "type1v2");
    struct vfio_group_status gs = { .argsz = sizeof gs };
    if (ioctl(v->group, VFIO_GROUP_GET_STATUS, &gs))
        return nx_fail(d, errno, "VFIO_GROUP_GET_STATUS failed: %s", strerror(errno));
    if (!(gs.flags & VFIO_GROUP_FLAGS_VIABLE))
        return nx_fail(d, EBUSY, "the IOMMU group of %s is not viable: are all devices in the "
                       "group bound to vfio-pci (or no driver)?", bdf);
    if (ioctl(v->group, VFIO_GROUP_SET_CONTAINER, &v->container))
        return nx_fail(d, errno, "VFIO_GROUP_SET_CONTAINER failed: %s (is the group already open "
                       "in another process?)", strerror(errno));
    if (ioctl(v->container, VFIO_SET_IOMMU, type))
        return nx_fail(d, errno, "VFIO_SET_IOMMU failed: %s", strerror(errno));
    if (v->noiommu) {
        v->pagemap_fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
        if (v->pagemap_fd < 0)
            return nx_fail(d, errno, "cannot open /proc/self/pagemap: %s", strerror(errno));
        return 0;
    }
    return read_iova_ranges(d);
}

static int setup_device(struct ntx_nvme *d, const char *bdf)
{
    struct nx_vfio *v = &d->vfio;
    v->device = ioctl(v->group, VFIO_GROUP_GET_DEVICE_FD, bdf);
    if (v->device < 0)
        return nx_fail(d, errno, "VFIO_GROUP_GET_DEVICE_FD(%s) failed: %s", bdf, strerror(errno));
    struct vfio_region_info bar = { .argsz = sizeof bar, .index = VFIO_PCI_BAR0_REGION_INDEX };
    if (ioctl(v->device, VFIO_DEVICE_GET_REGION_INFO, &bar))
        return nx_fail(d, errno, "cannot query BAR0 of %s: %s", bdf, strerror(errno));
    if (!(bar.flags & VFIO_REGION_INFO_FLAG_MMAP) || bar.size < NVME_REG_DBS + 8)
        return nx_fail(d, ENOTSUP, "BAR0 of %s cannot be mmapped (size %llu)", bdf,
                       (unsigned long long)bar.size);
    void *p = mmap(NULL, bar.size, PROT_READ | PROT_WRITE, MAP_SHARED, v->device, (off_t)bar.offset);
    if (p == MAP_FAILED)
        return nx_fail(d, errno, "mmap of BAR0 of %s failed: %s", bdf, strerror(errno));
    v->bar0 = p;
    v->bar0_len = bar.size;
    struct vfio_region_info cfg = { .argsz = sizeof cfg, .index = VFIO_PCI_CONFIG_REGION_INDEX };
    if (ioctl(v->device, VFIO_DEVICE_GET_REGION_INFO, &cfg))
        return nx_fail(d, errno, "cannot query PCI config space of %s: %s", bdf, strerror(errno));
    v->cfg_offset = cfg.offset;
    uint16_t cmd;
    if (pread(v->device, &cmd, 2, (off_t)(cfg.offset + PCI_COMMAND)) != 2)
        return nx_fail(d, EIO, "cannot read the PCI command register of %s", bdf);
    cmd |= PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_INTX_OFF;
    if (pwrite(v->device, &cmd, 2, (off_t)(cfg.offset + PCI_COMMAND)) != 2)
        return nx_fail(d, EIO, "cannot enable bus mastering on %s", bdf);
    return 0;
}

int nx_vfio_open(struct ntx_nvme *d, const char *bdf, int want_iommu)
{
    struct nx_vfio *v = &d->vfio;
    v->container = v->group = v->device = v->pagemap_fd = -1;
    int rc = open_group(d, bdf, want_iommu);
    if (!rc)
        rc = setup_container(d, bdf);
    if (!rc)
        rc = setup_device(d, bdf);
    return rc;
}

void nx_vfio_close(struct nx_vfio *v)
{
    if (v->device >= 0) { /* leave bus mastering off so a stray command cannot DMA */
        uint16_t cmd;
        if (pread(v->device, &cmd, 2, (off_t)(v->cfg_offset + PCI_COMMAND)) == 2) {
            cmd &= (uint16_t)~PCI_COMMAND_MASTER;
            if (pwrite(v->device, &cmd, 2, (off_t)(v->cfg_offset + PCI_COMMAND)) != 2)
                cmd = 0; /* nothing more to do: closing the device fd resets it anyway */
        }
    }
    if (v->bar0)
        munmap((void *)v->bar0, v->bar0_len);
    v->bar0 = NULL;
    int *fds[] = { &v->pagemap_fd, &v->device, &v->group, &v->container };
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++) {
        if (*fds[i] >= 0)
            close(*fds[i]);
        *fds[i] = -1;
    }
}

/* First fit over the usable IOVA ranges, skipping the ranges already handed out. */
static int iova_alloc(struct nx_vfio *v, size_t len, uint64_t *out)
{
    uint64_t align = len >= NX_HUGE_SIZE ? NX_HUGE_SIZE : NVME_PAGE_SIZE;
    for (int r = 0; r < v->niova; r++) {
        uint64_t cur = v->iova[r].start < NX_IOVA_BASE ? NX_IOVA_BASE : v->iova[r].start;
        for (int moved = 1; moved;) {
            moved = 0;
            cur = (cur + align - 1) & ~(align - 1);
            for (int i = 0; i < NX_MAX_REGIONS; i++) {
                const struct nx_region *g = &v->regions[i];
                if (g->in_use && cur < g->iova + g->len && g->iova < cur + len) {
                    cur = g->iova + g->len;
                    moved = 1;
                }
            }
        }
        if (cur + len - 1 >= cur && cur + len - 1 <= v->iova[r].end) {
            *out = cur;
            return 0;
        }
    }
    return -ENOSPC;
}

static int pagemap_fill(struct ntx_nvme *d, struct nx_region *g)
{
    size_t pages = g->len / NVME_PAGE_SIZE;
    g->phys = calloc(pages, sizeof *g->phys);
    if (!g->phys)
        return nx_fail(d, ENOMEM, "out of memory for the page table of a DMA region");
    for (size_t i = 0; i < pages; i++) { /* write-fault every page: a read maps the zero page */
        volatile uint8_t *b = (volatile uint8_t *)(g->va + i * NVME_PAGE_SIZE);
        *b = *b;
    }
    if (mlock((void *)g->va, g->len))
        return nx_fail(d, errno, "mlock of a %zu-byte DMA region failed: %s (RLIMIT_MEMLOCK?)",
                       g->len, strerror(errno));
    for (size_t i = 0; i < pages; i++) {
        uint64_t e;
        off_t off = (off_t)((g->va / NVME_PAGE_SIZE + i) * sizeof e);
        if (pread(d->vfio.pagemap_fd, &e, sizeof e, off) != (ssize_t)sizeof e)
            return nx_fail(d, EIO, "reading /proc/self/pagemap failed");
        if (!(e & PAGEMAP_PRESENT) || !(e & PAGEMAP_PFN_MASK))
            return nx_fail(d, EPERM, "physical address of a DMA page is hidden "
                           "(no-IOMMU mode needs CAP_SYS_ADMIN to read pagemap)");
        g->phys[i] = (e & PAGEMAP_PFN_MASK) * NVME_PAGE_SIZE;
    }
    return 0;
}

static int region_map_iommu(struct ntx_nvme *d, struct nx_region *g)
{
    if (iova_alloc(&d->vfio, g->len, &g->iova))
        return nx_fail(d, ENOSPC, "no free IOVA range of %zu bytes", g->len);
    struct vfio_iommu_type1_dma_map m = {
        .argsz = sizeof m,
        .flags = VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
        .vaddr = g->va, .iova = g->iova, .size = g->len,
    };
    if (ioctl(d->vfio.container, VFIO_IOMMU_MAP_DMA, &m)) {
        int e = errno;
        if (e == ENOMEM)
            return nx_fail(d, e, "VFIO_IOMMU_MAP_DMA of %zu bytes failed: pinning exceeds "
                           "RLIMIT_MEMLOCK (raise `ulimit -l` or run with CAP_IPC_LOCK)", g->len);
        return nx_fail(d, e, "VFIO_IOMMU_MAP_DMA of %zu bytes failed: %s", g->len, strerror(e));
    }
    return 0;
}

int nx_region_map(struct ntx_nvme *d, void *va, size_t len, int internal)
{
    uintptr_t a = (uintptr_t)va;
    if (!va || !len || (a % NVME_PAGE_SIZE) || (len % NVME_PAGE_SIZE))
        return nx_fail(d, EINVAL, "DMA regions must be non-empty and 4 KiB aligned (va %p, %zu bytes)",
                       va, len);
    struct nx_region *g = NULL;
    for (int i = 0; i < NX_MAX_REGIONS; i++) {
        struct nx_region *r = &d->vfio.regions[i];
        if (r->in_use && a < r->va + r->len && r->va < a + len)
            return nx_fail(d, EEXIST, "memory at %p overlaps a region already mapped", va);
        if (!r->in_use && !g)
            g = r;
    }
    if (!g)
        return nx_fail(d, ENOSPC, "too many DMA regions (at most %d)", NX_MAX_REGIONS);
    *g = (struct nx_region){ .va = a, .len = len, .internal = internal };
    int rc = d->vfio.noiommu ? pagemap_fill(d, g) : region_map_iommu(d, g);
    if (rc) {
        free(g->phys);
        *g = (struct nx_region){ 0 };
        return rc;
    }
    g->in_use = 1;
    d->stats.regions++;
    d->stats.mapped_bytes += len;
    return 0;
}

int nx_region_unmap(struct ntx_nvme *d, void *va)
{
    for (int i = 0; i < NX_MAX_REGIONS; i++) {
        struct nx_region *g = &d->vfio.regions[i];
        if (!g->in_use || g->va != (uintptr_t)va)
            continue;
        int rc = 0;
        /* no-IOMMU: nothing to undo; the pages stay locked (mlock does not nest, and the
         * owner may have locked them itself) */
        if (!d->vfio.noiommu) {
            struct vfio_iommu_type1_dma_unmap u = { .argsz = sizeof u, .iova = g->iova, .size = g->len };
            if (ioctl(d->vfio.container, VFIO_IOMMU_UNMAP_DMA, &u))
                rc = nx_fail(d, errno, "VFIO_IOMMU_UNMAP_DMA failed: %s", strerror(errno));
        }
        free(g->phys);
        d->stats.regions--;
        d->stats.mapped_bytes -= g->len;
        *g = (struct nx_region){ 0 };
        return rc;
    }
    return nx_fail(d, ENOENT, "no DMA region starts at %p", va);
}

/* The mapped region holding all of [va, va + len), or NULL. */
const struct nx_region *nx_region_find(struct ntx_nvme *d, const void *va, size_t len)
{
    uintptr_t a = (uintptr_t)va;
    for (int i = 0; i < NX_MAX_REGIONS; i++) {
        const struct nx_region *g = &d->vfio.regions[i];
        if (g->in_use && a >= g->va && a + len <= g->va + g->len)
            return g;
    }
    return NULL;
}
