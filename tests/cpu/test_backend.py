"""Whole models on the native CPU backend against the numpy backend (the oracle), in ggml mode.

Both engines compute the same int8 products; they differ in float32 summation order only, and a
last-bit difference before an 8-bit activation quantization flips one int8 step that 30 layers
amplify. The yardstick is the numpy engine's own rounding noise (`ntx_engine.noise`, as in
tests/engine/test_oracle.py): logits within 3x that floor, and teacher-forced greedy tokens equal
at every step whose numpy top-1/top-2 margin clears max(0.05, 2x the noise at that position).
"""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.engine import Engine, EngineConfig
from ntx_engine.noise import rounding_noise

# every weight type appears in one of these files (per-type kernel tests are in test_matmul.py);
# the SmolLM2 runs cost ~1 min each on the 2-core CI machine, the tiny models seconds
TINY = ["tiny-llama-" + v for v in ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K")] + ["tiny-qwen2-Q8_0"]
MODELS = ["smollm2-Q4_1", "smollm2-Q4_K_M", "smollm2-BF16"] + TINY
GREEDY = ["smollm2-Q4_1"] + TINY
PROMPTS = 3
NEAR_TIE = 0.05


@pytest.fixture(scope="module")
def pair(request, oracle_manifest):
    path = oracle_manifest["models"][request.param]
    native = Engine.load(path, EngineConfig(device="cpu", n_ctx=512))
    numpy_ = Engine.load(path, EngineConfig(device="numpy", n_ctx=512))
    assert native.model.backend.name == "cpu" and numpy_.model.backend.name == "numpy"
    yield request.param, native, numpy_
    native.model.backend.close()
    native.close()
    numpy_.close()


def _noise(eng: Engine, ids: list[int]) -> np.ndarray:
    return rounding_noise(lambda: eng.logits(ids), eng.model.backend, (1, 2, 3), 1e-6)


@pytest.mark.parametrize("pair", MODELS, indirect=True)
def test_logits_within_noise_floor(oracle_manifest, record_measurement, pair):
    name, native, numpy_ = pair
    ids = np.load(oracle_manifest["root"] / "oracle" / f"{name}.npz")["logits_ids"].tolist()
    ours, ref = native.logits(ids), numpy_.logits(ids)
    diff = float(np.abs(ours - ref).max())
    floor = float(_noise(numpy_, ids).max())
    record_measurement({"test": "cpu-native-vs-numpy-logits", "model": name, "max_abs_diff": f"{diff:.4f}",
                        "noise_floor": f"{floor:.4f}", "top1": f"{np.mean(ours.argmax(-1) == ref.argmax(-1)):.2f}"})
    assert np.isfinite(ours).all()
    assert diff <= 3 * floor + 1e-3, f"{name}: native vs numpy {diff:.4f} exceeds 3x the noise floor {floor:.4f}"


@pytest.mark.parametrize("pair", GREEDY, indirect=True)
def test_greedy_teacher_forced(oracle_manifest, record_measurement, pair):
    name, native, numpy_ = pair
    ref = np.load(oracle_manifest["root"] / "oracle" / f"{name}.npz")
    checked = agreed = 0
    for i in range(PROMPTS):
        prompt, want = ref[f"prompt_{i}"].tolist(), ref[f"greedy_{i}"].tolist()
        seq = prompt + want[:-1]
        steps = slice(len(prompt) - 1, len(seq))
        ours, theirs = native.logits(seq)[steps], numpy_.logits(seq)[steps]
        top2 = np.sort(theirs, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > np.maximum(2 * _noise(numpy_, seq)[steps], NEAR_TIE)
        same = ours.argmax(-1) == theirs.argmax(-1)
        checked += int(clear.sum())
        agreed += int((same & clear).sum())
        bad = np.flatnonzero(clear & ~same)
        assert bad.size == 0, f"{name} prompt {i}: clear steps {bad.tolist()} chose different tokens"
    record_measurement({"test": "cpu-native-greedy", "model": name, "clear_steps": checked, "agreed": agreed})
    assert checked > 0, f"{name}: no step had a clear margin; the comparison checked nothing"


def test_weights_stay_raw_blocks(oracle_manifest):
    """The point of the backend: the matrices are the file's bytes, not a float32 copy."""
    path = oracle_manifest["models"]["smollm2-Q4_1"]
    eng = Engine.load(path, EngineConfig(device="cpu", n_ctx=64))
    try:
        lw = eng.model.w.layers[0]
        want = eng.gguf.tensors["blk.0.ffn_up.weight"]
        assert lw.w_up.nbytes == 1536 * 576 // 32 * 20  # Q4_1: 20 bytes per 32 weights
        assert np.shares_memory(lw.w_up.raw, np.frombuffer(eng.gguf.tensor_data("blk.0.ffn_up.weight"), np.uint8))
        assert int(want.ggml_type) == 3
    finally:
        eng.model.backend.close()
        eng.close()


def test_device_names_pick_the_backends():
    """'cpu' is the native backend (ggml mode), 'numpy' the oracle; exact mode stays on numpy."""
    from ntx_common.errors import UsageError
    from ntx_engine.backends import make_backend
    from ntx_engine.backends.cpu_native import NativeCpuBackend
    from ntx_engine.backends.numpy_backend import NumpyBackend

    native = make_backend("cpu", matmul_mode="ggml", kv_dtype="f16")
    assert type(native) is NativeCpuBackend and native.name == "cpu"
    native.close()
    assert type(make_backend("numpy", matmul_mode="ggml")) is NumpyBackend
    assert type(make_backend("cpu", matmul_mode="exact")) is NumpyBackend
    with pytest.raises(UsageError, match="numpy"):
        make_backend("tpu")


def test_cli_device_cpu_generates_what_the_native_engine_does(oracle_manifest):
    """`ntx-run --device cpu` runs the native backend: its greedy tokens are the API's."""
    import json

    from typer.testing import CliRunner

    from ntx_engine.cli.run import app

    path = oracle_manifest["models"]["tiny-llama-Q4_K_M"]
    res = CliRunner().invoke(app, ["Once upon a time", "--model", str(path), "--device", "cpu", "--raw",
                                   "--temperature", "0", "--max-tokens", "8", "--ctx", "64", "--json"],
                             env={"NO_COLOR": "1", "COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    eng = Engine.load(path, EngineConfig(device="cpu", n_ctx=64))
    try:
        want = list(eng.generate(eng.tokenize("Once upon a time"), 8))
    finally:
        eng.model.backend.close()
        eng.close()
    assert doc["device"] == "cpu" and doc["tokens"] == want
