"""Other kernel builds against the default build: the pipelined dp4a rows (-DNTX_FAST_ASYNC=S:
S cp.async shared-memory stages a warp), the split decode attention with its loads issued up
front (-DNTX_ATTN_PRELOAD=1), and the dp4a kernels that load no weight before the PDL wait
(-DNTX_PRE_WAIT=0; the default loads each warp's first group before it). Both add the same terms in the same order as the default kernels,
so matvec outputs, attention outputs and whole-model logits must be equal bit for bit; the
matvecs are also held to the numpy backend (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.config import ModelConfig
from ntx_engine.quants import GGMLType
from tests.cuda.conftest import greedy_logits, synthetic_gguf

pytestmark = pytest.mark.gpu

T = GGMLType
STAGES = [2, 3, 4]


def _backend(monkeypatch, stages: int, preload: bool = False, prewait: bool = True, **kw):
    """A CUDA backend whose dp4a kernels are built with `stages` (0: the default build), load
    their first weight group only after the PDL wait when not `prewait` (the default build loads
    it before), and whose split attention issues its loads up front when `preload`."""
    from ntx_engine.backends.cuda_backend import CudaBackend

    defines = ([f"-DNTX_FAST_ASYNC={stages}"] if stages else []) + (["-DNTX_ATTN_PRELOAD=1"] if preload else []) \
        + ([] if prewait else ["-DNTX_PRE_WAIT=0"])
    monkeypatch.setenv("NTX_CUDA_DEFINES", " ".join(defines))
    b = CudaBackend(**kw)
    monkeypatch.delenv("NTX_CUDA_DEFINES")
    return b


# rows x k: partial last group, one group, many groups (Q8_0: 14 of 32 blocks), a 1000-row grid
SHAPES = [(67, 6144), (37, 2304), (5, 14336), (1000, 4096)]


@pytest.mark.parametrize("stages", STAGES + ["noprewait"])
@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_pipelined_matvec_equals_the_default_build(cuda_backend, synth, monkeypatch, t, stages):
    prewait = stages != "noprewait"
    stages = stages if prewait else 0
    base, piped = _backend(monkeypatch, 0), _backend(monkeypatch, stages, prewait=prewait)
    for rows, k in SHAPES:
        rng = np.random.default_rng(100 * stages + rows + k)
        raw = synth.random_blocks(t, rows * k, rng)
        w_np = NumpyBackend().matrix(raw, t, (rows, k), "w")
        for n in (1, 3, 11):
            x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10, k)).astype(np.float32)
            outs = []
            for b in (base, piped):
                w = b.matrix(raw, t, (rows, k), "w")
                b._act_cache = None
                outs.append(b.to_numpy(b.matmul(w, b.from_numpy(x))))
            assert np.isfinite(outs[1]).all(), f"{t.name} {rows}x{k} n={n}: unwritten outputs"
            assert np.array_equal(outs[0], outs[1]), \
                f"{t.name} {rows}x{k} n={n} S={stages}: max |diff| {np.abs(outs[0] - outs[1]).max()}"
            ref = NumpyBackend().matmul(w_np, x)
            err = np.linalg.norm(outs[1] - ref) / np.linalg.norm(ref)
            assert err < 2e-5, f"{t.name} {rows}x{k} n={n}: rel L2 {err:.2e} against numpy"


@pytest.mark.parametrize("head_dim,n_head,n_head_kv", [(64, 8, 2), (128, 4, 4), (96, 6, 2), (256, 16, 2), (128, 32, 8)])
def test_preloaded_decode_attention_equals_the_default_build(cuda_backend, monkeypatch, head_dim, n_head, n_head_kv):
    """Decode steps at 7, 8 (one partial chunk) and 259 (five chunks, the last partial), after
    prefills that fill the cache; every split-kernel layout (head_dim / 32 = 2, 3, 4, 8)."""
    from ntx_engine.backends.cuda_kernels import gqa_split_ok

    assert gqa_split_ok(n_head, n_head_kv, head_dim)
    cfg = ModelConfig(arch="llama", n_layers=2, n_embd=n_head * head_dim, n_ff=256, n_head=n_head,
                      n_head_kv=n_head_kv, head_dim=head_dim, rope_dim=64, rope_base=10000.0, rope_type="norm",
                      rope_freq_scale=1.0, has_rope_freqs=False, rms_eps=1e-5, context_length=512, vocab_size=64,
                      tied_embeddings=True, qkv_bias=False)
    pair = _backend(monkeypatch, 0, attn="split"), _backend(monkeypatch, 0, preload=True, attn="split")
    for b in pair:
        b.set_model(cfg, 300, None)
    rng = np.random.default_rng(head_dim + n_head)
    start = 0
    for n in (7, 1, 1, 250, 1):
        q, k, v = (rng.standard_normal((n, d)).astype(np.float32) * 2 for d in (cfg.q_dim, cfg.kv_dim, cfg.kv_dim))
        for layer in (0, 1):
            a, p = (b.to_numpy(b.attention(b.from_numpy(q), b.from_numpy(k), b.from_numpy(v), layer, start))
                    for b in pair)
            assert np.isfinite(p).all() and np.array_equal(a, p), \
                f"hd {head_dim} {n_head}/{n_head_kv} n={n} start={start}: max |diff| {np.abs(a - p).max()}"
        start += n


CASES = [("tiny", "q8_0", 4), ("tiny", "q4_k_m", 4)]


@pytest.mark.parametrize("stages,preload,prewait", [(2, False, True), (4, False, True), (0, True, True),
                                                    (4, True, True), (0, False, False)])
@pytest.mark.parametrize("shape,mix,layers", CASES, ids=[f"{s}-{m}" for s, m, _ in CASES])
def test_opt_in_builds_give_the_default_logits(cuda_backend, synth, monkeypatch, tmp_path, shape, mix, layers,
                                              stages, preload, prewait):
    """Fused qkv / gate-up kernels included (fused.cu), prefill, decode and the CUDA graph."""
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.model import Transformer, WeightLoader

    gf, cfg = synthetic_gguf(synth, tmp_path, shape, mix, layers, seed=9)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 11)
    runs = []
    for s, pre, pw in ((0, False, True), (stages, preload, prewait)):
        b = _backend(monkeypatch, s, pre, pw, fuse="all", attn="split")  # the kernels preload changes
        model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
        runs.append(greedy_logits(model, DecodeGraph(model).forward, prompt, 6))
    for i, (a, p) in enumerate(zip(*runs)):
        assert np.array_equal(a, p), f"step {i}: S={stages} preload={preload}: logits differ (max {np.abs(a - p).max()})"
