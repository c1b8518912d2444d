"""Perplexity of a model (optionally with skipped layers) over a text, and top-1 agreement with
the unskipped model: the two quality numbers every layer-skip setting is judged by.

The text is cut into consecutive windows of `window` tokens; each window starts from an empty
context (position 0), and every position in it but the last predicts the next token, so a window
of n tokens scores n - 1 predictions. Perplexity is exp(mean negative log-likelihood) over all
scored positions; agreement is the fraction of positions whose argmax equals the reference
model's argmax on the same window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ntx_common.errors import UsageError

FORWARD_CHUNK = 256  # tokens per forward call: bounds the (tokens, vocab) logits buffer


@dataclass(frozen=True)
class PerplexityResult:
    nll_sum: float  # sum of -log p(next token) over scored positions, natural log
    scored: int  # predictions scored
    top1: np.ndarray  # (scored,) argmax at every scored position, for agreement
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.scored <= 0:
            raise ValueError("no position was scored: the text needs at least 2 tokens per window")

    @property
    def nll(self) -> float:
        return self.nll_sum / self.scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    @property
    def tok_s(self) -> float:
        return self.scored / self.seconds if self.seconds > 0 else 0.0

    def agreement(self, reference: "PerplexityResult") -> float:
        """Fraction of positions where this run's argmax equals `reference`'s."""
        if reference.top1.shape != self.top1.shape:
            raise ValueError(f"agreement needs the same positions: {self.top1.shape} vs {reference.top1.shape}")
        return float(np.mean(self.top1 == reference.top1))


def windows(ids: Sequence[int], window: int, max_tokens: int | None = None) -> list[list[int]]:
    """Consecutive windows of `window` tokens over the first `max_tokens` ids (a short tail that
    scores fewer than 2 tokens is dropped)."""
    if window < 2:
        raise UsageError(f"perplexity window must be >= 2 tokens, got {window}")
    ids = list(ids if max_tokens is None else ids[:max_tokens])
    return [ids[s:s + window] for s in range(0, len(ids), window) if len(ids[s:s + window]) >= 2]


def window_scores(model: Any, ids: Sequence[int], layers: Sequence[int] | None = None) -> tuple[float, np.ndarray]:
    """(sum of NLL, argmax per position) for one window run from position 0."""
    nll, top1 = 0.0, []
    for s in range(0, len(ids) - 1, FORWARD_CHUNK):
        part = ids[s:s + FORWARD_CHUNK]
        logits = model.forward(np.asarray(part), s, all_logits=True, layers=layers).astype(np.float64)
        nxt = np.asarray(ids[s + 1:s + 1 + len(part)])
        logits = logits[:len(nxt)]  # the window's last token predicts nothing inside it
        m = logits.max(axis=-1)
        logz = m + np.log(np.exp(logits - m[:, None]).sum(axis=-1))
        nll += float(np.sum(logz - logits[np.arange(len(nxt)), nxt]))
        top1.append(logits.argmax(axis=-1))
    return nll, np.concatenate(top1)


def evaluate(model: Any, ids: Sequence[int], window: int, layers: Sequence[int] | None = None,
             max_tokens: int | None = None) -> PerplexityResult:
    """Perplexity of `model` (running only `layers`, default all) over `ids`."""
    import time

    if window > model.n_ctx:
        raise UsageError(f"perplexity window {window} is longer than the context ({model.n_ctx})")
    t0 = time.perf_counter()
    total, tops = 0.0, []
    for w in windows(ids, window, max_tokens):
        nll, top1 = window_scores(model, w, layers)
        total += nll
        tops.append(top1)
    if not tops:
        raise UsageError(f"the text has {len(ids)} tokens: too short for a perplexity")
    top = np.concatenate(tops)
    return PerplexityResult(total, len(top), top, time.perf_counter() - t0)
