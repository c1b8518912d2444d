"""The FastAPI application: one loaded engine, one worker thread, the OpenAI routes, `/health`,
`/metrics` (Prometheus text) and `/report` (the HTML page of the last run)."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse

from ntx_engine.engine import Engine
from ntx_engine.report import RunSummary, render_report
from ntx_serve.completions import router
from ntx_serve.errors import APIError, install_handlers
from ntx_serve.metrics import Metrics
from ntx_serve.worker import Worker

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class ServerState:
    engine: Engine
    model_id: str  # the name clients pass as `model`
    max_tokens: int  # per-request cap on generated tokens (the context may cap it lower)
    metrics: Metrics
    worker: Worker
    started: int


def create_app(engine: Engine, model_id: str, max_tokens: int | None = None) -> FastAPI:
    """An app serving `engine`; the worker thread runs while the app is started (lifespan)."""
    metrics = Metrics()
    cap = engine.model.n_ctx if max_tokens is None else max_tokens
    if cap <= 0:
        raise ValueError(f"max_tokens must be positive, got {cap}")
    state = ServerState(engine, model_id, cap, metrics, Worker(engine, metrics), int(time.time()))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        yield
        state.worker.stop()

    app = FastAPI(title="ntx-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ntx = state
    install_handlers(app)
    app.include_router(router)
    _add_info_routes(app)
    return app


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        st: ServerState = request.app.state.ntx
        return {"object": "list", "data": [_model_card(st)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        st: ServerState = request.app.state.ntx
        if model_id != st.model_id:
            raise APIError(404, f"model {model_id!r} is not served here", param="model", code="model_not_found")
        return _model_card(st)

    @app.get("/health")
    async def health(request: Request) -> dict:
        st: ServerState = request.app.state.ntx
        return {"status": "ok", "model": st.model_id, "device": st.engine.engine_config.device,
                "n_ctx": st.engine.model.n_ctx, "queue_depth": st.metrics.queue_depth, "busy": bool(st.metrics.busy)}

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(request.app.state.ntx.metrics.render(), media_type=PROMETHEUS_TEXT)

    @app.get("/report")
    async def report(request: Request) -> HTMLResponse:
        st: ServerState = request.app.state.ntx
        run = st.worker.last_run or RunSummary(model=st.engine.gguf.path.name, device=st.engine.engine_config.device,
                                               prompt_tokens=0, generated_tokens=0, prefill_tok_s=0.0,
                                               decode_tok_s=0.0, stop_reason="no request served yet")
        return HTMLResponse(render_report(run))


def _model_card(st: ServerState) -> dict:
    return {"id": st.model_id, "object": "model", "created": st.started, "owned_by": "ntx"}
