"""`POST /v1/chat/completions` and `POST /v1/completions`: check the request against the model
and its context, queue it on the worker, answer with one JSON body or a server-sent event stream."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ntx_common.errors import NtxError
from ntx_serve import schemas
from ntx_serve.errors import APIError
from ntx_serve.worker import Event, Job

router = APIRouter()
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks its client


@dataclass(frozen=True)
class Shape:
    """How one endpoint spells its answers."""

    endpoint: str
    prefix: str
    full: Callable[..., dict]
    chunk: Callable[[str, int, str, str, str | None], dict]


def _chat_chunk(rid: str, created: int, model: str, text: str, finish: str | None) -> dict:
    return schemas.chat_chunk(rid, created, model, {"content": text} if finish is None else {}, finish)


CHAT = Shape("chat", "chatcmpl-", schemas.chat_response, _chat_chunk)
TEXT = Shape("completions", "cmpl-", schemas.completion_response, schemas.completion_chunk)


@router.post("/v1/chat/completions")
async def chat_completions(req: schemas.ChatRequest, request: Request):
    st = request.app.state.ntx
    try:
        _check_common(st, req)
        try:
            ids = st.engine.chat_ids([m.as_template_dict() for m in req.messages])
        except NtxError as exc:  # no template, or the template refused the conversation
            raise APIError(400, str(exc), param="messages", code="invalid_messages") from exc
        job = _job(st, req, ids, "messages", CHAT.endpoint)
    except APIError:
        st.metrics.count_request(CHAT.endpoint, "rejected")
        raise
    return await _answer(st, request, req, job, CHAT)


@router.post("/v1/completions")
async def completions(req: schemas.CompletionRequest, request: Request):
    st = request.app.state.ntx
    try:
        _check_common(st, req)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_parameter")
        job = _job(st, req, _prompt_ids(st.engine, req.prompt), "prompt", TEXT.endpoint)
    except APIError:
        st.metrics.count_request(TEXT.endpoint, "rejected")
        raise
    return await _answer(st, request, req, job, TEXT)


def _check_common(st, req) -> None:
    if req.model != st.model_id:
        raise APIError(404, f"model {req.model!r} is not served here; this server serves {st.model_id!r} "
                       "(GET /v1/models)", param="model", code="model_not_found")
    if req.n != 1:
        raise APIError(400, f"n must be 1 (one choice per request), got {req.n}", param="n", code="unsupported_parameter")
    if len(req.stops()) > 4:
        raise APIError(400, "stop takes at most 4 strings", param="stop", code="invalid_value")


def _prompt_ids(engine, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < engine.config.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{engine.config.vocab_size - 1})",
                           param="prompt", code="invalid_value")
        return list(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, "prompt: give one string (batched prompts are not supported)", param="prompt",
                           code="unsupported_parameter")
        prompt = prompt[0]
    return engine.tokenize(prompt)


def _job(st, req, ids: list[int], what: str, endpoint: str) -> Job:
    n_ctx = st.engine.model.n_ctx
    if not ids:
        raise APIError(400, f"{what} is empty: nothing to run", param=what, code="invalid_value")
    if len(ids) >= n_ctx:
        raise APIError(400, f"{what} has {len(ids)} tokens; the context holds {n_ctx} (prompt plus reply): "
                       "shorten it or start the server with a larger --ctx", param=what, code="context_length_exceeded")
    room = min(n_ctx - len(ids), st.max_tokens)
    asked = req.requested_tokens()
    if asked is not None and asked > room:
        raise APIError(400, f"max_tokens {asked} is over the limit: {room} for this prompt ({len(ids)} prompt tokens, "
                       f"context {n_ctx}, server cap {st.max_tokens})", param="max_tokens", code="context_length_exceeded")
    try:
        sampler = req.sampler()
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
    return Job(ids=ids, max_tokens=room if asked is None else asked, sampler=sampler, stops=req.stops(),
               emit=Channel(asyncio.get_running_loop()), endpoint=endpoint)


class Channel:
    """Events from the worker thread into this request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.events = loop, asyncio.Queue()

    def __call__(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the event loop is gone: the server is shutting down
            pass


async def _answer(st, request: Request, req, job: Job, shape: Shape):
    rid, created = shape.prefix + uuid.uuid4().hex[:24], int(time.time())
    st.worker.submit(job)
    if req.stream:
        gen = _sse(job, shape, rid, created, st.model_id, req.include_usage())
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _collect(job, request, shape, rid, created, st.model_id)


async def _collect(job: Job, request: Request, shape: Shape, rid: str, created: int, model: str) -> JSONResponse:
    events: asyncio.Queue[Event] = job.emit.events  # type: ignore[attr-defined]  # a Channel
    parts: list[str] = []
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                ev = None
            if loop.time() - checked >= DISCONNECT_POLL_S:  # pieces may come faster than the poll
                checked = loop.time()
                if await request.is_disconnected():
                    job.cancelled.set()
            if ev is None:
                continue
            if ev.kind == "text":
                parts.append(ev.text)
            elif ev.kind == "error":
                raise _generation_error(ev.error)
            else:
                use = schemas.usage(ev.prompt_tokens, ev.completion_tokens)
                return JSONResponse(shape.full(rid, created, model, "".join(parts), _finish(ev), use))
    finally:
        job.cancelled.set()  # a no-op once done; stops the worker if this handler was cancelled


async def _sse(job: Job, shape: Shape, rid: str, created: int, model: str, with_usage: bool) -> AsyncIterator[str]:
    events: asyncio.Queue[Event] = job.emit.events  # type: ignore[attr-defined]  # a Channel
    try:
        if shape is CHAT:
            yield _data(schemas.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None))
        while True:
            ev = await events.get()
            if ev.kind == "text":
                yield _data(shape.chunk(rid, created, model, ev.text, None))
                continue
            if ev.kind == "error":
                yield _data(_generation_error(ev.error).body())
                return
            last = shape.chunk(rid, created, model, "", _finish(ev))
            yield _data(last)
            if with_usage:
                yield _data(schemas.usage_chunk(last, schemas.usage(ev.prompt_tokens, ev.completion_tokens)))
            yield "data: [DONE]\n\n"
            return
    finally:
        job.cancelled.set()  # the client went away (or we are done): the worker stops at the next token


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _finish(ev: Event) -> str:
    return "length" if ev.finish == "cancelled" else ev.finish


def _generation_error(exc: Exception | None) -> APIError:
    if isinstance(exc, NtxError):
        return APIError(500, f"generation failed: {exc}", type_="server_error", code="generation_failed")
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type_="server_error")
