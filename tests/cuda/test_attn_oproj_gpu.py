"""The o projection inside the cluster form of the decode attention ("oproj", attn_oproj.cuh:
attn_cl<C>_4_g4_o). The attention's output must be the plain cluster kernel's bit for bit (the same
code up to its quantization, which the fused kernel keeps in shared memory); the product differs
from the matvec's only in the order its float sums are added, so it is held to numpy's product of
that output within MATVEC_REL (the bound of every matvec test) and to the matvec within 1e-6
(float32 sums of the same products in two orders: ~1e-7 seen); a model's logits to the build without the fusion within the noise floor that
tests/cuda/test_decode_variants_gpu.py derives, and its decode graph to its plain steps bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.config import ModelConfig
from ntx_engine.quants import GGMLType
from tests.cuda.conftest import synthetic_gguf
from tests.cuda.test_decode_variants_gpu import MATVEC_REL, _forced_logits, _noise_floor

pytestmark = pytest.mark.gpu

T = GGMLType


def _backend(monkeypatch, cluster: int, fuse: str, cfg=None, n_ctx: int = 1024):
    from ntx_engine.backends.cuda_backend import CudaBackend

    monkeypatch.setenv("NTX_CUDA_GRID_CLUSTER", str(cluster))  # Kernels reads it when it is made
    b = CudaBackend(fuse=fuse, attn="grid")
    if cfg is not None:
        b.set_model(cfg, n_ctx, None)
    return b


def _cfg() -> ModelConfig:
    """Llama-3-8B's attention: 32 query heads of 128 in groups of 4, o projection 4096 x 4096."""
    return ModelConfig(arch="llama", n_layers=1, n_embd=4096, n_ff=64, n_head=32, n_head_kv=8, head_dim=128,
                       rope_dim=128, rope_base=500000.0, rope_type="norm", rope_freq_scale=1.0, has_rope_freqs=False,
                       rms_eps=1e-5, context_length=1024, vocab_size=16, tied_embeddings=True, qkv_bias=False)


@pytest.mark.parametrize("cluster", [8, 16])
@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0])
def test_oproj_equals_the_attention_then_the_matvec(cuda_backend, synth, monkeypatch, t, cluster):
    """Decode at 8 positions (one block of a cluster holds any), ~100, ~600 and ~1000 (every block),
    after prefill chunks, with the fused rope path (q, k, v before RoPE) as the engine runs it. With
    clusters of 8 a block's 512 rows of Q8_0 do not fit its shared memory: the plain kernels run."""
    from ntx_engine.backends.cuda_backend import EXACT_FUSIONS
    from ntx_engine.backends.cuda_driver import download
    from ntx_engine.backends.cuda_kernels import oproj_smem

    cfg = _cfg()
    rng = np.random.default_rng(cluster + int(t))
    rows, k = cfg.n_embd, cfg.q_dim
    raw = synth.random_blocks(t, rows * k, rng)
    w_np = NumpyBackend().matrix(raw, t, (rows, k), "wo")
    steps = [(rng.standard_normal((n, cfg.q_dim)).astype(np.float32) * 2,
              rng.standard_normal((n, cfg.kv_dim)).astype(np.float32) * 2,
              rng.standard_normal((n, cfg.kv_dim)).astype(np.float32))
             for n in (7, 1, 1, 90, 1, 500, 1, 1, 400, 1)]
    runs = {}
    for fuse in ("all", EXACT_FUSIONS):
        b = _backend(monkeypatch, cluster, fuse, cfg)
        w = b.matrix(raw, t, (rows, k), "wo")
        takes = fuse == "all" and oproj_smem(t, rows, k, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cluster,
                                             b._grid_shape(cluster)[1], b.k.device.max_smem_optin) is not None
        assert takes or fuse != "all" or (cluster, t) == (8, T.Q8_0)
        start, outs = 0, []
        for q, kk, v in steps:
            n = q.shape[0]
            b.k.profile = []
            o = b.rope_attention(b.from_numpy(q), b.from_numpy(kk), b.from_numpy(v), np.arange(start, start + n), 0,
                                 start)
            y = b.matmul(w, o)
            ran = [name for name, *_ in b.k.profile]
            b.k.profile = None
            if n == 1:
                fused = f"attn_cl{cluster}_4_g4_o"
                if takes:
                    assert ran == [fused], f"the step at {start} ran {ran}, not the attention with its o projection"
                else:
                    assert fused not in ran and f"attn_cl{cluster}_4_g4" in ran, ran
            outs.append((start, n, b.to_numpy(o), b.to_numpy(y)))
            start += n
        if takes:
            assert not download(b._oproj_scratch[1], b.stream).any(), "the per-rank counters were not left at zero"
        runs[fuse] = outs
    npb = NumpyBackend()
    for (start, n, o, y), (_, _, o_ref, y_mv) in zip(runs["all"], runs[EXACT_FUSIONS]):
        assert np.isfinite(y).all(), f"position {start}: unwritten or non-finite o projection"
        assert np.array_equal(o, o_ref), f"position {start}: the attention's output differs from the plain kernel's"
        if n != 1:
            continue
        y_np = npb.matmul(w_np, o)
        err = np.linalg.norm(y - y_np) / np.linalg.norm(y_np)
        assert err < MATVEC_REL, f"position {start}: rel L2 {err:.2e} against numpy"
        err = np.linalg.norm(y - y_mv) / np.linalg.norm(y_mv)
        assert err < 1e-6, f"position {start}: rel L2 {err:.2e} against the matvec"


