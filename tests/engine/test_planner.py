"""Planner: budgets, reserves, the impossible-budget boundary, and the predicted time, checked
against the cost model recomputed here from the placement's own bytes."""
from __future__ import annotations

import pytest

from ntx_common.errors import UsageError
from ntx_engine.config import ModelConfig
from ntx_engine.layout import LayerSpan, layer_spans, resident_bytes
from ntx_engine.gguf import GGUFFile
from ntx_engine.planner import (MIN_SLOTS, Budgets, Links, PlanError, kv_cache_bytes, make_plan, parse_size,
                                vram_margin, workspace_bytes)

GB = 1e9
M0 = Budgets(vram=0, ram=0, margin=0)
LINKS = Links(vram=4000 * GB, h2d=50 * GB, storage=3 * GB, storage_kind="direct")


def cfg(n_layers=8) -> ModelConfig:
    return ModelConfig(arch="llama", n_layers=n_layers, n_embd=1024, n_ff=4096, n_head=16, n_head_kv=4,
                       head_dim=64, rope_dim=64, rope_base=1e4, rope_type="norm", rope_freq_scale=1.0,
                       has_rope_freqs=False, rms_eps=1e-5, context_length=4096, vocab_size=32000,
                       tied_embeddings=True, qkv_bias=False)


def spans(sizes) -> list[LayerSpan]:
    out, pos = [], 0
    for i, n in enumerate(sizes):
        out.append(LayerSpan(i, pos, pos + n, {f"blk.{i}.x": 0}, n))
        pos += n
    return out


def fixed(c, n_ctx, budgets, head) -> int:
    return kv_cache_bytes(c, n_ctx) + workspace_bytes(c, n_ctx) + head + vram_margin(budgets)


@pytest.mark.parametrize("text,value", [("24G", 24 << 30), ("512M", 512 << 20), ("0", 0), ("1.5GiB", 3 << 29),
                                         ("64k", 64 << 10), (" 2 gb ", 2 << 30), (123, 123)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "G", "-1G", "12X", "1.2.3G"])
def test_parse_size_rejects(bad):
    with pytest.raises(UsageError, match="is not a size"):
        parse_size(bad, "--vram-budget")


def test_everything_fits_means_no_ring():
    c, sp = cfg(), spans([100 << 20] * 8)
    plan = make_plan(sp, 50 << 20, c, 1024, Budgets(vram=64 << 30, ram=0), LINKS)
    assert not plan.streamed and plan.n_slots == 0 and plan.reserves.ring == 0
    assert plan.bytes_per_tier == {"vram": 800 << 20, "ram": 0, "storage": 0, "cpu": 0}


