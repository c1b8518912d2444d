"""The paired Q6_K decode of the dp4a kernels (NTX_Q6_PAIR, default 1, matvec_fast.cuh: one lane
decodes units s and s + 2 of a half) against the numpy backend and the unit decode
(-DNTX_Q6_PAIR=0). Each unit's term is the same, but the lanes hold other units, so a warp's sums
come in another order: the matvecs are held to numpy (rel L2 < 2e-5, as every dp4a matvec test)
and the logits to the unit build within what that tolerance can move them. The fused kernels
decode Q6_K one unit at a time in their build's lane order, so in each build they must give the
unfused kernels' bits; and every row of a several-token product must equal that token's
one-token product bit for bit (speculative decoding's verify pass against plain decoding).
CPU side (clean builds, no spills): tests/cuda/test_compile.py."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.quants import GGMLType
from tests.cuda.conftest import built_with, greedy_logits, synthetic_gguf

pytestmark = pytest.mark.gpu

T = GGMLType
UNIT = "-DNTX_Q6_PAIR=0"  # the build without the paired decode
MATVEC_REL = 2e-5  # rel L2 of a dp4a matvec against numpy, the bound of every matvec test


# rows x k: a partial last group, many groups, a 1000-row grid (Q6_K's dp4a path needs k % 2048 == 0)
SHAPES = [(67, 6144), (5, 14336), (1000, 4096), (3, 2048)]


def _product(b, raw, t, shape, x):
    w = b.matrix(raw, t, shape, "w")
    assert b.uses_fast(w)
    b._act_cache = None
    return b.to_numpy(b.matmul(w, b.from_numpy(x)))


@pytest.mark.parametrize("t", [T.Q6_K, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_paired_matvec_against_numpy_and_the_unit_build(cuda_backend, synth, monkeypatch, t):
    """Both builds within MATVEC_REL of numpy; Q8_0 (decoded alike in both) gives the same bits
    in both; a token's row of an n-token product (the _n8 kernels) equals its one-token
    product (the _n1 kernels) in the default build."""
    base, unit = built_with(monkeypatch), built_with(monkeypatch, UNIT)
    for rows, k in SHAPES:
        rng = np.random.default_rng(rows + k)
        raw = synth.random_blocks(t, rows * k, rng)
        w_np = NumpyBackend().matrix(raw, t, (rows, k), "w")
        x = (rng.standard_normal((5, k)) * rng.uniform(0.1, 10, k)).astype(np.float32)
        ref = NumpyBackend().matmul(w_np, x)
        got, other = _product(base, raw, t, (rows, k), x), _product(unit, raw, t, (rows, k), x)
        what = f"{t.name} {rows}x{k}"
        for out, build in ((got, "default"), (other, UNIT)):
            assert np.isfinite(out).all(), f"{what} {build}: unwritten outputs"
            err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
            assert err < MATVEC_REL, f"{what} {build}: rel L2 {err:.2e} against numpy"
        if t == T.Q8_0:  # (the unit build is also one without matvec_reg.cuh's Q4_K order)
            assert np.array_equal(got, other), f"{what}: the builds differ for a type they decode alike"
        for i in range(x.shape[0]):
            one = _product(base, raw, t, (rows, k), x[i:i + 1])
            assert np.array_equal(one[0], got[i]), f"{what}: token {i} alone differs from its row of 5"


def test_fused_kernels_follow_their_build(cuda_backend, synth, monkeypatch):
    """matvecf_multi (Q4_K q/k with a Q6_K v: fast_row_any) and matvecf_swiglu (the paired gate/up
    rows) decode Q6_K one unit at a time (their register bounds) but in their build's lane order,
    so in both builds they give the unfused matvecs' bits (matvecf_q6_k: paired in the default
    build), and stay within MATVEC_REL of numpy."""
    k, npb = 4096, NumpyBackend()
    for defines in ("", UNIT):
        fused, plain = built_with(monkeypatch, defines, fuse="all"), built_with(monkeypatch, defines, fuse="none")
        for n in (1, 3):
            rng = np.random.default_rng(41 + n)
            x = (rng.standard_normal((n, k)) * 2).astype(np.float32)
            ws = [(t, rows, synth.random_blocks(t, rows * k, rng)) for t, rows in [(T.Q4_K, 67), (T.Q4_K, 37),
                                                                                 (T.Q6_K, 5)]]
            outs = []
            for b in (fused, plain):
                mats = [b.matrix(raw, t, (rows, k), f"w{i}") for i, (t, rows, raw) in enumerate(ws)]
                b._act_cache = None
                outs.append([b.to_numpy(y) for y in b.matmul_many(mats, b.from_numpy(x))])
            for (t, rows, raw), got, want in zip(ws, *outs):
                what = f"{defines or 'default'} multi {t.name} n={n}"
                assert np.array_equal(got, want), f"{what}: fused and unfused differ"
                ref = npb.matmul(npb.matrix(raw, t, (rows, k), "w"), x)
                assert np.linalg.norm(got - ref) < MATVEC_REL * np.linalg.norm(ref), f"{what} against numpy"
            rg, ru = synth.random_blocks(T.Q6_K, 71 * k, rng), synth.random_blocks(T.Q6_K, 71 * k, rng)
            got, want = [b.to_numpy(b.matmul_swiglu(b.matrix(rg, T.Q6_K, (71, k), "g"),
                                                    b.matrix(ru, T.Q6_K, (71, k), "u"), b.from_numpy(x)))
                         for b in (fused, plain)]
            assert np.array_equal(got, want), f"{defines or 'default'} swiglu Q6_K n={n}: fused and unfused differ"


def _forced_logits(model, forward, prompt, toks) -> list:
    """The prompt's logits (every position), then one pass per token of `toks` through `forward`
    (teacher forcing: both builds see the same sequence even where a near-tie would split them)."""
    logits = [model.forward(prompt, 0, all_logits=True)]
    for i, tok in enumerate(toks):
        logits.append(forward(np.asarray([tok]), len(prompt) + i))
    return logits


def _noise_floor(gf, cfg, seq, rel: float) -> np.ndarray:
    """Per position, max |logit change| of the numpy model when every matmul input is jittered
    by `rel` (ntx_engine.noise, as tests/cuda/test_engine_gpu.py)."""
    from ntx_engine.model import Transformer, WeightLoader
    from ntx_engine.noise import rounding_noise

    npb = NumpyBackend()
    ref = Transformer(cfg, WeightLoader(gf, cfg, npb).load(), npb, 64)
    return rounding_noise(lambda: ref.forward(np.asarray(seq), 0, all_logits=True), npb, rel=rel)


STEPS = 6


def test_paired_logits_follow_the_unit_build(cuda_backend, synth, monkeypatch, tmp_path):
    """A Q4_K_M model whose Q6_K down projections and output take matvecf_q6_k (the "small"
    synthetic shape: k = 2048), prefill, decode and the CUDA graph, the paired build fed the unit
    build's greedy tokens. Each matmul of either build is within MATVEC_REL of numpy, so the
    logits may move by what jittering every matmul input of the numpy model by that relative
    amount moves them (int8 re-quantization can turn a last-bit difference into one int8 step):
    per position at most 3 x that noise floor + 1e-3, the margin tests/cuda/test_engine_gpu.py
    gives prefill logits. The paired kernel must have run."""
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.model import Transformer, WeightLoader

    gf, cfg = synthetic_gguf(synth, tmp_path, "small", "q4_k_m", 2, seed=9)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 11)
    b = built_with(monkeypatch, UNIT, fuse="all")
    model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
    base = greedy_logits(model, DecodeGraph(model).forward, prompt, STEPS)
    toks = [int(np.argmax(step[-1])) for step in base[:-1]]
    b = built_with(monkeypatch, "", fuse="all")
    model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
    model.forward(prompt, 0)
    b.k.profile = []
    model.forward(np.asarray([toks[0]]), len(prompt))  # one plain step, to see which kernels run
    # the paired decode: matvecf_q6_k, or matvec_reg.cu's one-warp Q6_K rows, which add its terms in its order
    assert {"matvecf_q6_k_n1", "matvecr_q6_k_p2"} & {name for name, *_ in b.k.profile}, \
        "no Q6_K weight took the paired dp4a decode"
    b.k.profile = None
    runs = _forced_logits(model, DecodeGraph(model).forward, prompt, toks)
    noise = _noise_floor(gf, cfg, [*prompt.tolist(), *toks], MATVEC_REL)
    starts = [0, *range(len(prompt), len(prompt) + STEPS)]  # first position of each pass
    for i, (a, p) in enumerate(zip(base, runs)):
        floor = float(noise[starts[i]:starts[i] + len(a)].max())
        diff = float(np.abs(a - p).max())
        assert diff <= 3 * floor + 1e-3, f"pass {i}: logits differ by {diff} (noise floor {floor})"
