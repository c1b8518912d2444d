#!/usr/bin/env python3
"""Decode tok/s of `ntx-run --device cpu` (the native CPU kernels) against llama.cpp
(llama-cpp-python) on the same GGUF file with the same thread count, measured side by side in
one run: the two alternate for `--rounds` rounds so load from other processes hits both alike.

    python scripts/bench_cpu.py                       # SmolLM2-135M-Instruct Q4_1, all cores
    python scripts/bench_cpu.py --model M.gguf --threads 2 --tokens 128 --json out.json
    python scripts/bench_cpu.py layer --threads 2    # per-layer time: op by op vs one native call
    python scripts/bench_cpu.py matvec --threads 1,2  # matvec GB/s per thread count (bench_matvec.py)

ntx runs twice per round: each layer one native call (the default) and op by op
(NTX_CPU_WHOLE_LAYER=0), so both paths are compared in the same run.

ntx is timed through the real CLI (`ntx-run --device cpu --temperature 0 --json`, its reported
decode_tok_s); llama.cpp through `Llama.generate` with greedy sampling, decode rate = tokens
after the first / time after the first (the first comes out of prefill in both).
The per-kernel view: `--kernels` also times one matvec per weight shape of the model and
prints GB/s of weight bytes read.

On a shared machine wall-clock tok/s depends on the load (llama.cpp's spinning thread pool
collapses when the cores are oversubscribed), so the JSON also carries a load-independent
figure: one thread each, in this process, decode tokens per second of *CPU time*
(`*_cpu_tok_s`, time.process_time between the first and the last generated token).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"


def default_model() -> Path:
    from ntx_engine.modelfile import resolve_model

    return Path(resolve_model(None))


def run_ntx(model: Path, threads: int, tokens: int, prompt: str, whole_layer: bool = True) -> float:
    env = dict(os.environ, NTX_CPU_THREADS=str(threads), OPENBLAS_NUM_THREADS="1", NO_COLOR="1",
               NTX_CPU_WHOLE_LAYER="1" if whole_layer else "0")
    cmd = [str(Path(sys.executable).parent / "ntx-run"), prompt, "--model", str(model), "--device", "cpu",
           "--temperature", "0", "--max-tokens", str(tokens), "--ctx", "512", "--raw", "--json"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"ntx-run failed ({res.returncode}): {res.stderr[-2000:]}")
    doc = json.loads(res.stdout)
    if len(doc["tokens"]) < tokens:
        raise RuntimeError(f"ntx-run stopped after {len(doc['tokens'])} tokens ({doc.get('stop_reason')}); "
                           "use a prompt that does not end the text early")
    return float(doc["decode_tok_s"])


def load_llama(model: Path, threads: int):
    from llama_cpp import Llama

    return Llama(model_path=str(model), n_threads=threads, n_threads_batch=threads, n_ctx=512,
                 verbose=False)


def run_llama(llm, tokens: int, prompt: str) -> float:
    llm.reset()
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    gen = llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
    return _rate(gen, tokens, time.perf_counter)


def _rate(tokens_iter, tokens: int, clock) -> float:
    """Decode tokens per second of `clock` over a token iterator's yields (the first one, which
    includes the prompt, is the start mark)."""
    stamps = []
    for _ in tokens_iter:
        stamps.append(clock())
        if len(stamps) == tokens:
            break
    if len(stamps) < tokens:
        raise RuntimeError(f"generation stopped after {len(stamps)} tokens")
    return (tokens - 1) / (stamps[-1] - stamps[0])


def _cpu_rate(tokens_iter, tokens: int) -> float:
    """Decode tokens per CPU-second of this process."""
    return _rate(tokens_iter, tokens, time.process_time)


def cpu_time_rates(model: Path, tokens: int, prompt: str) -> tuple[float, float]:
    """(ntx, llama.cpp) decode tok per CPU-second, one thread each, greedy, same prompt."""
    from ntx_engine.backends.cpu_native import NativeCpuBackend
    from ntx_engine.engine import Engine, EngineConfig

    os.environ["NTX_CPU_THREADS"] = "1"
    eng = Engine.load(model, EngineConfig(device="cpu", n_ctx=512))
    if not isinstance(eng.model.backend, NativeCpuBackend):
        raise RuntimeError("--device cpu did not give the native backend: is ntx_engine._cpu built?")
    ours = _cpu_rate(eng.generate(eng.tokenize(prompt), tokens), tokens)
    eng.model.backend.close()
    eng.close()
    llm = load_llama(model, 1)
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    theirs = _cpu_rate(llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0), tokens)
    return ours, theirs


def kernel_table(model: Path) -> list[dict]:
    """One matvec per distinct (type, shape) of the model's matrices on one thread: CPU-time us
    per call and GB/s of weight bytes (load-independent, like the *_cpu_tok_s figures)."""
    import numpy as np

    from ntx_engine.backends.cpu_kernels import CpuKernels
    from ntx_engine.gguf import GGUFFile

    kern, gf, rows = CpuKernels(1), GGUFFile.open(model), []
    seen = set()
    for name, info in gf.tensors.items():
        if len(info.shape) != 2 or (info.ggml_type, tuple(info.shape)) in seen:
            continue
        seen.add((info.ggml_type, tuple(info.shape)))
        raw = np.frombuffer(gf.tensor_data(name), np.uint8)
        r, k = info.shape
        x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
        kern.matmul(info.ggml_type, raw, r, k, x)
        reps = max(3, int(2e8 // max(raw.nbytes, 1)))
        t = time.process_time()
        for _ in range(reps):
            kern.matmul(info.ggml_type, raw, r, k, x)
        dt = (time.process_time() - t) / reps
        rows.append({"tensor": name, "type": int(info.ggml_type), "shape": [r, k], "us": dt * 1e6,
                     "gb_s": raw.nbytes / dt / 1e9})
    gf.close()
    kern.close()
    return rows


def synthetic_path(shape: str) -> Path:
    """A 2-layer synthetic Q4_K_M model of a real shape, as bench_tiers.py's repeated writer makes it."""
    return Path(f"/tmp/ntx-bench/{shape}-q4_k_m-2.gguf")


