"""Our own memmap reader for GGUF v2 and v3 files.

Layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count,
metadata key/value pairs, tensor infos (name, n_dims, dims ne0 first, type, offset), padding to
`general.alignment`, then tensor data. Offsets in the file are relative to the data section;
`TensorInfo.offset` is absolute, because the streaming tiers and NVMe staging read by file range.

Opening only walks the header: numeric arrays are views into the map and string arrays keep just
the start of every string, so the 49k-entry vocab never becomes Python objects unless asked.
Every malformed input raises GGUFError naming the file, the byte offset and what was expected.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ntx_common.errors import GGUFError
from ntx_engine.quants import GGML_BLOCK_SIZES, GGMLType, ggml_type_of, tensor_nbytes

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # real files never nest arrays; a crafted header must not recurse forever
HEAD_READ = 8 << 20  # first read of a GGUF header from a raw device; grown until it parses
INT64_MAX = 2**63 - 1


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# numpy dtype of each fixed-size value type; BOOL is read as bytes (any non-zero is true)
_DTYPES: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# struct codes spelled out: numpy's dtype.char for <u8 is "L", which struct reads as 4 bytes
_STRUCTS = {t: struct.Struct("<" + c) for t, c in zip(_DTYPES, "BbHhIifBQqd")}
_U64 = struct.Struct("<Q")
# smallest encoding of one element: used to reject counts the rest of the file cannot hold
_MIN_SIZE = {**{t: d.itemsize for t, d in _DTYPES.items()}, GGUFValueType.STRING: 8,
             GGUFValueType.ARRAY: 12}


class GGUFArray:
    """Lazy view of a metadata array: numeric arrays are numpy views of the map, string arrays
    remember where each string starts and decode on access."""

    def __init__(self, key: str, element_type: GGUFValueType, count: int, *, data=None,
                 starts=None, lengths=None, buf=None, items=None):
        self.key = key
        self.element_type = element_type
        self._count = count
        self._data = data  # numeric: np.ndarray view
        self._starts, self._lengths, self._buf = starts, lengths, buf  # strings
        self._items = items  # nested arrays: list[GGUFArray]

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"GGUFArray({self.key!r}, {self.element_type.name}, len={self._count})"

    def _string(self, i: int) -> str:
        start, n = int(self._starts[i]), int(self._lengths[i])
        try:
            return bytes(self._buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"metadata {self.key!r}[{i}] is not valid UTF-8 ({e.reason})") from None

    def _item(self, i: int) -> Any:
        if self.element_type == GGUFValueType.STRING:
            return self._string(i)
        if self._items is not None:
            return self._items[i]
        value = self._data[i].item()
        return bool(value) if self.element_type == GGUFValueType.BOOL else value

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(self._count))]
        i = index + self._count if index < 0 else index
        if not 0 <= i < self._count:
            raise IndexError(f"metadata {self.key!r} has {self._count} entries, no index {index}")
        return self._item(i)

    def __iter__(self) -> Iterator[Any]:
        return (self._item(i) for i in range(self._count))

    def tolist(self) -> list[Any]:
        if self._data is not None:
            values = self._data.tolist()
            return [bool(v) for v in values] if self.element_type == GGUFValueType.BOOL else values
        if self.element_type == GGUFValueType.STRING and self._count:
            return self._all_strings()
        return list(self)

    def _all_strings(self) -> list[str]:
        # One copy of the whole string table, then slices of it: ~3x faster than per item.
        starts, lengths = self._starts.tolist(), self._lengths.tolist()
        base = starts[0]
        blob = bytes(self._buf[base:starts[-1] + lengths[-1]])
        try:
            return [blob[s - base:s - base + n].decode("utf-8") for s, n in zip(starts, lengths)]
        except UnicodeDecodeError:
            return list(self)  # per item, to name the entry that is not UTF-8

    def to_numpy(self) -> np.ndarray:
        """The numeric array as a read-only numpy array (bool arrays as numpy bool)."""
        if self._data is None:
            raise GGUFError(f"metadata {self.key!r} is an array of {self.element_type.name}, "
                            "not numbers: use tolist()")
        return self._data != 0 if self.element_type == GGUFValueType.BOOL else self._data


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order, ne0 (the contiguous dimension) first
    shape: tuple[int, ...]  # numpy order: reversed dims
    ggml_type: GGMLType
    offset: int  # absolute byte offset in the file
    nbytes: int
    n_elements: int

    def __post_init__(self):
        if not 1 <= len(self.dims) <= MAX_DIMS or any(d < 0 for d in self.dims):
            raise ValueError(f"tensor {self.name!r}: bad dims {self.dims}")
        if self.shape != tuple(reversed(self.dims)):
            raise ValueError(f"tensor {self.name!r}: shape {self.shape} is not dims reversed")
        if self.n_elements != math.prod(self.dims):
            raise ValueError(f"tensor {self.name!r}: n_elements {self.n_elements} != prod(dims)")
        if self.offset < 0 or self.nbytes != tensor_nbytes(self.ggml_type, self.n_elements):
            raise ValueError(f"tensor {self.name!r}: bad offset/nbytes {self.offset}/{self.nbytes}")

    @property
    def end(self) -> int:
        """Absolute offset one past the tensor's last byte."""
        return self.offset + self.nbytes


