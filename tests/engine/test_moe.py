"""Mixture-of-experts models (ntx_engine/moe.py) against llama.cpp and against direct formulas.

The oracle models are tiny MoE files with random F32 weights (scripts/tiny_models.py, a
Mixtral-style llama, qwen2moe with a shared expert, qwen3moe with q/k norms) and their
llama.cpp re-quantizations; llama.cpp's logits and greedy tokens were recorded by
scripts/build_fixtures.py. Tolerances are tests/engine/test_oracle.py's: F32 weights and KV
cache in exact mode to 1e-3; quantized variants within 3x the float32 noise floor measured on
our own engine; greedy tokens equal wherever llama.cpp's top-1/top-2 margin clears the noise.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from ntx_common.errors import ModelError
from ntx_engine.backends import make_backend
from ntx_engine.config import ModelConfig
from ntx_engine.engine import Engine, EngineConfig
from ntx_engine.gguf import GGUFFile
from ntx_engine.moe import ExpertTensor, MoeTransformer, MoeWeightLoader, model_classes, route
from ntx_engine.noise import rounding_noise
from ntx_engine.tokenizer import Tokenizer

NEAR_TIE = 0.05
F32_MODELS = ["tiny-llamamoe-F32", "tiny-qwen2moe-F32", "tiny-qwen3moe-F32"]
QUANT_MODELS = ["tiny-llamamoe-Q8_0", "tiny-llamamoe-Q4_K_M", "tiny-qwen2moe-Q8_0", "tiny-qwen3moe-Q8_0"]
ALL = F32_MODELS + QUANT_MODELS
# free-running needs clear llama.cpp margins early on; the int8-activation variants' noise
# (~0.1 logit) leaves only a few such steps, which the teacher-forced test checks anyway
FREE_RUNNING = F32_MODELS + ["tiny-qwen2moe-Q8_0"]


def _engine(path, mode: str = "ggml", kv: str = "f16") -> Engine:
    """An Engine on the numpy backend built from moe.py's loader and model directly."""
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    backend = make_backend("cpu", matmul_mode=mode, kv_dtype=kv)
    loader_cls, model_cls = model_classes(cfg)
    model = model_cls(cfg, loader_cls(gf, cfg, backend).load(), backend, 512)
    return Engine(gf, cfg, model, Tokenizer.from_metadata(gf.metadata), None,
                  EngineConfig(device="cpu", matmul_mode=mode, kv_dtype=kv, n_ctx=512))


@pytest.fixture(scope="module")
def engine(request, oracle_manifest):
    eng = _engine(oracle_manifest["models"][request.param])
    yield eng
    eng.close()


def _oracle(manifest, tag):
    return np.load(manifest["root"] / "oracle" / f"{tag}.npz")


def _noise(eng: Engine, ids: list[int]) -> np.ndarray:
    return rounding_noise(lambda: eng.logits(ids), eng.model.backend)


# --- llama.cpp oracle --------------------------------------------------------------------------
@pytest.mark.parametrize("name", F32_MODELS)
def test_f32_logits_exact(oracle_manifest, record_measurement, name):
    ref = _oracle(oracle_manifest, f"{name}.f32kv")
    eng = _engine(oracle_manifest["models"][name], "exact", "f32")
    assert isinstance(eng.model, MoeTransformer)
    diff = float(np.abs(eng.logits(ref["logits_ids"].tolist()) - ref["logits"]).max())
    record_measurement({"test": "moe-f32-exact-logits", "model": name, "max_abs_diff": f"{diff:.1e}"})
    assert diff < 1e-3, f"{name}: max |logit diff| {diff} vs llama.cpp (F32 weights, F32 KV)"


@pytest.mark.parametrize("engine", ALL, indirect=True)
def test_logits_within_noise_floor(oracle_manifest, record_measurement, engine):
    name = engine.gguf.path.stem
    ref = _oracle(oracle_manifest, name)
    ids = ref["logits_ids"].tolist()
    diff = float(np.abs(engine.logits(ids) - ref["logits"]).max())
    floor = float(_noise(engine, ids).max())
    record_measurement({"test": "moe-ggml-logits", "model": name, "max_abs_diff": f"{diff:.4f}",
                        "noise_floor": f"{floor:.4f}"})
    assert diff <= 3 * floor + 1e-3, f"{name}: |logit diff| {diff:.4f} > 3x noise floor {floor:.4f}"