def test_held_attention_launches_alone_for_any_other_op(cuda_backend, synth, monkeypatch):
    """The attention's launch is held for its matmul; read first (or multiplied by a weight the
    fused kernel cannot take: Q6_K), it runs as the plain cluster kernel, with the same output."""
    cfg = _cfg()
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, cfg.q_dim)).astype(np.float32)
    kv = [rng.standard_normal((1, cfg.kv_dim)).astype(np.float32) for _ in range(2)]
    raw6 = synth.random_blocks(T.Q6_K, cfg.n_embd * cfg.q_dim, rng)
    outs = []
    for fuse, read_first in (("all", True), ("all", False), ("none", True)):
        b = _backend(monkeypatch, 16, fuse, cfg)
        w6 = b.matrix(raw6, T.Q6_K, (cfg.n_embd, cfg.q_dim), "wo")
        b.k.profile = []
        o = b.rope_attention(b.from_numpy(q), *(b.from_numpy(a) for a in kv), np.arange(1), 0, 0)
        first = b.to_numpy(o) if read_first else None
        y = b.to_numpy(b.matmul(w6, o))
        ran = [name for name, *_ in b.k.profile]
        b.k.profile = None
        assert "attn_cl16_4_g4" in ran and "attn_cl16_4_g4_o" not in ran, ran
        outs.append((first if read_first else b.to_numpy(o), y))
    for o, y in outs[1:]:
        assert np.array_equal(o, outs[0][0]) and np.array_equal(y, outs[0][1])


@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0"])
def test_oproj_model_logits(cuda_backend, synth, monkeypatch, tmp_path, mix):
    """A "small" synthetic model (heads of 128 in groups of 4, o projection 2048 x 2048): prefill,
    decode and the decode graph with the fusion, fed the greedy tokens of the build without it:
    graph and plain steps bit for bit, and within 3 x the MATVEC_REL noise floor + 1e-3 of that
    build (the margin tests/cuda/test_engine_gpu.py gives prefill logits)."""
    from ntx_engine.backends.cuda_backend import EXACT_FUSIONS
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.model import Transformer, WeightLoader
    from tests.cuda.conftest import greedy_logits

    gf, cfg = synthetic_gguf(synth, tmp_path, "small", mix, 2, seed=12)
    prompt = np.random.default_rng(6).integers(0, cfg.vocab_size, 11)
    steps = 6
    b = _backend(monkeypatch, 16, EXACT_FUSIONS)
    model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
    base = greedy_logits(model, model.forward, prompt, steps)
    toks = [int(np.argmax(step[-1])) for step in base[:-1]]
    runs = []
    for graph in (False, True):
        b = _backend(monkeypatch, 16, "all")
        model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
        b.k.profile = []
        runs.append(_forced_logits(model, DecodeGraph(model).forward if graph else model.forward, prompt, toks))
        ran = [name for name, *_ in b.k.profile]
        b.k.profile = None
        if not graph:
            assert ran.count("attn_cl16_4_g4_o") == steps * cfg.n_layers, "the decode steps did not take the fusion"
    for i, (p, g) in enumerate(zip(*runs)):
        assert np.array_equal(p, g), f"pass {i}: graph logits differ from the plain steps"
    noise = _noise_floor(gf, cfg, [*prompt.tolist(), *toks], MATVEC_REL)
    starts = [0, *range(len(prompt), len(prompt) + steps)]
    for i, (a, p) in enumerate(zip(base, runs[0])):
        floor = float(noise[starts[i]:starts[i] + len(a)].max())
        diff = float(np.abs(a - p).max())
        assert diff <= 3 * floor + 1e-3, f"pass {i}: logits differ by {diff} (noise floor {floor})"
