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

        return Engine.load(opts.model, EngineConfig(device=opts.device, n_ctx=opts.ctx), on_layer)


def _messages(opts: RunOptions, history: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": opts.system}] if opts.system else []) + history


def prompt_ids(engine: Engine, opts: RunOptions, prompt: str) -> tuple[list[int], bool]:
    """Token ids for a one-shot prompt, through the chat template unless --raw or none exists."""
    if opts.raw or engine.chat_template is None:
        return engine.tokenize(prompt), False
    text = engine.render_chat(_messages(opts, [{"role": "user", "content": prompt}]))
    return engine.tokenize(text, add_special=False), True


def stream(engine: Engine, ids: list[int], opts: RunOptions, echo: bool) -> GenerationStats:
    stats = GenerationStats()
    dec = engine.tokenizer.stream_decoder(skip_special=True)
    for tok in engine.generate(ids, opts.max_tokens, opts.sampler(), stats):
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


def run_once(opts: RunOptions, prompt: str) -> dict[str, Any] | None:
    engine = load_engine(opts)
    try:
        ids, templated = prompt_ids(engine, opts, prompt)
        stats = stream(engine, ids, opts, echo=not opts.json)
        err.print(f"[dim]{stats_line(stats)}[/]")
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
            "stop_reason": stats.stop_reason,
        }
    finally:
        engine.close()


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
            stats = stream(engine, ids, opts, echo=True)
            reply = engine.detokenize([t for t in stats.tokens if not engine.tokenizer.is_eog(t)])
            history.append({"role": "assistant", "content": reply})
            err.print(f"[dim]{stats_line(stats)}[/]")
    finally:
        engine.close()
