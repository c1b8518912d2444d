"""Expert offload for mixture-of-experts models (docs/moe.md, "Expert offload").

The dense part of every layer is loaded resident as usual; the routed experts' bytes stay in
host memory (`ExpertStore`: pinned RAM, or the file when the RAM budget is short). Per MoE
layer, after routing, the selected experts' ids come to the host (one small D2H on CUDA, so
decode is not captured in a CUDA graph in this mode) and either

- `gpu`: the `ExpertCache` says which selected experts are already in a VRAM cache slot;
  misses copy that expert's gate/up/down bytes into a slot (on the copy stream, ordered by
  events on CUDA; on numpy the "device" is host memory as in numpy_ring) and the routed
  matvecs read the slots: ids are rewritten to slot indices, so the kernels are the resident
  ones. More distinct experts than slots (prefill) are done in groups of at most n_slots.
- `cpu`: the host backend (native CPU kernels next to a GPU) computes the selected experts
  from their RAM bytes; h goes down and (n, used, n_embd) comes back.

Both give the resident run's numbers: the same products over the same bytes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import numpy as np

from ntx_common.errors import ModelError, UsageError
from ntx_engine.expert_cache import CacheStats, ExpertCache
from ntx_engine.moe import Experts, MoeTransformer, MoeWeightLoader, NumpyMoe, make_ops
from ntx_engine.moe_plan import ExpertPlan, MoeOffloadPlan, make_expert_plan
from ntx_engine.model import ResidentLayers

class ExpertStore:
    """The expert tensors of every layer in host memory: pinned copies for RAM-tier layers,
    the file's bytes (read on demand into a staging buffer) for storage-tier ones."""

    def __init__(self, gf: Any, layers: list, plan: ExpertPlan, cuda: bool) -> None:
        from ntx_engine.backends.host_memory import host_buffer, host_view

        self.gf, self.plan, self.layers = gf, plan, layers  # layers: MoeLayerWeights with .where only
        self.buffers: list = []
        self.tensors: dict[tuple[int, int], np.ndarray] = {}
        for i, lw in enumerate(layers):
            for p, ex in enumerate(_experts(lw)):
                if plan.expert_tiers[i] == "ram":
                    buf = host_buffer(ex.where.expert_nbytes * ex.where.n_expert, cuda=cuda)
                    view = host_view(buf)[: ex.where.expert_nbytes * ex.where.n_expert]
                    np.copyto(view, gf.tensor_data(ex.where.name))
                    self.buffers.append(buf)
                    self.tensors[i, p] = view
                else:
                    self.tensors[i, p] = gf.tensor_data(ex.where.name)  # the page cache, if anything
        staging = max(sum(ex.where.expert_nbytes for ex in _experts(lw)) for lw in layers)
        self._staging_buf = host_buffer(staging, cuda=cuda) if "storage" in plan.expert_tiers else None
        self.staging = host_view(self._staging_buf) if self._staging_buf is not None else None

    def tensor(self, i: int, p: int) -> np.ndarray:
        return self.tensors[i, p]

    def parts(self, i: int, e: int) -> tuple[tuple[np.ndarray, ...], bool]:
        """Expert e of layer i: (gate, up, down bytes, whether they sit in the staging buffer)."""
        lw = self.layers[i]
        views, staged, at = [], self.plan.expert_tiers[i] == "storage", 0
        for p, ex in enumerate(_experts(lw)):
            n = ex.where.expert_nbytes
            src = self.tensors[i, p][e * n:(e + 1) * n]
            if staged:  # read the range now; drop it from the page cache: storage is storage
                dst = self.staging[at:at + n]
                np.copyto(dst, src)
                _evict(self.gf, ex.where.expert_range(e))
                src, at = dst, at + n
            views.append(src)
        return tuple(views), staged

    def close(self) -> None:
        self.tensors = {}
        for buf in self.buffers + ([self._staging_buf] if self._staging_buf is not None else []):
            if hasattr(buf, "close"):
                buf.close()
        self.buffers, self._staging_buf, self.staging = [], None, None


def _experts(lw: Any) -> tuple:
    return lw.gate_exps, lw.up_exps, lw.down_exps


