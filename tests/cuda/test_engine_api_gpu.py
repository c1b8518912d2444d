"""The Python API and `ntx-run` on the GPU: `device="auto"` picks CUDA, the decode step runs as a
CUDA graph with the argmax on the device, and greedy tokens equal the numpy engine's (up to a
near-tie within the model's float32 noise, as in tests/engine/test_oracle.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from ntx_engine.engine import Engine, EngineConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_model(cuda_backend, synth, tmp_path_factory, oracle_manifest):
    return oracle_manifest["models"]["tiny-llama-Q4_K_M"]


def test_auto_device_is_cuda_and_greedy_matches_numpy(tiny_model):
    gpu = Engine.load(tiny_model, EngineConfig(n_ctx=256))
    cpu = Engine.load(tiny_model, EngineConfig(device="cpu", n_ctx=256))
    assert gpu.engine_config.device == "cuda"
    assert type(gpu.model).__name__ == "DecodeGraph"
    ids = cpu.tokenize("Once upon a time, in a small village by the sea,")
    got = list(gpu.generate(ids, max_tokens=24))
    want = list(cpu.generate(ids, max_tokens=24))
    # the numpy engine's own margins decide where a near-tie makes either token legitimate
    logits = cpu.logits(ids + want[:-1])[len(ids) - 1:]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    for step, (g, w) in enumerate(zip(got, want)):
        if margins[step] < 0.05:
            break
        assert g == w, f"step {step}: cuda {g} vs numpy {w} (numpy margin {margins[step]:.3f})"


def test_ntx_run_json_reports_cuda(tiny_model):
    from ntx_engine.cli.run import app

    res = CliRunner().invoke(app, ["hello", "--raw", "--temperature", "0", "-n", "8", "--json",
                                   "-m", str(tiny_model)], env={"NO_COLOR": "1", "COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["device"] == "cuda" and len(out["tokens"]) == 8 and out["decode_tok_s"] > 0
    # the default stack step runs Q8_0 models; this Q4_K_M one decodes layer by layer, and says why
    assert out["stack_decode"]["one_launch"] is False and out["stack_decode"]["why_not"], out["stack_decode"]
