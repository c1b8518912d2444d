"""The whole-layer native call (cpu_layer.c, NativeCpuBackend.run_block) against the op-by-op
native path (model.py's block over the same backend): the same kernels run in the same order,
so hidden states and KV caches must be equal bit for bit — for every dense weight type, odd
shapes, GQA and MHA, both RoPE conventions (partial too), qwen2 biases, F16 and F32 KV caches,
a prefill chunk and the decode steps after it. The op-by-op path is itself checked against
the numpy oracle (test_matmul.py, test_ops.py, test_backend.py); the end-to-end check here is
that `--device cpu` (which installs the whole-layer hook) generates the op-by-op tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ggml_ref import ggml, quantize_chunk

from ntx_engine.backends.cpu_kernels import BEST_SIMD as BEST
from ntx_engine.backends.cpu_native import NativeCpuBackend, WholeLayers, is_dense
from ntx_engine.config import ModelConfig
from ntx_engine.model import LayerWeights, ModelWeights, Transformer
from ntx_engine.quants import GGML_BLOCK_SIZES
from ntx_engine.quants import GGMLType as T

BASE = ModelConfig(arch="llama", n_layers=2, n_embd=96, n_ff=160, n_head=6, n_head_kv=2, head_dim=16,
                   rope_dim=16, rope_base=10000.0, rope_type="norm", rope_freq_scale=1.0,
                   has_rope_freqs=False, rms_eps=1e-5, context_length=64, vocab_size=10,
                   tied_embeddings=True, qkv_bias=False)
# K-quants need widths that are multiples of 256; F32/F16/BF16 get widths of no block at all
SHAPES = {32: dict(n_embd=96, n_ff=160, n_head=6, n_head_kv=2, head_dim=16, rope_dim=16),
          256: dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=1, head_dim=64, rope_dim=64),
          1: dict(n_embd=70, n_ff=90, n_head=5, n_head_kv=5, head_dim=14, rope_dim=10)}
DENSE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
N_CTX = 24


def _cfg(t: T, qwen2: bool) -> ModelConfig:
    shape = SHAPES[GGML_BLOCK_SIZES[t][0]]
    return dataclasses.replace(BASE, **shape, arch="qwen2" if qwen2 else "llama",
                               rope_type="neox" if qwen2 else "norm", qkv_bias=qwen2)


def _layer(backend, cfg: ModelConfig, types: list[T], rng) -> LayerWeights:
    """Blocks ggml's quantizer writes for smooth random matrices (finite, realistic scales)."""
    e, q, kv, ff = cfg.n_embd, cfg.q_dim, cfg.kv_dim, cfg.n_ff
    shapes = {"wq": (q, e), "wk": (kv, e), "wv": (kv, e), "wo": (e, q), "w_gate": (ff, e), "w_up": (ff, e),
              "w_down": (e, ff)}
    mats = {}
    for (field, shape), t in zip(shapes.items(), types):
        w = rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[1]).astype(np.float32)
        mats[field] = backend.matrix(quantize_chunk(ggml(), int(t), w).reshape(-1), int(t), shape, field)
    vec = lambda n, s=1.0: (1.0 + s * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    bias = {k: vec(n, 0.5) - 1.0 for k, n in (("bq", q), ("bk", kv), ("bv", kv))} if cfg.qkv_bias else {}
    return LayerWeights(**mats, attn_norm=vec(e, 0.1), ffn_norm=vec(e, 0.1), **bias)


def _models(kernels, cfg: ModelConfig, types: list[T], kv: str, seed: int = 0):
    """Two models over two backends sharing the kernel pool and the weights: op by op, whole layer."""
    rng = np.random.default_rng(seed)
    made = []
    for _ in range(2):
        b = NativeCpuBackend(kv_dtype=kv, kernels=kernels)
        made.append(b)
    layers = [_layer(made[0], cfg, types, rng) for _ in range(cfg.n_layers)]
    w = ModelWeights(tok_embd=None, output_norm=None, output=None, layers=layers, rope_freqs=None)
    return [Transformer(cfg, w, b, N_CTX) for b in made]


def _steps(op, whole, cfg: ModelConfig, rng) -> int:
    """A 5-token prefill chunk then 3 decode steps through every layer; returns the steps compared."""
    x = rng.standard_normal((5, cfg.n_embd)).astype(np.float32)
    chunks = [(x, 0)] + [(rng.standard_normal((1, cfg.n_embd)).astype(np.float32), 5 + j) for j in range(3)]
    for xs, start in chunks:
        pos = np.arange(start, start + len(xs))
        a = b = xs
        for i in range(cfg.n_layers):
            a = op.block(i, op.w.layers[i], a, pos, start)
            b = whole.backend.run_block(whole, i, whole.w.layers[i], b, pos, start)
            assert np.isfinite(a).all()
            assert a.tobytes() == b.tobytes(), f"layer {i} at {start}: max |diff| {np.abs(a - b).max()}"
    for name in ("k_cache", "v_cache"):
        assert getattr(op.backend, name).tobytes() == getattr(whole.backend, name).tobytes(), name
    return len(chunks)


@pytest.mark.parametrize("t", DENSE, ids=lambda t: t.name)
@pytest.mark.parametrize("qwen2", [False, True], ids=["llama", "qwen2"])
def test_whole_layer_equals_op_by_op(kernels, t, qwen2):
    cfg = _cfg(t, qwen2)
    op, whole = _models(kernels, cfg, [t] * 7, "f16")
    assert _steps(op, whole, cfg, np.random.default_rng(1)) == 4


def test_q4_k_m_mix_f32_cache_partial_rope_each_simd_level(kernels, simd):
    """Q4_K_M's mix (Q6_K attn_v and ffn_down), an F32 KV cache, RoPE over half of each head."""
    try:
        cfg = dataclasses.replace(_cfg(T.Q4_K, False), rope_dim=32, n_head=8, n_head_kv=2, head_dim=32)
        types = [T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K, T.Q4_K, T.Q6_K]
        op, whole = _models(kernels, cfg, types, "f32", seed=3)
        _steps(op, whole, cfg, np.random.default_rng(4))
    finally:
        kernels.select_simd(BEST)


def test_whole_layer_makes_no_op_level_calls(kernels):
    """run_block is one native call: none of the backend's op methods runs."""
    cfg = _cfg(T.Q8_0, True)
    _, whole = _models(kernels, cfg, [T.Q8_0] * 7, "f16")
    b = whole.backend

    def refuse(*_a, **_k):
        raise AssertionError("an op-level call ran inside the whole-layer path")
    for name in ("rmsnorm", "matmul_many", "matmul_swiglu", "rope_attention", "add", "swiglu"):
        setattr(b, name, refuse)
    x = np.ones((1, cfg.n_embd), np.float32)
    out = b.run_block(whole, 0, whole.w.layers[0], x, np.arange(1), 0)
    assert out.shape == x.shape and out is not x and (x == 1).all()  # the caller's x is untouched


def test_patched_matmul_and_foreign_models_fall_back_to_op_by_op(kernels):
    """A jittered matmul (ntx_engine.noise) or a model whose FFN is overridden (MoE) must run
    the op-by-op block: the whole-layer call would silently skip the override."""
    cfg = _cfg(T.Q8_0, False)
    op, whole = _models(kernels, cfg, [T.Q8_0] * 7, "f16")
    b, lw, x, pos = whole.backend, whole.w.layers[0], np.ones((1, cfg.n_embd), np.float32), np.arange(1)
    calls = []
    whole.ffn = lambda i, lw_, h: calls.append(i) or Transformer.ffn(whole, i, lw_, h)
    assert not is_dense(whole)
    b.run_block(whole, 0, lw, x, pos, 0)
    assert calls == [0]
    del whole.ffn
    assert is_dense(whole)
    b.matmul = lambda w, x_: calls.append(w.name) or NativeCpuBackend.matmul(b, w, x_)
    b.run_block(whole, 0, lw, x, pos, 0)
    assert "wo" in calls and "w_down" in calls


def test_layer_forward_checks_its_inputs(kernels):
    cfg = _cfg(T.Q8_0, False)
    _, whole = _models(kernels, cfg, [T.Q8_0] * 7, "f16")
    b, lw = whole.backend, whole.w.layers[0]
    with pytest.raises(ValueError, match="n_embd"):
        b.run_block(whole, 0, lw, np.ones((1, cfg.n_embd + 1), np.float32), np.arange(1), 0)
    with pytest.raises(ValueError, match="context full"):
        b.run_block(whole, 0, lw, np.ones((2, cfg.n_embd), np.float32), np.arange(N_CTX - 1, N_CTX + 1), N_CTX - 1)
    bad = dataclasses.replace(lw, wk=lw.wv, wv=lw.wq)  # shapes swapped: (q_dim, e) where (kv_dim, e) belongs
    with pytest.raises(ValueError, match="shapes"):
        b.run_block(whole, 1, bad, np.ones((1, cfg.n_embd), np.float32), np.arange(1), 0)


@pytest.mark.parametrize("name", ["smollm2-Q4_K_M", "tiny-qwen2-Q8_0"])
def test_device_cpu_engine_runs_whole_layers_with_op_by_op_tokens(oracle_manifest, name):
    """Engine.load(device cpu) installs the hook; logits equal the op-by-op engine's bit for bit."""
    from ntx_engine.engine import Engine, EngineConfig

    eng = Engine.load(oracle_manifest["models"][name], EngineConfig(device="cpu", n_ctx=128))
    try:
        assert isinstance(eng.model.run_layer, WholeLayers)
        ids = eng.tokenize("The three primary colors are")
        whole_logits, whole_tokens = eng.logits(ids), list(eng.generate(ids, 8))
        del eng.model.run_layer  # back to Transformer.run_layer: model.block, op by op
        assert eng.logits(ids).tobytes() == whole_logits.tobytes()
        assert list(eng.generate(ids, 8)) == whole_tokens
    finally:
        eng.model.backend.close()
        eng.close()
