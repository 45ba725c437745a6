"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, and under
/v1/messages in Anthropic's: {"type": "error", "error": {"type", "message"}}, under /api/ in Ollama's:
{"error": "message"}.

Every error the API returns goes through `ApiError.body` (or `anthropic_body`), so clients
(the openai and anthropic packages among them) read the same shape for a bad parameter, a
full queue, an unknown route or a bug. Tracebacks stay in the server log, never in a response.
"""

from __future__ import annotations

import math

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from router.routing.engine_api import EngineError

ANTHROPIC_PATH = "/v1/messages"
# Anthropic's error types by status; any other 4xx is an invalid request, 5xx an api_error.
ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                         504: "timeout_error", 529: "overloaded_error"}


def is_ollama_path(path: str) -> bool:
    """Whether `path` is Ollama's API (router/ollama/: its errors {"error": "message"})."""
    return path.startswith("/api/")


def is_anthropic_path(path: str) -> bool:
    """Whether `path` is Anthropic's Messages API (its errors in Anthropic's shape)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class ApiError(Exception):
    """A request the API refuses, with the HTTP status and OpenAI error fields to send."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def from_engine(cls, exc: EngineError) -> "ApiError":
        headers = {}
        if exc.retry_after is not None:  # 429 (queue full) or 503 (no worker yet)
            # HTTP wants whole seconds; round up so a client never retries too early.
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        return cls(exc.status, exc.message, code=exc.code, headers=headers)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    @property
    def anthropic_status(self) -> int:
        return 400 if self.status == 422 else self.status  # Anthropic: a missing or mistyped field is a 400

    def response(self, anthropic: bool = False, ollama: bool = False) -> JSONResponse:
        if ollama:  # a missing or mistyped field is a bad request there too
            return JSONResponse({"error": self.message}, status_code=400 if self.status == 422 else self.status,
                                headers=self.headers)
        if anthropic:
            return JSONResponse(self.anthropic_body(), status_code=self.anthropic_status, headers=self.headers)
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _anthropic(request: Request) -> bool:
    return is_anthropic_path(request.url.path)


def _shaped(error: ApiError, request: Request) -> JSONResponse:
    return error.response(_anthropic(request), is_ollama_path(request.url.path))


def invalid(param: str, message: str, status: int = 400, code: str = "invalid_value") -> ApiError:
    """The error for a field whose value (400) or type (422, "invalid_type") is wrong, naming it."""
    return ApiError(status, f"Invalid '{param}': {message}", param=param, code=code)


def only(obj: dict, honoured: frozenset, path: str = "") -> None:
    """400 `unsupported_parameter` naming `obj`'s fields an endpoint does not
    honour (the first few: a body is at most max_request_bytes, its error far
    less). A field sent as null counts as not sent (clients echo objects back)."""
    unknown = sorted(k for k, v in obj.items() if k not in honoured and v is not None)
    if unknown:
        names = ", ".join(f"'{path}{k}'" for k in unknown[:8]) + (", ..." if len(unknown) > 8 else "")
        raise ApiError(400, f"Unsupported parameter{'s' if len(unknown) > 1 else ''}: {names}. Tandem does not "
                       f"honour {'them' if len(unknown) > 1 else 'it'} and will not ignore it silently; "
                       f"supported here: {', '.join(sorted(honoured))}",
                       param=path + unknown[0], code="unsupported_parameter")


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _shaped(exc, request)


async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineError)
    return _shaped(ApiError.from_engine(exc), request)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette's own 404 (unknown route) and 405 (wrong method).
    assert isinstance(exc, HTTPException)
    return _shaped(ApiError(exc.status_code, str(exc.detail), headers=exc.headers), request)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after this, so uvicorn logs the traceback; the client gets none.
    return _shaped(ApiError(500, "Internal server error"), request)


def exception_handlers() -> dict:
    return {
        ApiError: _api_error,
        EngineError: _engine_error,
        HTTPException: _http_error,
        Exception: _unexpected,
    }
