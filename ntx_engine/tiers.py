"""Builds a model whose layers sit in the tiers a `planner.Plan` chose: VRAM-tier layers are
loaded as usual, RAM-tier spans are copied once into pinned host buffers, storage-tier spans
stay on disk, and `pipeline.StreamingLayers` (or the naive `MmapBaseline`) hands them out."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import numpy as np

from ntx_common.errors import UsageError
from ntx_engine.layout import LayerSpan, layer_spans, resident_bytes
from ntx_engine.model import LayerWeights, ModelWeights, ResidentLayers, WeightLoader, close_owned_reader
from ntx_engine.pipeline import StreamingLayers
from ntx_engine.planner import RAM_MARGIN, Budgets, Links, Plan, make_plan, workspace_bytes

UNBOUNDED = 1 << 62
READ_WORKERS = int(os.environ.get("NTX_READ_WORKERS", 16))  # O_DIRECT requests in flight (8+ for a virtio disk)
READ_CHUNK = int(os.environ.get("NTX_READ_CHUNK_MB", 8)) << 20  # bytes per request
UNMEASURED = Links(vram=1e12, h2d=5e10, storage=1e9, storage_kind="auto", source="not measured")

TIER_MODES = ("auto", "mmap-baseline")
# CPUs the hybrid's host kernels leave to the copy feeder, the reader and Python: measured on the
# H200 box (16 cores, 70B Q4_K_M under 24G, docs/hybrid.md) 13 threads decode 4.70 tok/s, 12
# threads 4.47; all 16 collapse (FACTS.md: the copy thread loses its core)
HOST_SPARE_CPUS = 3


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{meminfo} has no MemAvailable line")


def default_budgets(backend: Any, cfg: Any) -> Budgets:
    """Budgets given in the EngineConfig, else what is free: cuMemGetInfo for the GPU, and
    MemAvailable minus a margin (2 GiB, or 1/8 on a small machine) for RAM. On the CPU
    backends "VRAM" is host memory: without a budget everything is resident there, as without
    tiers; with only --ram-budget, that budget is the resident part and the rest streams."""
    avail = mem_available()
    free_ram = max(0, avail - min(RAM_MARGIN, avail // 8))
    vram = cfg.vram_budget
    if backend.name != "cuda" and vram is None and cfg.ram_budget is not None:
        # CPU only: the compute device's memory is the RAM, so --ram-budget is what stays
        # resident, and everything else streams from storage (no pinned second copy)
        return Budgets(vram=cfg.ram_budget, ram=0, device_memory="RAM (CPU only)", option="--ram-budget",
                       unified=True)
    if vram is None:
        vram = backend.device.mem_info()[0] if backend.name == "cuda" else UNBOUNDED
    return Budgets(vram=vram, ram=free_ram if cfg.ram_budget is None else cfg.ram_budget)


def plan_for(gf: Any, cfg: Any, backend: Any, ecfg: Any, n_ctx: int, *, measure_links: bool = False,
             host: Any = None) -> Plan:
    """The placement for this model under the configured budgets. Links are measured (or read
    from the cache) only when something streams or `measure_links` asks for them; CPU-computed
    layers are considered only with a `host` backend."""
    spans, head = layer_spans(gf, cfg), resident_bytes(gf, cfg)
    budgets = default_budgets(backend, ecfg)
    links = ecfg.links or UNMEASURED
    if host is None and links.cpu:
        links = dataclasses.replace(links, cpu=0.0)
    extra = 0
    if backend.name == "cuda":  # the prefill GEMM's slab, and activations of its larger chunk
        from ntx_engine.backends.cuda_backend import gemm_workspace_bytes

        extra = gemm_workspace_bytes(cfg) + workspace_bytes(cfg, n_ctx, backend.prefill_chunk) \
            - workspace_bytes(cfg, n_ctx)
    plan = make_plan(spans, head, cfg, n_ctx, budgets, links, n_slots=ecfg.n_slots, extra_workspace=extra,
                     hybrid=ecfg.hybrid)
    if (plan.streamed or measure_links) and ecfg.links is None:
        from ntx_engine.links import measure

        links = measure(backend, gf, ecfg.storage, host=host)
        plan = make_plan(spans, head, cfg, n_ctx, budgets, links, n_slots=ecfg.n_slots, extra_workspace=extra,
                     hybrid=ecfg.hybrid)
    return plan


def host_backend(backend: Any, ecfg: Any) -> Any:
    """The backend that computes CPU-tier layers, or None. Auto: the native CPU kernels next
    to a GPU, with cores - HOST_SPARE_CPUS threads (NTX_CPU_THREADS overrides): the I/O, copy
    and Python threads need cores too, and DMA and CPU compute share DRAM."""
    import os

    from ntx_engine.backends import make_backend

    choice = ecfg.host_device
    if choice == "none" or ecfg.tiers == "mmap-baseline":
        return None
    if choice is not None:
        return make_backend(choice, kv_dtype=ecfg.kv_dtype)
    if backend.name != "cuda":
        return None
    from ntx_engine.backends.cpu_kernels import load_module

    if load_module() is None:
        return None
    from ntx_engine.backends.cpu_native import NativeCpuBackend

    threads = int(os.environ.get("NTX_CPU_THREADS") or max(1, len(os.sched_getaffinity(0)) - HOST_SPARE_CPUS))
    return NativeCpuBackend(kv_dtype=ecfg.kv_dtype, threads=threads)


def make_ring(backend: Any, n_slots: int, slot_bytes: int) -> Any:
    if backend.name == "cuda":
        from ntx_engine.backends.cuda_ring import CudaRing

        return CudaRing(backend, n_slots, slot_bytes)
    from ntx_engine.backends.numpy_ring import NumpyRing

    return NumpyRing(backend, n_slots, slot_bytes)


class SlotWeights:
    """Builds a streamed layer's LayerWeights over the slot that holds its span."""

    def __init__(self, loader: WeightLoader, spans: list[LayerSpan], ring: Any, layers: list[int]) -> None:
        self.ring, self.spans = ring, spans
        self.specs = {i: loader.matrix_specs(i) for i in layers}
        self.vectors = {i: loader.layer_vectors(i) for i in layers}
        self.nbytes = {name: loader.gf.tensors[name].nbytes for i in layers for name, _, _ in self.specs[i].values()}

    def __call__(self, i: int, mem: Any) -> LayerWeights:
        offsets = self.spans[i].tensors
        mats = {f: self.ring.matrix(mem, offsets[name], self.nbytes[name], t, shape, name)
                for f, (name, t, shape) in self.specs[i].items()}
        return LayerWeights(**mats, **self.vectors[i])


