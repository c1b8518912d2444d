"""Rotary position embedding angles, computed the way llama.cpp computes them.

llama.cpp builds theta_i = pos * base^(-2i/d) as a running float32 product starting at pos
(theta *= scale), not with pow() per dimension; matching that keeps our logits within rounding of the oracle.
"""

from __future__ import annotations

import numpy as np

from ntx_engine.config import ModelConfig


def cos_sin(
    cfg: ModelConfig, positions: np.ndarray, freq_factors: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables (n, rope_dim/2) float32 for absolute positions, llama3 factors and linear scaling."""
    half = cfg.rope_dim // 2
    scale = np.float32(np.float32(cfg.rope_base) ** np.float32(-2.0 / cfg.rope_dim))
    ff = np.ones(half, np.float32) if freq_factors is None else freq_factors.astype(np.float32)[:half]
    theta = positions.astype(np.float32).copy()
    angles = np.empty((len(theta), half), dtype=np.float32)
    for i in range(half):  # the running product, starting at pos, as ggml's rope cache does
        angles[:, i] = (theta / ff[i]) * np.float32(cfg.rope_freq_scale)
        theta = (theta * scale).astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_type: str, rope_dim: int) -> np.ndarray:
    """Rotate x (n, heads, head_dim) in place of a copy; dims past rope_dim pass through."""
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if rope_type == "norm":  # adjacent pairs (x0, x1), (x2, x3), ...
        x0, x1 = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
        out[..., 0:rope_dim:2] = x0 * c - x1 * s
        out[..., 1:rope_dim:2] = x0 * s + x1 * c
    else:  # neox halves (x_i, x_{i+d/2})
        h = rope_dim // 2
        x0, x1 = x[..., :h], x[..., h:rope_dim]
        out[..., :h] = x0 * c - x1 * s
        out[..., h:rope_dim] = x0 * s + x1 * c
    return out
