"""The pipelined dp4a rows (-DNTX_FAST_ASYNC=S: S cp.async shared-memory stages a warp) against
the default register-staged build: the same terms added in the same order, so matvec outputs and
whole-model logits must be equal bit for bit; and against the numpy backend (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.config import ModelConfig
from ntx_engine.quants import GGMLType

pytestmark = pytest.mark.gpu

T = GGMLType
STAGES = [2, 3, 4]


def _backend(monkeypatch, stages: int, **kw):
    """A CUDA backend whose dp4a kernels are built with `stages` (0: the default build)."""
    from ntx_engine.backends.cuda_backend import CudaBackend

    monkeypatch.setenv("NTX_CUDA_DEFINES", f"-DNTX_FAST_ASYNC={stages}" if stages else "")
    b = CudaBackend(**kw)
    monkeypatch.delenv("NTX_CUDA_DEFINES")
    return b


# rows x k: partial last group, one group, many groups (Q8_0: 14 of 32 blocks), a 1000-row grid
SHAPES = [(67, 6144), (37, 2304), (5, 14336), (1000, 4096)]


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_pipelined_matvec_equals_the_default_build(cuda_backend, synth, monkeypatch, t, stages):
    base, piped = _backend(monkeypatch, 0), _backend(monkeypatch, stages)
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


CASES = [("tiny", "q8_0", 4), ("tiny", "q4_k_m", 4)]


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("shape,mix,layers", CASES, ids=[f"{s}-{m}" for s, m, _ in CASES])
def test_pipelined_model_logits_equal_the_default_build(cuda_backend, synth, monkeypatch, tmp_path, shape, mix,
                                                         layers, stages):
    """Fused qkv / gate-up kernels included (fused.cu), prefill, decode and the CUDA graph."""
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.gguf import GGUFFile
    from ntx_engine.model import Transformer, WeightLoader

    path = tmp_path / f"{shape}-{mix}.gguf"
    synth.write_model(path, shape, mix, layers, seed=9)
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 11)
    runs = []
    for s in (0, stages):
        b = _backend(monkeypatch, s, fuse="all")
        model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 64)
        graph = DecodeGraph(model)
        logits = [model.forward(prompt, 0, all_logits=True)]
        tok = int(np.argmax(logits[0][-1]))
        for i in range(6):
            logits.append(graph.forward(np.asarray([tok]), len(prompt) + i))
            tok = int(np.argmax(logits[-1][-1]))
        runs.append(logits)
    for i, (a, p) in enumerate(zip(*runs)):
        assert np.array_equal(a, p), f"step {i}: S={stages} logits differ (max {np.abs(a - p).max()})"
