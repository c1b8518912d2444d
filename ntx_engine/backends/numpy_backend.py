"""The numpy backend: the oracle for the CUDA kernels and the CPU path. float32, readable.

Two matmul modes: `exact` multiplies float32 activations by the dequantized weights; `ggml`
(default) first quantizes each activation row to the weight type's vec_dot_type exactly as
llama.cpp's CPU backend does, so the logits match llama.cpp to rounding. With an F16 KV cache,
q and the attention probabilities are rounded to F16 before their dot products, as ggml does
when one operand of a matmul is F16.
"""

from __future__ import annotations

import numpy as np

from ntx_engine import matmul, quants, rope
from ntx_engine.config import ModelConfig

KV_DTYPES = {"f16": np.float16, "f32": np.float32}


class NumpyBackend:
    name = "numpy"

    def __init__(self, matmul_mode: str = "ggml", kv_dtype: str = "f16") -> None:
        if matmul_mode not in ("ggml", "exact"):
            raise ValueError(f"matmul_mode must be 'ggml' or 'exact', got {matmul_mode!r}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
        self.matmul_mode = matmul_mode
        self.kv_dtype = KV_DTYPES[kv_dtype]
        self.cfg: ModelConfig | None = None

    # weights ---------------------------------------------------------------------------
    def matrix(self, raw, ggml_type, shape, name):
        return matmul.MatmulWeight.from_raw(raw, ggml_type, shape, name)

    def vector(self, raw, ggml_type, n, name):
        return quants.dequantize(raw, ggml_type, (n,), name).astype(np.float32)

    # ops -------------------------------------------------------------------------------
    def embed(self, table: matmul.MatmulWeight, ids: np.ndarray) -> np.ndarray:
        return table.rows(np.asarray(ids, dtype=np.int64)).astype(np.float32)

    def matmul(self, w: matmul.MatmulWeight, x: np.ndarray) -> np.ndarray:
        return w.matmul(x, self.matmul_mode)

    # the fused ops of base.Backend, as the plain compositions they stand for (the oracle)
    def matmul_many(self, ws, x: np.ndarray) -> list[np.ndarray]:
        return [self.matmul(w, x) for w in ws]

    def matmul_swiglu(self, w_gate, w_up, x: np.ndarray) -> np.ndarray:
        return self.swiglu(self.matmul(w_gate, x), self.matmul(w_up, x))

    def rope_attention(self, q, k, v, positions, layer, start):
        cfg = self._model()
        return self.attention(self.rope(q, positions, cfg.n_head), self.rope(k, positions, cfg.n_head_kv), v, layer,
                              start)

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        mean = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)  # ggml sums in double
        scale = (1.0 / np.sqrt(mean.astype(np.float32) + np.float32(eps))).astype(np.float32)
        return (x * scale) * w

    def rope(self, x: np.ndarray, positions: np.ndarray, n_heads: int) -> np.ndarray:
        cfg = self._model()
        cos, sin = rope.cos_sin(cfg, positions, self.rope_freqs)
        heads = x.reshape(len(x), n_heads, cfg.head_dim)
        return rope.apply(heads, cos, sin, cfg.rope_type, cfg.rope_dim).reshape(x.shape)

    def attention(self, q, k, v, layer, start):
        cfg = self._model()
        n, end = len(q), start + len(q)
        if end > self.n_ctx:
            raise ValueError(f"context full: position {end} exceeds n_ctx {self.n_ctx}")
        self.k_cache[layer, start:end] = k.reshape(n, cfg.n_head_kv, cfg.head_dim)
        self.v_cache[layer, start:end] = v.reshape(n, cfg.n_head_kv, cfg.head_dim)
        keys = self.k_cache[layer, :end].astype(np.float32)  # (T, n_kv, hd)
        vals = self.v_cache[layer, :end].astype(np.float32)
        group = cfg.n_head // cfg.n_head_kv
        qh = self._round_kv(q.reshape(n, cfg.n_head_kv, group, cfg.head_dim))
        scores = np.einsum("nkgd,tkd->kgnt", qh, keys) * np.float32(1.0 / np.sqrt(cfg.head_dim))
        causal = np.arange(end)[None, :] > (start + np.arange(n))[:, None]  # (n, T)
        scores[..., causal] = -np.inf
        probs = _softmax(scores)
        out = np.einsum("kgnt,tkd->nkgd", self._round_kv(probs), vals)
        return out.reshape(n, cfg.q_dim).astype(np.float32)

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return (gate / (np.float32(1.0) + np.exp(-gate))) * up

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    # state -----------------------------------------------------------------------------
    def set_model(self, cfg: ModelConfig, n_ctx: int, rope_freqs: np.ndarray | None) -> None:
        self.cfg, self.n_ctx, self.rope_freqs = cfg, n_ctx, rope_freqs
        shape = (cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim)
        self.k_cache = np.zeros(shape, dtype=self.kv_dtype)  # (layer, pos, kv_head, head_dim)
        self.v_cache = np.zeros(shape, dtype=self.kv_dtype)

    def truncate(self, n_pos: int) -> None:
        pass  # attention only ever reads positions < the current end, which the caller tracks

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    def _model(self) -> ModelConfig:
        if self.cfg is None:
            raise RuntimeError("set_model() must be called before running ops")
        return self.cfg

    def _round_kv(self, x: np.ndarray) -> np.ndarray:
        return x.astype(self.kv_dtype).astype(np.float32) if self.kv_dtype == np.float16 else x


def _softmax(scores: np.ndarray) -> np.ndarray:
    m = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - m)
    return (e / e.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)
