"""`ntx-io bench`: sequential read bandwidth per reader, against the disk's own `dd iflag=direct`
figure, plus host-to-device bandwidth from the pinned buffers when a GPU is present.

Each reader streams the same bytes into a registered `PinnedBuffer` ring, `inflight` requests
of `chunk` bytes in flight at all times (a new one as the oldest lands) - the way the engine's
reader thread drives it. Every figure is GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ntx_io.buffers import PinnedBuffer

Progress = Callable[[int], None]


@dataclass(frozen=True)
class ReadBench:
    reader: str
    reason: str
    nbytes: int
    seconds: float
    chunk: int
    inflight: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "gbps": round(self.gbps, 3)}


@dataclass(frozen=True)
class BenchReport:
    source: str
    nbytes: int
    reads: list = field(default_factory=list)  # ReadBench
    dd: dict = field(default_factory=dict)  # {"1": GB/s, "8": GB/s}: dd iflag=direct, N parallel streams
    h2d: dict | None = None  # registered vs cudaMemcpy-pinned H2D GB/s
    kvikio_gbps: float | None = None
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"source": self.source, "nbytes": self.nbytes, "reads": [r.as_dict() for r in self.reads],
                "dd_direct_gbps": self.dd, "h2d": self.h2d, "kvikio_compat_gbps": self.kvikio_gbps,
                "notes": self.notes}


def parse_size(text: str) -> int:
    """'512M', '4G', '1.5G', '1048576' -> bytes (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size (use e.g. 512M or 4G)") from None


def make_bench_file(path: Path, nbytes: int) -> None:
    """A file of incompressible bytes (one random 64 MiB block repeated), written once."""
    if path.exists() and path.stat().st_size >= nbytes:
        return
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        for start in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - start)])
        f.flush()
        os.fsync(f.fileno())