def _busy_python(stop) -> None:
    """A Python thread that always wants the GIL, as the streaming pipeline's threads do."""
    n = 0
    while not stop.is_set():
        n += 1


def _time_layers(model, run, seconds: float) -> list[float]:
    """Seconds per layer call, each call timed alone (decode: one token at position 32)."""
    import numpy as np

    x0 = np.random.default_rng(0).standard_normal((1, model.cfg.n_embd)).astype(np.float32) * 0.1
    pos, times, t_end = np.arange(32, 33), [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 3 * model.cfg.n_layers:
        for i, lw in enumerate(model.w.layers):
            t0 = time.perf_counter()
            run(i, lw, x0, pos, 32)
            times.append(time.perf_counter() - t0)
    return times


def layer_bench(model_path: Path | None, threads: int, seconds: float, rounds: int, shape: str = "llama3-8b") -> dict:
    """Per-layer decode time of op-by-op vs whole-layer native calls on a dense model (default:
    a 2-layer Q4_K_M model of `shape` written once to /tmp), idle and next to a busy Python
    thread, against the CPU probe (links.cpu_bps) the planner would use with this many threads."""
    import threading

    from ntx_engine import links
    from ntx_engine.backends.cpu_native import NativeCpuBackend
    from ntx_engine.config import ModelConfig
    from ntx_engine.gguf import GGUFFile
    from ntx_engine.model import Transformer, WeightLoader

    path = model_path or synthetic_path(shape)
    if not path.exists():
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_tiers import write_repeated_model

        path.parent.mkdir(parents=True, exist_ok=True)
        write_repeated_model(path, shape, "q4_k_m", 2)
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    backend = NativeCpuBackend(threads=threads)
    model = Transformer(cfg, WeightLoader(gf, cfg, backend).load(), backend, 64)
    mat_bytes = sum(t.nbytes for n, t in gf.tensors.items() if n.startswith("blk.0.") and len(t.shape) == 2)
    ways = {"op_by_op": lambda *a: model.block(*a),
            "whole_layer": lambda *a: backend.run_block(model, *a)}
    doc = {"model": str(path), "threads": threads, "simd": backend.kernels.simd, "layer_matrix_bytes": mat_bytes,
           "load_avg_1m": os.getloadavg()[0]}
    host = NativeCpuBackend(threads=threads, kernels=backend.kernels)  # the probe's own KV cache
    probes = []
    for busy in (False, True):
        stop = threading.Event()
        hog = threading.Thread(target=_busy_python, args=(stop,), daemon=True) if busy else None
        if hog:
            hog.start()
        per = {k: [] for k in ways}
        for _ in range(rounds):  # alternate so load from other processes hits all alike
            for k, run in ways.items():
                per[k] += _time_layers(model, run, seconds)
            if not busy:
                probes.append(links.cpu_bps(host, host, gf, seconds) / 1e9)
        stop.set()
        if hog:
            hog.join()
        for k, ts in per.items():
            med = statistics.median(ts)
            doc[f"{k}{'_busy_python' if busy else ''}"] = {"ms_per_layer": med * 1e3, "gb_s": mat_bytes / med / 1e9}
    doc["probe_gb_s"] = statistics.median(probes)
    doc["probe_over_whole_layer"] = doc["probe_gb_s"] / doc["whole_layer"]["gb_s"]
    backend.close()
    gf.close()
    return doc


def layer_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_cpu.py layer", description=layer_bench.__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a dense GGUF (default: a synthetic one of --shape)")
    ap.add_argument("--shape", default="llama3-8b", help="synthetic 2-layer Q4_K_M model: llama3-8b or llama3-70b")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--seconds", type=float, default=1.0, help="per way and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    text = json.dumps(layer_bench(args.model, args.threads, args.seconds, args.rounds, args.shape), indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


def main() -> None:
    if sys.argv[1:2] == ["layer"]:
        layer_main(sys.argv[2:])
        return
    if sys.argv[1:2] == ["matvec"]:  # matvec GB/s per thread count (scripts/bench_matvec.py)
        from bench_matvec import main as matvec_main

        matvec_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--kernels", action="store_true", help="also time one matvec per weight shape")
    ap.add_argument("--json", type=Path, default=None, help="write the result here (always printed)")
    args = ap.parse_args()
    model = args.model or default_model()
    llm = load_llama(model, args.threads)
    ntx, ntx_op, ref = [], [], []
    for r in range(args.rounds):
        ntx.append(run_ntx(model, args.threads, args.tokens, args.prompt))
        ntx_op.append(run_ntx(model, args.threads, args.tokens, args.prompt, whole_layer=False))
        ref.append(run_llama(llm, args.tokens, args.prompt))
        print(f"round {r + 1}: ntx {ntx[-1]:.1f} tok/s (op by op {ntx_op[-1]:.1f}), llama.cpp {ref[-1]:.1f} tok/s",
              file=sys.stderr)
    from ntx_engine.backends.cpu_kernels import CpuKernels

    kern = CpuKernels(1)
    doc = {
        "model": str(model), "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
        "simd": kern.simd, "numa_nodes": kern.numa_nodes(), "cpu": platform.processor() or platform.machine(),
        "load_avg_1m": os.getloadavg()[0],
        "ntx_decode_tok_s": ntx, "ntx_op_by_op_decode_tok_s": ntx_op, "llama_cpp_decode_tok_s": ref,
        "ntx_median": statistics.median(ntx), "ntx_op_by_op_median": statistics.median(ntx_op),
        "llama_cpp_median": statistics.median(ref),
        "ratio_median": statistics.median(ntx) / statistics.median(ref),
    }
    kern.close()
    doc["ntx_cpu_tok_s"], doc["llama_cpp_cpu_tok_s"] = cpu_time_rates(model, args.tokens, args.prompt)
    doc["ratio_cpu_time"] = doc["ntx_cpu_tok_s"] / doc["llama_cpp_cpu_tok_s"]
    if args.kernels:
        doc["kernels"] = kernel_table(model)
    text = json.dumps(doc, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
