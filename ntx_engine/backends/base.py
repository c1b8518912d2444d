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

    def rmsnorm(self, x: Any, w: Any, eps: float) -> Any: ...

    def rope(self, x: Any, positions: np.ndarray, n_heads: int) -> Any:
        """Rotate x (n, n_heads*head_dim) for absolute positions (tables from `set_model`)."""

    def attention(self, q: Any, k: Any, v: Any, layer: int, start: int) -> Any:
        """Append k, v (n, kv_dim) at `start` to layer's cache, causal GQA attention -> (n, q_dim)."""

    def swiglu(self, gate: Any, up: Any) -> Any: ...

    def add(self, a: Any, b: Any) -> Any: ...

    def set_model(self, cfg: ModelConfig, n_ctx: int, rope_freqs: np.ndarray | None) -> None:
        """Allocate the KV cache for n_ctx positions and the RoPE tables."""

    def truncate(self, n_pos: int) -> None:
        """Forget cached positions >= n_pos (new prompt, speculative rollback)."""

    def to_numpy(self, x: Any) -> np.ndarray: ...
