"""The grid attention's cluster form (attn_grid.cu, attn_cl<C>_*: the blocks of a KV head in one
thread-block cluster, meeting through distributed shared memory) against its grid form (global
scratch, a counter barrier, a last block). Where both split the context alike — up to 16 x C
positions, where each block has the minimum of 16 — they combine the same values in the same
order, so every output is compared bit for bit there: the
attention's output, its quantized activations (through the o projection after it), the K/V caches
it writes, and whole-model logits, plain and in the decode graph. Beyond that the cluster's blocks
hold more positions than the grid's, so sums round differently: test_kernels_gpu.py holds both forms
to numpy at every length."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.config import ModelConfig
from ntx_engine.quants import GGMLType
from tests.cuda.conftest import greedy_logits, synthetic_gguf

pytestmark = pytest.mark.gpu

T = GGMLType


def _backend(monkeypatch, cluster: int, cfg=None, n_ctx: int = 300):
    from ntx_engine.backends.cuda_backend import CudaBackend

    monkeypatch.setenv("NTX_CUDA_GRID_CLUSTER", str(cluster))  # Kernels reads it when it is made
    b = CudaBackend(fuse="all", attn="grid")
    if cfg is not None:
        b.set_model(cfg, n_ctx, None)
    return b


@pytest.mark.parametrize("cluster", [8, 16])
@pytest.mark.parametrize("t", [None, T.Q4_K, T.Q8_0], ids=["f32", "q8_k", "q8_1"])
def test_cluster_attention_equals_the_grid_form(cuda_backend, synth, monkeypatch, t, cluster):
    """Llama-3-8B heads (128, 32 / 8). Decode at 8 positions (one block of the cluster has any:
    the others only come to its barriers), at ~100 (7 blocks), up to 16 x C (every block; the last
    partial) and after each prefill chunk; with the o projection's Q8_K or Q8_1 activations
    quantized by the attention itself, or none."""
    from ntx_engine.backends.cuda_driver import download

    head_dim, n_head, n_kv = 128, 32, 8
    cfg = ModelConfig(arch="llama", n_layers=1, n_embd=n_head * head_dim, n_ff=64, n_head=n_head, n_head_kv=n_kv,
                      head_dim=head_dim, rope_dim=head_dim, rope_base=10000.0, rope_type="norm",
                      rope_freq_scale=1.0, has_rope_freqs=False, rms_eps=1e-5, context_length=512, vocab_size=16,
                      tied_embeddings=True, qkv_bias=False)
    rng = np.random.default_rng(cluster + (0 if t is None else int(t)))
    k = cfg.q_dim
    raw = synth.random_blocks(t, 48 * k, rng) if t is not None else None
    steps = [(rng.standard_normal((n, cfg.q_dim)).astype(np.float32) * 2,
              rng.standard_normal((n, cfg.kv_dim)).astype(np.float32) * 2,
              rng.standard_normal((n, cfg.kv_dim)).astype(np.float32))
             for n in ((7, 1, 1, 90, 1, 1, 150, 1, 1, 1) if cluster == 16 else (7, 1, 1, 90, 1, 1, 25, 1))]
    res, caches = [], []
    for form in (cluster, 0):
        b = _backend(monkeypatch, form, cfg)
        w = b.matrix(raw, t, (48, k), "wo") if t is not None else None
        start, outs = 0, []
        for q, kk, v in steps:
            b.k.profile = []
            o = b.attention(b.from_numpy(q), b.from_numpy(kk), b.from_numpy(v), 0, start)
            y = b.matmul(w, o) if w is not None else None
            ran = [name for name, *_ in b.k.profile]
            b.k.profile = None
            if q.shape[0] == 1:
                want = f"attn_cl{cluster}_4_g4" if form else "attn_grid_4_g4"
                assert want in ran, (form, ran)
            outs.append(b.to_numpy(o))
            if y is not None:
                outs.append(b.to_numpy(y))
            start += q.shape[0]
        res.append(outs)
        caches.append([download(c, b.stream)[:start] for c in (b.k_cache[0], b.v_cache[0])])
    for i, (got, want) in enumerate(zip(*res)):
        assert np.isfinite(got).all(), f"output {i}: unwritten or non-finite values"
        assert np.array_equal(got, want), f"output {i} differs from the grid form (max {np.abs(got - want).max()})"
    for got, want, what in zip(*caches, ("K", "V")):
        assert np.array_equal(got, want), f"{what} cache differs"


@pytest.mark.parametrize("cluster", [8, 16])
def test_cluster_attention_model_logits_equal_the_grid_form(cuda_backend, synth, monkeypatch, tmp_path, cluster):
    """A "small" synthetic Q4_K_M model (heads of 128, groups of 4: the cluster kernels' layout):
    prefill, decode steps and the decode graph, logits bit for bit against the grid form."""
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.model import Transformer, WeightLoader

    gf, cfg = synthetic_gguf(synth, tmp_path, "small", "q4_k_m", 2, seed=8)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 11)
    runs = []
    for form, graph in ((cluster, False), (cluster, True), (0, False)):
        b = _backend(monkeypatch, form)
        model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
        b.k.profile = []
        runs.append(greedy_logits(model, DecodeGraph(model).forward if graph else model.forward, prompt, 6))
        ran = {name for name, *_ in b.k.profile}
        b.k.profile = None
        if not graph:
            assert (f"attn_cl{cluster}_4_g4" if form else "attn_grid_4_g4") in ran, ran
    for i, (c, g, d) in enumerate(zip(*runs)):
        assert np.array_equal(c, d), f"step {i}: cluster logits differ from the grid form's (max {np.abs(c - d).max()})"
        assert np.array_equal(c, g), f"step {i}: cluster graph logits differ from the plain run"


def test_decode_graph_switches_form_at_the_cluster_limit(cuda_backend, synth, monkeypatch, tmp_path):
    """Past CLUSTER_MAX_T positions the grid form runs (more blocks a head): the decode graph,
    captured for the cluster form, captures the grid form's step once the position crosses the
    limit (here lowered to 14) and goes on bit for bit as the grid form alone would."""
    from ntx_engine.backends import cuda_backend
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.model import Transformer, WeightLoader

    monkeypatch.setattr(cuda_backend, "CLUSTER_MAX_T", 14)
    gf, cfg = synthetic_gguf(synth, tmp_path, "small", "q8_0", 2, seed=9)
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, 11)  # decode at T = 12 .. 17
    runs = []
    for form in (16, 0):
        b = _backend(monkeypatch, form)
        model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
        graph = DecodeGraph(model)
        runs.append(greedy_logits(model, graph.forward, prompt, 6))
        assert sorted(graph._graphs) == ([(0,), (16,)] if form else [(0,)]), sorted(graph._graphs)
    for i, (c, g) in enumerate(zip(*runs)):
        assert np.array_equal(c, g), f"step {i}: logits differ from the grid form's (max {np.abs(c - g).max()})"
