"""MoE on the GPU: native/cuda/moe.cu (via backends/cuda_moe.py) against the numpy oracle
(ntx_engine/moe.py, itself checked against llama.cpp in tests/engine/test_moe.py).

- moe_route: the same expert ids as numpy's route() and weights to float32 rounding;
- moe_matvec_<type>: every weight type, gate/up (one input per token) and down (one per slot);
- end to end on synthetic MoE models (Mixtral-style llama, qwen2moe with a shared expert,
  qwen3moe with q/k norms, and one layer of the Qwen3-30B-A3B shape): greedy tokens identical to
  numpy up to the first near-tie (numpy's top-1/top-2 margin below max(0.05, 2 x its float32
  noise floor), as tests/cuda/test_engine_gpu.py), prefill logits within 3 x that floor, and the
  CUDA-graph decode bit-identical to the plain CUDA path.

    python3 -m pytest -m gpu tests/cuda/test_moe_gpu.py
"""

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
from ntx_engine.moe import ExpertTensor, Experts, NumpyMoe, model_classes, route
from ntx_engine.noise import rounding_noise
from ntx_engine.quants import GGMLType

pytestmark = pytest.mark.gpu

NEAR_TIE = 0.05
STEPS = 16
RESULTS: list[dict] = []
CASES = [("tiny-moe", "q4_k_m", None), ("tiny-moe", "q8_0", None), ("tiny-moe", "q4_0", None),
         ("tiny-moe", "f16", None), ("tiny-qwen2moe", "q4_k_m", None), ("tiny-qwen2moe", "q4_1", None),
         ("tiny-qwen3moe", "q4_k_m", None), ("tiny-qwen3moe", "q8_0", None), ("qwen3-30b-a3b", "q4_k_m", 1)]


@pytest.fixture(scope="module")
def cuda_moe(cuda_backend):
    from ntx_engine.backends.cuda_moe import CudaMoe

    return CudaMoe(cuda_backend)


@pytest.mark.parametrize("n_expert,k,norm", [(8, 2, True), (60, 4, False), (128, 8, True), (16, 16, False)])
def test_route_kernel_matches_numpy(cuda_backend, cuda_moe, n_expert, k, norm):
    from ntx_engine.backends.cuda_driver import download

    logits = (np.random.default_rng(n_expert + k).standard_normal((37, n_expert)) * 3).astype(np.float32)
    logits[0, :3] = logits[0, 3]  # a tie: the lower ids first, as numpy's stable sort
    ids, w = cuda_moe.route(cuda_backend.from_numpy(logits), k, norm)
    want_ids, want_w = route(logits, k, norm)
    np.testing.assert_array_equal(download(ids, cuda_backend.stream), want_ids)
    np.testing.assert_allclose(download(w, cuda_backend.stream), want_w, rtol=2e-6, atol=1e-8)


def _experts(synth, t: GGMLType, n_expert: int, rows: int, k: int, rng) -> tuple[ExpertTensor, np.ndarray]:
    raw = synth.random_blocks(t, n_expert * rows * k, rng).reshape(-1)
    return ExpertTensor(f"test.{t.name}", t, n_expert, rows, k, 0), raw


@pytest.mark.parametrize("t", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                               "Q5_K", "Q6_K"])
def test_routed_matvec_matches_numpy(cuda_backend, cuda_moe, synth, t):
    from ntx_engine.backends.cuda_driver import download, upload

    rng = np.random.default_rng(7)
    n, used, n_expert, rows, k = 5, 3, 6, 72, 512
    where, raw = _experts(synth, GGMLType[t], n_expert, rows, k, rng)
    ref_ops = NumpyMoe(NumpyBackend())
    ref_w, gpu_w = Experts(where, ref_ops.experts(raw, where)), Experts(where, cuda_moe.experts(raw, where))
    ids = np.stack([rng.permutation(n_expert)[:used] for _ in range(n)]).astype(np.int32)
    d_ids = upload(cuda_backend.pool, ids, cuda_backend.stream)
    for x in (rng.standard_normal((n, k)), rng.standard_normal((n, used, k))):  # gate/up, then down
        x = x.astype(np.float32)
        want = ref_ops.routed(ref_w, x, ids)
        got = download(cuda_moe.routed(gpu_w, cuda_backend.from_numpy(x), d_ids), cuda_backend.stream)
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale + 1e-6,
                                   err_msg=f"{t}: x {x.shape}")


def _load(path: Path, backend, n_ctx: int):
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    loader_cls, model_cls = model_classes(cfg)
    return model_cls(cfg, loader_cls(gf, cfg, backend).load(), backend, n_ctx)


@pytest.mark.parametrize("shape,mix,layers", CASES, ids=[f"{s}-{m}" for s, m, _ in CASES])
def test_greedy_tokens_match_numpy(cuda_backend, synth, tmp_path, shape, mix, layers):
    from ntx_engine.backends.cuda_backend import CudaBackend
    from ntx_engine.backends.cuda_graph import DecodeGraph

    path = tmp_path / f"{shape}-{mix}.gguf"
    synth.write_model(path, shape, mix, layers, seed=5)
    prompt = np.random.default_rng(13).integers(0, 512, 9)
    ref = _load(path, NumpyBackend(), 64)
    ref_toks, ref_logits = greedy(ref.forward, prompt, STEPS)
    toks, logits = greedy(_load(path, CudaBackend(), 64).forward, prompt, STEPS)
    g_toks, g_logits = greedy(DecodeGraph(_load(path, CudaBackend(), 64)).forward, prompt, STEPS)

    seq = [*prompt.tolist(), *ref_toks[:-1]]
    noise = float(rounding_noise(lambda: ref.forward(np.asarray(seq), 0, all_logits=True)[len(prompt) - 1:],
                                 ref.backend).max())
    agree, tie = agree_until_tie(ref_toks, ref_logits, toks, max(NEAR_TIE, 2 * noise))
    prefill = float(np.abs(logits[0] - ref_logits[0]).max())
    problems = []
    if g_toks != toks or not all(np.array_equal(a, b) for a, b in zip(g_logits, logits)):
        problems.append(f"CUDA graph replay differs from the plain CUDA path: {g_toks} vs {toks}")
    if not (agree == STEPS or tie):
        problems.append(f"tokens diverge at step {agree} away from a near-tie: {toks} vs numpy {ref_toks}")
    if prefill > 3 * noise + 1e-3:
        problems.append(f"prefill logits differ by {prefill} (noise floor {noise})")
    RESULTS.append(dict(model=f"{shape}-{mix}", layers=ref.cfg.n_layers, experts=ref.cfg.n_expert,
                        used=ref.cfg.n_expert_used, agree=agree, steps=STEPS, near_tie=tie, noise_floor=noise,
                        prefill_logit_diff=prefill, problems=problems))
    assert not problems, "; ".join(problems)


def test_zz_write_results(cuda_backend):
    print("\n" + "\n".join(json.dumps(r) for r in RESULTS))
    assert RESULTS, "no end-to-end MoE case ran"
    if os.environ.get("NTX_REPORT_DIR"):
        Path(os.environ["NTX_REPORT_DIR"], "moe_gpu.json").write_text(json.dumps(RESULTS, indent=1))
