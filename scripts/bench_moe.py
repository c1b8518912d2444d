"""Benchmark MoE expert offload: a Mixtral-8x7B-shaped Q4_K_M model under a 24 GB VRAM budget,
decode tok/s with the VRAM expert cache (lru, then lfu) and with CPU-computed experts, the
cache hit rate, expert bytes per token and achieved speed over the bound.

    python3 scripts/bench_moe.py --json /tmp/moe.json                       # the H200 run
    python3 scripts/bench_moe.py --device cpu --shape tiny-moe --vram-budget 0 --expert-slots 5 \\
        --decode 8 --warmup 4                                               # smoke test on a CPU

The model file repeats layer 0's random expert and attention blocks in every layer (only bytes
and shapes matter for speed, and writing is then disk-bound); each layer's router is its own
random F32 matrix, so routing differs from layer to layer. Random weights route without the
locality real models have: hit rates here are those of near-uniform routing, a floor for the
cache, not a prediction for a real Mixtral.

One process loads the model once and switches modes (`ExpertOffload.configure`): lru, then lfu
(each cache starts empty), lru with the next-layer prefetch experiment (moe_prefetch.py), then
cpu. Each mode decodes `--warmup` tokens (the cache fills),
resets its counters, then times `--decode` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_tiers import git_commit  # noqa: E402  (scripts/ is on sys.path above)

NOTE = ("synthetic random weights: routing is near-uniform, without the locality of a real model; "
        "hit rates are a floor for the cache, not a prediction for real Mixtral")


def write_repeated_moe(path: Path, shape: str, mix: str, n_layers: int | None, seed: int = 0) -> int:
    """make_synthetic_model.write_moe_model, but every layer reuses layer 0's random blocks
    except the router (`ffn_gate_inp`), which is drawn per layer."""
    import gguf
    import make_synthetic_model as ms

    m, plan = ms.moe_tensor_plan(shape, n_layers, mix)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), m.arch)
    w.add_name(f"synthetic {shape} {mix} (repeated layer, own routers)")
    ms._moe_header(w, m)
    arrays: dict[str, np.ndarray] = {}

    def data(name: str, t, shp) -> np.ndarray:
        key = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if "gate_inp" in name and "shexp" not in name:  # per layer: routing differs by layer
            return (rng.standard_normal(shp) * 0.1).astype(np.float32)
        if key not in arrays:
            if t == ms.T.F32:
                arrays[key] = (1.0 + 0.1 * rng.standard_normal(shp)).astype(np.float32)
            else:
                blocks = ms.random_blocks(t, int(np.prod(shp)), rng)
                arrays[key] = blocks.reshape(*shp[:-1], blocks.size // int(np.prod(shp[:-1])))
        return arrays[key]

    for name, t, shp in plan:  # header pass: shapes, types and sizes
        if t == ms.T.F32:
            w.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
        else:
            raw = data(name, t, shp)
            w.add_tensor_info(name, raw.shape, np.dtype(np.uint8), raw.nbytes,
                              raw_dtype=gguf.GGMLQuantizationType(int(t)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = 0
    for name, t, shp in plan:
        arr = data(name, t, shp)
        w.write_tensor_data(arr)
        total += arr.nbytes
    w.close()
    return total


def decode(model, tok: int, pos: int, n: int) -> tuple[int, int, float]:
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(model.forward(np.asarray([tok]), pos)[-1]))
        pos += 1
    return tok, pos, time.perf_counter() - t0


def bound(plan, st: dict, dense_bytes: int) -> float:
    """Seconds per token from the measured bytes and links: dense part and cached experts read
    from VRAM, CPU-side experts from DRAM, plus the misses over H2D (a miss is copied after its
    layer routes and before its experts run: the terms add, as in moe_plan)."""
    lk = plan.links
    gpu_reads = st["selections"]["gpu"] / max(st["tokens"], 1) * st["slot_bytes"]
    compute = (dense_bytes + gpu_reads) / lk.vram + ((st["cpu_bytes_per_token"] or 0) / lk.cpu if lk.cpu else 0)
    return compute + (st["h2d_bytes_per_token"] or 0) / lk.h2d


def run_modes(path: Path, args) -> dict:
    from ntx_engine.backends import make_backend
    from ntx_engine.config import ModelConfig
    from ntx_engine.engine import EngineConfig, load_model
    from ntx_engine.gguf import GGUFFile
    from ntx_engine.links import measure
    from ntx_engine.moe_offload import host_for
    from ntx_engine.planner import parse_size

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    backend = make_backend(args.device)
    base = EngineConfig(device=args.device, n_ctx=1024)
    host = host_for(backend, base) if args.device == "cuda" else None
    links = measure(backend, gf, "auto", host=host)
    if host is not None and host is not backend:
        host.close()
    ecfg = EngineConfig(device=args.device, n_ctx=1024, links=links, vram_budget=parse_size(args.vram_budget),
                        expert_cache="lru", expert_slots=args.expert_slots, moe_experts="gpu")
    t0 = time.perf_counter()
    model = load_model(gf, cfg, backend, ecfg)
    load_s = time.perf_counter() - t0
    off, plan = model.offload, model.plan
    dense = sum(p.nbytes for p in plan.placements) + plan.head_bytes
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, 16)
    tok, pos = int(np.argmax(model.forward(prompt, 0)[-1])), len(prompt)
    results = {}
    modes = [("gpu-lru", {"policy": "lru", "side": "gpu"}), ("gpu-lfu", {"policy": "lfu"}),
             ("gpu-lru-prefetch", {"policy": "lru", "prefetch": True}), ("cpu", {"side": "cpu", "prefetch": False})]
    for mode, kw in modes:
        try:
            off.configure(**kw)
        except Exception as exc:  # e.g. no native CPU kernels: report, keep the other modes
            results[mode] = {"error": str(exc)}
            continue
        tok, pos, _ = decode(model, tok, pos, args.warmup if mode != "cpu" else 1)
        off.reset_stats()
        tok, pos, secs = decode(model, tok, pos, args.decode)
        st = off.stats()
        b = bound(plan, st, dense)
        tok_s = args.decode / secs
        results[mode] = {"decode_tok_s": tok_s, "bound_tok_s": 1 / b, "achieved_over_bound": tok_s * b,
                         "hit_rate": (st["cache"] or {}).get("hit_rate"), "h2d_bytes_per_token": st["h2d_bytes_per_token"],
                         "cpu_bytes_per_token": st["cpu_bytes_per_token"], "prefetch": st["prefetch"], "stats": st}
        print(mode, json.dumps({k: v for k, v in results[mode].items() if k != "stats"}), flush=True)
    model.source.close()
    return {"load_s": load_s, "plan": plan.as_dict(), "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="mixtral-8x7b")
    ap.add_argument("--mix", default="q4_k_m")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--model", type=Path, help="an existing MoE GGUF instead of the synthetic one")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ntx-bench"))
    ap.add_argument("--vram-budget", default="24G")
    ap.add_argument("--expert-slots", type=int, help="override the cache size the budget gives")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=24, help="tokens decoded before timing (the cache fills)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to smoke-test the script")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    path = args.model
    if path is None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        path = args.workdir / f"{args.shape}-{args.mix}-{args.layers or 'all'}-moe.gguf"
        if not path.exists():
            t0 = time.perf_counter()
            tmp = path.with_suffix(".partial")
            n = write_repeated_moe(tmp, args.shape, args.mix, args.layers)
            tmp.rename(path)
            print(f"wrote {path} ({n / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)
    res = run_modes(path, args)
    out = {"model": str(path), "model_bytes": os.path.getsize(path), "vram_budget": args.vram_budget,
           "commit": git_commit(), "machine": platform.node(), "command": " ".join(sys.argv), "note": NOTE, **res}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(f"\nnote: {NOTE}")
    print(f"{'mode':16} {'tok/s':>8} {'bound':>8} {'ach/bnd':>8} {'hit':>6} {'H2D MB/tok':>11} {'CPU MB/tok':>11}")
    for mode, r in res["results"].items():
        if "error" in r:
            print(f"{mode:16} error: {r['error']}")
            continue
        hit = f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "-"
        print(f"{mode:16} {r['decode_tok_s']:8.2f} {r['bound_tok_s']:8.2f} {r['achieved_over_bound']:8.2f} {hit:>6} "
              f"{(r['h2d_bytes_per_token'] or 0) / 1e6:11.1f} {(r['cpu_bytes_per_token'] or 0) / 1e6:11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
