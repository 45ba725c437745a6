"""Faults against a real `tandem serve`: kill -9 real worker and cache-service
PIDs mid-request, SIGTERM the server mid-stream, admission limits and auth.
Every client call has a timeout; a hang fails the test instead of the suite.

Three servers: a colocated one and the module's split one serve a float32
random tiny llama with the embedded tokenizer (the faults' machinery is
under test, not the answers' sense: each compares the server with itself,
and a token costs ~1 ms of model instead of ~0.1 s); the guarded one (key,
queue limit) serves the embedded model, whose prefill lasts long enough for
a kill mid-prefill and a queue to form."""

from __future__ import annotations

import glob
import os
import signal
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.support.groups import random_model
from tests.support.server import module_server, pid_alive

QUESTION = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
# A tiny model's stream: long enough to still be decoding when the client has its 4th piece and
# kills (~10 ms a token here, a few on a fast Mac): the request must move (asserted through the metric).
TINY_TOKENS = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_model_dir) -> str:
    """The session's float32 random tiny llama (tests/support/groups.py), the embedded tokenizer."""
    return str(random_model(tmp_path_factory, "tiny-llama", embedded_model_dir))


def client_for(srv, **kw):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=kw.pop("api_key", "unused"),
                         timeout=kw.pop("timeout", 30), max_retries=0, **kw)


def assert_recovers(srv, killed_pid: int) -> None:
    """/health goes 503 while the role is missing, then 200, and serving works again."""
    srv.wait_status(503, timeout=10)
    body = srv.wait_healthy(timeout=90)
    assert killed_pid not in [w["pid"] for w in body["workers"]]
    resp = client_for(srv).chat.completions.create(model="default", messages=QUESTION, max_tokens=5, temperature=0)
    assert resp.usage.completion_tokens == 5


def greedy_stream(srv, messages, max_tokens, timeout=30, api_key="unused"):
    """A greedy chat stream's text pieces, as the client saw them (iterator)."""
    stream = client_for(srv, timeout=timeout, api_key=api_key).chat.completions.create(
        model="default", messages=messages, max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            yield chunk.choices[0].delta.content


def test_kill_decoding_worker_mid_stream_and_the_stream_goes_on(server_factory, tiny):
    """SIGKILL the worker decoding a stream: the stream pauses while the
    supervisor restarts it, then resumes where it was; the client sees the
    same greedy text as an uninterrupted run, no token lost or repeated.
    Colocated here (prefill and decode die together); the split layout's
    decode worker dies in test_chaos_streams_survive_killed_workers."""
    role = "prefill+decode"
    srv = server_factory("--model", tiny, "--colocate")
    expected = "".join(greedy_stream(srv, QUESTION, TINY_TOKENS))
    pid = srv.worker_pid(role)
    pieces = greedy_stream(srv, QUESTION, TINY_TOKENS)
    got = [next(pieces) for _ in range(4)]
    os.kill(pid, signal.SIGKILL)
    got += list(pieces)
    assert "".join(got) == expected
    body = srv.wait_healthy(timeout=90)
    assert pid not in [w["pid"] for w in body["workers"]]
    assert 'tandem_request_moves_total{role="decode"} 1.0' in httpx.get(srv.base_url + "/metrics", timeout=5).text


KEY = "sekrit"


@pytest.fixture(scope="module")
def guarded(request, tmp_path_factory):
    """The embedded model behind an API key, one request decoding and one
    queued at most, prompts prefilled in 16-token chunks (seconds for a few
    hundred tokens here): for the prefill worker killed mid-prefill, the key
    and the queue limit, then SIGTERM's drain, which ends it (one start
    instead of three)."""
    return module_server(request, tmp_path_factory, "--api-key", KEY, "--max-batch", "1", "--max-queue", "1",
                         "--prefill-chunk", "16")


def test_kill_prefill_worker_during_prefill_and_the_prompt_is_prefilled_again(guarded):
    srv = guarded
    pid = srv.worker_pid("prefill")
    long_prompt = [{"role": "user", "content": "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 24}]
    result = {}

    def ask():
        try:
            # The client waits through the restart and the prompt's second prefill.
            result["text"] = "".join(greedy_stream(srv, long_prompt, 5, timeout=90, api_key=KEY))
        except openai.APIError as exc:
            result["error"] = exc

    t = threading.Thread(target=ask)
    t.start()
    # Killed while it prefills (~270 tokens in 16-token chunks: seconds here, and
    # prefilled twice), as its heartbeat says (every 0.5 s), not after a guess at
    # how long that takes.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
            w["pid"] == pid and w["running"] for w in srv.health()[1]["workers"]):
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    t.join(timeout=90)
    assert not t.is_alive(), "request hung after its prefill worker died"
    assert "error" not in result, result
    assert result["text"] == "".join(greedy_stream(srv, long_prompt, 5, api_key=KEY))
    assert 'tandem_request_moves_total{role="prefill"} 1.0' in httpx.get(srv.base_url + "/metrics", timeout=5).text


def test_api_key_and_queue_limit(guarded):
    srv = guarded
    with pytest.raises(openai.AuthenticationError):
        client_for(srv, api_key="wrong").models.list()
    assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 200  # health stays open
    good = client_for(srv, api_key=KEY)
    assert [m.id for m in good.models.list().data] == ["SmolLM2-135M-Instruct"]

    long_prompt = [{"role": "user", "content": "Summarize: " + "lorem ipsum dolor sit amet. " * 24}]
    statuses = []
    lock = threading.Lock()

    def ask():
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "default", "messages": long_prompt, "max_tokens": 2})
        with lock:
            statuses.append((r.status_code, r.headers.get("retry-after"), r.json()))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    codes = sorted(s[0] for s in statuses)
    assert len(codes) == 6 and 200 in codes and 429 in codes, statuses
    for code, retry_after, body in statuses:
        if code == 429:
            assert retry_after is not None and float(retry_after) > 0
            assert "busy" in body["error"]["message"]