def _evict(gf: Any, rng: tuple[int, int]) -> None:
    if gf.reader is None:
        fd = os.open(gf.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, rng[0], rng[1], os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class NumpyExpertSlots:
    """The expert cache's storage on the numpy / native CPU backends: host arrays standing for
    VRAM, a fill is a copy, and each slot's weights are built over its bytes when filled."""

    def __init__(self, backend: Any, n_slots: int, wheres: tuple) -> None:
        import dataclasses

        self.b, self.n_slots = backend, n_slots
        self.wheres = [dataclasses.replace(w, n_expert=n_slots, offset=0) for w in wheres]
        self.arrays = [np.empty(n_slots * w.expert_nbytes, np.uint8) for w in self.wheres]
        self.experts = [Experts(w, [None] * n_slots) for w in self.wheres]

    def fill(self, slot: int, parts: tuple) -> None:
        for arr, w, ex, src in zip(self.arrays, self.wheres, self.experts, parts):
            n = w.expert_nbytes
            if src.nbytes != n:
                raise ModelError(f"{w.name}: expert of {src.nbytes} bytes for a {n}-byte cache slot")
            dst = arr[slot * n:(slot + 1) * n]
            np.copyto(dst, src)
            ex.data[slot] = self.b.matrix(dst, w.ggml_type, (w.rows, w.k), f"{w.name}[slot {slot}]")

    def before_compute(self, slots) -> None:
        pass

    def after_compute(self, slots) -> None:
        pass

    def wait_copies(self) -> None:
        pass

    def ids(self, slot_ids: np.ndarray) -> np.ndarray:
        return slot_ids

    def close(self) -> None:
        self.arrays, self.experts = [], []


def make_slots(backend: Any, n_slots: int, wheres: tuple) -> Any:
    if backend.name == "cuda":
        from ntx_engine.backends.cuda_moe import CudaExpertSlots

        return CudaExpertSlots(backend, n_slots, wheres)
    return NumpyExpertSlots(backend, n_slots, wheres)


class SlotPool:
    """An expert cache and its slots for the layers whose experts share one layout (type and
    shape of gate/up/down): the kernels address slot j at j x the expert's bytes."""

    def __init__(self, backend: Any, n_slots: int, policy: str, wheres: tuple, layers: list[int]) -> None:
        self.layers, self.wheres = layers, wheres
        self.cache = ExpertCache(n_slots, policy)
        self.slots = make_slots(backend, n_slots, wheres)


def _layout(lw: Any) -> tuple:
    return tuple((int(ex.where.ggml_type), ex.where.rows, ex.where.k) for ex in _experts(lw))


def make_pools(backend: Any, plan: ExpertPlan, layers: list, policy: str) -> list[SlotPool]:
    """One pool per expert layout among the GPU-side layers (llama.cpp's Q4_K_M gives some
    layers' ffn_down Q6_K and others Q4_K); slots shared out by layer count, each pool at
    least n_used (so the total can exceed plan.n_slots by a little)."""
    groups: dict[tuple, list[int]] = {}
    for i in plan.layers_on("gpu"):
        groups.setdefault(_layout(layers[i]), []).append(i)
    n_gpu, members = len(plan.layers_on("gpu")), list(groups.values())
    shares = [plan.n_slots * len(ls) // n_gpu for ls in members]
    for j in range(plan.n_slots - sum(shares)):  # the rounding remainder, one slot per pool
        shares[j % len(shares)] += 1
    return [SlotPool(backend, max(plan.n_used, n), policy, tuple(ex.where for ex in _experts(layers[ls[0]])), ls)
            for n, ls in zip(shares, members)]


class ExpertOffload:
    """`MoeTransformer.offload`: computes a layer's routed experts from the cache or the CPU."""

    def __init__(self, backend: Any, host: Any, plan: ExpertPlan, store: ExpertStore, layers: list) -> None:
        self.b, self.host, self.plan, self.store = backend, host, plan, store
        self.moe = make_ops(backend)
        self.sides = list(plan.sides)
        self.pools = make_pools(backend, plan, layers, plan.policy) if plan.n_slots else []
        self.pool_of = {i: p for p in self.pools for i in p.layers}
        self.host_moe = NumpyMoe(host) if host is not None else None
        self.host_experts: dict[int, tuple] = {}
        for i in plan.layers_on("cpu"):
            self._host_layer(i)
        self.prefetcher = None  # moe_prefetch.Prefetcher when the experiment is on
        self.reset_stats()

    def _host_layer(self, i: int) -> None:
        self.host_experts[i] = tuple(Experts(ex.where, self.host_moe.experts(self.store.tensor(i, p), ex.where))
                                     for p, ex in enumerate(_experts(self.store.layers[i])))

    # --- the forward pass's hook ---------------------------------------------------------
    def routed(self, i: int, h: Any, ids: Any) -> Any:
        """(n, used, n_embd) on the main backend: each token's selected experts' down outputs."""
        ids_h = np.asarray(self.b.to_numpy(ids), np.int32)
        if i == self._first:
            self.tokens += ids_h.shape[0]
        self.selections[self.sides[i]] += ids_h.size
        if self.sides[i] == "cpu":
            return self._on_cpu(i, h, ids_h)
        down = self._on_gpu(i, h, ids_h)
        if self.prefetcher is not None and ids_h.shape[0] == 1:
            self.prefetcher.after_layer(i, h)
        return down

    def _on_gpu(self, i: int, h: Any, ids: np.ndarray) -> Any:
        m, uniq, pool = self.moe, np.unique(ids), self.pool_of[i]
        n = pool.cache.n_slots
        groups = [uniq[j:j + n] for j in range(0, len(uniq), n)]
        gate_ex, up_ex, down_ex = pool.slots.experts
        gate = up = down = None
        acquired = []
        for g in groups:
            sid, used = self._acquire(pool, i, g, ids)
            gate, up = m.routed(gate_ex, h, sid, out=gate), m.routed(up_ex, h, sid, out=up)
            pool.slots.after_compute(used)
            acquired.append((sid, used))
        act = self.b.swiglu(gate, up)
        for j in reversed(range(len(groups))):  # the last group is still cached: down hits
            sid, used = acquired[j] if len(groups) == 1 else self._acquire(pool, i, groups[j], ids)
            down = m.routed(down_ex, act, sid, out=down)
            pool.slots.after_compute(used)
        return down

    def _acquire(self, pool: SlotPool, i: int, group: np.ndarray, ids: np.ndarray) -> tuple[Any, list[int]]:
        """The group's experts in slots (misses copied in); ids as slot indices, -1 outside."""
        slots, fills = pool.cache.acquire(i, group)
        if self.prefetcher is not None:
            self.prefetcher.looked_up(i, group, fills)
        for e, slot in fills:
            parts, staged = self.store.parts(i, e)
            pool.slots.fill(slot, parts)
            pool.cache.stats.copied_bytes += sum(p.nbytes for p in parts)
            if staged:  # the staging buffer is reused by the next storage read
                pool.slots.wait_copies()
        used = list(slots.values())
        pool.slots.before_compute(used)
        sid = np.full(ids.shape, -1, np.int32)
        for e, slot in slots.items():
            sid[ids == e] = slot
        return pool.slots.ids(sid), used

    def _on_cpu(self, i: int, h: Any, ids: np.ndarray) -> Any:
        host, m = self.host, self.host_moe
        hh = h if host is self.b else np.ascontiguousarray(self.b.to_numpy(h), np.float32)
        gate, up, down = self.host_experts[i]
        act = host.swiglu(m.routed(gate, hh, ids), m.routed(up, hh, ids))
        y = m.routed(down, act, ids)
        return y if host is self.b else self.b.from_numpy(y)

    # --- stats and control ---------------------------------------------------------------
    def reset_stats(self) -> None:
        self.tokens, self.selections = 0, {"gpu": 0, "cpu": 0}
        self._first = 0
        for p in self.pools:
            p.cache.reset_stats()
        if self.prefetcher is not None:
            self.prefetcher.reset()

    def cache_stats(self) -> CacheStats | None:
        if not self.pools:
            return None
        total = CacheStats()
        for p in self.pools:
            total.layers.update(p.cache.stats.layers)
            total.copied_bytes += p.cache.stats.copied_bytes
        return total

    def stats(self) -> dict:
        """Counters since the last reset (per generate())."""
        cs = self.cache_stats()
        cache = cs.as_dict() if cs is not None else None
        copied = cs.copied_bytes if cs is not None else 0
        per_tok = (lambda n: n / self.tokens if self.tokens else None)
        return {"policy": self.plan.policy if self.pools else None,
                "slots": sum(p.cache.n_slots for p in self.pools), "slot_bytes": self.plan.slot_bytes,
                "layers_gpu": self.sides.count("gpu"), "layers_cpu": self.sides.count("cpu"),
                "tokens": self.tokens, "selections": dict(self.selections), "cache": cache,
                "h2d_bytes_per_token": per_tok(copied),
                "cpu_bytes_per_token": per_tok(self.selections["cpu"] * self.plan.slot_bytes),
                "prefetch": self.prefetcher.stats() if self.prefetcher is not None else None}

    def configure(self, policy: str | None = None, side: str | None = None, prefetch: bool | None = None) -> None:
        """Switch the cache policy (the caches start empty), the side of every layer, or the
        prefetch experiment (the benchmark compares modes on one loaded model)."""
        if prefetch is not None:
            from ntx_engine.moe_prefetch import Prefetcher

            routers = [lw.router for lw in self.store.layers]
            self.prefetcher = Prefetcher(self, routers, self.plan.n_used, False) if prefetch else None
        if policy is not None:
            for p in self.pools:
                p.cache = ExpertCache(p.cache.n_slots, policy)
            self.plan = dataclasses.replace(self.plan, policy=policy)
        if side is not None:
            if side == "gpu" and set(self.pool_of) != set(range(len(self.sides))):
                raise UsageError("this model was planned without an expert cache for every layer: "
                                 "no GPU side to switch to")
            if side == "cpu" and self.host_moe is None:
                raise UsageError("no host backend computes experts here (native CPU kernels missing)")
            for i in range(len(self.sides)):
                if side == "cpu" and i not in self.host_experts:
                    self._host_layer(i)
                self.sides[i] = side
        self.reset_stats()

    def close(self) -> None:
        for p in self.pools:
            p.slots.close()
        self.pools, self.pool_of, self.host_experts = [], {}, {}
        self.store.close()
        if self.host is not None and self.host is not self.b and hasattr(self.host, "close"):
            self.host.close()


class OffloadedLayers(ResidentLayers):
    """`Transformer.source`: dense parts resident; stats reset and cleanup reach the offload."""

    def __init__(self, layers: list, offload: ExpertOffload) -> None:
        super().__init__(layers)
        self.offload = offload

    def reset_stats(self) -> None:
        self.offload.reset_stats()

    def close(self) -> None:
        self.offload.close()


def wants_offload(ecfg: Any) -> bool:
    """Options that ask for the offload even when everything would fit."""
    return ecfg.expert_slots is not None or ecfg.moe_experts != "auto"


def load_offloaded(gf: Any, cfg: Any, backend: Any, ecfg: Any, n_ctx: int,
                   progress: Callable[[int, int], None] | None = None) -> MoeTransformer | None:
    """The MoE model with its experts offloaded, or None when the planner would keep every
    layer resident (and no option asks for the offload)."""
    if not needs_offload(gf, cfg, backend, ecfg, n_ctx):
        return None
    host = host_for(backend, ecfg)
    plan = plan_offload(gf, cfg, backend, ecfg, n_ctx, host)
    loader = MoeWeightLoader(gf, cfg, backend)
    weights = loader.load(progress, layers=[])
    weights.layers = [loader.layer(i, experts=False) for i in range(cfg.n_layers)]
    store = ExpertStore(gf, weights.layers, plan.experts, cuda=backend.name == "cuda")
    model = MoeTransformer(cfg, weights, backend, n_ctx)
    model.plan = plan
    model.offload = ExpertOffload(backend, host, plan.experts, store, weights.layers)
    model.source = OffloadedLayers(weights.layers, model.offload)
    return model


def needs_offload(gf: Any, cfg: Any, backend: Any, ecfg: Any, n_ctx: int) -> bool:
    """An option asks for it, or the ordinary planner would stream (or cannot place) layers."""
    from ntx_engine import tiers
    from ntx_engine.layout import layer_spans, resident_bytes
    from ntx_engine.planner import PlanError, make_plan

    if not cfg.is_moe:
        return False
    if wants_offload(ecfg):
        return True
    try:
        return make_plan(layer_spans(gf, cfg), resident_bytes(gf, cfg), cfg, n_ctx, tiers.default_budgets(backend, ecfg),
                         ecfg.links or tiers.UNMEASURED, n_slots=ecfg.n_slots).streamed
    except PlanError:  # not even a streaming ring fits: the offload needs far less
        return True


def plan_offload(gf: Any, cfg: Any, backend: Any, ecfg: Any, n_ctx: int, host: Any) -> MoeOffloadPlan:
    """The offload placement under ecfg's budgets; links measured on a GPU (cached)."""
    from ntx_engine import tiers
    from ntx_engine.layout import layer_spans, resident_bytes

    side = ecfg.moe_experts
    if side == "auto" and backend.name != "cuda":  # host memory is the "VRAM": no copies at all
        side = "gpu" if ecfg.expert_slots is not None else "cpu"
    if side == "cpu" and host is None:
        raise UsageError("--moe-experts cpu needs the native CPU kernels (native/cpu), which are not built here")
    links = ecfg.links or tiers.UNMEASURED
    if ecfg.links is None and backend.name == "cuda":
        from ntx_engine.links import measure

        links = measure(backend, gf, ecfg.storage, host=host)
    return make_expert_plan(gf, layer_spans(gf, cfg), resident_bytes(gf, cfg), cfg, n_ctx,
                            tiers.default_budgets(backend, ecfg), links, policy=ecfg.expert_cache,
                            n_slots=ecfg.expert_slots, side=side, cpu_ok=host is not None)


def host_for(backend: Any, ecfg: Any) -> Any:
    """The backend computing CPU-side experts: next to a GPU the native CPU kernels (tiers'
    choice; None when they are not built or --hybrid off), on the CPU backends the main
    backend itself."""
    if backend.name != "cuda":
        return backend
    from ntx_engine import tiers

    return tiers.host_backend(backend, ecfg)
