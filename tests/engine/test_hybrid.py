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


def test_numa_interleaved_cpu_layers_compute_the_same(smollm2_path, resident, monkeypatch):
    """NTX_NUMA=interleave (what a multi-node machine gets by default): the CPU-tier layers'
    buffers have their pages interleaved over the online nodes before they are filled (the
    kernel's own get_mempolicy says so), the RAM-tier ones keep first touch, and the logits
    stay bit-identical to the all-resident run."""
    from ntx_io import numa

    monkeypatch.setenv("NTX_NUMA", "interleave")
    eng = load(smollm2_path, vram_budget=110 * MiB, ram_budget=1 << 30, host_device="numpy")
    try:
        plan, src = eng.plan(), eng.model.source
        cpu, ram = plan.layers_in("cpu"), plan.layers_in("ram")
        assert cpu and ram
        nodes = numa.online_nodes()
        for i in cpu:
            assert numa.policy_of(src.pinned[i].ctypes.data + numa.PAGE) == (numa.MPOL_INTERLEAVE, nodes), i
        for i in ram:
            assert numa.policy_of(src.pinned[i].ctypes.data + numa.PAGE)[0] != numa.MPOL_INTERLEAVE, i
        np.testing.assert_array_equal(eng.logits(resident["ids"]), resident["logits"])
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
        _assert_matches_resident(eng, resident)
    finally:
        eng.close()


def _assert_matches_resident(eng, resident) -> None:
    """Logits within the noise floor of the resident run, greedy tokens equal up to the first
    near-tie (margin < 0.05 in the engine's own teacher-forced logits)."""
    diff = np.abs(eng.logits(resident["ids"]) - resident["logits"]).max(axis=-1)
    assert (diff <= 3 * resident["noise"] + 1e-3).all(), (diff, resident["noise"])
    toks = list(eng.generate(resident["ids"], 8))
    ref_logits = eng.logits(resident["ids"] + resident["tokens"][:-1])[len(resident["ids"]) - 1:]
    for step, (a, b) in enumerate(zip(toks, resident["tokens"])):
        top2 = np.sort(ref_logits[step])[-2:]
        if top2[1] - top2[0] < 0.05:
            break
        assert a == b, f"step {step}"


def _refuse(*_a, **_k):
    raise AssertionError("an op-level host call ran: the CPU layers should be one native call each")


def test_native_host_runs_each_cpu_layer_in_one_native_call(smollm2_path, resident):
    """The hybrid's CPU layers go through NativeCpuBackend.run_block: with every op-level method
    of the host refused, decode still runs, with the tokens of the op-by-op host."""
    if load_module() is None:
        pytest.fail("the native CPU kernels are not built: `pip install -e .` builds ntx_engine._cpu", pytrace=False)
    eng = load(smollm2_path, vram_budget=110 * MiB, ram_budget=1 << 30, host_device="cpu")
    try:
        host = eng.model.host_layers.host
        ids = resident["ids"]
        host.whole_layers = False  # the op-by-op host first (NTX_CPU_WHOLE_LAYER=0)
        op_logits, op_tokens = eng.logits(ids), list(eng.generate(ids, 6))
        host.whole_layers = True
        # not matmul: an instance matmul means "jittered" (ntx_engine.noise) and sends layers op by op
        for name in ("rmsnorm", "matmul_many", "matmul_swiglu", "rope_attention", "swiglu"):
            setattr(host, name, _refuse)
        assert eng.logits(ids).tobytes() == op_logits.tobytes()
        assert list(eng.generate(ids, 6)) == op_tokens
    finally:
        eng.close()


def test_hybrid_cpu_puts_every_non_resident_layer_on_the_cpu(smollm2_path, resident):
    """--hybrid cpu (the issue's benchmark b): no layer streams; numpy host: bit-exact tokens."""
    eng = load(smollm2_path, vram_budget=110 * MiB, ram_budget=1 << 30, host_device="numpy", hybrid="cpu")
    try:
        plan = eng.plan()
        tiers = {p.tier for p in plan.placements}
        assert tiers == {"vram", "cpu"}, tiers
        assert any("--hybrid cpu" in n for n in plan.notes)
        np.testing.assert_array_equal(eng.logits(resident["ids"]), resident["logits"])
        assert list(eng.generate(resident["ids"], 8)) == resident["tokens"]
        assert list(eng.generate(resident["long_ids"], 6)) == resident["long_tokens"]
    finally:
        eng.close()


