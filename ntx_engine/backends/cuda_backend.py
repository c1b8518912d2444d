"""The CUDA backend: every op of `base.Backend` on the GPU, weights resident in VRAM as their
raw GGUF blocks. Same numerics as the numpy backend in the same mode (activations quantized to
the weight's vec_dot_type in `ggml` mode, F16 KV cache); see docs/cuda.md.

Token ids and positions are read by the kernels from two device buffers, so a decode step
captured in a CUDA graph (`cuda_graph.DecodeGraph`) replays for any token and position.

Fusions (`fuse`, NTX_CUDA_FUSE = all | none | a comma list of FUSIONS; default none until the
fused kernels have passed tests/cuda/test_fused_gpu.py on the GPU): "qkv" runs the q/k/v
matmuls as one launch (matmul_many), "ffn" gate/up + SwiGLU as one (matmul_swiglu), "rope" the
two RoPEs and the KV-cache store as one (rope_attention), "norm" a residual add + RMSNorm + the
next matmul's activation quantization as one: `add` of two same-shape arrays is held back
(`_pending`) until the next op, and when that op is the rmsnorm of its result both run in one
kernel; every other op launches the held add first (`flush`); "attn" the decode attention's last
block also quantizes its output for the matmul that reads it (the o projection). Each fused kernel
computes bit for bit what the unfused kernels compute. "stack" (not in "all") runs a one-token
step's layers in one persistent launch where every layer matrix is Q8_0, Q4_K, Q5_K or Q6_K (`decode_stack`,
backends/cuda_layers.py): held to the numpy backend within tolerances, not bit for bit; "stack8" the
same where every layer matrix is Q8_0 only. The default is "all,stack": at 8B the stack step is
faster than the layer-by-layer kernels for Q8_0 (~10 %) and for Q4_K_M (1–3 %, docs/cuda.md, session 23).
"""

from __future__ import annotations

import os

import numpy as np

from ntx_common.errors import CudaError, UnsupportedQuantError, UsageError
from ntx_engine import quants
from ntx_engine.backends.cuda_driver import DeviceArray, MemoryPool, Stream, Device, download, upload
from ntx_engine.backends.cuda_kernels import (ATTN_CHUNK, BLOCK_ELEMENTS, FAST_CODES, KERNEL_TYPES, MATVEC_MAX_TOKENS,
                                             MMQ_TYPES, CLUSTER_MAX_T, Kernels, fast_matvec_ok, gqa_split_ok,
                                             grid_attn_shape, grid_cluster_size, reg_shape)
from ntx_engine.config import ROPE_NEOX, ModelConfig
from ntx_engine.quants import GGMLType

FUSIONS = ("qkv", "ffn", "rope", "norm", "attn", "stack", "stack8")
STACK_FUSIONS = frozenset({"stack", "stack8"})  # the one-launch stack step (decode_stack), either form
OPT_IN_FUSIONS = STACK_FUSIONS  # named explicitly; "all" is the others (bit for bit)
ATTN_VARIANTS = ("grid", "split", "single")
# prefill GEMM (dequant.cu + cuBLAS): a matmul of at least GEMM_MIN_TOKENS rows decodes the weight
# to fp16 in slabs of at most GEMM_SLAB_BYTES and runs one tensor-core GEMM per slab
GEMM_MIN_TOKENS = 32
GEMM_SLAB_BYTES = 128 << 20
GEMM_TYPES = frozenset(KERNEL_TYPES) - {GGMLType.F32, GGMLType.BF16}  # fp16 holds these exactly or as ggml rounds
# tests/cuda/test_fused_gpu.py passed on the H200 ("all": fused == unfused, bit for bit), and the whole GPU suite
# with the stack step ("stack": Q8_0, Q4_K and Q6_K layer matrices)
DEFAULT_FUSE = "all,stack"


