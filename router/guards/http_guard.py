"""Browser safety and API keys: one ASGI middleware in front of every route,
run before anything reads a body.

The attacker here is a web page: any page the user opens can send requests to
a server on localhost. The checks, in this order (the first that fails answers,
in the API's error shape, router/api/errors.py):

1. Host (DNS rebinding): a page on evil.example that re-points its own name at
   127.0.0.1 talks to this server as a same-origin page, but its Host header
   still names evil.example. Only names the server is reachable as pass (421).
2. Origin (cross-site requests): a request from a page of another origin (its
   Origin header, or Sec-Fetch-Site without one) is refused unless
   --cors-origins lists that origin (403), whatever the method: a "simple"
   POST reaches the server without a preflight, and its side effect happens
   even though the page cannot read the answer. Listed origins get CORS
   headers, and their preflights are answered here, before the key check
   (browsers send no credentials on a preflight).
3. API key: with --api-key, every route but /health and /metrics needs one
   (401). The key that matched names the request's cache tenant,
   scope["state"]["cache_tenant"], so callers with different keys never
   share cached KV.
4. Content-Type: a POST body is taken only as application/json (415). The
   types a page may send without a preflight (text/plain, forms) never reach
   a handler. Ollama's API (/api/*) takes any type from a client that is no
   page (no Origin, no Sec-Fetch-*), as Ollama does: `curl -d` sends a form's.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import socket

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from environment.settings import Settings
from router.api.errors import ApiError, is_anthropic_path, is_ollama_path

OPEN_PATHS = frozenset({"/health", "/metrics"})  # supervisors and scrapers: no key, still Host and Origin
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
# Request headers a listed origin's page may send: what the openai and
# anthropic SDKs send (their x-stainless-* telemetry, openai-organization,
# anthropic-version, anthropic-beta, ...), besides the key and the body's type.
CORS_HEADERS = ("authorization", "content-type", "x-api-key", "anthropic-version")
CORS_EXTRA_HEADERS = frozenset({"accept", "idempotency-key"})
CORS_HEADER_PREFIXES = ("openai-", "anthropic-", "x-stainless-")
CORS_MAX_AGE_S = 600
TENANT_CHARS = 32  # of the key's SHA-256, hex: 128 bits
DEFAULT_PORTS = {"http": "80", "https": "443"}
_HOST = re.compile(r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9_.-]+))(?::(?P<port>[0-9]{1,5}))?", re.ASCII)


def split_host(value: str) -> tuple[str, str] | None:
    """'LocalHost.:8000' -> ('localhost', '8000'); '[::1]' -> ('::1', '');
    None for anything that is not a host name or address with an optional port
    (user info, paths, spaces, unbracketed IPv6)."""
    match = _HOST.fullmatch(value.strip().lower())
    if match is None:
        return None
    name = match["v6"] or match["name"].removesuffix(".")
    return (name, match["port"] or "") if name else None


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return None
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


class HostNames:
    """The Host names this server answers to. Any port: port forwarding
    (`ssh -L 9000:localhost:8000`, `docker -p`) changes the port a client names,
    and the port adds nothing against rebinding, where the attacker's page
    must name its own host."""

    def __init__(self, settings: Settings):
        host = settings.host.strip().lower()
        self.any_host = "*" in settings.allowed_hosts
        self.any_ip = host in WILDCARD_HOSTS  # bound to every interface: reachable at any of its addresses
        names = {"localhost"} | {n.strip().lower().removesuffix(".") for n in settings.allowed_hosts}
        if self.any_ip:
            machine = socket.gethostname().lower().removesuffix(".")
            short = machine.split(".")[0]
            names |= {machine, short, short + ".local"}
        elif host:
            parsed = split_host(host) or split_host(f"[{host}]")  # a bare IPv6 address as --host
            if parsed:
                names.add(str(_ip(parsed[0]) or parsed[0]))
        self.names = frozenset(n for n in names if n)

    def allows(self, name: str) -> bool:
        if self.any_host or name in self.names:
            return True
        ip = _ip(name)
        return ip is not None and (ip.is_loopback or self.any_ip or str(ip) in self.names)


class Origins:
    """Which browser Origins may call the API: the server's own (the Origin
    names the Host the request was sent to), and those --cors-origins lists
    ('*': any, never with credentials)."""

    def __init__(self, settings: Settings):
        self.any_origin = "*" in settings.cors_origins
        self.listed = frozenset(filter(None, (normalize_origin(o) for o in settings.cors_origins if o != "*")))

    def allows(self, origin: str | None, host: str | None) -> bool:
        return self.any_origin or (origin is not None and (same_origin(origin, host) or origin in self.listed))


def normalize_origin(origin: str) -> str | None:
    """'HTTP://LocalHost:80/' -> 'http://localhost'; None when not scheme://host."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or not scheme or not rest.rstrip("/"):
        return None
    parsed = split_host(rest.rstrip("/"))
    if parsed is None:
        return f"{scheme}://{rest.rstrip('/')}"  # an extension's or app's origin: compared as written
    name, port = parsed
    name = f"[{name}]" if ":" in name else name
    return f"{scheme}://{name}" + (f":{port}" if port and port != DEFAULT_PORTS.get(scheme) else "")


