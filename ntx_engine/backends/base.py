"""The op interface every backend implements; the model (`model.py`) is written once against it.

Activations are backend arrays of shape (n_tokens, width). Weights are whatever the backend's
`matrix`/`vector` return (prepared once at load). Attention owns the KV cache write so a
backend can fuse the write with the read.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ntx_engine.config import ModelConfig


class Backend(Protocol):
    name: str

    def matrix(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int], name: str) -> Any:
        """Prepare a 2-D weight (rows, k) from its raw GGUF bytes."""

    def vector(self, raw: np.ndarray, ggml_type: int, n: int, name: str) -> Any:
        """Prepare a 1-D weight (norm gain, bias) from its raw GGUF bytes."""

    def embed(self, table: Any, ids: np.ndarray) -> Any:
        """Rows of the embedding table for token ids -> (n, n_embd)."""

    def matmul(self, w: Any, x: Any) -> Any:
        """x (n, k) times w (rows, k)^T -> (n, rows)."""

    def matmul_many(self, ws: Any, x: Any) -> list:
        """[matmul(w, x) for w in ws] (q, k, v): one launch where the backend can fuse them."""

    def matmul_swiglu(self, w_gate: Any, w_up: Any, x: Any) -> Any:
        """swiglu(matmul(w_gate, x), matmul(w_up, x)), fused where the backend can."""

    def rmsnorm(self, x: Any, w: Any, eps: float) -> Any: ...

    def rope(self, x: Any, positions: np.ndarray, n_heads: int) -> Any:
        """Rotate x (n, n_heads*head_dim) for absolute positions (tables from `set_model`)."""

    def attention(self, q: Any, k: Any, v: Any, layer: int, start: int) -> Any:
        """Append k, v (n, kv_dim) at `start` to layer's cache, causal GQA attention -> (n, q_dim)."""

    def rope_attention(self, q: Any, k: Any, v: Any, positions: np.ndarray, layer: int, start: int) -> Any:
        """attention(rope(q, positions, n_head), rope(k, positions, n_head_kv), v, layer, start),
        fused where the backend can (RoPE + KV-cache write in one kernel)."""

    def swiglu(self, gate: Any, up: Any) -> Any: ...

    def add(self, a: Any, b: Any) -> Any: ...

    def set_model(self, cfg: ModelConfig, n_ctx: int, rope_freqs: np.ndarray | None) -> None:
        """Allocate the KV cache for n_ctx positions and the RoPE tables."""

    def truncate(self, n_pos: int) -> None:
        """Forget cached positions >= n_pos (new prompt, speculative rollback)."""

    def to_numpy(self, x: Any) -> np.ndarray: ...


# --- the fused ops as the model calls them ---------------------------------------------------
# A backend's own fused op when its class defines one, else the plain composition. The lookup is
# on the class, so a wrapper that forwards attributes (speculative.RowExact: matmul row by row)
# gets the composition over its own matmul instead of the wrapped backend's fused op.
def matmul_many(b: Any, ws: Any, x: Any) -> list:
    if hasattr(type(b), "matmul_many"):
        return b.matmul_many(ws, x)
    return [b.matmul(w, x) for w in ws]


def matmul_swiglu(b: Any, w_gate: Any, w_up: Any, x: Any) -> Any:
    if hasattr(type(b), "matmul_swiglu"):
        return b.matmul_swiglu(w_gate, w_up, x)
    return b.swiglu(b.matmul(w_gate, x), b.matmul(w_up, x))


def rope_attention(b: Any, cfg: ModelConfig, q: Any, k: Any, v: Any, positions: np.ndarray, layer: int,
                   start: int) -> Any:
    if hasattr(type(b), "rope_attention"):
        return b.rope_attention(q, k, v, positions, layer, start)
    return b.attention(b.rope(q, positions, cfg.n_head), b.rope(k, positions, cfg.n_head_kv), v, layer, start)
