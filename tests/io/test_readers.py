"""Kernel-path readers return exactly the file's bytes (the oracle: the bytes we wrote)."""

from __future__ import annotations

import random
import subprocess

import numpy as np
import pytest

from ntx_common.errors import NtxIOError, NvmeError, UsageError
from ntx_io.buffers import PinnedBuffer
from ntx_io.direct import DirectReader
from ntx_io.mapped import MmapReader
from ntx_io.reader import Reader, open_reader

KINDS = ["direct", "mmap"]


def edge_ranges(size: int) -> list[tuple[int, int]]:
    return [(0, 0), (0, 1), (size - 1, 1), (size - 4999, 4999), (0, size), (4096, 8192),
            (4095, 2), (511, 513), (size - 4096 - 17, 4096 + 17), (1 << 20, 3 << 20)]


def random_ranges(size: int, n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        offset = rng.randrange(size)
        out.append((offset, rng.randrange(min(size - offset, 2_500_000) + 1)))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_random_and_edge_ranges_return_the_files_bytes(data_file, kind):
    path, data = data_file
    reader, _ = open_reader(path, kind, chunk=64 << 10)  # small chunks: one range spans many
    with reader:
        assert isinstance(reader, Reader) and reader.size == len(data)
        for offset, length in edge_ranges(len(data)) + random_ranges(len(data), 300, seed=1):
            dest = bytearray(length)
            reader.read_into(offset, length, dest)
            assert dest == data[offset: offset + length], (offset, length)


@pytest.mark.parametrize("kind", KINDS)
def test_many_requests_in_flight_in_one_submit(data_file, kind):
    path, data = data_file
    ranges = random_ranges(len(data), 64, seed=2)
    dests = [bytearray(n) for _, n in ranges]
    with open_reader(path, kind)[0] as reader:
        handle = reader.submit([(o, n, d) for (o, n), d in zip(ranges, dests)])
        assert reader.wait(handle, timeout=60)
    for (o, n), d in zip(ranges, dests):
        assert d == data[o: o + n]


@pytest.mark.parametrize("kind", KINDS)
def test_past_eof_and_bad_ranges_are_refused_clearly(data_file, kind):
    path, data = data_file
    with open_reader(path, kind)[0] as reader:
        with pytest.raises(NtxIOError, match=f"past the end of .*data.bin .{len(data)} bytes"):
            reader.read_into(len(data) - 10, 11, bytearray(11))
        with pytest.raises(NtxIOError, match="bad read range"):
            reader.read_into(-1, 4, bytearray(4))
        with pytest.raises(NtxIOError, match="bad read range"):
            reader.read_into(1.5, 4, bytearray(4))
        with pytest.raises(NtxIOError, match="holds 3 bytes, 4 requested"):
            reader.read_into(0, 4, bytearray(3))
        with pytest.raises(NtxIOError, match="read-only"):
            reader.read_into(0, 4, b"abcd")


@pytest.mark.parametrize("kind", KINDS)
def test_destinations_numpy_pinned_and_unaligned_slices(data_file, kind):
    path, data = data_file
    with open_reader(path, kind)[0] as reader, PinnedBuffer(3 << 20) as buf:
        reader.register(buf)
        arr = np.zeros(10_000, dtype=np.uint8)
        reader.read_into(np.int64(12_345), np.uint32(10_000), arr)  # offsets from numpy tables
        assert arr.tobytes() == data[12_345: 22_345]
        reader.read_into(8192, 2 << 20, buf)  # aligned, straight into the pinned buffer
        assert buf.view()[: 2 << 20] == data[8192: 8192 + (2 << 20)]
        with buf.view() as view:
            reader.read_into(77, 1_000_001, view[3: 3 + 1_000_001])  # unaligned memory and offset
            assert view[3: 3 + 1_000_001] == data[77: 77 + 1_000_001]


def test_short_tail_is_read_through_the_aligned_bounce(tmp_path):
    """A file of 4096 + 10 bytes: O_DIRECT must read the last block short and copy 10 bytes."""
    data = bytes(range(256)) * 16 + b"0123456789"
    path = tmp_path / "tail.bin"
    path.write_bytes(data)
    with DirectReader(str(path)) as reader:
        dest = bytearray(10)
        reader.read_into(4096, 10, dest)
        assert dest == b"0123456789"
        whole = bytearray(len(data))
        reader.read_into(0, len(data), whole)
        assert whole == data


def test_block_device_through_direct_and_mmap(loop_device):
    dev, backing = loop_device
    data = random.Random(3).randbytes(8 << 20)
    with open(backing, "r+b") as f:
        f.write(data)
    subprocess.run(["blockdev", "--flushbufs", str(dev)], capture_output=True)
    for kind in KINDS:
        with open_reader(dev, kind)[0] as reader:
            assert reader.size == 160 << 20
            for offset, length in random_ranges(len(data), 50, seed=4):
                dest = bytearray(length)
                reader.read_into(offset, length, dest)
                assert dest == data[offset: offset + length]
    sysfs = f"/sys/class/block/{dev.name}/queue/logical_block_size"
    with DirectReader(str(dev)) as reader, open(sysfs) as f:
        assert reader.align == int(f.read())


@pytest.fixture
def ramfs(tmp_path):
    """A filesystem without O_DIRECT (ramfs), to see the automatic fallback to mmap."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here ({made.stderr.strip()}): no filesystem without O_DIRECT")
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_auto_falls_back_to_mmap_and_says_why(ramfs):
    path = ramfs / "model.bin"
    data = random.Random(5).randbytes(100_000)
    path.write_bytes(data)
    with pytest.raises(NtxIOError, match="O_DIRECT"):
        DirectReader(str(path))
    reader, why = open_reader(path)
    with reader:
        assert isinstance(reader, MmapReader)
        assert "mmap fallback" in why and "O_DIRECT" in why
        dest = bytearray(1234)
        reader.read_into(98_000, 1234, dest)
        assert dest == data[98_000: 99_234]


def test_auto_prefers_o_direct(data_file):
    reader, why = open_reader(data_file[0])
    with reader:
        assert reader.name == "direct" and "O_DIRECT" in why


def test_kind_and_source_mismatches(data_file, tmp_path):
    with pytest.raises(UsageError, match="PCI address"):
        open_reader(data_file[0], "vfio")
    with pytest.raises(UsageError, match="only the VFIO reader"):
        open_reader("vfio:0000:01:00.0", "direct")
    with pytest.raises(UsageError, match="reader kind"):
        open_reader(data_file[0], "floppy")
    with pytest.raises(NtxIOError, match="no such file"):
        open_reader(tmp_path / "missing.bin")
    with pytest.raises(NvmeError, match="not a PCI address"):
        open_reader("vfio:not-an-address")


def _resident_pages(path, offset: int, length: int) -> int:
    """Pages of [offset, offset + length) of `path` in the page cache: mincore(2) over a fresh
    read-only mapping made with libc's mmap (Python's mmap hides the address)."""
    import ctypes
    import mmap
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = offset - offset % mmap.PAGESIZE
    span = offset + length - start
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        vec = (ctypes.c_ubyte * (-(-span // mmap.PAGESIZE)))()
        if libc.mincore(addr, span, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(v & 1 for v in vec)
    finally:
        libc.munmap(addr, span)


@pytest.mark.parametrize("evict", [True, False])
def test_mmap_reader_evicts_what_it_read_when_asked(data_file, evict):
    """evict=True (the storage tier's setting): the bytes are right and the pages read are no
    longer in the page cache afterwards (mincore), so the next token reads the device again.
    Without it the same read leaves them cached: the check can tell the two apart."""
    import os

    path, data = data_file
    with open(path, "rb+") as f:  # written a moment ago: start, like a model file, out of the cache
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    offset, length = 1 << 20, 3 << 20
    with MmapReader(str(path), evict=evict) as reader:
        dest = bytearray(length)
        reader.read_into(offset, length, dest)
    assert dest == data[offset: offset + length]
    resident = _resident_pages(path, offset + 4096, length - 8192)
    if evict:
        assert resident == 0, f"{resident} pages still cached after an evicting read"
    else:
        assert resident > 0, "a plain mmap read left nothing cached: this filesystem cannot show eviction"
