"""The 3-tier pipeline on the numpy backend: SmolLM2 under budgets that force each tier and all
three at once gives exactly the all-resident logits and tokens; the pipeline's ordering (slot
reuse, staging reuse) is checked with a ring that verifies every layer's bytes against the
file while threads race, and failures surface as clear errors instead of hangs."""
from __future__ import annotations

import concurrent.futures as cf
import random
import time

import numpy as np
import pytest

from ntx_common.errors import ModelError, NtxIOError
from ntx_engine.backends.numpy_ring import NumpyRing
from ntx_engine.engine import Engine, EngineConfig
from ntx_engine.layout import LayerSpan
from ntx_engine.pipeline import StreamingLayers
from ntx_engine.planner import Links

LINKS = Links(vram=2e10, h2d=1e10, storage=1e9, storage_kind="direct")
MiB = 1 << 20
N_CTX = 128
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def resident(smollm2_path):
    eng = Engine.load(smollm2_path, EngineConfig(device="cpu", n_ctx=N_CTX, links=LINKS))
    ids = eng.tokenize(PROMPT)
    out = {"ids": ids, "logits": eng.logits(ids), "tokens": list(eng.generate(ids, 8)), "plan": eng.plan()}
    eng.close()
    assert not out["plan"].streamed
    return out


def budget_for(plan_layers_vram: int, layer: int, fixed: int) -> int:
    return fixed + (3 + plan_layers_vram) * layer


