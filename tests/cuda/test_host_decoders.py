"""The kernels' block decoders and activation quantizers, built for the host, against the
numpy codecs of ntx_engine.quants (themselves checked against gguf-py and ggml): bit-exact."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine import matmul, quants
from ntx_engine.quants import GGMLType

TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
         GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K,
         GGMLType.Q6_K]


def _add_mins(w: np.ndarray, mins: np.ndarray, block: int) -> np.ndarray:
    """The kernels keep Q4_1/Q5_1 minimums apart (0 for other types); add them back."""
    if block == 1:
        return w
    return (w.reshape(len(mins), -1) + mins[:, None]).reshape(-1)


def _bad_block(a: np.ndarray, b: np.ndarray, block: int) -> str:
    diff = np.abs(a.reshape(-1, block) - b.reshape(-1, block)).max(axis=1)
    worst = int(np.argmax(diff))
    return f"worst block {worst}: max |diff| {diff[worst]:.3g}, {int((diff > 0).sum())} blocks differ"


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_block_decoder_matches_numpy(host_check, synth, t):
    rng = np.random.default_rng(int(t) + 100)
    n = 256 * 37
    blocks = synth.random_blocks(t, n, rng)
    if t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):  # also fully random bits
        blocks[::3] = np.frombuffer(rng.bytes(blocks[::3].size), np.uint8).reshape(blocks[::3].shape)
    qt = quants.quant_type(t)
    raw = np.ascontiguousarray(blocks.reshape(-1, qt.type_size))
    nunits32 = n // 32
    w = np.full(n, np.nan, np.float32)
    mins = np.full(len(raw), np.nan, np.float32)
    unit_blocks = len(raw) if qt.block_size > 1 else nunits32
    assert host_check.ntx_host_deq(int(t), raw, unit_blocks, w, mins.ctypes.data) == 0
    with np.errstate(invalid="ignore"):
        w = _add_mins(w, mins, qt.block_size)
    with np.errstate(all="ignore"):  # random bits include inf/NaN scales: both sides alike
        ref = qt.dequantize_blocks(raw)
    same = (w == ref) | (np.isnan(w) & np.isnan(ref))
    assert same.all(), _bad_block(np.nan_to_num(w), np.nan_to_num(ref), 32)


@pytest.mark.parametrize("vdt", [GGMLType.Q8_0, GGMLType.Q8_1, GGMLType.Q8_K, GGMLType.F16, GGMLType.BF16],
                         ids=lambda t: t.name)
def test_activation_quantization_matches_numpy(host_check, vdt):
    rng = np.random.default_rng(int(vdt))
    x = (rng.standard_normal((3, 1024)) * rng.uniform(0.01, 50, (3, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: d = 0
    x[1, 5] = -x[1, :256].__abs__().max() * 1.0  # a tie in magnitude (first index wins for Q8_K)
    x[1, 7] = -x[1, 5]
    x[2, 256:512] *= np.float32(1e-38)  # 127/amax overflows: ggml quantizes the block to zeros
    ref = matmul.quantize_activations(x, vdt)
    if vdt == GGMLType.Q8_1:  # s = fp16(d * sum(q)): bytes 2..3 of each block ggml writes
        ref_s = matmul.quantize_blocks(x, vdt)[:, 2:4].copy().view("<f2").astype(np.float32)
    out = np.full_like(x, np.nan)
    if vdt in (GGMLType.Q8_0, GGMLType.Q8_1):
        s = np.full(x.size // 32, np.nan, np.float32)
        host_check.ntx_host_q8(x.reshape(-1), out.reshape(-1), s.ctypes.data if vdt == GGMLType.Q8_1 else None,
                               x.size // 32)
        if vdt == GGMLType.Q8_1:
            assert np.array_equal(s, ref_s.reshape(-1))
    elif vdt == GGMLType.Q8_K:
        host_check.ntx_host_q8k(x.reshape(-1), out.reshape(-1), x.size // 256)
    else:
        host_check.ntx_host_round(x.reshape(-1), out.reshape(-1), x.size, int(vdt == GGMLType.BF16))
    assert np.array_equal(out, ref), _bad_block(out, ref, 32)  # also no NaN where ggml gives 0


def test_f16_rounding_matches_numpy_on_edge_values(host_check):
    rng = np.random.default_rng(7)
    edges = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e6, 6.1035156e-05, 6.0e-05, 5.96e-08, 2.98e-08,
                      2.9802322e-08, 1e-9, np.inf, -np.inf], np.float32)
    x = np.concatenate([edges, rng.standard_normal(100000).astype(np.float32) * 1e-4,
                        rng.standard_normal(100000).astype(np.float32) * 1e4,
                        rng.integers(0, 2**32, 100000, dtype=np.uint32).view(np.float32)])
    x = x[np.isfinite(x) | np.isinf(x)]
    out = np.empty_like(x)
    host_check.ntx_host_round(x, out, x.size, 0)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(out, ref, equal_nan=True)
