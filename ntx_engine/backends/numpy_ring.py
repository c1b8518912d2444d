"""The numpy backend's slot ring: "VRAM" slots are host arrays and a copy is `np.copyto` on the
feeder thread, so the pipeline's ordering, staging reuse and tiers run (and are tested) on a
machine without a GPU. Weights in a slot are prepared from its bytes when the layer is acquired."""

from __future__ import annotations

import numpy as np

from ntx_engine.backends.host_memory import host_buffer, host_view


class NumpyRing:
    def __init__(self, backend, n_slots: int, slot_bytes: int) -> None:
        if n_slots < 1 or slot_bytes <= 0:
            raise ValueError(f"a ring needs slots and bytes, got {n_slots} x {slot_bytes}")
        self.backend, self.n_slots, self.slot_bytes = backend, n_slots, slot_bytes
        self.slots = [np.empty(slot_bytes, np.uint8) for _ in range(n_slots)]
        self.copies = 0

    # host memory ------------------------------------------------------------------------
    def host_buffer(self, nbytes: int, reader=None, numa_nodes=None):
        return host_buffer(nbytes, reader, cuda=False, numa_nodes=numa_nodes)

    def host_view(self, buf) -> np.ndarray:
        return host_view(buf)

    # the pipeline's hooks: copies are synchronous, so ordering needs no events ------------
    def bind_thread(self) -> None:
        pass

    def copy_in(self, slot: int, src: np.ndarray) -> None:
        np.copyto(self.slots[slot][: len(src)], src)
        self.copies += 1

    def mark_drained(self, buf: int) -> None:
        pass

    def wait_drained(self, buf: int) -> None:
        pass

    def before_compute(self, slot: int) -> None:
        pass

    def after_compute(self, slot: int) -> None:
        pass

    def slot_view(self, slot: int, nbytes: int) -> np.ndarray:
        return self.slots[slot][:nbytes]

    def matrix(self, mem: np.ndarray, offset: int, nbytes: int, ggml_type: int, shape, name: str):
        return self.backend.matrix(mem[offset:offset + nbytes], ggml_type, shape, name)

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self.slots = []