def build(gf: Any, loader: WeightLoader, spans: list[LayerSpan], plan: Plan, *, mode: str = "auto",
          reader: Any = None, base_offset: int = 0, host: Any = None,
          progress: Callable[[int, int], None] | None = None) -> tuple[ModelWeights, Any]:
    """(weights with VRAM-tier layers loaded, the Transformer's layer source). `host`: the
    backend that computes `cpu`-tier layers (their weights are built on it here)."""
    if mode not in TIER_MODES:
        raise UsageError(f"--tiers must be one of {', '.join(TIER_MODES)}, got {mode!r}")
    tiers = [p.tier for p in plan.placements]
    need_reader = plan.head_tier == "storage" or (mode != "mmap-baseline" and bool(plan.layers_in("storage")))
    reader, base_offset, owned = _storage_reader(gf, plan, reader, base_offset, need_reader)
    weights = loader.load(progress, layers=plan.layers_in("vram"), head=_streamed_head(gf, loader, plan, reader,
                                                                                        base_offset))
    if not plan.streamed:
        source = ResidentLayers(weights.layers)
    elif mode == "mmap-baseline":
        streamed = [i for i, t in enumerate(tiers) if t != "vram"]
        resident = {i: weights.layers[i] for i, t in enumerate(tiers) if t == "vram"}
        ring = make_ring(loader.backend, 1, plan.slot_bytes)
        source = MmapBaseline(gf, spans, tiers, ring, resident, SlotWeights(loader, spans, ring, streamed))
    else:
        source = _streaming(gf, loader, spans, plan, weights, reader, base_offset, host)
    source.owned_reader = owned  # a reader opened here: closed with the source
    return weights, source


def _streaming(gf: Any, loader: WeightLoader, spans: list[LayerSpan], plan: Plan, weights: ModelWeights,
               reader: Any, base_offset: int, host: Any) -> StreamingLayers:
    tiers = [p.tier for p in plan.placements]
    streamed = [i for i, t in enumerate(tiers) if t != "vram"]  # cpu layers stream for long prefills
    resident = {i: weights.layers[i] for i, t in enumerate(tiers) if t == "vram"}
    ring = make_ring(loader.backend, plan.n_slots, plan.slot_bytes)
    pinned, keep = _pin(gf, spans, ring, plan.layers_in("ram") + plan.layers_in("cpu"), set(plan.layers_in("cpu")))
    resident.update(_host_layers(loader, spans, {i: pinned[i] for i in plan.layers_in("cpu")}, host))
    source = StreamingLayers(spans, tiers, ring, resident, pinned, SlotWeights(loader, spans, ring, streamed),
                             reader=reader, base_offset=base_offset, n_staging=plan.n_staging,
                             source_size=reader.size if reader is not None else 0)
    source.pinned_buffers = keep  # the buffer objects own the pinned memory the views point into
    return source


def _storage_reader(gf: Any, plan: Plan, reader: Any, base_offset: int, needed: bool) -> tuple:
    """(reader, base offset, the reader if opened here) for what the plan reads from storage: the
    given one, a staged raw device's own, or (when needed) one opened on the file."""
    if reader is None and gf.reader is not None:  # a staged raw device: its reader, its offsets
        return gf.reader, gf.base_offset, None
    if reader is not None or not needed:
        return reader, base_offset, None
    from ntx_io.reader import open_reader

    kind = plan.links.storage_kind
    reader, _ = open_reader(gf.path, kind if kind in ("direct", "mmap") else "auto", workers=READ_WORKERS,
                            chunk=READ_CHUNK, evict=True)  # storage means storage: not the page cache
    return reader, base_offset, reader


