"""Errors in the OpenAI format: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx
status, for our own checks, FastAPI's validation errors and anything unexpected."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ntx_common.console import err


class APIError(Exception):
    """A request the server refuses; carries the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        err.print(f"error: {request.url.path}: {type(exc).__name__}: {exc}")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()


def validation_error(errors: list[dict]) -> APIError:
    """FastAPI's validation errors as one 400: bad JSON, a missing field or a wrong type."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})",
                        code="invalid_json")
    param = _param(first.get("loc", ()))
    if param is None:
        return APIError(400, f"the request body must be a JSON object: {first.get('msg', 'invalid value')}",
                        code="invalid_type")
    # a union field (`stop`: str or list) fails once per member: say all of it in one message
    msgs = list(dict.fromkeys(e.get("msg", "") for e in errors if _param(e.get("loc", ())) == param))
    got = json.dumps(first.get("input"), default=str)[:80] if "input" in first else "nothing"
    return APIError(400, f"{param}: {'; or '.join(msgs[:3])} (got {got})", param=param, code="invalid_type")


def _param(loc: tuple | list) -> str | None:
    """`messages.0.role` from pydantic's location, without "body" and union member tags
    (`int`, `list[str]`, `ContentPart`), which are not names the client wrote."""
    parts = [str(p) for p in loc if p != "body" and not _is_type_tag(p)]
    return ".".join(parts) or None


def _is_type_tag(part: object) -> bool:
    if not isinstance(part, str) or not part:
        return False
    return "[" in part or part in ("int", "float", "str", "bool", "none", "list", "dict") or part[0].isupper()
