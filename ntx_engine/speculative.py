"""Speculative decoding: a cheap draft proposes k tokens, one full pass verifies all of them.

Drafts: `LayerDraft` runs a subset of the model's own blocks (self-speculation: the VRAM-resident
layers, so a draft streams nothing) + final norm + head; `ModelDraft` runs a separate small model
that shares the vocabulary. Verify: one forward pass of the full model over the pending token and
the k drafts (k + 1 positions; a streamed layer is read once for all of them).

Acceptance is standard speculative sampling: draft token d with draft probability q(d) and
target probability p(d) is kept with probability min(1, p(d)/q(d)); the first rejected one is
replaced by a draw from the normalized residual max(0, p - q); when all k are kept, a bonus token
is drawn from the target's next distribution. The emitted tokens are then distributed exactly as
the target's. Greedy decoding is the special case where p and q are one-hot (keep d iff it is
the target's argmax; the residual is the target's argmax), so greedy speculation emits exactly
plain greedy's tokens.

KV cache: the target's cache is valid for the positions before the pending token. A draft pass
writes (draft-layer) entries at the positions after it, and the verify pass overwrites every
layer at all k + 1 positions before any of them is read; after acceptance the valid end moves
to just past the last accepted draft, and later positions are simply overwritten by the next
round (the backends' `truncate` is called with the new end for backends that track it). A
separate draft model tracks the ids its own cache holds and re-feeds from the first difference.

Numerics: the numpy backend's matmul of one row (decode, BLAS gemv) and of several rows
(BLAS gemm) round differently — measured up to ~1.6 logits on SmolLM2 Q4_1 — so with
`row_exact` (the default on numpy) the verify pass multiplies each position's row separately:
one pass over the weights, bit-identical to single-token decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from ntx_common.errors import ModelError, UsageError
from ntx_engine.engine import common_prefix
from ntx_engine.sampler import Sampler, SamplerConfig

K_MAX = 16
AUTO_K_START = 4


@dataclass
class SpecStats:
    """Acceptance, reported honestly: `accepted` counts only draft tokens the target kept; the
    extra token of every verify pass is a `correction` (a draft was rejected) or a `bonus`
    (all k kept), counted separately."""
    passes: int = 0  # verify passes
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    corrections: int = 0
    bonus: int = 0
    k_history: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens emitted per verify pass, accepted drafts + the correction/bonus token."""
        return (self.accepted + self.corrections + self.bonus) / self.passes if self.passes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"verify_passes": self.passes, "draft_proposed": self.proposed, "draft_accepted": self.accepted,
                "acceptance": self.acceptance, "corrections": self.corrections, "bonus": self.bonus,
                "accepted_per_pass": self.accepted / self.passes if self.passes else 0.0,
                "tokens_per_pass": self.tokens_per_pass, "draft_s": self.draft_s, "verify_s": self.verify_s}


# --- acceptance (pure) -----------------------------------------------------------------------
def accept(drafts: Sequence[int], q: Sequence[np.ndarray], p: Sequence[np.ndarray],
           rng: np.random.Generator) -> tuple[list[int], int]:
    """Speculative sampling over dense distributions: q[i] the draft's (vocab,) distribution that
    drafts[i] was drawn from, p[i] the target's at the same position, p[k] the one after the last
    draft. Returns (emitted tokens, number of drafts accepted); emitted has accepted + 1 tokens."""
    k = len(drafts)
    if len(q) != k or len(p) != k + 1:
        raise ValueError(f"accept needs k={k} draft and k+1 target distributions, got {len(q)} and {len(p)}")
    out = []
    for i, d in enumerate(drafts):
        pd, qd = float(p[i][d]), float(q[i][d])
        if qd > 0 and rng.random() < min(1.0, pd / qd):
            out.append(int(d))
            continue
        resid = np.maximum(p[i] - q[i], 0.0)
        # p == q exactly leaves no residual, but then d was accepted with probability 1
        out.append(_draw(resid if resid.sum() > 0 else p[i], rng))
        return out, i
    out.append(_draw(p[k], rng))
    return out, k


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from an unnormalized distribution (inverse CDF, float64); one-hot: no randomness used."""
    nz = np.flatnonzero(probs)
    if len(nz) == 1:
        return int(nz[0])
    cdf = np.cumsum(probs[nz], dtype=np.float64)
    return int(nz[min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(nz) - 1)])


def dense(sampler: Sampler, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
    """The sampler's distribution (penalties, top-k/p, min-p, temperature) as a dense vector;
    greedy: one-hot on the argmax."""
    ids, probs = sampler.distribution(logits, history)
    out = np.zeros(len(logits), np.float64)
    out[ids] = probs
    return out


# --- the pieces the loop drives --------------------------------------------------------------
class Draft(Protocol):
    def propose(self, ids: list[int], k: int, sampler: Sampler, rng: np.random.Generator) -> tuple[list[int], list[np.ndarray]]:
        """k draft tokens continuing `ids` (whose last token is pending) and their dense q's."""


