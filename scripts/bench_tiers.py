"""Benchmark the 3-tier pipeline: decode and prefill tok/s per budget scenario against the
planner's predicted bound, and the ratio over `--tiers mmap-baseline` with the same budget.

    python3 scripts/bench_tiers.py --synthetic llama3-70b:q4_k_m --layers 40 \\
        --scenario S0:: --scenario S1:12G:4G --scenario S2:12G: --scenario S3:12G:0 \\
        --baseline S2 --json out.json

A scenario is NAME:VRAM:RAM[:HYBRID] (empty = the default: what is free); HYBRID is `nohybrid`
(every non-resident layer streams, `--hybrid off`), `cpu` (every non-resident layer computed on the
CPU, `--hybrid cpu`) or absent (the planner's split, `--hybrid auto`): e.g. S2cpu:24G:200G:cpu.
Synthetic files repeat one random layer's bytes for every layer (only bytes and shapes matter
for speed; writing is then disk-bound). Prints a table last; JSON holds the plans and the pipeline counters.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]


def write_repeated_model(path: Path, shape: str, mix: str, n_layers: int | None, seed: int = 0) -> int:
    """Like make_synthetic_model.write_model, but every layer reuses layer 0's random blocks."""
    import gguf
    import make_synthetic_model as ms

    (layers, e, ff, nh, nkv, vocab, base, ctx), plan = ms.tensor_plan(shape, n_layers, mix)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_name, f"synthetic {shape} {mix} (repeated layer)"), (w.add_block_count, layers),
                       (w.add_context_length, ctx), (w.add_embedding_length, e), (w.add_feed_forward_length, ff),
                       (w.add_head_count, nh), (w.add_head_count_kv, nkv), (w.add_rope_freq_base, base),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_dimension_count, e // nh),
                       (w.add_vocab_size, vocab)):
        add(value)
    add_byte_vocab(w, vocab)
    arrays: dict[str, np.ndarray] = {}
    for name, t, shp in plan:
        key = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if key not in arrays:
            if t == ms.T.F32 and len(shp) == 1:
                arrays[key] = (1.0 + 0.1 * rng.standard_normal(shp[0])).astype(np.float32).view(np.uint8)
            else:
                arrays[key] = ms.random_blocks(t, int(np.prod(shp)), rng).reshape(-1)
        raw = arrays[key]
        w.add_tensor_info(name, shp if len(shp) == 1 and t == ms.T.F32 else (shp[0], raw.size // shp[0]),
                          np.dtype(np.float32) if t == ms.T.F32 and len(shp) == 1 else np.dtype(np.uint8),
                          raw.nbytes, raw_dtype=None if t == ms.T.F32 and len(shp) == 1 else gguf.GGMLQuantizationType(int(t)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = 0
    for name, t, shp in plan:
        key = name.split(".", 2)[-1] if name.startswith("blk.") else name
        w.write_tensor_data(arrays[key])
        total += arrays[key].nbytes
    w.close()
    return total


def add_byte_vocab(w, vocab: int) -> None:
    """A byte-level BPE vocabulary with one merge (two spaces): the 256 byte tokens, that merge,
    then placeholders. Text encodes about byte by byte, enough for benchmarks that tokenize a
    prompt (bench_speculative.py)."""
    from ntx_engine.tokenizer import _BYTE_CHARS

    space = _BYTE_CHARS[ord(" ")]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(_BYTE_CHARS) + [space * 2] + [f"<|synthetic_{i}|>" for i in range(vocab - 257)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([f"{space} {space}"])
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 2)


def parse_scenario(text: str) -> tuple[str, str | None, str | None, str]:
    """NAME:VRAM:RAM[:nohybrid|cpu] -> (name, vram, ram, hybrid mode auto|off|cpu)"""
    name, vram, ram, *flags = (text.split(":") + ["", ""])[:4]
    mode = {"nohybrid": "off", "cpu": "cpu", "": "auto"}.get(flags[0] if flags else "")
    if mode is None:
        raise SystemExit(f"scenario {text!r}: the 4th field must be nohybrid or cpu, not {flags[0]!r}")
    return name, vram or None, ram or None, mode


def bench_one(path: Path, vram: str | None, ram: str | None, tiers: str, decode: int, prefill: int,
              storage: str, device: str = "cuda", hybrid: str = "auto") -> dict:
    from ntx_engine.backends import make_backend
    from ntx_engine.config import ModelConfig
    from ntx_engine.engine import EngineConfig, load_model
    from ntx_engine.gguf import GGUFFile
    from ntx_engine.planner import parse_size

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    from ntx_engine.links import measure

    backend = make_backend(device)
    links = measure(backend, gf, storage)  # also for all-resident runs: the bound needs them
    from ntx_engine import tiers as tiers_mod

    host_device = "none" if hybrid == "off" else ("cpu" if device != "cuda" and hybrid == "cpu" else None)
    host = tiers_mod.host_backend(backend, EngineConfig(device=device, tiers=tiers, host_device=host_device))
    if host is not None:  # the CPU's concurrent rate on this model, as Engine.load would measure it
        links = measure(backend, gf, storage, host=host)
        host.close()
    ecfg = EngineConfig(device=device, n_ctx=1024, storage=storage, tiers=tiers, links=links,
                        host_device=host_device, hybrid="cpu" if hybrid == "cpu" else "auto",
                        vram_budget=None if vram is None else parse_size(vram),
                        ram_budget=None if ram is None else parse_size(ram))
    t0 = time.perf_counter()
    model = load_model(gf, cfg, backend, ecfg)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    src = getattr(model, "source", None)
    try:
        prompt = rng.integers(0, cfg.vocab_size, 16)
        logits = model.forward(prompt, 0)
        tok = int(np.argmax(logits[-1]))
        if hasattr(src, "reset_stats"):
            src.reset_stats()
        host_layers = getattr(model, "host_layers", None)
        if host_layers is not None:
            host_layers.reset_stats()
        greedy = getattr(model, "greedy", None)  # all resident on a GPU: the decode graph's argmax
        t1 = time.perf_counter()
        for i in range(decode):
            pos = len(prompt) + i
            tok = greedy(tok, pos) if greedy else int(np.argmax(model.forward(np.asarray([tok]), pos)[-1]))
        decode_s = time.perf_counter() - t1
        pipe = src.stats.as_dict() if hasattr(src, "stats") else None
        cpu = host_layers.stats() if host_layers is not None else None  # the CPU layers' achieved rate
        pp = None
        if prefill:
            ids = rng.integers(0, cfg.vocab_size, prefill)
            chunk = getattr(backend, "prefill_chunk", 256)  # as engine.py chunks a prompt
            model.forward(ids[:64], 0)  # warm-up: the prefill kernels' first launch, cuBLAS's handle
            t2 = time.perf_counter()
            for s in range(0, prefill, chunk):
                model.forward(ids[s:s + chunk], s)
            pp = prefill / (time.perf_counter() - t2)
        plan = model.plan
        tok_s = decode / decode_s
        bound = 1.0 / plan.predicted_token_s
        return {"tiers": tiers, "hybrid": hybrid, "vram_budget": vram, "ram_budget": ram, "load_s": load_s,
                "decode_tok_s": tok_s, "prefill_tok_s": pp, "bound_tok_s": bound,
                "token_time_over_bound": bound / tok_s, "plan": plan.as_dict(), "pipeline": pipe,
                "cpu_layers": cpu, "cpu_probe_gb_s": plan.links.cpu / 1e9}
    finally:
        if hasattr(src, "close"):
            src.close()
        gf.close()


def _cpu_rate(r: dict) -> str:
    cpu = r.get("cpu_layers") or {}
    return f"{cpu['gb_s']:.1f}/{r['cpu_probe_gb_s']:.1f}" if cpu.get("gb_s") else "-"


def run_child(path: Path, scenario: str, tiers: str, decode: int, prefill: int, args) -> dict:
    """One scenario in a fresh process: every scenario starts with all device and pinned memory free."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, __file__, "--model", str(path), "--one", scenario, "--tiers", tiers,
               "--decode", str(decode), "--prefill", str(prefill), "--storage", args.storage,
               "--device", args.device, "--json", tmp.name]
        subprocess.run(cmd, check=True)
        return json.loads(Path(tmp.name).read_text())


def drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise SystemExit(f"--cold-baseline needs root to drop the page cache: {exc}") from None


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--synthetic", help="SHAPE:MIX, e.g. llama3-70b:q4_k_m (written with repeated layers)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ntx-bench"))
    ap.add_argument("--scenario", action="append", default=[], help="NAME:VRAM:RAM")
    ap.add_argument("--baseline", action="append", default=[], help="scenario names to also run as mmap-baseline")
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--baseline-decode", type=int, default=2)
    ap.add_argument("--cold-baseline", action="store_true",
                    help="drop the page cache before each baseline run (root): the file is read from disk")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--storage", default="auto")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to smoke-test the script")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--tiers", default="auto", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    path = args.model
    if path is None:
        shape, mix = args.synthetic.split(":")
        args.workdir.mkdir(parents=True, exist_ok=True)
        path = args.workdir / f"{shape}-{mix}-{args.layers or 'all'}.gguf"
        if not path.exists():
            t0 = time.perf_counter()
            n = write_repeated_model(path, shape, mix, args.layers)
            print(f"wrote {path} ({n / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.one:  # one scenario in this process (the parent runs each in a fresh one)
        _, vram, ram, mode = parse_scenario(args.one)
        res = bench_one(path, vram, ram, args.tiers, args.decode, args.prefill, args.storage, args.device,
                        hybrid=mode)
        args.json.write_text(json.dumps(res))
        return 0
    results = {}
    for sc in args.scenario:
        name, vram, ram, _ = parse_scenario(sc)
        results[name] = run_child(path, sc, "auto", args.decode, args.prefill, args)
        print(name, json.dumps({k: v for k, v in results[name].items() if k not in ("plan", "pipeline")}), flush=True)
        if name in args.baseline:
            if args.cold_baseline:  # the naive mmap path on a model not in the page cache
                drop_page_cache()
            b = run_child(path, sc, "mmap-baseline", args.baseline_decode, 0, args)
            results[name]["baseline_cold_cache"] = args.cold_baseline
            results[name]["baseline_decode_tok_s"] = b["decode_tok_s"]
            results[name]["speedup_over_baseline"] = results[name]["decode_tok_s"] / b["decode_tok_s"]
            print(name, "baseline", b["decode_tok_s"], flush=True)
    out = {"model": str(path), "model_bytes": os.path.getsize(path), "commit": git_commit(),
           "machine": platform.node(), "command": " ".join(sys.argv), "results": results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(f"\n{'scen':5} {'vram':>6} {'ram':>6} {'tok/s':>8} {'bound':>8} {'t/bound':>8} {'pp tok/s':>9} {'xbase':>7}  "
          "GB vram/ram/sto/cpu  CPU layers GB/s achieved/probe")
    for name, r in results.items():
        b = r["plan"]["bytes_per_tier"]
        gb = "/".join(f"{b[t] / 1e9:.1f}" for t in ("vram", "ram", "storage", "cpu"))
        pp = f"{r['prefill_tok_s']:.1f}" if r["prefill_tok_s"] else "-"
        xb = f"{r['speedup_over_baseline']:.1f}" if "speedup_over_baseline" in r else "-"
        print(f"{name:5} {str(r['vram_budget']):>6} {str(r['ram_budget']):>6} {r['decode_tok_s']:8.2f} "
              f"{r['bound_tok_s']:8.2f} {r['token_time_over_bound']:8.2f} {pp:>9} {xb:>7}  {gb}  {_cpu_rate(r)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
