"""Malformed GGUF files: every defect is a GGUFError with a clear message, never anything else.

The valid starting point is written by gguf-py's GGUFWriter (conftest.write_small_gguf); the
defects are byte patches at fields located by searching for their unique names.
"""
from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ntx_common.errors import GGUFError
from ntx_engine.gguf import GGUFArray, GGUFFile
from ntx_engine.quants import dequantize

U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")


class Patchable:
    """A valid small GGUF as a bytearray, with helpers to find and overwrite its fields."""

    def __init__(self, raw: bytes):
        self.raw = bytearray(raw)

    def find(self, needle: bytes) -> int:
        pos = self.raw.find(needle)
        assert pos >= 0 and self.raw.find(needle, pos + 1) < 0, needle
        return pos

    def after_key(self, key: str) -> int:
        """Offset of the value-type u32 that follows metadata `key`."""
        encoded = U64.pack(len(key)) + key.encode()  # with its length: t.str is not t.strs
        return self.find(encoded) + len(encoded)

    def tensor_fields(self, name: str) -> dict[str, int]:
        """Offsets of the fields of tensor info `name` (n_dims, dims[0], type, offset)."""
        pos = self.find(name.encode()) + len(name)
        n_dims = U32.unpack_from(self.raw, pos)[0]
        dims = pos + 4
        return {"n_dims": pos, "dims": dims, "type": dims + 8 * n_dims,
                "offset": dims + 8 * n_dims + 4}

    def put(self, fmt: struct.Struct, pos: int, value: int) -> Patchable:
        fmt.pack_into(self.raw, pos, value)
        return self

    def save(self, path: Path) -> Path:
        path.write_bytes(bytes(self.raw))
        return path


@pytest.fixture
def small(small_gguf) -> Patchable:
    return Patchable(small_gguf.read_bytes())


def _open_error(path: Path) -> str:
    with pytest.raises(GGUFError) as info:
        GGUFFile.open(path)
    message = str(info.value)
    assert str(path) in message or "GGUF" in message
    return message


def test_bad_magic(small, tmp_path):
    small.raw[0:4] = b"GGML"
    assert "not a GGUF file (magic b'GGML'" in _open_error(small.save(tmp_path / "x.gguf"))


@pytest.mark.parametrize("version, expected", [
    (1, "GGUF v1 files are not supported"),
    (4, "unsupported GGUF version 4: supported versions are 2 and 3"),
    (0x03000000, "big-endian GGUF"),
])
def test_unsupported_version(small, tmp_path, version, expected):
    small.put(U32, 4, version)
    assert expected in _open_error(small.save(tmp_path / "x.gguf"))


def test_every_truncation_is_an_error(small, tmp_path):
    with GGUFFile.open(small.save(tmp_path / "full.gguf")) as f:
        last_end = max(t.end for t in f.tensors.values())
    path = tmp_path / "cut.gguf"
    for size in range(0, last_end):
        path.write_bytes(bytes(small.raw[:size]))
        message = _open_error(path)
        assert any(s in message for s in ("truncated", "past the end")), (size, message)


