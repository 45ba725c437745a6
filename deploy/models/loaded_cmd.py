"""`tandem ps` and `tandem stop MODEL`: the running server's loaded models, as
`ollama ps` and `ollama stop` show and unload them, through the server's own
Ollama endpoints (GET /api/ps; POST /api/generate with keep_alive 0). The
answers come from the network: every field is checked before it is used."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone

import httpx

from environment.hub_cache import size_text
from environment.settings import Settings

TIMEOUT_S = 10.0
FOREVER_S = 10 * 365 * 86400  # a keep-alive of -1 reads as a date this far off or more


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    d = Settings()
    parser.add_argument("--host", default=d.host, help="the server's address (default %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="the server's port (default %(default)s)")
    parser.add_argument("--api-key", default=None, help="a key the server takes (`serve --api-key`)")


def add_ps_arguments(parser: argparse.ArgumentParser) -> None:
    _add_server_arguments(parser)
    parser.set_defaults(run=run_ps)


def add_stop_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a loaded model, as `tandem ps` names it")
    _add_server_arguments(parser)
    parser.set_defaults(run=run_stop)


def _url(args: argparse.Namespace, path: str) -> str:
    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    return f"http://{host}:{args.port}{path}"


def _headers(args: argparse.Namespace) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _error(resp: httpx.Response) -> str:
    """The server's own words: Ollama's {"error": "..."} or OpenAI's {"error": {"message": ...}}."""
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}"
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        err = err.get("message")
    return str(err) if err else f"HTTP {resp.status_code}"


def _processor(size, vram) -> str:
    """Where the weights are, as `ollama ps` says it."""
    if not isinstance(size, int) or not isinstance(vram, int) or size <= 0:
        return "?"
    if vram <= 0:
        return "100% CPU"
    if vram >= size:
        return "100% GPU"
    gpu = round(100 * vram / size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def _until(expires, now: datetime | None = None) -> str:
    """When an idle model goes: "4 minutes from now", "Forever", "Stopping..."."""
    if not isinstance(expires, str) or not expires:
        return "?"
    try:
        when = datetime.fromisoformat(expires.replace("Z", "+00:00"))
    except ValueError:
        return "?"
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    left = (when - (now or datetime.now(timezone.utc))).total_seconds()
    if left <= 0:
        return "Stopping..."
    if left >= FOREVER_S:
        return "Forever"
    for unit, seconds in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if left >= seconds:
            n = int(left // seconds)
            return f"{n} {unit}{'s' if n != 1 else ''} from now"
    return "Less than a second from now"


def ps_lines(body) -> list[str]:
    """The table `tandem ps` prints for /api/ps's answer."""
    models = body.get("models") if isinstance(body, dict) else None
    rows = [(str(m.get("name") or m.get("model") or "?"),
             size_text(m["size"]) if isinstance(m.get("size"), int) else "?",
             _processor(m.get("size"), m.get("size_vram")), _until(m.get("expires_at")))
            for m in (models if isinstance(models, list) else []) if isinstance(m, dict)]
    head = ("NAME", "SIZE", "PROCESSOR", "UNTIL")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    return ["  ".join(f"{cell:<{w}}" for cell, w in zip(r, widths)) + "  " + r[3] for r in [head, *rows]]


def run_ps(args: argparse.Namespace) -> int:
    try:
        resp = httpx.get(_url(args, "/api/ps"), headers=_headers(args), timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        print(f"tandem ps: no server answers at {_url(args, '')} ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        print(f"tandem ps: {_error(resp)}", file=sys.stderr)
        return 1
    try:
        body = resp.json()
    except ValueError:
        print("tandem ps: the server answered, but not with JSON (another program on this port?)", file=sys.stderr)
        return 1
    print("\n".join(ps_lines(body)))
    return 0


def run_stop(args: argparse.Namespace) -> int:
    """Unload MODEL now, as `ollama stop` does: a generate request with no
    prompt and keep_alive 0."""
    try:
        resp = httpx.post(_url(args, "/api/generate"), json={"model": args.model, "keep_alive": 0},
                          headers=_headers(args), timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        print(f"tandem stop: no server answers at {_url(args, '')} ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    if resp.status_code == 404:
        print(f"tandem stop: couldn't find model \"{args.model}\" to stop ({_error(resp)})", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        print(f"tandem stop: {_error(resp)}", file=sys.stderr)
        return 1
    return 0
