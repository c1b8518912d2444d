"""Layer skip: the model hash, the calibration profile (against rotation blocks whose cosines are
known exactly, and on SmolLM2 through `ntx-run --calibrate-skip`), the choice of layers, and a
skipping model that really never touches the skipped layers' weights."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from ntx_common.errors import ModelError, UsageError
from ntx_engine import skip
from ntx_engine.cli.run import app
from ntx_engine.engine import Engine, EngineConfig

ENV = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}


# --- hash --------------------------------------------------------------------------------------
def _documented_hash(data: bytes) -> str:
    """The layout skip.HASH_METHOD documents, computed independently on the bytes."""
    size = len(data)
    parts = [size.to_bytes(8, "little"), data[:1 << 20]]
    parts += [data[size * (i + 1) // 17:][:1 << 16] for i in range(16)]
    parts.append(data[max(0, size - (1 << 20)):])
    return hashlib.sha256(b"".join(parts)).hexdigest()


def test_model_hash_is_the_documented_sample_hash(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes()
    f = tmp_path / "m.gguf"
    f.write_bytes(data)
    assert skip.model_hash(f) == _documented_hash(data)
    # a changed header byte, a changed sampled byte, a changed size: all change the hash
    for off in (10, (5 << 20) * 3 // 17 + 5):
        g = bytearray(data)
        g[off] ^= 1
        f.write_bytes(bytes(g))
        assert skip.model_hash(f) != _documented_hash(data)
    f.write_bytes(data + b"x")
    assert skip.model_hash(f) != _documented_hash(data)


def test_model_hash_reads_little_of_a_huge_file(tmp_path):
    f = tmp_path / "huge.gguf"
    with open(f, "wb") as fh:  # sparse: 40 GB of size, no blocks on disk
        fh.truncate(40 << 30)
    before = _bytes_read()
    skip.model_hash(f)
    assert _bytes_read() - before < 4 << 20  # 3 MiB of reads (plus Python's own), not 40 GB


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and friends (the kernel's count)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar line")


# --- choice of layers --------------------------------------------------------------------------
def test_eligible_layers_exclude_first_and_last_quarter():
    assert list(skip.eligible_layers(30)) == list(range(8, 22))
    assert list(skip.eligible_layers(80)) == list(range(20, 60))
    assert list(skip.eligible_layers(4)) == [1, 2]
    assert list(skip.eligible_layers(2)) == []


def _profile(sims):
    return skip.SkipProfile("h", tuple(sims), 10)


def test_choose_by_threshold_and_count():
    # 20 layers: eligible 5..14; the most similar layers of all sit in the protected quarters
    sims = [0.999] * 5 + [0.90, 0.98, 0.95, 0.97, 0.99, 0.91, 0.5, 0.6, 0.7, 0.8] + [0.999] * 5
    p = _profile(sims)
    eligible = set(skip.eligible_layers(20))
    by_t = skip.choose_skip(p, threshold=0.96)
    assert set(by_t) <= eligible
    assert by_t == tuple(i for i in sorted(eligible) if sims[i] > 0.96)
    assert skip.choose_skip(p, count=3) == (6, 8, 9)  # 0.98, 0.97, 0.99
    assert skip.choose_skip(p, count=0) == ()
    with pytest.raises(UsageError, match="allows 0..10"):
        skip.choose_skip(p, count=11)
    with pytest.raises(UsageError, match="exactly one"):
        skip.choose_skip(p, threshold=0.9, count=2)


def test_plan_splits_streamed_and_resident():
    plan = skip.SkipPlan(30, (10, 12, 14), frozenset({12, 14, 20}))
    assert (plan.skipped_streamed, plan.skipped_resident) == (2, 1)
    assert plan.layers == [i for i in range(30) if i not in (10, 12, 14)]
    assert plan.to_dict() == {"skipped_layers": [10, 12, 14], "skipped_streamed": 2, "skipped_resident": 1}
    with pytest.raises(ValueError):
        skip.SkipPlan(30, (30,))
    with pytest.raises(ValueError):
        skip.SkipProfile("h", (0.5, 1.5), 3)


# --- calibration against exact cosines --------------------------------------------------------
class _Rotations:
    """A 'model' whose block i rotates every hidden state by angle theta[i] in the (0, 1) plane
    and scales it: cos(input, output) is exactly cos(theta[i]) for every token."""

    def __init__(self, thetas):
        self.thetas = thetas
        self.cfg = SimpleNamespace(n_layers=len(thetas))
        self.n_ctx = 64
        self.w = SimpleNamespace(tok_embd=np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32))
        self.backend = SimpleNamespace(embed=lambda t, ids: t[ids], to_numpy=lambda x: x)
        self.acquired = []
        self.source = SimpleNamespace(acquire=self.acquired.append, release=lambda i: None)

    def run_layer(self, i, lw, x, pos, start):  # Transformer's hook (a hybrid model replaces it)
        return self.block(i, lw, x, pos, start)

    def block(self, i, lw, x, pos, start):
        c, s = math.cos(self.thetas[i]), math.sin(self.thetas[i])
        y = x.copy()
        y[:, 0], y[:, 1] = c * x[:, 0] - s * x[:, 1], s * x[:, 0] + c * x[:, 1]
        return 1.7 * y if i % 2 else y


def test_layer_similarity_matches_exact_cosines():
    rng = np.random.default_rng(0)
    # the rotation acts on coordinates 0-1 only, so build tokens living in that plane
    model = _Rotations([0.1, 0.5, 1.0, 2.0, 3.0])
    model.w.tok_embd[:, 2:] = 0
    ids = rng.integers(0, 16, 23).tolist()
    got = skip.layer_similarity(model, ids, chunk=5)  # 5 chunks, one short
    np.testing.assert_allclose(got, np.cos(model.thetas), atol=1e-6)
    assert model.acquired == list(range(5)) * 5


def test_layer_similarity_rejects_bad_input():
    model = _Rotations([0.1])
    with pytest.raises(UsageError, match="empty"):
        skip.layer_similarity(model, [])
    with pytest.raises(UsageError, match="context"):
        skip.layer_similarity(model, [1] * 65)


# --- SmolLM2: calibrate, store, skip -----------------------------------------------------------
@pytest.fixture(scope="module")
def linked_model(tmp_path_factory, smollm2_path):
    """The SmolLM2 file seen through a symlink in a temp folder: its profile lands there."""
    d = tmp_path_factory.mktemp("skipmodel")
    link = d / smollm2_path.name
    link.symlink_to(smollm2_path)
    return link


@pytest.fixture(scope="module")
def calibrated(linked_model):
    res = CliRunner().invoke(app, ["--calibrate-skip", "--device", "cpu", "--json", "-m", str(linked_model)], env=ENV)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_calibrate_stores_a_profile_keyed_by_hash(linked_model, calibrated):
    path = linked_model.with_name(linked_model.name + ".skip.json")
    assert calibrated["profile"] == str(path)
    doc = json.loads(path.read_text())
    key = skip.model_hash(linked_model)
    assert doc["format"] == skip.PROFILE_FORMAT and list(doc["profiles"]) == [key]
    prof = skip.load_profile(linked_model)
    assert prof.similarity == tuple(calibrated["similarity"]) and prof.n_layers == 30
    # block 0 turns token embeddings into something else entirely; the middle ones nudge
    assert prof.similarity[0] < 0.5 < min(prof.similarity[8:22])
    # a different file (another hash) has no profile even at the same path
    assert skip.load_profile(linked_model, key="0" * 64) is None


def test_malformed_profile_is_a_clean_error(tmp_path, smollm2_path):
    link = tmp_path / smollm2_path.name
    link.symlink_to(smollm2_path)
    link.with_name(link.name + ".skip.json").write_text("{not json")
    with pytest.raises(ModelError, match="calibrate again"):
        skip.load_profile(link)


def test_skip_without_profile_is_a_usage_error(tmp_path, smollm2_path):
    link = tmp_path / smollm2_path.name
    link.symlink_to(smollm2_path)
    res = CliRunner().invoke(app, ["hi", "--raw", "--device", "cpu", "--skip-layers", "2", "-m", str(link)], env=ENV)
    assert res.exit_code != 0  # run_app (the CLI boundary) prints the UsageError as one `error:` line
    assert isinstance(res.exception, UsageError) and "--calibrate-skip" in str(res.exception)


def test_skipped_layers_are_never_acquired_and_output_is_the_layered_forward(linked_model, calibrated):
    eng = Engine.load(linked_model, EngineConfig(device="cpu", n_ctx=256))
    plan = skip.plan_for(eng, count=4)
    assert len(plan.skipped) == 4 and set(plan.skipped) <= set(range(8, 22))
    assert (plan.skipped_streamed, plan.skipped_resident) == (0, 4)  # nothing streams yet
    ids = eng.tokenize("The capital of France is")
    # oracle: a greedy loop over Transformer.forward(layers=...) written out here
    model, want, seq = eng.model, [], list(ids)
    logits = model.forward(np.asarray(seq), 0, layers=plan.layers)[-1]
    for _ in range(6):
        want.append(int(np.argmax(logits)))
        seq.append(want[-1])
        logits = model.forward(np.asarray(seq[-1:]), len(seq) - 1, layers=plan.layers)[-1]
    skip.apply_skip(eng, plan)
    seen = []
    acquire = eng.model.source.acquire
    eng.model.source.acquire = lambda i: (seen.append(i), acquire(i))[1]
    got = list(eng.generate(ids, 6))
    assert got == want
    assert not set(seen) & set(plan.skipped) and set(seen) == set(plan.layers)


def test_cli_skip_reports_layers_and_split(linked_model, calibrated):
    res = CliRunner().invoke(app, ["The capital of France is", "--raw", "--temperature", "0", "-n", "4", "--device", "cpu",
                                   "--skip-threshold", "0.97", "--json", "-m", str(linked_model)], env=ENV)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    sims = calibrated["similarity"]
    want = [i for i in range(8, 22) if sims[i] > 0.97]
    assert out["skip"] == {"skipped_layers": want, "skipped_streamed": 0, "skipped_resident": len(want)}
    assert len(out["tokens"]) == 4


def test_streamed_layers_come_from_the_tier_plan():
    tiers = ["vram"] * 4 + ["cpu"] * 2 + ["ram"] * 3 + ["storage"] * 3
    plan = SimpleNamespace(tier_of=lambda i: tiers[i])
    eng = SimpleNamespace(model=SimpleNamespace(plan=plan), config=SimpleNamespace(n_layers=12))
    assert skip.streamed_layers(eng) == frozenset(range(6, 12))
    eng.streamed_layers = {1, 2}  # the pipeline's own set wins
    assert skip.streamed_layers(eng) == frozenset({1, 2})
    assert skip.streamed_layers(SimpleNamespace(model=SimpleNamespace(), config=eng.config)) == frozenset()


def test_cli_plan_shows_the_skip_split_and_the_bytes_it_saves(linked_model, calibrated):
    """--plan with a skip option: the layers the profile skips, split by the plan's own tiers
    (streamed = ram/storage), bytes per tier lowered by exactly those layers' bytes, and a
    faster predicted decode. The CPU-only budget makes the later layers stream from storage."""
    args = ["--plan", "--json", "--device", "cpu", "--ram-budget", "150M", "--ctx", "512", "-m", str(linked_model)]
    base = json.loads(CliRunner().invoke(app, args, env=ENV).stdout)
    res = CliRunner().invoke(app, args + ["--skip-layers", "6"], env=ENV)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    sims = calibrated["similarity"]
    want = sorted(sorted(range(8, 22), key=lambda i: -sims[i])[:6])
    tiers = {p["layer"]: p["tier"] for p in out["layers"]}
    sizes = {p["layer"]: p["nbytes"] for p in out["layers"]}
    streamed = [i for i in want if tiers[i] in ("ram", "storage")]
    assert out["skip"]["skipped_layers"] == want and out["skip"]["skipped_streamed"] == len(streamed) > 0
    assert out["skip"]["skipped_resident"] == len(want) - len(streamed)
    for tier, n in out["skip"]["bytes_per_tier"].items():
        assert n == base["bytes_per_tier"][tier] - sum(sizes[i] for i in want if tiers[i] == tier)
    assert out["skip"]["predicted_tok_s"] > base["predicted_tok_s"]