def _streamed_head(gf: Any, loader: WeightLoader, plan: Plan, reader: Any, base_offset: int) -> tuple | None:
    """(tok_embd, output) read from storage when the plan leaves the head there, else None."""
    if plan.head_tier != "storage":
        return None
    from ntx_engine.head_stream import StreamedMatrix

    c, b = loader.cfg, loader.backend
    for name in ("token_embd.weight", "output.weight"):
        if name in gf.tensors:
            loader._info(name, (c.vocab_size, c.n_embd))  # the shape checks of a resident load
    tok = StreamedMatrix(gf, "token_embd.weight", b, reader, base_offset)
    return tok, (tok if c.tied_embeddings else StreamedMatrix(gf, "output.weight", b, reader, base_offset))


def _host_layers(loader: WeightLoader, spans: list[LayerSpan], pinned: dict[int, np.ndarray], host: Any) -> dict:
    """LayerWeights on the host backend for the CPU-computed layers, over their pinned spans
    (the native kernels read the GGUF blocks there: no dequantized copy; the same bytes are
    the source when a long prefill streams these layers to the GPU)."""
    if not pinned:
        return {}
    if host is None:
        raise UsageError("the plan computes layers on the CPU but no host backend was given")
    gf = loader.gf
    host_loader = type(loader)(gf, loader.cfg, host)
    out = {}
    for i, raw in pinned.items():
        offsets = spans[i].tensors
        mats = {f: host.matrix(raw[offsets[name]:offsets[name] + gf.tensors[name].nbytes], t, shape, name)
                for f, (name, t, shape) in host_loader.matrix_specs(i).items()}
        out[i] = LayerWeights(**mats, **host_loader.layer_vectors(i))
    return out


def _pin(gf: Any, spans: list[LayerSpan], ring: Any, layers: list[int],
         cpu: set[int] = frozenset()) -> tuple[dict[int, np.ndarray], list]:
    """Copy RAM-tier spans into pinned host buffers once (the bytes then never touch the disk);
    returns the per-layer views and the buffers that own them. The `cpu` layers, which every
    CPU worker reads, get their pages interleaved over the NUMA nodes (ntx_io.numa: on a
    machine with several, or with NTX_NUMA=interleave); the others feed DMA and keep first touch."""
    from ntx_io.numa import placement_nodes

    nodes = placement_nodes() if cpu else None
    pinned, keep = {}, []
    for i in layers:
        buf = ring.host_buffer(spans[i].nbytes, numa_nodes=nodes if i in cpu else None)
        view = ring.host_view(buf)[: spans[i].nbytes]
        np.copyto(view, gf.span_data(spans[i].start, spans[i].end))
        pinned[i] = view
        keep.append(buf)
    return pinned, keep


class MmapBaseline:
    """`--tiers mmap-baseline`: the naive way every benchmark compares against. Each streamed
    layer is copied from the page-cache mapping (pageable memory) into one slot and waited for,
    layer by layer: no pinned memory, no read-ahead, no overlap of I/O, copies and compute.
    Storage-tier spans are dropped from the page cache after use (POSIX_FADV_DONTNEED): the RAM
    budget does not hold them, so, as for a model bigger than RAM, they come from disk each token."""

    def __init__(self, gf, spans, tiers, ring, resident, make_weights) -> None:
        self.gf, self.spans, self.tiers, self.ring = gf, spans, tiers, ring
        self.resident, self.make_weights = resident, make_weights
        self.stats_bytes = {"vram": 0, "ram": 0, "storage": 0}
        self.copy_s = 0.0
        self._fd = os.open(gf.path, os.O_RDONLY) if gf.reader is None else None

    def acquire(self, i: int) -> LayerWeights:
        span = self.spans[i]
        self.stats_bytes[self.tiers[i]] += span.nbytes
        if self.tiers[i] == "vram":
            return self.resident[i]
        self.ring.synchronize()  # the previous layer's compute must be done with the slot
        t0 = time.perf_counter()
        self.ring.copy_in(0, np.asarray(self.gf.span_data(span.start, span.end)))
        self.ring.synchronize()
        if self.tiers[i] == "storage" and self._fd is not None:
            os.posix_fadvise(self._fd, span.start, span.nbytes, os.POSIX_FADV_DONTNEED)
        self.copy_s += time.perf_counter() - t0
        self.ring.before_compute(0)
        return self.make_weights(i, self.ring.slot_view(0, span.nbytes))

    def release(self, i: int) -> None:
        if self.tiers[i] != "vram":
            self.ring.after_compute(0)

    def set_active(self, layers, **_) -> None:
        pass

    def close(self) -> None:
        self.ring.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        close_owned_reader(self)  # the streamed head's reader, if build opened one
