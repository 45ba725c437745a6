"""The OpenAI-compatible HTTP API and Anthropic's Messages API (Starlette), in front of
an `Engine`.

Request path: read and validate the body (router.schemas; an Anthropic body first becomes
its OpenAI chat equivalent, router.anthropic_request, and so does a Responses body,
router.responses_request) -> tokenize -> Engine.generate
-> token events -> text and tool calls (router.generation) -> JSON or SSE in the
endpoint's shapes (router.openai_format, router.anthropic_format, router.responses_format,
sent by router.http_stream, which also cancels the request when the client goes away).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from deploy.model_folder import is_vlm
from deploy.settings import Settings
from router.anthropic_format import MessagesFormat
from router.anthropic_request import chat_body as anthropic_chat_body
from router.answer_tokens import AnswerTokens
from router.chat_output import ChatOutput
from router.engine_api import Engine, GenerationRequest
from router.errors import ApiError, exception_handlers, is_anthropic_path
from router.generation import Generation
from router.http_stream import GenerationResponse
from router.media import DecodedVideo, MediaLimits, RecentImages
from router.media_parts import load_media_parts
from router.schemas import MODEL_ALIAS, ParsedRequest, check_chat_fields, parse_chat, parse_completion, read_json
from router.openai_format import ChatFormat, CompletionFormat
from router.responses_format import ResponsesFormat
from router.responses_request import ResponseStore, responses_turn
from router.text_stream import TextStream, TokenBytes
from router.vision_prompt import VisionPrompter

log = logging.getLogger("tandem.router")

# The engine enforces settings.request_timeout_s itself (its 504 says where it waited);
# the HTTP layer's own deadline is a backstop a little later, so no response ever hangs.
DEADLINE_BACKSTOP_S = 5.0
COUNT_ANY_LENGTH = 2**31  # the context count_tokens parses under


def create_app(engine: Engine, tokenizer, settings: Settings) -> Starlette:
    """`tokenizer`: mlx-lm's TokenizerWrapper for the served model (chat template,
    EOS ids, streaming detokenizer)."""
    api = _Api(engine, tokenizer, settings)
    routes = [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/messages", api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", api.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", api.delete_response, methods=["DELETE"]),
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.get_model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    middleware = [Middleware(ApiKeyMiddleware, api_key=settings.api_keys[0])] if settings.api_keys else []
    return Starlette(routes=routes, middleware=middleware, exception_handlers=exception_handlers())


class ApiKeyMiddleware:
    """With an API key set, /v1 routes need `Authorization: Bearer <key>` (Anthropic's
    /v1/messages also takes `x-api-key: <key>`); /health and /metrics stay open for
    supervisors and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = Headers(scope=scope)
            anthropic = is_anthropic_path(scope["path"])
            # constant time: no key guessing by timing
            valid = hmac.compare_digest(headers.get("authorization", "").encode(), self.expected)
            if anthropic:
                valid |= hmac.compare_digest(headers.get("x-api-key", "").encode(), self.key)
            if not valid:
                how = "'Authorization: Bearer <key>'"
                how = "'x-api-key: <key>' or " + how if anthropic else how
                error = ApiError(401, f"Invalid or missing API key: send {how}", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error.response(anthropic)(scope, receive, send)
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
        self.stored_responses = ResponseStore()  # for the Responses API's previous_response_id
        self.vision = VisionPrompter(settings.model_dir) if settings.model_dir and is_vlm(settings.model_dir) else None
        self.media_limits = MediaLimits.from_settings(settings)
        self.recent_images = RecentImages() if self.vision is not None else None

    async def chat_completions(self, request: Request) -> "GenerationResponse":
        t0 = time.perf_counter()
        body = await read_json(request, self.settings.max_request_bytes)
        t_read = time.perf_counter()
        parsed = await self.parse_chat_body(body)
        log.debug("chat request of %d prompt tokens: body read in %.2f ms, parsed in %.2f ms",
                  len(parsed.prompt_tokens), (t_read - t0) * 1000, (time.perf_counter() - t_read) * 1000)
        return self._generation_response(parsed, ChatFormat)

    async def parse_chat_body(self, body: dict, max_context: int | None = None) -> ParsedRequest:
        """An OpenAI chat body parsed (every chat-like endpoint's): images decoded
        first, grammars compiled off the event loop. `max_context`: the engine's unless given."""
        max_context = max_context or self.engine.max_context
        if self.vision is not None and _has_media(body):
            return await self._parse_vision_chat(body, max_context)
        if body.get("tools") or body.get("response_format"):  # schemas compile: off the event loop
            return await asyncio.to_thread(parse_chat, body, self.tokenizer, self.engine.model_id,
                                           max_context, answers=self.answers)
        return parse_chat(body, self.tokenizer, self.engine.model_id, max_context, answers=self.answers)

    async def messages(self, request: Request) -> GenerationResponse:
        """Anthropic's Messages API: the body as its OpenAI chat equivalent
        (router/anthropic_request.py), the answer in Anthropic's shapes."""
        body = await read_json(request, self.settings.max_request_bytes)
        # Anthropic clients must send max_tokens and send large ones (32000)
        # whatever the model: here it is a ceiling, and the answer ends at the
        # context's end (stop_reason "max_tokens") rather than a 400.
        parsed = await self.parse_chat_body(anthropic_chat_body(body), COUNT_ANY_LENGTH)
        room = self.engine.max_context - len(parsed.prompt_tokens)
        if room < 1:
            raise ApiError(400, f"prompt is too long: {len(parsed.prompt_tokens)} tokens, and this model's "
                           f"context is {self.engine.max_context} tokens", param="messages",
                           code="context_length_exceeded")
        parsed.sampling.max_tokens = min(parsed.sampling.max_tokens, room)
        message_id = MessagesFormat.id_prefix + uuid.uuid4().hex
        generation = self.generation(parsed, message_id)
        fmt = MessagesFormat(message_id, self.engine.model_id, generation)
        return GenerationResponse(generation, fmt, parsed.stream)

    async def count_tokens(self, request: Request) -> JSONResponse:
        body = await read_json(request, self.settings.max_request_bytes)
        # Counted whatever the context: a prompt too long to answer still has a length.
        parsed = await self.parse_chat_body(anthropic_chat_body(body, count_only=True), COUNT_ANY_LENGTH)
        return JSONResponse({"input_tokens": len(parsed.prompt_tokens)})

    async def responses(self, request: Request) -> GenerationResponse:
        """OpenAI's Responses API: the body as its chat equivalent, after the
        conversation it continues (router/responses_request.py); the answer in
        the Responses shapes, kept for the next turn."""
        body = await read_json(request, self.settings.max_request_bytes)
        turn = responses_turn(body, self.stored_responses, images=self.vision is not None)
        try:
            parsed = await self.parse_chat_body(turn.chat)
        except ApiError as exc:
            raise turn.rename(exc)
        response_id = ResponsesFormat.id_prefix + uuid.uuid4().hex
        fmt = ResponsesFormat(response_id, self.engine.model_id, turn, self.stored_responses,
                              lambda text: len(self.tokenizer.encode(text, add_special_tokens=False)))
        return GenerationResponse(self.generation(parsed, response_id), fmt, parsed.stream)

    async def get_response(self, request: Request) -> JSONResponse:
        return JSONResponse(self.stored_responses.get(request.path_params["response_id"]).response)

    async def delete_response(self, request: Request) -> JSONResponse:
        response_id = request.path_params["response_id"]
        self.stored_responses.get(response_id)  # 404 when unknown
        self.stored_responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _parse_vision_chat(self, body: dict, max_context: int) -> ParsedRequest:
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
                                       max_context, (self.vision, items))

    async def completions(self, request: Request) -> "GenerationResponse":
        body = await read_json(request, self.settings.max_request_bytes)
        parsed = parse_completion(body, self.tokenizer, self.engine.model_id, self.engine.max_context)
        return self._generation_response(parsed, CompletionFormat)

    def _generation_response(self, parsed: ParsedRequest, format_class: type) -> GenerationResponse:
        request_id = format_class.id_prefix + uuid.uuid4().hex
        generation = self.generation(parsed, request_id)
        fmt = format_class(request_id, self.engine.model_id, parsed, self.token_bytes)
        return GenerationResponse(generation, fmt, parsed.stream)

    def generation(self, parsed: ParsedRequest, request_id: str) -> Generation:
        """A parsed request's run through the engine (every endpoint's)."""
        return Generation(
            self.engine,
            GenerationRequest(request_id, parsed.prompt_tokens, parsed.sampling, parsed.images),
            TextStream(self.tokenizer, parsed.stop, keep_leading_space=parsed.kind == "completion"),
            self.settings.request_timeout_s + DEADLINE_BACKSTOP_S,
            self.answers if parsed.kind == "chat" else None,
            ChatOutput(parsed.output) if parsed.output is not None else None,
        )

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


def _has_media(body) -> bool:
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in ("image_url", "video_url") for p in m["content"])
        for m in messages)
