"""The native CPU kernels (`native/cpu`, cffi module `ntx_engine._cpu`) behind a small Python API.

One `CpuKernels` owns a persistent thread pool; its calls take numpy arrays, check shapes and
dtypes, release the GIL for the whole C call (cffi does that for every out-of-line API call)
and turn a negative errno into a `CpuKernelError`. A lock serializes calls: the pool runs one
job at a time.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np

from ntx_common.errors import CpuKernelError
from ntx_engine.quants import GGML_BLOCK_SIZES, GGMLType

SIMD_NAMES = {0: "portable", 1: "avx2", 2: "avx512vnni", 3: "avx512"}
BEST_SIMD = SIMD_NAMES[max(SIMD_NAMES)]  # select_simd(BEST_SIMD): the best level this CPU has
DEFAULT_SPIN_US = 1000  # workers spin this long after a job: decode issues one every ~10-50 us
DEFAULT_DEADLINE_MS = 120_000  # no single op of a sane model takes two minutes


def load_module():
    """The built cffi module, or None when `pip install -e .` has not compiled it."""
    try:
        from ntx_engine import _cpu
    except ImportError:
        return None
    return _cpu


def default_threads() -> int:
    """NTX_CPU_THREADS, else every CPU this process may run on."""
    env = os.environ.get("NTX_CPU_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise CpuKernelError(f"NTX_CPU_THREADS={env!r} is not a number of threads") from None
        if n < 1:
            raise CpuKernelError(f"NTX_CPU_THREADS={env!r} must be at least 1")
        return n
    return len(os.sched_getaffinity(0))


def _f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def _vec(v: np.ndarray, n: int, what: str) -> np.ndarray:
    v = _f32(v).reshape(-1)
    if v.size != n:
        raise ValueError(f"{what}: {v.size} values, expected {n}")
    return v


class RawWeight:
    """A checked (rows, k) weight of raw GGUF blocks and its C pointer (kept alive with `raw`)."""

    __slots__ = ("type", "raw", "ptr", "rows", "k", "name")

    def __init__(self, ggml_type: int, raw: np.ndarray, ptr, rows: int, k: int, name: str) -> None:
        self.type, self.raw, self.ptr, self.rows, self.k, self.name = ggml_type, raw, ptr, rows, k, name


class LayerSpec:
    """A filled `struct ntx_cpu_layer` and everything it points into (kept alive here)."""

    __slots__ = ("struct", "keep", "n_embd", "name")

    def __init__(self, struct, keep: list, n_embd: int, name: str) -> None:
        self.struct, self.keep, self.n_embd, self.name = struct, keep, n_embd, name


class CpuKernels:
    def __init__(self, threads: int | None = None, spin_us: int | None = None,
                 deadline_ms: int = DEFAULT_DEADLINE_MS) -> None:
        mod = load_module()
        if mod is None:
            raise CpuKernelError("the native CPU kernels are not built (ntx_engine._cpu is missing): "
                                 "run `pip install -e .` (or `make`) in the ntx checkout")
        self.ffi, self.lib = mod.ffi, mod.lib
        self.threads = threads if threads is not None else default_threads()
        spin = spin_us if spin_us is not None else int(os.environ.get("NTX_CPU_SPIN_US", DEFAULT_SPIN_US))
        box = self.ffi.new("struct ntx_cpu_pool **")
        self._check(self.lib.ntx_cpu_pool_open(box, self.threads, spin, deadline_ms),
                    f"thread pool of {self.threads}")
        self._pool = self.ffi.gc(box[0], self.lib.ntx_cpu_pool_close)
        self._lock = threading.Lock()

    # --- facts ---------------------------------------------------------------------------
    @property
    def simd(self) -> str:
        return SIMD_NAMES[self.lib.ntx_cpu_simd_level()]

    def select_simd(self, name: str) -> str:
        """Use at most the `name`d kernel table (tests compare the paths); returns the one in use."""
        level = {v: k for k, v in SIMD_NAMES.items()}.get(name)
        if level is None:
            raise ValueError(f"unknown SIMD level {name!r} (known: {', '.join(SIMD_NAMES.values())})")
        return SIMD_NAMES[self.lib.ntx_cpu_simd_select(level)]

    def has_multi_row(self, ggml_type: int) -> bool:
        """Whether the active table reads a weight row once for up to 4 activation rows."""
        rc = self.lib.ntx_cpu_multi_row(int(ggml_type))
        self._check(rc, f"type {ggml_type}")
        return bool(rc)

    def supported_simd(self) -> str:
        return SIMD_NAMES[self.lib.ntx_cpu_simd_supported()]

    def numa_nodes(self) -> int:
        return int(self.lib.ntx_cpu_numa_nodes())

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self.ffi.release(self._pool)  # joins the workers now, not at garbage collection
                self._pool = None

    # --- ops -----------------------------------------------------------------------------
    def act_row_bytes(self, ggml_type: int, k: int) -> int:
        n = self.lib.ntx_cpu_act_row_bytes(int(ggml_type), k)
        self._check(n, f"activation row of type {ggml_type} and width {k}")
        return int(n)

    def quantize_act(self, ggml_type: int, x: np.ndarray) -> np.ndarray:
        """x (n, k) -> the (n, row bytes) activation rows ggml's from_float writes."""
        x = _f32(x)
        out = np.empty((x.shape[0], self.act_row_bytes(ggml_type, x.shape[1])), np.uint8)
        rc = self.lib.ntx_cpu_quantize_act(int(ggml_type), self._fp(x), x.shape[0], x.shape[1],
                                           self.ffi.from_buffer(out))
        self._check(rc, "activation quantization")
        return out

    def weight(self, ggml_type: int, raw: np.ndarray, rows: int, k: int, name: str = "?") -> "RawWeight":
        """Check (rows, k) raw blocks once; the handle is what the matmul calls take."""
        t = GGMLType(int(ggml_type))
        block, size = GGML_BLOCK_SIZES[t]
        if k <= 0 or rows <= 0 or k % block or raw.nbytes != rows * (k // block) * size:
            raise ValueError(f"{name}: {raw.nbytes} bytes are not ({rows}, {k}) of {t.name}")
        self.act_row_bytes(t, k)  # a type without kernels fails here, not inside a forward pass
        return RawWeight(int(t), raw, self.ffi.from_buffer(raw), rows, k, name)

    def matmul(self, ggml_type: int, raw: np.ndarray, rows: int, k: int, x: np.ndarray,
               name: str = "?", out: np.ndarray | None = None) -> np.ndarray:
        """x (n, k) @ W.T for W the (rows, k) raw blocks -> (n, rows) float32 (into `out` if given)."""
        return self.matmul_w(self.weight(ggml_type, raw, rows, k, name), x, out)

    def matmul_w(self, w: "RawWeight", x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        x = self._x(x, w)
        out = self._out(out, (len(x), w.rows))
        with self._lock:
            rc = self.lib.ntx_cpu_matmul(self._live(), w.type, w.ptr, w.rows, w.k, self._fp(x), len(x),
                                         self._fp(out))
        self._check(rc, f"matmul of {w.name}")
        return out

    def matmul_many(self, ws: list["RawWeight"], x: np.ndarray) -> list[np.ndarray]:
        """[x @ W.T for W in ws] in one pass (x quantized once per activation format)."""
        x = self._x(x, ws[0])
        outs = [np.empty((len(x), w.rows), np.float32) for w in ws]
        if any(w.k != ws[0].k for w in ws):
            raise ValueError(f"matmul_many: widths differ ({[w.k for w in ws]})")
        ffi = self.ffi
        with self._lock:
            rc = self.lib.ntx_cpu_matmul_many(
                self._live(), len(ws), ffi.new("int[]", [w.type for w in ws]), ffi.new("void *[]", [w.ptr for w in ws]),
                ffi.new("int64_t[]", [w.rows for w in ws]), ws[0].k, self._fp(x), len(x),
                ffi.new("float *[]", [self._fp(o) for o in outs]))
        self._check(rc, f"matmul of {', '.join(w.name for w in ws)}")
        return outs

    def matmul_swiglu(self, gate: "RawWeight", up: "RawWeight", x: np.ndarray) -> np.ndarray:
        """silu(x @ gate.T) * (x @ up.T) in one pass over both weights."""
        if gate.rows != up.rows or gate.k != up.k:
            raise ValueError(f"{gate.name} ({gate.rows}, {gate.k}) and {up.name} ({up.rows}, {up.k}) differ")
        x = self._x(x, gate)
        out = np.empty((len(x), gate.rows), np.float32)
        with self._lock:
            rc = self.lib.ntx_cpu_matmul_swiglu(self._live(), gate.type, gate.ptr, up.type, up.ptr, gate.rows,
                                                gate.k, self._fp(x), len(x), self._fp(out))
        self._check(rc, f"matmul+swiglu of {gate.name}, {up.name}")
        return out

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
        x, w = _f32(x), _f32(w)
        if x.shape[-1] != w.size:
            raise ValueError(f"rmsnorm: rows of {x.shape} do not match the gain ({w.size})")
        out = self._out(out, x.shape)
        n, d = x.reshape(-1, x.shape[-1]).shape
        with self._lock:
            rc = self.lib.ntx_cpu_rmsnorm(self._live(), self._fp(x), self._fp(w), n, d, eps, self._fp(out))
        self._check(rc, "rmsnorm")
        return out

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_heads: int, head_dim: int,
             rope_dim: int, neox: bool) -> np.ndarray:
        out = np.array(x, dtype=np.float32, order="C")  # a copy: callers keep their input
        half = (len(out), rope_dim // 2)
        if out.shape != (len(out), n_heads * head_dim) or np.shape(cos) != half or np.shape(sin) != half:
            raise ValueError(f"rope: x {out.shape}, cos {np.shape(cos)}, sin {np.shape(sin)} do not fit "
                             f"{n_heads} heads of {head_dim} with rope_dim {rope_dim}")
        rc = self.lib.ntx_cpu_rope(self._fp(out), self._fp(_f32(cos)), self._fp(_f32(sin)), len(out),
                                   n_heads, head_dim, rope_dim, int(neox))
        self._check(rc, "rope")
        return out

    def swiglu(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        gate, up = _f32(gate), _f32(up)
        if gate.shape != up.shape:
            raise ValueError(f"swiglu: gate {gate.shape} and up {up.shape} differ")
        out = self._out(out, gate.shape)
        with self._lock:
            rc = self.lib.ntx_cpu_swiglu(self._live(), self._fp(gate), self._fp(up), gate.size, self._fp(out))
        self._check(rc, "swiglu")
        return out

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = _f32(a), _f32(b)
        if a.shape != b.shape:
            return a + b  # broadcasting (a bias row): numpy's add is the same float add
        out = np.empty_like(a)
        self._check(self.lib.ntx_cpu_add(self._fp(a), self._fp(b), a.size, self._fp(out)), "add")
        return out

    def attention(self, q, k, v, k_cache: np.ndarray, v_cache: np.ndarray, start: int,
                  n_head: int, n_kv: int, head_dim: int, out: np.ndarray | None = None,
                  rope: tuple[np.ndarray, np.ndarray, int, bool] | None = None) -> np.ndarray:
        """Write k, v at `start` into one layer's caches (n_ctx, n_kv, head_dim), attend -> (n, n_head*hd).
        With rope = (cos, sin, rope_dim, neox), q and k are rotated first (in the same C call)."""
        q, k, v = _f32(q), _f32(k), _f32(v)
        n_ctx = len(k_cache)
        for c in (k_cache, v_cache):
            if not c.flags.c_contiguous or c.shape != (n_ctx, n_kv, head_dim) or c.dtype not in (np.float16, np.float32):
                raise ValueError(f"attention: a KV cache must be C-contiguous f16/f32 (n_ctx, {n_kv}, {head_dim}), "
                                 f"got {c.dtype} {c.shape}")
        if q.shape != (len(q), n_head * head_dim) or k.shape != v.shape or k.shape != (len(q), n_kv * head_dim):
            raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit {n_head}/{n_kv} heads of {head_dim}")
        out = self._out(out, (len(q), n_head * head_dim))
        f16, fb = int(k_cache.dtype == np.float16), self.ffi.from_buffer
        geometry = (fb(k_cache), fb(v_cache), f16, n_ctx, start, len(q), n_head, n_kv, head_dim, self._fp(out))
        with self._lock:
            if rope is None:
                rc = self.lib.ntx_cpu_attention(self._live(), self._fp(q), self._fp(k), self._fp(v), *geometry)
            else:
                cos, sin, rope_dim, neox = rope
                cos, sin = _f32(cos), _f32(sin)
                if cos.shape != (len(q), rope_dim // 2) or sin.shape != cos.shape:
                    raise ValueError(f"rope: cos {cos.shape} / sin {sin.shape} do not fit {len(q)} tokens")
                rc = self.lib.ntx_cpu_rope_attention(self._live(), self._fp(q), self._fp(k), self._fp(v),
                                                     self._fp(cos), self._fp(sin), rope_dim, int(neox),
                                                     *geometry)
        self._check(rc, "attention")
        return out

    # --- a whole layer -------------------------------------------------------------------
    def layer_spec(self, geometry: dict, ws: list["RawWeight"], norms: tuple, biases: tuple | None,
                   k_cache: np.ndarray, v_cache: np.ndarray, name: str = "layer") -> LayerSpec:
        """Check a dense llama-family layer once: geometry = n_embd, n_head, n_kv, head_dim, n_ff,
        rope_dim, neox, eps; ws = wq, wk, wv, wo, w_gate, w_up, w_down; norms = (attn, ffn);
        biases = (bq, bk, bv) or None; caches (n_ctx, n_kv, head_dim) of this layer."""
        g = geometry
        e, hd, ff = g["n_embd"], g["head_dim"], g["n_ff"]
        qd, kvd = g["n_head"] * hd, g["n_kv"] * hd
        shapes = [(qd, e), (kvd, e), (kvd, e), (e, qd), (ff, e), (ff, e), (e, ff)]
        if len(ws) != 7 or [(w.rows, w.k) for w in ws] != shapes:
            raise ValueError(f"{name}: weights {[(w.rows, w.k) for w in ws]} are not the shapes {shapes}")
        vecs = [_vec(v, e, f"{name} norm") for v in norms]
        if biases is not None:
            vecs += [_vec(b, n, f"{name} bias") for b, n in zip(biases, (qd, kvd, kvd))]
        for c in (k_cache, v_cache):
            if not c.flags.c_contiguous or c.shape[1:] != (g["n_kv"], hd) or c.dtype not in (np.float16, np.float32):
                raise ValueError(f"{name}: a KV cache must be C-contiguous f16/f32 (n_ctx, {g['n_kv']}, {hd}), "
                                 f"got {c.dtype} {c.shape}")
        st = self.ffi.new("struct ntx_cpu_layer *")
        for key in ("n_embd", "n_head", "n_kv", "head_dim", "n_ff", "rope_dim"):
            setattr(st, key, int(g[key]))
        st.neox, st.eps = int(g["neox"]), float(g["eps"])
        for j, w in enumerate(ws):
            st.types[j], st.w[j] = w.type, w.ptr
        fps = [self._fp(v) for v in vecs]
        st.attn_norm, st.ffn_norm = fps[0], fps[1]
        if biases is not None:
            st.bq, st.bk, st.bv = fps[2:]
        st.k_cache, st.v_cache = self.ffi.from_buffer(k_cache), self.ffi.from_buffer(v_cache)
        st.kv_f16, st.n_ctx = int(k_cache.dtype == np.float16), len(k_cache)
        return LayerSpec(st, [ws, vecs, fps, k_cache, v_cache], e, name)

    def layer_forward(self, spec: LayerSpec, x: np.ndarray, start: int, cos: np.ndarray,
                      sin: np.ndarray) -> np.ndarray:
        """x (n, n_embd) through the whole layer in one C call -> a new (n, n_embd) array."""
        out = np.array(x, dtype=np.float32, order="C")  # the kernel updates its x in place
        cos, sin = _f32(cos), _f32(sin)
        half = (len(out), int(spec.struct.rope_dim) // 2)
        if out.ndim != 2 or out.shape[1] != spec.n_embd or cos.shape != half or sin.shape != half:
            raise ValueError(f"{spec.name}: x {out.shape}, cos {cos.shape}, sin {sin.shape} do not fit "
                             f"n_embd {spec.n_embd} and rope tables {half}")
        if start < 0 or start + len(out) > spec.struct.n_ctx:
            raise ValueError(f"context full: position {start + len(out)} exceeds n_ctx {spec.struct.n_ctx}")
        with self._lock:
            rc = self.lib.ntx_cpu_layer_forward(self._live(), spec.struct, self._fp(out), len(out), start,
                                                self._fp(cos), self._fp(sin))
        self._check(rc, f"forward of {spec.name}")
        return out

    # --- plumbing ------------------------------------------------------------------------
    def _fp(self, a: np.ndarray):
        return self.ffi.from_buffer("float[]", a)

    @staticmethod
    def _x(x: np.ndarray, w: RawWeight) -> np.ndarray:
        x = _f32(x)
        if x.ndim != 2 or x.shape[1] != w.k:
            raise ValueError(f"{w.name}: cannot multiply {x.shape} by weight ({w.rows}, {w.k})")
        return x

    @staticmethod
    def _out(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
        if out is None:
            return np.empty(shape, np.float32)
        if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"output must be C-contiguous float32 {shape}, got {out.dtype} {out.shape}")
        return out

    def _live(self):
        if self._pool is None:
            raise CpuKernelError("the CPU kernel pool was closed; create a new backend")
        return self._pool

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc < 0:
            name = errno.errorcode.get(-rc, str(-rc))
            hint = " (a worker thread is stuck: the pool is unusable now)" if -rc in (errno.ETIMEDOUT, errno.EBUSY) else ""
            raise CpuKernelError(f"native CPU {what} failed: {name} ({os.strerror(-rc)}){hint}")
