"""quants' "ggml" matmul mode against llama.cpp's own CPU kernels (ggml via ctypes).

llama.cpp's CPU mul_mat quantizes each activation row with the CPU traits' `from_float` for
the weight type's `vec_dot_type` and then calls `vec_dot` per weight row. We check
  1. quantize_blocks / quantize_activations reproduce ggml's quantized activations bit for bit
     (also the 4-row interleaved quantizers the repacked Q4_0/Q4_K/Q2_K GEMMs use);
  2. MatmulWeight.matmul(x, "ggml") matches vec_dot to float32 rounding;
  3. MatmulWeight.matmul(x, "exact") matches float64 numpy.

Tolerance for 2 and 3: |ours - ref| <= 8 units, one unit being eps32 * (sum_i |x_i (d q)_i|
+ sum_g |offset_g * sum_{i in g} x_i|), the size of the terms both sides add. The products are
exact in float32 for the legacy types and rounded once (Q8_K's f32 scale, K-quant d*sc*q) for
the K-quants, and the two sides add them in different orders (BLAS blocks vs ggml's 8-lane
SIMD accumulators and exact integer block sums), so they differ by a few float32 roundings.
Measured here (seeded data below): at most 3.5 units (Q6_K, k=512), most types below 2.2;
the float64 check of "exact" mode at most 1.9. The margin of 8 covers other BLAS builds'
summation orders. One activation rounded the wrong way would already cost ~1/254 of its own
term (about 10^5 units), and the negative control shows float32 activations miss llama.cpp by
325 (F16) to over 10^6 (Q4_0) units - so the test tells the schemes apart.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ntx_engine.matmul import MatmulWeight, quantize_activations, quantize_blocks
from ntx_engine.quants import GGML_BLOCK_SIZES, GGMLType, dequantize, quant_type

pytest.importorskip("llama_cpp", reason="llama-cpp-python ships the ggml oracle: install .[test]")
from ggml_ref import ggml, quantize_chunk  # noqa: E402

EPS = float(np.finfo(np.float32).eps)
TOL_UNITS = 8.0
WEIGHT_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def activations(n: int, k: int, seed: int, extremes: bool = False) -> np.ndarray:
    """Random rows plus the awkward cases: an all-zero block, exact .5 ties after scaling,
    a lone outlier, values on a coarse grid; with `extremes`, magnitudes whose fp16 scales
    underflow to zero or overflow to infinity (bytes still comparable, products not)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, k)) * 2).astype(np.float32)
    if n >= 4:
        x[0, :256] = 0
        x[1, :64] = np.float32(0.5) * (np.arange(64) - 32)
        x[2, 7] = 1000.0
        x[3] = np.round(x[3] * 4) / 4
    if extremes:
        x[-2] *= np.float32(1e-20)
        x[-1] *= np.float32(1e20)
    return x


# the `extremes` rows overflow fp16 scales on purpose, as they would in ggml
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("vdt", ["Q8_0", "Q8_1", "Q8_K"])
def test_quantize_blocks_match_ggml_from_float(vdt):
    x = activations(8, 2048, seed=1, extremes=True)
    ref = ggml().from_float(int(GGMLType[vdt]), x)
    ours = quantize_blocks(x, GGMLType[vdt]).reshape(len(x), -1)
    np.testing.assert_array_equal(ours, ref)


@settings(max_examples=400, deadline=None)
@given(x=arrays(np.float32, (2, 256), elements=st.floats(-1e4, 1e4, width=32)),
       scale=st.sampled_from([1.0, 1e-3, 1e-36, 1e-38, 1e-44]),
       vdt=st.sampled_from(["Q8_0", "Q8_1", "Q8_K"]))
def test_quantize_blocks_match_ggml_on_any_block(x, scale, vdt):
    # the small scales push whole blocks below ~3.7e-37, where 127/amax overflows float32
    x = (x * np.float32(scale)).astype(np.float32)
    ref = ggml().from_float(int(GGMLType[vdt]), x)
    np.testing.assert_array_equal(quantize_blocks(x, GGMLType[vdt]).reshape(2, -1), ref)


