"""Checking a staged image against its header and the model file (`ntx-io verify`).

Sampled mode compares the SHA-256 of ranges of the device (the first and last MiB plus seeded
random ones) with the same ranges of the file; full mode hashes every byte on the device and
compares with the header's SHA-256 (and the file's). Works through any `Reader`, so the same
check runs through the kernel path or the VFIO driver.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ntx_common.errors import NtxIOError
from ntx_io.buffers import PinnedBuffer
from ntx_io.image import ImageHeader, read_header

CHUNK = 4 << 20


@dataclass(frozen=True)
class VerifyReport:
    header: ImageHeader
    source: str
    mode: str  # "sampled" | "full"
    ranges: int
    bytes_checked: int
    mismatches: tuple = field(default=())  # (offset in the GGUF, length) that differ
    problems: tuple = field(default=())  # header-level findings

    def __post_init__(self):
        if self.mode not in ("sampled", "full"):
            raise ValueError(f"mode must be sampled or full, got {self.mode!r}")

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.problems

    def as_dict(self) -> dict:
        return {"ok": self.ok, "source": self.source, "mode": self.mode, "ranges": self.ranges,
                "bytes_checked": self.bytes_checked, "mismatches": [list(m) for m in self.mismatches],
                "problems": list(self.problems), "header": self.header.as_dict()}


def sample_ranges(size: int, count: int, length: int, seed: int = 0) -> list[tuple[int, int]]:
    """`count` ranges of at most `length` bytes in [0, size): both ends plus seeded random ones."""
    if size <= 0:
        return []
    length = min(length, size)
    rng = random.Random(seed)
    picks = {0, size - length} | {rng.randrange(0, size - length + 1) for _ in range(max(0, count - 2))}
    return [(offset, length) for offset in sorted(picks)]


def _file_range(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _device_chunks(reader, header: ImageHeader, ranges, buf: PinnedBuffer):
    """Yield (offset in the GGUF, bytes) piece by piece; the next piece is read into the other
    half of `buf` while the caller hashes the current one."""
    half = buf.nbytes // 2
    pieces = [(o + s, min(half, n - s)) for o, n in ranges for s in range(0, n, half)]
    halves = [buf.view()[:half], buf.view()[half: 2 * half]]
    pending = None
    try:
        for k, (offset, n) in enumerate(pieces):
            view = halves[k % 2][:n]
            handle = reader.submit([(header.data_offset + offset, n, view)])
            if pending is not None:
                reader.wait(pending[0])
                yield pending[1], pending[2]
            pending = (handle, offset, view)
        if pending is not None:
            reader.wait(pending[0])
            yield pending[1], pending[2]
    finally:
        pending = None
        for h in halves:
            h.release()


def verify_image(reader, model: Path | None = None, *, full: bool = False, samples: int = 64,
                 sample_bytes: int = 1 << 20, seed: int = 0,
                 progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check the image `reader` reads: its header, then its bytes against `model` / the hash."""
    header = read_header(reader)
    problems = []
    if model is not None and model.stat().st_size != header.source_size:
        problems.append(f"{model} is {model.stat().st_size} bytes; the image holds {header.source_size}")
    if model is None and not full:
        raise NtxIOError("sampled verification compares with the model file: pass MODEL, or use --full")
    ranges = ([(0, header.source_size)] if full else
              sample_ranges(header.source_size, samples, sample_bytes, seed))
    with PinnedBuffer(2 * CHUNK, hugepages=True if reader.needs_hugepages else None) as buf:
        reader.register(buf)
        mismatches, checked = _compare(reader, header, model, ranges, full, buf, progress)
    if full and not mismatches and checked.get("device") != header.sha256:
        problems.append("the SHA-256 of the data on the device differs from the header's")
    if full and model is not None and not problems and checked.get("file") != header.sha256:
        problems.append(f"the SHA-256 of {model} differs from the image's: a different model was staged")
    return VerifyReport(header, reader.source, "full" if full else "sampled", len(ranges),
                        sum(n for _, n in ranges), tuple(mismatches), tuple(problems))


def _compare(reader, header, model, ranges, full, buf, progress):
    whole_dev, whole_file = hashlib.sha256(), hashlib.sha256()
    mismatches = []
    src = open(model, "rb") if model is not None and (full or ranges) else None
    try:
        for offset, view in _device_chunks(reader, header, ranges, buf):
            if full:
                whole_dev.update(view)
            if src is not None:
                src.seek(offset)
                theirs = src.read(len(view))
                if full:
                    whole_file.update(theirs)
                if hashlib.sha256(view).digest() != hashlib.sha256(theirs).digest():
                    mismatches.append((offset, len(view)))
            if progress:
                progress(len(view))
    finally:
        if src is not None:
            src.close()
    return mismatches, {"device": whole_dev.digest(), "file": whole_file.digest() if src else None}
