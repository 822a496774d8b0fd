"""Errors in the shape of the API that was called.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}

Routes raise APIError with one of our kinds; the handlers installed by `install_handlers` turn it, and
every framework error (bad JSON, wrong types, unknown path, wrong method, a bug), into the caller's
shape. Which API was called is decided by the path (`/v1/messages...` is Anthropic) and, for the shared
`/v1/models`, by Anthropic's headers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kind:
    status_openai: int
    type_openai: str
    code_openai: str | None
    status_anthropic: int
    type_anthropic: str


KINDS: dict[str, Kind] = {
    "invalid_request": Kind(400, "invalid_request_error", None, 400, "invalid_request_error"),
    "context_length": Kind(400, "invalid_request_error", "context_length_exceeded", 400, "invalid_request_error"),
    "unsupported": Kind(400, "invalid_request_error", "unsupported_parameter", 400, "invalid_request_error"),
    "authentication": Kind(401, "authentication_error", "invalid_api_key", 401, "authentication_error"),
    "permission": Kind(403, "permission_error", "forbidden", 403, "permission_error"),
    "not_found": Kind(404, "invalid_request_error", "not_found", 404, "not_found_error"),
    "method": Kind(405, "invalid_request_error", "method_not_allowed", 405, "invalid_request_error"),
    "too_large": Kind(413, "invalid_request_error", "request_too_large", 413, "request_too_large"),
    "overloaded": Kind(429, "rate_limit_error", "rate_limit_exceeded", 529, "overloaded_error"),
    "unavailable": Kind(503, "server_error", "model_not_ready", 503, "api_error"),
    "server": Kind(500, "server_error", None, 500, "api_error"),
}

# What a service error code becomes.
SERVICE_CODE_KINDS = {"bad_request": "invalid_request", "overloaded": "overloaded", "no_model": "unavailable", "loading": "unavailable",
                      "context_length": "context_length", "engine_error": "server", "load_failed": "unavailable"}


RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, kind: str, message: str, *, param: str | None = None):
        assert kind in KINDS, kind
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param


def is_anthropic(path: str, headers) -> bool:
    if path.startswith("/v1/messages"):
        return True
    if path.startswith("/v1/models"):
        return "anthropic-version" in headers or ("x-api-key" in headers and "authorization" not in headers)
    return False


def error_body(anthropic: bool, kind: str, message: str, param: str | None = None) -> dict:
    k = KINDS[kind]
    if anthropic:
        return {"type": "error", "error": {"type": k.type_anthropic, "message": message}}
    return {"error": {"message": message, "type": k.type_openai, "param": param, "code": k.code_openai}}


def error_status(anthropic: bool, kind: str) -> int:
    return KINDS[kind].status_anthropic if anthropic else KINDS[kind].status_openai


def error_response(anthropic: bool, kind: str, message: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(anthropic, kind, message, param), status_code=error_status(anthropic, kind),
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    problems, param = [], None
    for err in exc.errors()[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        param = param or where
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            problems.append(f"the body is not valid JSON ({ctx.get('error', err.get('msg'))})")
        elif err.get("type") == "missing":
            problems.append(f"field '{where}' is required")
        else:
            problems.append(f"field '{where}': {err.get('msg')}")
    return "; ".join(problems) or "invalid request", param


def install_handlers(app: FastAPI) -> None:
    def anthropic_of(request: Request) -> bool:
        return is_anthropic(request.url.path, request.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        # busy or loading: tell clients when to retry instead of letting them hammer the server
        retry = {"retry-after": str(RETRY_AFTER_S)} if exc.kind in ("overloaded", "unavailable") else None
        return error_response(anthropic_of(request), exc.kind, exc.message, exc.param, headers=retry)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(anthropic_of(request), "invalid_request", message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method", 413: "too_large", 401: "authentication",
                403: "permission"}.get(exc.status_code, "invalid_request" if exc.status_code < 500 else "server")
        message = str(exc.detail) if exc.status_code != 404 else f"no such endpoint: {request.method} {request.url.path}"
        return error_response(anthropic_of(request), kind, message)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(anthropic_of(request), "server", f"internal error: {type(exc).__name__}: {exc}")
