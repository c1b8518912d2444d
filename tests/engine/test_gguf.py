"""ntx_engine.gguf against gguf-py's GGUFReader (the reference reader) and the file's bytes."""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from ntx_common.errors import GGUFError
from ntx_engine.gguf import GGUFArray, GGUFFile, GGUFValueType
from ntx_engine.quants import GGMLType

gguf = pytest.importorskip("gguf", reason="gguf-py is the oracle: install .[test]")

_READERS: dict = {}


def _reader(path, keep: bool = False):
    # GGUFReader materialises every array (seconds per file): keep the shipped model's open.
    if path in _READERS:
        return _READERS[path]
    reader = gguf.GGUFReader(path)
    if keep:
        _READERS[path] = reader
    return reader


def _check_field(ours: GGUFFile, field) -> None:
    key = field.name
    assert ours.value_types[key] == field.types[0], key
    value = ours.metadata[key]
    if field.types[0] != GGUFValueType.ARRAY:
        assert value == field.contents(), key
        assert type(value) is type(field.contents()), key
        return
    assert isinstance(value, GGUFArray)
    assert value.element_type == field.types[1], key
    if field.types[1] == GGUFValueType.ARRAY:
        flat = [x for sub in value for x in sub.tolist()]  # gguf-py flattens nested arrays
        assert flat == field.contents(), key
    elif field.types[1] == GGUFValueType.STRING:
        assert value.tolist() == field.contents(), key
        assert len(value) == len(field.data)
    else:
        expected = np.concatenate([field.parts[i] for i in field.data]) if field.data else []
        if field.types[1] == GGUFValueType.BOOL:
            expected = np.asarray(expected) != 0
        np.testing.assert_array_equal(value.to_numpy(), expected, err_msg=key)
        assert value.tolist() == field.contents(), key


def _check_against_reader(path, keep: bool = False) -> None:
    reader = _reader(path, keep)
    with GGUFFile.open(path) as ours:
        header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
        fields = [f for f in reader.fields.values() if f.name not in header]
        assert list(ours.metadata) == [f.name for f in fields]
        assert ours.version == reader.fields["GGUF.version"].contents()
        for field in fields:
            _check_field(ours, field)
        assert ours.alignment == reader.alignment
        assert ours.data_offset == reader.data_offset
        assert list(ours.tensors) == [t.name for t in reader.tensors]
        for ref in reader.tensors:
            info = ours.tensors[ref.name]
            assert info.dims == tuple(int(d) for d in ref.shape)
            assert info.shape == tuple(reversed(info.dims))
            assert info.ggml_type == GGMLType(int(ref.tensor_type))
            assert info.offset == ref.data_offset
            assert info.n_elements == ref.n_elements
            assert info.nbytes == ref.n_bytes
            data = ours.tensor_data(ref.name)
            assert data.dtype == np.uint8 and data.shape == (info.nbytes,)
            assert np.array_equal(data, ref.data.reshape(-1).view(np.uint8))


def test_smollm2_matches_gguf_py(smollm2_path):
    _check_against_reader(smollm2_path, keep=True)


@pytest.mark.slow
def test_every_real_file_matches_gguf_py(real_gguf_paths):
    for path in real_gguf_paths[1:]:
        _check_against_reader(path)


def test_small_file_every_value_type_matches_gguf_py(small_gguf):
    _check_against_reader(small_gguf)


def test_custom_alignment_matches_gguf_py(tmp_path, make_small_gguf):
    path = make_small_gguf(tmp_path / "aligned.gguf", alignment=64)
    _check_against_reader(path)
    with GGUFFile.open(path) as f:
        assert f.alignment == 64
        assert all(t.offset % 64 == 0 for t in f.tensors.values())


def test_version_2_reads_like_version_3(small_gguf, tmp_path):
    raw = bytearray(small_gguf.read_bytes())
    raw[4:8] = (2).to_bytes(4, "little")  # v2 and v3 share the little-endian layout
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(raw)
    with GGUFFile.open(small_gguf) as a, GGUFFile.open(v2) as b:
        assert (a.version, b.version) == (3, 2)
        assert a.tensors == b.tensors
        assert list(a.metadata) == list(b.metadata)


def test_tensor_data_is_the_files_bytes(smollm2_path):
    with GGUFFile.open(smollm2_path) as f, open(smollm2_path, "rb") as raw:
        for name in ["token_embd.weight", "blk.0.attn_norm.weight", list(f.tensors)[-1]]:
            info = f.tensors[name]
            raw.seek(info.offset)
            assert f.tensor_data(name).tobytes() == raw.read(info.nbytes)
        last = max(f.tensors.values(), key=lambda t: t.end)
        assert last.end <= f.file_size == smollm2_path.stat().st_size


def test_array_access(small_gguf):
    with GGUFFile.open(small_gguf) as f:
        strs = f.metadata["t.strs"]
        assert len(strs) == 4 and strs[2] == "ü ✓" and strs[-1] == "Ġthe"
        assert strs[1:3] == ["", "ü ✓"] and list(strs) == strs.tolist()
        with pytest.raises(IndexError):
            strs[4]
        with pytest.raises(GGUFError, match="t.strs.*tolist"):
            strs.to_numpy()
        ints = f.metadata["t.ints"]
        assert ints.to_numpy().dtype == np.int32 and ints[-1] == 3
        assert f.metadata["t.bools"].to_numpy().tolist() == [True, False, True]
        assert [sub.tolist() for sub in f.metadata["t.nested"]] == [[1, 2], [3]]
        assert f.get("t.u8") == 200 and f.get("missing", 7) == 7


def test_tensor_views_outlive_close(small_gguf):
    f = GGUFFile.open(small_gguf)
    view = f.tensor_data("a.weight")
    expected = view.copy()
    f.close()
    assert np.array_equal(view, expected)
    with pytest.raises(GGUFError, match="closed"):
        f.tensor_data("a.weight")


def test_unknown_tensor_name_is_gguf_error(small_gguf):
    with GGUFFile.open(small_gguf) as f, pytest.raises(GGUFError, match="no tensor named 'nope'"):
        f.tensor_data("nope")


def test_open_keeps_vocab_lazy(smollm2_path):
    # Turning the 49k tokens + 49k merges into str objects would allocate well over 6 MB;
    # the lazy reader keeps only two int64 offset tables per string array (~1.6 MB).
    start = time.perf_counter()
    GGUFFile.open(smollm2_path).close()
    elapsed = time.perf_counter() - start  # reported, not asserted: see scripts/bench_gguf_open.py
    tracemalloc.start()
    f = GGUFFile.open(smollm2_path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"\nGGUFFile.open({smollm2_path.name}): {elapsed * 1000:.1f} ms, "
          f"peak traced allocation {peak / 1e6:.2f} MB")
    assert peak < 4e6
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[0] == "<|endoftext|>"
    f.close()
