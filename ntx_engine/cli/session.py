"""What `ntx-run` does once its options are parsed: load with a progress bar, stream, report."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ntx_common.console import err
from ntx_common.errors import UsageError
from ntx_engine.engine import Engine, EngineConfig, GenerationStats
from ntx_engine.sampler import SamplerConfig


@dataclass(frozen=True)
class RunOptions:
    model: Optional[Path]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    seed: Optional[int]
    system: Optional[str]
    raw: bool
    device: str
    ctx: int
    json: bool
    report: Optional[Path] = None  # --report DIR: write DIR/report.html after the run
    vram_budget: Optional[str] = None  # sizes like 24G (planner.parse_size)
    ram_budget: Optional[str] = None
    storage: str = "auto"
    tiers: str = "auto"
    slots: Optional[int] = None
    hybrid: str = "auto"  # auto | off | cpu: CPU-computed layers next to a GPU (cpu: all non-resident)
    skip_threshold: Optional[float] = None  # --skip-threshold / --skip-layers: skip.py
    skip_layers: Optional[int] = None
    speculate: Optional[str] = None  # --speculate k|auto, --draft-model, --draft-layers: speculative.py
    draft_model: Optional[Path] = None
    draft_layers: Optional[int] = None
    expert_cache: str = "lru"  # MoE expert offload: moe_offload.py
    expert_slots: Optional[int] = None
    moe_experts: str = "auto"

    def engine_config(self) -> EngineConfig:
        from ntx_engine.planner import parse_size

        vram = None if self.vram_budget is None else parse_size(self.vram_budget, "--vram-budget")
        ram = None if self.ram_budget is None else parse_size(self.ram_budget, "--ram-budget")
        try:
            if self.hybrid not in ("auto", "off", "cpu"):
                raise ValueError(f"--hybrid must be auto, off or cpu, got {self.hybrid!r}")
            return EngineConfig(device=self.device, n_ctx=self.ctx, vram_budget=vram, ram_budget=ram,
                                storage=self.storage, tiers=self.tiers, n_slots=self.slots,
                                host_device="none" if self.hybrid == "off" else None,
                                hybrid="cpu" if self.hybrid == "cpu" else "auto",
                                expert_cache=self.expert_cache, expert_slots=self.expert_slots,
                                moe_experts=self.moe_experts)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc

    def sampler(self) -> SamplerConfig:
        try:
            return SamplerConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                 min_p=self.min_p, repeat_penalty=self.repeat_penalty, seed=self.seed)
        except ValueError as exc:
            raise UsageError(f"bad sampling option: {exc}") from exc


def load_engine(opts: RunOptions) -> Engine:
    progress = Progress(TextColumn("loading {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("layers"), TimeElapsedColumn(), console=err, transient=True)
    with progress:
        task = progress.add_task(str(opts.model or "default model"), total=None)

        def on_layer(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        return Engine.load(opts.model, opts.engine_config(), on_layer)


def run_plan(opts: RunOptions) -> dict[str, Any] | None:
    """--plan: place the layers and predict the speed without loading or generating."""
    from ntx_common.console import out
    from ntx_engine.cli.plan_view import render
    from ntx_engine.planner import fmt_bytes

    plan = Engine.plan_model(opts.model, opts.engine_config())
    skipping = _plan_skip(opts, plan)
    if opts.json:
        return {**plan.as_dict(), **({"skip": skipping} if skipping else {})}
    render(plan, out)
    for line in getattr(plan, "describe", lambda: [])():  # MoE expert offload
        out.print(line)
    if skipping:
        out.print(f"skip: {len(skipping['skipped_layers'])} layers {skipping['skipped_layers']} — "
                  f"{skipping['skipped_streamed']} streamed (their bytes are not read), "
                  f"{skipping['skipped_resident']} resident (compute saved); bytes per token then "
                  + ", ".join(f"{t} {fmt_bytes(n)}" for t, n in skipping["bytes_per_tier"].items())
                  + f"; predicted decode {skipping['predicted_tok_s']:.2f} tok/s")
    return None


def _plan_skip(opts: RunOptions, plan: Any) -> dict[str, Any] | None:
    """--plan with --skip-threshold/--skip-layers: which layers the stored profile skips, split
    into streamed and resident, and the plan's bytes and predicted speed without them."""
    if opts.skip_threshold is None and opts.skip_layers is None:
        return None
    if not hasattr(plan, "without"):
        raise UsageError("--plan with layer skip needs a dense model's tier plan (not an MoE expert offload)")
    from ntx_engine import skip

    profile = skip.load_profile(opts.model)
    if profile is None:
        raise UsageError(f"{opts.model} has no skip profile yet: run `ntx-run --calibrate-skip -m {opts.model}` first")
    n = len(plan.placements)
    streamed = frozenset(p.layer for p in plan.placements if p.tier in ("ram", "storage"))  # as skip.streamed_layers
    sp = skip.SkipPlan(n, skip.choose_skip(profile, opts.skip_threshold, opts.skip_layers), streamed)
    after = plan.without(sp.skipped)
    return {**sp.to_dict(), "bytes_per_tier": after.bytes_per_tier, "predicted_tok_s": 1.0 / after.predicted_token_s}


