"""The sampling a model's authors recommend, read from its folder's
`generation_config.json`: what a request gets for every field it leaves out.

OpenAI's own defaults (temperature 1, top_p 1) suit large models; a small
one left at temperature 1 rambles until its length limit (the embedded
4-bit SmolLM2 never stops). vLLM serves a model's generation_config by
default for that reason, and so does Tandem. A request's own fields always
win.

The file is untrusted input like any in a model folder: a value outside the
API's own range is dropped (and logged), never served.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """None: the API's own default (temperature 1, top_p 1, no top_k or
    min_p, no repetition penalty, the answer's length up to the context)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens

    def given(self) -> dict:
        """The fields the model sets, as /v1/models shows them."""
        return {k: v for k, v in asdict(self).items() if v is not None}


# generation_config's key -> (our field, the range the API accepts)
_FIELDS = {
    "temperature": ("temperature", lambda v: 0 <= v <= 2),
    "top_p": ("top_p", lambda v: 0 < v <= 1),
    "top_k": ("top_k", lambda v: v >= 0 and float(v).is_integer()),
    "min_p": ("min_p", lambda v: 0 <= v <= 1),
    "repetition_penalty": ("repetition_penalty", lambda v: v > 0),
    "max_new_tokens": ("max_tokens", lambda v: v >= 1 and float(v).is_integer()),
}


def generation_defaults(folder: str | Path) -> GenerationDefaults:
    """The folder's recommended sampling (empty when it has no readable
    generation_config.json). `do_sample: false` means greedy, as in
    transformers, whatever temperature the file also names."""
    path = Path(folder) / FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return GenerationDefaults()
    except (OSError, ValueError) as exc:
        log.warning("%s: not read (%s); the API's own sampling defaults apply", path, exc)
        return GenerationDefaults()
    if not isinstance(config, dict):
        log.warning("%s: not a JSON object; the API's own sampling defaults apply", path)
        return GenerationDefaults()
    found = {}
    for key, (name, ok) in _FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            log.warning("%s: %s = %r is outside what a request may ask; left out", path, key, value)
            continue
        found[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    if config.get("do_sample") is False:
        found["temperature"] = 0.0
    if found.get("top_k") == 0:
        del found["top_k"]  # 0 is transformers' "off", the API's default already
    return GenerationDefaults(**found)


def write_generation_defaults(folder: str | Path, values: dict, replace: bool = False) -> None:
    """Give a folder we made (a converted GGUF) the sampling its authors
    recommend, unless it has a generation_config.json already (`replace`:
    unless it has exactly these values, for a folder that is Tandem's own).
    Atomic: a reader sees the whole file or none."""
    path = Path(folder) / FILE
    if path.exists():
        try:
            same = json.loads(path.read_text()) == values
        except (OSError, ValueError):
            same = False
        if same or not replace:
            return
    tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(values, indent=2) + "\n")
    tmp.replace(path)
