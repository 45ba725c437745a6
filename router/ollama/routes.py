"""Ollama's /api/* routes over the app's own parts (router/app.py `_Api`):
admission (`_admit`), the model pool (`models`), the chat parse
(`parse_chat_body`), the run (`generation`) and its sending
(router/api/http_stream.py GenerationResponse). /api/chat's greedy answer
is /v1/chat/completions' token for token: one path from the prompt on.

What each route does is Ollama's (router/ollama/request.py says how bodies
translate): /api/chat, /api/generate, /api/embed (and the legacy
/api/embeddings), /api/tags (downloaded and loaded models), /api/ps (loaded
ones), /api/show, /api/version, /api/pull (streamed progress), /api/delete.
/api/delete unloads an idle loaded model first; one with requests in flight
is a 409 (delete it once they end), and so is the model the server started
with (--model: it comes back at the next start). They run behind the same Host, Origin and API key checks as
/v1 (router/guards/http_guard.py: every path but /health and /metrics needs
the key when one is set).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from router.api.errors import ApiError
from router.api.http_stream import GenerationResponse
from router.api.openai_request import parse_completion
from router.ollama.embed import serve_embed
from router.ollama.errors import model_not_found, ollama_errors
from router.ollama.hub import PullResponse, delete_model
from router.ollama.listing import ps_entry, show_body, tags_entry
from router.ollama.names import tandem_name
from router.ollama.ndjson_format import ChatLines, GenerateLines, TimedGeneration, load_answer
from router.ollama.request import ModelFacts, read_call, refuse_unknown, renamed, translate

log = logging.getLogger("tandem.router")

# `name` is the field's old name, which older clients still send; show's `verbose` asks for the
# whole model_info, which it always is.
SHOW_FIELDS = frozenset(("model", "name", "verbose"))
PULL_FIELDS = frozenset(("model", "name", "stream", "insecure"))
DELETE_FIELDS = frozenset(("model", "name"))


def tandem_version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "0.0.0"


def ollama_routes(api) -> list[Route]:
    """The routes, for create_app's list: `api` is the app's `_Api`."""
    o = OllamaApi(api)
    return [
        Route("/api/chat", o.chat, methods=["POST"]),
        Route("/api/generate", o.generate, methods=["POST"]),
        Route("/api/embed", o.embed, methods=["POST"]),
        Route("/api/embeddings", o.embeddings, methods=["POST"]),
        Route("/api/tags", o.tags, methods=["GET"]),
        Route("/api/ps", o.ps, methods=["GET"]),
        Route("/api/show", o.show, methods=["POST"]),
        Route("/api/version", o.version, methods=["GET"]),
        Route("/api/pull", o.pull, methods=["POST"]),
        Route("/api/delete", o.delete, methods=["DELETE"]),
        Route("/", o.root, methods=["GET", "HEAD"]),  # where Ollama's apps look whether a server runs
    ]


class TemplateArgs:
    """A tokenizer whose chat template also gets `kwargs` (a request's
    `think`). Equal to (and hashed as) the tokenizer it wraps, so what is
    cached by tokenizer (llguidance's view of it) is found, not rebuilt."""

    def __init__(self, tokenizer, kwargs: dict):
        self._tokenizer, self._kwargs = tokenizer, kwargs

    def apply_chat_template(self, messages, *args, **kwargs):
        return self._tokenizer.apply_chat_template(messages, *args, **{**kwargs, **self._kwargs})

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __hash__(self) -> int:
        return hash(self._tokenizer)

    def __eq__(self, other) -> bool:
        return self._tokenizer == (other._tokenizer if isinstance(other, TemplateArgs) else other)


class OllamaApi:
    def __init__(self, api):
        self.api = api

    # ----------------------------------------------------------- generation
    @ollama_errors
    async def chat(self, request: Request):
        return await self._generate(request, "chat")

    @ollama_errors
    async def generate(self, request: Request):
        return await self._generate(request, "generate")

    async def _generate(self, request: Request, endpoint: str):
        arrived = time.monotonic_ns()
        ticket, body = await self.api._admit(request)
        with ticket:
            call = read_call(body, endpoint)
            request.state.ollama_model = call.name
            if call.keep_alive == 0 and not (body.get("messages") if endpoint == "chat" else
                                             body.get("prompt") or body.get("images")):
                ticket.release()  # `ollama stop`: unload, without loading it first
                return JSONResponse(await self._unload(call, endpoint, arrived))
            lease = await self.api.models.acquire(call.model, call.keep_alive)
            ticket.also_release(lease.release)
            served = lease.model
            if served.kind == "embedding":
                raise ApiError(400, f'"{call.name}" is an embedding model: it serves /api/embed', param="model")
            tokenizer = served.tokenizer
            translate(call, endpoint, ModelFacts(call.name, served.vision is not None,
                                                 bool(getattr(tokenizer, "has_thinking", False)),
                                                 getattr(tokenizer, "chat_template", None) is not None))
            loaded = time.monotonic_ns()
            if call.load_only:
                ticket.release()
                return JSONResponse(load_answer(call.name, endpoint, False, arrived))
            call.body["model"] = served.model_id
            try:
                parsed = await self._parse(ticket, call, served)
            except ApiError as exc:
                raise renamed(exc, endpoint)
            if call.to_the_context:  # num_predict -1 / -2: whatever room the prompt leaves
                parsed.sampling.max_tokens = served.max_context - len(parsed.prompt_tokens)
            generation = self.api.generation(parsed, f"ollama-{uuid.uuid4().hex}", request, served)
            timed = TimedGeneration(generation, arrived, loaded)
            lines = (ChatLines if endpoint == "chat" else GenerateLines)(
                call.name, timed, served.token_bytes, parsed.sampling.top_logprobs if parsed.sampling.logprobs else None)
            return GenerationResponse(timed, lines, call.stream, ticket)

    async def _parse(self, ticket, call, served):
        if call.kind == "completion":
            return await ticket.off_loop(parse_completion, call.body, served.tokenizer, served.model_id,
                                         served.max_context, served.defaults)
        if call.template_kwargs:
            served = dataclasses.replace(served, tokenizer=TemplateArgs(served.tokenizer, call.template_kwargs))
        return await self.api.parse_chat_body(ticket, call.body, served)

    async def _unload(self, call, endpoint: str, arrived: int) -> dict:
        await self.api.models.unload_soon(call.model, "keep_alive 0 (Ollama)")  # a busy one once its requests end
        return load_answer(call.name, endpoint, True, arrived)

    # ----------------------------------------------------------- embeddings
    @ollama_errors
    async def embed(self, request: Request):
        return await self._embed(request, legacy=False)

    @ollama_errors
    async def embeddings(self, request: Request):
        return await self._embed(request, legacy=True)

    async def _embed(self, request: Request, legacy: bool):
        arrived = time.monotonic_ns()
        ticket, body = await self.api._admit(request)
        with ticket:
            return await serve_embed(self.api, ticket, body, legacy, arrived, request)

    # -------------------------------------------------------------- listing
    @ollama_errors
    async def tags(self, request: Request):
        models = await self.api.models.available()
        default = self.api.models.default_model
        if not any(tandem_name(m["name"]) == default.model_id for m in models):
            models.insert(0, {"name": default.model_id, "model_dir": default.model_dir, "kind": default.kind,
                              "loaded_at": self.api.created})
        entries = await asyncio.to_thread(lambda: [tags_entry(m) for m in models])
        return JSONResponse({"models": entries})

    @ollama_errors
    async def ps(self, request: Request):
        loaded = [m for m in self.api.models.loaded() if m["state"] == "ready"]
        entries = await asyncio.to_thread(lambda: [ps_entry(m) for m in loaded])
        return JSONResponse({"models": entries})

    @ollama_errors
    async def show(self, request: Request):
        body = await self._small_body(request)
        refuse_unknown(body, SHOW_FIELDS)
        name = request.state.ollama_model = _model_name(body)
        model = await self._find(name)
        return JSONResponse(await asyncio.to_thread(show_body, name, model.get("model_dir") or "",
                                                    model.get("kind") or "chat", model.get("loaded_at")))

    async def _find(self, name: str) -> dict:
        """A model of the listing (loaded or downloaded) by any of its names."""
        default = self.api.models.default_model
        wanted = tandem_name(name)
        if wanted in (default.model_id, "default"):
            return {"name": default.model_id, "model_dir": default.model_dir, "kind": default.kind,
                    "loaded_at": self.api.created}
        for model in await self.api.models.available():
            if tandem_name(model["name"]).lower() == wanted.lower():
                return model
        raise model_not_found(name)

    async def root(self, request: Request):
        return PlainTextResponse("Tandem is running (Ollama's API is at /api/)")

    @ollama_errors
    async def version(self, request: Request):
        return JSONResponse({"version": tandem_version()})

    async def _small_body(self, request: Request) -> dict:
        ticket, body = await self.api._admit(request)
        ticket.release()
        return body

    # ---------------------------------------------------------- pull, delete
    @ollama_errors
    async def pull(self, request: Request):
        body = await self._small_body(request)
        refuse_unknown(body, PULL_FIELDS)
        if body.get("insecure"):
            raise ApiError(400, "'insecure' does not apply: Tandem pulls from the Hugging Face Hub "
                           "(HF_ENDPOINT names another)", param="insecure")
        name = _model_name(body)
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        # The listing's cached scan is stale once the pull lands.
        return PullResponse(tandem_name(name), stream, self.api.models.catalog.forget)

    @ollama_errors
    async def delete(self, request: Request):
        body = await self._small_body(request)
        refuse_unknown(body, DELETE_FIELDS)
        name = request.state.ollama_model = _model_name(body)
        model = tandem_name(name)
        if model == self.api.models.default_model.model_id:
            raise ApiError(409, f'"{name}" is the model this server started with (--model): it is not deleted here')
        loaded = [m for m in self.api.models.loaded() if tandem_name(m["name"]).lower() == model.lower()]
        if loaded and not await self.api.models.unload(loaded[0]["name"], "deleted (Ollama)"):
            raise ApiError(409, f'"{name}" is answering requests: delete it once they end')
        freed = await asyncio.to_thread(delete_model, model)
        self.api.models.catalog.forget()
        log.info("deleted %s for an Ollama client (%d bytes freed)", model, freed)
        return JSONResponse({})


def _model_name(body: dict) -> str:
    """The model a show, pull or delete names (`model`, or Ollama's older `name`)."""
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model is required", param="model")
    return name
