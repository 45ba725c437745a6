"""The router's one request (`ParsedRequest`): what every API's body becomes
(router/api/: OpenAI's chat and completions, Anthropic's Messages and
OpenAI's Responses by way of a chat body) and the app dispatches. With the
checks of what it carries whatever the endpoint: sampling, the answer's
token limit against the context, stop strings, stream options, the cache
salt; and the typed field reads they are built on (422 for a missing field
or a wrong type, 400 for a bad value; every error names its `param`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from environment.generation_defaults import GenerationDefaults
from protos.messages import SamplingParams
from router.api.chat_output import OutputShape
from router.api.errors import ApiError, invalid, only
from router.guards.cache_salt import check_cache_salt

DEFAULT_MAX_TOKENS = 4096  # when the client sets no limit: the remaining context, at most this
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
STREAM_OPTION_FIELDS = frozenset(("include_usage",))


@dataclass
class ParsedRequest:
    """A chat or completion request as the router dispatches it, whichever
    API it came in by."""

    kind: str  # "chat" | "completion"
    prompt_tokens: list[int]
    sampling: SamplingParams  # max_tokens resolved (its TokenBudget's allowed), EOS ids in stop_token_ids
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    images: list = field(default_factory=list)  # protos.messages.ImageInput, prompt order
    output: OutputShape | None = None  # a chat answer's reasoning and tool calls, when it may have them
    cache_salt: str = ""  # the body's `cache_salt` ("": none); router/guards/cache_salt.py adds the tenant


# --------------------------------------------------------------------------- #
# Field reads: 422 for a missing field or wrong type, 400 for a bad value
# --------------------------------------------------------------------------- #

_JSON_TYPES = {
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a boolean": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
    "an array": lambda v: isinstance(v, list),
    "a string or an array": lambda v: isinstance(v, (str, list)),
}


def _json_type_name(value: Any) -> str:
    for name, check in _JSON_TYPES.items():
        if check(value):
            return name.split()[-1]
    return "null" if value is None else type(value).__name__


def read_field(body: dict, name: str, expected: str, default: Any = None, required: bool = False, path: str = "") -> Any:
    param = path + name
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(422, f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter")
        return default
    return expect_type(value, expected, param)


def expect_type(value: Any, expected: str, param: str) -> Any:
    if not _JSON_TYPES[expected](value):
        raise ApiError(
            422,
            f"Invalid type for '{param}': expected {expected}, but got {_json_type_name(value)}",
            param=param,
            code="invalid_type",
        )
    return value


def in_range(value: Any, param: str, low: float, high: float, low_open: bool = False) -> Any:
    if value is None:
        return None
    below = value <= low if low_open else value < low
    if below or value > high or (isinstance(value, float) and math.isnan(value)):
        bracket = "(" if low_open else "["
        raise invalid(param, f"expected a value in {bracket}{low:g}, {high:g}], but got {value}")
    return value


def _number_in(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    return float(in_range(read_field(body, name, "a number", default), name, low, high, low_open))


# --------------------------------------------------------------------------- #
# What a ParsedRequest carries
# --------------------------------------------------------------------------- #


def sampling_fields(body: dict, tokenizer, defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
    """Everything but max_tokens and logprobs, which differ between chat and
    completions. A field the body leaves out takes the model's recommended
    value (`defaults`, its generation_config.json), else the API's own."""
    n = read_field(body, "n", "an integer", 1)
    if n > 1:
        raise ApiError(400, "n > 1 is not supported", param="n", code="unsupported_value")
    if n < 1:
        raise invalid("n", f"expected a value >= 1, but got {n}")
    d = defaults
    vocab_size = len(tokenizer)
    top_k = read_field(body, "top_k", "an integer", min(d.top_k or 0, vocab_size))
    if not -1 <= top_k <= vocab_size:  # the workers take k up to the vocabulary (past it: off)
        raise invalid("top_k", f"expected a value in [0, {vocab_size}] (or -1 for off), but got {top_k}")
    repetition_penalty = read_field(body, "repetition_penalty", "a number", d.repetition_penalty or 1.0)
    if not repetition_penalty > 0:
        raise invalid("repetition_penalty", f"expected a value > 0, but got {repetition_penalty}")
    seed = read_field(body, "seed", "an integer")
    if seed is not None and not 0 <= seed < 2**64:  # what the workers' PRNG key (mx.random.key) takes
        raise invalid("seed", f"expected an integer in [0, {2**64 - 1}], but got {seed}")
    read_field(body, "user", "a string")  # accepted, ignored
    return SamplingParams(
        temperature=_number_in(body, "temperature", _or(d.temperature, 1.0), 0, 2),
        top_p=_number_in(body, "top_p", _or(d.top_p, 1.0), 0, 1, low_open=True),
        top_k=max(top_k, 0),  # -1 and 0 both mean off
        min_p=_number_in(body, "min_p", _or(d.min_p, 0.0), 0, 1),
        seed=seed,
        repetition_penalty=float(repetition_penalty),
        presence_penalty=_number_in(body, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=_number_in(body, "frequency_penalty", 0.0, -2, 2),
        logit_bias=_logit_bias(body, vocab_size),
        stop_token_ids=sorted(tokenizer.eos_token_ids),
    )


def _or(value, default):
    return default if value is None else value


def _logit_bias(body: dict, vocab_size: int) -> dict:
    raw = read_field(body, "logit_bias", "an object", {})
    bias = {}
    for key, value in raw.items():
        param = f"logit_bias.{key}"
        # ASCII digits only: str.isdigit takes "²", which int() refuses.
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
            raise invalid("logit_bias", f"'{key}' is not a token id of this model (0 to {vocab_size - 1})")
        bias[str(int(key))] = float(in_range(expect_type(value, "a number", param), param, -100, 100))
    return bias


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(expect_type(stop, "a string or an array", "stop"), str) else stop
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, but got {len(stops)}")
    for i, s in enumerate(stops):
        if not expect_type(s, "a string", f"stop[{i}]"):
            raise invalid(f"stop[{i}]", "stop strings must not be empty")
    return list(stops)


def body_cache_salt(body: dict) -> str:
    return check_cache_salt(read_field(body, "cache_salt", "a string", ""))


def stream_options(body: dict) -> tuple[bool, bool]:
    stream = read_field(body, "stream", "a boolean", False)
    options = read_field(body, "stream_options", "an object", {})
    only(options, STREAM_OPTION_FIELDS, "stream_options.")
    include_usage = read_field(options, "include_usage", "a boolean", False, path="stream_options.")
    return stream, stream and include_usage


def allowed_tokens(body: dict, names: tuple[str, ...], prompt_param: str, prompt_len: int, max_context: int,
                   default: int | None = None) -> int:
    """The answer's allowed tokens from the first of `names` given; 400
    context_length_exceeded when prompt + answer does not fit. With no limit
    given: the remaining context, capped (at `default`, the model's
    max_new_tokens, when it has one)."""
    param = next((n for n in names if body.get(n) is not None), names[0])
    requested = read_field(body, param, "an integer")
    if requested is not None and requested < 1:
        raise invalid(param, f"expected a value >= 1, but got {requested}")
    if requested is None and prompt_len < max_context:
        return min(default or DEFAULT_MAX_TOKENS, max_context - prompt_len)
    budget = requested or 1  # no limit given: the prompt must still leave room for one token
    if prompt_len + budget > max_context:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_len + budget} tokens ({prompt_len} in the prompt, {budget} for the completion). "
            "Please reduce the length of the prompt or of the completion.",
            param=prompt_param if requested is None else param,
            code="context_length_exceeded",
        )
    return budget


def require_tokens(tokens: list[int], param: str) -> list[int]:
    if not tokens:
        raise invalid(param, "the prompt is empty after tokenization")
    return tokens
