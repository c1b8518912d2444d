"""Link bandwidths the planner's cost model needs, measured at start-up and cached per machine
in ~/.cache/ntx/links.json: kernels reading device memory, host-to-device copies from pinned
memory, and the storage reader on the model's filesystem."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ntx_common.errors import NtxIOError
from ntx_engine.planner import Links

PROBE_BYTES = 256 << 20
STORAGE_PROBE = 1 << 30
CACHE_VERSION = 6  # bump when a probe changes: old figures then stop being used (6: whole-layer CPU probe)
CACHE = Path(os.environ.get("NTX_CACHE", Path.home() / ".cache" / "ntx")) / "links.json"


def _best_rate(nbytes: int, run, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def host_copy_bps(nbytes: int = PROBE_BYTES) -> float:
    """memcpy bandwidth: the numpy backend's "VRAM" and "H2D" links are host memory."""
    from ntx_engine.tiers import mem_available

    nbytes = max(1 << 20, min(nbytes, mem_available() // 8))  # small machines and VMs too
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    return _best_rate(nbytes, lambda: np.copyto(b, a))


def cuda_links(backend: Any, nbytes: int = PROBE_BYTES) -> tuple[float, float]:
    """(device-to-device read+write rate, pinned host-to-device rate) in bytes/s."""
    from ntx_engine.backends.cuda_driver import DeviceArray, check, driver
    from ntx_engine.backends.host_memory import host_buffer, host_view

    drv, s = driver(), backend.stream
    a, b = DeviceArray(backend.pool, (nbytes,), np.uint8), DeviceArray(backend.pool, (nbytes,), np.uint8)

    def d2d() -> None:
        check(drv.cuMemcpyDtoDAsync(b.ptr, a.ptr, nbytes, s.handle), "cuMemcpyDtoDAsync")
        s.synchronize()
    buf = host_buffer(nbytes, cuda=True, device=backend.device.ordinal)
    host = host_view(buf)

    def h2d() -> None:
        check(drv.cuMemcpyHtoDAsync(a.ptr, host.ctypes.data, nbytes, s.handle), "cuMemcpyHtoDAsync")
        s.synchronize()
    vram = 2 * _best_rate(nbytes, d2d)  # a copy reads and writes every byte
    rate = _best_rate(nbytes, h2d)
    host = None  # the view (h2d's too) released before the pinned buffer closes
    buf.close()
    return vram, rate


def storage_bps(reader: Any, nbytes: int = STORAGE_PROBE, piece: int = 256 << 20, depth: int = 2) -> float:
    """Reader throughput as the pipeline drives it: consecutive layer-sized reads (`piece`),
    `depth` of them in flight, from the middle of the source (O_DIRECT and VFIO bypass the
    page cache; for mmap the range is evicted first, so the disk is measured, not the cache)."""
    size = reader.size
    piece = max(4096, min(piece, size // 2) // 4096 * 4096)
    count = max(1, min(nbytes, size) // piece)
    start = max(0, (size - count * piece) // 2) // 4096 * 4096
    if reader.name == "mmap":
        evict(reader.source, [(start, count * piece)])
    bufs = [np.empty(piece, np.uint8) for _ in range(depth)]
    for b in bufs:
        b.fill(0)  # fault the pages in now: first-touch is not the disk's time
    inflight = []
    t0 = time.perf_counter()
    for j in range(count):
        if len(inflight) == depth:
            reader.wait(inflight.pop(0))
        inflight.append(reader.submit([(start + j * piece, piece, bufs[j % depth])]))
    for h in inflight:
        reader.wait(h)
    return count * piece / (time.perf_counter() - t0)


def evict(path: str, ranges) -> None:
    """Drop file ranges from the page cache (POSIX_FADV_DONTNEED): the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, n in ranges:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cpu_bps(backend: Any, host: Any, gf: Any, seconds: float = 0.6) -> float:
    """The host's weight-read rate on this model's layer 0, run as a decode step runs it — one
    whole-layer native call when the host has one (NativeCpuBackend.run_block), else all its
    matrices one by one — measured while host-to-device copies run (they share DRAM: the
    concurrent figure is the one that holds)."""
    probe = _layer_probe(host, gf) or _matrix_probe(host, gf)
    if probe is None:
        return 0.0
    run, nbytes = probe
    stop = threading.Event()
    copier = threading.Thread(target=_copy_loop, args=(backend, stop), daemon=True) if backend.name == "cuda" else None
    if copier:
        copier.start()
    try:
        run()  # warm: thread pool, caches
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            run()
            n += 1
        return n * nbytes / (time.perf_counter() - t0)
    finally:
        stop.set()
        if copier:
            copier.join()


def _layer0_matrices(gf: Any) -> list:
    return [t for n, t in gf.tensors.items() if n.startswith("blk.0.") and len(t.shape) == 2]


def _matrix_probe(host: Any, gf: Any):
    infos = _layer0_matrices(gf)
    if not infos:
        return None
    weights = [host.matrix(np.array(gf.tensor_data(t.name), np.uint8), t.ggml_type, tuple(t.shape), t.name)
               for t in infos]
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, t.shape[1])).astype(np.float32) for t in infos]

    def run() -> None:
        for w, x in zip(weights, xs):
            host.matmul(w, x)
    return run, sum(t.nbytes for t in infos)


PROBE_CTX, PROBE_POS = 64, 32  # the probe's decode step attends over 33 positions
PROBE_LAYER_BYTES = 256 << 20  # enough distinct layers to overflow the caches (small models)


def _layer_probe(host: Any, gf: Any):
    """(run one decode step through the first layers, their matrix bytes) through the host's
    whole-layer call, or None when the host has none or the model is not a dense llama-family
    one (MoE: the matrix probe). As many layers as make PROBE_LAYER_BYTES: a small model's
    single layer would sit in the CPU caches and overstate the DRAM rate several times."""
    if not hasattr(host, "run_block") or not hasattr(gf, "metadata"):
        return None
    from ntx_common.errors import NtxError
    from ntx_engine.config import ModelConfig
    from ntx_engine.model import LayerWeights, ModelWeights, Transformer, WeightLoader

    try:
        cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
        if cfg.is_moe:
            return None
        loader, layers, nbytes = WeightLoader(gf, cfg, host), [], 0
        while len(layers) < cfg.n_layers and (not layers or nbytes < PROBE_LAYER_BYTES):
            specs = loader.matrix_specs(len(layers))
            mats = {f: host.matrix(np.array(gf.tensor_data(name), np.uint8), t, shape, name)
                    for f, (name, t, shape) in specs.items()}
            layers.append(LayerWeights(**mats, **loader.layer_vectors(len(layers))))
            nbytes += sum(w.nbytes for w in mats.values())
    except (NtxError, ValueError, KeyError):
        return None
    model = Transformer(cfg, ModelWeights(None, None, None, layers, None), host, PROBE_CTX)
    x = np.random.default_rng(0).standard_normal((1, cfg.n_embd)).astype(np.float32) * np.float32(0.1)
    pos = np.arange(PROBE_POS, PROBE_POS + 1)

    def run() -> None:
        for i, lw in enumerate(layers):
            host.run_block(model, i, lw, x, pos, PROBE_POS)
    return run, nbytes


def _copy_loop(backend: Any, stop: threading.Event, nbytes: int = 256 << 20) -> None:
    from ntx_engine.backends.cuda_driver import DeviceArray, Stream, check, driver
    from ntx_engine.backends.host_memory import host_buffer, host_view

    drv = driver()
    check(drv.cuCtxSetCurrent(backend.device.context), "cuCtxSetCurrent(copy probe)")
    dev, s = DeviceArray(backend.pool, (nbytes,), np.uint8), Stream()
    buf = host_buffer(nbytes, cuda=True, device=backend.device.ordinal)
    host = host_view(buf)
    while not stop.is_set():
        check(drv.cuMemcpyHtoDAsync(dev.ptr, host.ctypes.data, nbytes, s.handle), "cuMemcpyHtoDAsync")
        s.synchronize()
    del host
    buf.close()


def measure(backend: Any, gf: Any, storage: str = "auto", *, use_cache: bool = True, host: Any = None) -> Links:
    """The links for this backend and the storage `gf` (a GGUFFile, or a path) lives on, from
    the cache when present; with a `host` backend also its CPU compute rate on this model."""

    reader = getattr(gf, "reader", None)
    path = getattr(gf, "path", gf)
    where = reader.source if reader is not None else f"dev{os.stat(path).st_dev}"
    key = f"v{CACHE_VERSION}|{backend.name}:{getattr(getattr(backend, 'device', None), 'name', 'host')}|{where}|{storage}"
    data = _load_cache() if use_cache else {}
    cached = data.get(key)
    cpu_key = _cpu_key(host, gf) if host is not None else None
    if cached:
        links = Links(**{**cached, "source": f"cached in {CACHE}"})
    else:
        links = _measure_links(backend, path, reader, storage)
        _save_cache(key, {"vram": links.vram, "h2d": links.h2d, "storage": links.storage,
                          "storage_kind": links.storage_kind})
    if host is None:
        return links
    cpu = data.get(cpu_key, {}).get("cpu")
    if cpu is None:
        cpu = cpu_bps(backend, host, gf)
        _save_cache(cpu_key, {"cpu": cpu})
    return dataclasses.replace(links, cpu=cpu)


def _cpu_key(host: Any, gf: Any) -> str:
    infos = [t for n, t in getattr(gf, "tensors", {}).items() if n.startswith("blk.0.") and len(t.shape) == 2]
    kind = max(infos, key=lambda t: t.nbytes) if infos else None
    what = f"{int(kind.ggml_type)}x{tuple(kind.shape)}" if kind else "none"
    threads = getattr(getattr(host, "kernels", None), "threads", "?")
    return f"v{CACHE_VERSION}|cpu:{host.name}:{threads}|{what}"


def _measure_links(backend: Any, path: Any, reader: Any, storage: str) -> Links:
    """Bandwidths; for a file with --storage auto both kernel readers are measured and the
    faster wins (a virtio disk backed by the host's cache reads faster buffered than O_DIRECT)."""
    if backend.name == "cuda":
        vram, h2d = cuda_links(backend)
    else:
        vram = h2d = host_copy_bps()
    if reader is not None:
        sto, kind = storage_bps(reader), reader.name
    else:
        kinds = ("direct", "mmap") if storage == "auto" else (storage,)
        rates = {k: _file_rate(path, k) for k in kinds}
        rates = {k: v for k, v in rates.items() if v is not None}
        if not rates:
            raise NtxIOError(f"{path}: no storage reader works for this file")
        kind = max(rates, key=rates.get)
        sto = rates[kind]
    return Links(vram=vram, h2d=h2d, storage=sto, storage_kind=kind, source="measured")


def _file_rate(path: Any, kind: str) -> float | None:
    from ntx_engine.tiers import READ_CHUNK, READ_WORKERS
    from ntx_io.reader import open_reader

    try:
        reader, _ = open_reader(path, kind, workers=READ_WORKERS, chunk=READ_CHUNK, evict=True)
    except NtxIOError:
        return None  # e.g. O_DIRECT on tmpfs
    try:
        return storage_bps(reader)
    finally:
        reader.close()


def _load_cache() -> dict:
    try:
        return json.loads(CACHE.read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(key: str, entry: dict) -> None:
    data = _load_cache()
    data[key] = entry
    try:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_text(json.dumps(data, indent=1))
    except OSError:
        pass  # a read-only home only costs a re-measure next time
