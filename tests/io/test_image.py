"""The raw-image header: round trip, corruption detection, validation."""

from __future__ import annotations

import hashlib
import struct
import zlib

import pytest

from ntx_common.errors import NtxIOError
from ntx_io.image import DATA_ALIGN, HEADER_BYTES, ImageHeader, read_header
from ntx_io.reader import open_reader

SHA = hashlib.sha256(b"model").digest()


def header(**kw) -> ImageHeader:
    args = dict(name="SmolLM2 ünïcode.gguf", size=98_000_123, sha256=SHA, lba_bytes=512, staged_at=1_700_000_000)
    args.update(kw)
    return ImageHeader.for_source(**args)


def test_round_trip_and_layout():
    h = header()
    raw = h.pack()
    assert len(raw) == HEADER_BYTES and raw[:8] == b"NTXIMAGE"
    assert ImageHeader.unpack(raw) == h
    assert h.data_offset == DATA_ALIGN and h.first_data_lba == DATA_ALIGN // 512
    assert header(lba_bytes=4096).first_data_lba == DATA_ALIGN // 4096
    assert h.end_offset == DATA_ALIGN + 98_000_123
    assert h.as_dict()["sha256"] == SHA.hex()


def _recrc(raw: bytearray) -> bytes:
    raw[-4:] = struct.pack("<I", zlib.crc32(bytes(raw[:-4])))
    return bytes(raw)


def test_corruption_and_foreign_data_are_detected():
    raw = bytearray(header().pack())
    flipped = bytearray(raw)
    flipped[40] ^= 1  # a bit of the source size
    with pytest.raises(NtxIOError, match="corrupt"):
        ImageHeader.unpack(bytes(flipped))
    with pytest.raises(NtxIOError, match="no ntx image header"):
        ImageHeader.unpack(b"\0" * HEADER_BYTES)
    with pytest.raises(NtxIOError, match="no ntx image header"):
        ImageHeader.unpack(bytes(raw[:100]))
    newer = bytearray(raw)
    newer[8:12] = struct.pack("<I", 2)
    with pytest.raises(NtxIOError, match="version 2 is not supported"):
        ImageHeader.unpack(_recrc(newer))
    bad_lba = bytearray(raw)
    bad_lba[16:20] = struct.pack("<I", 1000)
    with pytest.raises(NtxIOError, match="invalid"):
        ImageHeader.unpack(_recrc(bad_lba))


def test_fields_are_validated():
    with pytest.raises(ValueError, match="sha256"):
        header(sha256=b"short")
    with pytest.raises(ValueError, match="lba_bytes"):
        header(lba_bytes=1000)
    with pytest.raises(ValueError, match="source name"):
        header(name="x" * 300)
    with pytest.raises(ValueError, match="after the 4096-byte header"):
        ImageHeader("m", 1, SHA, 512, 1)


def test_read_header_checks_the_device_is_large_enough(tmp_path):
    small = tmp_path / "img"
    small.write_bytes(header().pack() + b"\0" * 10_000)
    with open_reader(small)[0] as reader, pytest.raises(NtxIOError, match="truncated"):
        read_header(reader)
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"NTX")
    with open_reader(tiny)[0] as reader, pytest.raises(NtxIOError, match="no ntx image there"):
        read_header(reader)
