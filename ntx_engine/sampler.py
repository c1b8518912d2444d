"""Next-token sampling: repetition penalty, top-k, top-p, min-p, temperature, seeded draw.

The steps run in llama.cpp's default order (penalties -> top-k -> top-p -> min-p ->
temperature -> draw), so top-p and min-p see the temperature-1 probabilities and the
temperature only reshapes what survives. Temperature <= 0 is greedy: the argmax after the
repetition penalty (with the default penalty of 1.0, the plain argmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 0.8  # <= 0: greedy
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64  # tokens of history penalised; 0: off, -1: all of it
    seed: int | None = None  # None: a fresh seed from the OS

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0.0):
            raise ValueError(f"repeat_penalty must be a positive number, got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1 (-1: whole history), got {self.repeat_last_n}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Picks token ids from logits; the same config and seed give the same sequence."""

    def __init__(self, cfg: SamplerConfig) -> None:
        self.cfg = cfg
        self._rng = np.random.default_rng(cfg.seed)

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """One token id. `history` is every token so far (prompt and generated)."""
        x = self._penalized(_as_logits(logits), history)
        if self.cfg.greedy:
            return int(np.argmax(x))
        ids, probs = self._filtered(x)
        # Inverse CDF on float64 cumulative sums: one uniform draw per token keeps streams reproducible.
        cdf = np.cumsum(probs)
        k = int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"))
        return int(ids[min(k, len(ids) - 1)])

    def distribution(self, logits: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The ids `sample` can return and their probabilities (greedy: the argmax with 1.0)."""
        x = self._penalized(_as_logits(logits), history)
        if self.cfg.greedy:
            return np.array([int(np.argmax(x))]), np.ones(1)
        return self._filtered(x)

    def _penalized(self, x: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """llama.cpp's repetition penalty: logits of recent tokens shrink towards (or below)
        zero; a positive logit is divided, a negative one multiplied."""
        cfg = self.cfg
        if cfg.repeat_penalty == 1.0 or cfg.repeat_last_n == 0 or len(history) == 0:
            return x
        window = history if cfg.repeat_last_n < 0 else history[-cfg.repeat_last_n:]
        seen = np.unique(np.asarray(window, dtype=np.int64))
        if seen[0] < 0 or seen[-1] >= x.size:
            raise ValueError(f"history holds token ids outside the {x.size}-entry logits")
        x = x.copy()
        v = x[seen]
        x[seen] = np.where(v <= 0, v * cfg.repeat_penalty, v / cfg.repeat_penalty)
        return x

    def _filtered(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg
        ids = _top_ids(x, cfg.top_k)
        z = x[ids].astype(np.float64)  # sorted, largest first
        if cfg.top_p < 1.0:
            cum = np.cumsum(_softmax(z))
            keep = int(np.searchsorted(cum, cfg.top_p, side="left")) + 1  # first prefix reaching p
            ids, z = ids[:keep], z[:keep]
        if cfg.min_p > 0.0:
            keep = int(np.count_nonzero(z >= z[0] + math.log(cfg.min_p)))
            ids, z = ids[:max(keep, 1)], z[:max(keep, 1)]
        return ids, _softmax(z / cfg.temperature)


def _as_logits(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
    if np.isnan(x).any():
        raise ValueError("logits contain NaN: the forward pass produced invalid numbers")
    return x


def _top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits (all if k is 0), largest first; ties go to the lower id."""
    if 0 < k < x.size:
        kth = x[np.argpartition(-x, k - 1)[k - 1]]  # O(n): no full sort of a 150k vocabulary
        above = np.nonzero(x > kth)[0]
        ids = np.concatenate([above, np.nonzero(x == kth)[0][:k - above.size]])
    else:
        ids = np.arange(x.size)
    return ids[np.lexsort((ids, -x[ids]))]


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()
