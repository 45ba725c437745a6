"""Cache salts at the router: the attack is a caller probing the shared
prefix cache for another caller's prompt (exact `cached_tokens`, a faster
first token). The `cache_salt` field (as vLLM has it, on chat, completions
and responses) and, with several API keys, the key's tenant pick the cache a
request reads and fills; with neither, the shared cache, as before.
Driven over HTTP against a real uvicorn with a scripted engine that records
the GenerationRequest (tests/support/fake_engine.py)."""

from __future__ import annotations

import httpx
import pytest

from router.guards.cache_salt import MAX_CACHE_SALT_CHARS, effective_salt, request_salt, tenant_of
from router.routing.prefix_affinity import prefix_keys
from tests.support.fake_engine import FakeEngine
from tests.support.router_server import serve_app

KEYS = ("sk-tenant-one", "sk-tenant-two")
MESSAGES = [{"role": "user", "content": "Say hello"}]
BODIES = {
    "/v1/chat/completions": {"model": "tandem-test", "messages": MESSAGES},
    "/v1/completions": {"model": "tandem-test", "prompt": "Say hello"},
    "/v1/responses": {"model": "tandem-test", "input": "Say hello"},
}


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture(autouse=True)
def fresh_engine(engine):
    engine.reset()
    engine.say("Hello world.")


@pytest.fixture(scope="module")
def open_server(engine, tokenizer):
    with serve_app(engine, tokenizer) as running, httpx.Client(timeout=10) as running.http:
        yield running  # one client: making one costs ~0.1 s (its TLS context)


@pytest.fixture(scope="module")
def keyed_server(engine, tokenizer):
    with serve_app(engine, tokenizer, api_keys=KEYS) as running, httpx.Client(timeout=10) as running.http:
        yield running


