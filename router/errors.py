"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every error the API returns goes through `error_body`, so clients (the openai package
among them) read the same shape for a bad parameter, a full queue, an unknown route or
a bug. Tracebacks stay in the server log, never in a response.
"""

from __future__ import annotations

import math

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from router.engine_api import EngineError


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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineError)
    return ApiError.from_engine(exc).response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette's own 404 (unknown route) and 405 (wrong method).
    assert isinstance(exc, HTTPException)
    return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after this, so uvicorn logs the traceback; the client gets none.
    return ApiError(500, "Internal server error").response()


def exception_handlers() -> dict:
    return {
        ApiError: _api_error,
        EngineError: _engine_error,
        HTTPException: _http_error,
        Exception: _unexpected,
    }
