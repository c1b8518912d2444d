"""The native quantized matmul against the numpy backend's ggml mode (the oracle), every type,
odd shapes, every SIMD level, outputs poisoned with NaN first; and its activation quantizer
byte for byte against matmul.py's and ggml's own.

Tolerance, measured rather than guessed: both engines compute the same exact products (int8
activations times the weight's integers, per block), so they differ only in the order float32
adds the block terms. For a dot product sum_i a_i that noise is a few ulps of sum_i |a_i|; the
bound used is TOL_ULPS * eps32 * (|x_hat| @ |W|^T) per output. ggml's own vec_dot (llama.cpp's
shipped CPU kernels) is held to the same bound on the same data, so the tolerance is one the
reference implementation itself needs, and the measured ratios are printed at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

from ggml_ref import ggml, quantize_chunk
from make_synthetic_model import random_blocks

from ntx_engine import matmul, quants
from ntx_engine.backends.cpu_kernels import BEST_SIMD as BEST
from ntx_engine.backends.cpu_kernels import SIMD_NAMES
from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.quants import GGMLType as T

TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
         T.Q5_K, T.Q6_K]
EPS = float(np.finfo(np.float32).eps)
TOL_ULPS = 4.0
LEVELS = list(SIMD_NAMES.values())  # portable, avx2, avx512vnni: each includes the one before
MEASURED: dict[str, float] = {}


def _k_for(t: T) -> int:
    block = quants.GGML_BLOCK_SIZES[t][0]
    return {1: 291, 32: 32 * 9, 256: 256 * 3}[block]  # odd float widths exercise the SIMD tails


def _weights(t: T, source: str, rows: int, k: int, rng) -> np.ndarray:
    if source == "ggml":  # blocks llama.cpp's quantizer writes for a smooth matrix
        return quantize_chunk(ggml(), int(t), rng.standard_normal((rows, k)).astype(np.float32)).reshape(-1)
    return random_blocks(t, rows * k, rng).reshape(-1)  # every bit pattern of scales and quants


def _bound(t: T, raw: np.ndarray, x: np.ndarray, rows: int, k: int) -> np.ndarray:
    w = np.abs(quants.dequantize(raw, t, (rows, k)))
    x_hat = np.abs(matmul.quantize_activations(x, quants.quant_type(t).vec_dot_type))
    return TOL_ULPS * EPS * (x_hat.astype(np.float64) @ w.T.astype(np.float64)) + 1e-30


def bad_block_report(ours: np.ndarray, ref: np.ndarray, bound: np.ndarray, raw: np.ndarray,
                     row_bytes: int, top: int = 5) -> str:
    """The worst outputs (token, row) with the first bytes of their weight row: where to look."""
    ratio = np.abs(ours - ref) / bound
    order = np.argsort(np.nan_to_num(ratio, nan=np.inf).reshape(-1))[::-1][:top]
    lines = []
    for flat in order:
        t, r = divmod(int(flat), ours.shape[1])
        head = raw[r * row_bytes:r * row_bytes + 16].tobytes().hex()
        lines.append(f"token {t} row {r}: ours {ours[t, r]!r} numpy {ref[t, r]!r} "
                     f"= {ratio[t, r]:.2f} x tolerance; row bytes {head}...")
    return "\n".join(lines)


@pytest.mark.parametrize("source", ["ggml", "random"])
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_matches_numpy_ggml_mode(kernels, simd, t, n, source):
    rng = np.random.default_rng(100 * int(t) + n)
    rows, k = 37, _k_for(t)
    raw = _weights(t, source, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ref = NumpyBackend().matrix(raw, t, (rows, k), "w").matmul(x, "ggml")
    out = np.full((n, rows), np.nan, np.float32)
    kernels.matmul(t, raw, rows, k, x, "w", out=out)
    bound = _bound(t, raw, x, rows, k)
    ratio = float(np.nanmax(np.abs(out - ref) / bound)) if np.isfinite(out).all() else np.inf
    MEASURED[f"{t.name} {simd}"] = max(MEASURED.get(f"{t.name} {simd}", 0.0), ratio)
    assert np.isfinite(out).all(), f"{int((~np.isfinite(out)).sum())} outputs unwritten or not finite"
    assert ratio <= 1.0, bad_block_report(out, ref, bound, raw, raw.size // rows)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_ggml_itself_needs_the_same_tolerance(kernels, t):
    """ggml's vec_dot against the numpy oracle on the same data: the bound admits it, and the
    native kernels (best SIMD level) stay within a small factor of ggml's own distance."""
    g, rng = ggml(), np.random.default_rng(7 + int(t))
    rows, k = 37, _k_for(t)
    raw = _weights(t, "ggml", rows, k, rng).reshape(rows, -1)
    x = rng.standard_normal((2, k)).astype(np.float32)
    ref = NumpyBackend().matrix(raw.reshape(-1), t, (rows, k), "w").matmul(x, "ggml")
    theirs = g.matmul(int(t), raw, x)
    ours = kernels.matmul(t, raw.reshape(-1), rows, k, x)
    bound = _bound(t, raw.reshape(-1), x, rows, k)
    r_ggml = float((np.abs(theirs - ref) / bound).max())
    r_ours = float((np.abs(ours - ref) / bound).max())
    MEASURED[f"{t.name} ggml"] = r_ggml
    assert r_ggml <= 1.0, f"ggml itself is {r_ggml:.2f} x the tolerance from numpy: the bound is too tight"
    assert r_ours <= 1.0


