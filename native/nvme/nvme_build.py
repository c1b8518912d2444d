"""cffi builder (out-of-line API mode) for the userspace NVMe driver: `ntx_io._nvme`.

Built at install time through `setup.py` (`cffi_modules=["native/nvme/nvme_build.py:ffibuilder"]`): `pip install -e .`
rebuilds `ntx_io/_nvme.abi3.so` in place after a change to the C sources. The declarations given
to cffi are the block between the cdef markers of `nvme.h`, so the header is the only source
of truth for the API. cffi releases the GIL around every call, so polling in
`ntx_nvme_batch_wait` does not stop other Python threads.
"""

from __future__ import annotations

import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["nvme_dev.c", "nvme_ctrl.c", "nvme_io.c", "nvme_vfio.c"]
CFLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"]


def _cdef_block() -> str:
    with open(os.path.join(HERE, "nvme.h"), encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", text, re.S)
    if match is None:
        raise RuntimeError("nvme.h lost its cdef markers")
    return re.sub(r"/\*.*?\*/", "", match.group(1), flags=re.S)


def _rel(path: str) -> str:
    # setuptools wants sources relative to the directory setup.py runs in
    return os.path.relpath(path, os.getcwd())


ffibuilder = FFI()
ffibuilder.cdef(_cdef_block())
ffibuilder.set_source(
    "ntx_io._nvme",
    '#include "nvme.h"\n',
    sources=[_rel(os.path.join(HERE, s)) for s in SOURCES],
    include_dirs=[_rel(HERE)],
    extra_compile_args=CFLAGS,
    depends=[_rel(os.path.join(HERE, h)) for h in ("nvme.h", "nvme_impl.h", "nvme_spec.h")],
)
