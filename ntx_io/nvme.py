"""`NvmeDevice`: the Python face of the userspace NVMe driver (`native/nvme`, cffi `ntx_io._nvme`).

The controller must already be on vfio-pci (`ntx-setup bind`). Reads land by DMA in
`PinnedBuffer`s mapped into the device. The batched interface (`submit` a list of
(lba, blocks, destination), `wait` on the handle) keeps many commands in flight over several
queues; cffi releases the GIL while the driver polls, so other Python threads keep running.
No numpy here: this module also runs inside the slow TCG test guest.
"""

from __future__ import annotations

import errno
import re
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ntx_common.errors import NvmeError
from ntx_io.buffers import PinnedBuffer

BDF_RE = re.compile(r"^([0-9a-f]{4}:)?[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _native():
    try:
        from ntx_io._nvme import ffi, lib
    except ImportError as exc:
        raise NvmeError(f"the NVMe driver extension ntx_io._nvme is not built ({exc}): reinstall with "
                        "`pip install -e .` (needs gcc and cffi)") from None
    return ffi, lib


def normalize_bdf(bdf: str) -> str:
    bdf = bdf.strip().lower()
    if not BDF_RE.match(bdf):
        raise NvmeError(f"{bdf!r} is not a PCI address (expected DDDD:BB:DD.F, e.g. 0000:01:00.0)")
    return bdf if bdf.count(":") == 2 else "0000:" + bdf


def _text(raw: bytes) -> str:
    """Identify strings are untrusted device data: printable ASCII only, trailing spaces cut."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in raw.decode("latin-1")).rstrip()


def _error(rc: int, message: str, **attrs) -> NvmeError:
    exc = NvmeError(message)
    exc.errno = -rc
    for key, value in attrs.items():
        setattr(exc, key, value)
    return exc


@dataclass(frozen=True)
class NvmeIdentity:
    bdf: str
    vid: int  # PCI vendor id from Identify Controller
    ssvid: int
    serial: str
    model: str
    firmware: str
    version: str  # NVMe version from the VS register, "1.4.0"
    mqes: int  # entries per queue the controller allows
    doorbell_stride: int
    ready_timeout_ms: int  # CAP.TO
    mdts_bytes: int  # 0 = no limit reported
    max_transfer_bytes: int  # what one Read command of ours moves at most
    namespaces: int
    nsid: int
    blocks: int  # namespace size (NSZE) in logical blocks
    capacity_blocks: int
    lba_bytes: int
    queues: int  # I/O queue pairs created
    queue_depth: int
    iommu: bool  # False: no-IOMMU mode, DMA to physical addresses

    @property
    def size_bytes(self) -> int:
        return self.blocks * self.lba_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "size_bytes": self.size_bytes}


class NvmeBatch:
    """Reads in flight; created by `NvmeDevice.submit`, finished by `NvmeDevice.wait`."""

    def __init__(self, ios, count: int, keepalive: list):
        self._ios = ios  # cffi array of struct ntx_nvme_io, read by the driver until closed
        self._keep = keepalive  # the cffi buffers the destinations come from
        self.count = count
        self.handle = None
        self.done = False


class NvmeDevice:
    """An NVMe controller on vfio-pci, driven from this process. Use `NvmeDevice.open`."""

    def __init__(self, bdf: str, *, iommu: bool = True, queues: int = 4, depth: int = 256,
                 nsid: int = 0, cmd_timeout: float = 10.0, admin_timeout: float = 10.0,
                 range_check: bool = True):
        ffi, lib = _native()
        self.bdf = normalize_bdf(bdf)
        opts = ffi.new("struct ntx_nvme_opts *")
        lib.ntx_nvme_default_opts(opts)
        opts.iommu, opts.nqueues, opts.qdepth, opts.nsid = int(iommu), queues, depth, nsid
        opts.cmd_timeout_us = max(1, int(cmd_timeout * 1e6))
        opts.admin_timeout_ms = max(1, int(admin_timeout * 1e3))
        opts.range_check = int(range_check)
        out = ffi.new("struct ntx_nvme **")
        err = ffi.new("char[256]")
        rc = lib.ntx_nvme_open(self.bdf.encode(), opts, out, err, 256)
        if rc:
            raise _error(rc, f"cannot open NVMe {self.bdf}: {ffi.string(err).decode(errors='replace')}")
        self._ffi, self._lib, self._dev = ffi, lib, out[0]
        self._lock = threading.RLock()
        self._mapped: dict[int, PinnedBuffer] = {}
        # batches the driver still writes results into: kept alive here until waited, even if
        # the caller drops its handle, so the driver never writes into freed memory
        self._open: set[NvmeBatch] = set()
        self._identity = self._read_identity()

    @classmethod
    def open(cls, bdf: str, iommu: bool = True, **options) -> NvmeDevice:
        return cls(bdf, iommu=iommu, **options)

    def __enter__(self) -> NvmeDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._dev is None

    def _check(self, rc: int, what: str, **attrs) -> None:
        if rc:
            detail = self._ffi.string(self._lib.ntx_nvme_last_error(self._dev)).decode(errors="replace")
            raise _error(rc, f"{what}: {detail or errno.errorcode.get(-rc, rc)}", **attrs)

    def _alive(self):
        if self._dev is None:
            raise NvmeError(f"NVMe {self.bdf} is closed")
        return self._dev

    def _read_identity(self) -> NvmeIdentity:
        i = self._ffi.new("struct ntx_nvme_info *")
        self._lib.ntx_nvme_get_info(self._dev, i)
        s = self._ffi.string
        return NvmeIdentity(
            bdf=self.bdf, vid=i.vid, ssvid=i.ssvid, serial=_text(s(i.sn)), model=_text(s(i.mn)),
            firmware=_text(s(i.fr)), version=f"{i.vs >> 16}.{(i.vs >> 8) & 0xff}.{i.vs & 0xff}",
            mqes=i.mqes, doorbell_stride=i.dstrd_bytes, ready_timeout_ms=i.to_ms,
            mdts_bytes=i.mdts_bytes, max_transfer_bytes=i.max_xfer_bytes, namespaces=i.nn,
            nsid=i.nsid, blocks=i.nsze, capacity_blocks=i.ncap, lba_bytes=i.lba_bytes,
            queues=i.nqueues, queue_depth=i.qdepth, iommu=not i.noiommu)

    def identify(self) -> NvmeIdentity:
        self._alive()
        return self._identity

    def stats(self) -> dict:
        st = self._ffi.new("struct ntx_nvme_stats *")
        with self._lock:
            self._lib.ntx_nvme_get_stats(self._alive(), st)
        return {k: getattr(st, k) for k in ("commands", "blocks", "timeouts", "max_inflight",
                                             "regions", "mapped_bytes", "fenced")}

    @property
    def fenced(self) -> bool:
        return bool(self.stats()["fenced"])

    def map(self, buf: PinnedBuffer) -> None:
        """Make `buf` a DMA target of this device (once; mapping again is a no-op)."""
        if buf.closed:  # its memory is gone: the driver would fault every page of it
            raise NvmeError(f"cannot map {buf!r} for DMA from {self.bdf}: the buffer is closed")
        if buf.address in self._mapped:
            return
        if not self._identity.iommu and not buf.hugepages:
            raise NvmeError(f"no-IOMMU DMA into {buf!r} refused: without an IOMMU the controller "
                            "writes to physical addresses, and only hugepages never move; "
                            "allocate it with PinnedBuffer(n, hugepages=True)")
        with self._lock:
            rc = self._lib.ntx_nvme_dma_map(self._alive(), self._ffi.cast("void *", buf.address), buf.capacity)
            self._check(rc, f"cannot map {buf!r} for DMA from {self.bdf}")
        self._mapped[buf.address] = buf
        buf._devices.append(self)

    def unmap(self, buf: PinnedBuffer) -> None:
        """Stop DMA into `buf`; refused while the device is fenced (reset() first)."""
        if self._mapped.get(buf.address) is not buf:
            return
        with self._lock:
            rc = self._lib.ntx_nvme_dma_unmap(self._alive(), self._ffi.cast("void *", buf.address))
            self._check(rc, f"cannot release {buf!r} from {self.bdf}")
        del self._mapped[buf.address]
        buf._devices.remove(self)

    def _destination(self, dest, nbytes: int, keep: list) -> int:
        if isinstance(dest, PinnedBuffer):
            if nbytes > dest.nbytes:
                raise NvmeError(f"{nbytes} bytes do not fit in {dest!r}")
            return dest.address
        cdata = self._ffi.from_buffer(dest, require_writable=True)
        if nbytes > len(cdata):
            raise NvmeError(f"{nbytes} bytes do not fit in a {len(cdata)}-byte destination")
        keep.append(cdata)
        return int(self._ffi.cast("uintptr_t", cdata))

    def submit(self, reads: Sequence[tuple[int, int, object]]) -> NvmeBatch:
        """Start reads of (lba, blocks, destination); destinations lie in mapped buffers.

        A destination is a PinnedBuffer (its start) or a writable buffer slice of one
        (e.g. `buf.view()[off:]`)."""
        lba_bytes = self._identity.lba_bytes
        ios = self._ffi.new("struct ntx_nvme_io[]", max(1, len(reads)))
        keep: list = []
        for k, (lba, nlb, dest) in enumerate(reads):
            if lba < 0 or nlb <= 0:
                raise NvmeError(f"read {k}: bad range lba={lba} blocks={nlb}")
            ios[k].lba, ios[k].nlb = lba, nlb
            ios[k].dst = self._ffi.cast("void *", self._destination(dest, nlb * lba_bytes, keep))
        batch = NvmeBatch(ios, len(reads), keep)
        handle = self._ffi.new("struct ntx_nvme_batch **")
        with self._lock:
            rc = self._lib.ntx_nvme_batch_open(self._alive(), ios, len(reads), handle)
            self._check(rc, f"{self.bdf}: reads refused")
        batch.handle = handle[0]
        self._open.add(batch)
        return batch

    def wait(self, batch: NvmeBatch, timeout: float | None = None) -> bool:
        """True once every read of `batch` landed; False if `timeout` s passed first.

        Raises NvmeError naming the failed LBA range (and the NVMe status) if a read failed,
        or if a command passed its deadline (the device is then fenced until `reset()`)."""
        if batch.done:
            return True
        timeout_us = -1 if timeout is None else max(0, int(timeout * 1e6))
        with self._lock:
            dev = self._alive()
            rc = self._lib.ntx_nvme_batch_wait(dev, batch.handle, timeout_us)
            if rc == -errno.EAGAIN:
                return False
            detail = self._ffi.string(self._lib.ntx_nvme_last_error(dev)).decode(errors="replace")
            self._lib.ntx_nvme_batch_close(dev, batch.handle)
        batch.done, batch.handle = True, None
        self._open.discard(batch)
        for cdata in batch._keep:  # give the destinations' buffer exports back now, not at GC
            self._ffi.release(cdata)
        batch._keep.clear()
        if rc:
            raise self._batch_error(batch, rc, detail)
        return True

    def _batch_error(self, batch: NvmeBatch, rc: int, detail: str) -> NvmeError:
        failed = [batch._ios[k] for k in range(batch.count) if batch._ios[k].result < 0]
        first = failed[0] if failed else None
        return _error(rc, f"{len(failed)} of {batch.count} reads failed on {self.bdf}: {detail}",
                      status=first.nvme_status if first else 0,
                      lba=first.fail_lba if first else None, blocks=first.fail_nlb if first else None)

    def read(self, lba: int, blocks: int, buf, timeout: float | None = None) -> None:
        """Read `blocks` logical blocks at `lba` into `buf` (a mapped PinnedBuffer or a slice of one)."""
        batch = self.submit([(lba, blocks, buf)])
        if not self.wait(batch, timeout):
            self.wait(batch)  # a caller timeout cannot abandon DMA in flight: finish it
            raise NvmeError(f"read of LBA {lba}+{blocks} on {self.bdf} took longer than {timeout} s")

    def reset(self) -> None:
        """Disable and re-enable the controller: ends a fence; pending reads fail."""
        with self._lock:
            self._check(self._lib.ntx_nvme_reset(self._alive()), f"reset of {self.bdf} failed")

    def close(self) -> None:
        """Shut the controller down (CC.SHN), unmap every buffer, release VFIO. Idempotent."""
        if self._dev is None:
            return
        with self._lock:
            dev, self._dev = self._dev, None
            rc = self._lib.ntx_nvme_close(dev)
        for buf in self._mapped.values():
            buf._devices.remove(self)
        self._mapped.clear()
        self._open.clear()  # the driver freed its batches with the device
        if rc:
            raise _error(rc, f"{self.bdf} did not shut down cleanly (errno {-rc}); its VFIO "
                         "handles were released anyway")

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
