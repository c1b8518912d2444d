"""MoE expert offload (ntx_engine/moe_offload.py, moe_plan.py): with experts in RAM and a
small expert cache that must miss and evict, or computed by the CPU side, the logits and
greedy tokens are those of the all-resident run (the oracle: the resident MoE engine that
tests/engine/test_moe.py checks against llama.cpp). On the numpy and native CPU backends
the same products run over the same bytes, so equality is bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from ntx_common.errors import UsageError
from ntx_engine.engine import Engine, EngineConfig
from ntx_engine.planner import Links, PlanError

LINKS = Links(vram=1e11, h2d=1e10, storage=1e9, cpu=5e9, source="test")
MODELS = ["tiny-llamamoe-Q8_0", "tiny-llamamoe-Q4_K_M", "tiny-qwen2moe-Q8_0", "tiny-qwen3moe-Q8_0"]
DEVICES = ["numpy", "cpu"]  # "cpu" is the native kernels where they are built (else numpy again)
PROMPT = list(range(20, 60))  # 40 tokens: the prefill pass selects every expert: groups


def _run(path, device: str, **kw) -> tuple[np.ndarray, list[int], dict | None]:
    eng = Engine.load(path, EngineConfig(device=device, n_ctx=256, links=LINKS, **kw))
    try:
        logits = eng.logits(PROMPT)
        eng.reset()
        toks = list(eng.generate(PROMPT[:6], 10))
        return logits, toks, eng.tier_stats().get("experts")
    finally:
        eng.close()


@pytest.fixture(scope="module")
def resident(oracle_manifest):
    cache = {}

    def get(name, device):
        if (name, device) not in cache:
            cache[name, device] = _run(oracle_manifest["models"][name], device)
        return cache[name, device]
    return get


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cache_misses_and_evictions_give_the_resident_run(oracle_manifest, resident, name, device, policy):
    ref_logits, ref_toks, none = resident(name, device)
    assert none is None  # the resident run has no offload
    used = {"tiny-qwen2moe-Q8_0": 4, "tiny-qwen3moe-Q8_0": 4}.get(name, 2)
    logits, toks, st = _run(oracle_manifest["models"][name], device, expert_slots=used + 1, expert_cache=policy)
    assert np.array_equal(logits, ref_logits), f"{name}: max diff {np.abs(logits - ref_logits).max()}"
    assert toks == ref_toks
    c = st["cache"]
    assert c["misses"] > 0 and c["evictions"] > 0 and c["hits"] + c["misses"] > 0
    # tokens through the layers: the 6-token prompt, then 9 decode steps (the 10th token is not run)
    assert st["policy"] == policy and st["tokens"] == 6 + 9 and st["selections"]["cpu"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_cpu_experts_give_the_resident_run(oracle_manifest, resident, name, device):
    ref_logits, ref_toks, _ = resident(name, device)
    logits, toks, st = _run(oracle_manifest["models"][name], device, moe_experts="cpu")
    assert np.array_equal(logits, ref_logits) and toks == ref_toks
    assert st["cache"] is None and st["layers_cpu"] == 2 and st["selections"]["gpu"] == 0


def test_decode_lookups_equal_selections(oracle_manifest):
    """One token per pass: every selected expert is one lookup (hits + misses == selections)."""
    eng = Engine.load(oracle_manifest["models"]["tiny-llamamoe-Q8_0"],
                      EngineConfig(device="numpy", n_ctx=64, links=LINKS, expert_slots=3))
    try:
        list(eng.generate([5], 12))  # a 1-token prompt: every pass is one token
        st = eng.tier_stats()["experts"]
        c = st["cache"]
        assert c["hits"] + c["misses"] == st["selections"]["gpu"] == 12 * 2 * 2
        per_layer = c["per_layer"]
        assert sum(v["hits"] + v["misses"] for v in per_layer.values()) == st["selections"]["gpu"]
        assert st["h2d_bytes_per_token"] == c["misses"] * st["slot_bytes"] / 12
        assert eng.last_run_stats["experts"] == st  # what reports read
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["tiny-llamamoe-Q8_0", "tiny-qwen3moe-Q8_0"])
def test_prefetch_changes_hits_not_tokens(oracle_manifest, name):
    """The next-layer prefetch (moe_prefetch.py) only moves bytes earlier: same tokens; its
    useful guesses are hits the plain cache would not have had unless already cached."""
    runs = {}
    for pf in (False, True):
        eng = Engine.load(oracle_manifest["models"][name],
                          EngineConfig(device="numpy", n_ctx=64, links=LINKS, expert_slots=6))
        try:
            eng.model.offload.configure(prefetch=pf)
            runs[pf] = list(eng.generate([3], 24)), eng.tier_stats()["experts"]
        finally:
            eng.close()
    (toks, plain), (toks_pf, pf) = runs[False], runs[True]
    assert toks == toks_pf and plain["prefetch"] is None
    p, c = pf["prefetch"], pf["cache"]
    assert 0 < p["useful"] <= p["issued"] and c["hits"] + c["misses"] == pf["selections"]["gpu"]
    assert c["copied_bytes"] == (c["misses"] * pf["slot_bytes"] + p["copied_bytes"])
    assert p["copied_bytes"] == p["issued"] * pf["slot_bytes"]


def test_mixed_expert_layouts_get_separate_pools(oracle_manifest):
    """llama.cpp's Q4_K_M quantizes ffn_down_exps differently per layer (gguf-py reads the
    types): each layout gets its own slot pool, and the requested slots are all handed out."""
    import gguf

    path = oracle_manifest["models"]["tiny-llamamoe-Q4_K_M"]
    types = {t.name: int(t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors if "down_exps" in t.name}
    eng = Engine.load(path, EngineConfig(device="numpy", n_ctx=64, links=LINKS, expert_slots=5))
    try:
        pools = eng.model.offload.pools
        assert len(pools) == len(set(types.values())) == 2
        assert sum(p.cache.n_slots for p in pools) == 5 and sorted(p.cache.n_slots for p in pools) == [2, 3]
        for p in pools:
            assert {types[f"blk.{i}.ffn_down_exps.weight"] for i in p.layers} == {int(p.wheres[2].ggml_type)}
    finally:
        eng.close()


def test_experts_on_storage_give_the_resident_run(oracle_manifest, resident):
    """RAM budget 0: every miss reads the expert's three byte ranges from the file."""
    name = "tiny-llamamoe-Q8_0"
    ref_logits, ref_toks, _ = resident(name, "numpy")
    logits, toks, st = _run(oracle_manifest["models"][name], "numpy", expert_slots=3, ram_budget=0)
    assert np.array_equal(logits, ref_logits) and toks == ref_toks


