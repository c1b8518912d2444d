"""The CUDA backend: every op of `base.Backend` on the GPU, weights resident in VRAM as their
raw GGUF blocks. Same numerics as the numpy backend in the same mode (activations quantized to
the weight's vec_dot_type in `ggml` mode, F16 KV cache); see docs/cuda.md.

Token ids and positions are read by the kernels from two device buffers, so a decode step
captured in a CUDA graph (`cuda_graph.DecodeGraph`) replays for any token and position.
"""

from __future__ import annotations

import os

import numpy as np

from ntx_common.errors import UnsupportedQuantError, UsageError
from ntx_engine import quants
from ntx_engine.backends.cuda_driver import DeviceArray, MemoryPool, Stream, Device, download, upload
from ntx_engine.backends.cuda_kernels import (ATTN_CHUNK, BLOCK_ELEMENTS, KERNEL_TYPES, MATVEC_MAX_TOKENS, Kernels,
                                             fast_matvec_ok)
from ntx_engine.config import ROPE_NEOX, ModelConfig
from ntx_engine.quants import GGMLType


class CudaWeight:
    """A (rows, k) weight on the device as its GGUF blocks."""

    def __init__(self, data: DeviceArray, ggml_type: GGMLType, shape: tuple[int, int], name: str) -> None:
        self.data, self.ggml_type, self.shape, self.name = data, ggml_type, shape, name
        self.vec_dot_type = quants.quant_type(ggml_type, name).vec_dot_type
        self.has_min = quants.quant_type(ggml_type, name).has_block_min

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class CudaBackend:
    name = "cuda"

    def __init__(self, matmul_mode: str = "ggml", kv_dtype: str = "f16", device: int = 0,
                 cache_dir=None, matvec: str | None = None, attn: str | None = None,
                 pdl: bool | None = None, fuse: bool | None = None) -> None:
        if matmul_mode not in ("ggml", "exact"):
            raise ValueError(f"matmul_mode must be 'ggml' or 'exact', got {matmul_mode!r}")
        if kv_dtype != "f16":
            raise UsageError(f"the CUDA backend keeps its KV cache in f16 only, not {kv_dtype!r}")
        self.matmul_mode = matmul_mode
        # "split": decode attention in ATTN_CHUNK-position blocks (flash-decoding); "single": one block a head
        self.attn = attn or os.environ.get("NTX_CUDA_ATTN", "split")
        if self.attn not in ("split", "single"):
            raise UsageError(f"attention variant must be 'split' or 'single', got {self.attn!r} (NTX_CUDA_ATTN)")
        self.device = Device(device)
        self.stream = Stream()
        self.pool = MemoryPool()
        self.k = Kernels(self.device, cache_dir, matvec or os.environ.get("NTX_CUDA_MATVEC", "fast"), pdl)
        self.cfg: ModelConfig | None = None
        # fuse: rmsnorm also quantizes its output for the next matmul (NTX_CUDA_FUSE=1), in the
        # format the fast matmuls fed by an rmsnorm asked for last (_norm_key; learned in matmul)
        self.fuse = fuse if fuse is not None else os.environ.get("NTX_CUDA_FUSE", "0") == "1"
        self._norm_key: tuple | None = None
        self._last_norm: DeviceArray | None = None
        self.capturing = False
        self._staged: tuple | None = None  # (positions tuple) last uploaded to pos_buf
        self._act_cache: tuple | None = None  # (x, (vec_dot_type, has_min), (x_hat, s))

    # --- weights -------------------------------------------------------------------------
    def matrix(self, raw, ggml_type, shape, name) -> CudaWeight:
        t = quants.ggml_type_of(int(ggml_type), name)
        if t not in KERNEL_TYPES:
            supported = ", ".join(x.name for x in KERNEL_TYPES)
            raise UnsupportedQuantError(f"tensor {name!r} is {t.name}, which the CUDA backend cannot "
                                        f"multiply (supported: {supported}); re-quantize the model")
        rows, k = shape
        if k % BLOCK_ELEMENTS[t]:
            raise UnsupportedQuantError(f"tensor {name!r}: rows of {k} elements are not whole "
                                        f"{BLOCK_ELEMENTS[t]}-element units for the CUDA kernels")
        host = np.frombuffer(raw, np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1).view(np.uint8)
        expected = quants.tensor_nbytes(t, rows * k)
        if host.size != expected:
            raise UnsupportedQuantError(f"tensor {name!r}: {host.size} bytes for {t.name} {shape}, expected {expected}")
        return CudaWeight(upload(self.pool, host, self.stream), t, (rows, k), name)

    def vector(self, raw, ggml_type, n, name) -> DeviceArray:
        return upload(self.pool, quants.dequantize(raw, ggml_type, (n,), name).astype(np.float32), self.stream)

    # --- ops -----------------------------------------------------------------------------
    def _new(self, *shape, dtype=np.float32) -> DeviceArray:
        return DeviceArray(self.pool, shape, dtype)

    def _stage_positions(self, positions: np.ndarray) -> None:
        """Upload positions to pos_buf unless capturing (then the caller has staged them)."""
        key = tuple(int(p) for p in positions)
        if self.capturing or key == self._staged:
            return
        upload(self.pool, np.asarray(key, np.int32), self.stream, out=self.pos_buf)
        self._staged = key

    def embed(self, table: CudaWeight, ids: np.ndarray) -> DeviceArray:
        ids = np.asarray(ids).reshape(-1)
        if not self.capturing:
            upload(self.pool, ids.astype(np.int32), self.stream, out=self.ids_buf)
        out = self._new(len(ids), table.shape[1])
        self.k.embed(table.ggml_type, table.data, self.ids_buf, out, len(ids), table.shape[1], self.stream)
        return out

    def matmul(self, w: CudaWeight, x: DeviceArray) -> DeviceArray:
        n, k = x.shape
        rows = w.shape[0]
        if k != w.shape[1]:
            raise ValueError(f"{w.name}: cannot multiply {x.shape} by weight {w.shape}")
        y = self._new(n, rows)
        if self.uses_fast(w):
            if x is self._last_norm:
                self._norm_key = (w.vec_dot_type, w.has_min, True)
            xq, (xd, xs) = self._activations(w, x, int8=True)
            for t0 in range(0, n, MATVEC_MAX_TOKENS):
                m = min(MATVEC_MAX_TOKENS, n - t0)
                self.k.matvec_fast(w.ggml_type, w.data, xq[t0:t0 + m], xd[t0:t0 + m], xs[t0:t0 + m],
                                   y[t0:t0 + m], rows, k, m, self.stream)
            return y
        xq, s = self._activations(w, x)
        for t0 in range(0, n, MATVEC_MAX_TOKENS):
            m = min(MATVEC_MAX_TOKENS, n - t0)
            self.k.matvec(w.ggml_type, w.data, xq[t0:t0 + m], None if s is None else s[t0:t0 + m],
                          y[t0:t0 + m], rows, k, m, self.stream)
        return y

    def uses_fast(self, w: CudaWeight) -> bool:
        """Whether w goes through matvec_fast.cu's dp4a kernels (ggml mode, aligned rows)."""
        return self.k.fast and self.matmul_mode == "ggml" and fast_matvec_ok(w.ggml_type, w.data.ptr, w.shape[1])

    def _activations(self, w: CudaWeight, x: DeviceArray, int8: bool = False) -> tuple:
        """x quantized for w's vec_dot_type; reused while the same x feeds several weights
        (q/k/v, gate/up): ops never write their inputs, so x's values cannot have changed.
        int8: (xq int8, (xd, xs)) for the dp4a kernels, else (x_hat, s)."""
        key = (w.vec_dot_type, w.has_min, int8)
        if self._act_cache is not None and self._act_cache[0] is x and self._act_cache[1] == key:
            return self._act_cache[2]
        result = self._quantize_int8(w, x) if int8 else self._quantize(w, x)
        self._act_cache = (x, key, result)
        return result

    def _quantize_int8(self, w: CudaWeight, x: DeviceArray) -> tuple:
        n, k = x.shape
        xq, xd, xs = self._new(n, k, dtype=np.int8), self._new(n, k // 32), self._new(n, k // 32)
        self.k.quantize_int8(w.vec_dot_type, x, xq, xd, xs, self.stream)
        return xq, (xd, xs)

    def _quantize(self, w: CudaWeight, x: DeviceArray) -> tuple[DeviceArray, DeviceArray | None]:
        n, k = x.shape
        s = self._new(n, k // 32) if w.has_min else None
        if self.matmul_mode == "exact" or w.vec_dot_type == GGMLType.F32:
            if s is not None:
                self.k._go("matvec.cu", "block_sum32", (-(-n * k // 32 // 128),), (128,), (x, s, n * k // 32), self.stream)
            return x, s
        xq = self._new(n, k)
        self.k.quantize(w.vec_dot_type, x, xq, s, self.stream)
        return xq, s

    def rmsnorm(self, x: DeviceArray, w: DeviceArray, eps: float) -> DeviceArray:
        out = self._new(*x.shape)
        key, (n, k) = self._norm_key, x.shape
        q8k = key is not None and key[0] == GGMLType.Q8_K
        if not self.fuse or key is None or key[0] not in (GGMLType.Q8_0, GGMLType.Q8_1, GGMLType.Q8_K) \
                or k % (256 if q8k else 32):
            self.k.rmsnorm(x, w, out, eps, self.stream)
        else:  # the act cache then hands the next matmul(s) on `out` these int8 values
            xq, xd, xs = self._new(n, k, dtype=np.int8), self._new(n, k // 32), self._new(n, k // 32)
            self.k.rmsnorm_quanti(x, w, out, xq, xd, xs, eps, q8k, self.stream)
            self._act_cache = (out, key, (xq, (xd, xs)))
        self._last_norm = out
        return out

    def rope(self, x: DeviceArray, positions: np.ndarray, n_heads: int) -> DeviceArray:
        c = self._model()
        self._stage_positions(positions)
        out = self._new(*x.shape)
        self.k.rope(x, out, self.pos_buf, self.rope_ff, n_heads, c.head_dim, c.rope_dim, self.rope_scale,
                    c.rope_freq_scale, c.rope_type == ROPE_NEOX, self.stream)
        return out

    def attention(self, q: DeviceArray, k: DeviceArray, v: DeviceArray, layer: int, start: int) -> DeviceArray:
        c = self._model()
        n = q.shape[0]
        if start + n > self.n_ctx:
            raise ValueError(f"context full: position {start + n} exceeds n_ctx {self.n_ctx}")
        self._stage_positions(np.arange(start, start + n))
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        self.k.kv_store(k, v, kc, vc, self.pos_buf, c.kv_dim, self.stream)
        out = self._new(n, c.q_dim)
        if self.attn == "split" and n == 1 and c.head_dim <= 256:
            nchunk = -(-self.n_ctx // ATTN_CHUNK)
            scratch = (self._new(n, c.n_head, self.n_ctx), self._new(n, c.n_head, nchunk),
                       self._new(n, c.n_head, nchunk, c.head_dim))
            self.k.attention_split(q, kc, vc, out, self.pos_buf, c.n_head, c.n_head_kv, c.head_dim, self.n_ctx,
                                   float(np.float32(1.0 / np.sqrt(c.head_dim))), scratch, self.stream)
            return out
        self.k.attention(q, kc, vc, out, self.pos_buf, c.n_head, c.n_head_kv, c.head_dim, self.n_ctx,
                         float(np.float32(1.0 / np.sqrt(c.head_dim))), self.stream)
        return out

    def swiglu(self, gate: DeviceArray, up: DeviceArray) -> DeviceArray:
        out = self._new(*gate.shape)
        self.k.swiglu(gate, up, out, self.stream)
        return out

    def add(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        out = self._new(*a.shape)
        self.k.add(a, b, out, self.stream)
        return out

    def argmax(self, x: DeviceArray) -> DeviceArray:
        """Index of the largest of x (flattened) as a device int32: greedy sampling on the GPU."""
        out = self._new(1, dtype=np.int32)
        self.k.argmax(x, out, self.stream)
        return out

    # --- state ---------------------------------------------------------------------------
    def set_model(self, cfg: ModelConfig, n_ctx: int, rope_freqs: np.ndarray | None) -> None:
        self.cfg, self.n_ctx = cfg, n_ctx
        # (n_ctx, n_head_kv*head_dim) f16 per layer: the layout the numpy backend uses
        self.k_cache = [self._new(n_ctx, cfg.kv_dim, dtype=np.float16) for _ in range(cfg.n_layers)]
        self.v_cache = [self._new(n_ctx, cfg.kv_dim, dtype=np.float16) for _ in range(cfg.n_layers)]
        self.pos_buf = self._new(n_ctx, dtype=np.int32)
        self.ids_buf = self._new(n_ctx, dtype=np.int32)
        self._staged = None
        self.rope_scale = float(np.float32(np.float32(cfg.rope_base) ** np.float32(-2.0 / cfg.rope_dim)))
        self.rope_ff = None
        if rope_freqs is not None:
            self.rope_ff = upload(self.pool, np.asarray(rope_freqs, np.float32)[: cfg.rope_dim // 2], self.stream)

    def truncate(self, n_pos: int) -> None:
        pass  # attention reads positions <= the query's own; later ones are overwritten first

    def to_numpy(self, x: DeviceArray) -> np.ndarray:
        if self.capturing:  # inside graph capture nothing may wait: the graph owner reads it later
            self.captured_output = x
            return np.empty(x.shape, x.dtype)
        return download(x, self.stream)

    def from_numpy(self, x: np.ndarray) -> DeviceArray:
        return upload(self.pool, np.ascontiguousarray(x, np.float32), self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def _model(self) -> ModelConfig:
        if self.cfg is None:
            raise RuntimeError("set_model() must be called before running ops")
        return self.cfg
