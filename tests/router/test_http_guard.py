"""Browser safety and API keys (router/guards/http_guard.py), as the attacks a web page
makes on a server on localhost: DNS rebinding, cross-site requests, bodies a
page may send without a preflight; and keys, each its own cache tenant. Over
real HTTP (uvicorn in a thread) against the scripted engine."""

from __future__ import annotations

import hashlib
import json
import socket

import httpx
import openai
import pytest
from starlette.responses import JSONResponse

from environment.settings import Settings
from router.guards.http_guard import HostNames, HttpGuard, normalize_origin, same_origin, split_host
from tests.support.fake_engine import FakeEngine
from tests.support.router_server import ServerThread, serve_app

PAGE = "http://localhost:3000"  # a page the operator lets call the API
EVIL = "http://evil.example"
CHAT = {"model": "tandem-test", "messages": [{"role": "user", "content": "Say hello"}]}
KEYS = ("sk-alice", "sk-bob")


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with serve_app(engine, tokenizer, cors_origins=(PAGE,), request_timeout_s=30) as running:
        yield running


@pytest.fixture(scope="module")
def keyed_server(engine, tokenizer):
    with serve_app(engine, tokenizer, api_keys=KEYS, cors_origins=(PAGE,), request_timeout_s=30) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh_engine(engine):
    engine.reset()
    engine.say("Hello world.")


def post_chat(server, headers=None, **kwargs) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", headers=headers or {}, timeout=10, **kwargs)


# --------------------------------------------------------------------------- #
# Host: DNS rebinding
# --------------------------------------------------------------------------- #


def test_a_rebound_name_is_refused_everywhere(server, engine):
    """A page on evil.example that re-points its name at 127.0.0.1 is same-origin
    to itself: only the Host header tells. Nothing it asks is answered."""
    for path in ("/health", "/metrics", "/v1/models"):
        response = httpx.get(server.url + path, headers={"Host": "evil.example:%d" % server.port})
        assert response.status_code == 421, path
        error = response.json()["error"]
        assert error["code"] == "invalid_host" and "evil.example" in error["message"]
    response = post_chat(server, {"Host": "evil.example", "Origin": "http://evil.example"}, json=CHAT)
    assert response.status_code == 421  # Host first: the rebound page is same-origin to itself
    response = httpx.post(server.url + "/v1/messages", headers={"Host": "evil.example"}, timeout=10,
                          json={"model": "tandem-test", "max_tokens": 5, "messages": []})
    assert response.status_code == 421 and response.json()["type"] == "error"  # Anthropic's shape there
    for host in ("evil.example.", "localhost.evil.example", "127.0.0.1.nip.io", "localhost@evil.example",
                 "evil.example:80@localhost", "localhost/x", "::1", "10.0.0.8"):
        assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 421, host
    assert not engine.requests


def test_the_names_the_server_is_reachable_as_are_accepted(server):
    for host in ("localhost", "LocalHost.:8000", "127.0.0.1:%d" % server.port, "127.0.0.2", "[::1]:9000",
                 "[::ffff:127.0.0.1]"):
        assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 200, host


