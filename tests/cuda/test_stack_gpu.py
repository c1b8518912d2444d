"""The "stack" decode (backends/cuda_layers.py, native/cuda/layer_q8.cu: every layer of a one-token
step in one persistent launch) against the numpy backend on synthetic models (all-Q8_0; Q4_K_M: Q4_K with
Q6_K v and down rows; llama.cpp's Q4_K_M, whose v and down rows are Q6_K in some layers and Q4_K in the others: two
type mixes in one launch; all-Q4_K; Q5_K_M, the synthetic and llama.cpp's), teacher-forced on numpy's greedy
tokens so every step's logits are compared at the same inputs:
- each decode step's logits within 3 x the numpy model's noise floor + 1e-3 (test_engine_gpu's
  prefill bound; the layer-by-layer CUDA path is held to the same bound in the same test);
- free-running greedy tokens identical to numpy's up to the first near-tie;
- the CUDA graph of the step bit-identical to the plain stack step (the kernel sums in a fixed order), and the
  later steps (the producers' chunk lists copied from the first launch's) bit-identical to the first ones (listed
  in the launch), each block's list within the host's bound (cuda_layers.layer_chunks);
- the stack really ran (`stack_why_not` is None), from the build its down rows take (layer_q8_ks.cu: Q6_K rows as
  K slices, where n_ff is a multiple of 2048; layer_q8.cu), and a model it cannot run falls back with a reason.
Contexts from 1 to ~200 positions: the attention's 32 chunks a KV head are mostly empty, then full; and
Llama-3-8B's heads (8 KV heads: 16 chunks on 132 SMs) at ~600 positions, where a chunk has more (position,
head) scores than the block has 4-lane teams (the scores loop's second round)."""

from __future__ import annotations

import numpy as np
import pytest
from greedy_check import agree_until_tie, greedy  # tests/cuda/greedy_check.py

from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.model import Transformer, WeightLoader
from ntx_engine.noise import rounding_noise
from tests.cuda.conftest import synthetic_gguf

pytestmark = pytest.mark.gpu

NEAR_TIE = 0.05
STEPS = 12
# (shape, mix, layers, prompt length, n_ctx): head_dim 64 (tiny) and 128 (small); the K-quant mixes on "small"; an odd
# group of query heads a KV head ("gqa3": 3, the attention combine's unaligned form)
# (rows of 2048 values: Q6_K rows of 1680 bytes, whole 16-byte pieces for the ring's copies; tiny's are not)
CASES = [("tiny", "q8_0", 4, 5, 64), ("tiny", "q8_0", 3, 180, 256), ("small", "q8_0", 2, 9, 64),
         ("small", "q8_0", 2, 120, 160), ("gqa8", "q8_0", 2, 600, 640), ("small", "q4_k_m", 2, 9, 64),
         ("small", "q4_k_m", 2, 150, 192), ("small", "q4_k", 2, 40, 64), ("gqa3", "q8_0", 2, 200, 256),
         ("wide", "q4_k_m", 2, 30, 64), ("wide", "q8_0", 2, 30, 64),
         # llama.cpp's Q4_K_M: small's 8 layers Q6_K (kind 0) at 0, 3, 6, 7, Q4_K (kind 1) between; wide's 4 layers Q4_K
         # (kind 0) at 0, 1, Q6_K (kind 1) at 2, 3
         ("small", "q4_k_m_lcpp", 8, 40, 64), ("wide", "q4_k_m_lcpp", 4, 70, 128),
         # Q5_K (the K-quant build's dot): Q5_K with Q6_K v and down rows, and llama.cpp's Q5_K_M (two mixes)
         ("small", "q5_k_m", 2, 25, 64), ("wide", "q5_k_m_lcpp", 4, 50, 64)]
# the cases whose Q6_K down rows go as K slices (layer_q8_ks.cu's build: n_ff a multiple of 2048, K-quant matrices
# only: cuda_layers.ks_fits; with Q5_K matrices that build with the Q5_K dot, layer_q8_ks5.cu); the rest load
# layer_q8.cu's
KS_CASES = {("small", "q4_k_m"), ("wide", "q4_k_m"), ("small", "q4_k_m_lcpp"), ("wide", "q4_k_m_lcpp")}
KS5_CASES = {("small", "q5_k_m"), ("wide", "q5_k_m_lcpp")}


def _models(synth, tmp_path, shape, mix, layers, n_ctx, fuse):
    from ntx_engine.backends.cuda_backend import CudaBackend

    gf, cfg = synthetic_gguf(synth, tmp_path, shape, mix, layers, seed=5)
    ref = Transformer(cfg, WeightLoader(gf, cfg, NumpyBackend()).load(), NumpyBackend(), n_ctx)
    out = []
    for f in fuse:
        b = CudaBackend(fuse=f)
        out.append(Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, n_ctx))
    return ref, out


def _forced(model, forward, prompt, toks):
    """Logits of each decode step fed numpy's tokens (the prompt through model.forward)."""
    model.forward(prompt, 0)
    return [forward(np.asarray([t]), len(prompt) + i)[-1] for i, t in enumerate(toks)]


