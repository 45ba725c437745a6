"""Ollama's `options` read into the OpenAI sampling fields the router
honours (router/parsed_request.py checks their values).

Each option is honoured, or accepted because it has nothing to do here
(named in a log line), or refused with a 400 naming it: never dropped.
- Sampling: temperature, top_p, top_k, min_p, seed, stop, num_predict
  (-> max_tokens; -1 and -2, "no limit" and "fill the context", let the
  answer run to the context's end), repeat_penalty (-> repetition_penalty),
  presence_penalty, frequency_penalty. Without num_predict, the model's
  recommended length (generation_config.json), as every endpoint's.
- repeat_last_n: the penalties look at the last 20 tokens (mlx-lm's window),
  so 20 is honoured, and any value while no penalty is in force (the window
  then changes nothing); another is a 400.
- Sampling switched off: mirostat 0, tfs_z 1, typical_p 1 (the samplers
  Tandem lacks, asked not to run).
- How llama.cpp holds the model (num_ctx, num_gpu, num_thread, num_batch,
  use_mmap, ...): Tandem's layout and memory come from its own settings and
  the model's context; num_keep (Tandem never shifts a context) and
  penalize_newline (Ollama itself no longer applies it) alike.
"""

from __future__ import annotations

import logging

from router.api.errors import ApiError

log = logging.getLogger("tandem.router")

SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}
NOT_APPLYING = frozenset(("num_ctx", "num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock",
                          "numa", "low_vram", "f16_kv", "vocab_only", "logits_all", "embedding_only", "num_keep",
                          "penalize_newline"))
SWITCHED_OFF = {"mirostat": 0, "tfs_z": 1, "typical_p": 1}
PENALTY_WINDOW = 20  # tokens mlx-lm's repetition, presence and frequency penalties look back over
UNLIMITED_PREDICT = (-1, -2)
TO_THE_CONTEXT = -1  # max_tokens once the prompt's length is known: the rest of the context (routes.py)
# OpenAI's name of each honoured option, for errors: the client named it in `options`.
OPTION_OF_FIELD = {**{v: k for k, v in SAMPLING.items()}, "max_tokens": "num_predict"}


def bad_option(name: str, why: str) -> ApiError:
    return ApiError(400, f"invalid option '{name}': {why}", param=f"options.{name}")


def sampling_of(options) -> dict:
    """The OpenAI body fields `options` asks for (values checked later, as
    any chat body's). 400 for an option Tandem does not honour."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be an object", param="options")
    out, idle, refused = {}, [], []
    for name, value in options.items():
        if value is None:
            continue
        if name in SAMPLING:
            out[SAMPLING[name]] = [value] if name == "stop" and isinstance(value, str) else value
        elif name == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad_option(name, "expected an integer")
            if value == 0 or value < -2:
                raise bad_option(name, f"expected a number of tokens > 0, or -1 (no limit), but got {value}")
            out["max_tokens"] = value if value not in UNLIMITED_PREDICT else TO_THE_CONTEXT
        elif name in NOT_APPLYING:
            idle.append(name)
        elif name in SWITCHED_OFF:
            if value != SWITCHED_OFF[name]:
                raise bad_option(name, f"Tandem has no such sampler; only {SWITCHED_OFF[name]} (off) is accepted")
            idle.append(name)
        elif name != "repeat_last_n":
            refused.append(name)
    if refused:
        raise ApiError(400, f"unsupported option{'s' if len(refused) > 1 else ''} "
                       f"{', '.join(repr(n) for n in sorted(refused)[:8])}: Tandem does not honour "
                       f"{'them' if len(refused) > 1 else 'it'} and will not ignore it silently; supported: "
                       f"{', '.join(sorted([*SAMPLING, 'num_predict', 'repeat_last_n', *SWITCHED_OFF, *NOT_APPLYING]))}",
                       param=f"options.{sorted(refused)[0]}")
    _penalty_window(options.get("repeat_last_n"), out)
    if idle:
        log.info("Ollama options %s accepted, not applying to Tandem (its layout and memory come from its own "
                 "settings; its samplers are those it names)", ", ".join(sorted(idle)))
    return out


def _penalty_window(window, fields: dict) -> None:
    if window is None or window == PENALTY_WINDOW:
        return
    if isinstance(window, bool) or not isinstance(window, int):
        raise bad_option("repeat_last_n", "expected an integer")
    penalties = [f for f in ("repetition_penalty", "presence_penalty", "frequency_penalty")
                 if fields.get(f) not in (None, 0, 0.0) and not (f == "repetition_penalty" and fields[f] == 1)]
    if penalties:
        raise bad_option("repeat_last_n", f"Tandem's penalties look at the last {PENALTY_WINDOW} tokens; "
                         f"send {PENALTY_WINDOW}, or no penalty")
