"""One decode step (all layers, final norm, output matmul, argmax) captured once as a CUDA graph
and replayed per token, so Python's cost is per token instead of per kernel.

The kernels read the token id and the position from the backend's `ids_buf`/`pos_buf`, which
are written just before each replay; every buffer the capture touched is kept alive by the graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ntx_engine.backends.cuda_driver import check, download, driver, upload


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

    def forward(self, ids: np.ndarray, start: int, all_logits: bool = False, layers=None) -> np.ndarray:
        if len(ids) != 1 or all_logits or layers is not None:
            return self.model.forward(ids, start, all_logits, layers)
        self._replay(int(ids[0]), start)
        return download(self.logits, self.b.stream)

    def greedy(self, token: int, start: int) -> int:
        """Run one token at `start`; only the next token id comes back over PCIe."""
        self._replay(token, start)
        return int(download(self.token, self.b.stream)[0])

    def __getattr__(self, name: str) -> Any:  # cfg, n_ctx, backend, w: those of the model
        return getattr(self.model, name)

    def _replay(self, token: int, start: int) -> None:
        if start + 1 > self.model.n_ctx:
            self.model.forward(np.asarray([token]), start)  # raises the model's context error
        b = self.b
        upload(b.pool, np.asarray([token], np.int32), b.stream, out=b.ids_buf)
        upload(b.pool, np.asarray([start], np.int32), b.stream, out=b.pos_buf)
        b._staged = (start,)
        form = b.decode_form(start) if hasattr(b, "decode_form") else ()
        if form not in self._graphs:
            self._keep = []
            self._capture(token, start)
            self._graphs[form] = (self.exec, self.graph, self.logits, self.token, self._keep)
        self.exec, self.graph, self.logits, self.token, self._keep = self._graphs[form]
        check(driver().cuGraphLaunch(self.exec, b.stream.handle), "cuGraphLaunch(decode step)")

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
            self.token = b.argmax(self.logits)
        finally:
            b.capturing = False
            b.pool.keep = None
            graph = check(drv.cuStreamEndCapture(b.stream.handle), "cuStreamEndCapture")
        self.graph = graph
        self.exec = check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate(decode step)")
