#!/usr/bin/env python3
"""Benchmark the CUDA backend on one GGUF (real or synthetic): prefill and decode tok/s,
decode with and without the CUDA graph, achieved GB/s against the HBM bound; JSON out.

    python scripts/bench_cuda.py --model m.gguf --json out.json
    python scripts/bench_cuda.py --synthetic llama3-8b:q4_k_m --json out.json   # writes /tmp/...

Bytes per decode token = every weight matrix once (one row of token_embd) + the KV cache read;
the bound is those bytes over the measured device-to-device copy bandwidth (read + write).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def copy_bandwidth(backend, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device copy bandwidth in bytes/s counting bytes read plus written (cuMemcpyDtoDAsync)."""
    from ntx_engine.backends.cuda_driver import DeviceArray, Event, check, driver

    a, b = DeviceArray(backend.pool, (nbytes,), np.uint8), DeviceArray(backend.pool, (nbytes,), np.uint8)
    s = backend.stream

    def copy():
        check(driver().cuMemcpyDtoDAsync(b.ptr, a.ptr, nbytes, s.handle), "cuMemcpyDtoDAsync")

    copy()
    t0, t1 = Event(), Event()
    t0.record(s)
    for _ in range(reps):
        copy()
    t1.record(s)
    t1.synchronize()
    return 2 * nbytes * reps / (t1.elapsed_ms(t0) / 1e3)


