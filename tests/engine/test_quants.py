"""ntx_engine.quants dequantization: bit-exact against gguf-py and against ggml's own to_float."""
from __future__ import annotations

import numpy as np
import pytest

from ntx_common.errors import GGUFError, UnsupportedQuantError
from ntx_engine.gguf import GGUFFile
from ntx_engine.matmul import MatmulWeight
from ntx_engine.quants import GGML_BLOCK_SIZES, GGMLType, dequantize, quant_type

gguf = pytest.importorskip("gguf", reason="gguf-py is the oracle: install .[test]")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

SUPPORTED = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# byte offsets of the fp16 scales inside each block (d, and m/dmin where present)
_FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(name: str, n_blocks: int, seed: int) -> np.ndarray:
    """Uniformly random block bytes with every fp16 scale finite; F32/F16/BF16 as finite
    random values across their whole exponent range."""
    rng = np.random.default_rng(seed)
    _, size = GGML_BLOCK_SIZES[GGMLType[name]]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if name in ("F32", "F16", "BF16"):
        dtype = {"F32": "<u4", "F16": "<u2", "BF16": "<u2"}[name]
        exp_mask = {"F32": 0x7F800000, "F16": 0x7C00, "BF16": 0x7F80}[name]
        bits = raw.view(dtype)
        bits[(bits & exp_mask) == exp_mask] &= ~np.array(1 << (exp_mask.bit_length() - 1), dtype)
        return raw
    for off in _FP16_FIELDS[name]:
        hi = raw[:, off + 1]
        raw[(hi & 0x7C) == 0x7C, off + 1] &= 0xFB  # exponent 31 -> 30: finite, still huge
    return raw


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).reshape(-1).view(np.uint32)


def test_block_table_matches_ggml_and_gguf_py():
    from ggml_ref import ggml

    g = ggml()
    for t in GGMLType:
        assert GGML_BLOCK_SIZES[t] == g.block(int(t)), t.name
        assert g.type_name(int(t)).upper() == t.name
        # gguf-py 0.19 still has the old 40-byte Q8_1 (float d and s) and no Q2_0
        if t not in (GGMLType.Q8_1, GGMLType.Q2_0):
            assert GGML_BLOCK_SIZES[t] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))]
    # every id ggml knows up to our largest is either ours or a removed/deprecated type
    for i in range(max(GGMLType) + 1):
        if i not in GGMLType._value2member_map_:
            assert g.block(i)[0] == 0 or "REMOVED" in g.type_name(i), i


@pytest.mark.parametrize("name", SUPPORTED)
def test_random_blocks_match_gguf_py_and_ggml(name):
    from ggml_ref import ggml

    qt = quant_type(GGMLType[name])
    raw = random_blocks(name, 4096 if qt.block_size > 1 else 65536, seed=SUPPORTED.index(name))
    n = len(raw) * qt.block_size
    ours = dequantize(raw, GGMLType[name], (n,))
    assert ours.dtype == np.float32 and ours.shape == (n,)
    ref = gguf_dequantize(raw.reshape(-1), gguf.GGMLQuantizationType[name])
    np.testing.assert_array_equal(_bits(ours), _bits(ref))
    np.testing.assert_array_equal(_bits(ours), _bits(ggml().to_float(int(qt.ggml_type), raw, n)))
    np.testing.assert_array_equal(_bits(qt.dequantize_blocks(raw)), _bits(ref))


@pytest.mark.parametrize("name", [n for n in SUPPORTED if n in _FP16_FIELDS])
def test_edge_scales_match_gguf_py(name):
    # zero, negative zero, subnormal and largest finite fp16 scales
    raw = random_blocks(name, 64, seed=99)
    for i, scale in enumerate([0x0000, 0x8000, 0x0001, 0x03FF, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00]):
        for off in _FP16_FIELDS[name]:
            raw[i * 8:(i + 1) * 8, off:off + 2] = np.array([scale & 0xFF, scale >> 8], np.uint8)
    qt = quant_type(GGMLType[name])
    ours = dequantize(raw, GGMLType[name], (len(raw), qt.block_size))
    ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[name])
    np.testing.assert_array_equal(_bits(ours), _bits(ref))


