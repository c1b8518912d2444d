"""ctypes access to the ggml that llama-cpp-python ships: the oracle for quant formats and for
the quantized dot products llama.cpp's CPU backend computes.

Struct layouts are those of ggml.h / ggml-cpu.h in the ggml vendored by llama-cpp-python 0.3.36
(`libggml-*.so.0.25.x`):
    struct ggml_type_traits     { const char *type_name; int64_t blck_size;
                                  int64_t blck_size_interleave; size_t type_size;
                                  bool is_quantized; to_float_t to_float;
                                  from_float_t from_float_ref; };
    struct ggml_type_traits_cpu { from_float_t from_float; vec_dot_t vec_dot;
                                  enum ggml_type vec_dot_type; int64_t nrows; };
    vec_dot(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by, int nrc)
"""
from __future__ import annotations

import ctypes
import importlib.util
from functools import cache
from pathlib import Path

import numpy as np

_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                            ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _TypeTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


class _TypeTraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


def lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise RuntimeError("llama-cpp-python is not installed: run `make test`")
    return Path(spec.origin).parent / "lib"


class Ggml:
    """The base and CPU libraries, initialised once."""

    def __init__(self):
        d = lib_dir()
        # RTLD_GLOBAL: libggml-cpu resolves its ggml-base symbols against this copy
        self.base = ctypes.CDLL(str(d / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(d / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        self.base.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
        self.base.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCpu)
        self.cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        self.base.ggml_type_size.restype = ctypes.c_size_t
        self.base.ggml_blck_size.restype = ctypes.c_int64
        self.cpu.ggml_cpu_init()  # fills the fp16 tables the CPU kernels use

    def block(self, ggml_type: int) -> tuple[int, int]:
        """(elements per block, bytes per block) as ggml itself reports them."""
        return int(self.base.ggml_blck_size(ggml_type)), int(self.base.ggml_type_size(ggml_type))

    def type_name(self, ggml_type: int) -> str:
        return self.base.ggml_get_type_traits(ggml_type).contents.type_name.decode()

    def vec_dot_type(self, ggml_type: int) -> int:
        return int(self.cpu.ggml_get_type_traits_cpu(ggml_type).contents.vec_dot_type)

    def to_float(self, ggml_type: int, raw: np.ndarray, n: int) -> np.ndarray:
        """ggml's own dequantize_row for `n` elements of raw bytes."""
        fn = self.base.ggml_get_type_traits(ggml_type).contents.to_float
        src = np.ascontiguousarray(raw, np.uint8)
        if fn is None:  # F32 has no conversion: its bytes are the values
            return src.reshape(-1).view(np.float32)[:n].copy()
        out = np.empty(n, np.float32)
        _TO_FLOAT(fn)(src.ctypes.data, out.ctypes.data, n)
        return out

    def from_float(self, ggml_type: int, x: np.ndarray) -> np.ndarray:
        """The CPU backend's from_float (what mul_mat applies to activations) for each row
        of x (n, k) -> uint8 (n, bytes per row)."""
        fn = _FROM_FLOAT(self.cpu.ggml_get_type_traits_cpu(ggml_type).contents.from_float)
        x = np.ascontiguousarray(x, np.float32)
        bs, ts = self.block(ggml_type)
        out = np.zeros((x.shape[0], x.shape[1] // bs * ts), np.uint8)
        for i in range(x.shape[0]):
            fn(x[i].ctypes.data, out[i].ctypes.data, x.shape[1])
        return out

    def vec_dot(self, weight_type: int, w_row: np.ndarray, act_row: np.ndarray, k: int) -> float:
        """One quantized dot product exactly as the CPU backend's mul_mat computes it."""
        fn = _VEC_DOT(self.cpu.ggml_get_type_traits_cpu(weight_type).contents.vec_dot)
        w = np.ascontiguousarray(w_row, np.uint8)
        a = np.ascontiguousarray(act_row, np.uint8)
        out = np.zeros(1, np.float32)
        fn(k, out.ctypes.data, 0, w.ctypes.data, 0, a.ctypes.data, 0, 1)
        return float(out[0])

    def matmul(self, weight_type: int, w_raw: np.ndarray, x: np.ndarray) -> np.ndarray:
        """x (n, k) float32 times weight rows (rows, bytes per row) -> (n, rows) via
        from_float + vec_dot, the path llama.cpp's CPU mul_mat takes."""
        n, k = x.shape
        act = self.from_float(self.vec_dot_type(weight_type), x)
        out = np.empty((n, len(w_raw)), np.float32)
        for i in range(n):
            for r in range(len(w_raw)):
                out[i, r] = self.vec_dot(weight_type, w_raw[r], act[i], k)
        return out


@cache
def ggml() -> Ggml:
    return Ggml()


def quantize_chunk(g: Ggml, ggml_type: int, w: np.ndarray) -> np.ndarray:
    """ggml's own quantizer (ggml_quantize_chunk, no imatrix): float32 (rows, k) -> uint8
    (rows, bytes per row) — realistic weight blocks for the dot-product oracle."""
    fn = g.base.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]
    w = np.ascontiguousarray(w, np.float32)
    rows, k = w.shape
    bs, ts = g.block(ggml_type)
    out = np.zeros((rows, k // bs * ts), np.uint8)
    written = fn(ggml_type, w.ctypes.data, out.ctypes.data, 0, rows, k, None)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out