def same_origin(origin: str, host: str | None) -> bool:
    """Whether a page of `origin` sent the request to itself: its host and port
    are the Host's (behind a TLS proxy the scheme may differ, the name not)."""
    scheme, _, rest = origin.strip().lower().partition("://")
    page, target = split_host(rest.rstrip("/")), split_host(host or "")
    if scheme not in DEFAULT_PORTS or page is None or target is None:
        return False
    return page[0] == target[0] and (page[1] or DEFAULT_PORTS[scheme]) == (target[1] or DEFAULT_PORTS[scheme])


class ApiKeys:
    """Several keys, any one of which opens the API; each its own cache tenant."""

    def __init__(self, keys: tuple):
        # Compared as digests: fixed length, so timing says nothing of a key's length either.
        self.digests = [hashlib.sha256(key.encode()).digest() for key in keys if key]

    def tenant(self, headers: Headers, anthropic: bool) -> str | None:
        """The cache tenant of the key the request carries ("" with no keys
        configured), None when it carries none of them."""
        if not self.digests:
            return ""
        candidates = [_bearer(headers.get("authorization", ""))]
        if anthropic:  # Anthropic's own header, on its routes
            candidates.append(headers.get("x-api-key", ""))
        tenant = None
        for candidate in candidates:
            digest = hashlib.sha256(candidate.encode("latin-1")).digest()  # the bytes sent (Headers decodes latin-1)
            # Every key compared, none skipped: timing tells nothing of which matched.
            if any([hmac.compare_digest(digest, key) for key in self.digests]) and tenant is None:
                tenant = digest.hex()[:TENANT_CHARS]
        return tenant


def _bearer(authorization: str) -> str:
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def json_content_type(value: str | None) -> bool:
    """'application/json', with any parameters, in any case."""
    return value is not None and value.split(";")[0].strip().lower() == "application/json"


