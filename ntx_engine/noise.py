"""How far float32 rounding alone moves a model's logits: the yardstick for comparing engines.

Two correct engines that sum floats in a different order differ by a few ulps before each
8-bit activation quantization; a flipped int8 step then propagates through the layers. The
numpy backend measures that spread on itself by jittering every matmul input by `rel`
(a few ulps) and recording the largest logit change per position over several seeds.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ntx_engine.backends.numpy_backend import NumpyBackend


def rounding_noise(logits: Callable[[], np.ndarray], backend: NumpyBackend,
                   seeds: tuple[int, ...] = (1, 2, 3), rel: float = 1e-6) -> np.ndarray:
    """Per-position max |logit change| of `logits()` (rows = positions) under jittered matmuls."""
    base = logits()
    worst = np.zeros(len(base), np.float32)
    for seed in seeds:
        rng = np.random.default_rng(seed)

        def jittered(w, x, _rng=rng):
            x = (x * (1 + _rng.standard_normal(x.shape) * rel)).astype(np.float32)
            return NumpyBackend.matmul(backend, w, x)

        backend.matmul = jittered  # instance attribute shadows the method for these runs only
        try:
            worst = np.maximum(worst, np.abs(logits() - base).max(axis=-1))
        finally:
            del backend.matmul
    return worst