def test_budget_too_small_for_the_resident_model_offloads(oracle_manifest):
    """A VRAM budget below the model but above its dense part: the planner offloads the
    experts by itself and sizes the cache from what is left (the margin is budget / 16)."""
    path = oracle_manifest["models"]["tiny-llamamoe-Q8_0"]
    forced = Engine.plan_model(path, EngineConfig(device="numpy", n_ctx=64, links=LINKS, expert_slots=2))
    r, slot = forced.reserves, forced.experts.slot_bytes
    base = r.kv_cache + r.workspace + forced.head_bytes + sum(p.nbytes for p in forced.placements)
    budget = int((base + 5.5 * slot) * 16 / 15)
    assert not Engine.plan_model(path, EngineConfig(device="numpy", n_ctx=64, links=LINKS,
                                                    vram_budget=budget + 16 * slot)).streamed
    plan = Engine.plan_model(path, EngineConfig(device="numpy", n_ctx=64, links=LINKS, vram_budget=budget,
                                                moe_experts="gpu"))
    e = plan.as_dict()["experts"]
    assert plan.strategy == "experts offloaded" and e["n_slots"] == 5
    assert e["predicted_miss_rate"] == pytest.approx(1 - 5 / 16)
    assert e["predicted_bytes_per_token"]["h2d"] == pytest.approx(2 * slot * (1 - 5 / 16) * 2)
    # without --moe-experts the numpy backend computes offloaded experts on the "CPU" side
    auto = Engine.plan_model(path, EngineConfig(device="numpy", n_ctx=64, links=LINKS, vram_budget=budget))
    assert auto.strategy == "experts offloaded" and auto.experts.sides == ("cpu", "cpu")


def test_budget_without_room_for_the_used_experts_is_refused(oracle_manifest):
    path = oracle_manifest["models"]["tiny-llamamoe-Q8_0"]
    with pytest.raises(PlanError, match="expert slots"):
        Engine.load(path, EngineConfig(device="numpy", n_ctx=64, links=LINKS, vram_budget=64 << 10,
                                       moe_experts="gpu"))


@pytest.mark.parametrize("kw, err, match", [
    (dict(expert_slots=0), ValueError, "at least 1"),
    (dict(expert_cache="fifo"), ValueError, "lru or lfu"),
    (dict(moe_experts="tpu"), ValueError, "auto, gpu or cpu")])
def test_bad_engine_options(kw, err, match):
    with pytest.raises(err, match=match):
        EngineConfig(**kw)


def test_fewer_slots_than_used_experts_is_refused(oracle_manifest):
    with pytest.raises(UsageError, match="fewer than the 4 experts each token uses"):
        Engine.load(oracle_manifest["models"]["tiny-qwen3moe-Q8_0"],
                    EngineConfig(device="numpy", n_ctx=64, links=LINKS, expert_slots=3))


