"""Multi-row matmul (prefill chunks, the speculative verify pass) against the one-row path.

Every kernel table (portable C, avx2, avx512vnni, avx512) has a multi-row kernel (`dotn`) for
every weight type: it reads each weight block once for up to 8 activation rows. A row's value
must not depend on how many rows shared the pass, so every oracle test of the one-row dot keeps
its meaning. Checked bit for bit, for every type and every SIMD level this CPU has, for
n = 1..17 (every row count of a pass, two full 8-row groups and a remainder), on matmul,
matmul_many and the fused gate/up SwiGLU. The one-row reference is the same C entry point called with n = 1.
"""

from __future__ import annotations

import numpy as np
import pytest

from make_synthetic_model import random_blocks

from ntx_engine import quants
from ntx_engine.quants import GGMLType as T

TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
         T.Q5_K, T.Q6_K]


def _k_for(t: T) -> int:
    block = quants.GGML_BLOCK_SIZES[t][0]
    return {1: 291, 32: 32 * 9, 256: 256 * 3}[block]  # odd block counts: the kernels' tails


def _one_by_one(fn, x: np.ndarray) -> np.ndarray:
    return np.concatenate([fn(x[i:i + 1]) for i in range(len(x))])


def _diff(a: np.ndarray, b: np.ndarray) -> str:
    bad = np.argwhere(a.view(np.uint32) != b.view(np.uint32))
    t, r = bad[0]
    return f"{len(bad)} outputs differ, first (row {t}, col {r}): {a[t, r]!r} vs one-row {b[t, r]!r}"


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_every_type_has_a_multi_row_kernel(kernels, simd, t):
    """No type on any level goes row by row (else the tests below would compare that loop with
    itself and an 8-row pass would read the weights 8 times)."""
    assert kernels.has_multi_row(t), f"{t.name} has no multi-row kernel on {simd}"


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_n_rows_equal_one_row_bit_for_bit(kernels, simd, t):
    assert kernels.has_multi_row(t)
    rng = np.random.default_rng(300 + int(t))
    rows, k = 13, _k_for(t)
    w = kernels.weight(t, random_blocks(t, rows * k, rng).reshape(-1), rows, k, "w")
    x = rng.standard_normal((17, k)).astype(np.float32)
    single = _one_by_one(lambda r: kernels.matmul_w(w, r), x)
    for n in range(1, 18):
        got = kernels.matmul_w(w, x[:n])
        assert got.tobytes() == single[:n].tobytes(), f"n={n}: " + _diff(got, single[:n])


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_many_and_swiglu_n_rows_equal_one_row(kernels, simd, t):
    """The fused entry points take the same multi-row path: q/k/v of mixed types, gate/up."""
    rng = np.random.default_rng(400 + int(t))
    k = 256 * 3  # one width every type of the mix takes
    mix = [t, T.Q6_K, T.Q4_K]  # Q4_K_M puts Q6_K on attn_v: parts of one pass differ in type
    ws = [kernels.weight(ty, random_blocks(ty, r * k, rng).reshape(-1), r, k, f"w{i}")
          for i, (ty, r) in enumerate(zip(mix, (11, 5, 7)))]
    gate, up = (kernels.weight(t, random_blocks(t, 17 * k, rng).reshape(-1), 17, k, n) for n in ("g", "u"))
    x = rng.standard_normal((11, k)).astype(np.float32)  # one full 8-row group and a remainder
    many = kernels.matmul_many(ws, x)
    for i, w in enumerate(ws):
        single = _one_by_one(lambda r: kernels.matmul_w(w, r), x)
        assert many[i].tobytes() == single.tobytes(), f"matmul_many part {i}: " + _diff(many[i], single)
    fused = kernels.matmul_swiglu(gate, up, x)
    single = _one_by_one(lambda r: kernels.matmul_swiglu(gate, up, r), x)
    assert fused.tobytes() == single.tobytes(), "swiglu: " + _diff(fused, single)


def test_unknown_type_has_no_multi_row_kernel(kernels):
    """The table lookup answers per type: Q8_K (an activation format) is no weight type."""
    assert not kernels.has_multi_row(T.Q8_K)
