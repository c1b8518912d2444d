"""End to end on the GPU: the CUDA backend (with and without the decode CUDA graph) against
the numpy backend on synthetic models with real shapes, every weight mix.

Tolerances as in tests/engine/test_oracle.py: activations are quantized to 8 bits inside every
matmul, so a last-bit difference in a float32 sum (the GPU sums in another order) can flip one
int8 step, which a deep model amplifies. The noise floor is measured on the numpy reference
itself (matmul inputs jittered by 1e-6, three seeds, teacher-forced on its greedy tokens):
- prefill logits: max |cuda - numpy| <= 3 x noise floor + 1e-3;
- greedy tokens identical up to the first step whose numpy top-1/top-2 margin is below
  max(0.05, 2 x noise floor) (a near-tie);
- the CUDA-graph decode path bit-identical to the plain CUDA path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from greedy_check import agree_until_tie, greedy  # tests/cuda/greedy_check.py

from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.config import ModelConfig
from ntx_engine.gguf import GGUFFile
from ntx_engine.model import Transformer, WeightLoader
from ntx_engine.noise import rounding_noise

pytestmark = pytest.mark.gpu

NEAR_TIE = 0.05  # the foundation's floor for a near-tie margin (tests/engine/test_oracle.py)
NOISE_REL = 1e-6
STEPS = 24
RESULTS: list[dict] = []

CASES = [("smollm2-135m", "q4_1", None), ("smollm2-135m", "q8_0", None), ("smollm2-135m", "f16", None),
         ("smollm2-135m", "q4_0", None), ("tiny", "q4_k_m", 6), ("tiny", "q5_k_m", 6), ("tiny", "q6_k", 6),
         ]


def _load(path: Path, backend, n_ctx: int) -> Transformer:
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    return Transformer(cfg, WeightLoader(gf, cfg, backend).load(), backend, n_ctx)


def noise_floor(model: Transformer, seq: list[int], n_prompt: int) -> float:
    """Max |logit change| of the numpy model when every matmul input is jittered (ntx_engine.noise)."""
    def logits():
        return model.forward(np.asarray(seq), 0, all_logits=True)[n_prompt - 1:]

    return float(rounding_noise(logits, model.backend, rel=NOISE_REL).max())


@pytest.mark.parametrize("shape,mix,layers", CASES, ids=[f"{s}-{m}" for s, m, _ in CASES])
def test_greedy_tokens_match_numpy(cuda_backend, synth, tmp_path, shape, mix, layers):
    from ntx_engine.backends.cuda_backend import CudaBackend
    from ntx_engine.backends.cuda_graph import DecodeGraph

    path = tmp_path / f"{shape}-{mix}.gguf"
    synth.write_model(path, shape, mix, layers, seed=3)
    n_ctx = 64
    ref = _load(path, NumpyBackend(), n_ctx)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, ref.cfg.vocab_size, 9)
    ref_toks, ref_logits = greedy(ref.forward, prompt, STEPS)

    gpu = _load(path, CudaBackend(), n_ctx)
    toks, logits = greedy(gpu.forward, prompt, STEPS)
    graph = DecodeGraph(_load(path, CudaBackend(), n_ctx))
    g_toks, g_logits = greedy(graph.forward, prompt, STEPS)

    noise = noise_floor(ref, [*prompt.tolist(), *ref_toks[:-1]], len(prompt))
    near_tie = max(NEAR_TIE, 2 * noise)
    n_cmp = min(len(logits), len(ref_logits))
    max_diff = max(float(np.abs(logits[i] - ref_logits[i]).max()) for i in range(n_cmp))
    agree, tie = agree_until_tie(ref_toks, ref_logits, toks, near_tie)
    problems = []
    if g_toks != toks:
        problems.append(f"the CUDA graph replay gave other tokens than the plain CUDA path: {g_toks} vs {toks}")
    if not all(np.array_equal(a, b) for a, b in zip(g_logits, logits)):
        problems.append("graph logits differ from the plain CUDA path")
    if not (agree == STEPS or tie):
        problems.append(f"tokens diverge at step {agree} with numpy margin >= {near_tie:.3f}: {toks} vs {ref_toks}")
    prefill_diff = float(np.abs(logits[0] - ref_logits[0]).max())
    if prefill_diff > 3 * noise + 1e-3:
        problems.append(f"prefill logits differ by {prefill_diff} (noise floor {noise})")
    RESULTS.append(dict(model=f"{shape}-{mix}", layers=ref.cfg.n_layers, steps=STEPS, agree=agree,
                        near_tie=bool(tie), noise_floor=noise, prefill_logit_diff=prefill_diff,
                        max_logit_diff=max_diff, graph_equal=bool(g_toks == toks), problems=problems))
    assert not problems, "; ".join(problems)


def test_zz_write_results(cuda_backend):
    print("\n" + "\n".join(json.dumps(r) for r in RESULTS))
    assert RESULTS, "no end-to-end case ran"
    if os.environ.get("NTX_REPORT_DIR"):
        Path(os.environ["NTX_REPORT_DIR"], "engine_gpu.json").write_text(json.dumps(RESULTS, indent=1))
