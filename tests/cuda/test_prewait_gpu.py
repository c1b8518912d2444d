"""The dp4a kernels' two load arrangements against the builds without them: the first weight
group of each warp's row loaded before the PDL wait (NTX_PRE_WAIT, default 1) and the decode
gate/up kernel streaming both rows side by side (NTX_SWIGLU_PAIR, default 1), and the grid
attention's first K/V loads before its PDL wait (NTX_AG_PRE_WAIT, default 1; the tiny and the
CASES models decode through the grid kernel), and the fused norm's weights loaded before its PDL
wait (NTX_NORM_PRE_WAIT, default 1). Each adds the same terms in the same order, so
matvec outputs and whole-model logits must be equal bit for bit; the matvecs are also held to the
numpy backend (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.quants import GGMLType
from tests.cuda.conftest import built_with, greedy_logits, synthetic_gguf

pytestmark = pytest.mark.gpu

T = GGMLType


# rows x k: partial last group, one group, many groups (Q8_0: 14 of 32 blocks), a 1000-row grid
SHAPES = [(67, 6144), (37, 2304), (5, 14336), (1000, 4096)]


@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_prewait_matvec_equals_the_build_without(cuda_backend, synth, monkeypatch, t):
    base, other = built_with(monkeypatch), built_with(monkeypatch, "-DNTX_PRE_WAIT=0")
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
            assert np.isfinite(outs[0]).all(), f"{t.name} {rows}x{k} n={n}: unwritten outputs"
            assert np.array_equal(outs[0], outs[1]), \
                f"{t.name} {rows}x{k} n={n}: max |diff| {np.abs(outs[0] - outs[1]).max()}"
            ref = NumpyBackend().matmul(w_np, x)
            err = np.linalg.norm(outs[0] - ref) / np.linalg.norm(ref)
            assert err < 2e-5, f"{t.name} {rows}x{k} n={n}: rel L2 {err:.2e} against numpy"


CASES = [("tiny", "q8_0", 4), ("tiny", "q4_k_m", 4), ("small", "q4_k_m", 2)]


@pytest.mark.parametrize("defines", ["-DNTX_PRE_WAIT=0", "-DNTX_SWIGLU_PAIR=0", "-DNTX_PRE_WAIT=0 -DNTX_SWIGLU_PAIR=0",
                                     "-DNTX_AG_PRE_WAIT=0", "-DNTX_NORM_PRE_WAIT=0", "-DNTX_AG_PV_TREE=0"])
@pytest.mark.parametrize("shape,mix,layers", CASES, ids=[f"{s}-{m}" for s, m, _ in CASES])
def test_default_logits_equal_the_builds_without(cuda_backend, synth, monkeypatch, tmp_path, shape, mix, layers,
                                                 defines):
    """Fused qkv / gate-up kernels included (fused.cu), prefill, decode and the CUDA graph."""
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.model import Transformer, WeightLoader

    gf, cfg = synthetic_gguf(synth, tmp_path, shape, mix, layers, seed=9)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 11)
    runs = []
    for d in ("", defines):
        b = built_with(monkeypatch, d, fuse="all")
        model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
        runs.append(greedy_logits(model, DecodeGraph(model).forward, prompt, 6))
    for i, (a, p) in enumerate(zip(*runs)):
        assert np.array_equal(a, p), f"step {i}: {defines}: logits differ (max {np.abs(a - p).max()})"
