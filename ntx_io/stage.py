"""Staging a GGUF model onto a raw block device or an image file (`ntx-io stage`).

`plan_stage` is pure: it describes the target, what will be overwritten and why the write
is refused. A block device gets exactly the guards `ntx-setup bind` applies
(`ntx_setup.guards.block_device_refusals`: never the boot disk, nothing mounted, no swap, no
holders, not open, no filesystem/partition signature unless forced); a regular file gets none
of those but still needs `--yes`. `apply_stage` then writes the model first and the header
last, so an interrupted stage never leaves a header that describes missing data.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ntx_common.errors import NtxIOError
from ntx_io.image import HEADER_BYTES, ImageHeader

BLKGETSIZE64 = 0x80081272  # <linux/fs.h>
BLKSSZGET = 0x1268
FILE_LBA = 512  # image files usually back an emulated NVMe with 512-byte blocks
COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class StagePlan:
    model: Path
    target: Path
    kind: str  # "block" | "file" | "new-file"
    target_bytes: int  # size now (0 for a new file)
    needed_bytes: int  # header area + model
    lba_bytes: int
    model_bytes: int
    overwrite: str  # what will be overwritten, for the confirmation
    refusals: tuple = field(default=())  # ntx_setup.guards.Refusal

    def __post_init__(self):
        if self.kind not in ("block", "file", "new-file"):
            raise ValueError(f"unknown target kind {self.kind!r}")

    def blocking(self, force: bool) -> list:
        """Refusals that stop the write; `--force` overrides only signature refusals."""
        return [r for r in self.refusals if not (force and r.overridable)]

    def as_dict(self) -> dict:
        return {"model": str(self.model), "target": str(self.target), "kind": self.kind,
                "target_bytes": self.target_bytes, "needed_bytes": self.needed_bytes,
                "lba_bytes": self.lba_bytes, "overwrite": self.overwrite,
                "refusals": [r.as_dict() for r in self.refusals]}


def _block_geometry(path: Path) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0]
        lba = struct.unpack("i", fcntl.ioctl(fd, BLKSSZGET, b"\0" * 4))[0]
    finally:
        os.close(fd)
    return size, lba


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def plan_stage(model: Path, target: Path, root: Path = Path("/")) -> StagePlan:
    """Describe staging `model` onto `target` (a block device or an image file)."""
    model, target = Path(model), Path(target)
    if not model.is_file():
        raise NtxIOError(f"{model}: no such model file")
    model_bytes = model.stat().st_size
    try:
        st = target.stat()
    except FileNotFoundError:
        return _plan_file(model, target, model_bytes, "new-file", 0)
    if stat.S_ISREG(st.st_mode):
        return _plan_file(model, target, model_bytes, "file", st.st_size)
    if not stat.S_ISBLK(st.st_mode):
        raise NtxIOError(f"{target} is neither a block device nor a regular file: refusing to stage there")
    return _plan_block(model, target, model_bytes, root)


def _plan_file(model: Path, target: Path, model_bytes: int, kind: str, size: int) -> StagePlan:
    header = ImageHeader.for_source(model.name, model_bytes, b"\0" * 32, FILE_LBA)
    needed = header.end_offset
    if kind == "new-file":
        what = f"{target} will be created ({_mib(needed)})"
    else:
        what = (f"{target} is an existing {_mib(size)} file: its bytes 0..{needed - 1} "
                f"({_mib(needed)}) will be overwritten" + ("" if size >= needed else ", and it will grow"))
    return StagePlan(model, target, kind, size, needed, FILE_LBA, model_bytes, what)


def _plan_block(model: Path, target: Path, model_bytes: int, root: Path) -> StagePlan:
    from ntx_setup.guards import block_device_refusals

    refusals = tuple(block_device_refusals(str(target), root))
    size, lba = _block_geometry(target)
    header = ImageHeader.for_source(model.name, model_bytes, b"\0" * 32, lba)
    needed = header.end_offset
    if needed > size:
        raise NtxIOError(f"{target} holds {_mib(size)}; the image needs {_mib(needed)}")
    signatures = [r.message for r in refusals if r.code == "signature"]
    found = "; ".join(signatures) if signatures else "no filesystem or partition-table signature found"
    what = (f"{target} ({_mib(size)} block device, {lba}-byte blocks): bytes 0..{needed - 1} "
            f"({_mib(needed)}) will be overwritten; it holds: {found}")
    return StagePlan(model, target, "block", size, needed, lba, model_bytes, what, refusals)


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _open_target(plan: StagePlan) -> int:
    flags = os.O_WRONLY | os.O_CLOEXEC
    if plan.kind == "new-file":
        flags |= os.O_CREAT | os.O_EXCL
    if plan.kind == "block":
        flags |= os.O_EXCL  # the kernel refuses an exclusive open of a mounted/claimed device
    try:
        return os.open(plan.target, flags, 0o644)
    except OSError as exc:
        raise NtxIOError(f"cannot open {plan.target} for writing: {exc.strerror} (mounted, or in use?)") from None


def apply_stage(plan: StagePlan, force: bool = False,
                progress: Callable[[int], None] | None = None) -> ImageHeader:
    """Write the model, then its header. Refuses if any blocking refusal is left."""
    blocking = plan.blocking(force)
    if blocking:
        raise NtxIOError(f"refusing to stage onto {plan.target}: " + "; ".join(r.message for r in blocking))
    layout = ImageHeader.for_source(plan.model.name, plan.model_bytes, b"\0" * 32, plan.lba_bytes)
    digest = hashlib.sha256()
    fd = _open_target(plan)
    try:
        _write_all(fd, bytes(HEADER_BYTES), 0)  # any older header is void from here on
        offset = layout.data_offset
        with open(plan.model, "rb") as src:
            while chunk := src.read(COPY_CHUNK):
                digest.update(chunk)
                _write_all(fd, chunk, offset)
                offset += len(chunk)
                if progress:
                    progress(len(chunk))
        if offset - layout.data_offset != plan.model_bytes:
            raise NtxIOError(f"{plan.model} changed size while staging; stage it again")
        header = ImageHeader.for_source(plan.model.name, plan.model_bytes, digest.digest(),
                                        plan.lba_bytes, int(time.time()))
        os.fsync(fd)
        _write_all(fd, header.pack(), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return header
