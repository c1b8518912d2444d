"""One decode step (all layers, final norm, output matmul, argmax) captured once as a CUDA graph
and replayed per token, so Python's cost is per token instead of per kernel.

The kernels read the token id and the position from the backend's `ids_buf`/`pos_buf`, which
are written just before each replay; every buffer the capture touched is kept alive by the graph.
The step's last kernel (the argmax) also writes its token into `ids_buf` and advances `pos_buf`,
so `greedy_stream` queues the next step before the host has read this one's token: the host's
round trip (read the token, write the next inputs, launch) leaves the GPU's critical path. The
argmax also writes the token into page-locked host memory the device maps, at the step's position
(`_hist`), so the stream holds nothing between two steps (a 4-byte copy there cost ~45 us a step).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ntx_engine.backends.cuda_driver import Event, HostSlots, check, download, driver, upload


class DecodeGraph:
    """Wraps a `model.Transformer` on a CudaBackend; `forward` has the Transformer's signature."""

    def __init__(self, model: Any) -> None:
        self.model, self.b = model, model.backend
        self.exec = self.graph = None
        self.logits = None  # (1, vocab) device array written by each replay
        self.token = None  # (1,) int32 device array: argmax of the logits
        self._keep: list = []
        # one capture for each decode form the steps have needed (the backend's decode_form: e.g.
        # the attention's cluster form at short contexts, its grid form at long ones)
        self._graphs: dict[tuple, tuple] = {}
        # every step's token by position, written by the graph's argmax (mapped host memory, n_ctx words)
        self._hist = HostSlots(model.n_ctx)
        self._events: list[Event] = []  # greedy_stream's: two steps in flight

    def forward(self, ids: np.ndarray, start: int, all_logits: bool = False, layers=None) -> np.ndarray:
        if len(ids) != 1 or all_logits or layers is not None:
            return self.model.forward(ids, start, all_logits, layers)
        self._replay(int(ids[0]), start)
        return download(self.logits, self.b.stream)

    def greedy(self, token: int, start: int) -> int:
        """Run one token at `start`; only the next token id comes back over PCIe."""
        self._replay(token, start)
        return int(download(self.token, self.b.stream)[0])

    def greedy_stream(self, token: int, start: int, n: int) -> Iterator[int]:
        """The next n greedy tokens after `token` at position `start`, as greedy() gives them one at a
        time, with the next step queued on the GPU before this one's token is read: a step whose
        position keeps the decode form (and fits the context) starts from the token and position the
        step before left on the device. A consumer that stops early leaves at most one step computed
        past its last token (its K/V row lies beyond the tokens it kept)."""
        if n <= 0:
            return
        if not self._events:
            self._events = [Event(), Event()]
        self._replay(token, start)
        self._events[0].record(self.b.stream)
        for i in range(n):
            pos = start + i + 1  # the position of the step after step i
            ahead = i + 1 < n and pos + 1 <= self.model.n_ctx and self._fed(pos)
            if ahead:  # the token of step i is on the device already: queue step i + 1 now
                self._launch(pos)
                self._events[(i + 1) % 2].record(self.b.stream)
            self._events[i % 2].synchronize()
            tok = int(self._hist.values[pos - 1])  # step i's (the argmax wrote it at its position)
            yield tok
            if i + 1 < n and not ahead:
                self._replay(tok, pos)
                self._events[(i + 1) % 2].record(self.b.stream)

    def run_fed(self, start: int, n: int) -> int:
        """Up to n steps from `start` queued back to back, each from the token and position the step before left
        on the device (a benchmark's GPU-only time: nothing is read back; the tokens land in the step history),
        after a step at start - 1 (greedy, greedy_stream); it stops before a step that needs another decode form or
        lies past the context. Returns the steps queued."""
        for i in range(n):
            if start + i + 1 > self.model.n_ctx or not self._fed(start + i):
                return i
            self._launch(start + i)
        return n

    def _form(self, start: int) -> tuple:
        """The backend's decode form at start (the key of the captured steps)."""
        return self.b.decode_form(start) if hasattr(self.b, "decode_form") else ()

    def _fed(self, pos: int) -> bool:
        """Whether a step at pos may replay the graph the last step ran (the same decode form)."""
        return self._graphs.get(self._form(pos), (None,))[0] is self.exec

    def __getattr__(self, name: str) -> Any:  # cfg, n_ctx, backend, w: those of the model
        return getattr(self.model, name)

    def _replay(self, token: int, start: int) -> None:
        if start + 1 > self.model.n_ctx:
            self.model.forward(np.asarray([token]), start)  # raises the model's context error
        b = self.b
        upload(b.pool, np.asarray([token], np.int32), b.stream, out=b.ids_buf)
        upload(b.pool, np.asarray([start], np.int32), b.stream, out=b.pos_buf)
        b._staged = (start,)
        form = self._form(start)
        if form not in self._graphs:
            self._keep = []
            self._capture(token, start)
            self._graphs[form] = (self.exec, self.graph, self.logits, self.token, self._keep)
        self.exec, self.graph, self.logits, self.token, self._keep = self._graphs[form]
        self._launch(start)

    def _launch(self, start: int) -> None:
        """Replay the current graph for the step at `start` (its inputs already on the device)."""
        check(driver().cuGraphLaunch(self.exec, self.b.stream.handle), "cuGraphLaunch(decode step)")
        self.b._staged = (start + 1,)  # the step's argmax advanced pos_buf

    def _capture(self, token: int, start: int) -> None:
        drv, b = driver(), self.b
        # one step kernel by kernel first: the fused ops learn their activation formats from the
        # matmuls that read them (a prefill's GEMMs ask for none), so the graph holds every fusion;
        # the replay after the capture recomputes this token and writes the same K/V rows again
        self.model.forward(np.asarray([token]), start)
        b.pool.keep = self._keep
        b.capturing = True
        check(drv.cuStreamBeginCapture(b.stream.handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
              "cuStreamBeginCapture")
        try:
            self.model.forward(np.asarray([token]), start)
            self.logits = b.captured_output
            self.token = b.argmax(self.logits, feed=True, hist=self._hist)
        finally:
            b.capturing = False
            b.pool.keep = None
            graph = check(drv.cuStreamEndCapture(b.stream.handle), "cuStreamEndCapture")
        self.graph = graph
        self.exec = check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate(decode step)")
