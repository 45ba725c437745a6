"""Clients that stop reading (router/guards/slow_clients.py, the write deadline),
as the attack: more streams than the router has places, whose clients never
read a byte of them. Each must be cancelled once it has not taken its bytes
for --client-timeout: its place comes back (tandem_requests_admitted to 0),
its engine request is cancelled, /metrics counts it, and new requests are
served. Raw sockets against the router's app under real uvicorn, configured
as the router process configures it, over the scripted engine.

The buffers between the engine and a client that does not read must fill
before uvicorn pauses the writes: the client's receive buffer and the
server's send buffer are made small (accepted sockets inherit the listening
socket's), and the answer is long."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest

from tests.support.fake_engine import FakeEngine
from tests.support.router_server import serve_app, wait_for

DEADLINE_S = 0.5
SMALL = dict(max_batch=1, decode_workers=1, max_queue=2, client_timeout_s=DEADLINE_S, request_timeout_s=30)
PLACES = 3  # 1 decode row + 2 queued
SMALL_BUFFER = 4096
CHAT = {"model": "tandem-test", "messages": [{"role": "user", "content": "Say hello"}]}


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer, max_context=1 << 16)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    running = serve_app(engine, tokenizer, **SMALL)
    running.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
    with running:
        yield running


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def open_unread(server, path: str, body: dict) -> socket.socket:
    """A request whose client never reads its answer (and keeps the socket open)."""
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)  # before connecting: the window
    conn.connect(("127.0.0.1", server.port))
    data = json.dumps(body)
    conn.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return conn


def test_streams_whose_clients_never_read_give_their_places_back(server, engine):
    engine.reset()
    engine.say("the quick brown fox jumps over the lazy dog; " * 1500)  # far more than the buffers hold
    timeouts_before = metric(server, "tandem_client_write_timeouts_total")
    unread = [open_unread(server, "/v1/chat/completions", CHAT | {"stream": True})
              for _ in range(PLACES + 2)]  # past the places: two get 429
    try:
        wait_for(lambda: len(engine.requests) == PLACES, 10, "the streams were not admitted")
        wait_for(lambda: metric(server, "tandem_client_write_timeouts_total") == timeouts_before + PLACES, 20,
                 "the unread streams were not closed")
        wait_for(lambda: metric(server, "tandem_requests_admitted") == 0, 10, "the unread streams kept their places")
        wait_for(lambda: len(engine.cancelled) == PLACES, 10, "the engine's requests were not cancelled")
        assert not engine.finished
        engine.say("Hello world.")
        answer = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10)  # the others are served
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "Hello world."
    finally:
        for conn in unread:
            conn.close()
