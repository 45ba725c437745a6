"""Errors in Ollama's shape: {"error": "message"} with the HTTP status (400
for a bad request, 404 for a model not found: `model "x" not found, try
pulling it first`, 500 only for a fault of the server's own).

The app's exception handlers and the HTTP guard answer /api/ paths in this
shape (router/api/errors.py); every /api/ handler is also wrapped here, to
name a model the pool does not know as Ollama does (an error after a
stream has begun is an {"error"} line: router/ollama/ndjson_format.py).
"""

from __future__ import annotations

import functools
import logging

from starlette.responses import JSONResponse

from router.api.errors import ApiError
from router.routing.engine_api import EngineError

log = logging.getLogger("tandem.router")


def model_not_found(name: str) -> ApiError:
    return ApiError(404, f'model "{name}" not found, try pulling it first', param="model", code="model_not_found")


def ollama_response(error: ApiError) -> JSONResponse:
    return error.response(ollama=True)


def as_ollama(exc: Exception, name: str | None = None) -> ApiError:
    """`exc` as the error to send; a model the pool does not know named as
    Ollama names it."""
    if isinstance(exc, ApiError):
        if exc.status == 404 and exc.code == "model_not_found" and name is not None:
            return model_not_found(name)
        return exc
    if isinstance(exc, EngineError):
        return ApiError.from_engine(exc)
    log.exception("unexpected error in an Ollama route")
    return ApiError(500, "Internal server error")


def ollama_errors(handler):
    """A route handler whose errors are answered in Ollama's shape."""

    @functools.wraps(handler)
    async def wrapped(self, request):
        try:
            return await handler(self, request)
        except Exception as exc:  # noqa: BLE001 - every error answered in the route's own shape
            return ollama_response(as_ollama(exc, getattr(request.state, "ollama_model", None)))

    return wrapped
