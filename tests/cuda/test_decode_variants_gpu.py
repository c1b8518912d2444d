"""The opt-in decode forms of the dp4a kernels (matvec_fast.cuh) against the numpy backend and the
default build:
- NTX_UNROLL_UNITS=1: a lane's units in a loop of compile-time trip count, all activation loads
  first. Each lane adds the same terms in the same order, so matvec outputs and whole-model
  logits must equal the default build's bit for bit.
- NTX_Q4_PAIR=1 / NTX_Q6_PAIR=1: one lane decodes two units that share their weight bytes. Each
  unit's term is the same, but the lanes hold other units, so the warp's sums come in another
  order: the matvecs are held to numpy (rel L2 < 2e-5, as every dp4a matvec test) and the
  logits to the default build within what that matvec tolerance can move them (see
  test_variant_logits_follow_the_default_build).
CPU side (clean builds, no spills): tests/cuda/test_compile.py."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.quants import GGMLType
from tests.cuda.conftest import greedy_logits, synthetic_gguf

pytestmark = pytest.mark.gpu

T = GGMLType
UNROLL = "-DNTX_UNROLL_UNITS=1"
VARIANTS = [UNROLL, "-DNTX_Q4_PAIR=1", "-DNTX_Q6_PAIR=1"]
MATVEC_REL = 2e-5  # rel L2 of a dp4a matvec against numpy, the bound of every matvec test


def _backend(monkeypatch, defines: str = "", **kw):
    """A CUDA backend whose tunable kernels are built with `defines` ("": the default build)."""
    from ntx_engine.backends.cuda_backend import CudaBackend

    monkeypatch.setenv("NTX_CUDA_DEFINES", defines)
    b = CudaBackend(**kw)
    monkeypatch.delenv("NTX_CUDA_DEFINES")
    return b


# rows x k: partial last group, one group, many groups (Q8_0: 14 of 32 blocks), a 1000-row grid
# (Q6_K rows of k = 2304 are not whole 16-byte chunks: those take the float kernels)
SHAPES = [(67, 6144), (37, 2304), (5, 14336), (1000, 4096)]


@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("defines", VARIANTS)
def test_variant_matvec_against_numpy_and_the_default_build(cuda_backend, synth, monkeypatch, t, defines):
    base, other = _backend(monkeypatch), _backend(monkeypatch, defines)
    for rows, k in SHAPES:
        rng = np.random.default_rng(rows + k)
        raw = synth.random_blocks(t, rows * k, rng)
        w_np = NumpyBackend().matrix(raw, t, (rows, k), "w")
        for n in (1, 3, 11):
            x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10, k)).astype(np.float32)
            outs = []
            for b in (base, other):
                w = b.matrix(raw, t, (rows, k), "w")
                b._act_cache = None
                outs.append(b.to_numpy(b.matmul(w, b.from_numpy(x))))
            what = f"{defines} {t.name} {rows}x{k} n={n}"
            assert np.isfinite(outs[1]).all(), f"{what}: unwritten outputs"
            if defines == UNROLL:
                assert np.array_equal(outs[0], outs[1]), f"{what}: max |diff| {np.abs(outs[0] - outs[1]).max()}"
            ref = NumpyBackend().matmul(w_np, x)
            err = np.linalg.norm(outs[1] - ref) / np.linalg.norm(ref)
            assert err < MATVEC_REL, f"{what}: rel L2 {err:.2e} against numpy"


def _rel(out, ref) -> float:
    assert np.isfinite(out).all(), "unwritten or non-finite outputs"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("defines", VARIANTS)
def test_variant_fused_kernels_against_numpy_and_the_default_build(cuda_backend, synth, monkeypatch, defines, n):
    """matvecf_multi (q, k, v of mixed types: fast_row_any) and matvecf_swiglu (n = 1: the paired
    gate/up rows, decode_group2) of the variant build: within MATVEC_REL of numpy, and the same bits
    as the default build for NTX_UNROLL_UNITS."""
    k, npb = 4096, NumpyBackend()  # Q6_K's dp4a path needs k % 2048 == 0
    base, other = _backend(monkeypatch, fuse="all"), _backend(monkeypatch, defines, fuse="all")
    rng = np.random.default_rng(41 + n)
    x = (rng.standard_normal((n, k)) * 2).astype(np.float32)
    mix = [(T.Q4_K, 67), (T.Q4_K, 37), (T.Q6_K, 5)]
    ws = [(t, rows, synth.random_blocks(t, rows * k, rng)) for t, rows in mix]
    outs = []
    for b in (base, other):
        mats = [b.matrix(raw, t, (rows, k), f"w{i}") for i, (t, rows, raw) in enumerate(ws)]
        assert all(b.uses_fast(m) for m in mats)
        b._act_cache = None
        outs.append([b.to_numpy(y) for y in b.matmul_many(mats, b.from_numpy(x))])
    for (t, rows, raw), want, got in zip(ws, *outs):
        assert _rel(got, npb.matmul(npb.matrix(raw, t, (rows, k), "w"), x)) < MATVEC_REL, f"{defines} multi {t.name}"
        if defines == UNROLL:
            assert np.array_equal(got, want), f"{defines} multi {t.name}: differs from the default build"
    for t in (T.Q4_K, T.Q6_K, T.Q8_0):
        rows = 71
        rg, ru = synth.random_blocks(t, rows * k, rng), synth.random_blocks(t, rows * k, rng)
        want, got = [b.to_numpy(b.matmul_swiglu(b.matrix(rg, t, (rows, k), "g"), b.matrix(ru, t, (rows, k), "u"),
                                                b.from_numpy(x))) for b in (base, other)]
        ref = npb.matmul_swiglu(npb.matrix(rg, t, (rows, k), "g"), npb.matrix(ru, t, (rows, k), "u"), x)
        assert _rel(got, ref) < MATVEC_REL, f"{defines} swiglu {t.name} n={n}"
        if defines == UNROLL:
            assert np.array_equal(got, want), f"{defines} swiglu {t.name} n={n}: differs from the default build"


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


CASES = [("tiny", "q8_0", 4), ("tiny", "q4_k_m", 4)]
STEPS = 6


@pytest.mark.parametrize("defines", VARIANTS)
@pytest.mark.parametrize("shape,mix,layers", CASES, ids=[f"{s}-{m}" for s, m, _ in CASES])
def test_variant_logits_follow_the_default_build(cuda_backend, synth, monkeypatch, tmp_path, shape, mix, layers,
                                                 defines):
    """Fused qkv / gate-up kernels included (fused.cu), prefill, decode and the CUDA graph, the
    variant fed the default build's greedy tokens. NTX_UNROLL_UNITS: the same bits. The pairs:
    each matmul of either build is within MATVEC_REL of numpy, so the logits may move by what
    jittering every matmul input of the numpy model by that relative amount moves them (int8
    re-quantization can turn a last-bit difference into one int8 step): per position at most
    3 x that noise floor + 1e-3, the margin tests/cuda/test_engine_gpu.py gives prefill logits."""
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.model import Transformer, WeightLoader

    gf, cfg = synthetic_gguf(synth, tmp_path, shape, mix, layers, seed=9)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 11)
    b = _backend(monkeypatch, "", fuse="all")
    model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
    base = greedy_logits(model, DecodeGraph(model).forward, prompt, STEPS)
    toks = [int(np.argmax(step[-1])) for step in base[:-1]]
    b = _backend(monkeypatch, defines, fuse="all")
    model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
    runs = _forced_logits(model, DecodeGraph(model).forward, prompt, toks)
    if defines == UNROLL:
        for i, (a, p) in enumerate(zip(base, runs)):
            assert np.array_equal(a, p), f"pass {i}: {defines}: logits differ (max {np.abs(a - p).max()})"
        return
    noise = _noise_floor(gf, cfg, [*prompt.tolist(), *toks], MATVEC_REL)
    starts = [0, *range(len(prompt), len(prompt) + STEPS)]  # first position of each pass
    for i, (a, p) in enumerate(zip(base, runs)):
        floor = float(noise[starts[i]:starts[i] + len(a)].max())
        diff = float(np.abs(a - p).max())
        assert diff <= 3 * floor + 1e-3, f"pass {i}: {defines}: logits differ by {diff} (noise floor {floor})"