@pytest.mark.parametrize("vram_layers,ram_layers", [(4, 2), (3, 0), (0, 8), (2, 6), (4, 9)])
def test_tiers_respect_budgets(vram_layers, ram_layers):
    c, layer = cfg(), 100 << 20
    sp, head, n_ctx = spans([layer] * 8), 50 << 20, 1024
    # room for exactly `vram_layers` resident layers next to a 3-slot ring; RAM for `ram_layers`
    # next to 3 staging buffers
    vram = fixed(c, n_ctx, M0, head) + (3 + vram_layers) * layer + layer // 2
    budgets = Budgets(vram=vram, ram=(3 + ram_layers) * layer + layer // 2, margin=0)
    plan = make_plan(sp, head, c, n_ctx, budgets, LINKS)
    tiers = [p.tier for p in plan.placements]
    assert tiers.count("vram") == vram_layers
    n_streamed = 8 - vram_layers
    assert tiers.count("ram") == min(ram_layers, n_streamed)
    assert plan.reserves.vram + plan.bytes_per_tier["vram"] <= budgets.vram
    pinned = plan.bytes_per_tier["ram"] + plan.reserves.staging
    assert pinned <= budgets.ram or plan.n_staging  # staging is reserved only when storage streams
    assert plan.n_slots == min(3, n_streamed) and plan.slot_bytes == layer


def test_predicted_time_is_the_slowest_link():
    c, sp = cfg(), spans([100 << 20] * 8)
    head, layer = 50 << 20, 100 << 20
    vram = fixed(c, 1024, M0, head) + (3 + 4) * layer  # 4 resident, 4 streamed: 2 in RAM, 2 from storage
    plan = make_plan(sp, head, c, 1024, Budgets(vram=vram, ram=(3 + 2) * layer, margin=0), LINKS)
    b = plan.bytes_per_tier
    assert b == {"vram": 4 * layer, "ram": 2 * layer, "storage": 2 * layer, "cpu": 0}
    expect = max((sum(b.values()) + (50 << 20)) / LINKS.vram, (b["ram"] + b["storage"]) / LINKS.h2d,
                 b["storage"] / LINKS.storage)
    assert plan.predicted_token_s == pytest.approx(expect, rel=1e-12)
    assert b["storage"] > 0 and plan.bottleneck == "storage"
    assert plan.as_dict()["predicted_tok_s"] == pytest.approx(1 / expect)


def test_largest_layers_go_resident_when_that_is_faster():
    c = cfg(4)
    sp = spans([250 << 20, 300 << 20, 250 << 20, 250 << 20])
    head, n_ctx = 1 << 20, 256
    # room for a 2-slot ring of 300 MiB + 300 MiB of resident layers: model order keeps layer 0
    # (250 MiB) and streams 800 MiB; largest first keeps layer 1 and streams 750 MiB
    budgets = Budgets(vram=fixed(c, n_ctx, M0, head) + 3 * (300 << 20), ram=1 << 40, margin=0)
    plan = make_plan(sp, head, c, n_ctx, budgets, LINKS, n_slots=2)
    assert plan.placements[1].tier == "vram" and plan.strategy == "largest first"
    assert plan.bytes_per_tier["ram"] == 750 << 20


def test_impossible_budget_names_the_minimum():
    c, sp, head, n_ctx = cfg(), spans([100 << 20] * 8), 50 << 20, 2048
    with pytest.raises(PlanError) as exc:
        make_plan(sp, head, c, n_ctx, Budgets(vram=200 << 20, ram=0), LINKS)
    msg = str(exc.value)
    assert "KV cache for 2048 tokens" in msg and "--vram-budget" in msg and "--ctx" in msg
    assert isinstance(exc.value, UsageError)
    # the boundary: fixed reserves + the minimum ring fit exactly
    need = fixed(c, n_ctx, M0, head) + MIN_SLOTS * (100 << 20)
    plan = make_plan(sp, head, c, n_ctx, Budgets(vram=need, ram=0, margin=0), LINKS)
    assert plan.n_slots == MIN_SLOTS and plan.bytes_per_tier["vram"] == 0
    with pytest.raises(PlanError):
        make_plan(sp, head, c, n_ctx, Budgets(vram=need - 1, ram=0, margin=0), LINKS)


def test_the_minimum_named_in_the_error_plans():
    """With the default margin (which grows with the budget) the figure in the message works."""
    import re

    c, sp, head = cfg(), spans([100 << 20] * 8), 50 << 20
    with pytest.raises(PlanError) as exc:
        make_plan(sp, head, c, 2048, Budgets(vram=10 << 20, ram=0), LINKS)
    mib = float(re.search(r"raise --vram-budget to ([0-9.]+) MiB", str(exc.value)).group(1))
    plan = make_plan(sp, head, c, 2048, Budgets(vram=int((mib + 0.01) * (1 << 20)), ram=0), LINKS)
    assert plan.n_slots == MIN_SLOTS
    with pytest.raises(PlanError):
        make_plan(sp, head, c, 2048, Budgets(vram=int((mib - 0.02) * (1 << 20)), ram=0), LINKS)


def test_cpu_only_budget_holds_the_staging_buffers_too():
    """CPU only (one memory): the storage staging buffers come out of the same budget as the ring
    and the resident layers, so nothing is allocated beside it; the minimum the error names
    includes them, and that figure plans."""
    import re

    from ntx_engine.planner import DEFAULT_STAGING, TIGHT_CHUNK

    c, sp, head, n_ctx = cfg(), spans([100 << 20] * 8), 50 << 20, 2048
    unified = dict(ram=0, device_memory="RAM (CPU only)", option="--ram-budget", unified=True)
    with pytest.raises(PlanError) as exc:
        make_plan(sp, head, c, n_ctx, Budgets(vram=300 << 20, **unified), LINKS)
    msg = str(exc.value)
    assert "storage staging" in msg and "--ram-budget" in msg and "RAM (CPU only)" in msg
    mib = float(re.search(r"raise --ram-budget to ([0-9.]+) MiB", msg).group(1))
    budget = int((mib + 0.01) * (1 << 20))
    plan = make_plan(sp, head, c, n_ctx, Budgets(vram=budget, **unified), LINKS)
    r = plan.reserves
    used = r.kv_cache + r.workspace + r.head + r.ring + r.vram_margin + r.staging + plan.bytes_per_tier["vram"]
    assert plan.n_staging == DEFAULT_STAGING and used <= budget
    # the named minimum is that of the smallest configuration: 16-token prefill passes, head on storage
    assert plan.head_tier == "storage" and plan.prefill_chunk == TIGHT_CHUNK and "read from storage" in msg
    assert r.head < head and plan.terms["storage"] * LINKS.storage >= head
    # the same numbers as a GPU budget leave the staging outside it, with a note saying so
    gpu = make_plan(sp, head, c, n_ctx, Budgets(vram=budget, ram=0), LINKS)
    assert gpu.n_slots > plan.n_slots or gpu.bytes_per_tier["vram"] > plan.bytes_per_tier["vram"]
    assert any("staging" in n for n in gpu.notes)


def test_slots_option_and_minimum():
    c, sp = cfg(), spans([1 << 30] * 8)
    plan = make_plan(sp, 0, c, 256, Budgets(vram=6 << 30, ram=1 << 40), LINKS, n_slots=5)
    assert plan.n_slots == 5 and plan.bytes_per_tier["vram"] == 0  # 5 slots leave no room for a layer
    with pytest.raises(UsageError, match="at least 2 slots"):
        make_plan(sp, 0, c, 256, Budgets(vram=6 << 30, ram=1 << 40), LINKS, n_slots=1)


def test_spans_of_a_real_file_cover_its_tensors(smollm2_path):
    """Span bytes = the file's own tensor bytes per layer (gguf offsets), head = the rest."""
    with GGUFFile.open(smollm2_path) as gf:
        c = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
        sp = layer_spans(gf, c)
        assert [s.index for s in sp] == list(range(c.n_layers))
        for s in sp:
            own = [t for n, t in gf.tensors.items() if n.startswith(f"blk.{s.index}.")]
            assert s.tensor_bytes == sum(t.nbytes for t in own)
            assert s.start == min(t.offset for t in own) and s.end == max(t.end for t in own)
            for t in own:  # the slot offset reproduces the tensor's bytes from the span
                span = gf.span_data(s.start, s.end)
                off = s.tensors[t.name]
                assert bytes(span[off:off + t.nbytes]) == bytes(gf.tensor_data(t.name))
        every = sum(t.nbytes for t in gf.tensors.values())
        assert sum(s.tensor_bytes for s in sp) + resident_bytes(gf, c) == every


def test_hybrid_split_balances_cpu_and_pcie():
    """70B-like: 80 layers of 540 MB, room for 42 in VRAM. With the CPU at 39 GB/s and PCIe at
    52 GB/s the planner gives the CPU about 39/(39+52) of the 38 other layers, spread out."""
    c = cfg(80)
    layer = 540 << 20
    sp = spans([layer] * 80)
    links = Links(vram=3000 * GB, h2d=52 * GB, storage=3 * GB, cpu=39 * GB)
    vram = fixed(c, 1024, M0, 0) + (3 + 42) * layer
    plan = make_plan(sp, 0, c, 1024, Budgets(vram=vram, ram=1 << 40, margin=0), links)
    tiers = [p.tier for p in plan.placements]
    n_cpu = tiers.count("cpu")
    assert tiers.count("vram") == 42 and n_cpu + tiers.count("ram") == 38
    assert abs(n_cpu - 38 * 39 / (39 + 52)) <= 1.5
    cpu_at = [i for i, t in enumerate(tiers) if t == "cpu"]
    assert all(b - a >= 2 for a, b in zip(cpu_at, cpu_at[1:]))  # interleaved with streamed layers
    no_cpu = make_plan(sp, 0, c, 1024, Budgets(vram=vram, ram=1 << 40, margin=0),
                       Links(vram=3000 * GB, h2d=52 * GB, storage=3 * GB))
    assert "cpu" not in {p.tier for p in no_cpu.placements}
    assert plan.predicted_token_s < 0.7 * no_cpu.predicted_token_s
    t = plan.terms  # both sides finish together, to within one layer's time
    assert abs(t["compute"] - t["h2d"]) <= layer / (39 * GB)


def test_hybrid_cpu_layers_need_ram():
    c = cfg(80)
    layer = 540 << 20
    sp = spans([layer] * 80)
    links = Links(vram=3000 * GB, h2d=52 * GB, storage=3 * GB, cpu=39 * GB)
    vram = fixed(c, 1024, M0, 0) + (3 + 42) * layer
    plan = make_plan(sp, 0, c, 1024, Budgets(vram=vram, ram=(3 + 5) * layer, margin=0), links)
    b = plan.bytes_per_tier
    assert b["cpu"] + b["ram"] <= 5 * layer and b["storage"] > 0


def test_cpu_only_tight_budget_first_shrinks_the_prefill_pass_then_streams_the_head():
    """CPU only, between the default minimum and the smallest one: first the prefill pass
    shrinks to TIGHT_CHUNK tokens with the head still in RAM; only below that does the head go
    to storage (its bytes then join the storage term of the predicted time)."""
    from ntx_engine.planner import TIGHT_CHUNK, kv_cache_bytes, workspace_bytes

    c, sp, head, n_ctx = cfg(), spans([8 << 20] * 8), 30 << 20, 256
    unified = dict(ram=0, device_memory="RAM (CPU only)", option="--ram-budget", unified=True)
    default_ws, tight_ws = workspace_bytes(c, n_ctx), workspace_bytes(c, n_ctx, TIGHT_CHUNK)
    assert tight_ws < default_ws
    # room for the head, the tight workspace, KV, a 2-slot ring + staging, but not the default workspace
    budget = kv_cache_bytes(c, n_ctx) + tight_ws + head + 5 * (8 << 20) + (8 << 20)
    budget = int(budget * 16 / 15) + (1 << 20)
    assert budget < kv_cache_bytes(c, n_ctx) + default_ws + head + 5 * (8 << 20)
    plan = make_plan(sp, head, c, n_ctx, Budgets(vram=budget, **unified), LINKS)
    assert plan.prefill_chunk == TIGHT_CHUNK and plan.head_tier == "vram" and plan.reserves.head == head
    smaller = make_plan(sp, head, c, n_ctx, Budgets(vram=budget - head + (4 << 20), **unified), LINKS)
    assert smaller.head_tier == "storage" and smaller.reserves.head < head
    assert smaller.terms["storage"] * LINKS.storage == pytest.approx(smaller.bytes_per_tier["storage"] + head)
    # a GPU budget never takes this path: its error stays the plain one
    with pytest.raises(PlanError, match="embeddings/head 30.00 MiB"):
        make_plan(sp, head, c, n_ctx, Budgets(vram=budget - head + (4 << 20), ram=0), LINKS)