def test_report_measured_ratios(record_measurement):
    """Runs last in this module: the worst |ours - numpy| / tolerance per type and path."""
    for key, ratio in sorted(MEASURED.items()):
        record_measurement({"test": "cpu-matmul-noise", "case": key, "max_err_over_tol": f"{ratio:.3f}"})
    assert MEASURED, "the matmul tests did not run"


EDGE_ROWS = {
    "zeros": np.zeros(256, np.float32),
    "tiny": np.full(256, 1e-38, np.float32),  # 127/amax overflows: ggml's INT_MIN path
    "ties": (np.arange(256, dtype=np.float32) - 128) * np.float32(0.5),  # many x.5 after scaling
    "huge": np.linspace(-3e38, 3e38, 256, dtype=np.float32),
    "one-hot": np.eye(1, 256, 77, dtype=np.float32)[0] * -5,
}


@pytest.mark.parametrize("weight_type", [T.Q4_0, T.Q4_1, T.Q6_K], ids=["Q8_0", "Q8_1", "Q8_K"])
def test_activation_quantizer_is_bit_identical(kernels, weight_type):
    act = quants.quant_type(weight_type).vec_dot_type
    rng = np.random.default_rng(int(act))
    x = np.concatenate([np.stack(list(EDGE_ROWS.values())),
                        rng.standard_normal((6, 256)).astype(np.float32) * np.float32(10) ** rng.integers(-6, 6, (6, 1))])
    ours = kernels.quantize_act(weight_type, x.astype(np.float32))
    python = matmul.quantize_blocks(x, act).reshape(len(x), -1)
    theirs = ggml().from_float(int(act), x)
    for name, i in zip([*EDGE_ROWS, *(f"random {j}" for j in range(6))], range(len(x))):
        assert ours[i].tobytes() == python[i].tobytes(), f"{act.name} row {name}: differs from matmul.py"
        assert ours[i].tobytes() == theirs[i].tobytes(), f"{act.name} row {name}: differs from ggml"


def _as_f32(weight_type, raw: np.ndarray) -> np.ndarray:
    """The activation bytes as float32: F16/BF16 rows are stored in that type, 2 bytes a value."""
    if weight_type == T.F16:
        return raw.view(np.float16).astype(np.float32)
    if weight_type == T.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.float32)


@pytest.mark.parametrize("weight_type", [T.F16, T.BF16, T.F32])
def test_float_activations_rounded_like_ggml(kernels, weight_type):
    x = np.concatenate([np.stack(list(EDGE_ROWS.values())),
                        np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)])
    raw = kernels.quantize_act(weight_type, x)
    assert raw.shape == (len(x), 256 * (4 if weight_type == T.F32 else 2))
    want = matmul.quantize_activations(x, weight_type)
    assert _as_f32(weight_type, raw).tobytes() == want.tobytes()
    if weight_type != T.F32:  # the very bytes ggml's from_float writes for this vec_dot_type
        assert raw.tobytes() == ggml().from_float(int(weight_type), x).tobytes()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_simd_and_portable_paths_agree(kernels, t):
    """Every SIMD table this CPU has against the portable C on the same random blocks."""
    rng = np.random.default_rng(55 + int(t))
    rows, k = 29, _k_for(t)
    raw = _weights(t, "random", rows, k, rng)
    x = rng.standard_normal((5, k)).astype(np.float32)
    bound = _bound(t, raw, x, rows, k)
    kernels.select_simd("portable")
    base = kernels.matmul(t, raw, rows, k, x)
    try:
        for level in LEVELS[1:LEVELS.index(kernels.supported_simd()) + 1]:
            kernels.select_simd(level)
            other = kernels.matmul(t, raw, rows, k, x)
            assert (np.abs(other - base) <= bound).all(), f"{level} vs portable:\n" + \
                bad_block_report(other, base, bound, raw, raw.size // rows)
    finally:
        kernels.select_simd(BEST)


def test_env_var_forces_the_portable_path():
    """NTX_CPU_SIMD=portable is how CI runs the fallback kernels on a SIMD-capable machine."""
    import os
    import subprocess
    import sys

    code = "from ntx_engine.backends.cpu_kernels import CpuKernels; print(CpuKernels(1).simd)"
    env = dict(os.environ, NTX_CPU_SIMD="portable")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "portable"


def test_thread_count_does_not_change_a_bit(kernels):
    """Rows are split over threads but each row is one thread's sum: 1 and 3 threads agree exactly."""
    from ntx_engine.backends.cpu_kernels import CpuKernels

    rng = np.random.default_rng(9)
    rows, k = 1001, 256 * 2
    raw = _weights(T.Q4_K, "random", rows, k, rng)
    x = rng.standard_normal((4, k)).astype(np.float32)
    one, three = CpuKernels(threads=1), CpuKernels(threads=3)
    try:
        assert one.matmul(T.Q4_K, raw, rows, k, x).tobytes() == three.matmul(T.Q4_K, raw, rows, k, x).tobytes()
    finally:
        one.close()
        three.close()


def test_wrong_sizes_are_refused_before_c_reads_them(kernels):
    raw = np.zeros(18 * 4, np.uint8)  # 4 Q4_0 blocks
    with pytest.raises(ValueError, match="bytes are not"):
        kernels.matmul(T.Q4_0, raw, 2, 96, np.zeros((1, 96), np.float32))
    with pytest.raises(ValueError, match="cannot multiply"):
        kernels.matmul(T.Q4_0, raw, 2, 64, np.zeros((1, 32), np.float32))
