"""Slow clients (router/guards/slow_clients.py), as the attacks: a slowloris that sends
a header byte at a time for ever, one that sends its headers and then
trickles the body, one that connects and sends nothing. Each must be cut off
near the deadline (here 1 s; the bounds below are generous) while a normal
client on another connection is served; and what must not be cut: an idle
kept-alive connection (keep-alive governs it) and a stream that outlasts the
deadline. Raw sockets against the router's app under real uvicorn, configured
as the router process configures it, over the scripted engine."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from router.guards.slow_clients import BODY_GRACE_S
from tests.support.fake_engine import FakeEngine
from tests.support.router_server import serve_app

DEADLINE_S = 1.0
CUT_WITHIN_S = DEADLINE_S + BODY_GRACE_S + 5.0  # deadline + slack, generous for a busy 2-core box
CHAT = json.dumps({"model": "tandem-test", "messages": [{"role": "user", "content": "Say hello"}]}).encode()


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with serve_app(engine, tokenizer, client_timeout_s=DEADLINE_S, request_timeout_s=30) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh_engine(engine):
    engine.reset()
    engine.say("Hello world.")


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=CUT_WITHIN_S + 5)
    return sock


def _head(path: str, length: int, host: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _trickle(sock: socket.socket, data: bytes, stop: threading.Event, every_s: float = 0.2) -> None:
    """Send `data` a byte at a time until told to stop or the server closes."""
    for i in range(len(data)):
        if stop.wait(every_s):
            return
        try:
            sock.sendall(data[i:i + 1])
        except OSError:
            return


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and when it closed."""
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return out, time.monotonic()
        out += chunk


def _read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length, the connection left open."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += sock.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _served_meanwhile(server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", content=CHAT,
                   headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world."


def test_a_slowloris_is_cut_off_with_a_408_while_others_are_served(server):
    sock = _connect(server)
    stop = threading.Event()
    start = time.monotonic()
    header_bytes = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 1000
    feeder = threading.Thread(target=_trickle, args=(sock, header_bytes, stop), daemon=True)
    feeder.start()
    try:
        _served_meanwhile(server)
        answer, closed_at = _read_until_closed(sock)
    finally:
        stop.set()
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert DEADLINE_S * 0.9 <= closed_at - start < CUT_WITHIN_S


def test_a_client_that_sends_nothing_is_cut_off(server):
    sock = _connect(server)
    start = time.monotonic()
    try:
        answer, closed_at = _read_until_closed(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and closed_at - start < CUT_WITHIN_S


@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")])
def test_a_trickled_body_gets_a_408_in_the_apis_shape(server, engine, path, shape):
    sock = _connect(server)
    stop = threading.Event()
    start = time.monotonic()
    sock.sendall(_head(path, len(CHAT), f"127.0.0.1:{server.port}"))
    feeder = threading.Thread(target=_trickle, args=(sock, CHAT, stop), daemon=True)
    feeder.start()
    try:
        _served_meanwhile(server)
        answer, closed_at = _read_until_closed(sock)
    finally:
        stop.set()
        sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and closed_at - start < CUT_WITHIN_S
    error = json.loads(body)
    if shape == "openai":
        assert error["error"]["code"] == "request_timeout" and "not received" in error["error"]["message"]
    else:
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert len(engine.requests) == 1  # only the normal client's request reached the engine


def test_a_body_the_app_never_reads_still_ends_the_connection(server):
    """GET /v1/models answers at once; the trickled body behind it cannot hold the connection."""
    sock = _connect(server)
    stop = threading.Event()
    start = time.monotonic()
    sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Length: 500\r\n\r\n".encode())
    threading.Thread(target=_trickle, args=(sock, b"x" * 500, stop), daemon=True).start()
    try:
        answer, closed_at = _read_until_closed(sock)
    finally:
        stop.set()
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200 ") and closed_at - start < CUT_WITHIN_S


def test_a_kept_alive_connection_is_not_cut_when_idle_but_its_next_slow_request_is(server):
    sock = _connect(server)
    try:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode())
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(DEADLINE_S * 1.5)  # idle between requests: keep-alive's (75 s), not the client deadline
        start = time.monotonic()
        sock.sendall(b"GET /hea")  # the next request, begun and never finished
        answer, closed_at = _read_until_closed(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and closed_at - start < CUT_WITHIN_S


def test_a_stream_longer_than_the_deadline_is_not_cut(server, engine):
    engine.token_delay_s = DEADLINE_S / 2  # "Hello world." is a few tokens: longer than the deadline
    body = {"model": "tandem-test", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}
    start = time.monotonic()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert time.monotonic() - start > DEADLINE_S
    text = "".join((json.loads(line[5:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                   for line in lines[:-1])
    assert text == "Hello world."
