"""Perplexity and top-1 agreement: against llama.cpp's own logits (F32 SmolLM2, F32 KV cache),
on the shipped evaluation text, and through `ntx-run --eval-ppl`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from llama_oracle import _llama  # scripts/ is on pytest's pythonpath
from ntx_common.errors import UsageError
from ntx_engine import perplexity, skip
from ntx_engine.cli.run import app
from ntx_engine.engine import Engine, EngineConfig

TEXT = Path(__file__).resolve().parents[1] / "data" / "python_reference.txt"
ENV = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}


def _nll_from_logits(logits: np.ndarray, ids: list[int]) -> float:
    z = logits[:-1].astype(np.float64)
    nxt = np.asarray(ids[1:])
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    return float(np.sum(lse - z[np.arange(len(nxt)), nxt]))


def test_eval_text_is_long_enough(smollm2_path):
    eng = Engine.load(smollm2_path, EngineConfig(device="cpu", n_ctx=64))
    assert len(eng.tokenize(TEXT.read_text())) >= 20_000


def test_perplexity_matches_llama_cpp(oracle_manifest):
    """F32 weights + F32 KV in exact mode agree with llama.cpp to ~1e-4 in the logits, so the
    perplexity over two 96-token windows must agree to 1e-4 relative."""
    path = oracle_manifest["models"]["smollm2-F32"]
    eng = Engine.load(path, EngineConfig(device="cpu", matmul_mode="exact", kv_dtype="f32", n_ctx=128))
    ids = eng.tokenize(TEXT.read_text()[:4000])[:192]
    ours = perplexity.evaluate(eng.model, ids, window=96)
    llm, total, scored = _llama(path, f32_kv=True), 0.0, 0
    for w in perplexity.windows(ids, 96):
        llm.reset()
        llm.eval(w)
        total += _nll_from_logits(np.asarray(llm.scores[:len(w)]), w)
        scored += len(w) - 1
    ref = math.exp(total / scored)
    assert ours.scored == scored == 190
    assert abs(ours.perplexity - ref) / ref < 1e-4, (ours.perplexity, ref)
    assert 1.0 < ref < 100.0  # technical English: a working model predicts it well


def test_windows_split_and_drop_short_tail():
    assert perplexity.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert perplexity.windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert perplexity.windows(list(range(10)), 4, max_tokens=6) == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(UsageError):
        perplexity.windows([1, 2], 1)


def test_skipping_layers_costs_perplexity_and_agreement(smollm2_path):
    eng = Engine.load(smollm2_path, EngineConfig(device="cpu", n_ctx=128))
    ids = eng.tokenize(TEXT.read_text()[:3000])[:256]
    full = perplexity.evaluate(eng.model, ids, 128)
    same = perplexity.evaluate(eng.model, ids, 128, layers=list(range(30)))
    assert same.perplexity == full.perplexity and same.agreement(full) == 1.0
    plan = skip.SkipPlan(30, tuple(range(10, 18)))
    part = perplexity.evaluate(eng.model, ids, 128, layers=plan.layers)
    assert part.perplexity > full.perplexity * 1.05
    assert 0.0 < part.agreement(full) < 0.95


def test_cli_eval_ppl_with_skip(tmp_path, smollm2_path):
    link = tmp_path / smollm2_path.name
    link.symlink_to(smollm2_path)
    sims = [0.5] * 8 + [0.8 + i / 100 for i in range(14)] + [0.5] * 8  # the most similar: 20, 21
    skip.save_profile(skip.SkipProfile(skip.model_hash(link), tuple(sims), 10, "test"), link)
    text = tmp_path / "t.txt"
    text.write_text(TEXT.read_text()[:600])
    res = CliRunner().invoke(app, ["--eval-ppl", str(text), "--skip-layers", "2", "--ctx", "64", "--device", "cpu",
                                   "--json", "-m", str(link)], env=ENV)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["skipped_layers"] == [20, 21] and out["window"] == 64
    # oracle: the library on the same windows
    eng = Engine.load(link, EngineConfig(device="cpu", n_ctx=64))
    ids = eng.tokenize(text.read_text())
    full = perplexity.evaluate(eng.model, ids, 64)
    part = perplexity.evaluate(eng.model, ids, 64, layers=skip.SkipPlan(30, (20, 21)).layers)
    assert out["ppl_tokens"] == full.scored
    assert out["perplexity_full"] == pytest.approx(full.perplexity, rel=1e-6)
    assert out["perplexity"] == pytest.approx(part.perplexity, rel=1e-6)
    assert out["top1_agreement"] == pytest.approx(part.agreement(full))
