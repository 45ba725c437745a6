"""How long an idle model stays loaded, as a request says it.

Ollama's `keep_alive`: a duration string ("5m", "1h30m", "90s", "250ms"), a
number of seconds, 0 (unload right after the answer) or a negative value
(keep it loaded). LM Studio's `ttl`: seconds, a positive integer. Either
becomes seconds as a float, or FOREVER; None when the request did not say.
"""

from __future__ import annotations

import math
import re

FOREVER = -1.0  # what a negative keep_alive means
MAX_SECONDS = 10 * 365 * 86400.0  # longer than any server runs: anything past it is forever
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


class KeepAliveError(ValueError):
    """A keep_alive or ttl no reading makes sense of; the message says why."""


def parse_keep_alive(value, field: str = "keep_alive") -> float | None:
    """Seconds (0: unload after the answer), FOREVER, or None (not given).
    Strings follow Go's time.ParseDuration, as Ollama reads them; a bare
    number in a string is seconds, as Ollama also takes it."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise KeepAliveError(f"{field} must be a duration such as \"5m\" or a number of seconds, not a boolean")
    if isinstance(value, (int, float)):
        return _seconds(float(value), field)
    if not isinstance(value, str):
        raise KeepAliveError(f"{field} must be a duration such as \"5m\" or a number of seconds")
    text = value.strip()
    try:
        return _seconds(float(text), field)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise KeepAliveError(f"{field} {value!r} is not a duration: use e.g. \"5m\", \"1h30m\", \"30s\", 0 or -1")
    return _seconds(sign * sum(float(n) * _UNITS[u] for n, u in parts), field)


def parse_ttl(value) -> float | None:
    """LM Studio's `ttl`: seconds an idle model stays, a positive number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise KeepAliveError("ttl must be a positive number of seconds")
    return _seconds(float(value), "ttl")


def _seconds(seconds: float, field: str) -> float:
    if math.isnan(seconds):
        raise KeepAliveError(f"{field} is not a number")
    if seconds < 0 or seconds > MAX_SECONDS:
        return FOREVER
    return seconds
