"""GGML tensor types: the id enum, the block-size table and per-type numpy codecs.

The ids and block layouts follow ggml (`ggml.h` / `ggml-common.h`) of the llama.cpp vendored in
llama-cpp-python 0.3.36. Sizes are ggml's, not gguf-py's: gguf-py 0.19 still lists Q8_1 as 40
bytes (float d and s), ggml has stored both as fp16 (36 bytes) for a long time.
"""
from __future__ import annotations

import math
from enum import IntEnum

import numpy as np

from ntx_common.errors import GGUFError, UnsupportedQuantError

QK_K = 256  # elements per K-quant super-block


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    # 4 and 5 were Q4_2 / Q4_3, removed from ggml long ago
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    # 31-33 and 36-38 were the interleaved Q4_0 / IQ4_NL layouts, now repacked at run time
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


# (elements per block, bytes per block) for every type ggml defines.
GGML_BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q8_1: (32, 2 + 2 + 32),
    GGMLType.Q2_K: (QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    GGMLType.Q3_K: (QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    GGMLType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    GGMLType.Q8_K: (QK_K, 4 + QK_K + 2 * QK_K // 16),
    GGMLType.IQ2_XXS: (QK_K, 2 + QK_K // 4),
    GGMLType.IQ2_XS: (QK_K, 2 + QK_K // 4 + QK_K // 32),
    GGMLType.IQ3_XXS: (QK_K, 2 + 3 * QK_K // 8),
    GGMLType.IQ1_S: (QK_K, 2 + QK_K // 8 + QK_K // 16),
    GGMLType.IQ4_NL: (32, 2 + 16),
    GGMLType.IQ3_S: (QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    GGMLType.IQ2_S: (QK_K, 2 + QK_K // 4 + QK_K // 16),
    GGMLType.IQ4_XS: (QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (QK_K, 2 + 4 * 13),
    GGMLType.TQ2_0: (QK_K, 2 + QK_K // 4),
    GGMLType.MXFP4: (32, 1 + 16),
    GGMLType.NVFP4: (64, 4 + 32),
    GGMLType.Q1_0: (128, 2 + 16),
    GGMLType.Q2_0: (64, 2 + 16),
}


def ggml_type_of(type_id: int, tensor_name: str = "?") -> GGMLType:
    """The GGMLType for a raw id from a file, or a GGUFError naming the tensor."""
    try:
        return GGMLType(type_id)
    except ValueError:
        raise GGUFError(
            f"tensor {tensor_name!r} has unknown GGML type id {type_id}: the file is corrupt "
            "or was written by a newer ggml than this ntx knows"
        ) from None


def tensor_nbytes(ggml_type: GGMLType | int, n_elements: int) -> int:
    """Bytes held by `n_elements` values of `ggml_type`; a GGUFError unless whole blocks."""
    t = ggml_type_of(int(ggml_type))
    block, size = GGML_BLOCK_SIZES[t]
    if n_elements < 0 or n_elements % block:
        raise GGUFError(
            f"{n_elements} elements is not a whole number of {t.name} blocks of {block}"
        )
    return n_elements // block * size


# ---------------------------------------------------------------------------------------------
# Codecs: one class per supported type. Element order within a block and the order of float
# operations follow ggml's dequantize_row_* so results are bit-identical to ggml and gguf-py.

_REGISTRY: dict[GGMLType, type[QuantType]] = {}


def _f16(raw: np.ndarray) -> np.ndarray:
    """(nblocks, 2) uint8 little-endian fp16 -> (nblocks, 1) float32."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _high_bits(bits: np.ndarray, n: int) -> np.ndarray:
    """Bit (e // 32) of bits[e % 32], for e in range(n): the Q3_K/Q5_K high-bit layout."""
    shifts = np.arange(n // 32, dtype=np.uint8).reshape(1, -1, 1)
    return ((bits[:, None, :] >> shifts) & 1).reshape(len(bits), n)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Split groups of `width` bytes into their low then high nibbles: the 4-bit layout."""
    nb = len(qs)
    q = qs.reshape(nb, -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(nb, -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins packed into 12 bytes."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


class QuantType:
    """One GGML block format. Subclasses register themselves by `ggml_type`."""

    ggml_type: GGMLType
    block_size: int
    type_size: int
    vec_dot_type: GGMLType
    has_block_min = False  # Q4_1/Q5_1: value = d*q + m, with the Q8_1 `s` term in llama.cpp
    is_weight_format = True  # False for Q8_1/Q8_K: ggml only uses them for activations

    def __init_subclass__(cls, *, ggml_type: GGMLType, vec_dot_type: GGMLType, **kw):
        super().__init_subclass__(**kw)
        cls.ggml_type, cls.vec_dot_type = ggml_type, vec_dot_type
        cls.block_size, cls.type_size = GGML_BLOCK_SIZES[ggml_type]
        _REGISTRY[ggml_type] = cls

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        """(nblocks, type_size) uint8 -> (nblocks * block_size,) float32."""
        scaled, offsets = cls.dequantize_parts(blocks)
        if offsets is None:
            return scaled.reshape(-1)
        nb, groups = offsets.shape
        return (scaled.reshape(nb, groups, -1) + offsets[:, :, None]).reshape(-1)

    @classmethod
    def dequantize_parts(cls, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The two terms of each value: (nblocks, block_size) scaled quants d*q, and for types
        with a min (nblocks, groups) offsets added to each equal group (Q4_1/Q5_1: +m per block;
        Q2_K/Q4_K/Q5_K: -dmin*m per sub-block), else None. value = scaled + offset."""
        raise NotImplementedError


class F32(QuantType, ggml_type=GGMLType.F32, vec_dot_type=GGMLType.F32):
    @classmethod
    def dequantize_parts(cls, blocks):
        return np.ascontiguousarray(blocks).view("<f4").astype(np.float32), None


class F16(QuantType, ggml_type=GGMLType.F16, vec_dot_type=GGMLType.F16):
    @classmethod
    def dequantize_parts(cls, blocks):
        return _f16(blocks), None


class BF16(QuantType, ggml_type=GGMLType.BF16, vec_dot_type=GGMLType.BF16):
    @classmethod
    def dequantize_parts(cls, blocks):
        bits = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32), None


class Q4_0(QuantType, ggml_type=GGMLType.Q4_0, vec_dot_type=GGMLType.Q8_0):
    @classmethod
    def dequantize_parts(cls, blocks):
        q = _nibbles(blocks[:, 2:], 16).astype(np.int8) - np.int8(8)
        return _f16(blocks[:, :2]) * q.astype(np.float32), None


class Q4_1(QuantType, ggml_type=GGMLType.Q4_1, vec_dot_type=GGMLType.Q8_1):
    has_block_min = True

    @classmethod
    def dequantize_parts(cls, blocks):
        q = _nibbles(blocks[:, 4:], 16).astype(np.float32)
        return _f16(blocks[:, :2]) * q, _f16(blocks[:, 2:4])


class Q5_0(QuantType, ggml_type=GGMLType.Q5_0, vec_dot_type=GGMLType.Q8_0):
    @classmethod
    def dequantize_parts(cls, blocks):
        q = _nibbles(blocks[:, 6:], 16) | (np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little") << 4)
        return _f16(blocks[:, :2]) * (q.astype(np.int8) - np.int8(16)).astype(np.float32), None


class Q5_1(QuantType, ggml_type=GGMLType.Q5_1, vec_dot_type=GGMLType.Q8_1):
    has_block_min = True

    @classmethod
    def dequantize_parts(cls, blocks):
        q = _nibbles(blocks[:, 8:], 16) | (np.unpackbits(blocks[:, 4:8], axis=1, bitorder="little") << 4)
        return _f16(blocks[:, :2]) * q.astype(np.float32), _f16(blocks[:, 2:4])


class Q8_0(QuantType, ggml_type=GGMLType.Q8_0, vec_dot_type=GGMLType.Q8_0):
    @classmethod
    def dequantize_parts(cls, blocks):
        q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)
        return q * _f16(blocks[:, :2]), None


class Q8_1(QuantType, ggml_type=GGMLType.Q8_1, vec_dot_type=GGMLType.Q8_1):
    # activation-only format (d, s = d * sum(q), 32 x int8); never stored in model files
    is_weight_format = False

    @classmethod
    def dequantize_parts(cls, blocks):
        q = np.ascontiguousarray(blocks[:, 4:]).view(np.int8).astype(np.float32)
        return q * _f16(blocks[:, :2]), None


class Q2_K(QuantType, ggml_type=GGMLType.Q2_K, vec_dot_type=GGMLType.Q8_K):
    # scales[16] (low nibble scale, high nibble min), qs[64] (2-bit), d, dmin
    @classmethod
    def dequantize_parts(cls, blocks):
        nb, sc = len(blocks), blocks[:, :16]
        q = blocks[:, 16:80].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        q = (q & 3).reshape(nb, 16, 16).astype(np.float32)
        dl = (_f16(blocks[:, 80:82]) * (sc & 0x0F).astype(np.float32))[:, :, None]
        ml = _f16(blocks[:, 82:84]) * (sc >> 4).astype(np.float32)
        return (dl * q).reshape(nb, QK_K), -ml


class Q3_K(QuantType, ggml_type=GGMLType.Q3_K, vec_dot_type=GGMLType.Q8_K):
    # hmask[32], qs[64] (low 2 bits), scales[12] (16 x 6-bit, offset 32), d
    @classmethod
    def dequantize_parts(cls, blocks):
        nb, sc = len(blocks), blocks[:, 96:108]
        i = np.arange(16)
        low = (sc[:, i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 0x0F
        high = (sc[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
        scales = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
        dl = (_f16(blocks[:, 108:110]) * scales)[:, :, None]
        q = blocks[:, 32:96].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        # a cleared hmask bit means "subtract 4"
        q = (q & 3).reshape(nb, QK_K).astype(np.int8) - ((1 - _high_bits(blocks[:, :32], QK_K)) << 2).astype(np.int8)
        return (dl * q.reshape(nb, 16, 16).astype(np.float32)).reshape(nb, QK_K), None


class Q4_K(QuantType, ggml_type=GGMLType.Q4_K, vec_dot_type=GGMLType.Q8_K):
    # d, dmin, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128]
    @classmethod
    def dequantize_parts(cls, blocks):
        nb = len(blocks)
        sc, mn = _k_scale_min(blocks[:, 4:16])
        d1 = (_f16(blocks[:, 0:2]) * sc)[:, :, None]
        q = _nibbles(blocks[:, 16:], 32).reshape(nb, 8, 32).astype(np.float32)
        return (d1 * q).reshape(nb, QK_K), -(_f16(blocks[:, 2:4]) * mn)


class Q5_K(QuantType, ggml_type=GGMLType.Q5_K, vec_dot_type=GGMLType.Q8_K):
    # d, dmin, scales[12], qh[32] (5th bits), qs[128]
    @classmethod
    def dequantize_parts(cls, blocks):
        nb = len(blocks)
        sc, mn = _k_scale_min(blocks[:, 4:16])
        d1 = (_f16(blocks[:, 0:2]) * sc)[:, :, None]
        q = _nibbles(blocks[:, 48:], 32) | (_high_bits(blocks[:, 16:48], QK_K) << 4)
        return (d1 * q.reshape(nb, 8, 32).astype(np.float32)).reshape(nb, QK_K), -(_f16(blocks[:, 2:4]) * mn)


class Q6_K(QuantType, ggml_type=GGMLType.Q6_K, vec_dot_type=GGMLType.Q8_K):
    # ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d
    @classmethod
    def dequantize_parts(cls, blocks):
        nb = len(blocks)
        low = _nibbles(blocks[:, :128], 64).reshape(nb, 2, 128)
        qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        q = (low | ((qh & 3).reshape(nb, 2, 128) << 4)).astype(np.int8) - np.int8(32)
        scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        d = (_f16(blocks[:, 208:210]) * scales)[:, :, None]
        return (d * q.reshape(nb, 16, 16).astype(np.float32)).reshape(nb, QK_K), None


class Q8_K(QuantType, ggml_type=GGMLType.Q8_K, vec_dot_type=GGMLType.Q8_K):
    # activation-only format: f32 d, 256 x int8, 16 x int16 group sums
    is_weight_format = False

    @classmethod
    def dequantize_parts(cls, blocks):
        d = np.ascontiguousarray(blocks[:, :4]).view("<f4")
        return np.ascontiguousarray(blocks[:, 4:260]).view(np.int8).astype(np.float32) * d, None


def quant_type(ggml_type: GGMLType | int, tensor_name: str = "?") -> type[QuantType]:
    """The codec for `ggml_type`, or UnsupportedQuantError naming the tensor and the type."""
    t = ggml_type_of(int(ggml_type), tensor_name)
    if t not in _REGISTRY:
        known = ", ".join(k.name for k, v in _REGISTRY.items() if v.is_weight_format)
        raise UnsupportedQuantError(
            f"tensor {tensor_name!r} is {t.name}, which ntx cannot decode (supported: {known}); "
            "re-quantize the model to one of those (e.g. Q4_K_M or Q8_0 with llama-quantize)"
        )
    return _REGISTRY[t]


_CHUNK_BLOCKS = 1 << 14  # bounds the float32 temporaries of one dequantize step (~16 MB)


def as_blocks(raw: np.ndarray | memoryview, qt: type[QuantType], shape: tuple[int, ...],
               name: str) -> np.ndarray:
    data = np.frombuffer(raw, np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
    data = data.view(np.uint8)
    if not shape or shape[-1] % qt.block_size:
        raise GGUFError(f"tensor {name!r}: rows of shape {shape} are not whole "
                        f"{qt.ggml_type.name} blocks of {qt.block_size}")
    expected = tensor_nbytes(qt.ggml_type, math.prod(shape))
    if data.size != expected:
        raise GGUFError(f"tensor {name!r}: {data.size} bytes for {qt.ggml_type.name} {shape}, "
                        f"expected {expected}: the file is corrupt")
    return data.reshape(-1, qt.type_size)


def dequantize_into(qt: type[QuantType], blocks: np.ndarray, out: np.ndarray,
                     mins: np.ndarray | None = None) -> None:
    """Fill out (nblocks * block_size,) with full values; with `mins` (nblocks,) given, a
    has_block_min type leaves its per-block min out of `out` and writes it there instead."""
    bs = qt.block_size
    for i in range(0, len(blocks), _CHUNK_BLOCKS):
        chunk = blocks[i:i + _CHUNK_BLOCKS]
        if mins is not None:
            scaled, m = qt.dequantize_parts(chunk)
            mins[i:i + len(chunk)] = m[:, 0]
            out[i * bs:(i + len(chunk)) * bs] = scaled.reshape(-1)
        else:
            out[i * bs:(i + len(chunk)) * bs] = qt.dequantize_blocks(chunk)


def dequantize(raw: np.ndarray | memoryview, ggml_type: GGMLType | int, shape: tuple[int, ...],
               name: str = "?") -> np.ndarray:
    """Tensor bytes -> float32 array of numpy `shape` (last axis contiguous, whole blocks)."""
    qt = quant_type(ggml_type, name)
    blocks = as_blocks(raw, qt, tuple(shape), name)
    out = np.empty(math.prod(shape), np.float32)
    dequantize_into(qt, blocks, out)
    return out.reshape(shape)
