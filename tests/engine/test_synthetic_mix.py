"""scripts/make_synthetic_model.py's "q4_k_m_lcpp" and "q5_k_m_lcpp" mixes are the type mixes llama.cpp's own quantizer
gives a Llama model for Q4_K_M and Q5_K_M (the oracle: llama_model_quantize on an F16 synthetic model of the same shape):
Q6_K attn_v and ffn_down in the layers llama.cpp gives more bits, Q4_K (Q5_K) in the others; "q4_k_m" has Q6_K in every
layer."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from ntx_engine.gguf import GGUFFile
from ntx_engine.quants import GGMLType

LAYERS = 16  # more-bits layers 0, 1, 4, 7, 10, 13, 14, 15: both kinds, each in runs of one and of several


@pytest.fixture(scope="module")
def synth():
    import make_synthetic_model  # scripts/ (pytest's pythonpath)

    return make_synthetic_model


def _llama_cpp_quantize(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}"), 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize -> {ftype} returned {rc}"


@pytest.mark.parametrize("ftype,base", [("Q4_K_M", GGMLType.Q4_K), ("Q5_K_M", GGMLType.Q5_K)])
def test_the_lcpp_mixes_are_llama_cpps(synth, tmp_path, ftype, base):
    src, dst = tmp_path / "f16.gguf", tmp_path / f"{ftype}.gguf"
    synth.write_model(src, "tiny", "f16", LAYERS)  # rows of 256 values: no K-quant fallback
    _llama_cpp_quantize(src, dst, ftype)
    theirs = {n: t.ggml_type for n, t in GGUFFile.open(dst).tensors.items()}
    _, plan = synth.tensor_plan("tiny", LAYERS, f"{ftype.lower()}_lcpp")
    ours = {n: t for n, t, _ in plan}
    assert ours.keys() == theirs.keys()
    differ = {n: (ours[n].name, theirs[n].name) for n in ours if ours[n] != theirs[n]}
    assert not differ, f"(ours, llama.cpp's) types: {differ}"
    six = {i for i in range(LAYERS) if ours[f"blk.{i}.ffn_down.weight"] == GGMLType.Q6_K}
    assert six == {0, 1, 4, 7, 10, 13, 14, 15}  # (the rule applied, not a mix without it)
    assert all(ours[f"blk.{i}.attn_v.weight"] == ours[f"blk.{i}.ffn_down.weight"] for i in range(LAYERS))
    assert ours["blk.2.ffn_down.weight"] == ours["blk.2.attn_q.weight"] == base


def test_q4_k_m_keeps_q6_k_in_every_layer(synth):
    _, plan = synth.tensor_plan("llama3-8b", None, "q4_k_m")
    types = {n: t for n, t, _ in plan}
    assert all(types[f"blk.{i}.{m}.weight"] == GGMLType.Q6_K for i in range(32) for m in ("attn_v", "ffn_down"))
    assert all(types[f"blk.{i}.attn_q.weight"] == GGMLType.Q4_K for i in range(32))