class _NeedMore(Exception):
    """The head read so far ends inside the header: read at least `upto` bytes and parse again."""

    def __init__(self, upto: int):
        super().__init__(upto)
        self.upto = upto


class _Parser:
    """Bounds-checked little-endian cursor over the mapped file."""

    def __init__(self, path: Path, buf: memoryview, size: int | None = None):
        # size: the whole file's bytes when buf holds only its head (a raw device read in pieces)
        self.path, self.buf, self.pos = path, buf, 0
        self.avail = len(buf)
        self.size = self.avail if size is None else size

    def fail(self, message: str) -> GGUFError:
        return GGUFError(f"{self.path}: {message}")

    def need(self, n: int, what: str) -> None:
        if n > self.avail - self.pos:
            if self.avail < self.size and n <= self.size - self.pos:
                raise _NeedMore(self.pos + n)
            raise self.fail(f"truncated at byte {self.pos} while reading {what} (need {n} bytes, "
                            f"file has {self.size}): the download is incomplete or the file is corrupt")

    def scalar(self, vtype: GGUFValueType, what: str) -> Any:
        st = _STRUCTS[vtype]
        self.need(st.size, what)
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return bool(value) if vtype == GGUFValueType.BOOL else value

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def raw_string(self, what: str) -> bytes:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        start, self.pos = self.pos, self.pos + n
        return bytes(self.buf[start:self.pos])

    def string(self, what: str) -> str:
        start = self.pos
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} at byte {start} is not valid UTF-8 ({e.reason})") from None

    def count(self, what: str, min_size: int) -> int:
        n = self.u64(f"count of {what}")
        if n * min_size > self.size - self.pos:
            raise self.fail(f"{what} claims {n} entries at byte {self.pos - 8}, more than the "
                            f"remaining {self.size - self.pos} bytes can hold: the file is truncated or corrupt")
        return n

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.u32(f"value type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"{what} has unknown value type {raw} at byte {self.pos - 4}") from None

    def value(self, vtype: GGUFValueType, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(f"value of {key!r}")
        if vtype == GGUFValueType.ARRAY:
            return self.array(key)
        return self.scalar(vtype, f"value of {key!r}")

    def array(self, key: str, depth: int = 0) -> GGUFArray:
        if depth > MAX_ARRAY_NESTING:
            raise self.fail(f"metadata {key!r} nests arrays more than {MAX_ARRAY_NESTING} deep")
        etype = self.value_type(f"elements of {key!r}")
        n = self.count(f"array {key!r}", _MIN_SIZE[etype])
        if etype in _DTYPES:
            dtype = _DTYPES[etype]
            self.need(n * dtype.itemsize, f"array {key!r}")
            data = np.frombuffer(self.buf, dtype, n, self.pos)
            self.pos += n * dtype.itemsize
            return GGUFArray(key, etype, n, data=data)
        if etype == GGUFValueType.ARRAY:
            items = [self.array(f"{key}[{i}]", depth + 1) for i in range(n)]
            return GGUFArray(key, etype, n, items=items)
        starts, lengths = self._string_table(key, n)
        return GGUFArray(key, etype, n, starts=starts, lengths=lengths, buf=self.buf)

    def _string_table(self, key: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        # One pass to find where each string starts; the text itself is decoded on access.
        starts = np.empty(n, np.int64)
        lengths = np.empty(n, np.int64)
        unpack, buf, pos, size = _U64.unpack_from, self.buf, self.pos, self.avail
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"length of {key!r}[{i}]")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > size - pos:
                self.pos = pos
                self.need(length, f"{key!r}[{i}]")
            starts[i], lengths[i] = pos, length
            pos += length
        self.pos = pos
        return starts, lengths


def _parse(p: _Parser) -> tuple:
    version = _read_version(p)
    n_tensors, metadata, types = _read_metadata(p)
    alignment = _alignment(p, metadata, types)
    raw = [_read_tensor_info(p, i) for i in range(n_tensors)]
    data_offset = -(-p.pos // alignment) * alignment
    tensors = _place_tensors(p, raw, data_offset, alignment)
    return version, alignment, data_offset, metadata, types, tensors


class ReaderBytes:
    """The bytes of a GGUF on a raw source, sliced like the file's memory map: `[a:b]` reads
    them through the reader into a fresh array."""

    def __init__(self, reader: Any, base_offset: int, size: int):
        self.reader, self.base_offset, self.size = reader, base_offset, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self.size)
        if step != 1:
            raise TypeError("ReaderBytes supports contiguous slices only")
        out = np.empty(max(0, stop - start), np.uint8)
        if len(out):
            self.reader.read_into(self.base_offset + start, len(out), out)
        return out


def _read_version(p: _Parser) -> int:
    p.need(8, "the GGUF header")
    magic = bytes(p.buf[:4])
    if magic != GGUF_MAGIC:
        raise p.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    p.pos = 4
    version = p.u32("the version")
    if version in SUPPORTED_VERSIONS:
        return version
    if version == 1:
        hint = "GGUF v1 files are not supported: re-convert the model with a current llama.cpp"
    elif int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
        hint = "this is a big-endian GGUF; only little-endian files are supported"
    else:
        hint = "supported versions are 2 and 3"
    raise p.fail(f"unsupported GGUF version {version}: {hint}")


def _read_metadata(p: _Parser) -> tuple[int, dict[str, Any], dict[str, GGUFValueType]]:
    n_tensors = p.count("tensor infos", 8 + 4 + 8 + 4 + 8)
    n_kv = p.count("metadata", 8 + 4 + 1)
    metadata: dict[str, Any] = {}
    types: dict[str, GGUFValueType] = {}
    for i in range(n_kv):
        key = p.string(f"metadata key #{i}")
        if key in metadata:
            raise p.fail(f"duplicate metadata key {key!r}")
        types[key] = p.value_type(f"metadata {key!r}")
        metadata[key] = p.value(types[key], key)
    return n_tensors, metadata, types


def _alignment(p: _Parser, metadata: dict[str, Any], types: dict[str, GGUFValueType]) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    value = metadata["general.alignment"]
    if types["general.alignment"] != GGUFValueType.UINT32 or value <= 0 or value & (value - 1):
        raise p.fail(f"general.alignment must be a power-of-two UINT32, got {value!r}")
    return value


def _read_tensor_info(p: _Parser, index: int) -> tuple[str, tuple[int, ...], GGMLType, int]:
    name = p.string(f"name of tensor #{index}")
    n_dims = p.u32(f"n_dims of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise p.fail(f"tensor {name!r} has {n_dims} dimensions (ggml supports 1 to {MAX_DIMS})")
    dims = tuple(p.u64(f"dims of tensor {name!r}") for _ in range(n_dims))
    # the product of the non-zero dims: a zero dim makes the tensor empty but does not make a
    # 2^61-long other dim any less absurd (numpy cannot even shape such an array)
    if any(d > INT64_MAX for d in dims) or math.prod(d for d in dims if d) > INT64_MAX // 16:
        raise p.fail(f"tensor {name!r} dims {dims} overflow 64-bit element counts")
    try:
        ggml_type = ggml_type_of(p.u32(f"type of tensor {name!r}"), name)
    except GGUFError as e:
        raise p.fail(str(e)) from None
    block = GGML_BLOCK_SIZES[ggml_type][0]
    if dims[0] % block:
        raise p.fail(f"tensor {name!r} row length {dims[0]} is not a multiple of the "
                     f"{ggml_type.name} block size {block}")
    return name, dims, ggml_type, p.u64(f"offset of tensor {name!r}")


def _place_tensors(p: _Parser, raw: list, data_offset: int, alignment: int) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, rel in raw:
        if name in tensors:
            raise p.fail(f"duplicate tensor name {name!r}")
        if rel % alignment:
            raise p.fail(f"tensor {name!r} data offset {rel} is not aligned to {alignment} bytes")
        n = math.prod(dims)
        info = TensorInfo(name, dims, tuple(reversed(dims)), ggml_type, data_offset + rel,
                          tensor_nbytes(ggml_type, n), n)
        if info.end > p.size:
            raise p.fail(f"tensor {name!r} bytes [{info.offset}, {info.end}) run past the end of "
                         f"the file ({p.size} bytes): the file is truncated or corrupt")
        tensors[name] = info
    spans = sorted((t.offset, t.end, t.name) for t in tensors.values() if t.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise p.fail(f"tensors {a!r} and {b!r} overlap in the file: the file is corrupt")
    return tensors


class GGUFFile:
    """An open GGUF file: header parsed, tensor bytes memory-mapped (read-only)."""

    def __init__(self, path: Path, version: int, alignment: int, data_offset: int,
                 metadata: dict[str, Any], value_types: dict[str, GGUFValueType],
                 tensors: dict[str, TensorInfo], mm: np.ndarray):
        self.path, self.version, self.alignment = path, version, alignment
        self.data_offset, self.file_size = data_offset, len(mm)
        self.metadata: Mapping[str, Any] = MappingProxyType(metadata)
        # declared type of each metadata value (arrays: ARRAY; see GGUFArray.element_type)
        self.value_types: Mapping[str, GGUFValueType] = MappingProxyType(value_types)
        self.tensors = tensors
        self._mm: np.ndarray | None = mm
        self.reader, self.base_offset = None, 0  # set by from_reader: where tensor bytes come from

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path)
        mm = _map(path)
        return cls(path, *_parse(_Parser(path, memoryview(mm))), mm)

    @classmethod
    def from_reader(cls, reader: Any, base_offset: int, size: int, name: str) -> GGUFFile:
        """A GGUF stored at `base_offset` of a raw source read through an `ntx_io` Reader (a
        staged NVMe namespace): the header is read in growing pieces, tensor bytes on demand."""
        path = Path(name)
        head = min(size, HEAD_READ)
        while True:
            buf = np.empty(head, np.uint8)
            reader.read_into(base_offset, head, buf)
            try:
                parsed = _parse(_Parser(path, memoryview(buf), size))
                break
            except _NeedMore as more:
                head = min(size, max(2 * head, more.upto + HEAD_READ))
        gf = cls(path, *parsed, ReaderBytes(reader, base_offset, size))
        gf.reader, gf.base_offset = reader, base_offset
        return gf

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r}") from None

    def tensor_data(self, name: str) -> np.ndarray:
        """uint8 view of exactly the tensor's bytes in the map (no copy)."""
        if self._mm is None:
            raise GGUFError(f"{self.path}: file is closed")
        info = self.tensor(name)
        return self._mm[info.offset:info.end]

    def span_data(self, start: int, end: int) -> np.ndarray:
        """uint8 view of file bytes [start, end) (no copy): a streamed layer's span."""
        if self._mm is None:
            raise GGUFError(f"{self.path}: file is closed")
        if not 0 <= start < end <= self.file_size:
            raise GGUFError(f"{self.path}: byte range [{start}, {end}) is outside the file ({self.file_size} bytes)")
        return self._mm[start:end]

    def close(self) -> None:
        # Views handed out keep the map alive; dropping ours lets the OS unmap it when they go.
        self._mm = None
        if self.reader is not None:  # from_reader: this file owns the device's reader
            self.reader, reader = None, self.reader
            reader.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")


def _map(path: Path) -> np.ndarray:
    try:
        size = path.stat().st_size
        if size < 24:  # magic + version + two counts; mmap also refuses empty files
            raise GGUFError(f"{path}: truncated: {size} bytes is shorter than a GGUF header")
        return np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise GGUFError(f"cannot open GGUF file {path}: {e.strerror or e}") from None
