"""The OpenAI-compatible HTTP API (Starlette), in front of an `Engine`.

Request path: read and validate the body (router.schemas) -> tokenize -> Engine.generate
-> token events -> text (router.text_stream) -> JSON or SSE in OpenAI's shapes.

Cancellation: the client going away must cancel its request in the workers, also while
the engine is silent (a long prefill sends nothing for seconds). So every generation runs
as a task next to a watcher of the ASGI `receive` channel; on `http.disconnect` the task
is cancelled, which closes the engine's generator, which cancels the request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Coroutine

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from deploy.model_folder import is_vlm
from deploy.settings import Settings
from protos.messages import TokenLogprob
from router.answer_tokens import AnswerTokens
from router.engine_api import Engine, EngineError, GenerationRequest
from router.errors import ApiError, exception_handlers
from router.media import DecodedVideo, MediaLimits, RecentImages
from router.media_parts import load_media_parts
from router.schemas import MODEL_ALIAS, ParsedRequest, check_chat_fields, parse_chat, parse_completion, read_json
from router.text_stream import TextStream, TokenBytes
from router.vision_prompt import VisionPrompter

log = logging.getLogger("tandem.router")

# The engine enforces settings.request_timeout_s itself (its 504 says where it waited);
# the HTTP layer's own deadline is a backstop a little later, so no response ever hangs.
DEADLINE_BACKSTOP_S = 5.0
# After a disconnect, a request's work gets this long to end (its cleanup tells the
# workers to drop it, milliseconds) before it is cancelled again.
CANCEL_AGAIN_S = 1.0


def create_app(engine: Engine, tokenizer, settings: Settings) -> Starlette:
    """`tokenizer`: mlx-lm's TokenizerWrapper for the served model (chat template,
    EOS ids, streaming detokenizer)."""
    api = _Api(engine, tokenizer, settings)
    routes = [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.get_model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    middleware = [Middleware(ApiKeyMiddleware, api_key=settings.api_key)] if settings.api_key else []
    return Starlette(routes=routes, middleware=middleware, exception_handlers=exception_handlers())


class ApiKeyMiddleware:
    """With an API key set, /v1 routes need `Authorization: Bearer <key>`; /health and
    /metrics stay open for supervisors and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):  # constant time: no key guessing by timing
                error = ApiError(
                    401,
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Api:
    def __init__(self, engine: Engine, tokenizer, settings: Settings):
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.token_bytes = TokenBytes(tokenizer)  # shared: a cache over the vocabulary
        self.created = int(time.time())
        self.answers = AnswerTokens(self.token_bytes)  # recent answers' tokens, for the next turn's prompt
        self.vision = VisionPrompter(settings.model_dir) if settings.model_dir and is_vlm(settings.model_dir) else None
        self.media_limits = MediaLimits.from_settings(settings)
        self.recent_images = RecentImages() if self.vision is not None else None

    async def chat_completions(self, request: Request) -> "GenerationResponse":
        t0 = time.perf_counter()
        body = await read_json(request, self.settings.max_request_bytes)
        t_read = time.perf_counter()
        if self.vision is not None and _has_media(body):
            parsed = await self._parse_vision_chat(body)
        else:
            parsed = parse_chat(body, self.tokenizer, self.engine.model_id, self.engine.max_context,
                                answers=self.answers)
        log.debug("chat request of %d prompt tokens: body read in %.2f ms, parsed in %.2f ms",
                  len(parsed.prompt_tokens), (t_read - t0) * 1000, (time.perf_counter() - t_read) * 1000)
        return self._generation_response(parsed, ChatFormat)

    async def _parse_vision_chat(self, body: dict) -> ParsedRequest:
        """Decode the request's images and videos (router/media.py: 400 naming
        the part on any refusal), then template and tokenize in a thread. A
        video stays one video where the model takes video (Qwen-VL), else it
        becomes its frames, each an image. A field Tandem does not honour is
        refused before any picture is fetched."""
        check_chat_fields(body)
        media = await load_media_parts(body["messages"], self.media_limits, self.recent_images)
        native = self.vision.native_video
        items, it = [], iter(media)
        for message in body["messages"]:
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else []:
                if isinstance(part, dict) and part.get("type") in ("image_url", "video_url"):
                    # What router/schemas.py puts in the template for the part.
                    item = next(it)
                    part["_video"] = native and isinstance(item, DecodedVideo)
                    if isinstance(item, DecodedVideo) and not native:
                        part["_frames"] = len(item.frames)
                        items += item.frames
                    else:
                        part["_frames"] = 1
                        items.append(item)
        return await asyncio.to_thread(parse_chat, body, self.tokenizer, self.engine.model_id,
                                       self.engine.max_context, (self.vision, items))

    async def completions(self, request: Request) -> "GenerationResponse":
        body = await read_json(request, self.settings.max_request_bytes)
        parsed = parse_completion(body, self.tokenizer, self.engine.model_id, self.engine.max_context)
        return self._generation_response(parsed, CompletionFormat)

    def _generation_response(self, parsed: ParsedRequest, format_class: type["_Format"]) -> "GenerationResponse":
        request_id = format_class.id_prefix + uuid.uuid4().hex
        generation = Generation(
            self.engine,
            GenerationRequest(request_id, parsed.prompt_tokens, parsed.sampling, parsed.images),
            TextStream(self.tokenizer, parsed.stop, keep_leading_space=parsed.kind == "completion"),
            self.settings.request_timeout_s + DEADLINE_BACKSTOP_S,
            self.answers if parsed.kind == "chat" else None,
        )
        fmt = format_class(request_id, self.engine.model_id, parsed, self.token_bytes)
        return GenerationResponse(generation, fmt, parsed.stream, parsed.include_usage)

    def _model_card(self) -> dict:
        return {
            "id": self.engine.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "max_model_len": self.engine.max_context,
        }

    async def list_models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> JSONResponse:
        model = request.path_params["model"]
        if model not in (self.engine.model_id, MODEL_ALIAS):
            raise ApiError(404, f"The model '{model}' does not exist. Served models: {self.engine.model_id}",
                           param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> JSONResponse:
        ready, body = self.engine.health()
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(await self.engine.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")


# --------------------------------------------------------------------------- #
# Engine events -> text pieces
# --------------------------------------------------------------------------- #


@dataclass
class Piece:
    """Text ready to send, with the logprobs of the tokens consumed since the last piece."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class Generation:
    """One request's run through the engine, with its usage counts."""

    def __init__(self, engine: Engine, request: GenerationRequest, text: TextStream, timeout_s: float,
                 answers: AnswerTokens | None = None):
        self.engine = engine
        self.request = request
        self.text = text
        self.timeout_s = timeout_s
        self.eos = set(request.sampling.stop_token_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        # With `answers`: the answer's tokens and text, remembered when it ends
        # whole (not cut by a stop string) for the conversation's next turn.
        self.answers = answers
        self._tokens: list[int] = []
        self._texts: list[str] = []

    async def pieces(self) -> AsyncIterator[Piece]:
        """Yield pieces until one has a finish_reason. Raises EngineError. Returning early
        (stop string) or being closed closes the engine's generator: the request is cancelled."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        events = self.engine.generate(self.request)
        pending: list[TokenLogprob] = []  # logprobs of tokens whose text is still held back
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        event = await anext(events)
                except StopAsyncIteration:
                    raise EngineError(502, "The engine ended the request without a finish reason")
                except TimeoutError:
                    raise EngineError(504, f"Request timed out after {self.timeout_s:g} s", code="timeout")
                self.completion_tokens += 1  # EOS included, as it was generated
                self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
                if event.token in self.eos:  # ends the text; not part of it
                    text, finish = self.text.flush(), "stop"
                else:
                    if self.answers is not None:
                        self._tokens.append(event.token)
                    if event.logprob is not None:
                        pending.append(event.logprob)
                    text, finish = self.text.add(event.token), event.finish_reason
                    if self.text.stopped:
                        finish = "stop"
                    elif finish:
                        text += self.text.flush()
                if self.answers is not None:
                    self._texts.append(text)
                    if finish and not self.text.stopped:
                        self.answers.remember("".join(self._texts), self._tokens)
                if text or finish:
                    yield Piece(text, pending, finish)
                    pending = []
                if finish:
                    return
        finally:
            await events.aclose()

    def usage(self) -> dict:
        prompt = len(self.request.prompt_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# --------------------------------------------------------------------------- #
# Pieces -> OpenAI JSON
# --------------------------------------------------------------------------- #


def _finite(logprob: float) -> float:
    # JSON has no -inf; OpenAI reports impossible tokens as -9999.0.
    return logprob if math.isfinite(logprob) else -9999.0


class _Format:
    """The response shapes of one endpoint, for one request."""

    id_prefix = ""  # of response ids: "chatcmpl-", "cmpl-"
    object = ""  # of full responses
    chunk_suffix = ""  # appended to `object` for stream chunks

    def __init__(self, request_id: str, model: str, parsed: ParsedRequest, token_bytes: TokenBytes):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.want_logprobs = parsed.sampling.logprobs
        self.top_n = parsed.sampling.top_logprobs
        self.include_usage = parsed.include_usage
        self.token_bytes = token_bytes

    def _envelope(self, object_: str, choices: list) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, piece: Piece, first: bool) -> dict:
        out = self._envelope(self.object + self.chunk_suffix, [self._stream_choice(piece, first)])
        if self.include_usage:
            out["usage"] = None  # OpenAI: present on every chunk, set only on the last
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._envelope(self.object + self.chunk_suffix, []), "usage": usage}

    def response(self, piece: Piece, usage: dict) -> dict:
        return {**self._envelope(self.object, [self._final_choice(piece)]), "usage": usage}

    def _stream_choice(self, piece: Piece, first: bool) -> dict:
        raise NotImplementedError

    def _final_choice(self, piece: Piece) -> dict:
        raise NotImplementedError


class ChatFormat(_Format):
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_suffix = ".chunk"

    def _stream_choice(self, piece: Piece, first: bool) -> dict:
        delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text} if piece.text else {}
        return {"index": 0, "delta": delta, "logprobs": self._logprobs(piece), "finish_reason": piece.finish_reason}

    def _final_choice(self, piece: Piece) -> dict:
        message = {"role": "assistant", "content": piece.text}
        return {"index": 0, "message": message, "logprobs": self._logprobs(piece), "finish_reason": piece.finish_reason}

    def _logprobs(self, piece: Piece) -> dict | None:
        if not self.want_logprobs:
            return None
        return {"content": [self._entry(lp.token, lp.logprob, lp.top[: self.top_n]) for lp in piece.logprobs]}

    def _entry(self, token: int, logprob: float, top: list | None) -> dict:
        entry = {"token": self.token_bytes.text(token), "logprob": _finite(logprob), "bytes": list(self.token_bytes(token))}
        if top is not None:
            entry["top_logprobs"] = [self._entry(t, lp, None) for t, lp in top]
        return entry


class CompletionFormat(_Format):
    id_prefix = "cmpl-"
    object = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_offset = 0  # characters of completion text before the next token

    def _stream_choice(self, piece: Piece, first: bool) -> dict:
        return self._final_choice(piece)

    def _final_choice(self, piece: Piece) -> dict:
        return {"index": 0, "text": piece.text, "logprobs": self._logprobs(piece), "finish_reason": piece.finish_reason}

    def _logprobs(self, piece: Piece) -> dict | None:
        if not self.want_logprobs:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in piece.logprobs:
            text = self.token_bytes.text(lp.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(lp.logprob))
            out["top_logprobs"].append({self.token_bytes.text(t): _finite(v) for t, v in lp.top[: self.top_n]})
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
        return out


# --------------------------------------------------------------------------- #
# The ASGI response
# --------------------------------------------------------------------------- #


def _has_media(body) -> bool:
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in ("image_url", "video_url") for p in m["content"])
        for m in messages)


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineError):
        log.warning("request failed: %s %s", exc.status, exc.message)
        return ApiError.from_engine(exc)
    log.exception("unexpected error while generating")
    return ApiError(500, "Internal server error")


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class GenerationResponse:
    """Runs the generation while the response is sent, as JSON or as SSE.

    A stream's status is decided by the first engine event: an error before it (queue full,
    no worker) is a plain HTTP error; an error after it is an SSE error event, then the end.
    """

    def __init__(self, generation: Generation, fmt: _Format, stream: bool, include_usage: bool):
        self.generation = generation
        self.fmt = fmt
        self.stream = stream
        self.include_usage = include_usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        respond = self._stream if self.stream else self._complete
        await run_until_disconnect(receive, respond(scope, receive, send))

    async def _complete(self, scope: Scope, receive: Receive, send: Send) -> None:
        texts, logprobs, finish = [], [], None
        try:
            async with aclosing(self.generation.pieces()) as pieces:
                async for piece in pieces:
                    texts.append(piece.text)
                    logprobs += piece.logprobs
                    finish = piece.finish_reason
        except Exception as exc:
            response = _as_api_error(exc).response()
        else:
            body = self.fmt.response(Piece("".join(texts), logprobs, finish), self.generation.usage())
            response = JSONResponse(body)
        await response(scope, receive, send)

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with aclosing(self.generation.pieces()) as pieces:
            try:
                first = await anext(pieces)
            except Exception as exc:
                await _as_api_error(exc).response()(scope, receive, send)
                return
            headers = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),  # no proxy buffering of the stream
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await self._send(send, _sse(self.fmt.chunk(first, first=True)))
            try:
                async for piece in pieces:
                    await self._send(send, _sse(self.fmt.chunk(piece, first=False)))
            except Exception as exc:
                await self._send(send, _sse(_as_api_error(exc).body()))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
        if self.include_usage:
            await self._send(send, _sse(self.fmt.usage_chunk(self.generation.usage())))
        await self._send(send, _sse("[DONE]"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _send(send: Send, data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})


async def run_until_disconnect(receive: Receive, work: Coroutine) -> None:
    """Run `work` (which sends the response); cancel it if the client disconnects first.

    The cancel is asyncio's one-shot kind, so the engine's cleanup (telling workers to drop
    the request) may still await.
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            log.info("client disconnected: cancelling its request")
            work_task.cancel()
            # A cancel can be lost (code that swallows it), and uvicorn drops what is
            # sent after a disconnect, so lost work would run to max_tokens unseen.
            # Cancel again while it runs, each time after its cleanup had time to end.
            while not (await asyncio.wait({work_task}, timeout=CANCEL_AGAIN_S))[0]:
                log.warning("request still running %.1f s after its cancel: cancelling again", CANCEL_AGAIN_S)
                work_task.cancel()
        await asyncio.gather(work_task, watcher, return_exceptions=True)
    if not work_task.cancelled():
        exc = work_task.exception()
        if exc is not None and not isinstance(exc, OSError):  # OSError: the client vanished mid-send
            raise exc


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body was read already, so the next message is the disconnect (uvicorn also
    # sends one once the response is complete, by which time the work is done).
    while (await receive())["type"] != "http.disconnect":
        pass