def gemm_workspace_bytes(cfg: ModelConfig) -> int:
    """Device memory the prefill GEMM takes: the fp16 weight slab plus cuBLAS's workspace."""
    from ntx_engine.backends.cublas import WORKSPACE_BYTES

    largest = max(cfg.n_ff * cfg.n_embd, cfg.q_dim * cfg.n_embd, cfg.n_embd * cfg.n_embd)
    return min(GEMM_SLAB_BYTES, 2 * largest) + WORKSPACE_BYTES


def parse_fusions(fuse) -> frozenset:
    """fuse: None (NTX_CUDA_FUSE, default DEFAULT_FUSE), True/False, "all"/"none", or names of FUSIONS
    ("all" in a list stands for every fusion but the opt-in ones, OPT_IN_FUSIONS)."""
    if fuse is None:
        fuse = os.environ.get("NTX_CUDA_FUSE", DEFAULT_FUSE)
    if fuse is True or fuse in ("all", "1"):
        return frozenset(FUSIONS) - OPT_IN_FUSIONS
    if fuse is False or fuse in ("none", "0", ""):
        return frozenset()
    names = frozenset(n.strip() for n in fuse.split(",")) if isinstance(fuse, str) else frozenset(fuse)
    if "all" in names:  # e.g. "all,stack": the default set and opt-in ones
        names = (names - {"all"}) | (frozenset(FUSIONS) - OPT_IN_FUSIONS)
    if not names <= set(FUSIONS):
        raise UsageError(f"unknown CUDA fusion(s) {sorted(names - set(FUSIONS))} (NTX_CUDA_FUSE); "
                         f"use all, none or a comma list of {', '.join(FUSIONS)}")
    return names


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
    prefill_chunk = 512  # tokens per prefill pass (engine.py): the GEMMs run near peak from here on

    def __init__(self, matmul_mode: str = "ggml", kv_dtype: str = "f16", device: int = 0,
                 cache_dir=None, matvec: str | None = None, attn: str | None = None,
                 pdl: bool | None = None, fuse=None, mmq: bool | None = None, gemm: str | None = None) -> None:
        if matmul_mode not in ("ggml", "exact"):
            raise ValueError(f"matmul_mode must be 'ggml' or 'exact', got {matmul_mode!r}")
        if kv_dtype != "f16":
            raise UsageError(f"the CUDA backend keeps its KV cache in f16 only, not {kv_dtype!r}")
        self.matmul_mode = matmul_mode
        # decode attention: "grid" one launch whose blocks meet at barriers inside it (attn_grid.cu;
        # "split" where the context is too long for it), "split" two launches over ATTN_CHUNK-position
        # blocks (flash-decoding), "single" one block a head
        self.attn = attn or os.environ.get("NTX_CUDA_ATTN", "grid")
        if self.attn not in ATTN_VARIANTS:
            raise UsageError(f"attention variant must be one of {', '.join(ATTN_VARIANTS)}, got {self.attn!r} "
                             "(NTX_CUDA_ATTN)")
        self.device = Device(device)
        self.stream = Stream()
        self.pool = MemoryPool()
        self.k = Kernels(self.device, cache_dir, matvec or os.environ.get("NTX_CUDA_MATVEC", "fast"), pdl)
        self.cfg: ModelConfig | None = None
        self.fuse = parse_fusions(fuse)
        # mmq: matmuls of more than MATVEC_MAX_TOKENS rows on the int8 tensor cores (mmq.cu; opt-in,
        # NTX_CUDA_MMQ=1, until tests/cuda/test_mmq_gpu.py has passed on a GPU)
        self.mmq = mmq if mmq is not None else os.environ.get("NTX_CUDA_MMQ", "0") == "1"
        # gemm: prefill-sized matmuls as fp16 tensor-core GEMMs through cuBLAS (see GEMM_*);
        # NTX_CUDA_GEMM=auto (default: on when cuBLAS loads), 1 (required), 0 (off)
        self.gemm = gemm if gemm is not None else os.environ.get("NTX_CUDA_GEMM", "auto")
        if self.gemm not in ("auto", "1", "0"):
            raise UsageError(f"NTX_CUDA_GEMM must be auto, 1 or 0, not {self.gemm!r}")
        self._cublas = None
        self._gemm_ws: DeviceArray | None = None  # the fp16 weight slab (_slab)
        self._f16_cache: tuple | None = None  # (x, (xh, scales)) while x feeds several GEMMs
        # "norm": the fused rmsnorm also quantizes its output in the format the fast matmuls fed
        # by the same norm weight asked for before (_norm_keys: norm weight ptr -> act-cache key)
        self._norm_keys: dict[int, tuple] = {}
        self._last_norm: tuple | None = None  # (rmsnorm output, its norm weight's ptr)
        self._pending: tuple | None = None  # (a, b, out): the add held back for the next op
        self.capturing = False
        self._staged: tuple | None = None  # (positions tuple) last uploaded to pos_buf
        self._act_cache: tuple | None = None  # (x, (vec_dot_type, has_min), (x_hat, s))
        self._last_attn: DeviceArray | None = None  # the last decode attention's output ("attn")
        self._attn_key: tuple | None = None  # the act-cache key its matmul asked for
        self._stack: tuple | None = None  # "stack": (layers, StackDecode or None, why not)

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
        self.flush()
        ids = np.asarray(ids).reshape(-1)
        if not self.capturing:
            upload(self.pool, ids.astype(np.int32), self.stream, out=self.ids_buf)
        out = self._new(len(ids), table.shape[1])
        self.k.embed(table.ggml_type, table.data, self.ids_buf, out, len(ids), table.shape[1], self.stream)
        return out

    def matmul(self, w: CudaWeight, x: DeviceArray) -> DeviceArray:
        self.flush()
        n, k = x.shape
        rows = w.shape[0]
        if k != w.shape[1]:
            raise ValueError(f"{w.name}: cannot multiply {x.shape} by weight {w.shape}")
        y = self._new(n, rows)
        if self._uses_gemm(w, n):
            self._gemm(w, x, y)
            return y
        if self._uses_mmq(w, n):
            xq, (xd, xs) = self._int8_activations(w, x)
            self.k.mmq(w.ggml_type, w.data, xq, xd, xs, y, rows, k, n, self.stream)
            return y
        if self.uses_fast(w):
            xq, (xd, xs) = self._int8_activations(w, x)
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

    def matmul_many(self, ws, x: DeviceArray) -> list:
        """[matmul(w, x) for w in ws]; with "qkv", up to three fast weights of one activation
        format run as one launch (one grid over all their rows)."""
        self.flush()
        n, k = x.shape
        if "qkv" not in self.fuse or not self._fusable(ws, k) or len(ws) > 3 \
                or any(self._uses_mmq(w, n) or self._uses_gemm(w, n) for w in ws):
            return [self.matmul(w, x) for w in ws]
        xq, (xd, xs) = self._int8_activations(ws[0], x)
        ys = [self._new(n, w.shape[0]) for w in ws]
        specs = [(w.data, w.ggml_type, w.shape[0]) for w in ws]
        for t0 in range(0, n, MATVEC_MAX_TOKENS):
            m = min(MATVEC_MAX_TOKENS, n - t0)
            self.k.matvec_multi(specs, xq[t0:t0 + m], xd[t0:t0 + m], xs[t0:t0 + m], [y[t0:t0 + m] for y in ys],
                                k, m, self.stream)
        return ys

    def matmul_swiglu(self, w_gate: CudaWeight, w_up: CudaWeight, x: DeviceArray) -> DeviceArray:
        """swiglu(matmul(w_gate, x), matmul(w_up, x)); with "ffn" one kernel when both are fast."""
        self.flush()
        n, k = x.shape
        if "ffn" not in self.fuse or not self._swiglu_fusable(w_gate, w_up, k, n) or w_gate.shape != w_up.shape \
                or self._uses_mmq(w_gate, n) or self._uses_gemm(w_gate, n) or self._uses_gemm(w_up, n):
            return self.swiglu(self.matmul(w_gate, x), self.matmul(w_up, x))
        xq, (xd, xs) = self._int8_activations(w_gate, x)
        rows = w_gate.shape[0]
        y = self._new(n, rows)
        for t0 in range(0, n, MATVEC_MAX_TOKENS):
            m = min(MATVEC_MAX_TOKENS, n - t0)
            self.k.matvec_swiglu(w_gate.data, w_gate.ggml_type, w_up.data, w_up.ggml_type, xq[t0:t0 + m],
                                 xd[t0:t0 + m], xs[t0:t0 + m], y[t0:t0 + m], rows, k, m, self.stream)
        return y

    def _swiglu_fusable(self, w_gate: CudaWeight, w_up: CudaWeight, k: int, n: int) -> bool:
        """_fusable, or gate and up weights of one type whose product matvec_reg.cu's matvecr_swiglu_<type> takes
        (reg_shape: so Q5_K, which fused.cu lacks, for one token)."""
        same = w_gate.ggml_type == w_up.ggml_type and all(self.uses_fast(w) and w.shape[1] == k for w in (w_gate, w_up))
        return (same and reg_shape(w_gate.ggml_type, k, n, self.k.reg) is not None) or self._fusable((w_gate, w_up), k)

    def _fusable(self, ws, k: int) -> bool:
        """All of ws take the dp4a kernels and the fused ones (FAST_CODES), multiply rows of k, and share one activation
        format."""
        return all(self.uses_fast(w) and w.ggml_type in FAST_CODES and w.shape[1] == k and (w.vec_dot_type, w.has_min)
                   == (ws[0].vec_dot_type, ws[0].has_min) for w in ws)

    def _int8_activations(self, w: CudaWeight, x: DeviceArray) -> tuple:
        """x as int8 for w, learning which format the rmsnorm that produced x should emit."""
        if self._last_norm is not None and x is self._last_norm[0]:
            self._norm_keys[self._last_norm[1]] = (w.vec_dot_type, w.has_min, True)
        if self._last_attn is not None and x is self._last_attn:
            self._attn_key = (w.vec_dot_type, w.has_min, True)
        return self._activations(w, x, int8=True)

    def _uses_gemm(self, w: CudaWeight, n: int) -> bool:
        """Prefill-sized x through cuBLAS, unless mmq was asked for or cuBLAS is off/missing."""
        if n < GEMM_MIN_TOKENS or self.gemm == "0" or w.ggml_type not in GEMM_TYPES or self._uses_mmq(w, n):
            return False
        return self._cublas_handle() is not None

    def _cublas_handle(self):
        """The cuBLAS handle, created on first use; None when it is missing and gemm is auto."""
        if self._cublas is None:
            from ntx_engine.backends.cublas import WORKSPACE_BYTES, Cublas

            try:
                ws = self._new(WORKSPACE_BYTES, dtype=np.uint8)
                self._cublas = Cublas(int(self.stream.handle), ws.ptr, ws.nbytes)
                self._cublas_ws = ws
            except CudaError as exc:
                if self.gemm == "1":
                    raise
                from ntx_common.console import warn

                warn(f"prefill runs without tensor-core GEMMs: {exc}")
                self._cublas = False
        return self._cublas or None

    def _gemm(self, w: CudaWeight, x: DeviceArray, y: DeviceArray) -> None:
        """y = x . w^T: x to fp16 with per-row power-of-two scales, w decoded to fp16 slab by slab
        (F16 weights are used in place), one cuBLAS GEMM per slab, then the scales put back."""
        n, k = x.shape
        rows = w.shape[0]
        if self._f16_cache is not None and self._f16_cache[0] is x:
            xh, scales = self._f16_cache[1]
        else:
            xh, scales = self._new(n, k, dtype=np.float16), self._new(n)
            self.k.to_f16_rows(x, xh, scales, self.stream)
            self._f16_cache = (x, (xh, scales))
        cublas = self._cublas_handle()
        if w.ggml_type == GGMLType.F16:
            cublas.gemm_f16(w.data.ptr, xh.ptr, y.ptr, rows, n, k, rows)
        else:
            slab = self._slab(2 * rows * k)
            step = max(1, slab.nbytes // (2 * k))
            row_bytes = w.data.nbytes // rows
            for r0 in range(0, rows, step):
                m = min(step, rows - r0)
                src = DeviceArray(self.pool, (m * row_bytes,), np.uint8, base=w.data, ptr=w.data.ptr + r0 * row_bytes)
                self.k.dequant_f16(w.ggml_type, src, slab, m, k, self.stream)
                cublas.gemm_f16(slab.ptr, xh.ptr, y.ptr + 4 * r0, m, n, k, rows)
        self.k.scale_rows(y, scales, self.stream)

    def _slab(self, need: int) -> DeviceArray:
        """The fp16 weight slab: at most GEMM_SLAB_BYTES; with a model set, sized once for its
        largest matrix (what the planner reserved), else grown to the largest weight seen."""
        if self._gemm_ws is None or self._gemm_ws.nbytes < min(need, GEMM_SLAB_BYTES):
            planned = gemm_workspace_bytes(self.cfg) - self._cublas_ws.nbytes if self.cfg is not None else 0
            self._gemm_ws = None  # back to the pool before the larger one is taken
            self._gemm_ws = self._new(min(max(need, planned), GEMM_SLAB_BYTES), dtype=np.uint8)
        return self._gemm_ws

    def _uses_mmq(self, w: CudaWeight, n: int) -> bool:
        """Prefill-sized x (more than one _n8 slice) on the tensor-core kernel (opt-in)."""
        return self.mmq and n > MATVEC_MAX_TOKENS and w.ggml_type in MMQ_TYPES and self.uses_fast(w)

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
        d = None
        if self._pending is not None and self._pending[2] is x:  # "norm": add + rmsnorm in one kernel
            a, d, _ = self._pending
            self._pending = None
        else:
            self.flush()
            a = x
        n, k = x.shape
        out = self._new(n, k)
        key = self._norm_keys.get(w.ptr) if "norm" in self.fuse else None
        qmode = 0
        if key is not None and key[0] in (GGMLType.Q8_0, GGMLType.Q8_1) and k % 32 == 0:
            qmode = 1
        elif key is not None and key[0] == GGMLType.Q8_K and k % 256 == 0:
            qmode = 2
        if qmode == 0 and d is None:
            self.k.rmsnorm(x, w, out, eps, self.stream)
        else:  # the act cache then hands the next matmul(s) on `out` these int8 values
            xq, xd, xs = ((self._new(n, k, dtype=np.int8), self._new(n, k // 32), self._new(n, k // 32)) if qmode
                          else (None, None, None))
            self.k.add_rmsnorm_quanti(a, d, x if d is not None else None, w, out, xq, xd, xs, eps, qmode, self.stream)
            if qmode:
                self._act_cache = (out, key, (xq, (xd, xs)))
        self._last_norm = (out, w.ptr)
        return out

    def rope(self, x: DeviceArray, positions: np.ndarray, n_heads: int) -> DeviceArray:
        self.flush()
        c = self._model()
        self._stage_positions(positions)
        out = self._new(*x.shape)
        self.k.rope(x, out, self.pos_buf, self.rope_ff, n_heads, c.head_dim, c.rope_dim, self.rope_scale,
                    c.rope_freq_scale, c.rope_type == ROPE_NEOX, self.stream)
        return out

    def attention(self, q: DeviceArray, k: DeviceArray, v: DeviceArray, layer: int, start: int) -> DeviceArray:
        self.flush()
        c = self._model()
        self._check_room(start, q.shape[0])
        self._stage_positions(np.arange(start, start + q.shape[0]))
        self.k.kv_store(k, v, self.k_cache[layer], self.v_cache[layer], self.pos_buf, c.kv_dim, self.stream)
        return self._attend(q, layer)

    def rope_attention(self, q: DeviceArray, k: DeviceArray, v: DeviceArray, positions: np.ndarray, layer: int,
                       start: int) -> DeviceArray:
        """attention(rope(q), rope(k), v); with "rope" the RoPEs and the cache store are one kernel."""
        c = self._model()
        n = q.shape[0]
        if "rope" not in self.fuse or not np.array_equal(positions, np.arange(start, start + n)):
            return self.attention(self.rope(q, positions, c.n_head), self.rope(k, positions, c.n_head_kv), v, layer,
                                  start)
        self.flush()
        self._check_room(start, n)
        self._stage_positions(positions)
        if n == 1 and self.attn == "grid" and self._grid_shape(self._attn_form()) is not None:  # it does rope_kv's work
            rope = (k, v, self.rope_ff, c.rope_dim, self.rope_scale, c.rope_freq_scale, int(c.rope_type == ROPE_NEOX))
            return self._attend(q, layer, rope)
        qr = self._new(*q.shape)
        self.k.rope_kv(q, k, v, qr, self.k_cache[layer], self.v_cache[layer], self.pos_buf, self.rope_ff, c.n_head,
                       c.n_head_kv, c.head_dim, c.rope_dim, self.rope_scale, c.rope_freq_scale,
                       c.rope_type == ROPE_NEOX, self.stream)
        return self._attend(qr, layer)

    def _check_room(self, start: int, n: int) -> None:
        if start + n > self.n_ctx:
            raise ValueError(f"context full: position {start + n} exceeds n_ctx {self.n_ctx}")

    def _attend(self, q: DeviceArray, layer: int, rope: tuple | None = None) -> DeviceArray:
        """Causal GQA attention of q at the staged positions over layer's cache (already stored).
        rope: Kernels.attention_grid's, for one token whose q, k, v are not yet rotated and stored
        (only where the grid kernel runs)."""
        c, n = self._model(), q.shape[0]
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        out = self._new(n, c.q_dim)
        scale = float(np.float32(1.0 / np.sqrt(c.head_dim)))
        form = self._attn_form() if self.attn == "grid" and n == 1 else 0
        grid = self._grid_shape(form) if self.attn == "grid" and n == 1 else None
        if grid is not None:
            nb = grid[0]
            scratch = (None, None, None, None) if form else (  # the cluster form keeps them in shared memory
                self._new(c.n_head, nb), self._new(c.n_head, nb, dtype=np.float64),
                self._new(c.n_head, nb, c.head_dim), self._grid_counters)
            self.k.attention_grid(q, kc, vc, out, self.pos_buf, c.n_head, c.n_head_kv, c.head_dim, grid, scale,
                                  scratch, self.stream, self._attn_quant(out), rope, form)
            self._last_attn = out
            return out
        if self.attn != "single" and n == 1 and gqa_split_ok(c.n_head, c.n_head_kv, c.head_dim):
            nchunk = -(-self.n_ctx // ATTN_CHUNK)
            scratch = (self._new(c.n_head, self.n_ctx), self._new(c.n_head, nchunk),
                       self._new(c.n_head, nchunk, c.head_dim), *self._attn_stats)
            quant = self._attn_quant(out)
            self.k.attention_gqa(q, kc, vc, out, self.pos_buf, c.n_head, c.n_head_kv, c.head_dim, self.n_ctx,
                                 scale, scratch, self.stream, quant)
            self._last_attn = out
            return out
        self.k.attention(q, kc, vc, out, self.pos_buf, c.n_head, c.n_head_kv, c.head_dim, self.n_ctx, scale,
                         self.stream)
        return out

    def _grid_shape(self, cluster: int = 0) -> tuple[int, int] | None:
        """The grid attention's (nb, rmax, minr) for this model and n_ctx, in the grid form
        (cluster 0) or the cluster form of `cluster` blocks a KV head; None where it cannot run.
        Found once a model and form (the grid form asks the occupancy calculator)."""
        if cluster not in self._grid:
            c, dev = self._model(), self.k.device
            per_sm = 1 if cluster else self.k.grid_per_sm(c.n_head, c.n_head_kv, c.head_dim, self.n_ctx)
            self._grid[cluster] = grid_attn_shape(c.n_head, c.n_head_kv, c.head_dim, self.n_ctx, dev.sm_count,
                                                  dev.max_smem_optin, per_sm, cluster=cluster) or ()
        return self._grid[cluster] or None

    def _attn_form(self, pos: int | None = None) -> int:
        """The decode attention's form at position pos (None: the staged one): the cluster form's
        blocks a KV head where it runs (grid_cluster_size; up to CLUSTER_MAX_T positions, beyond
        which the grid form's twice as many blocks are faster), else 0 (the grid form)."""
        c = self._model()
        pos = self._staged[0] if pos is None else pos
        cl = grid_cluster_size(c.n_head, c.n_head_kv, c.head_dim, self.k.device.cc, self.k.grid_cluster)
        return cl if cl and pos + 1 <= CLUSTER_MAX_T and self._grid_shape(cl) is not None else 0

    def decode_form(self, start: int) -> tuple:
        """What a decode step's launches depend on besides the buffers, at position start: a
        captured step (DecodeGraph) replays only where this is the one it was captured with."""
        return (self._attn_form(start) if self.attn == "grid" else 0,)

    def _attn_quant(self, out: DeviceArray) -> tuple | None:
        """"attn": (xq, xd, xs, qmode) for the decode attention to quantize out as the matmul
        that read its output last time asked (_int8_activations learns it), and that matmul's
        act-cache entry; None while unknown or not fused."""
        key = self._attn_key if "attn" in self.fuse else None
        n, k = out.shape
        qmode = 0
        if key is not None and key[0] in (GGMLType.Q8_0, GGMLType.Q8_1):
            qmode = 1
        elif key is not None and key[0] == GGMLType.Q8_K and (k // self.cfg.n_head_kv) % 256 == 0:
            qmode = 2
        if not qmode:
            return None
        xq, xd, xs = self._new(n, k, dtype=np.int8), self._new(n, k // 32), self._new(n, k // 32)
        self._act_cache = (out, key, (xq, (xd, xs)))
        return xq, xd, xs, qmode

    def decode_stack(self, layers: list, x: DeviceArray, start: int) -> DeviceArray | None:
        """"stack" / "stack8": every layer for the one token x at position start in one persistent launch
        (backends/cuda_layers.py), returning the residual after the last layer; None where it
        cannot run (not asked for, the model does not fit it, or the GPU cannot hold its grid now: the
        first such launch fails cleanly, as a cooperative one, and the step goes on layer by layer;
        `stack_why_not`)."""
        if not self.stack_asked or x.shape[0] != 1:
            return None
        from ntx_engine.backends.cuda_layers import TYPE_CODES, StackDecode, stack_unfit

        if self._stack is None or self._stack[0] is not layers:
            c, dev = self._model(), self.device
            allowed, hint = tuple(TYPE_CODES), ""
            if "stack" not in self.fuse:  # "stack8": Q8_0 models only
                allowed, hint = (GGMLType.Q8_0,), (": the stack step stack8 takes Q8_0 models "
                                                    "(NTX_CUDA_FUSE=all,stack, the default, also runs Q4_K/Q5_K/Q6_K mixes)")
            why = stack_unfit(c, layers, self.n_ctx, dev.cc, dev.sm_count, dev.max_smem_optin, allowed, hint)
            self._stack = (layers, None if why else StackDecode(self, layers), why)
        if self._stack[1] is None:
            return None
        self.flush()
        self._check_room(start, 1)
        self._stage_positions(np.arange(start, start + 1))
        try:
            return self._stack[1].run(x)
        except CudaError as e:  # a cooperative grid the GPU cannot hold (an MPS share of the SMs)
            if self.capturing or "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE" not in str(e):
                raise
            self._stack = (layers, None, f"the GPU cannot hold the stack step's blocks all at once ({e}): "
                                         f"the layer-by-layer kernels run")
            from ntx_common.console import warn

            warn(self._stack[2])
            return None

    @property
    def stack_asked(self) -> bool:
        """Whether the fusions name a stack step ("stack" or "stack8", the default's)."""
        return bool(STACK_FUSIONS & self.fuse)

    @property
    def stack(self):
        """The model's stack decode (cuda_layers.StackDecode) once decode_stack has run it, else None."""
        return None if self._stack is None else self._stack[1]

    @property
    def stack_why_not(self) -> str | None:
        """Why the last decode_stack call fell back to the layer-by-layer kernels (None: it did not)."""
        return None if self._stack is None else self._stack[2]

    def swiglu(self, gate: DeviceArray, up: DeviceArray) -> DeviceArray:
        self.flush()
        out = self._new(*gate.shape)
        self.k.swiglu(gate, up, out, self.stream)
        return out

    def add(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        self.flush()
        out = self._new(*a.shape)
        if "norm" in self.fuse and a.shape == b.shape:
            self._pending = (a, b, out)  # launched by the next op, or fused into its rmsnorm
        else:
            self.k.add(a, b, out, self.stream)
        return out

    def forget_inputs(self) -> None:
        """Drop every cache keyed by an array's identity (quantized or fp16 activations, the last
        norm and attention outputs): a caller about to rewrite arrays in place (a graph replay
        over its own buffers) makes them stale. Launches the held-back add first."""
        self.flush()
        self._act_cache = self._f16_cache = self._last_norm = self._last_attn = None

    def flush(self) -> None:
        """Launch the held-back add, if any. Every op but a fusing rmsnorm calls this first; code
        that launches kernels on this backend's arrays itself (through `self.k`) must too."""
        if self._pending is not None:
            a, b, out = self._pending
            self._pending = None
            self.k.add(a, b, out, self.stream)

    def argmax(self, x: DeviceArray, feed: bool = False, hist=None) -> DeviceArray:
        """Index of the largest of x (flattened) as a device int32: greedy sampling on the GPU.
        feed (a one-token decode step): the index also becomes the token id the next step embeds
        (ids_buf) and the position in pos_buf advances by one, on the device; hist (HostSlots of n_ctx
        words, with feed): the index is also written to the host at hist[the step's position]."""
        self.flush()
        out = self._new(1, dtype=np.int32)
        self.k.argmax(x, out, self.stream, (self.ids_buf, self.pos_buf) if feed else None, hist)
        return out

    # --- state ---------------------------------------------------------------------------
    def set_model(self, cfg: ModelConfig, n_ctx: int, rope_freqs: np.ndarray | None) -> None:
        self.cfg, self.n_ctx = cfg, n_ctx
        # (n_ctx, n_head_kv*head_dim) f16 per layer: the layout the numpy backend uses
        self.k_cache = [self._new(n_ctx, cfg.kv_dim, dtype=np.float16) for _ in range(cfg.n_layers)]
        self.v_cache = [self._new(n_ctx, cfg.kv_dim, dtype=np.float16) for _ in range(cfg.n_layers)]
        self._pending, self._last_norm, self._act_cache = None, None, None
        self._f16_cache, self._gemm_ws = None, None  # the slab is sized from this model's shapes
        # split attention's per-KV-head arrival counters of its two kernels (zero between
        # launches), softmax max and sum per query head
        self._attn_stats = (upload(self.pool, np.zeros(cfg.n_head_kv, np.uint32), self.stream),
                            upload(self.pool, np.zeros(cfg.n_head_kv, np.uint32), self.stream),
                            self._new(cfg.n_head), self._new(cfg.n_head, dtype=np.float64))
        # the grid attention's per-KV-head counters: its barrier, its last block (zero between launches)
        self._grid: dict[int, tuple] = {}  # _grid_shape's answers by form: () where it cannot run
        self._grid_counters = upload(self.pool, np.zeros(2 * cfg.n_head_kv, np.uint32), self.stream)
        self._last_attn, self._attn_key = None, None
        self._stack = None
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
        self.flush()
        if self.capturing:  # inside graph capture nothing may wait: the graph owner reads it later
            self.captured_output = x
            return np.empty(x.shape, x.dtype)
        return download(x, self.stream)

    def from_numpy(self, x: np.ndarray) -> DeviceArray:
        return upload(self.pool, np.ascontiguousarray(x, np.float32), self.stream)

    def synchronize(self) -> None:
        self.flush()
        self.stream.synchronize()

    def _model(self) -> ModelConfig:
        if self.cfg is None:
            raise RuntimeError("set_model() must be called before running ops")
        return self.cfg
