"""Speculative decoding: greedy output token-identical to plain greedy on SmolLM2 (several k,
several draft-layer counts, a separate draft model), KV rollback (the whole cache equals a plain
run's; positions past the valid end poisoned with NaN are never read), and the sampling
distribution (chi-square against the exact target distribution of a toy model)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from ntx_common.errors import ModelError, UsageError
from ntx_engine import speculative as S
from ntx_engine.cli.run import app
from ntx_engine.engine import Engine, EngineConfig
from ntx_engine.sampler import SamplerConfig

ENV = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}
PROMPT = "The capital of France is Paris. The capital of Germany is"
N_TOKENS = 14


# --- SmolLM2: greedy identity and KV ----------------------------------------------------------
@pytest.fixture(scope="module")
def eng(smollm2_path):
    e = Engine.load(smollm2_path, EngineConfig(device="numpy", n_ctx=128))  # the oracle backend
    yield e
    e.close()


@pytest.fixture(scope="module")
def plain(eng):
    """Plain greedy from an empty cache: its tokens and the KV cache it leaves."""
    ids = eng.tokenize(PROMPT)
    eng._cached = []
    toks = list(eng.generate(ids, N_TOKENS))
    b = eng.model.backend
    return ids, toks, b.k_cache.copy(), b.v_cache.copy()


def _spec(eng, draft, k, n=N_TOKENS, sampler=None):
    ids = eng.tokenize(PROMPT)
    eng._cached = []  # same prefill as the plain run: the whole prompt in one batch
    sp = S.SpecStats()
    out = list(S.generate(eng, draft, ids, n, k, sampler, spec=sp))
    return ids, out, sp


def _check_counts(sp: S.SpecStats, out: list[int]):
    assert sp.proposed == sum(sp.k_history) and 0 <= sp.accepted <= sp.proposed
    assert sp.corrections + sp.bonus == sp.passes
    # one token from prefill, then accepted + 1 per verify pass (the last pass may be cut short)
    assert 1 + sp.accepted + sp.passes >= len(out) > sp.accepted + sp.passes - max(sp.k_history, default=0)


@pytest.mark.parametrize("layers,k", [(range(12), 2), (range(24), 4), ([i for i in range(30) if not 12 <= i < 16], 3)],
                         ids=["first12-k2", "first24-k4", "skip12..15-k3"])
def test_greedy_self_speculation_is_plain_greedy(eng, plain, layers, k):
    ids, want, k_plain, v_plain = plain
    _, out, sp = _spec(eng, S.LayerDraft(eng.model, layers), k)
    assert out == want
    _check_counts(sp, out)
    # rollback: every position the cache claims valid holds exactly what plain decoding wrote
    n = len(ids) + len(out) - 1
    b = eng.model.backend
    assert np.array_equal(b.k_cache[:, :n], k_plain[:, :n]) and np.array_equal(b.v_cache[:, :n], v_plain[:, :n])
    assert eng._cached == (ids + out)[:n]


def test_native_cpu_backend_batched_verify(smollm2_path):
    """The native CPU kernels round a row the same in any batch, so there the verify pass runs
    batched (row_exact off by default) and must still equal plain greedy."""
    e = Engine.load(smollm2_path, EngineConfig(device="cpu", n_ctx=128))
    ids = e.tokenize(PROMPT)
    want = list(e.generate(ids, N_TOKENS))
    assert S.Target(e).row_exact == (e.model.backend.name == "numpy")
    _, out, sp = _spec(e, S.LayerDraft(e.model, range(20)), 3)
    assert out == want and sp.corrections >= 1
    e.close()


def test_rejected_positions_are_never_read(eng, plain):
    """After every round, poison all layers' K/V from the valid end on with NaN: a stale entry
    that was read would turn the logits into NaN (the sampler refuses) or change a token."""
    ids, want, _, _ = plain
    b, commit = eng.model.backend, S.Target.commit

    def poisoning_commit(self, seq):
        commit(self, seq)
        b.k_cache[:, len(seq) - 1:] = np.nan
        b.v_cache[:, len(seq) - 1:] = np.nan

    S.Target.commit = poisoning_commit
    try:
        _, out, sp = _spec(eng, S.LayerDraft(eng.model, range(10)), 3)
    finally:
        S.Target.commit = commit
    assert out == want
    assert sp.corrections >= 3  # the 10-layer draft is mostly wrong: many rollbacks happened


def test_separate_draft_model(eng, plain, oracle_manifest):
    """A Q8_0 re-quantization of the same model drafts for the Q4_1 target; its own cache is
    poisoned past the ids it holds after every proposal."""
    ids, want, _, _ = plain
    d = Engine.load(oracle_manifest["models"]["smollm2-Q8_0"], EngineConfig(device="numpy", n_ctx=128))
    draft = S.ModelDraft(d, eng)
    propose = draft.propose

    def poisoned(*a):
        out = propose(*a)
        d.model.backend.k_cache[:, len(draft.cached):] = np.nan
        return out

    draft.propose = poisoned
    _, out, sp = _spec(eng, draft, 4)
    assert out == want
    _check_counts(sp, out)
    assert sp.acceptance > 0.5, sp.to_dict()  # the same weights at another precision mostly agree


def test_random_weight_draft_model_sharing_the_vocabulary(eng, plain, oracle_manifest):
    """tiny-llama (2 random layers, SmolLM2's tokenizer) is a legal but useless draft: nearly
    every round rolls back, and the output is still plain greedy's."""
    ids, want, _, _ = plain
    d = Engine.load(oracle_manifest["models"]["tiny-llama-Q8_0"], EngineConfig(device="numpy", n_ctx=128))
    _, out, sp = _spec(eng, S.ModelDraft(d, eng), 2)
    assert out == want
    assert sp.corrections >= sp.passes - 2


def test_draft_model_needs_the_same_vocabulary(eng):
    class Tok:
        def __init__(self, n, odd=None):
            self.vocab_size, self.odd = n, odd

        def token_bytes(self, i):
            return b"?" if i == self.odd else eng.tokenizer.token_bytes(i)

    def fake(n, odd=None):
        return SimpleNamespace(tokenizer=Tok(n, odd), config=SimpleNamespace(vocab_size=n),
                               gguf=SimpleNamespace(path=eng.gguf.path.with_name("draft.gguf")))

    n = eng.config.vocab_size
    S.check_same_vocab(fake(n), eng)
    with pytest.raises(ModelError, match="vocabulary"):
        S.check_same_vocab(fake(n - 1), eng)
    with pytest.raises(ModelError, match="token 96 differs"):
        S.check_same_vocab(fake(n, odd=96), eng)


def test_sampling_is_seeded_and_auto_k(eng):
    cfg = SamplerConfig(temperature=0.8, seed=7)
    runs = [_spec(eng, S.LayerDraft(eng.model, range(24)), S.AutoK(), n=10, sampler=cfg) for _ in range(2)]
    assert runs[0][1] == runs[1][1] and len(runs[0][1]) == 10
    sp = runs[0][2]
    _check_counts(sp, runs[0][1])
    assert sp.k_history[0] == S.AUTO_K_START and all(1 <= k <= S.K_MAX for k in sp.k_history[:-1])


# --- choosing k --------------------------------------------------------------------------------
def test_expected_tokens_and_best_k():
    for a in (0.0, 0.3, 0.8):
        for k in (1, 4):
            assert S.expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))
    assert S.expected_tokens(1.0, 5) == 6
    assert S.best_k(0.95, 0.0) == S.K_MAX  # free drafts: draft as far as allowed
    assert S.best_k(0.0, 0.1) == 1
    assert S.best_k(0.6, 0.5) < S.best_k(0.6, 0.01)  # dearer drafts, shorter runs
    assert S.parse_k("auto").__class__ is S.AutoK and S.parse_k("3") == 3
    for bad in ("0", "17", "x"):
        with pytest.raises(UsageError):
            S.parse_k(bad)