class HttpGuard:
    """The checks above, as ASGI middleware in front of the app."""

    def __init__(self, app: ASGIApp, settings: Settings):
        self.app = app
        self.hosts = HostNames(settings)
        self.origins = Origins(settings)
        self.keys = ApiKeys(settings.api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path, method = scope["path"], scope["method"]
        error = self.host_error(headers) or self.origin_error(headers)
        if error is None:
            origin = headers.get("origin")
            if origin is not None:
                send = _with_cors(send, "*" if self.origins.any_origin else origin)
                if method == "OPTIONS" and "access-control-request-method" in headers:
                    await _preflight(scope, receive, send, headers)
                    return
            error = self.key_error(scope, headers) or self.content_type_error(headers, method, path)
        if error is not None:
            await error.response(is_anthropic_path(path), is_ollama_path(path))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def host_error(self, headers: Headers) -> ApiError | None:
        hosts = headers.getlist("host")
        if not hosts or hosts == [""]:
            return None  # HTTP/1.0 without one: no browser sends that
        parsed = split_host(hosts[0]) if len(hosts) == 1 else None
        if parsed is not None and self.hosts.allows(parsed[0]):
            return None
        return ApiError(421, f"Host '{hosts[0][:100]}' is not a name this server answers to (a guard against "
                        "DNS rebinding): use localhost, 127.0.0.1 or the name it serves on, or add the name "
                        "with --allowed-hosts", code="invalid_host")

    def origin_error(self, headers: Headers) -> ApiError | None:
        origin = headers.get("origin")
        if origin is None and headers.get("sec-fetch-site", "").lower() not in ("cross-site", "same-site"):
            return None  # not from another site's page: curl, the SDKs, a page of this origin
        if self.origins.allows(origin, headers.get("host")):
            return None
        who = f"Origin '{origin[:100]}'" if origin is not None else "A page of another site"
        return ApiError(403, f"Cross-origin request refused: {who} may not call this server. Allow a browser "
                        "origin with --cors-origins", code="origin_not_allowed")

    def key_error(self, scope: Scope, headers: Headers) -> ApiError | None:
        path = scope["path"]
        anthropic = is_anthropic_path(path)
        tenant = self.keys.tenant(headers, anthropic)
        if tenant is None and path in OPEN_PATHS:
            tenant = ""
        if tenant is not None:
            scope.setdefault("state", {})["cache_tenant"] = tenant
            return None
        how = "'Authorization: Bearer <key>'"
        how = "'x-api-key: <key>' or " + how if anthropic else how
        return ApiError(401, f"Invalid or missing API key: send {how}", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})

    @staticmethod
    def content_type_error(headers: Headers, method: str, path: str = "") -> ApiError | None:
        types = headers.getlist("content-type")
        content_type = ", ".join(types) if types else None  # two of them: neither is taken
        if method not in BODY_METHODS or json_content_type(content_type):
            return None
        if is_ollama_path(path) and not _from_a_page(headers):
            return None  # Ollama takes any type, and its users' curl -d sends a form's: no page sent this
        got = f"'{content_type[:100]}'" if content_type is not None else "none"
        return ApiError(415, f"Unsupported Content-Type {got}: send the body as JSON with "
                        "'Content-Type: application/json'", param="Content-Type", code="unsupported_media_type")


def _from_a_page(headers: Headers) -> bool:
    """Whether a browser sent the request: pages' requests carry Origin (every
    POST of a page) or the Sec-Fetch-* marks; curl and the SDKs send neither."""
    return "origin" in headers or any(name in headers for name in ("sec-fetch-site", "sec-fetch-mode"))


def _with_cors(send: Send, allow_origin: str) -> Send:
    """`send`, with the CORS headers of an allowed origin on the response
    (streamed ones included: they go with the first message)."""

    async def send_with_cors(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            headers["Access-Control-Allow-Origin"] = allow_origin
            headers["Access-Control-Expose-Headers"] = "Retry-After"
            if allow_origin != "*":
                headers.add_vary_header("Origin")
        await send(message)

    return send_with_cors


async def _preflight(scope: Scope, receive: Receive, send: Send, headers: Headers) -> None:
    """An allowed origin's preflight: the methods, and those of the headers it
    asks for that the API reads or the SDKs send (the browser refuses the rest)."""
    asked = [h.strip().lower() for h in headers.get("access-control-request-headers", "").split(",") if h.strip()]
    allowed = list(CORS_HEADERS) + [h for h in asked if h not in CORS_HEADERS and (
        h in CORS_EXTRA_HEADERS or h.startswith(CORS_HEADER_PREFIXES))]
    response = Response(status_code=204, headers={
        "Access-Control-Allow-Methods": CORS_METHODS,
        "Access-Control-Allow-Headers": ", ".join(allowed),
        "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
    })
    await response(scope, receive, send)
