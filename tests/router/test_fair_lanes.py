"""Fair lanes (router/guards/fair_lanes.py), written as the attack: one API key
floods the router with big bodies (chats, or count_tokens) while another sends
a small chat. The callers take turns on the parsing threads, so the small
chat is answered while the flood is still queued, not after all of it. Each
flood body's parse is held until the test lets one more through, so what is
asserted is the order of the work, never a time."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import httpx
import pytest

import router.app
from router.guards.fair_lanes import FairLane, caller_of
from tests.support.fake_engine import FakeEngine
from tests.support.router_server import serve_app, wait_for

KEYS = ("sk-flood", "sk-small")
FLOOD = 12
FILLER = "the quick brown fox jumps over the lazy dog; " * 200  # ~9 KB: big next to the small chat
CHAT = {"model": "tandem-test", "messages": [{"role": "user", "content": "Say hello"}]}
FLOODS = {
    "chat": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "FLOOD " + FILLER}]}),
    "count_tokens": ("/v1/messages/count_tokens",
                     {"model": "tandem-test", "messages": [{"role": "user", "content": "FLOOD " + FILLER}]}),
}


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with serve_app(engine, tokenizer, api_keys=KEYS, request_timeout_s=30) as running:
        yield running


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=30) as client:  # one for every thread: a client each costs more than a request
        yield client


class HeldFlood:
    """The flood's bodies parsed one at a time, when the test lets one through."""

    def __init__(self, monkeypatch):
        self.started = 0  # flood parses a thread has taken up
        self._lock = threading.Lock()
        self._permits = threading.Semaphore(0)
        original = router.app.parse_json

        def held(raw: bytes):
            if b"FLOOD" in raw:
                with self._lock:
                    self.started += 1
                self._permits.acquire(timeout=20)  # the timeout only bounds a failed test
            return original(raw)

        monkeypatch.setattr(router.app, "parse_json", held)

    def let_one_through(self) -> None:
        self._permits.release()

    def let_all_through(self) -> None:
        for _ in range(FLOOD):
            self._permits.release()


def _post(http, server, key: str, path: str, body: dict, out: list) -> None:
    try:
        out.append(http.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}))
    except httpx.HTTPError as exc:  # seen by the asserts as a missing answer
        out.append(exc)


@pytest.mark.parametrize("flood", FLOODS)
def test_another_keys_small_chat_is_answered_while_a_flood_is_still_queued(server, http, engine, monkeypatch, flood):
    engine.reset()
    engine.say("Hello world.")
    held = HeldFlood(monkeypatch)
    path, body = FLOODS[flood]
    flood_answers, small_answer = [], []
    flooders = [threading.Thread(target=_post, args=(http, server, KEYS[0], path, body, flood_answers)) for _ in range(FLOOD)]
    for thread in flooders:
        thread.start()
    try:
        wait_for(lambda: held.started == 2, 10, "the flood did not take both parsing threads")
        wait_for(lambda: _admitted(http, server) == FLOOD, 10, "the flood was not admitted")  # the rest queued behind
        small = threading.Thread(target=_post, args=(http, server, KEYS[1], "/v1/chat/completions", CHAT, small_answer))
        small.start()
        wait_for(lambda: _admitted(http, server) == FLOOD + 1, 10, "the small chat was not admitted")  # and queued
        # Each flood parse let through frees a thread for the next caller's turn.
        while not engine.requests and held.started < FLOOD:
            started = held.started
            held.let_one_through()
            wait_for(lambda: held.started > started or engine.requests, 10, "no thread took the next job")
        wait_for(lambda: engine.requests, 10, "the small chat never reached the engine")
        still_queued = FLOOD - held.started
        small.join(10)
        assert still_queued > 0, "the small chat waited for the whole flood"
        assert small_answer and small_answer[0].status_code == 200, small_answer
        assert small_answer[0].json()["choices"][0]["message"]["content"] == "Hello world."
        assert held.started < FLOOD  # answered while the flood is held: some of it still queued
    finally:
        held.let_all_through()
        for thread in flooders:
            thread.join(30)
    assert len(flood_answers) == FLOOD and all(not isinstance(a, Exception) for a in flood_answers)
    wait_for(lambda: _admitted(http, server) == 0, 10, "the flood's places did not come back")


def _admitted(http, server) -> float:
    text = http.get(server.url + "/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("tandem_requests_admitted ")))


# --------------------------------------------------------------------------- #
# The lane itself
# --------------------------------------------------------------------------- #


def test_callers_take_turns_one_job_each():
    lane = FairLane(1, "test")
    order, gate = [], threading.Event()

    def job(name: str):
        def run():
            if name == "a0":
                gate.wait(10)
            order.append(name)
        return run

    futures = [lane.submit("a", job("a0"))]
    wait_for(lambda: lane.queued("a") == 0, 5, "the first job did not start")
    futures += [lane.submit("a", job(f"a{i}")) for i in range(1, 4)] + [lane.submit("b", job("b1"))]
    gate.set()
    for future in futures:
        future.result(10)
    assert order == ["a0", "a1", "b1", "a2", "a3"]  # in arrival order: b1 last


def test_a_job_cancelled_before_it_starts_never_runs():
    lane = FairLane(1, "test")
    ran, gate = [], threading.Event()
    first = lane.submit("a", lambda: gate.wait(10))
    wait_for(lambda: lane.queued("a") == 0, 5, "the first job did not start")
    dropped = lane.submit("a", lambda: ran.append("dropped"))
    last = lane.submit("a", lambda: ran.append("last"))
    assert dropped.cancel()
    gate.set()
    first.result(10)
    last.result(10)
    assert ran == ["last"]


def test_a_job_failing_fails_its_future_alone():
    lane = FairLane(2, "test")
    failing: Future = lane.submit("a", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(10)
    assert lane.submit("a", lambda: 7).result(10) == 7


def test_the_caller_is_the_key_else_the_address():
    keyed = SimpleNamespace(scope={"state": {"cache_tenant": "t1"}, "client": ("10.0.0.1", 5000)})
    plain = SimpleNamespace(scope={"client": ("10.0.0.1", 5001)})
    other_port = SimpleNamespace(scope={"client": ("10.0.0.1", 5002)})
    assert caller_of(keyed) == "key:t1"
    assert caller_of(plain) == caller_of(other_port) != caller_of(keyed)
