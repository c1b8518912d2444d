"""MoE expert offload on the GPU (ntx_engine/moe_offload.py, backends/cuda_moe.CudaExpertSlots):
synthetic tiny MoE models of each family, loaded all-resident on CUDA (the oracle: the resident
CUDA MoE path, itself checked against numpy in tests/cuda/test_moe_gpu.py) and with the experts
offloaded:

- `gpu` side, a VRAM expert cache of n_used + 1 slots (lru and lfu): misses, evictions and a
  24-token prefill that selects more distinct experts than there are slots (groups). The routed
  kernels read the same bytes from cache slots instead of the resident tensor: greedy tokens and
  every step's logits must be bit-identical.
- `cpu` side (native CPU kernels from pinned RAM, when built): different arithmetic (int8 dot
  products on the host), so tokens must agree up to the first near-tie, as test_moe_gpu.py.

    python3 -m pytest -m gpu tests/cuda/test_moe_offload_gpu.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from greedy_check import agree_until_tie, greedy  # tests/cuda/greedy_check.py

pytestmark = pytest.mark.gpu

NEAR_TIE = 0.05
STEPS = 12
RESULTS: list[dict] = []
CASES = [("tiny-moe", "q4_k_m"), ("tiny-moe", "q8_0"), ("tiny-qwen2moe", "q4_k_m"), ("tiny-qwen3moe", "q4_k_m")]


def _model(path: Path, **kw):
    from ntx_engine.backends.cuda_backend import CudaBackend
    from ntx_engine.config import ModelConfig
    from ntx_engine.engine import EngineConfig, load_model
    from ntx_engine.gguf import GGUFFile
    from ntx_engine.planner import Links

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    links = Links(vram=3e12, h2d=5e10, storage=1e9, cpu=5e10, source="test")
    return load_model(gf, cfg, CudaBackend(), EngineConfig(device="cuda", n_ctx=64, links=links, **kw))


@pytest.fixture(scope="module")
def models(synth, tmp_path_factory):
    out = {}
    for shape, mix in CASES:
        path = tmp_path_factory.mktemp("moe") / f"{shape}-{mix}.gguf"
        synth.write_model(path, shape, mix, None, seed=11)
        out[shape, mix] = path
    return out


def _greedy(model, prompt):
    return greedy(model.forward, prompt, STEPS)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("shape,mix", CASES)
def test_gpu_cache_is_bit_identical_to_resident(cuda_backend, synth, models, shape, mix, policy):
    prompt = np.random.default_rng(7).integers(0, 512, 24)
    ref_toks, ref_logits = _greedy(_model(models[shape, mix]), prompt)
    used = synth.MOE_SHAPES[shape].n_expert_used
    model = _model(models[shape, mix], expert_slots=used + 1, expert_cache=policy, moe_experts="gpu")
    assert model.offload is not None
    model.offload.reset_stats()
    toks, logits = _greedy(model, prompt)
    st = model.offload.stats()
    diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits))
    RESULTS.append(dict(model=f"{shape}-{mix}", side="gpu", policy=policy, slots=st["slots"],
                        max_logit_diff=diff, tokens_equal=toks == ref_toks, cache=st["cache"]))
    model.source.close()
    assert toks == ref_toks, f"{toks} vs resident {ref_toks}"
    assert diff == 0.0, f"logits differ from the resident CUDA run by {diff}"
    assert st["cache"]["misses"] > 0 and st["cache"]["evictions"] > 0


@pytest.mark.parametrize("shape,mix", CASES)
def test_cpu_experts_match_resident_up_to_near_ties(cuda_backend, models, shape, mix):
    from ntx_engine.backends.cpu_kernels import load_module

    if load_module() is None:
        pytest.skip("the native CPU kernels (native/cpu) are not built here: no CPU-side experts")
    from ntx_engine.noise import rounding_noise

    prompt = np.random.default_rng(7).integers(0, 512, 24)
    ref_toks, ref_logits = _greedy(_model(models[shape, mix]), prompt)
    model = _model(models[shape, mix], moe_experts="cpu")
    toks, logits = _greedy(model, prompt)
    oracle = _numpy_model(models[shape, mix])  # the float32 noise floor, as test_moe_gpu.py
    noise = float(rounding_noise(lambda: oracle.forward(prompt, 0, all_logits=True), oracle.backend).max())
    agree, tie = agree_until_tie(ref_toks, ref_logits, toks, max(NEAR_TIE, 2 * noise))
    diff = float(np.abs(logits[0] - ref_logits[0]).max())
    RESULTS.append(dict(model=f"{shape}-{mix}", side="cpu", agree=agree, steps=STEPS, near_tie=tie,
                        prefill_logit_diff=diff, noise_floor=noise))
    model.source.close()
    assert agree == STEPS or tie, f"tokens diverge at step {agree} away from a near-tie: {toks} vs {ref_toks}"
    assert diff <= 3 * noise + 1e-3, f"prefill logits differ from the resident CUDA run by {diff} (noise {noise})"


def _numpy_model(path: Path):
    from ntx_engine.backends.numpy_backend import NumpyBackend
    from ntx_engine.config import ModelConfig
    from ntx_engine.gguf import GGUFFile
    from ntx_engine.moe import model_classes

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    loader_cls, model_cls = model_classes(cfg)
    backend = NumpyBackend()
    return model_cls(cfg, loader_cls(gf, cfg, backend).load(), backend, 64)


def test_zz_write_results(cuda_backend):
    print("\n" + "\n".join(json.dumps(r) for r in RESULTS))
    assert RESULTS, "no offload case ran"
    if os.environ.get("NTX_REPORT_DIR"):
        Path(os.environ["NTX_REPORT_DIR"], "moe_offload_gpu.json").write_text(json.dumps(RESULTS, indent=1))