@pytest.mark.parametrize("engine", ALL, indirect=True)
def test_greedy_teacher_forced(oracle_manifest, record_measurement, engine):
    name = engine.gguf.path.stem
    ref = _oracle(oracle_manifest, name)
    checked = 0
    for i in range(5):
        prompt, want = ref[f"prompt_{i}"].tolist(), np.asarray(ref[f"greedy_{i}"])
        seq = prompt + want[:-1].tolist()
        steps = slice(len(prompt) - 1, len(seq))
        ours = engine.logits(seq)[steps].argmax(-1)
        clear = ref[f"margin_{i}"] > np.maximum(2 * _noise(engine, seq)[steps], NEAR_TIE)
        bad = np.flatnonzero(clear & (ours != want))
        assert bad.size == 0, f"{name} prompt {i} step {bad[0]}: ours {ours[bad[0]]} vs llama.cpp {want[bad[0]]}"
        checked += int(clear.sum())
    record_measurement({"test": "moe-greedy-teacher-forced", "model": name, "clear_steps_checked": checked})
    assert checked > 0, f"{name}: no step was clear of the noise bound; the check compared nothing"


@pytest.mark.parametrize("engine", FREE_RUNNING, indirect=True)
def test_greedy_free_running(oracle_manifest, record_measurement, engine):
    name = engine.gguf.path.stem
    ref = _oracle(oracle_manifest, name)
    compared = 0
    for i in range(5):
        prompt, want, margins = ref[f"prompt_{i}"].tolist(), ref[f"greedy_{i}"].tolist(), ref[f"margin_{i}"]
        got = list(engine.generate(prompt, max_tokens=len(want)))
        noise = _noise(engine, prompt + got[:-1])[len(prompt) - 1:]
        for step, (g, w) in enumerate(zip(got, want)):
            if margins[step] < max(NEAR_TIE, 2 * float(noise[step])):
                break  # llama.cpp itself is within our rounding noise of a tie from here on
            assert g == w, f"{name} prompt {i} step {step}: ours {g} vs llama.cpp {w} (margin {margins[step]:.3f})"
            compared += 1
    record_measurement({"test": "moe-greedy-free-running", "model": name, "tokens_compared": f"{compared}/160"})
    assert compared > 0, f"{name}: no step was clear of the noise bound; the check compared nothing"


def test_engine_load_picks_the_moe_model(oracle_manifest):
    eng = Engine.load(oracle_manifest["models"]["tiny-qwen2moe-Q8_0"], EngineConfig(device="cpu", n_ctx=64))
    model = getattr(eng.model, "model", eng.model)
    assert isinstance(model, MoeTransformer)
    assert eng.config.n_expert == 8 and eng.config.n_expert_used == 4 and eng.config.n_ff_shexp == 512
    eng.close()


# --- routing and the expert sum against direct formulas ----------------------------------------
def _route_direct(row, k, norm):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    p = [v / sum(e) for v in e]
    ids = sorted(range(len(row)), key=lambda j: (-p[j], j))[:k]
    w = [p[j] for j in ids]
    return ids, [v / sum(w) for v in w] if norm else w


@pytest.mark.parametrize("n_expert,k,norm", [(8, 2, True), (8, 4, False), (128, 8, True), (60, 4, False), (4, 4, True)])
def test_route_matches_direct_formula(n_expert, k, norm):
    rng = np.random.default_rng(n_expert * 10 + k)
    logits = (rng.standard_normal((16, n_expert)) * 3).astype(np.float32)
    logits[0, :2] = logits[0, 2]  # a three-way tie: the lower ids win
    ids, w = route(logits, k, norm)
    for t in range(len(logits)):
        want_ids, want_w = _route_direct(logits[t].astype(np.float64).tolist(), k, norm)
        assert ids[t].tolist() == want_ids
        np.testing.assert_allclose(w[t], want_w, rtol=2e-6, atol=1e-7)
    if norm:
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_route_rejects_bad_k():
    with pytest.raises(ValueError):
        route(np.zeros((1, 4), np.float32), 5, True)


