"""Hybrid execution: layers the planner put in the `cpu` tier are computed by a host backend
(the native CPU kernels) straight from their pinned-RAM bytes, while the GPU computes the rest
and the copy engine streams upcoming GPU layers into the slot ring. DRAM→CPU and DRAM→PCIe
bandwidth are then used at the same time. Activations cross PCIe only where a run of CPU
layers begins or ends (a few KB per token); each CPU layer's KV cache lives in host memory."""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np


class OnHost:
    """The hidden state while it sits in host memory between CPU-computed layers."""

    __slots__ = ("x",)

    def __init__(self, x: np.ndarray) -> None:
        self.x = x


GPU_PASS_TOKENS = 16  # a pass over more tokens streams the CPU layers to the GPU instead


class HostLayers:
    """Installs itself as `model.run_layer` / `model.settle` / `model.forward`.

    Decode and short passes (speculative verify) compute the CPU layers on the host. A long
    pass (prefill) is compute-bound, so there the CPU layers stream to the GPU like RAM-tier
    layers (from the same pinned bytes), and their new K/V rows are copied to the host cache
    afterwards, where the next decode step reads them."""

    def __init__(self, model: Any, host: Any, cpu_layers) -> None:
        self.model, self.host, self.cpu_layers = model, host, frozenset(cpu_layers)
        host.set_model(model.cfg, model.n_ctx, model.w.rope_freqs)  # the CPU layers' KV cache
        self.view = copy.copy(model)  # the same layer code over the host backend
        self.view.backend = host
        self.boundaries = 0  # activation transfers since creation (both directions)
        plan = getattr(model, "plan", None)
        self._nbytes = {p.layer: p.nbytes for p in plan.placements} if plan is not None else {}
        self.reset_stats()
        self.gpu_pass = False
        self._upload = getattr(model.backend, "from_numpy", None) or (lambda a: a)
        self._forward = model.forward
        # the native host runs a dense layer in one C call (GIL taken once per layer)
        run_block = getattr(host, "run_block", None)
        self._host_block = (lambda *a: run_block(self.view, *a)) if run_block else self.view.block
        model.run_layer, model.settle, model.forward = self.run_layer, self.settle, self.forward

    def forward(self, ids: np.ndarray, start: int, all_logits: bool = False, layers=None) -> np.ndarray:
        if len(ids) <= GPU_PASS_TOKENS or not hasattr(self.model.source, "set_active"):
            return self._forward(ids, start, all_logits, layers)
        src = self.model.source
        active = list(range(self.model.cfg.n_layers) if layers is None else layers)
        src.set_active(active, stream_cpu=True)
        self.gpu_pass = True
        try:
            out = self._forward(ids, start, all_logits, layers)
            self._copy_kv([i for i in active if i in self.cpu_layers], start, start + len(ids))
            return out
        finally:
            self.gpu_pass = False
            src.set_active(src.active_default)

    def _copy_kv(self, layers: list[int], start: int, end: int) -> None:
        """K/V rows [start, end) of CPU layers computed on the main backend -> the host cache."""
        main, host = self.model.backend, self.host
        for cache, dst in ((main.k_cache, host.k_cache), (main.v_cache, host.v_cache)):
            for i in layers:
                rows = cache[i, start:end] if isinstance(cache, np.ndarray) else main.to_numpy(cache[i][start:end])
                dst[i, start:end] = np.asarray(rows).reshape(dst[i, start:end].shape)

    def run_layer(self, i: int, lw: Any, x: Any, pos: np.ndarray, start: int) -> Any:
        if i in self.cpu_layers and not self.gpu_pass:
            if not isinstance(x, OnHost):
                x = OnHost(np.ascontiguousarray(self.model.backend.to_numpy(x), np.float32))
                self.boundaries += 1
            t0 = time.perf_counter()
            x.x = self._host_block(i, lw, x.x, pos, start)
            self.cpu_s += time.perf_counter() - t0
            self.cpu_bytes += self._nbytes.get(i, 0)
            self.cpu_calls += 1
            return x
        return self.model.block(i, lw, self.settle(x), pos, start)

    def reset_stats(self) -> None:
        self.cpu_s, self.cpu_bytes, self.cpu_calls = 0.0, 0, 0

    def stats(self) -> dict:
        """Host layer calls since the last reset: the CPU rate achieved inside the pipeline (the
        planner's probe, links.cpu_bps, should predict it)."""
        return {"calls": self.cpu_calls, "seconds": self.cpu_s, "bytes": self.cpu_bytes,
                "gb_s": self.cpu_bytes / self.cpu_s / 1e9 if self.cpu_s > 0 else None}

    def settle(self, x: Any) -> Any:
        if isinstance(x, OnHost):
            self.boundaries += 1
            return self._upload(x.x)
        return x
