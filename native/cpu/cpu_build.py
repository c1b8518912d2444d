"""cffi builder (out-of-line API mode) for the native CPU kernels: `ntx_engine._cpu`.

Built at install time through `setup.py` (`cffi_modules` lists this file next to the NVMe
driver's); `pip install -e .` rebuilds `ntx_engine/_cpu.abi3.so` after a change to the C
sources. The declarations given to cffi are the block between the cdef markers of `ntx_cpu.h`.
cffi releases the GIL around every call, so a matmul on the pool's threads runs while other
Python threads (the streaming pipeline's readers) keep going.

The x86 SIMD kernels are compiled with `#pragma GCC target` in their own files, so the module
itself needs no -m flags and runs on any x86-64; CPUID picks the kernel table at run time.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cffi_module import module  # noqa: E402  native/cffi_module.py, shared with the NVMe driver

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["cpu_pool.c", "cpu_act.c", "cpu_dot.c", "cpu_dot_avx2.c", "cpu_dot_vnni.c",
           "cpu_dot_avx512.c", "cpu_matmul.c", "cpu_ops.c", "cpu_layer.c"]
HEADERS = ["ntx_cpu.h", "cpu_impl.h", "cpu_dot_x86.inc", "cpu_dot_x86_rows.inc"]
# -ffp-contract=off: float expressions round exactly as written (the numpy oracle never fuses)
CFLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden", "-ffp-contract=off",
          "-pthread"]


ffibuilder = module("ntx_engine._cpu", HERE, "ntx_cpu.h", SOURCES, HEADERS, CFLAGS,
                    extra_link_args=["-pthread"], libraries=["m"])
