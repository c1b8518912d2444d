"""Hybrid execution (issue 8): layers in the `cpu` tier run on a host backend while the others
stream through the ring. With the numpy backend on both sides the numerics are the same
operations, so the logits must be bit-identical to the all-resident run; with the native CPU
kernels as host the CPU layers sum in another order, so the logits must stay within the
model's float32 noise floor (ntx_engine.noise) and greedy tokens agree up to a near-tie."""
from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends.cpu_kernels import load_module
from ntx_engine.engine import Engine, EngineConfig
from ntx_engine.noise import rounding_noise
from ntx_engine.planner import Links

MiB = 1 << 20
N_CTX = 128
LINKS = Links(vram=2e10, h2d=1e10, storage=1e9, storage_kind="direct", cpu=8e9)
PROMPT = "The three primary colors are"
# > hybrid.GPU_PASS_TOKENS tokens: the prefill streams the CPU layers to the main backend and
# copies their K/V rows to the host cache, which the following decode steps read
LONG = ("A lighthouse keeper kept a log of every ship that passed the rocks at night, the weather, "
        "the sea, and the colour of the sky at dawn. One morning he wrote")


def load(path, **kw):
    return Engine.load(path, EngineConfig(device="numpy", n_ctx=N_CTX, links=LINKS, **kw))


@pytest.fixture(scope="module")
def resident(smollm2_path):
    eng = load(smollm2_path)
    ids = eng.tokenize(PROMPT)
    long_ids = eng.tokenize(LONG)
    out = {"ids": ids, "logits": eng.logits(ids), "tokens": list(eng.generate(ids, 8)),
           "long_ids": long_ids, "long_logits": eng.logits(long_ids), "long_tokens": list(eng.generate(long_ids, 6)),
           "noise": rounding_noise(lambda: eng.logits(ids), eng.model.backend, seeds=(1, 2))}
    eng.close()
    return out


def test_numpy_host_is_bit_exact(smollm2_path, resident):
    eng = load(smollm2_path, vram_budget=110 * MiB, ram_budget=1 << 30, host_device="numpy")
    try:
        tiers = [p.tier for p in eng.plan().placements]
        assert "cpu" in tiers and "ram" in tiers  # both sides of the split are exercised
        np.testing.assert_array_equal(eng.logits(resident["ids"]), resident["logits"])
        assert list(eng.generate(resident["ids"], 8)) == resident["tokens"]
        from ntx_engine.hybrid import GPU_PASS_TOKENS

        assert len(resident["long_ids"]) > GPU_PASS_TOKENS
        np.testing.assert_array_equal(eng.logits(resident["long_ids"]), resident["long_logits"])
        assert list(eng.generate(resident["long_ids"], 6)) == resident["long_tokens"]
        hl = eng.model.host_layers
        assert hl.boundaries > 0 and hl.cpu_layers == frozenset(i for i, t in enumerate(tiers) if t == "cpu")
        st = eng.tier_stats()["pipeline"]
        assert st["bytes"]["cpu"] == 6 * eng.plan().bytes_per_tier["cpu"]  # the last generate: 6 passes
    finally:
        eng.close()


def test_no_host_means_no_cpu_tier(smollm2_path):
    eng = load(smollm2_path, vram_budget=110 * MiB, ram_budget=1 << 30, host_device="none")
    try:
        assert "cpu" not in {p.tier for p in eng.plan().placements}
    finally:
        eng.close()


def test_native_host_within_noise(smollm2_path, resident):
    if load_module() is None:
        pytest.fail("the native CPU kernels are not built: `pip install -e .` builds ntx_engine._cpu", pytrace=False)
    eng = load(smollm2_path, vram_budget=110 * MiB, ram_budget=1 << 30, host_device="cpu")
    try:
        assert "cpu" in {p.tier for p in eng.plan().placements}
        logits = eng.logits(resident["ids"])
        diff = np.abs(logits - resident["logits"]).max(axis=-1)
        assert (diff <= 3 * resident["noise"] + 1e-3).all(), (diff, resident["noise"])
        toks = list(eng.generate(resident["ids"], 8))
        ref = resident["tokens"]
        ref_logits = eng.logits(resident["ids"] + ref[:-1])[len(resident["ids"]) - 1:]
        for step, (a, b) in enumerate(zip(toks, ref)):
            top2 = np.sort(ref_logits[step])[-2:]
            if top2[1] - top2[0] < 0.05:
                break
            assert a == b, f"step {step}"
    finally:
        eng.close()
