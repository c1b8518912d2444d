"""The `Reader` protocol: bytes of a file, a block device or a raw NVMe namespace, by absolute
byte range, into caller-provided memory - and `open_reader`, which picks the fastest backend
that works (VFIO NVMe > O_DIRECT > mmap) and says why.

The engine drives a reader from its reader thread: `submit` a list of (offset, length,
destination) and `wait` on the handle, with several requests in flight; `read_into` is the
one-shot form. Destinations are writable buffers (memoryview, bytearray, numpy array,
`PinnedBuffer`) at least `length` bytes long. `register(buf)` makes a `PinnedBuffer` a
zero-copy target (the VFIO reader DMA-maps it); block-aligned ranges into registered buffers
then land without a copy.
"""

from __future__ import annotations

import concurrent.futures as cf
import operator
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from ntx_common.errors import NtxIOError, UsageError
from ntx_io.buffers import PinnedBuffer

KINDS = ("auto", "vfio", "direct", "mmap")
VFIO_PREFIX = "vfio:"


@runtime_checkable
class Reader(Protocol):
    name: str  # "vfio" | "direct" | "mmap"
    source: str
    size: int  # readable bytes
    needs_hugepages: bool  # True: destinations must be PinnedBuffer(hugepages=True)

    def register(self, buffer: PinnedBuffer) -> None: ...

    def read_into(self, offset: int, length: int, dest) -> None: ...

    def submit(self, requests: Sequence[tuple[int, int, object]]): ...

    def wait(self, handle, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...


def dest_view(dest, length: int) -> memoryview:
    """The first `length` bytes of a writable destination as a flat byte memoryview."""
    view = dest.view() if isinstance(dest, PinnedBuffer) else memoryview(dest)
    if view.readonly:
        raise NtxIOError("read destination is read-only")
    if not view.c_contiguous:
        raise NtxIOError("read destination must be contiguous memory")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if len(view) < length:
        raise NtxIOError(f"read destination holds {len(view)} bytes, {length} requested")
    return view[:length]


def check_range(source: str, size: int, offset, length) -> tuple[int, int]:
    """(offset, length) as ints, checked against the source's size."""
    try:
        offset, length = operator.index(offset), operator.index(length)  # numpy ints welcome
    except TypeError:
        offset = length = -1
    if offset < 0 or length < 0:
        raise NtxIOError(f"bad read range offset={offset!r} length={length!r} on {source}")
    if offset + length > size:
        raise NtxIOError(f"read of bytes {offset}..{offset + length} ends past the end of {source} "
                         f"({size} bytes)")
    return offset, length


class PooledReader:
    """Kernel-path readers: each request is cut into pieces of at most `chunk` bytes that run
    on a thread pool, so one large read keeps several requests in flight."""

    name = "pooled"
    needs_hugepages = False

    def __init__(self, source: str, size: int, *, workers: int, chunk: int):
        if workers < 1 or chunk < 4096:
            raise ValueError(f"workers must be >= 1 and chunk >= 4096, got {workers}, {chunk}")
        self.source, self.size, self.chunk = source, size, chunk
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"ntx-{self.name}")

    def register(self, buffer: PinnedBuffer) -> None:
        """Kernel-path reads copy into any memory: nothing to set up."""

    def _read_range(self, offset: int, length: int, view: memoryview) -> None:
        raise NotImplementedError

    def _task(self, offset: int, length: int, view: memoryview) -> Callable[[], None]:
        def run() -> None:
            try:
                self._read_range(offset, length, view)
            except OSError as exc:
                raise NtxIOError(f"{self.name} read of bytes {offset}..{offset + length} of "
                                 f"{self.source} failed: {exc.strerror or exc}") from None
        return run

    def submit(self, requests: Sequence[tuple[int, int, object]]) -> list[cf.Future]:
        futures = []
        for offset, length, dest in requests:
            offset, length = check_range(self.source, self.size, offset, length)
            view = dest_view(dest, length)
            for start in range(0, length, self.chunk):
                n = min(self.chunk, length - start)
                futures.append(self._pool.submit(self._task(offset + start, n, view[start:start + n])))
        return futures

    def wait(self, handle: list[cf.Future], timeout: float | None = None) -> bool:
        _, pending = cf.wait(handle, timeout=timeout)
        if pending:
            return False
        for future in handle:
            future.result()  # raises the first failure
        return True

    def read_into(self, offset: int, length: int, dest) -> None:
        self.wait(self.submit([(offset, length, dest)]))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def source_size(fd: int) -> int:
    """Bytes of a regular file or block device (lseek to the end works for both)."""
    return os.lseek(fd, 0, os.SEEK_END)


def open_reader(source: str | os.PathLike, kind: str = "auto", *, iommu: bool = True,
                **options) -> tuple[Reader, str]:
    """Open the best reader for `source`; returns (reader, why this one).

    `source` is a path (file or block device) or `vfio:<PCI address>` for a controller
    bound to vfio-pci. `iommu=False` (no-IOMMU DMA) is never chosen automatically."""
    if kind not in KINDS:
        raise UsageError(f"reader kind must be one of {', '.join(KINDS)}, got {kind!r}")
    text = os.fspath(source)
    if text.startswith(VFIO_PREFIX):
        if kind not in ("auto", "vfio"):
            raise UsageError(f"{text} is a PCI address: only the VFIO reader can read it")
        from ntx_io.nvme_reader import NvmeReader

        reader = NvmeReader.open(text[len(VFIO_PREFIX):], iommu=iommu, **options)
        mode = "IOMMU type1" if iommu else "no-IOMMU (unprotected DMA)"
        return reader, f"VFIO userspace NVMe driver ({mode}): DMA straight into pinned buffers"
    if kind == "vfio":
        raise UsageError(f"the VFIO reader needs a PCI address (vfio:0000:01:00.0), not a path: {text}")
    if not Path(text).exists():
        raise NtxIOError(f"{text}: no such file or device")
    return _open_kernel_path(text, kind, **options)


def _open_kernel_path(path: str, kind: str, evict: bool = False, **options) -> tuple[Reader, str]:
    """evict: the mmap reader drops what it read from the page cache (O_DIRECT never fills it)."""
    from ntx_io.direct import DirectReader
    from ntx_io.mapped import MmapReader

    why_not = ""
    if kind in ("auto", "direct"):
        try:
            reader = DirectReader(path, **options)
            return reader, (f"O_DIRECT: bypasses the page cache, up to {reader.workers} requests of "
                            f"{reader.chunk >> 20} MiB in flight")
        except NtxIOError as exc:
            if kind == "direct":
                raise
            why_not = str(exc)
    reader = MmapReader(path, evict=evict, **options)
    return reader, (f"mmap fallback ({why_not})" if why_not else "mmap (requested): page cache, madvise")
