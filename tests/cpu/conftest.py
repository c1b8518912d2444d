"""Fixtures for the native CPU kernel tests: one kernel pool per module, the SIMD levels this
CPU can run (the portable path always, so CI exercises the fallback on every machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # ggml_ref: llama.cpp's ggml

from ntx_engine.backends.cpu_kernels import BEST_SIMD as BEST
from ntx_engine.backends.cpu_kernels import SIMD_NAMES

LEVELS = list(SIMD_NAMES.values())


@pytest.fixture(scope="module")
def kernels():
    """A 2-thread pool (threads over rows are exercised even on one core); missing = failure."""
    from ntx_engine.backends.cpu_kernels import CpuKernels, load_module

    if load_module() is None:
        pytest.fail("ntx_engine._cpu is not built: run `pip install -e .` (make test does)", pytrace=False)
    k = CpuKernels(threads=2)
    yield k
    k.select_simd(BEST)  # back to the best level for the next module
    k.close()


@pytest.fixture(params=LEVELS)
def simd(request, kernels):
    """Each SIMD level in turn (skipped only where this CPU lacks it); restores the best after."""
    if LEVELS.index(request.param) > LEVELS.index(kernels.supported_simd()):
        pytest.skip(f"this CPU has no {request.param} (best: {kernels.supported_simd()})")
    assert kernels.select_simd(request.param) == request.param
    yield request.param
    kernels.select_simd(BEST)