class RowExact:
    """The backend with every matmul done one row at a time, so a k+1-position verify pass
    rounds exactly like k+1 single-token decode steps (see the module docstring)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def matmul(self, w: Any, x: np.ndarray) -> np.ndarray:
        if len(x) == 1:
            return self.backend.matmul(w, x)
        return np.concatenate([self.backend.matmul(w, x[i:i + 1]) for i in range(len(x))])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


class Target:
    """The full model of an `Engine`: prefill, one verify pass over k+1 positions, KV bookkeeping."""

    def __init__(self, engine: Any, row_exact: bool | None = None) -> None:
        self.engine, self.model = engine, engine.model
        self.row_exact = (self.model.backend.name == "numpy") if row_exact is None else row_exact

    def prefill(self, ids: list[int]) -> np.ndarray:
        return self.engine._prefill(ids)

    def verify(self, tokens: list[int], start: int) -> np.ndarray:
        """Logits (len(tokens), vocab) of `tokens` at positions start.. through every layer (a
        skipping or CUDA-graph wrapper is bypassed); every layer's KV there is rewritten."""
        inner = transformer(self.model)
        if not self.row_exact:
            return inner.forward(np.asarray(tokens), start, all_logits=True)
        plain = inner.backend
        inner.backend = RowExact(plain)
        try:
            return inner.forward(np.asarray(tokens), start, all_logits=True)
        finally:
            inner.backend = plain

    def commit(self, ids: list[int]) -> None:
        """KV is valid for every token of `ids` but the last (the pending one)."""
        valid = len(ids) - 1
        self.model.backend.truncate(valid)
        self.engine._cached = list(ids[:valid])  # Engine.generate's prefix reuse trusts this list


def transformer(model: Any) -> Any:
    """The `Transformer` under any wrappers (layer skip, CUDA decode graph)."""
    from ntx_engine.model import Transformer

    while not isinstance(model, Transformer):
        model = model.__dict__["model"]  # not getattr: the wrappers delegate unknown names
    return model


class LayerDraft:
    """Self-speculative draft: the target model run through `layers` only (+ final norm + head).
    Shares the target's KV cache: positions before the pending token hold the full model's
    entries (written by verify passes), which the draft reads as they are."""

    def __init__(self, model: Any, layers: Sequence[int]) -> None:
        n = model.cfg.n_layers
        if not layers:
            raise UsageError("a layer draft needs at least one layer")
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise UsageError(f"draft layer {bad[0]} is outside 0..{n - 1}")
        self.model, self.layers = transformer(model), sorted(set(layers))

    def propose(self, ids: list[int], k: int, sampler: Sampler, rng: np.random.Generator) -> tuple[list[int], list[np.ndarray]]:
        hist, drafts, qs = list(ids), [], []
        for _ in range(k):
            logits = self.model.forward(np.asarray(hist[-1:]), len(hist) - 1, layers=self.layers)[-1]
            q = dense(sampler, logits, hist)
            d = _draw(q, rng)
            drafts.append(d)
            qs.append(q)
            hist.append(d)
        return drafts, qs


class ModelDraft:
    """A separate draft model (an `Engine` sharing the target's vocabulary) with its own cache;
    `cached` lists the ids whose KV its cache holds, in order."""

    def __init__(self, engine: Any, target_engine: Any | None = None) -> None:
        if target_engine is not None:
            check_same_vocab(engine, target_engine)
        self.engine, self.cached = engine, []

    def propose(self, ids: list[int], k: int, sampler: Sampler, rng: np.random.Generator) -> tuple[list[int], list[np.ndarray]]:
        model = self.engine.model
        if len(ids) + k > model.n_ctx:
            raise UsageError(f"the draft model's context ({model.n_ctx}) is too short for {len(ids) + k} tokens")
        keep = common_prefix(self.cached, ids)
        keep = min(keep, len(ids) - 1)  # the pending token is always fed: its logits give q1
        model.backend.truncate(keep)  # rollback: entries from `keep` on are rewritten before being read
        logits = None
        for s in range(keep, len(ids), 256):
            logits = model.forward(np.asarray(ids[s:s + 256]), s)[-1]
        hist, drafts, qs = list(ids), [], []
        for i in range(k):
            if i:
                logits = model.forward(np.asarray(hist[-1:]), len(hist) - 1)[-1]
            q = dense(sampler, logits, hist)
            drafts.append(_draw(q, rng))
            qs.append(q)
            hist.append(drafts[-1])
        self.cached = hist[:-1]  # the last draft was never fed
        self.engine._cached = list(self.cached)
        return drafts, qs


