"""RMSNorm, RoPE, SwiGLU, add and KV-cache attention of the native backend against the numpy
backend (the oracle) on the same inputs, outputs poisoned with NaN first. RoPE and add do the
same float32 operations in the same order, so they must match bit for bit; the others differ
by libm's expf against numpy's exp, or summation order, by a few ulps."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from ntx_engine.backends.cpu_kernels import BEST_SIMD as BEST
from ntx_engine.backends.cpu_native import NativeCpuBackend
from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.config import ModelConfig

CFG = ModelConfig(arch="llama", n_layers=2, n_embd=96, n_ff=160, n_head=6, n_head_kv=2, head_dim=16,
                  rope_dim=16, rope_base=10000.0, rope_type="norm", rope_freq_scale=1.0,
                  has_rope_freqs=False, rms_eps=1e-5, context_length=64, vocab_size=10,
                  tied_embeddings=True, qkv_bias=False)


def _pair(kernels, cfg=CFG, kv="f16", n_ctx=40):
    ours, ref = NativeCpuBackend(kv_dtype=kv, kernels=kernels), NumpyBackend(kv_dtype=kv)
    ours.set_model(cfg, n_ctx, None)
    ref.set_model(cfg, n_ctx, None)
    return ours, ref


def _poison(n, d):
    return np.full((n, d), np.nan, np.float32)


@pytest.mark.parametrize("n", [1, 5])
def test_rmsnorm(kernels, n):
    rng = np.random.default_rng(n)
    x, w = rng.standard_normal((n, 96)).astype(np.float32) * 3, rng.standard_normal(96).astype(np.float32)
    out = kernels.rmsnorm(x, w, 1e-5, out=_poison(n, 96))
    np.testing.assert_allclose(out, NumpyBackend().rmsnorm(x, w, 1e-5), rtol=2e-7, atol=0)


def test_swiglu_and_add(kernels):
    rng = np.random.default_rng(2)
    g, u = (rng.standard_normal((3, 160)).astype(np.float32) * 4 for _ in range(2))
    np.testing.assert_allclose(kernels.swiglu(g, u, out=_poison(3, 160)), NumpyBackend().swiglu(g, u),
                               rtol=5e-7, atol=1e-30)
    assert kernels.add(g, u).tobytes() == (g + u).tobytes()


@pytest.mark.parametrize("rope_type", ["norm", "neox"])
@pytest.mark.parametrize("rope_dim", [16, 8])
def test_rope_is_bit_identical(kernels, rope_type, rope_dim):
    cfg = dataclasses.replace(CFG, rope_type=rope_type, rope_dim=rope_dim)
    ours, ref = _pair(kernels, cfg)
    x = np.random.default_rng(3).standard_normal((4, 6 * 16)).astype(np.float32)
    pos = np.array([0, 7, 8, 33])
    got = ours.rope(x, pos, 6)
    assert got.tobytes() == ref.rope(x, pos, 6).tobytes()
    assert not np.shares_memory(got, x)


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_attention_prefill_then_decode(kernels, kv):
    """A 7-token prefill then 3 single-token steps: the cache writes and the causal mask."""
    ours, ref = _pair(kernels, kv=kv)
    rng = np.random.default_rng(4)
    start = 0
    for n in (7, 1, 1, 1):
        q = rng.standard_normal((n, 96)).astype(np.float32)
        k, v = (rng.standard_normal((n, 32)).astype(np.float32) for _ in range(2))
        for layer in (0, 1):
            got = ours.kernels.attention(q, k, v, ours.k_cache[layer], ours.v_cache[layer], start, 6, 2, 16,
                                         out=_poison(n, 96))
            want = ref.attention(q, k, v, layer, start)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        assert ours.k_cache.tobytes() == ref.k_cache.tobytes(), "cache rows written differently"
        start += n


def test_attention_refuses_overflowing_the_context(kernels):
    ours, _ = _pair(kernels, n_ctx=8)
    q, kv = np.zeros((2, 96), np.float32), np.zeros((2, 32), np.float32)
    with pytest.raises(ValueError, match="context full"):
        ours.attention(q, kv, kv, 0, 7)


def test_gil_is_released_during_a_kernel(kernels):
    """While one thread sits in a long native matmul, this thread keeps running Python."""
    from make_synthetic_model import random_blocks

    from ntx_engine.quants import GGMLType

    rows, k = 6000, 4096
    raw = random_blocks(GGMLType.Q8_0, rows * k, np.random.default_rng(5)).reshape(-1)
    x = np.ones((64, k), np.float32)  # ~0.25 s on the 2-core dev box: far above the 0.05 s floor
    kernels.select_simd("portable")  # the slow path: the call lasts long enough to observe
    stamps: dict[str, float] = {}

    def work():
        stamps["start"] = time.perf_counter()
        kernels.matmul(GGMLType.Q8_0, raw, rows, k, x)
        stamps["end"] = time.perf_counter()

    th = threading.Thread(target=work)
    ticks = []
    try:
        th.start()
        while th.is_alive():
            ticks.append(time.perf_counter())
        th.join()
    finally:
        kernels.select_simd(BEST)
    inside = [t for t in ticks if stamps["start"] < t < stamps["end"]]
    assert stamps["end"] - stamps["start"] > 0.05, "the matmul was too short to tell"
    # with the GIL held for the call, this loop could not have run at all between the stamps
    assert len(inside) > 1000, f"only {len(inside)} Python iterations ran during the native call"


def test_fused_matmuls_equal_their_compositions_and_honour_a_patched_matmul(kernels):
    """matmul_many / matmul_swiglu give exactly the separate products; when an instance replaces
    matmul (ntx_engine.noise jitters inputs that way) the fused ops go through the replacement."""
    from make_synthetic_model import random_blocks

    from ntx_engine.quants import GGMLType

    b = NativeCpuBackend(kernels=kernels)
    rng = np.random.default_rng(8)
    ws = [b.matrix(random_blocks(t, r * 256, rng).reshape(-1), t, (r, 256), f"w{i}")
          for i, (t, r) in enumerate([(GGMLType.Q4_K, 40), (GGMLType.Q6_K, 24), (GGMLType.Q8_0, 40)])]
    x = rng.standard_normal((3, 256)).astype(np.float32)
    for fused, single in zip(b.matmul_many(ws, x), [b.matmul(w, x) for w in ws]):
        assert fused.tobytes() == single.tobytes()
    ref = b.swiglu(b.matmul(ws[0], x), b.matmul(ws[2], x))
    np.testing.assert_allclose(b.matmul_swiglu(ws[0], ws[2], x), ref, rtol=1e-6, atol=1e-30)
    calls = []
    b.matmul = lambda w, x_: calls.append(w.name) or NativeCpuBackend.matmul(b, w, x_)
    b.matmul_many(ws, x)
    b.matmul_swiglu(ws[0], ws[2], x)
    assert calls == ["w0", "w1", "w2", "w0", "w2"]
