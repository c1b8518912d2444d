"""Raw-device model images: one header block, then the GGUF file at an aligned LBA.

    offset 0        4096-byte header (layout below, little endian, CRC-32 in the last 4 bytes)
    data_offset     the GGUF file, byte for byte (data_offset = first_data_lba * lba_bytes = 1 MiB)

The header alone lets a reader find the model: the GGUF starts at `data_offset` and is
`source_size` bytes long, so every tensor lies at `data_offset` + its offset in the file.
`sha256` covers the GGUF bytes; `ntx-io verify` checks it.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import asdict, dataclass

from ntx_common.errors import NtxIOError

MAGIC = b"NTXIMAGE"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
DATA_ALIGN = 1 << 20  # aligned for every logical block size and erase block
NAME_BYTES = 256

# magic, version, header bytes, lba bytes, flags, first data LBA, source size, sha256,
# staged at (unix seconds), name length; then the name (NAME_BYTES), zero padded.
_FIXED = struct.Struct("<8sIIIIQQ32sQH")
_CRC = struct.Struct("<I")


def _crc(raw: bytes) -> int:
    return zlib.crc32(raw[: HEADER_BYTES - _CRC.size])


@dataclass(frozen=True)
class ImageHeader:
    source_name: str  # file name of the GGUF at staging time (untrusted when read back)
    source_size: int  # bytes of the GGUF
    sha256: bytes  # of the GGUF bytes
    lba_bytes: int  # logical block size of the target at staging time
    first_data_lba: int
    staged_at: int = 0
    version: int = FORMAT_VERSION

    def __post_init__(self):
        if len(self.source_name.encode()) > NAME_BYTES - 1 or "\0" in self.source_name:
            raise ValueError(f"source name must be <= {NAME_BYTES - 1} UTF-8 bytes without NUL")
        if len(self.sha256) != 32:
            raise ValueError(f"sha256 must be 32 bytes, got {len(self.sha256)}")
        if self.lba_bytes < 512 or self.lba_bytes > 65536 or self.lba_bytes & (self.lba_bytes - 1):
            raise ValueError(f"lba_bytes must be a power of two in 512..65536, got {self.lba_bytes}")
        if self.data_offset < HEADER_BYTES:
            raise ValueError(f"data must start after the {HEADER_BYTES}-byte header, not at {self.data_offset}")
        if self.source_size < 0 or self.staged_at < 0 or self.version != FORMAT_VERSION:
            raise ValueError("negative size/time or unknown format version")

    @classmethod
    def for_source(cls, name: str, size: int, sha256: bytes, lba_bytes: int, staged_at: int = 0) -> ImageHeader:
        return cls(name, size, sha256, lba_bytes, max(DATA_ALIGN, lba_bytes) // lba_bytes, staged_at)

    @property
    def data_offset(self) -> int:
        return self.first_data_lba * self.lba_bytes

    @property
    def end_offset(self) -> int:
        return self.data_offset + self.source_size

    def as_dict(self) -> dict:
        return {**asdict(self), "sha256": self.sha256.hex(), "data_offset": self.data_offset}

    def pack(self) -> bytes:
        name = self.source_name.encode()
        fixed = _FIXED.pack(MAGIC, self.version, HEADER_BYTES, self.lba_bytes, 0, self.first_data_lba,
                            self.source_size, self.sha256, self.staged_at, len(name))
        body = (fixed + name.ljust(NAME_BYTES, b"\0")).ljust(HEADER_BYTES - _CRC.size, b"\0")
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def unpack(cls, raw: bytes, where: str = "the image") -> ImageHeader:
        if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
            raise NtxIOError(f"{where} has no ntx image header (stage a model with `ntx-io stage`)")
        magic, version, hbytes, lba, _, first, size, sha, when, nlen = _FIXED.unpack_from(raw)
        if version != FORMAT_VERSION or hbytes != HEADER_BYTES:
            raise NtxIOError(f"{where}: image format version {version} is not supported (this ntx reads "
                             f"version {FORMAT_VERSION}); re-stage the model")
        if _CRC.unpack_from(raw, HEADER_BYTES - _CRC.size)[0] != _crc(raw):
            raise NtxIOError(f"{where}: the image header is corrupt (CRC mismatch); re-stage the model")
        name = raw[_FIXED.size: _FIXED.size + min(nlen, NAME_BYTES - 1)].decode(errors="replace")
        try:
            return cls(name, size, sha, lba, first, when, version)
        except ValueError as exc:
            raise NtxIOError(f"{where}: the image header is invalid ({exc}); re-stage the model") from None


def read_header(reader) -> ImageHeader:
    """The header of the image `reader` reads (any `Reader`), checked against its size."""
    raw = bytearray(HEADER_BYTES)
    if reader.size < HEADER_BYTES:
        raise NtxIOError(f"{reader.source} is only {reader.size} bytes: no ntx image there")
    reader.read_into(0, HEADER_BYTES, raw)
    header = ImageHeader.unpack(bytes(raw), reader.source)
    if header.end_offset > reader.size:
        raise NtxIOError(f"{reader.source}: the image needs {header.end_offset} bytes but the device has "
                         f"{reader.size}: truncated or staged on a larger device")
    return header