def test_sigterm_drains_streams_and_leaves_nothing_behind(guarded):
    """The guarded server's last test (after a restarted prefill worker's and a queue's): SIGTERM ends it."""
    srv = guarded
    children = srv.pids()
    # cache, prefill, decode, router (and multiprocessing's resource tracker)
    assert len(children) >= 4
    stream = client_for(srv, api_key=KEY).chat.completions.create(model="default", messages=QUESTION, max_tokens=24,
                                                                  temperature=0, stream=True)
    it = iter(stream)
    next(it)
    srv.proc.send_signal(signal.SIGTERM)
    rest = list(it)  # the in-flight stream runs to its end
    finish = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert srv.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 15  # the children's last exits (the resource tracker's) may trail
    while time.monotonic() < deadline and any(pid_alive(p) for p in children):
        time.sleep(0.1)
    assert [p for p in children if pid_alive(p)] == []
    if sys.platform.startswith("linux"):
        assert [p for p in glob.glob("/dev/shm/tandem-*") if str(srv.proc.pid) in p] == []


def _holders_of_the_port(srv) -> list[int]:
    """The supervisor's children holding the listening socket (Linux /proc):
    the router, whose socket the supervisor handed it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[1].endswith(f":{srv.port:04X}") and cols[3] == "0A":  # LISTEN
                    inodes.add(f"socket:[{cols[9]}]")
    holders = []
    for pid in srv.pids():
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if links & inodes:
            holders.append(pid)
    return holders


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, tiny):
    """A server of the default flags (the tiny model) for the tests whose
    faults it recovers from, in the file's order: the cache service killed,
    the chaos test's decode worker, then the router and the supervisor (which
    ends it): one start instead of three."""
    return module_server(request, tmp_path_factory, "--model", tiny)


def test_kill_cache_service(server):
    """The cache service killed: the supervisor restarts it and serving goes
    on. The server lives on for the chaos test after it."""
    srv = server
    body = srv.health()[1]
    cache_pid = body["cache_service"]["pid"]
    os.kill(cache_pid, signal.SIGKILL)
    # The supervisor restarts it within a second, usually before the router's next
    # stats call notices the gap, so wait for the new pid rather than a 503.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        code, body = srv.health()
        if code == 200 and body["cache_service"]["pid"] != cache_pid:
            break
        time.sleep(0.1)
    assert code == 200 and body["cache_service"]["pid"] != cache_pid, body
    resp = client_for(srv).chat.completions.create(model="default", messages=QUESTION, max_tokens=5, temperature=0)
    assert resp.usage.completion_tokens == 5
    if sys.platform.startswith("linux"):
        # Only the new arena exists: the dead service's segment was unlinked.
        assert len([p for p in glob.glob("/dev/shm/tandem-*") if str(srv.proc.pid) in p]) == 1


def test_chaos_streams_survive_killed_workers(server):
    """The chaos workload, small: greedy streams while the split layout's
    decode worker is killed with SIGKILL (the prefill worker's death:
    test_kill_prefill_worker_during_prefill_...; many kills: the bench); no
    request fails, every output is the undisturbed run's, and no shared
    memory is left after."""
    import asyncio

    from benchmarks.bench.workloads.chaos import ChaosConfig, arena_segments, chaos
    from benchmarks.bench.workloads.core import Target

    srv = server  # after test_kill_cache_service's fault, recovered from; the router's and supervisor's next
    # The tiny model's streams of 200 tokens: ~2 s here, still decoding at the kill (0.3 s in) on a fast box too.
    cfg = ChaosConfig(streams=4, max_tokens=200, interval_s=0.3, kills=1, timeout_s=120)
    result = asyncio.run(chaos(Target("tandem", srv.base_url, "default"), cfg, srv.proc.pid))
    assert [k["role"] for k in result["kills"]] == ["decode"], result
    assert result["reference_failed"] == 0 and result["failed"] == 0, result["errors"]
    assert result["outputs_differing"] == 0
    assert result["moves"] >= 1
    if sys.platform.startswith("linux"):  # the killed worker's handoffs were given back: one arena, the service's
        assert len(arena_segments(srv.proc.pid)) == 1


def test_a_killed_router_keeps_the_port_then_a_killed_supervisor_leaves_no_child(server):
    """Two faults, the module server's last (after the cache service's and the
    chaos test's). The router killed: the supervisor owns the port
    (deploy/service/listen_socket.py), so a request made while no router runs
    waits in the kernel's backlog and the next router answers it (the client
    retries nothing: max_retries=0). Then the supervisor killed: no child,
    the new router included, outlives it, and no shared memory is left."""
    srv = server
    if sys.platform.startswith("linux"):  # the router found through /proc
        [router] = _holders_of_the_port(srv)
        os.kill(router, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(router) and time.monotonic() < deadline:
            time.sleep(0.01)
        resp = client_for(srv, timeout=120).chat.completions.create(model="default", messages=QUESTION,
                                                                   max_tokens=5, temperature=0)
        assert resp.usage.completion_tokens == 5
        assert _holders_of_the_port(srv) not in ([], [router])
    children = srv.pids()
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(pid_alive(p) for p in children):
        time.sleep(0.2)
    assert [p for p in children if pid_alive(p)] == []
    if sys.platform.startswith("linux"):
        # The cache service stopped cleanly (SIGTERM from its watchdog) and unlinked its arena.
        assert [p for p in glob.glob("/dev/shm/tandem-*") if str(srv.proc.pid) in p] == []
