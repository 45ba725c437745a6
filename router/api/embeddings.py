"""POST /v1/embeddings in OpenAI's shape, for an embedding model (its workers:
workers/embed/, reached through the dispatcher's `embed`).

`input`: a string, a list of strings, a list of token ids, or a list of
token-id lists; at most MAX_INPUTS inputs, none empty, each within the
model's context. Text is tokenized by the served model's tokenizer as
sentence-transformers does (its special tokens: a BERT's [CLS] ... [SEP],
Qwen3-Embedding's closing <|endoftext|>); a last-token model whose tokenizer
appends no end token (Qwen3-Embedding's files before June 2025) gets its
<|endoftext|> here, as its authors' code appended it. Token ids are embedded
as given. `encoding_format`: "float" or "base64" (the vector's little-endian
float32 bytes, as OpenAI's); `dimensions`: for a model trained for it
(environment/embedding_config.py), else 400; `user`: accepted. Usage counts
the tokens embedded.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import time
from dataclasses import dataclass

import numpy as np
from starlette.responses import Response

from environment.embedding_config import EmbeddingConfig, embedding_config
from protos.grammar import per_tokenizer
from router.api.errors import ApiError, invalid, only

log = logging.getLogger("tandem.router")

MAX_INPUTS = 2048  # OpenAI's limit per request
HONOURED = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
END_TOKEN = "<|endoftext|>"
# Work this small runs on the event loop: a hop to an admission thread costs
# more than it (the GIL handed over, at worst after its 5 ms switch interval;
# on the H200 64 concurrent one-input requests reached the worker ~8 ms apart).
INLINE_INPUTS, INLINE_CHARS = 64, 8192  # inputs, and their characters (or token ids) together
INLINE_BASE64, INLINE_FLOATS = 1 << 18, 4096  # numbers in the answer's vectors  # Qwen3-Embedding's last token, the one its vector is read at


@dataclass
class EmbedInputs:
    inputs: list[list[int]]
    dimensions: int  # 0: the model's own width
    base64: bool


def parse_embeddings(body, tokenizer, max_context: int, config: EmbeddingConfig) -> EmbedInputs:
    """(Blocking: tokenizes.) The body checked and its inputs as token ids; ApiError (400/422) otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object")
    only(body, HONOURED)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise invalid("encoding_format", f"{fmt!r} is not one of 'float', 'base64'")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("user", "expected a string", 422, "invalid_type")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool):
            raise invalid("dimensions", "expected an integer", 422, "invalid_type")
        if dimensions < 1:
            raise invalid("dimensions", "must be at least 1")
        if not config.matryoshka:
            raise ApiError(400, "This model does not support 'dimensions': its vectors cannot be shortened",
                           param="dimensions", code="unsupported_parameter")
    inputs = [_tokens(item, i, tokenizer, config) for i, item in enumerate(_items(body.get("input")))]
    for i, ids in enumerate(inputs):
        if len(ids) > max_context:
            raise ApiError(400, f"Input {i} is {len(ids)} tokens; this model's context is {max_context} tokens",
                           param="input", code="context_length_exceeded")
    return EmbedInputs(inputs, dimensions or 0, fmt == "base64")


def _items(value) -> list:
    """The inputs: each a string or a list of token ids."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid("input", "expected a string, a list of strings, a list of token ids or a list of "
                      "token-id lists", 422 if value is not None else 400,
                      "invalid_type" if value is not None else "invalid_value")
    if not value:
        raise invalid("input", "must not be empty")
    if all(_is_id(v) for v in value):
        return [value]  # one input given as token ids
    if len(value) > MAX_INPUTS:
        raise invalid("input", f"{len(value)} inputs; at most {MAX_INPUTS} per request")
    for i, v in enumerate(value):
        if not isinstance(v, str) and not (isinstance(v, list) and all(_is_id(t) for t in v)):
            raise invalid(f"input[{i}]", "expected a string or a list of token ids", 422, "invalid_type")
    return value


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tokens(item, index: int, tokenizer, config: EmbeddingConfig) -> list[int]:
    if not item:
        raise invalid(f"input[{index}]", "must not be empty")
    if isinstance(item, list):
        vocab = len(tokenizer)
        bad = next((t for t in item if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"input[{index}]", f"token id {bad} is outside the vocabulary (0-{vocab - 1})")
        return list(item)
    ids = tokenizer.encode(item, add_special_tokens=True)
    end = _appended_end(tokenizer) if config.pooling == "last" else None
    return ids + [end] if end is not None and (not ids or ids[-1] != end) else ids


@per_tokenizer(maxsize=1)
def _appended_end(tokenizer) -> int | None:
    """The end token a last-token model's text needs appended here: None when
    its tokenizer adds special tokens itself (or has no END_TOKEN)."""
    if tokenizer.encode("a", add_special_tokens=True) != tokenizer.encode("a", add_special_tokens=False):
        return None
    return tokenizer.get_vocab().get(END_TOKEN)


def embeddings_body(vectors: np.ndarray, prompt_tokens: int, model_id: str, as_base64: bool) -> dict:
    """OpenAI's answer: one `embedding` object a vector, in input order."""
    rows = np.asarray(vectors, dtype="<f4")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.tobytes()).decode("ascii") if as_base64 else row.tolist()}
            for i, row in enumerate(rows)]
    return {"object": "list", "data": data, "model": model_id,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


async def serve_embeddings(ticket, body: dict, model, timeout_s: float) -> Response:
    """One request for `model` (router/models/served.py ServedModel: kind,
    engine, tokenizer, model_dir), its tokenizing and its JSON (2048 vectors
    of 4096 numbers are ~170 MB of text) in `ticket`'s threads
    (router/guards/admission.py), off the event loop. Its kind is checked
    where the pool hands it out (router/app.py model_of)."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    args = (body, model.tokenizer, model.max_context, _config(model.model_dir))
    parsed = parse_embeddings(*args) if _small(body) else await ticket.off_loop(parse_embeddings, *args)
    t1 = time.monotonic()
    vectors, tokens = await model.engine.embed(parsed.inputs, parsed.dimensions, deadline)
    t2 = time.monotonic()
    args = (vectors, tokens, model.model_id, parsed.base64)
    small = vectors.size <= (INLINE_BASE64 if parsed.base64 else INLINE_FLOATS)
    out = _render(*args) if small else await ticket.off_loop(_render, *args)
    log.debug("embeddings of %d inputs (%d tokens): parsed in %.1f ms, embedded in %.1f ms, written in %.1f ms",
              len(parsed.inputs), tokens, (t1 - t0) * 1000, (t2 - t1) * 1000, (time.monotonic() - t2) * 1000)
    return Response(out, media_type="application/json")


def _small(body) -> bool:
    """Whether the inputs are few and short enough to tokenize on the event loop."""
    value = body.get("input") if isinstance(body, dict) else None
    items = value if isinstance(value, list) else [value]
    return len(items) <= INLINE_INPUTS and sum(len(v) if isinstance(v, (str, list)) else 1 for v in items) <= INLINE_CHARS


def _render(vectors: np.ndarray, prompt_tokens: int, model_id: str, as_base64: bool) -> bytes:
    return json.dumps(embeddings_body(vectors, prompt_tokens, model_id, as_base64), separators=(",", ":")).encode()


_config = functools.lru_cache(maxsize=16)(embedding_config)  # a model's folder, read once