def test_a_request_without_a_host_header_is_a_non_browser_client(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200")


def test_host_names_by_bind_address():
    machine = socket.gethostname().lower().split(".")[0]
    local = HostNames(Settings(host="127.0.0.1"))
    assert local.allows("localhost") and local.allows("127.0.0.1") and local.allows("::1")
    assert not local.allows("192.168.1.20") and not local.allows(machine + ".local")
    named = HostNames(Settings(host="Studio.LAN.", allowed_hosts=("llm.example.com",)))
    assert named.allows("studio.lan") and named.allows("llm.example.com") and not named.allows("lan")
    assert HostNames(Settings(host="::1")).allows("::1") and HostNames(Settings(host="10.0.0.8")).allows("10.0.0.8")
    everywhere = HostNames(Settings(host="0.0.0.0"))  # reachable at every address of the machine
    assert everywhere.allows("192.168.1.20") and everywhere.allows("fe80::1") and everywhere.allows(machine)
    assert everywhere.allows(machine + ".local") and not everywhere.allows("evil.example")
    assert HostNames(Settings(allowed_hosts=("*",))).allows("evil.example")  # behind a proxy that checks


def test_host_and_origin_parsing():
    assert split_host("LocalHost.:8000") == ("localhost", "8000") and split_host("[::1]") == ("::1", "")
    for bad in ("a b", "x@y", "x/y", "::1", "[::1", "host:port", "host:123456", "", "."):
        assert split_host(bad) is None, bad
    assert normalize_origin("HTTP://LocalHost:80/") == "http://localhost"
    assert normalize_origin("https://x.example:8443") == "https://x.example:8443"
    assert normalize_origin("null") is None
    assert same_origin("http://localhost:8000", "localhost:8000") and same_origin("http://a.b", "a.b:80")
    assert same_origin("https://proxy.example", "proxy.example")  # a TLS proxy in front
    assert not same_origin("http://localhost:3000", "localhost:8000") and not same_origin("null", "localhost")


# --------------------------------------------------------------------------- #
# Origin: cross-site requests
# --------------------------------------------------------------------------- #


def test_a_blind_cross_site_post_never_reaches_the_engine(server, engine):
    """A 'simple' request (text/plain, no preflight): the page cannot read the
    answer, but without this check the generation would run."""
    for headers in ({"Origin": EVIL, "Content-Type": "text/plain"},
                    {"Origin": EVIL, "Content-Type": "application/json"},
                    {"Origin": "null", "Content-Type": "text/plain"},  # a sandboxed frame, a file:// page
                    {"Origin": "http://localhost:3001", "Content-Type": "text/plain"},  # same site, other port
                    {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"}):  # no Origin sent
        response = post_chat(server, headers, content=json.dumps(CHAT))
        assert response.status_code == 403, headers
        assert response.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in response.headers
    for method in ("GET", "DELETE", "OPTIONS"):
        response = httpx.request(method, server.url + "/v1/responses/resp_x", headers={
            "Origin": EVIL, "Access-Control-Request-Method": "DELETE"})
        assert response.status_code == 403 and "access-control-allow-origin" not in response.headers
    assert httpx.get(server.url + "/health", headers={"Origin": EVIL}).status_code == 403
    assert httpx.get(server.url + "/metrics", headers={"Sec-Fetch-Site": "same-site"}).status_code == 403
    assert not engine.requests


def test_an_allowed_origin_gets_cors_on_preflight_and_on_a_stream(server, engine):
    preflight = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": PAGE, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang, openai-organization, x-evil"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == PAGE and "Origin" in preflight.headers["vary"]
    assert "POST" in preflight.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in preflight.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-api-key", "anthropic-version", "x-stainless-lang",
            "openai-organization"} <= allowed and "x-evil" not in allowed
    assert int(preflight.headers["access-control-max-age"]) > 0
    assert not engine.requests
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=10,
                      headers={"Origin": PAGE}, json={**CHAT, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == PAGE and "Origin" in response.headers["vary"]
        text = response.read().decode()
    assert "Hello" in text and text.rstrip().endswith("data: [DONE]")
    own = "http://127.0.0.1:%d" % server.port  # the server's own origin needs no listing
    assert post_chat(server, {"Origin": own}, json=CHAT).status_code == 200


def test_any_origin_with_a_star_never_with_credentials(engine, tokenizer):
    with serve_app(engine, tokenizer, cors_origins=("*",)) as running:
        response = httpx.post(running.url + "/v1/chat/completions", headers={"Origin": EVIL}, json=CHAT, timeout=10)
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in response.headers
        assert httpx.get(running.url + "/health", headers={"Host": "evil.example"}).status_code == 421


# --------------------------------------------------------------------------- #
# Content-Type: bodies a page may send without a preflight
# --------------------------------------------------------------------------- #


def test_a_body_that_is_not_declared_json_is_415(server, engine):
    body = json.dumps(CHAT).encode()
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/jsonp", "text/plain, application/json", None):
        headers = {"Content-Type": content_type} if content_type else {}
        response = post_chat(server, headers, content=body)
        assert response.status_code == 415, content_type
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    twice = httpx.Headers([("Content-Type", "application/json"), ("Content-Type", "text/plain")])
    assert post_chat(server, twice, content=body).status_code == 415  # which one would a handler believe?
    response = httpx.post(server.url + "/v1/messages", content=body, headers={"Content-Type": "text/plain"})
    assert response.status_code == 415 and response.json()["type"] == "error"
    assert not engine.requests
    for content_type in ("application/json", "Application/JSON; charset=utf-8"):
        assert post_chat(server, {"Content-Type": content_type}, content=body).status_code == 200


def test_ollamas_api_takes_curls_form_type_but_never_from_a_page(server, engine):
    """`curl -d '{...}' .../api/chat` sends application/x-www-form-urlencoded, and
    Ollama answers it; a page's request (Origin, Sec-Fetch-*) still needs JSON."""
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "Hi"}], "stream": False})
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    response = httpx.post(server.url + "/api/chat", content=body, headers=form, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["message"]["content"] == "Hello world."
    for page in ({"Origin": PAGE}, {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "no-cors"}):
        response = httpx.post(server.url + "/api/chat", content=body, headers={**form, **page}, timeout=10)
        assert response.status_code == 415 and "error" in response.json(), page
    assert post_chat(server, form, content=json.dumps(CHAT).encode()).status_code == 415  # /v1 as before


# --------------------------------------------------------------------------- #
# API keys, each a cache tenant
# --------------------------------------------------------------------------- #


def test_several_keys_each_open_the_api_and_a_wrong_one_is_401(keyed_server, engine):
    for key in KEYS + KEYS:
        client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=key, max_retries=0, timeout=10)
        assert client.chat.completions.create(**CHAT).choices[0].message.content == "Hello world."
    alice, bob, alice_again, bob_again = (request.cache_salt for request in engine.requests)
    assert alice and bob and alice != bob and (alice, bob) == (alice_again, bob_again)  # never each other's KV
    for auth in ({"Authorization": "Bearer sk-alic"}, {"Authorization": "Bearer sk-alice2"},
                 {"Authorization": "sk-alice"}, {"x-api-key": "sk-alice"}, {}):  # x-api-key: Anthropic's paths only
        response = post_chat(keyed_server, auth, json=CHAT)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", auth
    assert post_chat(keyed_server, {"Authorization": "bearer  sk-bob"}, json=CHAT).status_code == 200
    assert httpx.get(keyed_server.url + "/not-a-route").status_code == 401  # closed by default
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    assert httpx.get(keyed_server.url + "/metrics").status_code == 200


