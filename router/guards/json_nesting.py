"""A bound on how deeply a request's JSON nests: a body, and the JSON text
inside it (a tool call's `arguments`).

Python's json parser stops near the interpreter's recursion limit (~1,000
levels), but what reads the parsed value afterwards (JSON schemas closed and
compiled, arguments rendered by the chat template, json.dumps) recurses too,
often two frames a level, and a RecursionError there was a 500. No request
needs more than MAX_JSON_DEPTH levels: a tool's schema a dozen or two, an
OpenAI structured-output schema at most 10 by OpenAI's own limit.

The depth is read from the text, not the parsed value: escapes and strings
cut out and the brackets that remain summed by NumPy, all at C speed (~0.1 s
for 8 MiB), and only for a text with more brackets than the limit.
"""

from __future__ import annotations

import numpy as np

from router.api.errors import ApiError, invalid

MAX_JSON_DEPTH = 64

_QUOTE = ord('"')
_SPECIAL = np.zeros(256, bool)
_SPECIAL[list(b'[]{}"')] = True
_STEP = np.zeros(256, np.int8)  # what a bracket does to the depth
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def nesting_depth(text: bytes | str) -> int:
    """How deeply the JSON `text` nests (0: a scalar; [] and {} are 1). Text
    that is not JSON gives a number, never an error."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    # Escapes out first (an escaped backslash, then an escaped quote), so
    # every quote left opens or closes a string; the brackets count outside them.
    raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    chars = np.frombuffer(raw, np.uint8)
    chars = chars[_SPECIAL[chars]]  # quotes and brackets, in order
    inside = np.bitwise_xor.accumulate(chars == _QUOTE)  # from an opening quote to its closing one
    steps = np.where(inside, 0, _STEP[chars])
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def check_nesting(text: bytes | str, param: str | None = None) -> None:
    """400 naming `param` (None: the body itself) when the JSON `text` nests
    past MAX_JSON_DEPTH."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:  # too few brackets to be too deep
        return
    depth = nesting_depth(raw)
    if depth <= MAX_JSON_DEPTH:
        return
    if param is None:
        raise ApiError(400, f"Request body nests {depth} levels deep; at most {MAX_JSON_DEPTH}",
                       code="invalid_json")
    raise invalid(param, f"nests {depth} levels deep; at most {MAX_JSON_DEPTH}")