def _dequant(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(x for x in reader.tensors if x.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


@pytest.mark.parametrize("name", ["tiny-qwen2moe-F32", "tiny-llamamoe-Q8_0"])
def test_ffn_equals_direct_expert_sum(oracle_manifest, name):
    """One layer's MoE FFN on random h, exact mode: the routed, weighted sum of SwiGLU experts
    (plus the sigmoid-gated shared expert) with matrices dequantized by gguf-py."""
    path = oracle_manifest["models"][name]
    eng = _engine(path, "exact", "f32")
    cfg, lw = eng.config, eng.model.w.layers[1]
    h = np.random.default_rng(0).standard_normal((5, cfg.n_embd)).astype(np.float32)
    got = eng.model.ffn(1, lw, h)
    reader = gguf.GGUFReader(str(path))
    p = "blk.1."
    router, gate, up, down = (_dequant(reader, p + n) for n in
                              ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    for t in range(len(h)):
        ids, w = _route_direct((router @ h[t]).astype(np.float64).tolist(), cfg.n_expert_used, cfg.expert_weights_norm)
        want = sum(wi * down[e] @ (silu(gate[e] @ h[t]) * (up[e] @ h[t])) for e, wi in zip(ids, w))
        if cfg.n_ff_shexp:
            g = _dequant(reader, p + "ffn_gate_inp_shexp.weight") @ h[t]
            sh = _dequant(reader, p + "ffn_down_shexp.weight") @ (
                silu(_dequant(reader, p + "ffn_gate_shexp.weight") @ h[t]) * (_dequant(reader, p + "ffn_up_shexp.weight") @ h[t]))
            want = want + sh / (1 + np.exp(-g))
        np.testing.assert_allclose(got[t], want, rtol=1e-4, atol=1e-5)


def test_expert_ranges_are_the_file_bytes(oracle_manifest):
    """ExpertTensor.expert_range(e) names exactly expert e's bytes (gguf-py's view of the tensor)."""
    path = oracle_manifest["models"]["tiny-llamamoe-Q4_K_M"]
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    layer = MoeWeightLoader(gf, cfg, make_backend("cpu")).layer(0)
    reader = gguf.GGUFReader(str(path))
    raw = path.read_bytes()
    for exps in (layer.gate_exps, layer.up_exps, layer.down_exps):
        where = exps.where
        assert isinstance(where, ExpertTensor) and where.n_expert == cfg.n_expert
        t = next(x for x in reader.tensors if x.name == where.name)
        for e in (0, 3, cfg.n_expert - 1):
            off, n = where.expert_range(e)
            assert raw[off:off + n] == np.ascontiguousarray(t.data[e]).tobytes()
    with pytest.raises(ValueError):
        layer.gate_exps.where.expert_range(cfg.n_expert)


# --- bad files -----------------------------------------------------------------------------------
def _small_moe(path, *, used=2, drop=(), old_layout=False):
    """A 1-layer llama MoE (vocab 32, n_embd 64, 4 experts) with chosen defects."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 64),
                     ("attention.head_count", 2), ("attention.head_count_kv", 2), ("expert_count", 4),
                     ("expert_used_count", used), ("vocab_size", 32)):
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    shapes = {"token_embd.weight": (32, 64), "output_norm.weight": (64,), "output.weight": (32, 64),
              "blk.0.attn_norm.weight": (64,), "blk.0.ffn_norm.weight": (64,),
              **{f"blk.0.attn_{x}.weight": (64, 64) for x in ("q", "k", "v", "output")},
              "blk.0.ffn_gate_inp.weight": (4, 64), "blk.0.ffn_gate_exps.weight": (4, 64, 64),
              "blk.0.ffn_up_exps.weight": (4, 64, 64), "blk.0.ffn_down_exps.weight": (4, 64, 64)}
    if old_layout:
        shapes["blk.0.ffn_gate.0.weight"] = (64, 64)
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile.open(path)


def _load(gf):
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    return MoeWeightLoader(gf, cfg, make_backend("cpu")).load()


def test_small_moe_loads(tmp_path):
    weights = _load(_small_moe(tmp_path / "ok.gguf"))
    assert weights.layers[0].down_exps.where.rows == 64


@pytest.mark.parametrize("used", [5, 0])
def test_bad_expert_used_count(tmp_path, used):
    gf = _small_moe(tmp_path / "bad.gguf", used=used)
    with pytest.raises(ModelError, match="expert_used_count"):
        ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))


@pytest.mark.parametrize("missing", ["blk.0.ffn_up_exps.weight", "blk.0.ffn_gate_inp.weight"])
def test_missing_expert_tensor(tmp_path, missing):
    with pytest.raises(ModelError, match=missing.replace(".", r"\.")):
        _load(_small_moe(tmp_path / "missing.gguf", drop=(missing,)))


def test_old_per_expert_layout_is_refused(tmp_path):
    with pytest.raises(ModelError, match="separate 2-D tensors"):
        _load(_small_moe(tmp_path / "old.gguf", old_layout=True))


def test_streaming_a_moe_layer_is_refused_clearly(tmp_path):
    """The tiers build streamed layers from matrix_specs; a MoE layer is offloaded instead
    (tests/engine/test_moe_offload.py), never streamed whole."""
    gf = _small_moe(tmp_path / "ok.gguf")
    loader = MoeWeightLoader(gf, ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors)), make_backend("cpu"))
    with pytest.raises(ModelError, match="offloads the experts"):
        loader.matrix_specs(0)


def test_qwen3moe_without_experts_is_refused(oracle_manifest):
    gf = GGUFFile.open(oracle_manifest["models"]["tiny-qwen3moe-Q8_0"])
    meta = {k: v for k, v in gf.metadata.items() if k != "qwen3moe.expert_count"}
    with pytest.raises(ModelError, match="expert_count"):
        ModelConfig.from_gguf(meta, frozenset(gf.tensors))


# --- synthetic MoE shapes (scripts/make_synthetic_model.py) ---------------------------------------
@pytest.fixture(scope="module")
def synth():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "make_synthetic_model.py"
    spec = importlib.util.spec_from_file_location("make_synthetic_model", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_synthetic_model"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape", ["tiny-moe", "tiny-qwen2moe", "tiny-qwen3moe"])
def test_synthetic_moe_model_loads_and_routes(synth, tmp_path, shape):
    """The generator's metadata and tensors are what the loader expects for that family, and a
    forward pass routes each token to distinct experts with finite logits."""
    path = tmp_path / f"{shape}.gguf"
    synth.write_model(path, shape, "q4_k_m", seed=1)
    want = synth.MOE_SHAPES[shape]
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    assert (cfg.arch, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp, cfg.head_dim) == (
        want.arch, want.n_expert, want.n_expert_used, want.n_ff_exp, want.n_ff_shexp, want.head_dim)
    assert cfg.qk_norm == (want.arch == "qwen3moe")
    backend = make_backend("cpu")
    model = MoeTransformer(cfg, MoeWeightLoader(gf, cfg, backend).load(), backend, 32)
    assert model.w.layers[0].down_exps.where.ggml_type.name == "Q6_K"  # the q4_k_m mix's down projection
    routes = []
    model.on_route = lambda i, ids: routes.append((i, ids))
    logits = model.forward(np.arange(1, 9) * 37, 0, all_logits=True)
    assert np.isfinite(logits).all() and logits.std() > 0.01
    assert [i for i, _ in routes] == list(range(cfg.n_layers))
    for _, ids in routes:
        assert ids.shape == (8, cfg.n_expert_used)
        assert all(len(set(row)) == cfg.n_expert_used for row in ids.tolist())
        assert len(np.unique(ids)) > cfg.n_expert_used  # tokens do not all pick the same experts
