"""llama.cpp-exact activation quantization and the CPU matmul weight (`MatmulWeight`).

llama.cpp's CPU backend quantizes each activation row to the weight type's vec_dot_type before
its integer dot products; `ggml` mode reproduces that bit for bit (tests/engine/test_quants_ggml.py
checks it against ggml itself), `exact` mode keeps float32 activations.
"""

from __future__ import annotations

import numpy as np

from ntx_common.errors import UnsupportedQuantError
from ntx_engine.quants import QK_K, GGMLType, as_blocks, dequantize_into, quant_type

# ---------------------------------------------------------------------------------------------
# Activation quantization exactly as llama.cpp's CPU backend does it (x86 AVX2 build: ggml's
# quantize_row_q8_0/q8_1 compute d = amax/127, multiply by 127/amax and round half to even;
# Q8_K uses the reference quantize_row_q8_K_ref: iscale = -127/max, round half to even).

def _q8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(nb, 32) float32 -> d (nb, 1) before fp16 rounding, q (nb, 32) and sum(q) (nb, 1) as
    ggml's int32 lanes add it, all float32."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    # 127/inf = 0 gives ggml's "id = 0 for an all-zero block" without a division warning;
    # |x * inv| <= 127 (1 + 2^-23), so the rounded q never leaves [-127, 127]
    with np.errstate(over="ignore"):
        inv = np.float32(127) / np.where(amax == 0, np.float32(np.inf), amax)
    overflow = np.isinf(inv)
    q = np.rint(x * np.where(overflow, np.float32(0), inv))
    if not overflow.any():
        return d, q, q.sum(axis=1, keepdims=True)
    # amax < ~3.7e-37: 127/amax overflows and ggml converts the inf/nan products to INT_MIN,
    # which saturates to -128 in every quant and wraps to 0 in the int32 sum (d is 0 in fp16)
    q = np.where(overflow, np.float32(-128), q)
    return d, q, np.where(overflow, np.float32(0), q.sum(axis=1, keepdims=True))