def _check_file(path) -> set[str]:
    seen = set()
    with GGUFFile.open(path) as f:
        for name, info in f.tensors.items():
            if info.ggml_type.name not in SUPPORTED:
                continue  # the fixture script may add other types; their error is tested below
            raw = f.tensor_data(name)
            ours = dequantize(raw, info.ggml_type, info.shape, name)
            assert ours.shape == info.shape
            rows = raw.reshape(*info.shape[:-1], -1) if len(info.shape) > 1 else raw
            ref = gguf_dequantize(rows, gguf.GGMLQuantizationType(int(info.ggml_type)))
            np.testing.assert_array_equal(_bits(ours), _bits(ref), err_msg=f"{path.name}:{name}")
            seen.add(info.ggml_type.name)
    return seen


def test_every_tensor_of_smollm2_matches_gguf_py(smollm2_path):
    assert _check_file(smollm2_path) == {"F32", "Q8_0", "Q4_1"}


@pytest.mark.slow
def test_every_tensor_of_every_real_model_matches_gguf_py(real_gguf_paths):
    seen = {"F32", "Q8_0", "Q4_1"}  # the shipped file, checked by the test above
    for path in real_gguf_paths[1:]:
        seen |= _check_file(path)
    # llama.cpp's K-quant fallbacks leave Q2_K out of SmolLM2 variants; random blocks cover it
    assert set(SUPPORTED) - {"Q2_K"} <= seen


def test_unsupported_type_names_tensor_and_type():
    with pytest.raises(UnsupportedQuantError, match=r"'blk\.3\.ffn_up\.weight' is IQ2_XXS"):
        quant_type(GGMLType.IQ2_XXS, "blk.3.ffn_up.weight")
    with pytest.raises(GGUFError, match="'w' has unknown GGML type id 77"):
        quant_type(77, "w")


def test_unsupported_type_in_a_real_file(tmp_path, smollm2_path):
    # llama.cpp makes a real file with a type we do not decode (Q2_0, ~1 s to quantize)
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = 41, True, 2  # LLAMA_FTYPE_MOSTLY_Q2_0
    out = tmp_path / "q2_0.gguf"
    assert llama_cpp.llama_model_quantize(str(smollm2_path).encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    with GGUFFile.open(out) as f:
        name, info = next((n, t) for n, t in f.tensors.items() if t.ggml_type == GGMLType.Q2_0)
        with pytest.raises(UnsupportedQuantError, match=f"'{name}' is Q2_0"):
            dequantize(f.tensor_data(name), info.ggml_type, info.shape, name)
        with pytest.raises(UnsupportedQuantError, match=f"'{name}' is Q2_0"):
            MatmulWeight.from_raw(f.tensor_data(name), info.ggml_type, info.shape, name)


def test_wrong_byte_count_is_gguf_error():
    raw = random_blocks("Q4_0", 4, seed=1)
    with pytest.raises(GGUFError, match="'t': 72 bytes for Q4_0 \\(2, 32\\), expected 36"):
        dequantize(raw, GGMLType.Q4_0, (2, 32), "t")
    with pytest.raises(GGUFError, match="not whole Q4_0 blocks"):
        dequantize(raw, GGMLType.Q4_0, (4, 36), "t")


def test_activation_formats_are_not_weights():
    raw = np.zeros((1, GGML_BLOCK_SIZES[GGMLType.Q8_K][1]), np.uint8)
    with pytest.raises(UnsupportedQuantError, match="activation format"):
        MatmulWeight.from_raw(raw, GGMLType.Q8_K, (1, 256), "x")