@pytest.mark.parametrize("vdt", ["Q8_0", "Q8_1", "Q8_K"])
def test_tiny_blocks_match_ggml_and_stay_finite(vdt):
    # |x| < 3.7e-37: 127/amax overflows float32 - ggml's bytes are still reproduced, and the
    # activations llama.cpp effectively uses are zeros, not NaN
    x = activations(2, 512, seed=5) * np.float32(1e-38)
    ref = ggml().from_float(int(GGMLType[vdt]), x)
    np.testing.assert_array_equal(quantize_blocks(x, GGMLType[vdt]).reshape(2, -1), ref)
    x_hat = quantize_activations(x, GGMLType[vdt])
    assert np.isfinite(x_hat).all() and not x_hat.any()


@pytest.mark.parametrize("vdt", ["Q8_0", "Q8_1", "Q8_K"])
def test_quantize_activations_are_ggml_blocks_dequantized(vdt):
    x = activations(8, 1024, seed=2, extremes=True)
    ref_blocks = ggml().from_float(int(GGMLType[vdt]), x)
    expected = dequantize(ref_blocks, GGMLType[vdt], x.shape)
    np.testing.assert_array_equal(quantize_activations(x, GGMLType[vdt]), expected)


@pytest.mark.parametrize("vdt", ["F16", "BF16"])
def test_float_activations_match_ggml_from_float(vdt):
    x = activations(8, 512, seed=3, extremes=True)
    ref = ggml().from_float(int(GGMLType[vdt]), x)
    ours = quantize_activations(x, GGMLType[vdt])
    np.testing.assert_array_equal(ours, dequantize(ref, GGMLType[vdt], x.shape))


@pytest.mark.parametrize("fn, vdt", [("ggml_quantize_mat_q8_0_4x8", "Q8_0"),
                                     ("ggml_quantize_mat_q8_K_4x8", "Q8_K")])
