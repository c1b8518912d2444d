"""The native CPU backend: the numpy backend's op interface on C kernels (`native/cpu`).

Weights stay as their raw GGUF blocks (a zero-copy view of the mapped file, no float32 copy):
decode reads 4.5 bits per weight of Q4_1 instead of 32, which is the point on a CPU whose
matvec is bound by DRAM bandwidth. Activations are quantized exactly as ggml's CPU backend
does before its integer dot products, so results agree with the numpy backend's `ggml` mode
to float32 summation order (tests/cpu measure how far). Only `ggml` mode exists here; the
float32-activation `exact` mode is an oracle mode and stays with `NumpyBackend`.
"""

from __future__ import annotations

import os

import numpy as np

from ntx_engine import quants, rope
from ntx_engine.backends.cpu_kernels import CpuKernels
from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.quants import GGMLType


class NativeWeight:
    """A weight matrix (rows, k) held as its raw GGUF blocks, multiplied by the C kernels."""

    def __init__(self, kernels: CpuKernels, raw: np.ndarray, ggml_type: GGMLType,
                 shape: tuple[int, int], name: str) -> None:
        self.kernels, self.ggml_type, self.shape, self.name = kernels, ggml_type, shape, name
        self.raw = raw  # (rows * row_bytes,) uint8: the file's bytes, not a copy
        self.vec_dot_type = quants.quant_type(ggml_type, name).vec_dot_type
        self.handle = kernels.weight(ggml_type, raw, *shape, name)

    def matmul(self, x: np.ndarray, mode: str = "ggml") -> np.ndarray:
        """x (n, k) -> x @ W.T (n, rows); `mode` must be "ggml" (the numpy backend's signature)."""
        if mode != "ggml":
            raise ValueError(f"{self.name}: the native CPU kernels only compute ggml mode, not {mode!r}")
        return self.kernels.matmul_w(self.handle, x)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows (len(ids), k) float32: the embedding lookup, only the rows asked for."""
        rows, k = self.shape
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            raise ValueError(f"{self.name}: row id outside 0..{rows - 1}")
        picked = self.raw.reshape(rows, -1)[ids]
        return quants.dequantize(picked, self.ggml_type, (len(ids), k), self.name)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes


def is_dense(model) -> bool:
    """True when `model` runs the plain llama-family block (not a MoE FFN or another override)."""
    from ntx_engine.model import Transformer

    if not isinstance(model, Transformer):
        return False
    own = vars(model)
    return all(getattr(type(model), m) is getattr(Transformer, m) and m not in own
               for m in ("block", "attention", "ffn"))


class WholeLayers:
    """`--device cpu`: installed as `model.run_layer`, so every layer the native backend
    computes is one C call (NativeCpuBackend.run_block); anything else runs op by op."""

    def __init__(self, model) -> None:
        self.model = model
        model.run_layer = self

    def __call__(self, i: int, lw, x, pos: np.ndarray, start: int):
        b = self.model.backend
        if isinstance(b, NativeCpuBackend):
            return b.run_block(self.model, i, lw, x, pos, start)
        return self.model.block(i, lw, x, pos, start)


class NativeCpuBackend(NumpyBackend):
    """`--device cpu`: the numpy backend with every op of a layer replaced by a C kernel."""

    name = "cpu"

    def __init__(self, matmul_mode: str = "ggml", kv_dtype: str = "f16", threads: int | None = None,
                 kernels: CpuKernels | None = None) -> None:
        if matmul_mode != "ggml":
            raise ValueError("the native CPU backend computes ggml mode only; use NumpyBackend "
                             f"(device 'numpy') for matmul_mode={matmul_mode!r}")
        super().__init__(matmul_mode, kv_dtype)
        self.kernels = kernels if kernels is not None else CpuKernels(threads)
        self._rope_key: bytes | None = None
        self._layer_specs: dict[int, tuple] = {}
        # NTX_CPU_WHOLE_LAYER=0: op by op (benchmarks compare the two in one run)
        self.whole_layers = os.environ.get("NTX_CPU_WHOLE_LAYER", "1") != "0"

    # weights ---------------------------------------------------------------------------
    def matrix(self, raw, ggml_type, shape, name):
        qt = quants.quant_type(ggml_type, name)
        if not qt.is_weight_format:
            return super().matrix(raw, ggml_type, shape, name)  # raises the numpy backend's error
        blocks = quants.as_blocks(raw, qt, tuple(shape), name)  # checks the byte count
        return NativeWeight(self.kernels, blocks.reshape(-1), qt.ggml_type, tuple(shape), name)

    # ops -------------------------------------------------------------------------------
    # The fused products go through self.matmul when an instance overrides it (noise.py jitters
    # every matmul input that way), so they stay the compositions they stand for.
    def matmul_many(self, ws, x):
        if "matmul" not in vars(self) and all(isinstance(w, NativeWeight) for w in ws) \
                and len({w.shape[1] for w in ws}) == 1:
            return self.kernels.matmul_many([w.handle for w in ws], x)
        return [self.matmul(w, x) for w in ws]

    def matmul_swiglu(self, w_gate, w_up, x):
        if "matmul" not in vars(self) and isinstance(w_gate, NativeWeight) and isinstance(w_up, NativeWeight) \
                and w_gate.shape == w_up.shape:
            return self.kernels.matmul_swiglu(w_gate.handle, w_up.handle, x)
        return self.swiglu(self.matmul(w_gate, x), self.matmul(w_up, x))

    def rope_attention(self, q, k, v, positions, layer, start):
        cfg = self._model()
        if start + len(q) > self.n_ctx:
            raise ValueError(f"context full: position {start + len(q)} exceeds n_ctx {self.n_ctx}")
        cos, sin = self._cos_sin(np.asarray(positions))
        return self.kernels.attention(q, k, v, self.k_cache[layer], self.v_cache[layer], start, cfg.n_head,
                                      cfg.n_head_kv, cfg.head_dim,
                                      rope=(cos, sin, cfg.rope_dim, cfg.rope_type != "norm"))

    def embed(self, table: NativeWeight, ids: np.ndarray) -> np.ndarray:
        return table.rows(ids)

    def rmsnorm(self, x, w, eps):
        return self.kernels.rmsnorm(x, w, eps)

    def rope(self, x, positions, n_heads):
        cfg = self._model()
        cos, sin = self._cos_sin(np.asarray(positions))
        return self.kernels.rope(x, cos, sin, n_heads, cfg.head_dim, cfg.rope_dim, cfg.rope_type != "norm")

    def attention(self, q, k, v, layer, start):
        cfg = self._model()
        if start + len(q) > self.n_ctx:
            raise ValueError(f"context full: position {start + len(q)} exceeds n_ctx {self.n_ctx}")
        return self.kernels.attention(q, k, v, self.k_cache[layer], self.v_cache[layer], start,
                                      cfg.n_head, cfg.n_head_kv, cfg.head_dim)

    def swiglu(self, gate, up):
        return self.kernels.swiglu(gate, up)

    def add(self, a, b):
        return a + b  # numpy's float32 add is the same operation, without a C call's overhead

    # a whole layer in one C call (cpu_layer.c) -------------------------------------------
    def run_block(self, model, i: int, lw, x: np.ndarray, pos: np.ndarray, start: int) -> np.ndarray:
        """Layer i of `model`: one native call when `model` is a dense llama-family Transformer
        computing on this very backend (the GIL is taken once per layer, not ~10 times), else
        its op-by-op `block`. Both run the same kernels in the same order: equal bit for bit."""
        dense = self.whole_layers and model.backend is self and is_dense(model)
        spec = self._layer_spec(i, lw) if dense else None
        if spec is None:
            return model.block(i, lw, x, pos, start)
        cos, sin = self._cos_sin(np.asarray(pos))
        return self.kernels.layer_forward(spec, x, start, cos, sin)

    def _layer_spec(self, i: int, lw):
        """The checked C view of layer i's weights and KV cache, or None when a piece is not
        what the C layer takes (a jittered matmul, a numpy weight). Cached while the pieces
        are the same objects (a streamed layer's slot brings new ones)."""
        mats = (lw.wq, lw.wk, lw.wv, lw.wo, lw.w_gate, lw.w_up, lw.w_down)
        if "matmul" in vars(self) or not all(isinstance(w, NativeWeight) for w in mats):
            return None
        parts = mats + (lw.attn_norm, lw.ffn_norm, lw.bq, lw.bk, lw.bv)
        hit = self._layer_specs.get(i)
        if hit is not None and len(hit[0]) == len(parts) and all(a is b for a, b in zip(hit[0], parts)):
            return hit[1]
        cfg = self._model()
        geometry = dict(n_embd=cfg.n_embd, n_head=cfg.n_head, n_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                        n_ff=cfg.n_ff, rope_dim=cfg.rope_dim, neox=cfg.rope_type != "norm", eps=cfg.rms_eps)
        biases = None if lw.bq is None else (lw.bq, lw.bk, lw.bv)
        spec = self.kernels.layer_spec(geometry, [w.handle for w in mats], (lw.attn_norm, lw.ffn_norm), biases,
                                       self.k_cache[i], self.v_cache[i], name=f"layer {i}")
        self._layer_specs[i] = (parts, spec)
        return spec

    def set_model(self, cfg, n_ctx, rope_freqs) -> None:
        super().set_model(cfg, n_ctx, rope_freqs)
        self._layer_specs: dict[int, tuple] = {}  # the specs point into the old caches
        self._rope_key = None

    def _cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """RoPE tables for `positions`; every layer of one forward asks for the same ones."""
        key = positions.astype(np.int64).tobytes()
        if key != self._rope_key:
            self._rope_tables = rope.cos_sin(self._model(), positions, self.rope_freqs)
            self._rope_key = key
        return self._rope_tables

    def close(self) -> None:
        self.kernels.close()
