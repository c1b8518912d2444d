"""One thread owns the engine and serves generation jobs in arrival order.

The engine is not re-entrant (one KV cache), so requests never run concurrently: handlers queue
a `Job` and read `Event`s back. A job whose client went away is marked cancelled; the worker
checks the mark after every text piece (one token's decode step at most) and before starting.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ntx_common.console import err
from ntx_common.errors import NtxError
from ntx_engine.engine import Engine, GenerationStats
from ntx_engine.report import RunSummary
from ntx_engine.sampler import SamplerConfig
from ntx_serve.metrics import Metrics
from ntx_serve.stops import StopMatcher


@dataclass(frozen=True)
class Event:
    kind: str  # "text" (a piece of the reply), "done" (last event) or "error" (last event)
    text: str = ""
    finish: str = ""  # done: "stop", "length" or "cancelled"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Exception | None = None


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    sampler: SamplerConfig
    stops: tuple[str, ...]
    emit: Callable[[Event], None]  # thread-safe hand-over to the request's event loop
    endpoint: str
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker:
    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.last_run: RunSummary | None = None
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="ntx-serve-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.metrics.add(queue_depth=1)
        self._jobs.put(job)

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the job in hand, then end the thread (queued jobs after it are dropped)."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.metrics.add(queue_depth=-1)
            if job.cancelled.is_set():  # the client left while the job waited
                self.metrics.count_request(job.endpoint, "cancelled")
                job.emit(Event("done", finish="cancelled", prompt_tokens=len(job.ids)))
                continue
            self.metrics.add(busy=1)
            try:
                event = self._generate(job)
            except Exception as exc:  # noqa: BLE001 - one bad request must not end the server
                if not isinstance(exc, NtxError):
                    err.print(f"error: generation failed: {type(exc).__name__}: {exc}")
                event = Event("error", error=exc)
            finally:
                self.metrics.add(busy=-1)
            outcome = "error" if event.kind == "error" else "cancelled" if event.finish == "cancelled" else "ok"
            self.metrics.count_request(job.endpoint, outcome)
            job.emit(event)

    def _generate(self, job: Job) -> Event:
        eng = self.engine
        eng.reset()  # every request from a fresh prefill: the same text as ntx-run (Engine.reset)
        stats, stop = GenerationStats(), StopMatcher(job.stops)
        t0, finish, counted = time.perf_counter(), "", 0
        pieces = eng.stream(job.ids, job.max_tokens, job.sampler, stats)
        try:
            for piece in pieces:
                self.metrics.add(generated_tokens=stats.generated - counted)
                counted = stats.generated
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                text, hit = stop.push(piece)
                if text:
                    job.emit(Event("text", text))
                if hit:
                    finish = "stop"
                    break
        finally:
            pieces.close()  # ends the engine's generator: no more decode steps
        self.metrics.add(generated_tokens=stats.generated - counted, prompt_tokens=stats.prompt_tokens)
        if not finish:
            tail, hit = stop.flush()
            if tail:
                job.emit(Event("text", tail))
            finish = "stop" if hit or stats.stop_reason == "eos" else "length"
        self._record(stats, time.perf_counter() - t0)
        return Event("done", finish=finish, prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generated)

    def _record(self, stats: GenerationStats, wall_s: float) -> None:
        if stats.decode_s == 0.0 and stats.generated > 1:  # stopped early: generate never timed it
            stats.decode_s = max(wall_s - stats.prefill_s, 1e-9)
        run = RunSummary.from_run(self.engine, stats)
        self.last_run = run
        self.metrics.last = {"prefill_tok_s": run.prefill_tok_s, "decode_tok_s": run.decode_tok_s}
        self.metrics.run_stats = run.stats