def test_a_preflight_needs_no_key_and_the_page_can_read_the_401(keyed_server, engine):
    preflight = httpx.options(keyed_server.url + "/v1/chat/completions", headers={
        "Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == PAGE
    refused = post_chat(keyed_server, {"Origin": PAGE}, json=CHAT)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE
    # The order: a foreign origin is refused before the key is asked for, the key before the body's type.
    assert post_chat(keyed_server, {"Origin": EVIL}, json=CHAT).status_code == 403
    assert post_chat(keyed_server, {"Content-Type": "text/plain"}, content=b"{}").status_code == 401
    assert not engine.requests


def test_each_key_is_its_own_cache_tenant():
    async def tenant_app(scope, receive, send):
        await JSONResponse({"tenant": scope["state"]["cache_tenant"]})(scope, receive, send)

    def tenants(settings: Settings, path: str, auth: dict) -> str:
        with ServerThread(HttpGuard(tenant_app, settings), settings) as running:
            return httpx.get(running.url + path, headers=auth).json()["tenant"]

    keyed = Settings(api_keys=KEYS)
    alice, bob = (tenants(keyed, "/v1/models", {"Authorization": f"Bearer {key}"}) for key in KEYS)
    assert alice == hashlib.sha256(b"sk-alice").hexdigest()[:32] and bob != alice and len(bob) == 32
    assert tenants(keyed, "/v1/messages", {"x-api-key": "sk-bob"}) == bob  # same key, same tenant, either header
    assert tenants(keyed, "/health", {}) == ""
    assert tenants(Settings(), "/v1/models", {}) == ""  # no keys: one shared tenant
