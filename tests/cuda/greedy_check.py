"""Greedy decoding and the near-tie comparison the GPU end-to-end tests share."""

from __future__ import annotations

import numpy as np


def greedy(forward, prompt: np.ndarray, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens of `forward(ids, start)` after `prompt`, and the logits of every step."""
    logits = forward(prompt, 0)[-1]
    toks, all_logits = [], [logits]
    for i in range(steps):
        toks.append(int(np.argmax(logits)))
        logits = forward(np.asarray([toks[-1]]), len(prompt) + i)[-1]
        all_logits.append(logits)
    return toks, all_logits


def agree_until_tie(ref_toks, ref_logits, toks, near_tie: float) -> tuple[int, bool]:
    """Identical leading tokens, and whether the first mismatch came at a near-tie (margin of
    the reference's top two logits below near_tie)."""
    for i, (a, b) in enumerate(zip(ref_toks, toks)):
        if a != b:
            top2 = np.sort(ref_logits[i])[-2:]
            return i, bool(top2[1] - top2[0] < near_tie)
    return len(ref_toks), False