# --- the acceptance rule on toy distributions --------------------------------------------------
V = 3
TARGET = np.array([[1.0, 0.0, -0.8], [0.2, 0.9, -0.5], [-0.4, 0.3, 0.8]])  # logits of the next token by last token
DRAFT = np.array([[0.0, 1.0, -0.2], [0.9, -0.3, 0.4], [0.1, 0.1, 0.1]])


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


class _ToyTarget:
    def __init__(self):
        self.model, self.hist = SimpleNamespace(n_ctx=64), []

    def prefill(self, ids):
        self.hist = list(ids)
        return TARGET[ids[-1]].astype(np.float32)

    def verify(self, tokens, start):
        return np.stack([TARGET[t] for t in tokens]).astype(np.float32)

    def commit(self, ids):
        self.hist = list(ids[:-1])


class _ToyDraft:
    """Draws each draft token from softmax(DRAFT[last]) with numpy's own choice (not speculative._draw)."""

    def propose(self, ids, k, sampler, rng):
        last, drafts, qs = ids[-1], [], []
        for _ in range(k):
            q = _softmax(DRAFT[last])
            last = int(rng.choice(V, p=q))
            drafts.append(last)
            qs.append(q)
        return drafts, qs


def _chi2_sf(x: float, df: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty cube-root normal approximation; within a few
    percent of the exact tail for df >= 10 at the p-values used here)."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _sample_sequences(n_trials: int, n_tokens: int, k: int) -> np.ndarray:
    toy = SimpleNamespace(_check_ids=lambda ids: None, tokenizer=SimpleNamespace(is_eog=lambda t: False),
                          model=SimpleNamespace(n_ctx=64))
    counts = np.zeros((V,) * n_tokens)
    cfg = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    for seed in range(n_trials):
        out = list(S.generate(toy, _ToyDraft(), [0], n_tokens, k, SamplerConfig(seed=seed, **cfg), target=_ToyTarget()))
        counts[tuple(out)] += 1
    return counts


