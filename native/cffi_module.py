"""The shared half of the cffi builders under native/ (out-of-line API mode): the declarations
given to cffi are the block between `/* cdef-begin */` and `/* cdef-end */` of the module's
header (the header stays the one source of truth), and setuptools wants source paths relative
to the directory `setup.py` runs in."""

from __future__ import annotations

import os
import re

from cffi import FFI


def cdef_block(header: str) -> str:
    with open(header, encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", text, re.S)
    if match is None:
        raise RuntimeError(f"{os.path.basename(header)} lost its cdef markers")
    return re.sub(r"/\*.*?\*/", "", match.group(1), flags=re.S)


def module(name: str, here: str, header: str, sources: list[str], headers: list[str], cflags: list[str],
           **extra) -> FFI:
    """An FFI builder for module `name` from the C files in `here`."""
    def rel(path: str) -> str:
        return os.path.relpath(os.path.join(here, path), os.getcwd())

    ffi = FFI()
    ffi.cdef(cdef_block(os.path.join(here, header)))
    ffi.set_source(name, f'#include "{header}"\n', sources=[rel(s) for s in sources], include_dirs=[rel(".")],
                   extra_compile_args=cflags, depends=[rel(h) for h in headers], **extra)
    return ffi
