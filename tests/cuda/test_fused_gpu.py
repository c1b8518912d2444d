"""The fused CUDA ops (qkv matmul, gate/up + SwiGLU, RoPE + KV store, add + RMSNorm + quantize)
against the unfused kernels they replace (bit for bit: same function, same float32 operations)
and against the numpy backend's plain composition (the oracle), on fresh random inputs with
outputs poisoned first; then whole synthetic models, fused vs unfused, logits bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.config import ModelConfig
from ntx_engine.quants import GGMLType
from tests.cuda.conftest import greedy_logits, synthetic_gguf

pytestmark = pytest.mark.gpu

T = GGMLType


def _backends(cfg=None, n_ctx=64, freqs=None, attn=None):
    """(fused, unfused) CUDA backends, set up for cfg when given (tests take the cuda_backend
    fixture first: it skips them where no GPU is usable)."""
    from ntx_engine.backends.cuda_backend import CudaBackend

    pair = CudaBackend(fuse="all", attn=attn), CudaBackend(fuse="none", attn=attn)
    if cfg is not None:
        for b in pair:
            b.set_model(cfg, n_ctx, freqs)
    return pair


def _rel(out, ref) -> float:
    assert np.isfinite(out).all(), "unwritten or non-finite outputs"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _weights(synth, types_rows, k, seed):
    rng = np.random.default_rng(seed)
    return [(t, rows, synth.random_blocks(t, rows * k, rng)) for t, rows in types_rows]


@pytest.mark.parametrize("n", [1, 3, 11])
@pytest.mark.parametrize("mix", [((T.Q4_K, 67), (T.Q4_K, 37), (T.Q6_K, 5)), ((T.Q8_0, 64), (T.Q8_0, 16), (T.Q8_0, 9))],
                         ids=["q4_k-q4_k-q6_k", "q8_0"])
def test_matmul_many_is_one_launch_of_the_same_products(cuda_backend, synth, mix, n):
    fused, plain = _backends()
    k = 4096  # Q6_K's dp4a path needs k % 2048 == 0
    ws = _weights(synth, mix, k, 31 + n)
    x = (np.random.default_rng(n).standard_normal((n, k)) * 2).astype(np.float32)
    outs = []
    for b in (fused, plain):
        mats = [b.matrix(raw, t, (rows, k), f"w{i}") for i, (t, rows, raw) in enumerate(ws)]
        assert all(b.uses_fast(m) for m in mats)
        b.k.profile = []
        ys = b.matmul_many(mats, b.from_numpy(x))
        launches = [name for name, *_ in b.k.profile]
        b.k.profile = None
        outs.append([b.to_numpy(y) for y in ys])
        assert sum(name.startswith(("matvecf_", "matvecr_")) for name in launches) == (
            -(-n // 8) * (1 if b is fused else len(ws))), launches
    npb = NumpyBackend()
    for (t, rows, raw), got, want in zip(ws, *outs):
        assert np.array_equal(got, want), f"fused {t.name} rows differ from the single matmul"
        assert _rel(got, npb.matmul(npb.matrix(raw, t, (rows, k), "w"), x)) < 2e-5


@pytest.mark.parametrize("n", [1, 5, 9])
@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_matmul_swiglu_equals_swiglu_of_two_matmuls(cuda_backend, synth, t, n):
    fused, plain = _backends()
    rows, k = 71, 4096
    (_, _, rg), (_, _, ru) = _weights(synth, [(t, rows), (t, rows)], k, 77 + n)
    x = np.random.default_rng(n + 5).standard_normal((n, k)).astype(np.float32)
    got, want = [b.to_numpy(b.matmul_swiglu(b.matrix(rg, t, (rows, k), "g"), b.matrix(ru, t, (rows, k), "u"),
                                            b.from_numpy(x))) for b in (fused, plain)]
    assert np.array_equal(got, want)
    npb = NumpyBackend()
    ref = npb.matmul_swiglu(npb.matrix(rg, t, (rows, k), "g"), npb.matrix(ru, t, (rows, k), "u"), x)
    assert _rel(got, ref) < 2e-5


def _cfg(rope_type, rope_dim, head_dim, n_head, n_kv, freq_scale=1.0) -> ModelConfig:
    return ModelConfig(arch="llama", n_layers=2, n_embd=n_head * head_dim, n_ff=256, n_head=n_head,
                       n_head_kv=n_kv, head_dim=head_dim, rope_dim=rope_dim, rope_base=10000.0,
                       rope_type=rope_type, rope_freq_scale=freq_scale, has_rope_freqs=False, rms_eps=1e-5,
                       context_length=512, vocab_size=64, tied_embeddings=True, qkv_bias=False)


@pytest.mark.parametrize("rope_type,rope_dim,head_dim,n_head,n_kv,freqs", [
    ("norm", 64, 64, 8, 2, False), ("neox", 128, 128, 4, 4, False), ("neox", 48, 64, 9, 3, True),
    ("norm", 32, 64, 6, 2, True), ("norm", 96, 128, 32, 8, True), ("neox", 128, 128, 16, 2, False)])
def test_rope_attention_equals_rope_rope_store_attention(cuda_backend, rope_type, rope_dim, head_dim, n_head, n_kv,
                                                         freqs):
    """Prefill chunks take rope_kv; a decode step (n = 1) takes the grid attention with the RoPE
    and the KV store inside it: both equal rope, rope, kv_store and attention bit for bit (the
    caches too), across the generic and the fixed-group grid kernels."""
    cfg = _cfg(rope_type, rope_dim, head_dim, n_head, n_kv, 0.5 if freqs else 1.0)
    rng = np.random.default_rng(rope_dim + n_head)
    ff = rng.uniform(1, 8, rope_dim // 2).astype(np.float32) if freqs else None
    fused, plain = _backends(cfg, 300, ff)
    npb = NumpyBackend()
    npb.set_model(cfg, 300, ff)
    start = 0
    for n in (7, 1, 1, 250, 1):
        q = rng.standard_normal((n, cfg.q_dim)).astype(np.float32) * 2
        k = rng.standard_normal((n, cfg.kv_dim)).astype(np.float32) * 2
        v = rng.standard_normal((n, cfg.kv_dim)).astype(np.float32)
        pos = np.arange(start, start + n)
        for layer in (0, 1):
            fused.k.profile = []
            got, want = [b.to_numpy(b.rope_attention(b.from_numpy(q), b.from_numpy(k), b.from_numpy(v), pos, layer,
                                                     start)) for b in (fused, plain)]
            ran, fused.k.profile = [name for name, *_ in fused.k.profile], None
            if n == 1:  # one launch: the grid kernel rotates and stores
                assert any(x.startswith(("attn_grid_", "attn_cl")) for x in ran) and "rope_kv" not in ran, ran
            assert np.array_equal(got, want), f"n={n} start={start} layer {layer}"
            assert _rel(got, npb.rope_attention(q, k, v, pos, layer, start)) < 1e-3
        start += n
    for layer in (0, 1):  # the rows written (the rest was never set: recycled memory may hold anything)
        assert np.array_equal(fused.to_numpy(fused.k_cache[layer])[:start], plain.to_numpy(plain.k_cache[layer])[:start])
        assert np.array_equal(fused.to_numpy(fused.v_cache[layer])[:start], plain.to_numpy(plain.v_cache[layer])[:start])


# (activation format, row length); 2304 and 1280 end in a partial 1024-value stripe
NORM_CASES = [(f, k) for f in (None, T.Q8_K, T.Q8_0) for k in (4096, 2304, 8192, 1280)]


@pytest.mark.parametrize("fmt,k", NORM_CASES, ids=[f"{f.name if f else 'norm-only'}-{k}" for f, k in NORM_CASES])
@pytest.mark.parametrize("n", [1, 4])
def test_add_rmsnorm_quantize_in_one_kernel(cuda_backend, synth, fmt, n, k):
    """add then rmsnorm (held-back add fused into the norm), with the next matmul's int8
    activations made by the norm kernel when the format is known (from the registers that hold
    the row in its 1024-thread block; k = 2304 and 1280 end in a partial stripe);
    the matmul after it, the sum and the norm are bit-identical to the unfused kernels."""
    fused, plain = _backends()
    rows = 40
    rng = np.random.default_rng(n)
    a, d = (rng.standard_normal((2, n, k)) * 3).astype(np.float32)
    g = rng.standard_normal(k).astype(np.float32)
    t = {None: T.Q4_K, T.Q8_K: T.Q4_K, T.Q8_0: T.Q8_0}[fmt]
    (_, _, raw), = _weights(synth, [(t, rows)], k, 5)
    res = []
    for b in (fused, plain):
        w, gw = b.matrix(raw, t, (rows, k), "w"), b.from_numpy(g)
        if fmt is not None and b is fused:
            b._norm_keys[gw.ptr] = (w.vec_dot_type, w.has_min, True)
        b.k.profile = []
        s = b.add(b.from_numpy(a), b.from_numpy(d))
        h = b.rmsnorm(s, gw, 1e-5)
        y = b.matmul(w, h)
        names = [name for name, *_ in b.k.profile]
        b.k.profile = None
        res.append([b.to_numpy(s), b.to_numpy(h), b.to_numpy(y)])
        if b is fused:
            assert names[0] == "add_rmsnorm_quanti" and "add" not in names, names
            quantized_by_norm = not any(x.startswith("quanti") for x in names)
            assert quantized_by_norm == (fmt is not None), names
        assert b is plain or fmt is None or b.uses_fast(w), "the matmul must read the norm's int8 activations"
    for got, want, what in zip(*res, ("sum", "rmsnorm", "matmul")):
        assert np.array_equal(got, want), what
    assert np.array_equal(res[0][0], a + d)
    assert _rel(res[0][1], NumpyBackend().rmsnorm(a + d, g, 1e-5)) < 1e-6


@pytest.mark.parametrize("attn", ["grid", "split"])
@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0], ids=["q8_k", "q8_1"])
@pytest.mark.parametrize("head_dim,n_head,n_head_kv", [(128, 32, 8), (64, 8, 2)])
def test_decode_attention_quantizes_for_the_o_projection(cuda_backend, synth, t, head_dim, n_head, n_head_kv, attn):
    """"attn": once the o projection has asked for its activation format, the decode attention's
    last block (grid or split kernels) quantizes the output itself (no quanti launch), and the
    attention output and the matmul after it are bit-identical to the unfused kernels."""
    from ntx_engine.backends.cuda_kernels import gqa_split_ok

    assert gqa_split_ok(n_head, n_head_kv, head_dim)
    cfg = ModelConfig(arch="llama", n_layers=1, n_embd=n_head * head_dim, n_ff=64, n_head=n_head,
                      n_head_kv=n_head_kv, head_dim=head_dim, rope_dim=head_dim, rope_base=10000.0,
                      rope_type="norm", rope_freq_scale=1.0, has_rope_freqs=False, rms_eps=1e-5,
                      context_length=512, vocab_size=16, tied_embeddings=True, qkv_bias=False)
    fused, plain = _backends(cfg, 200, attn=attn)
    k = cfg.q_dim
    (_, _, raw), = _weights(synth, [(t, 48)], k, 9)
    rng = np.random.default_rng(head_dim)
    steps = [(rng.standard_normal((n, cfg.q_dim)).astype(np.float32), rng.standard_normal((n, cfg.kv_dim)).astype(
        np.float32), rng.standard_normal((n, cfg.kv_dim)).astype(np.float32)) for n in (70, 1, 1, 1)]
    res = []
    for b in (fused, plain):
        w, start, outs, names = b.matrix(raw, t, (48, k), "wo"), 0, [], []
        for q, kk, v in steps:
            b.k.profile = []
            o = b.attention(b.from_numpy(q), b.from_numpy(kk), b.from_numpy(v), 0, start)
            y = b.matmul(w, o)
            names.append([name for name, *_ in b.k.profile])
            b.k.profile = None
            outs += [b.to_numpy(o), b.to_numpy(y)]
            start += q.shape[0]
        res.append(outs)
        kernel = ("attn_grid_", "attn_cl") if attn == "grid" else "attn_gqa_pv_"
        assert all(any(x.startswith(kernel) for x in step) for step in names[1:]), names  # the variant under test
        if b is fused:  # step 1 learns the format, steps 2 and 3 use it
            assert any(x.startswith("quanti") for x in names[1]), names[1]
            assert not any(x.startswith("quanti") for x in names[2] + names[3]), names[2:]
    for i, (got, want) in enumerate(zip(*res)):
        assert np.array_equal(got, want), f"step {i // 2} {'matmul' if i % 2 else 'attention'} differs"


# "small": rows of 2048, so the Q6_K v, down and output rows take the dp4a kernels (paired decode)
CASES = [("tiny", "q8_0", 4), ("tiny", "q4_k_m", 4), ("smollm2-135m", "q4_1", 3), ("small", "q4_k_m", 2)]


@pytest.mark.parametrize("shape,mix,layers", CASES, ids=[f"{s}-{m}" for s, m, _ in CASES])
def test_fused_model_logits_equal_unfused(cuda_backend, synth, tmp_path, shape, mix, layers):
    """Prefill, decode steps and the CUDA graph: the fused backend gives the unfused one's logits
    bit for bit (so the numpy comparison of test_engine_gpu.py holds for both)."""
    from ntx_engine.backends.cuda_backend import CudaBackend
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.model import Transformer, WeightLoader

    gf, cfg = synthetic_gguf(synth, tmp_path, shape, mix, layers, seed=4)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, 11)
    runs = []
    for fuse, graph in (("all", False), ("none", False), ("all", True)):
        b = CudaBackend(fuse=fuse)
        model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
        runs.append(greedy_logits(model, DecodeGraph(model).forward if graph else model.forward, prompt, 6))
    for i, (f, u, g) in enumerate(zip(*runs)):
        assert np.array_equal(f, u), f"step {i}: fused logits differ from unfused (max {np.abs(f - u).max()})"
        assert np.array_equal(f, g), f"step {i}: fused graph logits differ from fused plain"


@pytest.mark.parametrize("shape,mix,layers", [("tiny", "q8_0", 2), ("small", "q4_k_m", 2)], ids=["q8_0", "q4_k_m"])
def test_decode_graph_holds_the_fused_step(cuda_backend, synth, tmp_path, shape, mix, layers):
    """DecodeGraph runs one step kernel by kernel before its capture, so the fused ops have learnt
    their activation formats (after a GEMM prefill they know none): the graph is the warm step's
    launches plus the argmax (a capture on the first step held a quanti launch a fused op)."""
    from ntx_engine.backends.cuda_backend import CudaBackend
    from ntx_engine.backends.cuda_driver import check, driver
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.model import Transformer, WeightLoader

    gf, cfg = synthetic_gguf(synth, tmp_path, shape, mix, layers, seed=6)
    b = CudaBackend(fuse="all")
    model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, 40)  # a GEMM-sized prefill
    tok = int(np.argmax(model.forward(prompt, 0)[-1]))
    graph = DecodeGraph(model)
    tok = graph.greedy(tok, len(prompt))
    res = driver().cuGraphGetNodes(graph.graph, 0)
    check((res[0],), "cuGraphGetNodes")
    count = int(res[-1])
    b.k.profile = []
    model.forward(np.asarray([tok]), len(prompt) + 1)
    warm = [name for name, *_ in b.k.profile]
    b.k.profile = None
    assert count == len(warm) + 1, (count, warm)
