"""ntx_io: storage -> page-locked host buffers.

The userspace NVMe driver over VFIO (`NvmeDevice`), O_DIRECT and mmap readers behind one
`Reader` protocol (`open_reader`), pinned/hugepage/CUDA-registered buffers (`PinnedBuffer`),
and raw-device model images (`ImageHeader`, `read_header`). Imports neither `ntx_engine` nor
numpy at import time (the VM guest runs this package).
"""

from ntx_io.buffers import PinnedBuffer
from ntx_io.image import ImageHeader, read_header
from ntx_io.nvme import NvmeDevice, NvmeIdentity
from ntx_io.reader import Reader, open_reader

__all__ = ["ImageHeader", "NvmeDevice", "NvmeIdentity", "PinnedBuffer", "Reader", "open_reader", "read_header"]
