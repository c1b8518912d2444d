"""cffi builder (out-of-line API mode) for the userspace NVMe driver: `ntx_io._nvme`.

Built at install time through `setup.py` (`cffi_modules=["native/nvme/nvme_build.py:ffibuilder"]`): `pip install -e .`
rebuilds `ntx_io/_nvme.abi3.so` in place after a change to the C sources. The declarations given
to cffi are the block between the cdef markers of `nvme.h`, so the header is the only source
of truth for the API. cffi releases the GIL around every call, so polling in
`ntx_nvme_batch_wait` does not stop other Python threads.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cffi_module import module  # noqa: E402  native/cffi_module.py, shared with the CPU kernels

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["nvme_dev.c", "nvme_ctrl.c", "nvme_io.c", "nvme_vfio.c"]
CFLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"]

ffibuilder = module("ntx_io._nvme", HERE, "nvme.h", SOURCES, ["nvme.h", "nvme_impl.h", "nvme_spec.h"], CFLAGS)
