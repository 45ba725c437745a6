"""The OpenAI-compatible HTTP API and Anthropic's Messages API (Starlette), in front of
an `Engine`.

Request path: read the body -> admitted or 429 (router.guards.admission: nothing heavy runs for a
refused request; what follows runs in its threads, off the event loop) -> decode and
validate the body (router.api.openai_request; an Anthropic body first becomes its OpenAI chat
equivalent, router.api.anthropic_request, and so does a Responses body,
router.api.responses_request) -> media fetched (a VLM's) -> template, tokenize -> Engine.generate
-> token events -> text and tool calls (router.api.generation) -> JSON or SSE in the
endpoint's shapes (router.api.openai_format, router.api.anthropic_format, router.api.responses_format,
sent by router.api.http_stream, which also cancels the request when the client goes away).
"""

from __future__ import annotations

import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from environment.settings import Settings
from router.guards.admission import Admission, Ticket
from router.api.anthropic_format import MessagesFormat
from router.api.anthropic_request import chat_body as anthropic_chat_body
from router.api.answer_tokens import AnswerTokens
from router.guards.cache_salt import request_salt, tenant_of
from router.guards.fair_lanes import caller_of
from router.api.chat_output import ChatOutput
from router.routing.engine_api import Engine, GenerationRequest
from router.api.embeddings import serve_embeddings
from router.api.errors import ApiError, exception_handlers
from router.api.generation import Generation
from router.guards.http_guard import HttpGuard
from router.api.http_stream import GenerationResponse
from router.media.decode import MediaLimits
from router.media.parts import load_media_parts
from router.media.video import DecodedVideo
from router.metrics import AdmissionMetrics, labelled_by_model
from router.ollama.routes import ollama_routes
from router.models.keep_alive import KeepAliveError, parse_keep_alive, parse_ttl
from router.models.catalog import model_key
from router.models.pool import ModelPool
from router.models.served import ServedModel
from router.api.openai_request import (MODEL_ALIAS, ParsedRequest, check_chat_fields, parse_chat, parse_completion,
                            parse_json, read_body)
from router.api.openai_format import ChatFormat, CompletionFormat
from router.api.responses_format import ResponsesFormat
from router.api.response_store import ResponseStore
from router.api.responses_request import responses_turn
from router.text.text_stream import TextStream

log = logging.getLogger("tandem.router")

# settings.request_timeout_s is a deadline on progress: the engine fails a request
# whose next token has not come within it (its 504 says where it waited); the HTTP
# layer's own, a little later, is a backstop, so no response ever hangs. Either way an
# answer with tokens already ends with them, "length" (router/api/generation.py).
DEADLINE_BACKSTOP_S = 5.0
COUNT_ANY_LENGTH = 2**31  # the context count_tokens parses under


def create_app(engine: Engine, tokenizer, settings: Settings, models: ModelPool | None = None) -> Starlette:
    """`engine` and `tokenizer`: the served model's (router/text/tokenizer.py
    ModelTokenizer, or mlx-lm's TokenizerWrapper, whose names it keeps);
    `models`: the pool that loads others on demand (router/models/pool.py;
    None: that one model alone)."""
    api = _Api(models or ModelPool(settings, ServedModel.of(engine, tokenizer, settings.model_dir)), settings)
    routes = [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/messages", api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/embeddings", api.embeddings, methods=["POST"]),
        Route("/v1/responses/{response_id}", api.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", api.delete_response, methods=["DELETE"]),
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.get_model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        *ollama_routes(api),  # Ollama's /api/* (router/ollama/)
    ]
    # Host, Origin, API key and Content-Type checked before any handler reads a body.
    middleware = [Middleware(HttpGuard, settings=settings)]
    return Starlette(routes=routes, middleware=middleware, exception_handlers=exception_handlers())


