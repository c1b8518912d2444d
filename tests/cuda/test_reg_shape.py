"""Which products the host sends to matvec_reg.cu (cuda_kernels.reg_shape), without a GPU: one
activation row of Q4_K weights only, rows of at most 16 passes of 2048 values, and NTX_REG=0 in
NTX_CUDA_DEFINES turning it off. The GPU tests (test_reg_gpu.py) launch the shapes it returns: a
block that is not whole teams of the device's WK writes nothing, so a host/device mismatch fails there."""

from __future__ import annotations

import pytest

from ntx_engine.backends import cuda_kernels as ck
from ntx_engine.quants import GGMLType as T


@pytest.mark.parametrize("k", [256, 2048, 4096, 5120, 8192, 14336, 16384, 28672, 32768])
def test_every_row_width_up_to_16_passes_gets_whole_warps(k, monkeypatch):
    monkeypatch.delenv("NTX_CUDA_DEFINES", raising=False)
    ppw, wk = ck.reg_shape(T.Q4_K, k, 1)
    passes = -(-k // 2048)
    assert ppw in (1, 2) and 1 <= wk <= ck.REG_WARPS
    assert (wk - 1) * ppw < passes <= wk * ppw  # every pass has a warp, no warp is empty


@pytest.mark.parametrize("t,k,n", [(T.Q6_K, 4096, 1), (T.Q8_0, 4096, 1), (T.Q4_K, 4096, 2), (T.Q4_K, 4096, 8),
                                   (T.Q4_K, 34816, 1), (T.Q4_K, 65536, 1)])
def test_other_products_stay_on_the_dp4a_kernels(t, k, n, monkeypatch):
    monkeypatch.delenv("NTX_CUDA_DEFINES", raising=False)
    assert ck.reg_shape(t, k, n) is None


def test_ntx_reg_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("NTX_CUDA_DEFINES", "-DNTX_PRE_WAIT=1 -DNTX_REG=0")
    assert ck.reg_shape(T.Q4_K, 4096, 1) is None
    assert ck.Kernels.swiglu_fusable(T.Q4_K, T.Q4_K, 4096, 1)
    monkeypatch.setenv("NTX_CUDA_DEFINES", "-DNTX_PRE_WAIT=1")
    assert ck.reg_shape(T.Q4_K, 4096, 1) == (2, 1)
    assert not ck.Kernels.swiglu_fusable(T.Q4_K, T.Q6_K, 4096, 1)  # gate on matvec_reg.cu, up not