# VRAM budget: SmolLM2 at n_ctx 128 needs ~95 MiB of reserves (KV, workspaces, head, margin)
# plus the ring; each layer is ~2.1 MiB. RAM budget: staging (3 slots) + pinned layers.
CASES = {
    "three tiers": ("110M", "20M", {"vram", "ram", "storage"}),
    "ram only": ("101M", "1G", {"ram"}),
    "storage only": ("101M", "0", {"storage"}),
    "vram only": (None, None, {"vram"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiers_match_resident(smollm2_path, resident, case):
    from ntx_engine.planner import parse_size

    vram, ram, expect = CASES[case]
    cfg = EngineConfig(device="cpu", n_ctx=N_CTX, links=LINKS,
                       vram_budget=None if vram is None else parse_size(vram),
                       ram_budget=None if ram is None else parse_size(ram))
    eng = Engine.load(smollm2_path, cfg)
    try:
        plan = eng.plan()
        assert {p.tier for p in plan.placements} == expect
        logits = eng.logits(resident["ids"])
        np.testing.assert_array_equal(logits, resident["logits"])  # same bytes, same kernels: bit-exact
        tokens = list(eng.generate(resident["ids"], 8))
        assert tokens == resident["tokens"]
        if plan.streamed:
            st = eng.model.source.stats
            assert st.passes == 8  # one prefill pass + 7 decode steps
            per_pass = plan.bytes_per_tier
            assert st.bytes["ram"] == 8 * per_pass["ram"] and st.bytes["storage"] == 8 * per_pass["storage"]
            assert eng.tier_stats()["pipeline"]["bytes"] == st.bytes
    finally:
        eng.close()


def test_mmap_baseline_matches_resident(smollm2_path, resident):
    eng = Engine.load(smollm2_path, EngineConfig(device="cpu", n_ctx=N_CTX, links=LINKS, vram_budget=101 * MiB,
                                                 ram_budget=0, tiers="mmap-baseline"))
    try:
        assert eng.plan().streamed
        assert list(eng.generate(resident["ids"], 8)) == resident["tokens"]
        assert eng.model.source.ring.n_slots == 1
    finally:
        eng.close()


# --- the pipeline alone, with a ring that checks every byte ---------------------------------

class SlowReader:
    """Reads from an in-memory "disk" with random delays; optionally fails on one read."""

    name, needs_hugepages = "fake", False

    def __init__(self, disk: np.ndarray, fail_at: int | None = None, seed: int = 0) -> None:
        self.disk, self.size, self.fail_at, self.reads = disk, len(disk), fail_at, 0
        self.rng = random.Random(seed)
        self.pool = cf.ThreadPoolExecutor(max_workers=3)

    def read_into(self, offset, length, dest) -> None:
        self.reads += 1
        if self.fail_at is not None and self.reads > self.fail_at:
            raise NtxIOError("fake disk: read error at offset %d" % offset)
        time.sleep(self.rng.random() * 0.002)
        dest[:length] = self.disk[offset:offset + length]

    def submit(self, requests):  # the Reader protocol's asynchronous form, on a thread pool
        return [self.pool.submit(self.read_into, *r) for r in requests]

    def wait(self, handle, timeout=None) -> bool:
        done, pending = cf.wait(handle, timeout=timeout)
        for f in done:
            f.result()
        return not pending


class CheckingRing(NumpyRing):
    """Random copy delays; every acquired slot must hold exactly its layer's bytes, and still
    hold them at release (a slot overwritten while computed would fail here)."""

    def __init__(self, *a, seed=1, **kw) -> None:
        super().__init__(*a, **kw)
        self.rng = random.Random(seed)

    def copy_in(self, slot, src) -> None:
        time.sleep(self.rng.random() * 0.002)
        super().copy_in(slot, src)


def make_pipeline(tiers, n_slots=2, n_staging=2, fail_at=None, seed=0):
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(5000, 20000)) for _ in tiers]
    disk = rng.integers(0, 256, sum(sizes) + 8192, dtype=np.uint8)
    spans, pos = [], 4096 + 13  # unaligned starts exercise the IO_ALIGN widening
    for i, n in enumerate(sizes):
        spans.append(LayerSpan(i, pos, pos + n, {}, n))
        pos += n
    ring = CheckingRing(None, n_slots, max(sizes), seed=seed + 1)
    pinned = {i: disk[s.start:s.end].copy() for i, s in enumerate(spans) if tiers[i] == "ram"}
    resident = {i: ("resident", i) for i, t in enumerate(tiers) if t == "vram"}
    seen = []

    def make_weights(i, mem):
        expect = disk[spans[i].start:spans[i].end]
        assert np.array_equal(mem, expect), f"layer {i}: slot holds wrong bytes"
        seen.append(i)
        return ("streamed", i, mem)

    src = StreamingLayers(spans, list(tiers), ring, resident, pinned, make_weights,
                          reader=SlowReader(disk, fail_at, seed), n_staging=n_staging, source_size=len(disk))
    return src, spans, disk, seen


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n_slots,n_staging", [(2, 1), (2, 2), (3, 3)])
def test_pipeline_orders_slots_and_staging(seed, n_slots, n_staging):
    tiers = ["vram", "storage", "ram", "storage", "storage", "vram", "ram", "storage"]
    src, spans, disk, seen = make_pipeline(tiers, n_slots, n_staging, seed=seed)
    try:
        for _ in range(12):  # passes, like tokens
            for i in range(len(tiers)):
                w = src.acquire(i)
                if tiers[i] != "vram":
                    time.sleep(random.random() * 0.001)  # "compute"
                    assert np.array_equal(w[2], disk[spans[i].start:spans[i].end]), "slot overwritten in use"
                src.release(i)
        streamed = [i for i, t in enumerate(tiers) if t != "vram"]
        assert seen == streamed * 12
        assert src.stats.passes == 12
    finally:
        src.close()


def test_skip_changes_what_streams():
    tiers = ["ram", "storage", "ram", "storage"]
    src, spans, disk, seen = make_pipeline(tiers, seed=3)
    try:
        src.set_active([0, 3])  # layers 1 and 2 skipped: never read again
        for _ in range(3):
            for i in (0, 3):
                src.acquire(i)
                src.release(i)
        assert seen == [0, 3] * 3
        with pytest.raises(ModelError, match="streams layer 0 next"):
            src.acquire(1)
    finally:
        src.close()


def test_read_failure_is_an_error_not_a_hang():
    tiers = ["storage", "storage", "storage"]
    src, *_ = make_pipeline(tiers, fail_at=4, seed=5)
    try:
        with pytest.raises(NtxIOError, match="fake disk: read error"):
            for _ in range(10):
                for i in range(3):
                    src.acquire(i)
                    src.release(i)
    finally:
        src.close()


def test_passes_over_other_layer_sets_restart_the_cycle():
    """Skip (a pass over fewer layers), a draft over resident layers only, and a pass that
    died midway: the next pass streams exactly its own layers, bytes checked at acquire."""
    tiers = ["vram", "ram", "storage", "ram", "vram", "storage"]
    src, spans, disk, seen = make_pipeline(tiers, seed=9)
    try:
        def run(layers):
            src.begin(layers)
            for i in layers:
                src.acquire(i)
                src.release(i)
        run(range(6))
        run([0, 1, 3, 4, 5])  # skip layer 2
        run([0, 4])  # a draft: nothing streamed, the cycle stays
        run([0, 1, 3, 4, 5])
        src.begin(range(6))
        src.acquire(0)
        src.acquire(1)  # ... and the pass raises here, holding layer 1
        run(range(6))
        assert seen == [1, 2, 3, 5] + [1, 3, 5] * 2 + [1] + [1, 2, 3, 5]
    finally:
        src.close()


def test_skipping_passes_stream_only_their_layers(smollm2_path):
    """A pass over a layer subset (layer skip) on the streamed model equals the same pass on the
    resident model, and the skipped streamed layers are not read."""
    import numpy as np

    from ntx_engine.planner import parse_size

    full = Engine.load(smollm2_path, EngineConfig(device="cpu", n_ctx=N_CTX, links=LINKS))
    tiered = Engine.load(smollm2_path, EngineConfig(device="cpu", n_ctx=N_CTX, links=LINKS,
                                                    vram_budget=parse_size("110M"), ram_budget=parse_size("20M")))
    try:
        ids = np.asarray(full.tokenize(PROMPT))
        layers = [i for i in range(full.config.n_layers) if i not in (10, 11, 12, 20)]
        want = full.model.forward(ids, 0, all_logits=True, layers=layers)
        src = tiered.model.source
        src.reset_stats()
        got = tiered.model.forward(ids, 0, all_logits=True, layers=layers)
        np.testing.assert_array_equal(got, want)
        plan = tiered.plan()
        streamed_kept = sum(plan.placements[i].nbytes for i in layers if plan.placements[i].tier in ("ram", "storage"))
        assert src.stats.bytes["ram"] + src.stats.bytes["storage"] == streamed_kept
    finally:
        full.close()
        tiered.close()


def test_cpu_only_ram_budget_streams_the_rest(smollm2_path, resident):
    """--device cpu with only a RAM budget: that much stays resident, the rest streams from
    storage through the same pipeline (no pinned second copy), tokens as all-in-RAM."""
    from ntx_engine.planner import parse_size

    eng = Engine.load(smollm2_path, EngineConfig(device="cpu", n_ctx=N_CTX, links=LINKS,
                                                 ram_budget=parse_size("110M")))
    try:
        plan = eng.plan()
        assert {p.tier for p in plan.placements} == {"vram", "storage"} and plan.budgets.ram == 0
        assert plan.budgets.vram == parse_size("110M")
        assert list(eng.generate(resident["ids"], 8)) == resident["tokens"]
    finally:
        eng.close()


@pytest.mark.parametrize("device", ["cpu", "numpy"])
def test_cpu_only_40m_reads_the_head_from_storage(smollm2_path, resident, device):
    """SmolLM2 under 40 MB (issue 8): the tied 28.7 MB embedding/head table cannot stay in RAM,
    so the plan reads it from storage every token (two 1 MiB piece buffers instead) and
    prefills in 16-token passes; greedy tokens equal the all-in-RAM run's on the same backend,
    prefill logits too (row by row the same dot products), and the head's reads are counted."""
    from ntx_engine.head_stream import HEAD_PIECE_BYTES, StreamedMatrix
    from ntx_engine.planner import TIGHT_CHUNK, parse_size

    ref = resident
    if device == "numpy":  # the oracle backend's own all-in-RAM run
        eng = Engine.load(smollm2_path, EngineConfig(device="numpy", n_ctx=N_CTX, links=LINKS))
        ref = {"ids": resident["ids"], "logits": eng.logits(resident["ids"]),
               "tokens": list(eng.generate(resident["ids"], 8))}
        eng.close()
    eng = Engine.load(smollm2_path, EngineConfig(device=device, n_ctx=N_CTX, links=LINKS,
                                                 ram_budget=parse_size("40M")))
    try:
        plan = eng.plan()
        assert plan.head_tier == "storage" and plan.prefill_chunk == TIGHT_CHUNK
        assert plan.reserves.head == 2 * HEAD_PIECE_BYTES < plan.head_bytes
        assert plan.reserves.vram + sum(p.nbytes for p in plan.placements if p.tier == "vram") <= parse_size("40M")
        assert isinstance(eng.model.w.output, StreamedMatrix) and eng.model.w.output is eng.model.w.tok_embd
        assert list(eng.generate(ref["ids"], 8)) == ref["tokens"]
        read = eng.tier_stats()["head_storage_bytes_since_load"]
        table = eng.model.w.output
        assert read >= 8 * table.rows * table.row_bytes  # the whole table for each of the 8 tokens
        logits = eng.logits(ref["ids"])
        np.testing.assert_allclose(logits, ref["logits"], rtol=0, atol=1e-4)
        assert (logits.argmax(-1) == ref["logits"].argmax(-1)).all()
    finally:
        eng.close()
    with pytest.raises(RuntimeError, match="shutdown"):  # the reader opened for the head closed with the engine
        table.reader.read_into(0, 16, np.empty(16, np.uint8))


def test_cpu_only_budget_below_everything_names_the_minimum(smollm2_path):
    """Even with the head on storage and 16-token passes a budget can be too small: the error
    names the minimum and the option, as before."""
    from ntx_engine.planner import PlanError, parse_size

    with pytest.raises(PlanError, match=r"--ram-budget"):
        Engine.load(smollm2_path, EngineConfig(device="cpu", n_ctx=N_CTX, links=LINKS, ram_budget=parse_size("12M")))