# --- ntx-run -------------------------------------------------------------------------------------
def _cli(args):
    from ntx_engine.cli.run import app

    return CliRunner().invoke(app, args, env={"NO_COLOR": "1", "COLUMNS": "120"})


def test_cli_json_has_expert_stats_and_the_resident_tokens(oracle_manifest):
    path = str(oracle_manifest["models"]["tiny-llamamoe-Q8_0"])
    common = ["hello there", "-m", path, "--device", "numpy", "--temperature", "0", "-n", "6", "--raw",
              "--ctx", "128", "--json"]
    ref = _cli(common)
    assert ref.exit_code == 0, ref.output
    res = _cli(common + ["--expert-slots", "3", "--expert-cache", "lfu"])
    assert res.exit_code == 0, res.output
    a, b = json.loads(ref.stdout), json.loads(res.stdout)
    assert a["tokens"] == b["tokens"]
    ex = b["tiers"]["experts"]
    assert ex["policy"] == "lfu" and ex["slots"] == 3 and ex["cache"]["misses"] > 0
    assert "expert cache" in res.stderr and "hit rate" in res.stderr


@pytest.mark.parametrize("args, match", [(["--expert-slots", "0"], "expert-slots"),
                                         (["--expert-slots", "1"], "fewer than the 2 experts"),
                                         (["--moe-experts", "tpu"], "moe-experts")])
def test_cli_bad_options_are_clear_errors(oracle_manifest, args, match):
    path = str(oracle_manifest["models"]["tiny-llamamoe-Q8_0"])
    res = _cli(["hi", "-m", path, "--device", "numpy", "--ctx", "64", *args])
    assert res.exit_code != 0  # run_app (the CLI boundary) prints the UsageError as one `error:` line
    assert isinstance(res.exception, UsageError) and match in str(res.exception)


def test_cli_plan_shows_the_expert_cache(oracle_manifest):
    path = str(oracle_manifest["models"]["tiny-llamamoe-Q8_0"])
    res = _cli(["-m", path, "--device", "numpy", "--ctx", "64", "--plan", "--expert-slots", "5"])
    assert res.exit_code == 0, res.output
    assert "expert cache: 5 slots" in res.stdout and "experts in pinned RAM" in res.stdout
    res = _cli(["-m", path, "--device", "numpy", "--ctx", "64", "--plan", "--expert-slots", "5", "--json"])
    plan = json.loads(res.stdout)
    assert plan["experts"]["n_slots"] == 5 and plan["experts"]["sides"] == ["gpu", "gpu"]
    assert all(layer["tier"] == "vram" for layer in plan["layers"])



# --- the planner's per-layer side choice ---------------------------------------------------------
def _expert_plan(oracle_manifest, cpu_rate: float, side: str = "auto", slots: int = 8):
    from ntx_engine.config import ModelConfig
    from ntx_engine.gguf import GGUFFile
    from ntx_engine.layout import layer_spans, resident_bytes
    from ntx_engine.moe_plan import make_expert_plan
    from ntx_engine.planner import Budgets

    gf = GGUFFile.open(oracle_manifest["models"]["tiny-llamamoe-Q8_0"])
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    links = Links(vram=1e11, h2d=1e10, storage=1e9, cpu=cpu_rate)
    return make_expert_plan(gf, layer_spans(gf, cfg), resident_bytes(gf, cfg), cfg, 64,
                            Budgets(vram=1 << 40, ram=1 << 40), links, n_slots=slots, side=side)


@pytest.mark.parametrize("cpu_rate, want", [(0.0, ("gpu", "gpu")), (1e15, ("cpu", "cpu")),
                                            (2e10, None)])
def test_auto_side_is_never_slower_than_forcing_one(oracle_manifest, cpu_rate, want):
    """8 slots for 2 layers x 8 experts: all on the GPU side half the lookups miss; one layer on
    the CPU leaves the other all its experts cached. With the CPU between the link and VRAM
    speeds that split wins; the planner's choice is never slower than either forced side."""
    auto = _expert_plan(oracle_manifest, cpu_rate)
    if want is not None:
        assert auto.experts.sides == want
    else:
        assert sorted(auto.experts.sides) == ["cpu", "gpu"] and auto.experts.miss_rate == 0.0
    for forced in ("gpu", "cpu") if cpu_rate else ("gpu",):
        assert auto.predicted_token_s <= _expert_plan(oracle_manifest, cpu_rate, forced).predicted_token_s
    if want is None:
        assert auto.predicted_token_s < min(_expert_plan(oracle_manifest, cpu_rate, f).predicted_token_s
                                            for f in ("gpu", "cpu"))