def weight_bytes(weights) -> tuple[int, int]:
    """(bytes read per decode token, total bytes) of the resident weights."""
    mats = [weights.output] + [getattr(lw, f) for lw in weights.layers
                               for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    per_token = sum(m.nbytes for m in mats) + weights.tok_embd.nbytes // weights.tok_embd.shape[0]
    total = per_token + (0 if weights.output is weights.tok_embd else weights.tok_embd.nbytes)
    return per_token, total


PREFILL_REPS = 3  # timed prefills a run (their median is prefill_tok_s)


def timed(fn, backend) -> float:
    backend.synchronize()
    t0 = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - t0


def kernel_times(model, backend, token, pos: int, reps: int = 3, hold_us: int = 300_000) -> tuple[dict, float]:
    """Per-kernel GPU time of one plain decode step, mean of reps steps: CUDA events around every
    launch, the whole step queued behind a hold_us spin kernel so that the events time the GPU
    and not Python's launch rate. Returns ({kernel: {"ms": per token, "launches": per token}},
    slowest first; the step's GPU time without the graph, first event to last, ms)."""
    from collections import defaultdict

    totals: dict = defaultdict(float)
    counts: dict = defaultdict(int)
    step = 0.0
    for r in range(reps):
        backend.k._go("ops.cu", "spin_us", (1,), (1,), (hold_us,), backend.stream)
        backend.k.profile = []
        model.forward(np.atleast_1d(np.asarray(token)), pos + r)  # a token, or a prefill chunk's ids
        backend.synchronize()
        prof, backend.k.profile = backend.k.profile, None
        for name, e0, e1 in prof:
            totals[name] += e1.elapsed_ms(e0) / reps
            counts[name] += 1
        step += prof[-1][2].elapsed_ms(prof[0][1]) / reps
    order = sorted(totals, key=totals.get, reverse=True)
    return {n: {"ms": round(totals[n], 4), "launches": counts[n] // reps} for n in order}, step


def graph_us(backend, launches: list, reps: int = 5) -> float:
    """Microseconds per launch of `launches` (callables, each one kernel on the backend's
    stream) captured back to back in one CUDA graph and replayed: the way a decode step runs."""
    from ntx_engine.backends.cuda_driver import Event, check, driver

    drv, s = driver(), backend.stream
    backend.synchronize()
    check(drv.cuStreamBeginCapture(s.handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
          "cuStreamBeginCapture")
    try:
        for fn in launches:
            fn()
    finally:
        graph = check(drv.cuStreamEndCapture(s.handle), "cuStreamEndCapture")
    exe = check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    check(drv.cuGraphLaunch(exe, s.handle), "cuGraphLaunch")
    e0, e1 = Event(), Event()
    e0.record(s)
    for _ in range(reps):
        check(drv.cuGraphLaunch(exe, s.handle), "cuGraphLaunch")
    e1.record(s)
    e1.synchronize()
    return 1e3 * e1.elapsed_ms(e0) / (reps * len(launches))


def kernel_table(backend, l2_bytes: int = 160 << 20) -> list[dict]:
    """GPU time of each decode kernel alone at Llama-3-8B shapes (batch 1), from graph_us; a
    weight is rotated over enough copies that they exceed the L2 cache, so its bytes come from
    HBM as in a real step. GB/s counts the weight bytes read."""
    import make_synthetic_model as msm
    from ntx_engine.backends.cuda_backend import CudaWeight
    from ntx_engine.backends.cuda_driver import DeviceArray, upload
    from ntx_engine.quants import GGMLType as T

    b, rng, k, out = backend, np.random.default_rng(0), backend.k, []

    def copies(t, rows, cols):
        raw = msm.random_blocks(t, rows * cols, rng)
        n = max(2, -(-l2_bytes // raw.nbytes))
        return [CudaWeight(upload(b.pool, raw, b.stream), t, (rows, cols), "w") for _ in range(n)]

    def acts(cols, n=1):
        x = b.from_numpy(rng.standard_normal((n, cols)).astype(np.float32))
        return x, DeviceArray(b.pool, (n, cols), np.int8), b._new(n, cols // 32), b._new(n, cols // 32)

    def record(name, fns, nbytes=0):
        us = graph_us(b, fns)
        out.append(dict(kernel=name, us=round(us, 2), gb_s=round(nbytes / us / 1e3, 1) if nbytes else None))

    for t, rows, cols in ((T.Q4_K, 4096, 4096), (T.Q4_K, 14336, 4096), (T.Q6_K, 1024, 4096), (T.Q6_K, 4096, 14336),
                          (T.Q8_0, 4096, 4096), (T.Q8_0, 1024, 4096), (T.Q8_0, 14336, 4096), (T.Q8_0, 4096, 14336)):
        ws, (x, xq, xd, xs) = copies(t, rows, cols), acts(cols)
        y = b._new(1, rows)
        k.quantize_int8(ws[0].vec_dot_type, x, xq, xd, xs, b.stream)
        fns = [lambda w=w: k.matvec_fast(t, w.data, xq, xd, xs, y, rows, cols, 1, b.stream) for w in ws * 4]
        record(f"matvecf {t.name} {rows}x{cols}", fns, ws[0].nbytes)
    for t, tv in ((T.Q4_K, T.Q6_K), (T.Q8_0, T.Q8_0)):
        qs, ks, vs, (x, xq, xd, xs) = copies(t, 4096, 4096), copies(t, 1024, 4096), copies(tv, 1024, 4096), acts(4096)
        k.quantize_int8(qs[0].vec_dot_type, x, xq, xd, xs, b.stream)
        ys = [b._new(1, 4096), b._new(1, 1024), b._new(1, 1024)]
        trios = list(zip(qs, ks * 8, vs * 8))
        fns = [lambda q=q, kk=kk, v=v: k.matvec_multi([(q.data, t, 4096), (kk.data, t, 1024), (v.data, tv, 1024)],
                                                      xq, xd, xs, ys, 4096, 1, b.stream) for q, kk, v in trios * 4]
        record(f"matvecf_multi qkv {t.name}/{tv.name}", fns, sum(w.nbytes for w in trios[0]))
        gs, us_ = copies(t, 14336, 4096), copies(t, 14336, 4096)
        y = b._new(1, 14336)
        fns = [lambda g=g, u=u: k.matvec_swiglu(g.data, t, u.data, t, xq, xd, xs, y, 14336, 4096, 1, b.stream)
               for g, u in list(zip(gs, us_)) * 4]
        record(f"matvecf_swiglu {t.name} 2x14336x4096", fns, 2 * gs[0].nbytes)
    x, xq, xd, xs = acts(4096)
    w, h, s2, dd = b.from_numpy(np.ones(4096, np.float32)), b._new(1, 4096), b._new(1, 4096), b._new(1, 4096)
    record("rmsnorm 4096", [lambda: k.rmsnorm(x, w, h, 1e-5, b.stream)] * 64)
    record("add_rmsnorm_quanti 4096 q8_k", [lambda: k.add_rmsnorm_quanti(x, dd, s2, w, h, xq, xd, xs, 1e-5, 2,
                                                                          b.stream)] * 64)
    record("quanti_q8_k 4096", [lambda: k.quantize_int8(T.Q8_K, x, xq, xd, xs, b.stream)] * 64)
    x2, xq2, xd2, xs2 = acts(14336)
    record("quanti_q8_k 14336", [lambda: k.quantize_int8(T.Q8_K, x2, xq2, xd2, xs2, b.stream)] * 64)
    record("add 4096", [lambda: k.add(x, dd, s2, b.stream)] * 64)
    out += attention_table(b)
    return out


FLAT_BLOCKS_PER_SM, FLAT_THREADS = 8, 256  # read_ceiling.cu's flat grid (read_flat_uU, read_chain)


def ceiling_kernels(backend):
    """The backend's Kernels with native/cuda/read_ceiling.cu loaded (not among the engine's SOURCES)."""
    from ntx_engine.backends import cuda_nvrtc
    from ntx_engine.backends.cuda_driver import Module

    k = backend.k
    if "read_ceiling.cu" not in k.modules:
        k.modules["read_ceiling.cu"] = Module(cuda_nvrtc.cached_cubin("read_ceiling.cu", backend.device.arch),
                                              "read_ceiling.cu")
    return k


def read_ceiling_table(backend, l2_bytes: int = 160 << 20) -> list[dict]:
    """The streaming-read ceiling of the decode matrices' byte counts (native/cuda/read_ceiling.cu:
    loads and an XOR, nothing else), each buffer rotated over copies that exceed the L2 cache and
    launched back to back in a graph as a decode step launches its matvecs. Layouts: one warp a row
    (the dp4a kernels' layout) with U 16-byte loads in flight a lane, and a flat grid of
    sm_count x FLAT_BLOCKS_PER_SM blocks of FLAT_THREADS threads striding over the buffer."""
    from ntx_engine.backends.cuda_driver import DeviceArray

    b, k, out = backend, ceiling_kernels(backend), []
    shapes = (("Q4_K 4096x4096 (q, o)", 4096, 2304), ("Q4_K 14336x4096 (gate)", 14336, 2304),
              ("Q4_K 28672x4096 (gate+up)", 28672, 2304), ("Q6_K 4096x14336 (down)", 4096, 11760),
              ("Q8_0 6144x4096 (qkv)", 6144, 4352), ("Q8_0 28672x4096 (gate+up)", 28672, 4352),
              ("Q8_0 4096x14336 (down)", 4096, 15232), ("Q6_K 128256x4096 (output)", 128256, 3360))
    flat_blocks = b.device.sm_count * FLAT_BLOCKS_PER_SM
    sink = DeviceArray(b.pool, (max(128256, flat_blocks * 8),), np.uint32)
    for name, rows, row_bytes in shapes:
        nbytes = rows * row_bytes
        bufs = [DeviceArray(b.pool, (nbytes,), np.uint8) for _ in range(max(2, -(-l2_bytes // nbytes)))]
        row = {"matrix": name, "mb": round(nbytes / 1e6, 1)}
        for u in (1, 2, 4):
            fns = [lambda w=w, u=u: k._go("read_ceiling.cu", f"read_rows_u{u}", (-(-rows // 4),), (128,),
                                          (w, rows, row_bytes // 16, sink), b.stream) for w in bufs * 4]
            us = graph_us(b, fns)
            row[f"rows_u{u}_us"], row[f"rows_u{u}_tb_s"] = round(us, 2), round(nbytes / us / 1e6, 2)
        fns = [lambda w=w: k._go("read_ceiling.cu", "read_flat_u4", (flat_blocks,), (FLAT_THREADS,),
                                 (w, nbytes // 16, sink), b.stream) for w in bufs * 4]
        us = graph_us(b, fns)
        row["flat_u4_us"], row["flat_u4_tb_s"] = round(us, 2), round(nbytes / us / 1e6, 2)
        out.append(row)
        del bufs
    return out


def attention_table(backend, contexts=(576, 2048, 4096, 8192), l2_bytes: int = 160 << 20,
                    minrs: tuple = (None,)) -> list[dict]:
    """GPU time of one decode attention at Llama-3-8B heads (32 query, 8 KV, head_dim 128) over
    T positions: the grid kernel against the two split kernels, each over enough KV caches that
    they exceed the L2 cache (as a layer's cache does in a real step). GB/s counts K and V bytes."""
    from ntx_engine.backends.cuda_driver import upload
    from ntx_engine.backends.cuda_kernels import ATTN_CHUNK, grid_attn_shape

    b, k, rng, out = backend, backend.k, np.random.default_rng(1), []
    n_head, n_kv, hd = 32, 8, 128
    for t in contexts:
        kv = rng.standard_normal((t, n_kv * hd)).astype(np.float16)
        caches = [(upload(b.pool, kv, b.stream), upload(b.pool, kv[::-1].copy(), b.stream))
                  for _ in range(max(2, -(-l2_bytes // (2 * kv.nbytes))))]
        q, o = b.from_numpy(rng.standard_normal((1, n_head * hd)).astype(np.float32)), b._new(1, n_head * hd)
        pos = upload(b.pool, np.array([t - 1], np.int32), b.stream)
        nchunk = -(-t // ATTN_CHUNK)
        split = (b._new(n_head, t), b._new(n_head, nchunk), b._new(n_head, nchunk, hd),
                 upload(b.pool, np.zeros(n_kv, np.uint32), b.stream), upload(b.pool, np.zeros(n_kv, np.uint32), b.stream),
                 b._new(n_head), b._new(n_head, dtype=np.float64))
        scale = float(1 / np.sqrt(hd))
        runs = [("attn_gqa (2 kernels)", lambda kc, vc: k.attention_gqa(q, kc, vc, o, pos, n_head, n_kv, hd, t, scale,
                                                                       split, b.stream))]
        for per_sm in (1, k.grid_per_sm(n_head, n_kv, hd, t)):
            for minr in minrs:
                shape = grid_attn_shape(n_head, n_kv, hd, t, b.device.sm_count, b.device.max_smem_optin, per_sm, minr)
                nb = shape[0]
                grid = (b._new(n_head, nb), b._new(n_head, nb, dtype=np.float64), b._new(n_head, nb, hd),
                        upload(b.pool, np.zeros(2 * n_kv, np.uint32), b.stream))
                runs.append((f"attn_grid {nb} blocks a KV head, {shape[2]} positions a block at least",
                             lambda kc, vc, g=grid, sh=shape: k.attention_grid(q, kc, vc, o, pos, n_head, n_kv, hd, sh,
                                                                               scale, g, b.stream)))
        if b.device.cc >= (9, 0):  # the cluster form (sm_90): C blocks a KV head in one cluster
            from ntx_engine.backends.cuda_kernels import CLUSTER_SIZES

            for cl in CLUSTER_SIZES:
                shape = grid_attn_shape(n_head, n_kv, hd, t, b.device.sm_count, b.device.max_smem_optin,
                                        minr=minrs[0], cluster=cl)
                runs.append((f"attn_cl{cl} ({cl} blocks a KV head, one cluster)",
                             lambda kc, vc, sh=shape, g=grid, cl=cl: k.attention_grid(
                                 q, kc, vc, o, pos, n_head, n_kv, hd, sh, scale, g, b.stream, cluster=cl)))
        for name, fn in runs:
            fns = [lambda kc=kc, vc=vc, fn=fn: fn(kc, vc) for kc, vc in caches * 2]
            us = graph_us(b, fns)
            out.append(dict(kernel=f"{name} T={t}", us=round(us, 2), gb_s=round(2 * kv.nbytes / us / 1e3, 1)))
    return out


def run(path: Path, n_prompt: int, n_decode: int, n_ctx: int, matvec: str = "fast", attn: str = "split",
        pdl: bool | None = None, fuse=None, n_plain: int | None = None, mmq: bool | None = None,
        gemm: str | None = None, prefill_chunk: int = 256) -> dict:
    """One model, one kernel variant (fuse: CudaBackend's, e.g. "all" or "none"); n_plain: decode
    tokens without the graph (default n_decode)."""
    from ntx_engine.backends.cuda_backend import CudaBackend
    from ntx_engine.backends.cuda_graph import DecodeGraph
    from ntx_engine.config import ModelConfig
    from ntx_engine.gguf import GGUFFile
    from ntx_engine.model import Transformer, WeightLoader

    b = CudaBackend(matvec=matvec, attn=attn, pdl=pdl, fuse=fuse, mmq=mmq, gemm=gemm)
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    t0 = time.perf_counter()
    weights = WeightLoader(gf, cfg, b).load()
    load_s = time.perf_counter() - t0
    model = Transformer(cfg, weights, b, n_ctx)
    graph = DecodeGraph(model)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, n_prompt)

    def prefill():
        for s in range(0, n_prompt, prefill_chunk):
            model.forward(prompt[s:s + prefill_chunk], s)

    prefill()  # warm-up: module load, pool buffers
    # the median of PREFILL_REPS timed prefills (one sample once read 5917 against 9916 tok/s with the same GPU time)
    pre_samples = [timed(prefill, b) for _ in range(PREFILL_REPS)]
    pre_s = statistics.median(pre_samples)

    n_plain = n_decode if n_plain is None else n_plain

    def decode_plain():
        tok = int(prompt[-1])
        for i in range(n_plain):
            tok = int(np.argmax(model.forward(np.asarray([tok]), n_prompt + i)[-1]))

    def decode_graph():
        tok = int(prompt[-1])
        for i in range(n_decode):
            tok = graph.greedy(tok, n_prompt + i)

    def decode_stream():  # the engine's greedy decode: the next step queued before a token is read
        for _ in graph.greedy_stream(int(prompt[-1]), n_prompt, n_decode):
            pass

    def decode_fed() -> float:  # the graph back to back, each step fed by the one before on the device: GPU time
        from ntx_engine.backends.cuda_driver import Event

        graph.greedy(int(prompt[-1]), n_prompt)
        e0, e1 = Event(), Event()
        e0.record(b.stream)
        steps = graph.run_fed(n_prompt + 1, n_decode - 1)
        e1.record(b.stream)
        b.synchronize()
        return e1.elapsed_ms(e0) / steps if steps else float("nan")

    decode_plain()
    plain_s = timed(decode_plain, b)
    graph.greedy(int(prompt[-1]), n_prompt)  # capture
    graph_s = timed(decode_graph, b)
    stream_s = timed(decode_stream, b)
    fed_ms = decode_fed() if n_decode > 1 else float("nan")
    kernels, step_ms = kernel_times(model, b, int(prompt[-1]), n_prompt + n_decode)
    # one prefill chunk the same way; cuBLAS's GEMMs are not among the timed launches, so they
    # are the step's GPU time minus the kernels' (the gaps between launches are GPU-side there)
    pre_kernels, pre_step_ms = kernel_times(model, b, prompt[:prefill_chunk], 0, reps=1, hold_us=1_000_000)
    bw = copy_bandwidth(b)
    per_tok, total = weight_bytes(weights)
    kv = 2 * cfg.n_layers * (n_prompt + n_decode // 2) * cfg.kv_dim * 2  # f16 K and V read, mean context
    tok_s = n_decode / graph_s
    return dict(model=str(path.name), matvec=matvec, attn=attn, pdl=b.k.pdl, fuse=sorted(b.fuse), mmq=b.mmq,
                gemm=bool(b._cublas), prefill_chunk=prefill_chunk,
                prefill_kernels=dict(list(pre_kernels.items())[:10]), prefill_chunk_gpu_ms=pre_step_ms,
                prefill_outside_kernels_ms=pre_step_ms - sum(v["ms"] for v in pre_kernels.values()),
                device=b.device.name, arch=b.device.arch, n_layers=cfg.n_layers,
                weights_gb=total / 1e9, bytes_per_token_gb=(per_tok + kv) / 1e9, load_s=load_s,
                prefill_tokens=n_prompt, prefill_tok_s=n_prompt / pre_s,
                prefill_tok_s_samples=[round(n_prompt / x, 1) for x in pre_samples],
                decode_tokens=n_decode, decode_tok_s_graph=tok_s, decode_tok_s_plain=n_plain / plain_s,
                decode_tok_s_stream=n_decode / stream_s, fraction_of_bound_stream=(per_tok + kv) * n_decode / stream_s / bw,
                copy_bw_gb_s=bw / 1e9, hbm_bound_tok_s=bw / (per_tok + kv),
                achieved_gb_s=(per_tok + kv) * tok_s / 1e9, fraction_of_bound=(per_tok + kv) * tok_s / bw,
                kernel_ms_per_token=round(sum(v["ms"] for v in kernels.values()), 4), profiled_step_ms=step_ms,
                decode_ms_per_token_graph=1e3 / tok_s, decode_ms_back_to_back=fed_ms, kernels=kernels,
                # which decode step ran: the stack step's build (cuda_layers.StackDecode.source), else why not
                stack_source=None if b.stack is None else b.stack.source, stack_why_not=b.stack_why_not)


def synthetic_model(spec: str, workdir: Path) -> Path:
    """The GGUF for SHAPE:MIX[:LAYERS] under workdir, written by make_synthetic_model.py once."""
    import make_synthetic_model as msm

    shape, mix, *layers = spec.split(":")
    path = workdir / f"synthetic-{shape}-{mix}{'-' + layers[0] if layers else ''}.gguf"
    if not path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        msm.write_model(path, shape, mix, int(layers[0]) if layers else None)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path)
    src.add_argument("--synthetic", help="SHAPE:MIX[:LAYERS], written by make_synthetic_model.py")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--matvec", choices=["fast", "staged", "direct"], default="fast", help="matvec kernel variant")
    ap.add_argument("--attn", choices=["grid", "split", "single"], default="grid", help="decode attention variant")
    a = ap.parse_args(argv)
    path = synthetic_model(a.synthetic, a.workdir) if a.synthetic else a.model
    res = run(path, a.prompt, a.decode, a.n_ctx, a.matvec, a.attn)
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