def post(server, path, body, key=None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return server.http.post(server.url + path, json=body, headers=headers)


def salt_sent(engine, server, path, key=None, **fields) -> str:
    engine.requests.clear()
    reply = post(server, path, {**BODIES[path], **fields}, key)
    assert reply.status_code == 200, reply.text
    (request,) = engine.requests
    return request.cache_salt


# ------------------------------------------------------------- the field --
@pytest.mark.parametrize("path", list(BODIES))
def test_the_field_picks_the_cache_on_every_endpoint(engine, open_server, path):
    assert salt_sent(engine, open_server, path) == ""  # no salt: the shared cache, keys unchanged
    mine = salt_sent(engine, open_server, path, cache_salt="my-team")
    assert mine == effective_salt("", "my-team") and mine not in ("", "my-team")
    assert salt_sent(engine, open_server, path, cache_salt="my-team") == mine  # the same salt shares
    assert salt_sent(engine, open_server, path, cache_salt="other") not in (mine, "")
    assert salt_sent(engine, open_server, path, cache_salt="") == ""
    assert salt_sent(engine, open_server, path, cache_salt=None) == ""  # null: not sent


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("value, status", [("x" * (MAX_CACHE_SALT_CHARS + 1), 400), (42, 422), (["a"], 422),
                                           ({"a": 1}, 422)])
def test_a_bad_salt_is_refused_naming_the_field(engine, open_server, path, value, status):
    engine.requests.clear()
    reply = post(open_server, path, {**BODIES[path], "cache_salt": value})
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == "cache_salt"
    assert engine.requests == []  # refused before anything ran


def test_a_salt_of_the_longest_length_is_taken(engine, open_server):
    salt = "é" * MAX_CACHE_SALT_CHARS  # characters, not bytes
    assert salt_sent(engine, open_server, "/v1/chat/completions", cache_salt=salt) == effective_salt("", salt)


def test_anthropic_messages_has_no_such_field(engine, open_server):
    body = {"model": "tandem-test", "max_tokens": 16, "messages": MESSAGES, "cache_salt": "x"}
    reply = post(open_server, "/v1/messages", body)
    assert reply.status_code == 400 and "cache_salt" in reply.json()["error"]["message"]


# ------------------------------------------------------------ the tenant --
@pytest.mark.parametrize("path", list(BODIES) + ["/v1/messages"])
def test_callers_with_different_keys_never_share_a_cache(engine, keyed_server, path):
    body = BODIES.get(path) or {"model": "tandem-test", "max_tokens": 16, "messages": MESSAGES}
    salts = []
    for key in KEYS:
        engine.requests.clear()
        assert post(keyed_server, path, body, key).status_code == 200
        salts.append(engine.requests[0].cache_salt)
    assert "" not in salts and salts[0] != salts[1]
    engine.requests.clear()
    assert post(keyed_server, path, body, KEYS[0]).status_code == 200
    assert engine.requests[0].cache_salt == salts[0]  # one key's callers share, as before


def test_the_same_field_under_two_keys_stays_apart(engine, keyed_server):
    path = "/v1/chat/completions"
    one = salt_sent(engine, keyed_server, path, KEYS[0], cache_salt="shared?")
    two = salt_sent(engine, keyed_server, path, KEYS[1], cache_salt="shared?")
    assert one != two and one != salt_sent(engine, keyed_server, path, KEYS[0])


class _Request:
    def __init__(self, scope):
        self.scope = scope


def test_the_tenant_is_read_from_the_scope_and_combined_with_the_field():
    assert tenant_of(_Request({})) == "" and tenant_of(_Request({"state": {}})) == ""
    assert tenant_of(_Request({"state": {"cache_tenant": "ab12"}})) == "ab12"
    assert request_salt(_Request({"state": {"cache_tenant": "ab12"}}), "x") == effective_salt("ab12", "x")
    assert effective_salt("", "") == ""
    # Length-prefixed: no tenant and field pair passes for another.
    pairs = [("ab", ""), ("", "ab"), ("a", "b"), ("ab", "c"), ("a", "bc"), ("ab12", "x")]
    salts = {effective_salt(t, f) for t, f in pairs}
    assert len(salts) == len(pairs) and all(len(s) == 64 for s in salts)


def test_routing_keys_follow_the_salt():
    """The router's prefix affinity keys: unchanged without a salt (a fixed
    key of before salts), a chain of their own with one."""
    tokens = list(range(100, 110))
    assert prefix_keys(tokens, 4)[-1].hex() == "8f0c3358629571ce37f1928483330aa490606083fc08fc307ed5ee4e12de5825"
    assert prefix_keys(tokens, 4, salt="") == prefix_keys(tokens, 4)
    salted = prefix_keys(tokens, 4, salt="a")
    assert len(salted) == 2 and not set(salted) & set(prefix_keys(tokens, 4))
    assert not set(salted) & set(prefix_keys(tokens, 4, salt="b"))


def test_a_stored_response_belongs_to_the_key_that_made_it(engine, keyed_server):
    """The attack: a caller with another API key who learned a response id
    reads it, continues its conversation, or deletes it. To that caller it
    does not exist."""
    made = post(keyed_server, "/v1/responses", BODIES["/v1/responses"], KEYS[0])
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    url = keyed_server.url + "/v1/responses/" + rid
    other = {"Authorization": f"Bearer {KEYS[1]}"}
    assert keyed_server.http.get(url, headers=other).status_code == 404
    assert keyed_server.http.delete(url, headers=other).status_code == 404
    follow = post(keyed_server, "/v1/responses", {**BODIES["/v1/responses"], "previous_response_id": rid}, KEYS[1])
    assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"
    owner = {"Authorization": f"Bearer {KEYS[0]}"}
    assert keyed_server.http.get(url, headers=owner).json()["id"] == rid
    assert post(keyed_server, "/v1/responses", {**BODIES["/v1/responses"], "previous_response_id": rid},
                KEYS[0]).status_code == 200
    assert keyed_server.http.delete(url, headers=owner).status_code == 200
