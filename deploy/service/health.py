"""`tandem service status`'s view of the server itself: GET /health with a
short timeout, told as a few lines (model, uptime, workers, power). The body
comes from the network: every field is checked before it is used."""

from __future__ import annotations

import httpx

TIMEOUT_S = 3.0


def fetch_health(url: str, timeout: float = TIMEOUT_S) -> tuple[int, dict | None, str]:
    """(HTTP status or 0, the JSON body or None, what went wrong or "")."""
    try:
        resp = httpx.get(url.rstrip("/") + "/health", timeout=timeout)
    except httpx.TimeoutException:
        return 0, None, f"no answer within {timeout:.0f}s"
    except httpx.HTTPError as exc:
        return 0, None, f"does not answer ({type(exc).__name__}: {exc})"
    try:
        body = resp.json()
    except ValueError:
        return resp.status_code, None, "answered, but not with JSON (another program on this port?)"
    return resp.status_code, body if isinstance(body, dict) else None, ""


def _duration(seconds) -> str:
    if not isinstance(seconds, (int, float)) or seconds < 0:
        return "?"
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    days, h = divmod(hours, 24)
    return f"{days}d {h}h {m:02d}m" if days else f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def _workers(body: dict) -> str:
    workers = body.get("workers")
    if not isinstance(workers, list):
        return "?"
    parts = [f"{w.get('id', '?')} {w.get('state', '?')} (pid {w.get('pid', '?')})" for w in workers if isinstance(w, dict)]
    expected = body.get("expected")
    tail = f" of {len(expected)} expected" if isinstance(expected, list) else ""
    return (", ".join(parts) or "none ready") + tail


def _power(power) -> str:
    if not isinstance(power, dict):
        return "not reported"
    source, percent = power.get("source", "?"), power.get("percent")
    bits = [str(source) + (f" {percent}%" if isinstance(percent, (int, float)) else "")]
    if power.get("low_power_mode"):
        bits.append("Low Power Mode")
    bits.append(f"thermal {power.get('thermal', '?')}")
    policy = f"policy {power.get('policy', '?')}"
    if power.get("reason"):
        policy += f" ({power['reason']})"
    return ", ".join(bits + [policy])


def health_lines(url: str, status: int, body: dict | None, error: str) -> list:
    """What status prints for the server: an answer, or clearly none."""
    if error and body is None:
        return [f"server    {url}: {error}"]
    verdict = "ready" if status == 200 else f"not ready (HTTP {status})"
    lines = [f"server    {url}: {verdict}"]
    if body is None:
        return lines
    lines += [f"model     {body.get('model', '?')}",
              f"uptime    {_duration(body.get('uptime_s'))}",
              f"workers   {_workers(body)}"]
    cache = body.get("cache_service")
    if isinstance(cache, dict):
        lines.append(f"cache     {cache.get('state', '?')}")
    if isinstance(body.get("requests_in_flight"), int):
        lines.append(f"requests  {body['requests_in_flight']} in flight")
    lines.append(f"power     {_power(body.get('power'))}")
    return lines
