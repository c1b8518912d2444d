"""Page-locked host buffers: the NVMe DMA target and the CUDA H2D source are the same bytes.

A `PinnedBuffer` is an anonymous mapping, from 2 MiB hugepages when they are available
(they never move or swap, which no-IOMMU DMA requires), otherwise 4 KiB pages locked with
mlock. It is mapped once into each VFIO container that reads into it and registered once with
CUDA, and it refuses to be freed while anything could still write into it.
"""

from __future__ import annotations

import ctypes
import mmap
import resource
import weakref
from pathlib import Path

from ntx_common.errors import NtxIOError

PAGE = 4096
HUGE_PAGE = 2 << 20
MAP_HUGETLB = 0x40000  # <sys/mman.h>; Python's mmap module does not name it


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def hugepages_free(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Free 2 MiB hugepages right now (0 when the kernel shows none)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("HugePages_Free:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mlock(address: int, size: int) -> None:
    if _libc().mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) == 0:
        return
    errno = ctypes.get_errno()
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"
    raise NtxIOError(
        f"cannot lock {size >> 20} MiB of host memory (errno {errno}): RLIMIT_MEMLOCK is {limit}; "
        "raise it (`ulimit -l unlimited`, or memlock in /etc/security/limits.conf) or use hugepages "
        "(`ntx-setup hugepages`)")


def _address(mm: mmap.mmap) -> int:
    probe = ctypes.c_char.from_buffer(mm)  # a temporary export: released when probe goes
    address = ctypes.addressof(probe)
    del probe
    return address


def _allocate(nbytes: int, hugepages: bool | None, lock: bool,
              numa_nodes: list[int] | None = None) -> tuple[mmap.mmap, bool]:
    anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if numa_nodes is None:  # else the pages are touched after the policy is set (numa.interleave)
        anon |= mmap.MAP_POPULATE
    if hugepages is not False:
        size = round_up(nbytes, HUGE_PAGE)
        try:
            return _placed(mmap.mmap(-1, size, flags=anon | MAP_HUGETLB), numa_nodes), True
        except OSError as exc:
            if hugepages:
                raise NtxIOError(
                    f"cannot allocate {size >> 20} MiB from 2 MiB hugepages ({hugepages_free()} free: "
                    f"{exc.strerror}); reserve more with `ntx-setup hugepages` or "
                    f"`echo N > /proc/sys/vm/nr_hugepages`") from None
    size = round_up(nbytes, PAGE)
    mm = _placed(mmap.mmap(-1, size, flags=anon), numa_nodes)
    if lock:
        try:
            _mlock(_address(mm), size)
        except NtxIOError:
            mm.close()
            raise
    return mm, False


def _placed(mm: mmap.mmap, numa_nodes: list[int] | None) -> mmap.mmap:
    """mm with its pages interleaved over numa_nodes, then touched (MAP_POPULATE was left out
    so the policy applies when they are first faulted in)."""
    if numa_nodes is None:
        return mm
    from ntx_io import numa

    try:
        numa.interleave(_address(mm), len(mm), numa_nodes)
    except NtxIOError:
        mm.close()
        raise
    import numpy as np

    np.frombuffer(mm, dtype=np.uint8)[::PAGE] = 0  # fault every page in now, under the policy
    return mm


class PinnedBuffer:
    """`nbytes` of page-locked, page-aligned host memory.

    hugepages: None tries 2 MiB pages and falls back to locked 4 KiB pages; True requires
    them; False never uses them. numa_nodes: interleave the pages over these NUMA nodes.
    `view()`/`numpy()` expose the bytes; `close()` releases them and refuses while views are
    alive or a device may still write into them.
    """

    def __init__(self, nbytes: int, *, hugepages: bool | None = None, lock: bool = True,
                 numa_nodes: list[int] | None = None):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"PinnedBuffer size must be a positive int, got {nbytes!r}")
        self.nbytes = nbytes
        self.numa_nodes = numa_nodes  # pages interleaved over these nodes (ntx_io.numa), or first touch
        self._mm, self.hugepages = _allocate(nbytes, hugepages, lock, numa_nodes)
        self.address = _address(self._mm)
        self.capacity = len(self._mm)
        self._devices: list = []  # NvmeDevice objects this buffer is DMA-mapped into
        self._cuda = None  # gpu.CudaRegistration when registered
        self.closed = False

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        kind = "hugepages" if self.hugepages else "locked pages"
        state = "closed" if self.closed else f"0x{self.address:x}"
        return f"PinnedBuffer({self.nbytes} bytes, {kind}, {state})"

    def _check_open(self) -> None:
        if self.closed:
            raise NtxIOError(f"{self!r} is closed")

    def view(self) -> memoryview:
        """A writable memoryview of the first `nbytes` bytes."""
        self._check_open()
        return memoryview(self._mm)[: self.nbytes]

    def numpy(self):
        """A uint8 numpy array over the same bytes (no copy)."""
        import numpy as np

        self._check_open()
        return np.frombuffer(self._mm, dtype=np.uint8, count=self.nbytes)

    def contains(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.address + self.capacity

    @property
    def cuda_registered(self) -> bool:
        return self._cuda is not None

    def register_cuda(self, device: int = 0) -> None:
        """Page-lock the bytes for the GPU too (`cuMemHostRegister`), once."""
        from ntx_io import gpu

        self._check_open()
        if self._cuda is None:
            self._cuda = gpu.register_host(self.address, self.capacity, device)
            # a buffer dropped without close() must not leave its address range registered:
            # the next mapping at that address could then never be registered again
            self._cuda_finalizer = weakref.finalize(self, self._cuda.release)

    def close(self) -> None:
        """Unmap from devices, unregister from CUDA, free. Idempotent."""
        if self.closed:
            return
        for device in list(self._devices):
            device.unmap(self)  # raises while the device is fenced: the bytes stay reserved
        if self._cuda is not None:
            self._cuda_finalizer.detach()
            self._cuda.release()
            self._cuda = None
        try:
            self._mm.close()
        except BufferError:
            raise NtxIOError(f"{self!r} still has live views (memoryview/numpy arrays): "
                             "release them before close()") from None
        self.closed = True

    def __enter__(self) -> PinnedBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
