"""Which products the host sends to matvec_reg.cu (cuda_kernels.reg_shape), without a GPU: one
activation row of Q4_K or Q5_K weights of at most 16 passes of 2048 values, or of Q6_K weights of one or
two 2048-value groups (one warp a row: matvecf_q6_k's bits), and only in a
build with its decode (reg_build: not with NTX_REG=0, nor in the unit Q6_K decode build). The
GPU tests (test_reg_gpu.py) launch the shapes it returns: a block that is not whole teams of the
device's WK writes nothing, so a host/device mismatch fails there."""

from __future__ import annotations

import pytest

from ntx_engine.backends import cuda_kernels as ck
from ntx_engine.quants import GGMLType as T


@pytest.mark.parametrize("t", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 2048, 4096, 5120, 8192, 14336, 16384, 28672, 32768])
def test_every_row_width_up_to_16_passes_gets_whole_warps(t, k):
    ppw, wk = ck.reg_shape(t, k, 1)
    passes = -(-k // 2048)
    assert ppw in (1, 2) and 1 <= wk <= ck.REG_WARPS
    assert (wk - 1) * ppw < passes <= wk * ppw  # every pass has a warp, no warp is empty


def test_q6_k_rows_of_one_or_two_groups_take_one_warp():
    assert ck.reg_shape(T.Q6_K, 2048, 1) == ck.reg_shape(T.Q6_K, 4096, 1) == (2, 1)


@pytest.mark.parametrize("t,k,n", [(T.Q6_K, 6144, 1), (T.Q6_K, 14336, 1), (T.Q6_K, 2304, 1), (T.Q6_K, 4096, 2),
                                   (T.Q8_0, 4096, 1), (T.Q4_K, 4096, 2), (T.Q4_K, 4096, 8), (T.Q4_K, 34816, 1),
                                   (T.Q4_K, 65536, 1), (T.Q5_K, 4096, 8), (T.Q5_K, 34816, 1), (T.Q5_0, 4096, 1)])
def test_other_products_stay_on_the_dp4a_kernels(t, k, n):
    assert ck.reg_shape(t, k, n) is None


@pytest.mark.parametrize("defines,has", [("", True), ("-DNTX_PRE_WAIT=1", True), ("-DNTX_PRE_WAIT=1 -DNTX_REG=0", False),
                                         ("-DNTX_Q6_PAIR=0", False), ("-DNTX_REG=1", True)])
def test_builds_without_the_register_decode_launch_none_of_it(defines, has, monkeypatch):
    assert ck.reg_build(defines) is has
    monkeypatch.setenv("NTX_CUDA_DEFINES", defines)
    assert ck.reg_build() is has
    assert (ck.reg_shape(T.Q4_K, 4096, 1, ck.reg_build()) is not None) is has
