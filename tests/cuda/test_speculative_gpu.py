"""Self-speculative decoding on the CUDA engine: greedy speculative output must equal plain
greedy decoding (the decode graph) token for token, for several drafts and k. The verify pass
runs k+1 positions through the batched matvec kernels (no row-by-row fallback on CUDA), so
this holds only if those kernels round each row exactly as the single-token kernels do; a
draft identical to the target must then be accepted every time. The tiny llama fixture has
random weights: its drafts are rejected often, which exercises the KV rollback."""

from __future__ import annotations

import pytest

from ntx_engine import speculative as S
from ntx_engine.engine import Engine, EngineConfig

pytestmark = pytest.mark.gpu
N_TOKENS = 40


@pytest.fixture(scope="module")
def eng(cuda_backend, oracle_manifest):
    e = Engine.load(oracle_manifest["models"]["tiny-llama-Q4_K_M"], EngineConfig(device="cuda", n_ctx=256))
    yield e
    e.close()


def _run(eng, draft, k):
    ids = eng.tokenize("Once upon a time, in a small village by the sea,")
    eng._cached = []
    if draft is None:
        return list(eng.generate(ids, N_TOKENS)), None
    sp = S.SpecStats()
    return list(S.generate(eng, draft, ids, N_TOKENS, k, spec=sp)), sp


@pytest.mark.parametrize("layers,k", [("half", 2), ("half", 4), ("all", 3), ("all", 7)])
def test_greedy_speculation_on_cuda_is_plain_greedy(eng, layers, k, record_measurement):
    want, _ = _run(eng, None, 0)
    n = eng.model.cfg.n_layers
    draft_layers = range(n // 2) if layers == "half" else range(n)
    got, sp = _run(eng, S.LayerDraft(eng.model, draft_layers), k)
    record_measurement({"test": "cuda-speculative-greedy", "draft": layers, "k": k, **sp.to_dict()})
    assert got == want, f"draft {layers} k={k}: speculative {got} vs plain {want}"
    if layers == "all":  # draft == target: every proposal must be accepted
        assert sp.accepted == sp.proposed, sp.to_dict()
