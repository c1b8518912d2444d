"""Host buffers for the pipeline: pinned RAM-tier layers and storage staging.

With the VFIO reader the buffer must be a hugepage `PinnedBuffer` DMA-mapped into the reader;
for the GPU it is page-locked for CUDA too (`cuMemHostRegister`) so copies run at full PCIe
speed; the numpy backend uses plain arrays."""

from __future__ import annotations

import numpy as np

from ntx_io.buffers import PinnedBuffer


def host_buffer(nbytes: int, reader=None, *, cuda: bool, device: int = 0, numa_nodes: list[int] | None = None):
    """A buffer of at least nbytes: a PinnedBuffer (VFIO reader or CUDA) or a numpy array.
    numa_nodes: its pages interleaved over these nodes (ntx_io.numa), set before any is touched."""
    huge = reader is not None and getattr(reader, "needs_hugepages", False)
    dma = reader is not None and getattr(reader, "name", "") == "vfio"  # zero copy: DMA lands here
    if not (huge or dma or cuda):
        arr = np.empty(nbytes, np.uint8)  # large: fresh untouched pages, so the policy applies
        if numa_nodes is not None:
            from ntx_io import numa

            numa.interleave(arr.ctypes.data, nbytes, numa_nodes)
        return arr
    # cuMemHostRegister page-locks by itself: mlock (and its RLIMIT_MEMLOCK) only without CUDA
    buf = PinnedBuffer(nbytes, hugepages=True if huge else None, lock=not cuda, numa_nodes=numa_nodes)
    if reader is not None:
        reader.register(buf)
    if cuda:
        buf.register_cuda(device)
    return buf


def host_view(buf) -> np.ndarray:
    return buf.numpy() if isinstance(buf, PinnedBuffer) else buf
