"""`NvmeReader`: the `Reader` protocol over the userspace NVMe driver.

The controller moves whole logical blocks by DMA into mapped memory. A request whose byte
range is block aligned and whose destination lies in a `PinnedBuffer` lands there directly
(zero copy: the engine's staging buffers); any other request is read into a bounce region
of the reader's own pinned buffer and copied out after the wait.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field

from ntx_io.buffers import PinnedBuffer
from ntx_io.nvme import NvmeBatch, NvmeDevice
from ntx_io.reader import check_range, dest_view

DEFAULT_BOUNCE = 8 << 20


@dataclass
class NvmeHandle:
    batch: NvmeBatch
    copies: list = field(default_factory=list)  # (dest view, bounce buffer, offset, length)
    spill: list = field(default_factory=list)  # one-off bounce buffers to free after the wait
    regions: list = field(default_factory=list)  # (start, end) taken in the reader's bounce buffer


class NvmeReader:
    name = "vfio"

    def __init__(self, device: NvmeDevice, *, owns_device: bool = False, bounce_bytes: int = DEFAULT_BOUNCE):
        ident = device.identify()
        self.device, self._owns = device, owns_device
        self.source = f"vfio:{ident.bdf} (namespace {ident.nsid})"
        self.block, self.size = ident.lba_bytes, ident.size_bytes
        self.needs_hugepages = not ident.iommu  # no-IOMMU DMA only into memory that never moves
        self._hugepages = True if self.needs_hugepages else None
        self._bounce = self._pinned(bounce_bytes)
        self._live: list[tuple[int, int]] = []  # bounce regions of open handles

    @classmethod
    def open(cls, bdf: str, iommu: bool = True, **options) -> NvmeReader:
        return cls(NvmeDevice.open(bdf, iommu=iommu, **options), owns_device=True)

    def _pinned(self, nbytes: int) -> PinnedBuffer:
        buf = PinnedBuffer(nbytes, hugepages=self._hugepages)
        try:
            self.device.map(buf)
        except Exception:
            buf.close()
            raise
        return buf

    def register(self, buffer: PinnedBuffer) -> None:
        """DMA-map `buffer` (once) so aligned reads into it need no copy."""
        self.device.map(buffer)

    def _mapped_target(self, dest, view: memoryview) -> bool:
        """Can the controller write straight into `view`?"""
        if isinstance(dest, PinnedBuffer):
            self.device.map(dest)  # once; later calls return at once
            return True
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        return address % 4 == 0 and any(b.contains(address, len(view)) for b in self.device._mapped.values())

    def _bounce_region(self, nbytes: int, handle: NvmeHandle) -> tuple[PinnedBuffer, int]:
        """First fit in the reader's bounce buffer among the regions of handles still open;
        a one-off pinned buffer when it is full."""
        size = -(-nbytes // 4096) * 4096
        cursor = 0
        for start, end in sorted(self._live):
            if start - cursor >= size:
                break
            cursor = max(cursor, end)
        if cursor + size <= self._bounce.capacity:
            handle.regions.append((cursor, cursor + size))
            self._live.append((cursor, cursor + size))
            return self._bounce, cursor
        spill = self._pinned(nbytes)
        handle.spill.append(spill)
        return spill, 0

    def submit(self, requests: Sequence[tuple[int, int, object]]) -> NvmeHandle:
        block, plan = self.block, []
        handle = NvmeHandle(batch=None)
        for offset, length, dest in requests:
            offset, length = check_range(self.source, self.size, offset, length)
            view = dest_view(dest, length)
            if length == 0:
                continue
            start = offset - offset % block
            end = -(-(offset + length) // block) * block
            if start == offset and end == offset + length and self._mapped_target(dest, view):
                plan.append((start // block, (end - start) // block, view))
                continue
            buf, at = self._bounce_region(end - start, handle)
            plan.append((start // block, (end - start) // block, buf.view()[at: at + end - start]))
            handle.copies.append((view, buf, at + offset - start, length))
        try:
            handle.batch = self.device.submit(plan)
        except Exception:
            self._finish(handle)
            raise
        return handle

    def wait(self, handle: NvmeHandle, timeout: float | None = None) -> bool:
        try:
            if not self.device.wait(handle.batch, timeout):
                return False
        except Exception:
            self._finish(handle)
            raise
        for view, buf, at, length in handle.copies:
            with buf.view() as src:
                view[:] = src[at: at + length]
        self._finish(handle)
        return True

    def _finish(self, handle: NvmeHandle) -> None:
        handle.copies.clear()
        for region in handle.regions:
            self._live.remove(region)
        handle.regions.clear()
        for spill in handle.spill:
            if not self.device.fenced:  # a fenced device may still write there: keep it
                spill.close()
        handle.spill.clear()

    def read_into(self, offset: int, length: int, dest) -> None:
        self.wait(self.submit([(offset, length, dest)]))

    def close(self) -> None:
        if self.device.closed:
            return
        if not self.device.fenced:
            self._bounce.close()
        if self._owns:
            self.device.close()

    def __enter__(self) -> NvmeReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
