"""The CUDA backend's slot ring: N device buffers, a copy stream apart from the compute stream,
and per-slot events so that (1) compute of a layer waits for its copy, (2) the copy of the next
occupant of a slot waits for the compute that used the slot, (3) a staging buffer is refilled
only after the copy out of it has finished. Weights in a slot are `CudaWeight`s over views of
the slot: no kernel caches anything derived from a weight, so a slot's bytes may change."""

from __future__ import annotations

import numpy as np

from ntx_engine.backends.cuda_backend import CudaWeight
from ntx_engine.backends.cuda_driver import DeviceArray, Event, Stream, check, driver
from ntx_engine.backends.host_memory import host_buffer, host_view
from ntx_engine import quants


class CudaRing:
    def __init__(self, backend, n_slots: int, slot_bytes: int) -> None:
        if n_slots < 1 or slot_bytes <= 0:
            raise ValueError(f"a ring needs slots and bytes, got {n_slots} x {slot_bytes}")
        self.backend, self.n_slots, self.slot_bytes = backend, n_slots, slot_bytes
        self.slots = [DeviceArray(backend.pool, (slot_bytes,), np.uint8) for _ in range(n_slots)]
        self.copy_stream = Stream()
        self.copied = [Event() for _ in range(n_slots)]
        self.freed = [Event() for _ in range(n_slots)]
        self.drained: dict[int, Event] = {}
        self.copies = 0

    def host_buffer(self, nbytes: int, reader=None, numa_nodes=None):
        return host_buffer(nbytes, reader, cuda=True, device=self.backend.device.ordinal, numa_nodes=numa_nodes)

    def host_view(self, buf) -> np.ndarray:
        return host_view(buf)

    def bind_thread(self) -> None:
        """The feeder thread issues CUDA calls: make the backend's context current there."""
        check(driver().cuCtxSetCurrent(self.backend.device.context), "cuCtxSetCurrent(feeder thread)")

    def copy_in(self, slot: int, src: np.ndarray) -> None:
        drv = driver()
        check(drv.cuStreamWaitEvent(self.copy_stream.handle, self.freed[slot].handle, 0), "cuStreamWaitEvent(slot free)")
        check(drv.cuMemcpyHtoDAsync(self.slots[slot].ptr, src.ctypes.data, src.nbytes, self.copy_stream.handle),
              f"cuMemcpyHtoDAsync(slot {slot}, {src.nbytes} bytes)")
        self.copied[slot].record(self.copy_stream)
        self.copies += 1

    def mark_drained(self, buf: int) -> None:
        ev = self.drained.setdefault(buf, Event())
        ev.record(self.copy_stream)

    def wait_drained(self, buf: int) -> None:
        if buf in self.drained:
            self.drained[buf].synchronize()

    def before_compute(self, slot: int) -> None:
        check(driver().cuStreamWaitEvent(self.backend.stream.handle, self.copied[slot].handle, 0),
              "cuStreamWaitEvent(slot copied)")

    def after_compute(self, slot: int) -> None:
        self.freed[slot].record(self.backend.stream)

    def slot_view(self, slot: int, nbytes: int) -> DeviceArray:
        return self.slots[slot][:nbytes]

    def matrix(self, mem: DeviceArray, offset: int, nbytes: int, ggml_type: int, shape, name: str) -> CudaWeight:
        t = quants.ggml_type_of(int(ggml_type), name)
        view = DeviceArray(self.backend.pool, (nbytes,), np.uint8, base=mem.base or mem, ptr=mem.ptr + offset)
        return CudaWeight(view, t, tuple(shape), name)

    def synchronize(self) -> None:
        self.copy_stream.synchronize()
        self.backend.stream.synchronize()

    def close(self) -> None:
        self.synchronize()
        self.slots = []