def check_same_vocab(draft: Any, target: Any) -> None:
    a, b = draft.tokenizer, target.tokenizer
    if a.vocab_size != b.vocab_size or draft.config.vocab_size != target.config.vocab_size:
        raise ModelError(f"draft model {draft.gguf.path.name} has a {a.vocab_size}-token vocabulary, the target "
                         f"{target.gguf.path.name} {b.vocab_size}: a draft model must share the vocabulary")
    probe = range(0, a.vocab_size, max(1, a.vocab_size // 512))
    diff = [i for i in probe if a.token_bytes(i) != b.token_bytes(i)]
    if diff:
        raise ModelError(f"draft model {draft.gguf.path.name}: token {diff[0]} differs from the target's "
                         f"({a.token_bytes(diff[0])!r} vs {b.token_bytes(diff[0])!r}); it needs the same vocabulary")


# --- choosing k ------------------------------------------------------------------------------
def expected_tokens(alpha: float, k: int) -> float:
    """Tokens emitted per verify pass when each draft is accepted independently with probability
    alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def best_k(alpha: float, draft_cost: float, k_max: int = K_MAX) -> int:
    """k maximizing tokens per unit time, with one verify pass costing 1 and one draft step
    costing `draft_cost` (both measured): argmax_k expected_tokens(alpha, k) / (1 + k c)."""
    return max(range(1, k_max + 1), key=lambda k: expected_tokens(alpha, k) / (1.0 + k * draft_cost))


class AutoK:
    """`--speculate auto`: start at AUTO_K_START, then re-pick k each pass from the measured
    acceptance and the measured cost of a draft step relative to a verify pass (on a streamed
    model the verify is bound by the link, so drafts are cheap and k grows)."""

    def __init__(self, k_max: int = K_MAX) -> None:
        self.k_max = k_max

    def next_k(self, st: SpecStats) -> int:
        if st.passes < 2 or st.proposed == 0:
            return AUTO_K_START
        alpha = min(st.acceptance, 0.999)
        cost = (st.draft_s / st.proposed) / (st.verify_s / st.passes) if st.verify_s > 0 else 0.0
        return best_k(alpha, cost, self.k_max)


# --- the loop --------------------------------------------------------------------------------
def generate(engine: Any, draft: Draft, prompt_ids: Sequence[int], max_tokens: int, k: int | AutoK,
             sampler: SamplerConfig | None = None, stats: Any | None = None,
             spec: SpecStats | None = None, target: Target | None = None) -> Iterator[int]:
    """Like `Engine.generate`, with speculation: yields token ids; fills `stats`
    (a GenerationStats) and `spec` (SpecStats)."""
    from ntx_engine.engine import GenerationStats

    engine._check_ids(prompt_ids)
    if max_tokens < 0:
        raise UsageError(f"max_tokens must be >= 0, got {max_tokens}")
    if isinstance(k, int) and not 1 <= k <= K_MAX:
        raise UsageError(f"--speculate k must be in 1..{K_MAX}, got {k}")
    st = stats if stats is not None else GenerationStats()
    sp = spec if spec is not None else SpecStats()
    tgt = target or Target(engine)
    smp = Sampler(sampler or SamplerConfig(temperature=0.0))
    # a stream of its own: sharing the sampler's seed would replay its uniforms in the acceptance tests
    rng = np.random.default_rng(None if smp.cfg.seed is None else [smp.cfg.seed, 0x5BEC])
    ids = list(prompt_ids)
    st.prompt_tokens, st.stop_reason = len(ids), "length"
    t0 = time.perf_counter()
    first = smp.sample(tgt.prefill(ids), ids)
    st.prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    pending = [first]
    while pending:
        for tok in pending:
            ids.append(tok)
            st.tokens.append(tok)
            st.generated += 1
            yield tok
            stop = _stop_reason(engine, tok, st.generated, max_tokens, len(ids))
            if stop:
                st.stop_reason = stop
                break
        tgt.commit(ids)
        if stop:
            break
        pending = _round(tgt, draft, ids, _pick_k(k, sp), smp, rng, sp, max_tokens - st.generated)
    st.decode_s = time.perf_counter() - t1


def _stop_reason(engine: Any, tok: int, generated: int, max_tokens: int, n_ids: int) -> str:
    if engine.tokenizer.is_eog(tok):
        return "eos"
    if generated >= max_tokens:
        return "length"
    if n_ids >= engine.model.n_ctx:
        return "context"
    return ""


def _pick_k(k: int | AutoK, sp: SpecStats) -> int:
    return k.next_k(sp) if isinstance(k, AutoK) else k


def _round(tgt: Target, draft: Draft, ids: list[int], k: int, smp: Sampler, rng: np.random.Generator,
           sp: SpecStats, left: int) -> list[int]:
    """One draft + verify round after `ids` (last token pending); returns the tokens to emit."""
    start = len(ids) - 1
    k = max(0, min(k, left - 1, tgt.model.n_ctx - 1 - len(ids)))  # never draft past the budget
    t0 = time.perf_counter()
    drafts, qs = draft.propose(ids, k, smp, rng) if k else ([], [])
    t1 = time.perf_counter()
    rows = tgt.verify(ids[start:] + drafts, start)
    ps = [dense(smp, rows[i], ids + drafts[:i]) for i in range(k + 1)]
    out, n_acc = accept(drafts, qs, ps, rng)
    sp.draft_s += t1 - t0
    sp.verify_s += time.perf_counter() - t1
    sp.passes += 1
    sp.proposed += k
    sp.accepted += n_acc
    sp.k_history.append(k)
    if n_acc < k:
        sp.corrections += 1
    else:
        sp.bonus += 1
    return out




class Speculator:
    """What `ntx-run --speculate` holds: the target engine, a draft, k (or AutoK); `generate`
    has Engine.generate's signature and accumulates acceptance in `self.stats`."""

    def __init__(self, engine: Any, draft: Draft, k: int | AutoK, draft_desc: dict[str, Any]) -> None:
        self.engine, self.draft, self.k, self.draft_desc = engine, draft, k, draft_desc
        self.stats = SpecStats()

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 128, sampler: SamplerConfig | None = None,
                 stats: Any | None = None) -> Iterator[int]:
        return generate(self.engine, self.draft, prompt_ids, max_tokens, self.k, sampler, stats, self.stats)

    def to_dict(self) -> dict[str, Any]:
        return {"k": "auto" if isinstance(self.k, AutoK) else self.k, **self.draft_desc, **self.stats.to_dict()}


def parse_k(text: str) -> int | AutoK:
    if text.strip().lower() == "auto":
        return AutoK()
    try:
        k = int(text)
    except ValueError:
        raise UsageError(f"--speculate takes a number of draft tokens (1..{K_MAX}) or 'auto', got {text!r}") from None
    if not 1 <= k <= K_MAX:
        raise UsageError(f"--speculate k must be in 1..{K_MAX}, got {k}")
    return k


def default_draft_layers(engine: Any) -> list[int]:
    """The VRAM-resident layers when the tier plan streams some (the draft then reads nothing
    over a link), else every layer."""
    plan = getattr(engine.model, "plan", None)
    if plan is not None and getattr(plan, "streamed", False):
        return list(plan.layers_in("vram"))
    return list(range(engine.config.n_layers))


def speculator_for(engine: Any, k_text: str, draft_engine: Any | None = None, draft_layers: Sequence[int] | None = None,
                   skipped: Sequence[int] = ()) -> Speculator:
    """A separate draft model when given; else self-speculation over `draft_layers` (default:
    `default_draft_layers`) minus `skipped`."""
    k = parse_k(k_text)
    if draft_engine is not None:
        return Speculator(engine, ModelDraft(draft_engine, engine), k, {"draft": str(draft_engine.gguf.path)})
    layers = default_draft_layers(engine) if draft_layers is None else list(draft_layers)
    layers = [i for i in layers if i not in set(skipped)]
    if not layers:
        raise UsageError("the self-speculative draft has no layers (none VRAM-resident, or all skipped): "
                         "give --draft-layers N or --draft-model PATH")
    return Speculator(engine, LayerDraft(engine.model, layers), k,
                      {"draft": "self", "draft_layers": layers, "draft_layer_count": len(layers)})