def _messages(opts: RunOptions, history: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": opts.system}] if opts.system else []) + history


def prompt_ids(engine: Engine, opts: RunOptions, prompt: str) -> tuple[list[int], bool]:
    """Token ids for a one-shot prompt, through the chat template unless --raw or none exists."""
    if opts.raw or engine.chat_template is None:
        return engine.tokenize(prompt), False
    text = engine.render_chat(_messages(opts, [{"role": "user", "content": prompt}]))
    return engine.tokenize(text, add_special=False), True


def stream(engine: Engine, ids: list[int], opts: RunOptions, echo: bool, gen: Any = None) -> GenerationStats:
    stats = GenerationStats()
    dec = engine.tokenizer.stream_decoder(skip_special=True)
    for tok in (gen or engine.generate)(ids, opts.max_tokens, opts.sampler(), stats):
        if echo and not engine.tokenizer.is_eog(tok):
            sys.stdout.write(dec.push(tok))
            sys.stdout.flush()
    if echo:
        sys.stdout.write(dec.flush() + "\n")
        sys.stdout.flush()
    return stats


def stats_line(stats: GenerationStats) -> str:
    return (f"prompt {stats.prompt_tokens} tok, prefill {stats.prefill_tok_s:.1f} tok/s, "
            f"generated {stats.generated} tok, decode {stats.decode_tok_s:.1f} tok/s, "
            f"stop: {stats.stop_reason}")


def expert_line(st: dict) -> str:
    """The MoE expert offload's counters for the stats line."""
    c = st["cache"]
    cache = (f"expert cache {st['policy']} {st['slots']} slots: hit rate {c['hit_rate'] or 0:.2f} "
             f"({c['hits']} hits, {c['misses']} misses, {c['evictions']} evictions)" if c else "no expert cache")
    per_tok = st["h2d_bytes_per_token"]
    return (f"{cache}; experts on GPU in {st['layers_gpu']} layers, CPU in {st['layers_cpu']}; "
            f"{(per_tok or 0) / 1e6:.1f} MB/token copied")


def run_once(opts: RunOptions, prompt: str) -> dict[str, Any] | None:
    engine = load_engine(opts)
    try:
        ids, templated = prompt_ids(engine, opts, prompt)
        gen, speed = speedups(engine, opts)
        stats = stream(engine, ids, opts, echo=not opts.json, gen=gen)
        err.print(f"[dim]{stats_line(stats)}[/]")
        if getattr(engine.model, "offload", None) is not None:
            err.print(f"[dim]{expert_line(engine.model.offload.stats())}[/]")
        if opts.report is not None:
            _write_report(engine, stats, opts.report)
        if not opts.json:
            return None
        return {
            "model": str(engine.gguf.path), "device": engine.engine_config.device,
            "templated": templated, "prompt_tokens": ids,
            "tokens": stats.tokens, "text": engine.detokenize(
                [t for t in stats.tokens if not engine.tokenizer.is_eog(t)]),
            "prefill_tok_s": stats.prefill_tok_s, "decode_tok_s": stats.decode_tok_s,
            "stop_reason": stats.stop_reason, "tiers": engine.tier_stats(), "stack_decode": engine.stack_decode,
            **speed(),
        }
    finally:
        engine.close()


def speedups(engine: Engine, opts: RunOptions) -> tuple[Any, Any]:
    """Layer skip and speculation from the options: (the generate function to use or None,
    a function returning their --json fields). With --speculate the skipped layers leave the
    draft only; the verify pass always runs every layer."""
    from ntx_engine import skip, speculative

    plan = None
    if opts.skip_threshold is not None or opts.skip_layers is not None:
        plan = skip.plan_for(engine, opts.skip_threshold, opts.skip_layers)
    if opts.speculate is None and opts.draft_model is None and opts.draft_layers is None:
        if plan is not None:
            skip.apply_skip(engine, plan)
        return None, lambda: {"skip": plan.to_dict()} if plan is not None else {}
    if opts.speculate is None:
        raise UsageError("--draft-model / --draft-layers need --speculate K (or auto)")
    draft = None
    if opts.draft_model is not None:
        draft = Engine.load(opts.draft_model, EngineConfig(device=engine.engine_config.device, n_ctx=opts.ctx))
    layers = None if opts.draft_layers is None else range(min(opts.draft_layers, engine.config.n_layers))
    spec = speculative.speculator_for(engine, opts.speculate, draft, layers, plan.skipped if plan else ())
    extra = {"skip": plan.to_dict()} if plan is not None else {}
    return spec.generate, lambda: {**extra, "speculative": spec.to_dict()}


def run_quality(opts: RunOptions, calibrate: bool, ppl_file: Optional[Path]) -> dict[str, Any] | None:
    """--calibrate-skip and/or --eval-ppl FILE: profile the layers, then perplexity and top-1
    agreement of the skip setting against the full model."""
    from ntx_common.console import out
    from ntx_engine import skip

    engine = load_engine(opts)
    try:
        result: dict[str, Any] = {"model": str(engine.gguf.path)}
        if calibrate:
            prof = skip.calibrate(engine)
            result["profile"] = str(skip.save_profile(prof, engine.gguf.path))
            result["similarity"] = list(prof.similarity)
            err.print(f"skip profile ({prof.tokens} tokens) -> {result['profile']}")
            if not opts.json:
                for i, s in enumerate(prof.similarity):
                    out.print(f"layer {i:3d}  cos(in, out) {s:.4f}")
        if ppl_file is not None:
            result.update(_ppl(engine, opts, ppl_file))
        return result if opts.json else None
    finally:
        engine.close()


def _ppl(engine: Engine, opts: RunOptions, path: Path) -> dict[str, Any]:
    from ntx_common.console import out
    from ntx_engine import perplexity, skip

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --eval-ppl file {path}: {exc}") from exc
    ids, window = engine.tokenize(text), min(512, engine.model.n_ctx)
    full = perplexity.evaluate(engine.model, ids, window)
    res = {"ppl_tokens": full.scored, "window": window, "perplexity_full": full.perplexity}
    show = err.print if opts.json else out.print
    show(f"perplexity (all layers) {full.perplexity:.3f} over {full.scored} tokens, window {window}")
    if opts.skip_threshold is not None or opts.skip_layers is not None:
        plan = skip.plan_for(engine, opts.skip_threshold, opts.skip_layers)
        part = perplexity.evaluate(engine.model, ids, window, layers=plan.layers)
        res.update(plan.to_dict(), perplexity=part.perplexity, top1_agreement=part.agreement(full))
        show(f"perplexity (skipping {list(plan.skipped)}) {part.perplexity:.3f}, "
                  f"top-1 agreement {part.agreement(full):.4f}")
    return res


def _write_report(engine: Engine, stats: GenerationStats, directory: Path) -> None:
    from ntx_engine.report import RunSummary, write_report

    try:
        path = write_report(directory, RunSummary.from_run(engine, stats))
    except OSError as exc:
        raise UsageError(f"cannot write the report into {directory}: {exc.strerror or exc}") from exc
    err.print(f"report: {path}")


def run_chat(opts: RunOptions) -> None:
    engine = load_engine(opts)
    if engine.chat_template is None:
        raise UsageError(f"{engine.gguf.path.name} has no chat template; --chat needs one (use a prompt instead)")
    history: list[dict] = []
    gen, _ = speedups(engine, opts)
    err.print(f"chatting with {engine.model_name} — empty line or Ctrl-D to quit")
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            ids = engine.tokenize(engine.render_chat(_messages(opts, history)), add_special=False)
            stats = stream(engine, ids, opts, echo=True, gen=gen)
            reply = engine.detokenize([t for t in stats.tokens if not engine.tokenizer.is_eog(t)])
            history.append({"role": "assistant", "content": reply})
            err.print(f"[dim]{stats_line(stats)}[/]")
    finally:
        engine.close()