def test_empty_missing_and_directory(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "shorter than a GGUF header" in _open_error(tmp_path / "empty.gguf")
    assert "cannot open GGUF file" in _open_error(tmp_path / "missing.gguf")
    assert "cannot open GGUF file" in _open_error(tmp_path)


@pytest.mark.parametrize("field, value", [(8, 2**64 - 1), (8, 2**32), (16, 2**63), (16, 10**6)])
def test_overflowing_header_counts(small, tmp_path, field, value):
    small.put(U64, field, value)
    assert f"claims {value} entries" in _open_error(small.save(tmp_path / "x.gguf"))


def test_overflowing_array_count(small, tmp_path):
    pos = small.after_key("t.strs") + 4 + 4  # value type ARRAY, element type STRING, count
    small.put(U64, pos, 2**61)
    assert "array 't.strs' claims 2305843009213693952 entries" in _open_error(small.save(tmp_path / "x.gguf"))


def test_string_longer_than_file(small, tmp_path):
    small.put(U64, small.after_key("t.str") + 4, 2**40)
    assert "truncated" in _open_error(small.save(tmp_path / "x.gguf"))


def test_key_length_overflow(small, tmp_path):
    small.put(U64, 24, 2**64 - 1)  # length of the first key
    assert "truncated at byte 32 while reading metadata key #0" in _open_error(
        small.save(tmp_path / "x.gguf"))


def test_too_many_dims(small, tmp_path):
    small.put(U32, small.tensor_fields("a.weight")["n_dims"], 5)
    assert "'a.weight' has 5 dimensions" in _open_error(small.save(tmp_path / "x.gguf"))


def test_dims_overflow(small, tmp_path):
    fields = small.tensor_fields("a.weight")
    small.put(U64, fields["dims"], 2**40).put(U64, fields["dims"] + 8, 2**40)
    assert "overflow 64-bit element counts" in _open_error(small.save(tmp_path / "x.gguf"))


def test_duplicate_tensor_names(small, tmp_path):
    small.raw[small.find(b"b.weight")] = ord("a")
    assert "duplicate tensor name 'a.weight'" in _open_error(small.save(tmp_path / "x.gguf"))


def test_duplicate_metadata_keys(small, tmp_path):
    pos = small.find(b"t.i8\x01")  # key t.i8 then its INT8 value type
    small.raw[pos:pos + 4] = b"t.u8"
    assert "duplicate metadata key 't.u8'" in _open_error(small.save(tmp_path / "x.gguf"))


def test_unknown_tensor_type(small, tmp_path):
    small.put(U32, small.tensor_fields("b.weight")["type"], 99)
    assert "'b.weight' has unknown GGML type id 99" in _open_error(small.save(tmp_path / "x.gguf"))


def test_unknown_value_type(small, tmp_path):
    small.put(U32, small.after_key("t.u16"), 13)
    assert "'t.u16' has unknown value type 13" in _open_error(small.save(tmp_path / "x.gguf"))


def test_misaligned_tensor_data(small, tmp_path):
    pos = small.tensor_fields("b.weight")["offset"]
    small.put(U64, pos, U64.unpack_from(small.raw, pos)[0] + 1)
    assert "'b.weight' data offset 129 is not aligned to 32 bytes" in _open_error(
        small.save(tmp_path / "x.gguf"))


def test_tensor_past_end(small, tmp_path):
    small.put(U64, small.tensor_fields("c.weight")["offset"], 2**50)
    assert "'c.weight' bytes" in _open_error(small.save(tmp_path / "x.gguf"))


def test_overlapping_tensors(small, tmp_path):
    small.put(U64, small.tensor_fields("c.weight")["offset"], 0)
    assert "overlap" in _open_error(small.save(tmp_path / "x.gguf"))


def test_row_not_whole_blocks(small, tmp_path):
    small.put(U64, small.tensor_fields("b.weight")["dims"], 33)
    assert "row length 33 is not a multiple of the Q8_0 block size 32" in _open_error(
        small.save(tmp_path / "x.gguf"))


def test_invalid_utf8_key(small, tmp_path):
    small.raw[small.after_key("t.bool") - 6] = 0xFF
    assert "is not valid UTF-8" in _open_error(small.save(tmp_path / "x.gguf"))


@pytest.mark.parametrize("patch, expected", [("value", "power-of-two UINT32, got 48"),
                                             ("type", "power-of-two UINT32, got 64")])
def test_bad_alignment(tmp_path, make_small_gguf, patch, expected):
    p = Patchable(make_small_gguf(tmp_path / "a.gguf", alignment=64).read_bytes())
    pos = p.after_key("general.alignment")
    if patch == "value":
        p.put(U32, pos + 4, 48)
    else:
        p.put(U32, pos, 5)  # INT32 instead of UINT32
    assert expected in _open_error(p.save(tmp_path / "x.gguf"))


def _nested_array_file(depth: int) -> bytes:
    body = b""
    for _ in range(depth):
        body = U32.pack(9) + U64.pack(1) + body  # ARRAY of 1 ARRAY of ...
    body += U32.pack(4) + U64.pack(0)  # innermost: empty UINT32 array
    key = b"deep"
    return (b"GGUF" + U32.pack(3) + U64.pack(0) + U64.pack(1) + U64.pack(len(key)) + key
            + U32.pack(9) + body)


def test_deeply_nested_arrays(tmp_path):
    path = tmp_path / "deep.gguf"
    path.write_bytes(_nested_array_file(3))
    with GGUFFile.open(path) as f:
        assert f.metadata["deep"][0][0][0].tolist() == []
    path.write_bytes(_nested_array_file(5000))
    assert "nests arrays more than 8 deep" in _open_error(path)


# -- fuzzing ------------------------------------------------------------------------------

INTERESTING_U64 = [0, 1, 7, 31, 32, 33, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


def _exercise(path: Path) -> None:
    """Open and touch everything a model loader would; only GGUFError may escape."""
    with GGUFFile.open(path) as f:
        for value in f.metadata.values():
            if isinstance(value, GGUFArray):
                _touch_array(value)
        for name, info in f.tensors.items():
            data = f.tensor_data(name)
            assert data.size == info.nbytes
            dequantize(data, info.ggml_type, info.shape, name)


def _touch_array(arr: GGUFArray) -> None:
    items = arr.tolist()
    assert len(items) == len(arr)
    for item in items:
        if isinstance(item, GGUFArray):
            _touch_array(item)
    try:
        arr.to_numpy()
    except GGUFError:
        pass  # string and nested arrays refuse to_numpy


mutation = st.one_of(
    st.tuples(st.just("byte"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("u64"), st.integers(0, 10**6), st.sampled_from(INTERESTING_U64)),
    st.tuples(st.just("u32"), st.integers(0, 10**6), st.sampled_from([0, 1, 4, 9, 13, 99, 2**32 - 1])),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(mutation, min_size=1, max_size=4))
def test_fuzzed_headers_raise_only_gguf_error(small_gguf_bytes, mutations):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "small.gguf").write_bytes(small_gguf_bytes)
        with GGUFFile.open(Path(tmp) / "small.gguf") as f:
            header_end = f.data_offset  # mutate the header: that is where the parsing is
        raw = bytearray(small_gguf_bytes)
        for kind, pos, value in mutations:
            if not raw:
                break
            pos %= min(header_end, len(raw))
            if kind == "byte":
                raw[pos] = value
            elif kind == "u64" and pos + 8 <= len(raw):
                U64.pack_into(raw, pos, value)
            elif kind == "u32" and pos + 4 <= len(raw):
                U32.pack_into(raw, pos, value)
            elif kind == "cut":
                del raw[pos:]
        path = Path(tmp) / "fuzzed.gguf"
        path.write_bytes(bytes(raw))
        try:
            _exercise(path)
        except GGUFError:
            pass


def test_invalid_utf8_in_string_array_names_the_entry(small, tmp_path):
    small.raw[small.find("Ġthe".encode())] = 0xFF  # opening stays lazy: access fails
    with GGUFFile.open(small.save(tmp_path / "x.gguf")) as f:
        strs = f.metadata["t.strs"]
        assert strs[0] == "a"
        with pytest.raises(GGUFError, match=r"'t.strs'\[3\] is not valid UTF-8"):
            strs.tolist()
        with pytest.raises(GGUFError, match=r"'t.strs'\[3\] is not valid UTF-8"):
            strs[3]


def test_empty_tensor_with_an_absurd_dimension_is_refused(tmp_path):
    """Found by the fuzzer: dims (2^61, 0) hold no bytes, yet no array can have that shape. The
    reader refuses the file by name instead of leaving numpy to fail later."""
    name = b"b.weight"
    info = (U64.pack(len(name)) + name + U32.pack(2) + U64.pack(2**61) + U64.pack(0)
            + U32.pack(8) + U64.pack(0))  # Q8_0 (rows of 2^61 are whole blocks), offset 0
    body = b"GGUF" + U32.pack(3) + U64.pack(1) + U64.pack(0) + info
    path = tmp_path / "absurd.gguf"
    path.write_bytes(body + bytes(-len(body) % 32))
    assert "b.weight" in _open_error(path) and "overflow" in _open_error(path)
