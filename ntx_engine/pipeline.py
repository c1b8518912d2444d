"""The streaming pipeline: layers that live in pinned RAM or on storage flow through an N-slot
ring in device memory while the model computes.

Three actors work at once, each on a later layer than the next:

    reader thread   storage -> pinned staging buffer   (layer L+2, several reads in flight)
    feeder thread   staging / pinned RAM -> ring slot  (layer L+1, on the copy stream)
    caller          compute                             (layer L, on the compute stream)

Streamed layers are loaded in a fixed cyclic order (the streamed layers of a pass, in model
order, pass after pass), so load number k always goes to slot k % N and reads staging buffer
q % M. Hand-offs are counters under one condition variable; on the GPU, ordering between the
copy and compute streams is by events (see `backends/*_ring.py`). Every wait has a deadline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ntx_common.errors import ModelError, NtxIOError
from ntx_engine.layout import LayerSpan
from ntx_engine.model import close_owned_reader

STALL_S = 120.0  # no progress for this long = the pipeline is stuck (dead disk, lost GPU)
IO_ALIGN = 4096  # O_DIRECT and NVMe reads start and end on this boundary
STREAMED = ("ram", "storage")  # tiers whose layers pass through the slot ring
READ_DEPTH = 2  # layer reads in flight at once (each cut into the reader's own requests)


@dataclass
class PipelineStats:
    """Counters since the last `reset`; the engine reports them per run."""

    passes: int = 0
    bytes: dict = field(default_factory=lambda: {"vram": 0, "ram": 0, "storage": 0, "cpu": 0})
    io_s: float = 0.0  # reader thread busy reading
    wait_s: float = 0.0  # caller blocked waiting for a layer to be enqueued
    timeline: list = field(default_factory=list)  # last pass: {layer, kind, start_s, end_s}

    def as_dict(self) -> dict:
        return {"passes": self.passes, "bytes": dict(self.bytes), "io_s": self.io_s, "wait_s": self.wait_s}


class StreamingLayers:
    """`Transformer.source` for a plan with streamed layers. `ring` is the backend's slot ring;
    `resident` holds the VRAM-tier LayerWeights; `pinned` the RAM-tier spans' bytes (numpy
    uint8); storage-tier spans are read with `reader` at `base_offset + span.start`."""

    def __init__(self, spans: list[LayerSpan], tiers: list[str], ring: Any, resident: dict[int, Any],
                 pinned: dict[int, np.ndarray], make_weights: Callable[[int, Any], Any], *,
                 reader: Any = None, base_offset: int = 0, n_staging: int = 0, source_size: int = 0) -> None:
        self.spans, self.tiers, self.ring = spans, tiers, ring
        self.resident, self.pinned, self.make_weights = resident, pinned, make_weights
        self.reader, self.base_offset, self.source_size = reader, base_offset, source_size
        self.stats = PipelineStats()
        self._cv = threading.Condition()
        self._staging = [ring.host_buffer(max(s.nbytes for s in spans) + 2 * IO_ALIGN, reader)
                         for _ in range(n_staging)] if n_staging else []
        self._threads: list[threading.Thread] = []
        self._t0 = time.perf_counter()
        self.set_active(range(len(spans)))

    # --- configuration -------------------------------------------------------------------
    def set_active(self, layers, *, stream_cpu: bool = False) -> None:
        """The layers a forward pass runs (skip drops streamed layers: they are then not read).
        stream_cpu: CPU-tier layers stream to the GPU too (a long prefill is faster there)."""
        self.stop()
        self.active, self.stream_cpu = list(layers), stream_cpu
        if not stream_cpu:
            self.active_default = self.active  # what a long pass restores afterwards
        self.schedule = [i for i in self.active if self._streams(i)]
        self._storage_schedule = [i for i in self.schedule if self.tiers[i] == "storage"]
        self._loaded = self._released = self._read = 0  # loads enqueued / released; storage reads done
        self._next = 0  # the next load the caller will acquire
        self._drained = [0] * len(self._staging)  # per staging buffer: reads that may be overwritten
        self._staged: dict[int, tuple[int, int]] = {}  # storage read q -> (buffer, lead bytes)
        self._failure: BaseException | None = None
        self._stopping = False
        if self.schedule:
            self._start()

    def _start(self) -> None:
        self._threads = [threading.Thread(target=self._guard(self._feed), name="ntx-feeder", daemon=True)]
        if self._storage_schedule:
            self._threads.append(threading.Thread(target=self._guard(self._read_ahead), name="ntx-reader", daemon=True))
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=STALL_S)
        self._threads = []
        if hasattr(self, "ring"):
            self.ring.synchronize()

    def close(self) -> None:
        """Stop the threads, then give back the pinned memory (unregistered from CUDA and the
        VFIO container before it is unmapped: a stale registration would shadow later
        allocations) and the ring."""
        self.stop()
        buffers = list(getattr(self, "pinned_buffers", [])) + list(self._staging)
        self.pinned, self._staging, self.pinned_buffers, self.resident = {}, [], [], {}
        for buf in buffers:
            if hasattr(buf, "close"):
                try:
                    buf.close()
                except NtxIOError:  # a caller still holds weights over it: unregistered already,
                    pass  # the memory itself goes when the last view does
        self.ring.close()
        close_owned_reader(self)  # a reader tiers.build opened for this model

    def begin(self, layers) -> None:
        """Called at the start of every pass: when it streams a different set of layers than the
        cycle (layer skip, a perplexity run with skip), or the last pass stopped midway (an
        error), restart the cycle on this pass's set. A pass that streams nothing (a
        speculative draft over resident layers) leaves the cycle alone."""
        wanted = [i for i in layers if self._streams(i)]
        aborted = self.schedule and self._next % len(self.schedule)  # a pass that raised midway
        if wanted and (wanted != self.schedule or aborted):
            self.set_active(layers, stream_cpu=self.stream_cpu)

    def _streams(self, i: int) -> bool:
        return self.tiers[i] in STREAMED or (self.stream_cpu and self.tiers[i] == "cpu")

    # --- the caller's side (Transformer.forward) -----------------------------------------
    def acquire(self, i: int) -> Any:
        tier = self.tiers[i]
        if not self._streams(i):  # VRAM-resident, or computed on the CPU from pinned RAM
            self.stats.bytes[tier] += self.spans[i].nbytes
            return self.resident[i]
        k = self._next
        expected = self.schedule[k % len(self.schedule)] if self.schedule else None
        if expected != i:
            raise ModelError(f"layer {i} was requested but the pipeline streams layer {expected} next; "
                             "a pass must run the active streamed layers in order (set_active)")
        t0 = time.perf_counter()
        self._wait(lambda: self._loaded > k, f"layer {i} to be copied in")
        self.stats.wait_s += time.perf_counter() - t0
        slot = k % self.ring.n_slots
        self.ring.before_compute(slot)
        self.stats.bytes[tier] += self.spans[i].nbytes
        self._mark(i, "compute", t0)
        return self.make_weights(i, self.ring.slot_view(slot, self.spans[i].nbytes))

    def release(self, i: int) -> None:
        if not self._streams(i):
            return
        slot = self._next % self.ring.n_slots
        self.ring.after_compute(slot)
        self._next += 1
        if self._next % len(self.schedule) == 0:
            self.stats.passes += 1
        with self._cv:
            self._released = self._next
            self._cv.notify_all()

    # --- feeder: pinned RAM or staging -> slot -------------------------------------------
    def _feed(self) -> None:
        self.ring.bind_thread()
        k, q = 0, 0
        n = self.ring.n_slots
        while True:
            i = self.schedule[k % len(self.schedule)]
            if not self._wait(lambda: self._released >= k - n + 1, f"slot {k % n} to be free", feeder=True):
                return
            if self.tiers[i] == "storage":
                if not self._wait(lambda: self._read > q, f"layer {i} to be read from storage", feeder=True):
                    return
                buf, lead = self._staged.pop(q)
                src = self._staging_view(buf)[lead:lead + self.spans[i].nbytes]
                t0 = time.perf_counter()
                self.ring.copy_in(k % n, src)
                self.ring.mark_drained(buf)
                with self._cv:
                    self._drained[buf] = q + 1
                    self._cv.notify_all()
                q += 1
            else:
                t0 = time.perf_counter()
                self.ring.copy_in(k % n, self.pinned[i])
            self._mark(i, "h2d", t0)
            k += 1
            with self._cv:
                self._loaded = k
                self._cv.notify_all()

    # --- reader: storage -> staging ------------------------------------------------------
    def _read_ahead(self) -> None:
        """Up to READ_DEPTH layer reads in flight (a layer's read alone leaves the disk's queue
        half empty at its tail), each into its own staging buffer, handed over in order."""
        self.ring.bind_thread()  # waits on the GPU's copy-done events
        m, order = len(self._staging), self._storage_schedule
        inflight: deque = deque()  # (q, buffer, lead, handle, t0)
        q = 0
        while True:
            if self._stopping:
                for _, _, _, handle, _ in inflight:  # never leave a read landing in freed memory
                    self.reader.wait(handle, timeout=STALL_S)
                return
            while len(inflight) < min(READ_DEPTH, m) and (q < m or self._drained[q % m] >= q - m + 1):
                buf = q % m
                if q >= m:
                    self.ring.wait_drained(buf)  # the copy out of this buffer has finished on the GPU
                i = order[q % len(order)]
                lead, handle = self._submit_span(self.spans[i], self._staging_view(buf))
                inflight.append((q, buf, lead, handle, time.perf_counter()))
                q += 1
            if not inflight:  # every staging buffer still feeds a copy: wait for one to drain
                if not self._wait(lambda: self._drained[q % m] >= q - m + 1, f"staging buffer {q % m}", feeder=True):
                    return
                continue
            done, buf, lead, handle, t0 = inflight.popleft()
            self._finish(handle, done)
            self._evict(self.spans[order[done % len(order)]])
            self.stats.io_s += time.perf_counter() - t0
            self._mark(order[done % len(order)], "io", t0)
            with self._cv:
                self._staged[done] = (buf, lead)
                self._read = done + 1
                self._cv.notify_all()

    def _submit_span(self, span: LayerSpan, dest: np.ndarray) -> tuple[int, Any]:
        """Start reading span's bytes (widened to IO_ALIGN) into dest; (where the span starts in
        dest, the reader's handle)."""
        start = self.base_offset + span.start
        lo = start - start % IO_ALIGN
        hi = -(-(self.base_offset + span.end) // IO_ALIGN) * IO_ALIGN
        if self.source_size:
            hi = min(hi, self.source_size)
        return start - lo, self.reader.submit([(lo, hi - lo, dest[: hi - lo])])

    def _evict(self, span: LayerSpan) -> None:
        """Buffered (mmap) reads leave the span in the page cache: drop it, so storage-tier
        layers do not quietly occupy RAM the budget did not give them."""
        if getattr(self.reader, "name", "") == "mmap":
            from ntx_engine.links import evict

            evict(self.reader.source, [(self.base_offset + span.start, span.nbytes)])

    def _finish(self, handle: Any, q: int) -> None:
        deadline = time.monotonic() + STALL_S
        while not self.reader.wait(handle, timeout=1.0):
            if time.monotonic() > deadline:
                raise NtxIOError(f"storage read {q} did not finish within {STALL_S:.0f} s ({self.reader.source})")

    def _staging_view(self, buf: int) -> np.ndarray:
        return self.ring.host_view(self._staging[buf])

    # --- plumbing ------------------------------------------------------------------------
    def _guard(self, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # handed to the caller's next wait
                with self._cv:
                    self._failure = exc
                    self._cv.notify_all()
        return run

    def _wait(self, ready: Callable[[], bool], what: str, feeder: bool = False) -> bool:
        """Block until ready(); False when stopping (threads), raise on failure or stall."""
        deadline = time.monotonic() + STALL_S
        with self._cv:
            while not ready():
                if self._stopping and feeder:
                    return False
                if self._failure is not None and not feeder:
                    exc = self._failure
                    raise NtxIOError(f"streaming failed while waiting for {what}: {exc}") from exc
                if time.monotonic() > deadline:
                    raise NtxIOError(f"streaming stalled: waited {STALL_S:.0f} s for {what}")
                self._cv.wait(timeout=0.5)
        return not (self._stopping and feeder)

    def _mark(self, layer: int, kind: str, t0: float) -> None:
        now = time.perf_counter()
        tl = self.stats.timeline
        tl.append({"layer": layer, "kind": kind, "start_s": t0 - self._t0, "end_s": now - self._t0})
        if len(tl) > 4096:
            del tl[:2048]

    def reset_stats(self) -> None:
        self.stats = PipelineStats()
        self._t0 = time.perf_counter()
