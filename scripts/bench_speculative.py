"""Layer-skip and speculative-decoding benchmark: quality and speed tables for docs/skip.md and
docs/speculative.md.

    python scripts/bench_speculative.py skip  [--model M] [--device cpu] [--ppl-tokens 2048]
    python scripts/bench_speculative.py spec  [--model M] [--device cpu|cuda] [-n 32] [--k 2,4]
           [--draft-layers 24,all,resident] [--skip 0,4] [--draft-model D] [--vram-budget 24G]

`skip`: threshold -> layers skipped -> perplexity -> top-1 agreement -> decode tok/s, on the
shipped text tests/data/python_reference.txt (the first --ppl-tokens tokens, windows of 512).
The profile is the stored one (`ntx-run --calibrate-skip`) or, if none, calibrated in memory.

`spec`: for every (draft layers, skip, k): draft tokens proposed/accepted, tokens per verify
pass (accepted + the correction/bonus token), decode tok/s against plain greedy on the same
prompts, and whether the tokens are identical to plain greedy. Greedy only: acceptance of a
model with random weights (synthetic models) is meaningless; use those for speed only.
Prints a markdown table and, with --json FILE, writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as ntx-run; and CPU time = decode time (below)

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "python_reference.txt"
PROMPTS = ("The capital of France is Paris. The capital of Germany is",
           "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
THRESHOLDS = (1.0, 0.972, 0.970, 0.965, 0.960, 0.955, 0.950, 0.0)


def _engine(args):
    from ntx_engine.engine import Engine, EngineConfig
    from ntx_engine.planner import parse_size

    budgets = {k: parse_size(v, "--" + k.replace("_", "-")) for k, v in
               (("vram_budget", args.vram_budget), ("ram_budget", args.ram_budget)) if v is not None}
    return Engine.load(args.model, EngineConfig(device=args.device, n_ctx=args.ctx, **budgets))


def _profile(eng):
    from ntx_engine import skip

    return skip.load_profile(eng.gguf.path) or skip.calibrate(eng)


def _decode_tok_s(eng, gen, n, repeat=1):
    """(tokens per prompt, decode tok/s): the decode of one prompt costs t(n tokens) - t(1 token),
    best of `repeat` runs. On the CPU backends t is process CPU time, so other jobs on a shared
    machine count less (one BLAS thread); on CUDA it is wall time."""
    clock = time.process_time if eng.model.backend.name in ("cpu", "numpy") else time.perf_counter
    toks, cpu, steps = [], 0.0, 0
    for p in PROMPTS:
        ids, best = eng.tokenize(p), float("inf")
        for _ in range(repeat):
            c = []
            for m in (1, n):
                eng._cached = []
                t0 = clock()
                out = list(gen(ids, m, None, None))
                c.append(clock() - t0)
            best = min(best, c[1] - c[0])
        toks.append(out)
        cpu, steps = cpu + best, steps + len(out) - 1
    return toks, steps / cpu if cpu > 0 else 0.0


def bench_skip(args) -> list[dict]:
    from ntx_engine import perplexity, skip

    eng = _engine(args)
    prof = _profile(eng)
    ids = eng.tokenize(TEXT.read_text())[:args.ppl_tokens]
    window = min(512, eng.model.n_ctx)
    full = perplexity.evaluate(eng.model, ids, window) if args.ppl_tokens else None
    rows, seen = [], set()
    choices = ([("count", int(c)) for c in args.skip_counts.split(",")] if args.skip_counts
               else [("threshold", t) for t in THRESHOLDS])
    for how, t in choices:
        plan = skip.SkipPlan(eng.config.n_layers, skip.choose_skip(prof, **{how: t}))
        if plan.skipped in seen:
            continue
        seen.add(plan.skipped)
        res = full if not plan.skipped or full is None else perplexity.evaluate(eng.model, ids, window, layers=plan.layers)
        skip.apply_skip(eng, plan)
        _, tok_s = _decode_tok_s(eng, eng.generate, args.n, args.repeat)
        q = {} if res is None else {"perplexity": round(res.perplexity, 3), "ppl_tokens": res.scored,
                                    "top1_agreement": round(res.agreement(full), 4)}
        rows.append({how: t, "skipped": len(plan.skipped), "layers": list(plan.skipped), **q,
                     "decode_tok_s": round(tok_s, 2)})
        print(rows[-1], flush=True)
    skip.apply_skip(eng, skip.SkipPlan(eng.config.n_layers))
    return rows


def _draft_layers(spec: str, eng) -> list[int]:
    from ntx_engine import speculative as S

    if spec == "resident":  # the VRAM-resident layers of the tier plan (all, when nothing streams)
        return S.default_draft_layers(eng)
    return list(range(eng.config.n_layers)) if spec == "all" else list(range(int(spec)))


def bench_spec(args) -> list[dict]:
    from ntx_engine import skip

    eng = _engine(args)
    want, plain_tok_s = _decode_tok_s(eng, eng.generate, args.n, args.repeat)
    rows = [{"config": "plain greedy", "decode_tok_s": round(plain_tok_s, 2)}]
    print(rows[-1], flush=True)
    draft_eng = None
    if args.draft_model:
        from ntx_engine.engine import Engine, EngineConfig

        draft_eng = Engine.load(args.draft_model, EngineConfig(device=args.device, n_ctx=args.ctx))
    prof = _profile(eng) if any(int(s) for s in args.skip.split(",")) else None
    for dl in args.draft_layers.split(","):
        for n_skip in (int(s) for s in args.skip.split(",")):
            skipped = skip.choose_skip(prof, count=n_skip) if n_skip else ()
            for k in (int(x) for x in args.k.split(",")):
                for exact in ([True, False] if eng.model.backend.name == "numpy" and args.batched else [None]):
                    rows.append(_spec_row(eng, draft_eng, dl, skipped, k, exact, want, plain_tok_s, args))
                    print(rows[-1], flush=True)
            if draft_eng is not None:
                break
        if draft_eng is not None:
            break
    return rows


def _spec_row(eng, draft_eng, dl, skipped, k, exact, want, plain_tok_s, args) -> dict:
    from ntx_engine import speculative as S

    layers = [i for i in _draft_layers(dl, eng) if i not in set(skipped)]
    draft = S.ModelDraft(draft_eng, eng) if draft_eng is not None else S.LayerDraft(eng.model, layers)
    sp = S.SpecStats()
    tgt = S.Target(eng, row_exact=exact)

    def gen(ids, n, sampler, st):
        return S.generate(eng, draft, ids, n, k, sampler, st, sp if n > 1 else None, tgt)

    toks, tok_s = _decode_tok_s(eng, gen, args.n, args.repeat)
    desc = Path(args.draft_model).name if draft_eng is not None else f"layers {dl}, skip {len(skipped)}"
    return {"config": f"draft {desc}, k={k}" + ("" if exact is None else (", row-exact" if exact else ", batched")),
            "draft_layers": None if draft_eng is not None else len(layers), "k": k,
            "proposed": sp.proposed, "accepted": sp.accepted, "acceptance": round(sp.acceptance, 3),
            "tokens_per_pass": round(sp.tokens_per_pass, 3), "corrections": sp.corrections, "bonus": sp.bonus,
            "decode_tok_s": round(tok_s, 2), "speedup": round(tok_s / plain_tok_s, 3) if plain_tok_s else None,
            # the two costs the bound in docs/speculative.md is made of (all prompts, all repeats)
            "verify_ms_per_pass": round(1e3 * sp.verify_s / sp.passes, 2) if sp.passes else None,
            "draft_ms_per_token": round(1e3 * sp.draft_s / sp.proposed, 2) if sp.proposed else None,
            "identical_to_greedy": toks == want}


def _markdown(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["skip", "spec"])
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--ppl-tokens", type=int, default=2048, help="0: speed only")
    ap.add_argument("--skip-counts", default=None, help="skip mode: skip these layer counts instead of the thresholds")
    ap.add_argument("--repeat", type=int, default=1, help="decode timings: best of this many runs")
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--draft-layers", default="24,all", help="comma list of first-N counts, 'all' or 'resident'")
    ap.add_argument("--vram-budget", default=None, help="e.g. 24G: the tier planner streams what does not fit")
    ap.add_argument("--ram-budget", default=None)
    ap.add_argument("--skip", default="0,4", help="comma list: layers skipped in the draft (most similar first)")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--batched", action="store_true", help="numpy: also time the batched (not row-exact) verify")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = bench_skip(args) if args.mode == "skip" else bench_spec(args)
    print(_markdown(rows))
    print(f"({time.perf_counter() - t0:.0f} s, device {args.device})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
