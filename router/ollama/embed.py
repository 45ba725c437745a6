"""/api/embed and the legacy /api/embeddings, through the embeddings engine
/v1/embeddings runs on (router/api/embeddings.py: the inputs tokenized as
the model's sentence-transformers files say; the model's embed workers
through its dispatcher's `embed`).

/api/embed: `input` a string or a list of strings -> `embeddings`, a list
of vectors (L2-normalised, as Ollama's); `truncate` (Ollama's default:
true) cuts an input past the model's context to fit it (a last-token
model's end token kept last), false makes it a 400; `dimensions` for a
model trained for shorter vectors (else 400); `keep_alive`; `options`: only
those that do not apply to embeddings (router/ollama/options.py logs them).
/api/embeddings: `prompt` -> `embedding`, one vector.
"""

from __future__ import annotations

import time

from starlette.responses import JSONResponse

from environment.embedding_config import embedding_config
from router.api.embeddings import parse_embeddings
from router.api.errors import ApiError
from router.ollama.options import sampling_of
from router.ollama.request import bad_request, refuse_unknown
from router.models.keep_alive import KeepAliveError, parse_keep_alive
from router.ollama.names import tandem_name

EMBED_FIELDS = frozenset(("model", "input", "truncate", "dimensions", "keep_alive", "options"))
LEGACY_FIELDS = frozenset(("model", "prompt", "keep_alive", "options"))
ANY_LENGTH = 2**31  # inputs tokenized whatever their length, then cut (or refused) here


def _read(body: dict, legacy: bool) -> tuple[str, float | None]:
    refuse_unknown(body, LEGACY_FIELDS if legacy else EMBED_FIELDS)
    name = body.get("model")
    if not isinstance(name, str) or not name.strip():
        raise bad_request("model is required", "model")
    if sampling_of(body.get("options")):
        raise bad_request("sampling options do not apply to embeddings", "options")
    try:
        return name, parse_keep_alive(body.get("keep_alive"))
    except KeepAliveError as exc:
        raise bad_request(str(exc), "keep_alive") from None


def _inputs(body: dict, legacy: bool) -> dict:
    """The /v1/embeddings body of the request's inputs."""
    if legacy:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' must be a non-empty string", "prompt")
        return {"input": [prompt]}
    value = body.get("input")
    if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise bad_request("'input' must be a string or a list of strings", "input")
    dimensions = body.get("dimensions")
    return {"input": [value] if isinstance(value, str) else value, **({"dimensions": dimensions} if dimensions else {})}


def _cut(inputs: list[list[int]], max_context: int, pooling: str) -> list[list[int]]:
    """Each input cut to the context; a last-token model keeps its last (end) token last."""
    if pooling == "last":
        return [ids if len(ids) <= max_context else ids[: max_context - 1] + ids[-1:] for ids in inputs]
    return [ids[:max_context] for ids in inputs]


async def serve_embed(api, ticket, body: dict, legacy: bool, arrived: int, request) -> JSONResponse:
    name, keep_alive = _read(body, legacy)
    request.state.ollama_model = name
    chat_body = _inputs(body, legacy)
    truncate = body.get("truncate", True)
    if truncate is not None and not isinstance(truncate, bool):
        raise bad_request("'truncate' must be a boolean", "truncate")
    lease = await api.models.acquire(tandem_name(name), keep_alive)
    ticket.also_release(lease.release)
    served = lease.model
    loaded = time.monotonic_ns()
    if served.kind != "embedding":
        raise ApiError(400, f'"{name}" does not support embeddings (it is a {served.kind} model)', param="model")
    config = embedding_config(served.model_dir)
    parsed = await ticket.off_loop(parse_embeddings, {"model": served.model_id, **chat_body}, served.tokenizer,
                                   ANY_LENGTH if truncate is not False else served.max_context, config)
    inputs = _cut(parsed.inputs, served.max_context, config.pooling)
    deadline = time.monotonic() + api.settings.request_timeout_s
    vectors, tokens = await served.engine.embed(inputs, parsed.dimensions, deadline)
    rows = [[float(x) for x in row] for row in vectors]
    if legacy:
        return JSONResponse({"embedding": rows[0]})
    now = time.monotonic_ns()
    return JSONResponse({"model": name, "embeddings": rows, "total_duration": now - arrived,
                         "load_duration": loaded - arrived, "prompt_eval_count": int(tokens)})