def test_hybrid_cpu_native_host_tokens_match_resident(smollm2_path, resident):
    if load_module() is None:
        pytest.fail("the native CPU kernels are not built: `pip install -e .` builds ntx_engine._cpu", pytrace=False)
    eng = load(smollm2_path, vram_budget=110 * MiB, ram_budget=1 << 30, host_device="cpu", hybrid="cpu")
    try:
        assert {p.tier for p in eng.plan().placements} == {"vram", "cpu"}
        _assert_matches_resident(eng, resident)
    finally:
        eng.close()


def test_planner_hybrid_cpu_takes_what_ram_holds():
    """make_plan(hybrid="cpu"): every streamed layer on the CPU; with less RAM, as many as fit
    (the rest stream); without a measured CPU rate it cannot price CPU layers and plans none."""
    from ntx_engine.config import ModelConfig
    from ntx_engine.layout import LayerSpan
    from ntx_engine.planner import Budgets, make_plan

    cfg = ModelConfig(arch="llama", n_layers=8, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16,
                      rope_dim=16, rope_base=1e4, rope_type="norm", rope_freq_scale=1.0, has_rope_freqs=False,
                      rms_eps=1e-5, context_length=64, vocab_size=32, tied_embeddings=True, qkv_bias=False)
    spans = [LayerSpan(i, i * 100 * MiB, (i + 1) * 100 * MiB, {f"blk.{i}.x": 0}, 100 * MiB) for i in range(8)]
    plan = make_plan(spans, MiB, cfg, 64, Budgets(vram=500 * MiB, ram=4 << 30), LINKS, hybrid="cpu")
    tiers = [p.tier for p in plan.placements]
    assert set(tiers) == {"vram", "cpu"} and tiers.count("cpu") >= 4
    auto = make_plan(spans, MiB, cfg, 64, Budgets(vram=500 * MiB, ram=4 << 30), LINKS)
    assert auto.predicted_token_s <= plan.predicted_token_s  # auto chooses; cpu is forced
    small = make_plan(spans, MiB, cfg, 64, Budgets(vram=500 * MiB, ram=3 * 100 * MiB + 3 * 100 * MiB + 1),
                      LINKS, hybrid="cpu")
    st = [p.tier for p in small.placements]
    assert 0 < st.count("cpu") < tiers.count("cpu") and "storage" in st
    none = make_plan(spans, MiB, cfg, 64, Budgets(vram=500 * MiB, ram=4 << 30),
                     Links(vram=2e10, h2d=1e10, storage=1e9), hybrid="cpu")
    assert "cpu" not in {p.tier for p in none.placements}


def test_cpu_probe_times_the_whole_layer_call(smollm2_path, oracle_manifest):
    """links.cpu_bps on a native host runs whole-layer calls (layer 0's K row at the probe
    position is written without an op-level call); a MoE model or a numpy host fall back to the
    matrix probe."""
    if load_module() is None:
        pytest.fail("the native CPU kernels are not built: `pip install -e .` builds ntx_engine._cpu", pytrace=False)
    from ntx_engine import links
    from ntx_engine.backends.cpu_native import NativeCpuBackend
    from ntx_engine.backends.numpy_backend import NumpyBackend
    from ntx_engine.gguf import GGUFFile

    host = NativeCpuBackend(threads=2)
    try:
        with GGUFFile.open(smollm2_path) as gf:
            run, nbytes = links._layer_probe(host, gf)
            # SmolLM2's 30 layers hold less than PROBE_LAYER_BYTES: all of them, not one cache-hot layer
            assert nbytes == sum(t.nbytes for n, t in gf.tensors.items() if n.startswith("blk.") and len(t.shape) == 2)
            assert nbytes < links.PROBE_LAYER_BYTES
            assert not host.k_cache[0, links.PROBE_POS].any()
            host.rmsnorm = _refuse  # the op-by-op path would call it
            run()
            assert host.k_cache[0, links.PROBE_POS].any()
            del host.rmsnorm
            assert links.cpu_bps(host, host, gf, seconds=0.05) > 0
            assert links._layer_probe(NumpyBackend(), gf) is None
        with GGUFFile.open(oracle_manifest["models"]["tiny-llamamoe-F32"]) as gf:
            assert links._layer_probe(host, gf) is None
            assert links.cpu_bps(host, host, gf, seconds=0.05) > 0
    finally:
        host.close()