def drop_cache(path: str) -> None:
    """Evict a file's pages so the mmap reader measures the disk, not the page cache."""
    if not os.path.isfile(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_read(reader, reason: str, nbytes: int, *, chunk: int = 8 << 20, inflight: int = 8,
               progress: Progress | None = None) -> ReadBench:
    """Stream [0, nbytes) of `reader` through a registered pinned ring of `inflight` slots of
    `chunk` bytes, keeping `inflight` requests in flight (a new one as the oldest lands)."""
    nbytes = min(nbytes, reader.size)
    with PinnedBuffer(chunk * inflight, hugepages=True if reader.needs_hugepages else None) as buf:
        reader.register(buf)
        ring = buf.view()
        slots = [ring[k * chunk: (k + 1) * chunk] for k in range(inflight)]
        pending: deque = deque()
        t0 = time.perf_counter()
        for k, offset in enumerate(range(0, nbytes, chunk)):
            if len(pending) == inflight:
                _land(reader, pending.popleft(), progress)
            n = min(chunk, nbytes - offset)
            pending.append((reader.submit([(offset, n, slots[k % inflight][:n])]), n))
        while pending:
            _land(reader, pending.popleft(), progress)
        seconds = time.perf_counter() - t0
        del slots
        ring.release()
    return ReadBench(reader.name, reason, nbytes, seconds, chunk, inflight)


def _land(reader, item, progress: Progress | None) -> None:
    handle, n = item
    reader.wait(handle)
    if progress:
        progress(n)


def dd_direct_gbps(path: str, nbytes: int, streams: int = 1, bs: int = 8 << 20) -> float | None:
    """`dd iflag=direct` over [0, nbytes) split into `streams` parallel dd processes."""
    if shutil.which("dd") is None or path.startswith("vfio:"):
        return None
    per = max(1, nbytes // bs // streams)
    cmds = [["dd", f"if={path}", "of=/dev/null", f"bs={bs}", f"count={per}", f"skip={i * per}",
             "iflag=direct", "status=none"] for i in range(streams)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for c in cmds]
    failed = [p for p in procs if p.wait() != 0]
    seconds = time.perf_counter() - t0
    return None if failed else per * bs * streams / seconds / 1e9


def h2d_report(nbytes: int = 512 << 20) -> dict:
    """H2D GB/s from a CUDA-registered PinnedBuffer vs from cuMemAllocHost memory."""
    from ntx_io import gpu

    usable, why = gpu.cuda_status()
    if not usable:
        return {"available": False, "reason": why}
    with PinnedBuffer(nbytes) as buf:
        buf.register_cuda()
        ours = gpu.h2d_gbps(buf.address, nbytes)
    reference = gpu.cuda_pinned_h2d_gbps(nbytes)
    return {"available": True, "registered_gbps": round(ours, 2), "cuda_pinned_gbps": round(reference, 2),
            "ratio": round(ours / reference, 3), "nbytes": nbytes, "hugepages": buf.hugepages}


def kvikio_gbps(path: str, nbytes: int) -> float | None:
    """kvikio's compatibility mode (POSIX reads into GPU memory) on the same bytes, if installed."""
    os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
    try:
        import cupy
        import kvikio
    except ImportError:
        return None
    dest = cupy.empty(nbytes, dtype=cupy.uint8)
    with kvikio.CuFile(path, "r") as f:
        t0 = time.perf_counter()
        f.read(dest)
        cupy.cuda.runtime.deviceSynchronize()
        return nbytes / (time.perf_counter() - t0) / 1e9


@dataclass(frozen=True)
class BenchPlan:
    source: str | None  # None: create a scratch file in `workdir`
    readers: tuple  # reader kinds, empty = every kind that applies
    nbytes: int
    workdir: Path = Path(".")
    chunk: int = 8 << 20
    inflight: int = 8
    dd_streams: int = 8
    h2d: bool = True
    kvikio: bool = False
    iommu: bool = True
    keep: bool = False

    def __post_init__(self):
        if self.nbytes <= 0 or self.chunk < 4096 or self.inflight < 1 or self.dd_streams < 1:
            raise ValueError("size, chunk, inflight and dd streams must be positive (chunk >= 4 KiB)")


def run_bench(plan: BenchPlan, progress_for: Callable[[str, int], object]) -> BenchReport:
    """Run every measurement of `plan`; `progress_for(label, total)` is a context manager
    yielding an advance(n) callback."""
    from ntx_io.reader import VFIO_PREFIX, open_reader

    notes, scratch, source = [], None, plan.source
    if source is None:
        scratch = plan.workdir / "ntx-bench.bin"
        make_bench_file(scratch, plan.nbytes)
        source = str(scratch)
        notes.append(f"scratch file {scratch} ({plan.nbytes} bytes)" + ("" if plan.keep else ", removed"))
    vfio = source.startswith(VFIO_PREFIX)
    kinds = plan.readers or (("vfio",) if vfio else ("direct", "mmap"))
    reads, nbytes = [], plan.nbytes
    try:
        for kind in kinds:
            drop_cache(source)
            reader, why = open_reader(source, kind, iommu=plan.iommu)
            try:
                nbytes = min(plan.nbytes, reader.size)
                with progress_for(f"{reader.name} read", nbytes) as advance:
                    reads.append(bench_read(reader, why, nbytes, chunk=plan.chunk,
                                            inflight=plan.inflight, progress=advance))
            finally:
                reader.close()
        dd = {} if vfio else {str(n): dd_direct_gbps(source, nbytes, n) for n in sorted({1, plan.dd_streams})}
        kv = kvikio_gbps(source, nbytes) if plan.kvikio and not vfio else None
        if plan.kvikio and kv is None:
            notes.append("kvikio comparison skipped: kvikio/cupy not importable (or a vfio source)")
    finally:
        if scratch is not None and not plan.keep:
            scratch.unlink(missing_ok=True)
    h2d = h2d_report() if plan.h2d else None
    return BenchReport(source, nbytes, reads, dd, h2d, kv, notes)
