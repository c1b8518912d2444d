"""Decode through runs of VRAM-resident layers, and through each streamed layer, as CUDA graphs
when the model also streams (tiers) or computes layers on the CPU (hybrid), where the whole step
cannot be one graph.

A decode step of such a model launches every kernel from Python (~0.5 ms a layer: about 20 ms a
token for the 38 resident layers of a 70B model under 24 GB, while the CPU layers wait for them).
Each maximal run of consecutive resident layers becomes one graph, captured on the second decode
step (the first lets the fused ops learn their activation formats, as `cuda_graph.DecodeGraph`'s
warm-up does) and replayed on every later one: the hidden state is copied into the graph's input
buffer, the position written to `pos_buf`, and the run's output comes back from the graph's own
buffer. Runs are only replayed for passes that go through all of their layers in order (a
speculative draft that skips some of them runs them one by one). A streamed layer is one more
such run, one graph per slot it is computed from (the key is the address of its first weight in
the slot ring; the stream waits for that slot's copy before the launch, as before any kernel).
NTX_CUDA_RUN_GRAPHS=0 turns all of this off; =resident keeps the resident runs only.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ntx_engine.backends.cuda_driver import DeviceArray, check, driver


def resident_runs(tiers: list[str], min_len: int = 2) -> list[list[int]]:
    """Maximal runs of consecutive layers in the `vram` tier, at least min_len long."""
    runs, cur = [], []
    for i, tier in enumerate(tiers + ["end"]):
        if tier == "vram":
            cur.append(i)
            continue
        if len(cur) >= min_len:
            runs.append(cur)
        cur = []
    return runs


class _Run:
    __slots__ = ("layers", "weights", "warm", "exec", "x_in", "x_out", "keep")

    def __init__(self, layers: list[int], weights: Any = None) -> None:
        self.layers, self.weights, self.warm, self.exec = layers, weights, False, None
        self.x_in = self.x_out = None
        self.keep: list = []


class ResidentRuns:
    """Installs itself as `model.forward` / `model.run_layer` (around what was there: the hybrid's
    HostLayers, or the Transformer's own)."""

    def __init__(self, model: Any, runs: list[list[int]], streamed: frozenset = frozenset()) -> None:
        self.model, self.b = model, model.backend
        self.runs = {r[0]: _Run(r) for r in runs}
        self.streamed = streamed  # layers computed on the GPU from a slot: a graph per (layer, slot)
        self.slot_runs: dict[tuple[int, int], _Run] = {}
        self.replays = self.slot_replays = 0  # graph launches of resident runs / streamed layers
        self._order: list[int] = []
        self._skip_to = -1  # layers up to this one were computed by the last replayed graph
        self._forward, self._run_layer = model.forward, model.run_layer
        model.forward, model.run_layer = self.forward, self.run_layer

    def forward(self, ids: np.ndarray, start: int, all_logits: bool = False, layers=None) -> np.ndarray:
        self._order = list(range(self.model.cfg.n_layers) if layers is None else layers)
        self._skip_to = -1
        return self._forward(ids, start, all_logits, layers)

    def run_layer(self, i: int, lw: Any, x: Any, pos: np.ndarray, start: int) -> Any:
        if i <= self._skip_to:
            return x  # inside the run the graph just computed
        run = self.runs.get(i)
        if run is None and i in self.streamed and len(pos) == 1:
            run = self._slot_run(i, lw)
        if run is None or len(pos) != 1 or not self._whole(run, i):
            return self._run_layer(i, lw, x, pos, start)
        x = self.model.settle(x)  # on the GPU (the run may follow CPU layers)
        if not run.warm:  # first decode step: one by one, so the fused ops learn their formats
            run.warm = True
            return self._run_layer(i, lw, x, pos, start)
        self.b.flush()  # a held-back add that produced x runs before the graph reads x
        if run.exec is None:
            self._capture(run, x, pos, start)
        self._replay(run, x, pos)
        self._skip_to = run.layers[-1]
        return run.x_out

    def _slot_run(self, i: int, lw: Any) -> _Run | None:
        """The one-layer run of streamed layer i over the slot its weights are in now."""
        key = (i, int(lw.wq.data.ptr))
        run = self.slot_runs.get(key)
        if run is None:
            run = self.slot_runs[key] = _Run([i], lw)
        return run

    def _whole(self, run: _Run, i: int) -> bool:
        k = self._order.index(i) if i in self._order else -1
        return k >= 0 and self._order[k:k + len(run.layers)] == run.layers

    def _copy_in(self, run: _Run, x: DeviceArray) -> None:
        check(driver().cuMemcpyDtoDAsync(run.x_in.ptr, x.ptr, x.nbytes, self.b.stream.handle),
              "cuMemcpyDtoDAsync(resident run input)")

    def _capture(self, run: _Run, x: DeviceArray, pos: np.ndarray, start: int) -> None:
        drv, b, source = driver(), self.b, self.model.source
        run.x_in = DeviceArray(b.pool, x.shape, x.dtype)
        run.keep.append(run.x_in)
        b._stage_positions(pos)
        b.pool.keep = run.keep
        b.capturing = True
        check(drv.cuStreamBeginCapture(b.stream.handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
              "cuStreamBeginCapture(resident run)")
        try:
            y = run.x_in
            for j in run.layers:
                y = self.model.block(j, run.weights if run.weights is not None else source.resident[j], y, pos, start)
            b.flush()  # the run's last add belongs to the graph
            run.x_out = y
        finally:
            b.capturing = False
            b.pool.keep = None
            graph = check(drv.cuStreamEndCapture(b.stream.handle), "cuStreamEndCapture(resident run)")
        run.exec = check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate(resident run)")
        run.keep.append(graph)

    def _replay(self, run: _Run, x: DeviceArray, pos: np.ndarray) -> None:
        b = self.b
        self._copy_in(run, x)
        b._stage_positions(pos)
        check(driver().cuGraphLaunch(run.exec, b.stream.handle), "cuGraphLaunch(resident run)")
        b.forget_inputs()  # the graph's buffers are rewritten by every replay
        # (the pass's loop still acquires each layer: the per-tier bytes count it)
        if run.weights is None:
            self.replays += 1
        else:
            self.slot_replays += 1


def install(model: Any, tiers: list[str]) -> ResidentRuns | None:
    """ResidentRuns over model when it decodes on CUDA with streamed or CPU layers, unless
    NTX_CUDA_RUN_GRAPHS=0; None when there is no run of resident layers to capture."""
    mode = os.environ.get("NTX_CUDA_RUN_GRAPHS", "1")
    if mode == "0" or model.cfg.is_moe or not hasattr(model.source, "resident"):
        return None
    runs = resident_runs(tiers)
    streamed = frozenset(i for i, t in enumerate(tiers) if t in ("ram", "storage")) if mode != "resident" \
        else frozenset()
    return ResidentRuns(model, runs, streamed) if runs or streamed else None