def _q8_k_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nb, 256) float32 -> f32 d (nb, 1), q (nb, 256) float32."""
    signed_max = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    with np.errstate(divide="ignore", over="ignore"):
        iscale = np.where(signed_max != 0, np.float32(-127) / signed_max, np.float32(0))
        iscale = iscale.astype(np.float32)
        d = np.where(iscale != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    # a tiny max makes iscale infinite: ggml's nearest_int then yields values whose int8
    # truncation is 0, so those blocks quantize to all zeros (with d = -0.0 or +0.0)
    iscale = np.where(np.isinf(iscale), np.float32(0), iscale)
    return d, np.minimum(np.rint(iscale * x), 127)


def quantize_blocks(x: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """Float32 activations (n, k) -> the (n * k / block, type_size) uint8 blocks ggml's CPU
    `from_float` writes for Q8_0, Q8_1 or Q8_K (the oracle tests compare these bytes)."""
    qt = quant_type(ggml_type)
    x = np.ascontiguousarray(x, np.float32).reshape(-1, qt.block_size)
    if ggml_type == GGMLType.Q8_K:
        d, q = _q8_k_blocks(x)
        sums = q.reshape(len(x), 16, 16).sum(axis=2).astype("<i2")
        parts = [d.astype("<f4").view(np.uint8), q.astype(np.int8).view(np.uint8), sums.view(np.uint8)]
    elif ggml_type in (GGMLType.Q8_0, GGMLType.Q8_1):
        d, q, qsum = _q8_blocks(x)
        parts = [d.astype("<f2").view(np.uint8)]
        if ggml_type == GGMLType.Q8_1:
            parts.append((d * qsum).astype("<f2").view(np.uint8))
        parts.append(q.astype(np.int8).view(np.uint8))
    else:
        raise ValueError(f"{ggml_type.name} is not an activation block format")
    return np.concatenate(parts, axis=1)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest-even bfloat16, returned as float32 (ggml_compute_fp32_to_bf16)."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = np.where(nan, (u >> 16).astype(np.uint32) | 64, rounded)  # keep NaNs quiet
    return (rounded << 16).view(np.float32)


def _quantize_with_sums(x: np.ndarray, vec_dot_type: GGMLType) -> tuple[np.ndarray, np.ndarray | None]:
    """x_hat (n, k) and, for Q8_1, the fp16-rounded per-block s = d * sum(q) (n, k/32)."""
    n, k = x.shape
    if vec_dot_type == GGMLType.F32:
        return x, None
    if vec_dot_type == GGMLType.F16:
        return x.astype(np.float16).astype(np.float32), None
    if vec_dot_type == GGMLType.BF16:
        return _round_bf16(x), None
    if vec_dot_type in (GGMLType.Q8_0, GGMLType.Q8_1):
        d, q, qsum = _q8_blocks(x.reshape(-1, 32))
        d16 = d.astype(np.float16).astype(np.float32)
        x_hat = (d16 * q).reshape(n, k)
        if vec_dot_type == GGMLType.Q8_0:
            return x_hat, None
        s = (d * qsum).astype(np.float16).astype(np.float32)
        return x_hat, s.reshape(n, k // 32)
    if vec_dot_type == GGMLType.Q8_K:
        d, q = _q8_k_blocks(x.reshape(-1, QK_K))
        return (d * q).reshape(n, k), None
    raise ValueError(f"{vec_dot_type.name} is not a vec_dot type")


def quantize_activations(x: np.ndarray, vec_dot_type: GGMLType) -> np.ndarray:
    """x (n, k) float32 -> the values llama.cpp's dot products see: Q8_0/Q8_1 fp16 d * int8 q
    (exact in float32), Q8_K f32 d * int8 q (rounded to float32 once), F16/BF16 rounded to
    that type, F32 unchanged. k must be a multiple of the block size."""
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2:
        raise ValueError(f"activations must be (n, k), got shape {x.shape}")
    return _quantize_with_sums(x, GGMLType(vec_dot_type))[0]


class MatmulWeight:
    """A weight matrix (rows, k) prepared once for repeated matmuls on the CPU.

    Holds the dequantized d*q values as float32 (rows, k); for Q4_1/Q5_1 the per-block mins are
    kept apart (rows, k/32) because llama.cpp applies them through the fp16 `s` of Q8_1.
    """

    def __init__(self, ggml_type: GGMLType, shape: tuple[int, int], scaled: np.ndarray,
                 mins: np.ndarray | None, name: str):
        self.ggml_type, self.shape, self.name = ggml_type, shape, name
        self.vec_dot_type = quant_type(ggml_type, name).vec_dot_type
        self._w = scaled  # (rows, k) float32: d*q (the whole value unless mins)
        self._mins = mins  # (rows, k / block) float32 or None

    @classmethod
    def from_raw(cls, raw: np.ndarray | memoryview, ggml_type: GGMLType | int,
                 shape: tuple[int, int], name: str) -> MatmulWeight:
        qt = quant_type(ggml_type, name)
        if not qt.is_weight_format:
            raise UnsupportedQuantError(f"tensor {name!r} is {qt.ggml_type.name}, an activation "
                                        "format llama.cpp never multiplies as a weight")
        rows, k = shape
        blocks = as_blocks(raw, qt, (rows, k), name)
        scaled = np.empty((rows, k), np.float32)
        mins = np.empty((rows, k // qt.block_size), np.float32) if qt.has_block_min else None
        dequantize_into(qt, blocks, scaled.reshape(-1), None if mins is None else mins.reshape(-1))
        return cls(qt.ggml_type, (rows, k), scaled, mins, name)

    def matmul(self, x: np.ndarray, mode: str = "ggml") -> np.ndarray:
        """x (n, k) float32 -> x @ W.T (n, rows) float32.

        mode "ggml": activations quantized to vec_dot_type as llama.cpp does (the default);
        mode "exact": float32 activations as given."""
        x = np.ascontiguousarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"{self.name}: cannot multiply {x.shape} by weight {self.shape}")
        if mode == "exact":
            x_hat, block_terms = x, None
            if self._mins is not None:
                block_terms = x.reshape(len(x), -1, 32).sum(axis=2)
        elif mode == "ggml":
            x_hat, block_terms = _quantize_with_sums(x, self.vec_dot_type)
        else:
            raise ValueError(f"matmul mode must be 'ggml' or 'exact', not {mode!r}")
        out = x_hat @ self._w.T
        if self._mins is not None:
            out += block_terms @ self._mins.T
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows (len(ids), k) float32: the embedding lookup (ggml get_rows)."""
        w = self._w[np.asarray(ids)]
        if self._mins is None:
            return w
        return w + np.repeat(self._mins[np.asarray(ids)], 32, axis=-1)

    @property
    def nbytes(self) -> int:
        """Host memory held by the prepared weight."""
        return self._w.nbytes + (0 if self._mins is None else self._mins.nbytes)