class _Api:
    def __init__(self, models: ModelPool, settings: Settings):
        self.models = models
        self.engine = models.default_model.engine  # the server's own model's: power, admission room, /metrics
        self.settings = settings
        self.created = int(time.time())
        self.stored_responses = ResponseStore.from_settings(settings)  # for the Responses API's previous_response_id
        self.media_limits = MediaLimits.from_settings(settings)
        self.admission = Admission.from_settings(settings)  # before any heavy work; that work off the loop
        power = getattr(self.engine, "power", None)  # the dispatcher's PowerWatch; a test's engine may have none
        if power is not None:
            self.admission.follow(power)
        table = getattr(self.engine, "table", None)  # the dispatcher's workers: remote ones add room
        if table is not None:
            self.admission.remote_rows = table.remote_rows
        self.admission_metrics = AdmissionMetrics(self.admission, power, self.stored_responses)

    async def model_of(self, ticket: Ticket, body, kind: str = "chat") -> ServedModel:
        """The model `body` names, loaded if need be and held until the request
        ends (its ticket's release); `keep_alive` (Ollama) and `ttl` (LM
        Studio) taken out of the body: how long it stays loaded after."""
        if not isinstance(body, dict):
            return self.models.default_model  # the body's parse says what is wrong with it
        try:
            keep_alive = parse_keep_alive(body.pop("keep_alive", None))
            ttl = parse_ttl(body.pop("ttl", None))
        except KeepAliveError as exc:
            raise ApiError(400, str(exc), param="keep_alive" if "keep_alive" in str(exc) else "ttl") from None
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise ApiError(400, "'model' must be a string", param="model")
        lease = await self.models.acquire(name, keep_alive if keep_alive is not None else ttl)
        ticket.also_release(lease.release)
        served = lease.model
        if (served.kind == "embedding") != (kind == "embedding"):
            what = "an embedding model: use /v1/embeddings" if served.kind == "embedding" else \
                f"a {served.kind} model: it makes no embeddings"
            raise ApiError(400, f"The model '{served.model_id}' is {what}", param="model", code="model_not_supported")
        if name is not None:
            body["model"] = served.model_id  # named by an alias or a tag: the endpoint checks the served id
        return served

    async def _admit(self, request: Request) -> tuple[Ticket, dict]:
        """The request admitted (429 past capacity) as soon as its body is
        read, before any heavy work; then its JSON decoded off the loop."""
        raw = await read_body(request, self.settings.max_request_bytes)
        ticket = self.admission.admit(len(raw), caller_of(request))  # its work in its caller's turns
        with ticket:
            return ticket, await ticket.off_loop(parse_json, raw)

    async def chat_completions(self, request: Request) -> "GenerationResponse":
        t0 = time.perf_counter()
        ticket, body = await self._admit(request)
        with ticket:
            t_read = time.perf_counter()
            served = await self.model_of(ticket, body)
            parsed = await self.parse_chat_body(ticket, body, served)
            log.debug("chat request of %d prompt tokens: body read and decoded in %.2f ms, parsed in %.2f ms",
                      len(parsed.prompt_tokens), (t_read - t0) * 1000, (time.perf_counter() - t_read) * 1000)
            return self._generation_response(ticket, parsed, ChatFormat, request, served)

    async def parse_chat_body(self, ticket: Ticket, body: dict, served: ServedModel,
                              max_context: int | None = None) -> ParsedRequest:
        """An OpenAI chat body parsed (every chat-like endpoint's) off the event
        loop: checked, its media fetched and decoded (a VLM's), then templated and
        tokenized. `max_context`: the model's unless given."""
        max_context = max_context or served.max_context
        parsed = await ticket.off_loop(self._parse_text_chat, body, served, max_context)
        return parsed if parsed is not None else await self._parse_vision_chat(ticket, body, served, max_context)

    def _parse_text_chat(self, body: dict, served: ServedModel, max_context: int) -> ParsedRequest | None:
        """(In a thread.) The chat parsed; None, its fields checked, when it has
        media for a VLM, which are fetched before it is templated."""
        if served.vision is not None and _has_media(body):
            check_chat_fields(body)  # a field Tandem does not honour: refused before any fetch
            return None
        return parse_chat(body, served.tokenizer, served.model_id, max_context, answers=served.answers,
                          defaults=served.defaults)

    async def messages(self, request: Request) -> GenerationResponse:
        """Anthropic's Messages API: the body as its OpenAI chat equivalent
        (router/api/anthropic_request.py), the answer in Anthropic's shapes."""
        ticket, body = await self._admit(request)
        with ticket:
            served = await self.model_of(ticket, body)
            # Anthropic clients must send max_tokens and send large ones (32000)
            # whatever the model: here it is a ceiling, and the answer ends at the
            # context's end (stop_reason "max_tokens") rather than a 400.
            chat = await ticket.off_loop(anthropic_chat_body, body)
            parsed = await self.parse_chat_body(ticket, chat, served, COUNT_ANY_LENGTH)
            room = served.max_context - len(parsed.prompt_tokens)
            if room < 1:
                raise ApiError(400, f"prompt is too long: {len(parsed.prompt_tokens)} tokens, and this model's "
                               f"context is {served.max_context} tokens", param="messages",
                               code="context_length_exceeded")
            parsed.sampling.max_tokens = min(parsed.sampling.max_tokens, room)
            message_id = MessagesFormat.id_prefix + uuid.uuid4().hex
            generation = self.generation(parsed, message_id, request, served)
            fmt = MessagesFormat(message_id, served.model_id, generation)
            return GenerationResponse(generation, fmt, parsed.stream, ticket)

    async def count_tokens(self, request: Request) -> JSONResponse:
        ticket, body = await self._admit(request)
        try:  # admitted while it is tokenized
            served = await self.model_of(ticket, body)
            chat = await ticket.off_loop(anthropic_chat_body, body, count_only=True)
            # Counted whatever the context: a prompt too long to answer still has a length.
            parsed = await self.parse_chat_body(ticket, chat, served, COUNT_ANY_LENGTH)
        finally:
            ticket.release()
        return JSONResponse({"input_tokens": len(parsed.prompt_tokens)})

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings, for an embedding model (router/api/embeddings.py)."""
        ticket, body = await self._admit(request)
        try:  # admitted, and its model held, until its vectors are back
            served = await self.model_of(ticket, body, kind="embedding")
            return await serve_embeddings(ticket, body, served, self.settings.request_timeout_s)
        finally:
            ticket.release()

    async def responses(self, request: Request) -> GenerationResponse:
        """OpenAI's Responses API: the body as its chat equivalent, after the
        conversation it continues (router/api/responses_request.py); the answer in
        the Responses shapes, kept for the next turn."""
        ticket, body = await self._admit(request)
        stored = self.stored_responses.of(tenant_of(request))  # another API key's responses are not found
        with ticket:
            served = await self.model_of(ticket, body)
            turn = await ticket.off_loop(responses_turn, body, stored, images=served.vision is not None)
            try:
                parsed = await self.parse_chat_body(ticket, turn.chat, served)
            except ApiError as exc:
                raise turn.rename(exc)
            turn.echo.update(temperature=parsed.sampling.temperature, top_p=parsed.sampling.top_p)  # as served
            response_id = ResponsesFormat.id_prefix + uuid.uuid4().hex
            fmt = ResponsesFormat(response_id, served.model_id, turn, stored,
                                  lambda text: len(served.tokenizer.encode(text, add_special_tokens=False)))
            return GenerationResponse(self.generation(parsed, response_id, request, served), fmt, parsed.stream,
                                      ticket)

    async def get_response(self, request: Request) -> JSONResponse:
        stored = self.stored_responses.of(tenant_of(request))
        return JSONResponse(stored.get(request.path_params["response_id"]).response)

    async def delete_response(self, request: Request) -> JSONResponse:
        response_id = request.path_params["response_id"]
        stored = self.stored_responses.of(tenant_of(request))
        stored.get(response_id)  # 404 when unknown (or another API key's)
        stored.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _parse_vision_chat(self, ticket: Ticket, body: dict, served: ServedModel,
                                 max_context: int) -> ParsedRequest:
        """Fetch and decode the request's images and videos (router/media/decode.py:
        400 naming the part on any refusal), then template and tokenize in a
        thread."""
        media = await load_media_parts(body["messages"], self.media_limits, served.recent_images)
        return await ticket.off_loop(self._parse_with_media, body, media, served, max_context)

    def _parse_with_media(self, body: dict, media: list, served: ServedModel, max_context: int) -> ParsedRequest:
        """(In a thread.) The chat with its decoded media in place. A video
        stays one video where the model takes video (Qwen-VL), else it becomes
        its frames, each an image."""
        native = served.vision.native_video
        items, it = [], iter(media)
        for message in body["messages"]:
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else []:
                if isinstance(part, dict) and part.get("type") in ("image_url", "video_url"):
                    # What router/api/openai_request.py puts in the template for the part.
                    item = next(it)
                    part["_video"] = native and isinstance(item, DecodedVideo)
                    if isinstance(item, DecodedVideo) and not native:
                        part["_frames"] = len(item.frames)
                        items += item.frames
                    else:
                        part["_frames"] = 1
                        items.append(item)
        return parse_chat(body, served.tokenizer, served.model_id, max_context, (served.vision, items),
                          defaults=served.defaults)

    async def completions(self, request: Request) -> "GenerationResponse":
        ticket, body = await self._admit(request)
        with ticket:
            served = await self.model_of(ticket, body)
            parsed = await ticket.off_loop(parse_completion, body, served.tokenizer, served.model_id,
                                           served.max_context, served.defaults)
            return self._generation_response(ticket, parsed, CompletionFormat, request, served)

    def _generation_response(self, ticket: Ticket, parsed: ParsedRequest, format_class: type,
                             request: Request, served: ServedModel) -> GenerationResponse:
        request_id = format_class.id_prefix + uuid.uuid4().hex
        generation = self.generation(parsed, request_id, request, served)
        fmt = format_class(request_id, served.model_id, parsed, served.token_bytes)
        return GenerationResponse(generation, fmt, parsed.stream, ticket)

    def generation(self, parsed: ParsedRequest, request_id: str, request: Request,
                   served: ServedModel) -> Generation:
        """A parsed request's run through its model's engine (every endpoint's),
        in the prefix cache of its tenant and `cache_salt` (router/guards/cache_salt.py)."""
        return Generation(
            served.engine,
            GenerationRequest(request_id, parsed.prompt_tokens, parsed.sampling, parsed.images,
                              cache_salt=request_salt(request, parsed.cache_salt)),
            TextStream(served.tokenizer, parsed.stop, keep_leading_space=parsed.kind == "completion"),
            self.settings.request_timeout_s + DEADLINE_BACKSTOP_S,
            served.answers if parsed.kind == "chat" else None,
            ChatOutput(parsed.output) if parsed.output is not None else None,
        )

    def _model_card(self, model: dict) -> dict:
        served = self.models.default_model if model.get("default") else None
        card = {
            "id": model["name"],
            "object": "model",
            "created": int(model.get("loaded_at") or model.get("modified_at") or self.created),
            "owned_by": "tandem",
            "kind": model.get("kind") or "chat",
            "loaded": bool(model.get("loaded")),
        }
        if served is not None:
            card["max_model_len"] = served.max_context
            # What a request gets for the sampling fields it leaves out (the
            # model's generation_config.json; the API's own defaults otherwise).
            card["generation_defaults"] = served.defaults.given()
        return card

    async def _models(self) -> list[dict]:
        default = self.models.default_model
        own = {"name": default.model_id, "kind": default.kind, "loaded": self.models.default.state == "ready",
               "default": True, "loaded_at": self.created}
        rest = [m for m in await self.models.available() if m["name"] != default.model_id]
        return [own] + rest

    async def list_models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card(m) for m in await self._models()]})

    async def get_model(self, request: Request) -> JSONResponse:
        name = request.path_params["model"]
        if name == MODEL_ALIAS:
            name = self.models.default_model.model_id
        for model in await self._models():
            if model_key(model["name"]) == model_key(name):
                return JSONResponse(self._model_card(model))
        raise ApiError(404, f"The model '{name}' does not exist or is not downloaded. Served models: GET /v1/models",
                       param="model", code="model_not_found")

    async def health(self, request: Request) -> JSONResponse:
        if self.models.default.state == "ready" or self.models.control is None:
            ready, body = self.engine.health()
        else:  # the server's own model unloaded while idle: it loads on the next request
            ready, body = True, {"status": "ok", "model": self.engine.model_id, "workers": []}
        body["models"] = [{k: v for k, v in m.items() if k != "model_dir"} for m in self.models.loaded()]
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        text = await self.engine.metrics_text()
        others = self.models.other_engines()
        if others:  # each model loaded on demand: its dispatcher's series, labelled model="..."
            text = labelled_by_model([(None, text)] + [(name, await engine.metrics_text()) for name, engine in others])
        text += self.admission_metrics.text() + self.models.metrics_text()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _has_media(body) -> bool:
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in ("image_url", "video_url") for p in m["content"])
        for m in messages)
