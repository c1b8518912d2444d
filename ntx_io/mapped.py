"""`MmapReader`: the fallback when O_DIRECT is unavailable - the page cache through mmap.

`madvise(MADV_WILLNEED)` on each range starts kernel readahead for it before the copy touches
the pages, so the copy waits on the disk once per range rather than once per page fault.
"""

from __future__ import annotations

import mmap
import os

from ntx_io.reader import PooledReader, source_size

PAGE = mmap.PAGESIZE


class MmapReader(PooledReader):
    name = "mmap"

    def __init__(self, path: str, *, workers: int = 4, chunk: int = 8 << 20):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = source_size(fd)
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")
        super().__init__(path, size, workers=workers, chunk=chunk)

    def _read_range(self, offset: int, length: int, view: memoryview) -> None:
        start = offset - offset % PAGE
        self._map.madvise(mmap.MADV_WILLNEED, start, offset + length - start)
        view[:] = self._view[offset: offset + length]

    def close(self) -> None:
        super().close()
        self._view.release()
        if self._map is not None:
            self._map.close()
            self._map = None
