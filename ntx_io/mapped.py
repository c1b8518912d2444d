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

    def __init__(self, path: str, *, workers: int = 4, chunk: int = 8 << 20, evict: bool = False):
        """evict: drop each range from the page cache once copied (POSIX_FADV_DONTNEED), so a
        storage-tier layer is read from the device every time, as O_DIRECT does, instead of
        quietly living in RAM the budget did not give it."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = source_size(fd)
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        except BaseException:
            os.close(fd)
            raise
        if evict:
            self._fd = fd
        else:
            os.close(fd)
            self._fd = None
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")
        super().__init__(path, size, workers=workers, chunk=chunk)

    def _read_range(self, offset: int, length: int, view: memoryview) -> None:
        start = offset - offset % PAGE
        self._map.madvise(mmap.MADV_WILLNEED, start, offset + length - start)
        view[:] = self._view[offset: offset + length]
        if self._fd is not None:  # unmap our view of the pages first: mapped pages are never dropped
            self._map.madvise(mmap.MADV_DONTNEED, start, offset + length - start)
            os.posix_fadvise(self._fd, start, offset + length - start, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        super().close()
        self._view.release()
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