def _target_joint(n_tokens: int) -> np.ndarray:
    joint = _softmax(TARGET[0])  # first token after the prompt [0]
    for _ in range(n_tokens - 1):
        nxt = np.stack([_softmax(TARGET[a]) for a in range(V)])  # (last, next)
        joint = joint[..., None] * nxt.reshape((1,) * (joint.ndim - 1) + (V, V))
    return joint


def _chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    exp, obs = (probs * n).ravel(), counts.ravel()
    small = exp < 5  # pool sparse cells so the chi-square approximation holds
    if small.any():
        exp, obs = np.append(exp[~small], exp[small].sum()), np.append(obs[~small], obs[small].sum())
    stat = float(np.sum((obs - exp) ** 2 / exp))
    return _chi2_sf(stat, len(exp) - 1)


def test_speculative_sampling_has_the_target_distribution():
    """20,000 seeded 4-token continuations with k=2 (each run has acceptances, rejections with
    a residual draw, and bonus tokens) against the exact target joint distribution over 81
    sequences. Threshold p > 1e-3: with the seeds fixed the result is deterministic, and a
    correct sampler fails such a test with probability 1e-3 for a fresh seed set; the broken
    variant below (always accept = the draft's distribution) scores p < 1e-12."""
    counts = _sample_sequences(20_000, 4, 2)
    target = _target_joint(4)
    assert counts.sum() == 20_000
    p = _chi2_p(counts, target)
    assert p > 1e-3, f"chi-square p = {p:.2e}: speculative samples do not follow the target distribution"


def test_the_chi_square_test_catches_a_wrong_acceptance_rule(monkeypatch):
    def accept_all(drafts, q, p, rng):
        return list(drafts) + [S._draw(p[len(drafts)], rng)], len(drafts)

    monkeypatch.setattr(S, "accept", accept_all)
    counts = _sample_sequences(5_000, 4, 2)
    assert _chi2_p(counts, _target_joint(4)) < 1e-12


def test_accept_greedy_is_exact_match():
    onehot = lambda i: np.eye(5)[i]  # noqa: E731
    rng = np.random.default_rng(0)
    out, n = S.accept([1, 2, 3], [onehot(1), onehot(2), onehot(3)], [onehot(1), onehot(2), onehot(4), onehot(0)], rng)
    assert (out, n) == ([1, 2, 4], 2)  # third draft rejected, the target's argmax replaces it
    out, n = S.accept([1, 2], [onehot(1), onehot(2)], [onehot(1), onehot(2), onehot(3)], rng)
    assert (out, n) == ([1, 2, 3], 2)  # all kept + the bonus token


# --- CLI ---------------------------------------------------------------------------------------
def test_cli_speculate_json(eng, plain):
    ids, want, _, _ = plain
    res = CliRunner().invoke(app, [PROMPT, "--raw", "--temperature", "0", "-n", "8", "--device", "numpy",
                                   "--speculate", "3", "--draft-layers", "24", "--json", "-m", str(eng.gguf.path)], env=ENV)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["tokens"] == want[:8]
    sp = out["speculative"]
    assert sp["k"] == 3 and sp["draft"] == "self" and sp["draft_layers"] == list(range(24))
    assert sp["draft_accepted"] <= sp["draft_proposed"] and sp["corrections"] + sp["bonus"] == sp["verify_passes"]


def test_cli_draft_options_need_speculate(eng):
    res = CliRunner().invoke(app, ["hi", "--device", "cpu", "--draft-layers", "4", "-m", str(eng.gguf.path)], env=ENV)
    assert isinstance(res.exception, UsageError) and "--speculate" in str(res.exception)


def test_default_draft_is_the_vram_resident_layers(eng):
    """With a tier plan that streams, the self-speculative draft defaults to the VRAM layers."""
    tiers = ["vram"] * 10 + ["ram"] * 12 + ["storage"] * 8
    plan = SimpleNamespace(streamed=True, layers_in=lambda t: [i for i, x in enumerate(tiers) if x == t])
    fake = SimpleNamespace(model=SimpleNamespace(plan=plan), config=eng.config)
    assert S.default_draft_layers(fake) == list(range(10))
    assert S.default_draft_layers(SimpleNamespace(model=SimpleNamespace(), config=eng.config)) == list(range(30))
    spec = S.speculator_for(eng, "2", skipped=(3, 4))
    assert spec.draft_desc["draft_layers"] == [i for i in range(30) if i not in (3, 4)]
