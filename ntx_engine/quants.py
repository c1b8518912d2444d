"""GGML tensor types: the id enum, the block-size table and per-type numpy codecs.

The ids and block layouts follow ggml (`ggml.h` / `ggml-common.h`) of the llama.cpp vendored in
llama-cpp-python 0.3.36. Sizes are ggml's, not gguf-py's: gguf-py 0.19 still lists Q8_1 as 40
bytes (float d and s), ggml has stored both as fp16 (36 bytes) for a long time.
"""
from __future__ import annotations

from enum import IntEnum

from ntx_common.errors import GGUFError

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