@pytest.mark.parametrize("shape,mix,layers,n_prompt,n_ctx", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
def test_stack_decode_matches_numpy(cuda_backend, synth, tmp_path, shape, mix, layers, n_prompt, n_ctx):
    from ntx_engine.backends.cuda_graph import DecodeGraph

    ref, (stack, plain, graphed) = _models(synth, tmp_path, shape, mix, layers, n_ctx, ("all,stack", "all", "all,stack"))
    prompt = np.random.default_rng(n_prompt).integers(0, ref.cfg.vocab_size, n_prompt)
    ref_toks, ref_logits = greedy(ref.forward, prompt, STEPS)
    seq = [*prompt.tolist(), *ref_toks[:-1]]
    noise = float(rounding_noise(lambda: ref.forward(np.asarray(seq), 0, all_logits=True)[n_prompt - 1:],
                                 ref.backend, rel=1e-6).max())
    bound = 3 * noise + 1e-3

    got = _forced(stack, stack.forward, prompt, ref_toks[:-1])
    assert stack.backend.stack_why_not is None and stack.backend._stack[1] is not None, \
        f"the stack decode did not run: {stack.backend.stack_why_not}"
    base = _forced(plain, plain.forward, prompt, ref_toks[:-1])
    assert plain.backend._stack is None  # "all" leaves it out
    diffs = [float(np.abs(g - r).max()) for g, r in zip(got, ref_logits[1:])]
    base_diffs = [float(np.abs(g - r).max()) for g, r in zip(base, ref_logits[1:])]
    assert np.isfinite(got).all()
    assert max(diffs) <= bound, f"stack logits {diffs} against numpy (bound {bound:.4f}; layer by layer {base_diffs})"
    assert max(base_diffs) <= bound, f"layer-by-layer logits {base_diffs} (bound {bound:.4f})"

    toks, _ = greedy(stack.forward, prompt, STEPS)
    agree, tie = agree_until_tie(ref_toks, ref_logits, toks, max(NEAR_TIE, 2 * noise))
    assert agree == STEPS or tie, f"tokens diverge at step {agree}: {toks} vs {ref_toks}"

    graph = DecodeGraph(graphed)
    g = _forced(graphed, graph.forward, prompt, ref_toks[:-1])
    plain_stack = _forced(stack, stack.forward, prompt, ref_toks[:-1])
    assert all(np.array_equal(a, b) for a, b in zip(g, plain_stack)), "the graph replay differs from the plain step"
    assert all(np.array_equal(a, b) for a, b in zip(plain_stack, got)), "the stack step is not deterministic"
    # the first launch listed every block's ring chunks of each kind its layers have for the later ones: a count (the
    # first word) in the bound; none for a kind the layers do not have
    from ntx_engine.backends.cuda_driver import download
    from ntx_engine.backends.cuda_layers import (CHUNK_MAX, KINDS, KS5_SOURCE, KS_SOURCE, LAYER_FIELDS, SOURCE,
                                                 layer_chunks)

    st, b = stack.backend.stack, stack.backend
    assert st.source == (KS_SOURCE if (shape, mix) in KS_CASES else KS5_SOURCE if (shape, mix) in KS5_CASES
                         else SOURCE), st.source
    counts = download(st.lists, b.stream).reshape(st.blocks, KINDS, CHUNK_MAX + 1)[:, :, 0] & 0xFFFFFFFF
    mixes = []
    for lw in stack.w.layers:
        t = tuple(getattr(lw, n).ggml_type for n in LAYER_FIELDS[:7])
        mixes += [t] if t not in mixes else []
    assert len(mixes) == (2 if mix.endswith("_lcpp") else 1) and st.mixes == mixes
    for k in range(KINDS):
        c = counts[:, k]
        if k < len(mixes):
            assert c.min() >= 1 and c.max() <= layer_chunks(ref.cfg, st.blocks, mixes[k]), (k, c)
        else:
            assert not c.any(), (k, c)


def test_stack_falls_back_with_a_reason(cuda_backend, synth, tmp_path):
    from ntx_engine.backends.cuda_backend import CudaBackend

    gf, cfg = synthetic_gguf(synth, tmp_path, "tiny", "q4_k_m", 2, seed=5)  # Q6_K rows of 256 values: 210 bytes
    b = CudaBackend(fuse="all,stack")
    model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
    ref = CudaBackend(fuse="all")
    other = Transformer(cfg, WeightLoader(gf, cfg, ref).load(), ref, 64)
    prompt = np.arange(7)
    a, c = greedy(model.forward, prompt, 3), greedy(other.forward, prompt, 3)
    assert "not a multiple of 16" in (b.stack_why_not or ""), b.stack_why_not
    assert a[0] == c[0] and all(np.array_equal(x, y) for x, y in zip(a[1], c[1]))


def test_the_default_runs_the_stack_step_and_stack8_takes_q8_0_only(cuda_backend, synth, tmp_path, monkeypatch):
    """The default fusions ("all,stack"): a Q8_0 and a Q4_K_M model decode through the stack step, bit for bit as
    with the stack named ("all,stack"); with "all,stack8" a Q4_K_M model goes layer by layer, bit for bit as "all",
    with the reason named."""
    from ntx_engine.backends.cuda_backend import CudaBackend

    monkeypatch.delenv("NTX_CUDA_FUSE", raising=False)
    prompt = np.arange(9)
    for mix, fuse, named, why in (("q8_0", None, "all,stack", None), ("q4_k_m", None, "all,stack", None),
                                  ("q4_k_m", "all,stack8", "all", "the stack step stack8 takes Q8_0 models")):
        gf, cfg = synthetic_gguf(synth, tmp_path, "small", mix, 2, seed=5)
        runs = []
        for f in (fuse, named):
            b = CudaBackend(fuse=f)
            runs.append((b, greedy(Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64).forward, prompt, 3)))
        (b, (toks, logits)), (_, (toks2, logits2)) = runs
        assert toks == toks2 and all(np.array_equal(x, y) for x, y in zip(logits, logits2)), mix
        if why is None:
            assert b.stack is not None and b.stack_why_not is None
        else:
            assert b.stack is None and why in (b.stack_why_not or ""), b.stack_why_not