def test_cli_hybrid_values():
    from ntx_common.errors import UsageError
    from ntx_engine.cli.session import RunOptions

    base = dict(model=None, max_tokens=1, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                seed=None, system=None, raw=True, device="numpy", ctx=64, json=True)
    ecfg = RunOptions(**base, hybrid="cpu").engine_config()
    assert ecfg.hybrid == "cpu" and ecfg.host_device is None
    assert RunOptions(**base, hybrid="off").engine_config().host_device == "none"
    with pytest.raises(UsageError, match="auto, off or cpu"):
        RunOptions(**base, hybrid="gpu").engine_config()


@pytest.mark.gpu
def test_gpu_hybrid_cpu_tokens_match_resident(tmp_path):
    """--hybrid cpu on the GPU (the issue's benchmark b, small): CUDA for the VRAM layers, every
    other layer one native CPU call. Synthetic SmolLM2-shaped Q8_0 (the real file exceeds the
    device call's transfer limit). The backends sum in different orders, so: prefill top-1 at
    >= 95 % of positions, teacher-forced greedy tokens equal until the top-2 margin drops below
    0.5 logit."""
    import sys
    from pathlib import Path

    from ntx_engine.backends.cuda_driver import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"no usable CUDA GPU: {reason}")
    if load_module() is None:
        pytest.fail("native CPU kernels missing: carry ntx_engine/_cpu.abi3.so", pytrace=False)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import make_synthetic_model

    from ntx_engine import tiers
    from ntx_engine.backends.cuda_backend import CudaBackend
    from ntx_engine.config import ModelConfig
    from ntx_engine.engine import load_model
    from ntx_engine.gguf import GGUFFile

    path = tmp_path / "smollm2-q8_0.gguf"
    make_synthetic_model.write_model(path, "smollm2-135m", "q8_0", None, seed=11)
    gpu_links = Links(vram=3e12, h2d=5e10, storage=2e9, storage_kind="direct", cpu=4e10)
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    prompt = np.arange(1, 40) * 97 % cfg.vocab_size

    def ecfg(vram=None, hybrid="auto"):
        return EngineConfig(device="cuda", n_ctx=256, links=gpu_links, vram_budget=vram, ram_budget=1 << 40,
                            hybrid=hybrid)
    ref = load_model(gf, cfg, CudaBackend(), ecfg())
    ref_logits = ref.forward(prompt, 0, all_logits=True)
    out, ref_tokens = ref_logits[-1], []
    for i in range(16):
        ref_tokens.append(int(np.argmax(out)))
        out = ref.forward(np.asarray([ref_tokens[-1]]), len(prompt) + i)[-1]
    planning = CudaBackend()
    budget = next(m * MiB for m in range(16, 4096) if _plans(tiers, gf, cfg, planning, ecfg(m * MiB, "cpu")) >= 8)
    model = load_model(gf, cfg, CudaBackend(), ecfg(budget, "cpu"))
    try:
        assert {p.tier for p in model.plan.placements} == {"vram", "cpu"}, model.plan.as_dict()["layers"]
        logits = model.forward(prompt, 0, all_logits=True)
        assert (logits.argmax(-1) == ref_logits.argmax(-1)).mean() >= 0.95
        out, pos, tied = logits[-1], len(prompt), False
        for want in ref_tokens:
            top2 = np.sort(out)[-2:]
            tied = tied or top2[1] - top2[0] < 0.5
            assert tied or int(np.argmax(out)) == want, f"position {pos}"
            out = model.forward(np.asarray([want]), pos)[-1]
            pos += 1
        assert model.host_layers.stats()["calls"] > 0
    finally:
        for m in (model, ref):
            src = getattr(m, "source", None)
            if hasattr(src, "close"):
                src.close()
        gf.close()


def _plans(tiers, gf, cfg, backend, ecfg) -> int:
    """VRAM-resident layers of the plan for ecfg, -1 when the budget cannot run the model."""
    from ntx_engine.planner import PlanError

    try:
        return len(tiers.plan_for(gf, cfg, backend, ecfg, ecfg.n_ctx).layers_in("vram"))
    except PlanError:
        return -1