def test_repack_interleaved_quantizers_agree(fn, vdt):
    # Repacked Q4_0/Q4_K/Q2_K GEMMs quantize 4 rows at once into interleaved blocks
    # (block_q8_0x4 / block_q8_Kx4: 4 scales, then the rows' quants in 8-byte chunks taken
    # in turn): the scales and quants must equal the single-row ones we reproduce.
    x = activations(4, 1024, seed=4)
    bs, _ = GGML_BLOCK_SIZES[GGMLType[vdt]]
    nb, scale_bytes = 1024 // bs, 2 if vdt == "Q8_0" else 4
    per_block = 4 * scale_bytes + 4 * bs + (0 if vdt == "Q8_0" else 2 * 4 * bs // 16)
    out = np.zeros(nb * per_block, np.uint8)
    f = getattr(ggml().cpu, fn)
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    f(x.ctypes.data, out.ctypes.data, 1024)
    out = out.reshape(nb, per_block)
    scales = out[:, :4 * scale_bytes].copy().view("<f2" if vdt == "Q8_0" else "<f4")
    quants = out[:, 4 * scale_bytes:4 * scale_bytes + 4 * bs].copy().view(np.int8)
    quants = quants.reshape(nb, bs // 8, 4, 8).transpose(0, 2, 1, 3).reshape(nb, 4, bs)
    ours = quantize_blocks(x, GGMLType[vdt]).reshape(4, nb, -1).transpose(1, 0, 2)  # (nb, row, bytes)
    our_scales = ours[:, :, :scale_bytes].copy().view(scales.dtype)[..., 0]
    our_quants = ours[:, :, scale_bytes:scale_bytes + bs].copy().view(np.int8)
    np.testing.assert_array_equal(scales, our_scales)
    np.testing.assert_array_equal(quants, our_quants)


def test_vec_dot_types_match_ggml():
    for name in WEIGHT_TYPES:
        t = GGMLType[name]
        assert quant_type(t).vec_dot_type == ggml().vec_dot_type(int(t)), name


def _weight(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
    return quantize_chunk(ggml(), int(GGMLType[name]), w)  # realistic blocks from ggml itself


def _units(ours, ref, raw: np.ndarray, name: str, x: np.ndarray, x_mode: str) -> np.ndarray:
    """|ours - ref| in units of eps32 * (sum_i |x_i (d q)_i| + sum_g |offset_g * sum_g x|):
    the float32 rounding scale of the terms both sides add (ggml applies a min or dmin*m
    through the group sum of the activations - fp16 `s` of Q8_1, int16 bsums of Q8_K)."""
    qt = quant_type(GGMLType[name])
    rows = len(raw)
    scaled, offsets = qt.dequantize_parts(np.ascontiguousarray(raw).reshape(-1, qt.type_size))
    x_used = quantize_activations(x, qt.vec_dot_type) if x_mode == "ggml" else x
    scale = np.abs(x_used).astype(np.float64) @ np.abs(scaled.reshape(rows, -1)).T
    if offsets is not None:
        group = qt.block_size // offsets.shape[1]
        sums = np.abs(x_used.reshape(len(x), -1, group).sum(axis=2, dtype=np.float64))
        scale += sums @ np.abs(offsets.reshape(rows, -1)).T
    scale *= EPS
    diff = np.abs(ours.astype(np.float64) - ref)
    # an all-zero row has nothing to round: there only an exact zero passes
    return np.divide(diff, scale, out=np.where(diff > 0, np.inf, 0.0), where=scale > 0)


def _ks(name: str) -> list[int]:
    return [512, 4096] if GGML_BLOCK_SIZES[GGMLType[name]][0] == 256 else [512, 96]


@pytest.mark.parametrize("name", WEIGHT_TYPES)
def test_ggml_mode_matches_vec_dot(name):
    for k in _ks(name):
        raw = _weight(name, 24, k, seed=k)
        w = MatmulWeight.from_raw(raw, GGMLType[name], (24, k), f"w.{name}")
        x = activations(6, k, seed=k + 1)
        ref = ggml().matmul(int(GGMLType[name]), raw, x)
        ours = w.matmul(x, "ggml")
        assert ours.dtype == np.float32 and ours.shape == (6, 24)
        units = _units(ours, ref, raw, name, x, "ggml")
        assert units.max() <= TOL_UNITS, f"{name} k={k}: {units.max():.2f} units"
        if w.vec_dot_type != GGMLType.F32:
            # negative control: float32 activations are measurably not what llama.cpp computes
            exact_units = _units(w.matmul(x, "exact"), ref, raw, name, x, "ggml")
            assert exact_units.max() > 10 * TOL_UNITS, f"{name}: control did not discriminate"


@pytest.mark.parametrize("name", WEIGHT_TYPES)
def test_exact_mode_matches_float64(name):
    k = _ks(name)[0]
    raw = _weight(name, 16, k, seed=7)
    w = MatmulWeight.from_raw(raw, GGMLType[name], (16, k), "w")
    x = activations(5, k, seed=8)
    full = dequantize(raw, GGMLType[name], (16, k)).astype(np.float64)
    ref = x.astype(np.float64) @ full.T
    assert _units(w.matmul(x, "exact"), ref, raw, name, x, "exact").max() <= TOL_UNITS


@pytest.mark.parametrize("name", WEIGHT_TYPES)
def test_rows_are_ggml_dequantized_rows(name):
    raw = _weight(name, 12, 512, seed=9)
    w = MatmulWeight.from_raw(raw, GGMLType[name], (12, 512), "emb")
    ids = np.array([3, 0, 11, 3])
    expected = ggml().to_float(int(GGMLType[name]), raw[ids], len(ids) * 512).reshape(4, 512)
    np.testing.assert_array_equal(w.rows(ids), expected)


def test_real_tensor_matches_llama_cpp(smollm2_path):
    # SmolLM2's ffn_down is Q4_1 with k = 1536 (48 blocks): llama.cpp's Q8_1 path end to end
    from ntx_engine.gguf import GGUFFile

    with GGUFFile.open(smollm2_path) as f:
        info = f.tensors["blk.0.ffn_down.weight"]
        raw = np.asarray(f.tensor_data(info.name)).reshape(info.shape[0], -1)
        w = MatmulWeight.from_raw(raw, info.ggml_type, info.shape, info.name)
    x = activations(2, info.shape[1], seed=10)
    ref = ggml().matmul(int(info.ggml_type), raw, x)
    assert _units(w.matmul(x), ref, raw, info.ggml_type.name, x, "ggml").max() <= TOL_UNITS


def test_matmul_rejects_bad_input():
    raw = _weight("Q8_0", 4, 64, seed=11)
    w = MatmulWeight.from_raw(raw, GGMLType.Q8_0, (4, 64), "w")
    with pytest.raises(ValueError, match="cannot multiply"):
        w.matmul(np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="mode"):
        w.matmul(np.zeros((2, 64), np.float32), mode="fast")
