"""The prefill GEMM (dequant.cu + cuBLAS, default for matmuls of >= GEMM_MIN_TOKENS rows) against
an oracle built in numpy from the numpy backend's own decoder: the weight decoded by
`quants.dequantize` and rounded to fp16, the activations rounded to fp16 after the per-row
power-of-two scale, the product in float64. What is left is fp32 accumulation order, so the
tolerance is tight; a wrong block decoder, slab offset or row scale is off by O(1). The output
is poisoned with NaN first, so a row or token left unwritten fails."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine import quants
from ntx_engine.quants import GGMLType

pytestmark = pytest.mark.gpu


def _oracle(raw, t, rows, k, x) -> np.ndarray:
    w = quants.dequantize(raw, t, (rows, k)).astype(np.float16).astype(np.float64)
    amax = np.abs(x).max(axis=1)
    s = np.ones(len(x))
    while (big := np.isfinite(amax) & (amax / s >= 32768)).any():
        s[big] *= 2
    xh = (x / s[:, None].astype(np.float32)).astype(np.float16).astype(np.float64)
    return (xh @ w.T) * s[:, None]


def _gemm_backend(slab_rows: int | None, k: int, monkeypatch=None):
    from ntx_engine.backends import cuda_backend

    if slab_rows is not None:  # a small slab: the weight is decoded and multiplied in pieces
        monkeypatch.setattr(cuda_backend, "GEMM_SLAB_BYTES", slab_rows * k * 2)
    return cuda_backend.CudaBackend(gemm="1")


@pytest.mark.parametrize("n", [32, 77, 256])
@pytest.mark.parametrize("rows,k,slab_rows", [(67, 4096, None), (130, 2304, 48)])
@pytest.mark.parametrize("t", sorted(__import__("ntx_engine.backends.cuda_backend", fromlist=["GEMM_TYPES"]).GEMM_TYPES),
                         ids=lambda t: t.name)
def test_gemm_matches_fp16_oracle(cuda_backend, synth, monkeypatch, t, rows, k, slab_rows, n):
    rng = np.random.default_rng(7000 + rows + n + int(t))
    raw = synth.random_blocks(t, rows * k, rng)
    x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10, k)).astype(np.float32)
    x[n // 2, :7] *= 30000.0  # one token far beyond fp16's range: its row must be scaled
    b = _gemm_backend(slab_rows, k, monkeypatch)
    w = b.matrix(raw, t, (rows, k), "w")
    b.k.profile = []
    got = b.to_numpy(b.matmul(w, b.from_numpy(x)))
    names = [name for name, *_ in b.k.profile]
    b.k.profile = None
    assert "to_f16_rows" in names and not any(nm.startswith(("matvec", "mmq")) for nm in names), names
    if t != GGMLType.F16:
        pieces = 1 if slab_rows is None else -(-rows // slab_rows)
        assert names.count(f"dequant_f16_{t.name.lower()}") == pieces
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} outputs unwritten or not finite"
    ref = _oracle(raw, t, rows, k, x)
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)
    worst = int(err.argmax())
    assert err.max() < 1e-4, f"GEMM {t.name} {rows}x{k} n={n}: token {worst} off by {err.max():.2e} of its row"


def test_short_matmuls_stay_on_the_matvec_kernels(cuda_backend, synth):
    """Below GEMM_MIN_TOKENS rows (decode, speculative verify) nothing changes."""
    from ntx_engine.backends.cuda_backend import GEMM_MIN_TOKENS

    rng = np.random.default_rng(5)
    t, rows, k = GGMLType.Q4_K, 64, 2048
    b = _gemm_backend(None, k)
    w = b.matrix(synth.random_blocks(t, rows * k, rng), t, (rows, k), "w")
    b.k.profile = []
    b.to_numpy(b.matmul(w, b.from_numpy(rng.standard_normal((GEMM_MIN_TOKENS - 1, k)).astype(np.float32))))
    names = [name for name, *_ in b.k.profile]
    b.k.profile = None
    assert not any(nm.startswith(("dequant", "to_f16")) for nm in names), names


@pytest.mark.parametrize("shape,mix,layers", [("smollm2-135m", "q4_1", None), ("tiny", "q4_k_m", 6)])
def test_gemm_prefill_is_closer_to_exact_math_than_the_int8_path(cuda_backend, synth, tmp_path, shape, mix, layers):
    """End to end on a synthetic model with real shapes: a 40-token prefill through the GEMM
    path (fp16 activations) lands closer to the numpy backend's float32-activation ("exact")
    logits than the ggml-mode int8 path does (llama.cpp's CPU function, the numpy ggml oracle),
    and greedy decoding after it agrees with the numpy oracle up to the first near-tie."""
    from greedy_check import agree_until_tie, greedy
    from test_engine_gpu import NEAR_TIE, _load

    from ntx_engine.backends.cuda_backend import CudaBackend
    from ntx_engine.backends.numpy_backend import NumpyBackend

    path = tmp_path / f"{shape}-{mix}.gguf"
    synth.write_model(path, shape, mix, layers, seed=5)
    exact = _load(path, NumpyBackend(matmul_mode="exact"), 64)
    ggml = _load(path, NumpyBackend(), 64)
    gemm = _load(path, CudaBackend(gemm="1"), 64)
    prompt = np.random.default_rng(3).integers(0, exact.cfg.vocab_size, 40)
    ref = exact.forward(prompt, 0, all_logits=True)
    d_ggml = float(np.abs(ggml.forward(prompt, 0, all_logits=True) - ref).max())
    d_gemm = float(np.abs(gemm.forward(prompt, 0, all_logits=True) - ref).max())
    assert d_gemm < d_ggml, f"GEMM prefill {d_gemm:.4f} from exact math, the int8 path {d_ggml:.4f}"
    ref_toks, ref_logits = greedy(ggml.forward, prompt, 16)
    toks, _ = greedy(_load(path, CudaBackend(gemm="1"), 64).forward, prompt, 16)
    agree, tie = agree_until_tie(ref_toks, ref_logits, toks, NEAR_TIE)
    assert agree == 16 or tie, f"tokens diverge at step {agree} away from a near-tie: {toks} vs {ref_toks}"
