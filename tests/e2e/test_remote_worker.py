"""A worker of "another host" on localhost: `tandem serve --worker-listen
tcp://... --worker-keys DIR` and `tandem worker --connect ... --role colocated`,
real processes over ZeroMQ tcp with CURVE. The remote worker serves streamed
chats (the router's own worker stopped, so nobody else can) with the same
greedy tokens as the local one (mlx-lm's), a request moves when it is killed, and its
restart comes back under its old id; workers with a key the router does not
know, or the wrong router key, never join. A remote `--role prefill` worker
serves a split router whose own prefill worker is stopped: the prompt's KV
comes to this host's decode worker by value, over the socket, and the greedy
answer is mlx-lm's. Every wait has a deadline.

The servers and workers serve a float32 random tiny llama with the embedded
tokenizer: what is under test is where the work runs and what crosses the
socket, which the tokens show as well whatever they mean (~1 ms of model a
token instead of ~0.1 s, and a smaller load for every start)."""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import zmq

from deploy import keys_cmd
from protos import transport
from protos.messages import WorkerHello
from tests.support.embedded_chat import reference
from tests.support.groups import random_model
from tests.support.server import free_port, module_server, pid_alive
from workers.socket_loop import SocketLoop

QUESTION = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
# Long enough that the stream still decodes when the remote worker dies after its 3rd piece
# (~10 ms a token here, a few on a fast Mac): the move is asserted.
TOKENS = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_model_dir) -> str:
    """The session's float32 random tiny llama (tests/support/groups.py), the embedded tokenizer."""
    return str(random_model(tmp_path_factory, "tiny-llama", embedded_model_dir))


@pytest.fixture(scope="module")
def local_text(tiny) -> str:
    """mlx-lm's greedy answer to QUESTION on the tiny model, as a chat answer
    is sent (its leading space left out, as mlx_lm.server's detokenizer does)."""
    from workers.models.loading import load_model

    return reference(load_model(tiny), QUESTION, TOKENS)[1].lstrip()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Our keys (router + worker "mac2") and another set's ("stranger", its own router)."""
    base = tmp_path_factory.mktemp("keys")
    for out, name in (("ours", "mac2"), ("theirs", "stranger")):
        assert keys_cmd.run(argparse.Namespace(out=str(base / out), name=[name], force=False)) == 0
    return base


@pytest.fixture(scope="module")
def listen():
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def srv(request, tmp_path_factory, keys, listen, tiny):
    return module_server(request, tmp_path_factory, "--model", tiny, "--colocate", "--no-disk-cache",
                         "--worker-listen", listen, "--worker-keys", str(keys / "ours" / "router"))


class RemoteWorker:
    """`tandem worker` in its own process group, its log in a file."""

    def __init__(self, listen: str, keys_dir, log_path, *flags: str):
        self.args = [sys.executable, "-m", "deploy.cli", "worker", "--connect", listen, "--keys", str(keys_dir),
                     "--no-warm-up", "--no-disk-cache", "--join-timeout", "2", *flags]
        self.log_path = log_path
        self.proc = None

    def start(self) -> "RemoteWorker":
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def stop(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            raise


def workers(srv) -> dict:
    return {w["id"]: w for w in srv.health()[1].get("workers", [])}


def wait_workers(srv, pred, what: str, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ws = workers(srv)
        if pred(ws):
            return ws
        time.sleep(0.2)
    raise AssertionError(f"never {what}: {workers(srv)}; server log: {srv.log_tail()}")


def greedy_stream(srv, timeout=90):
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", timeout=timeout, max_retries=0)
    stream = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=TOKENS, temperature=0,
                                            stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            yield chunk.choices[0].delta.content


def try_to_join(listen: str, tries: dict, seconds: float, caplog) -> list[str]:
    """Real worker socket loops, {worker id: its CURVE keys}, all at once for
    `seconds`: none may be answered; the errors they logged."""
    ctxs = [zmq.Context() for _ in tries]  # one each: a loop binds its context's inproc outbox
    loops = [SocketLoop(ctx, listen, WorkerHello(wid, ["prefill", "decode"], os.getpid(), "ready", kv_host="x"),
                        0.2, curve=curve, join_timeout_s=1.0) for ctx, (wid, curve) in zip(ctxs, tries.items())]
    deadline = time.monotonic() + seconds
    with caplog.at_level(logging.ERROR, logger="workers.socket_loop"):
        for loop in loops:
            loop.start()
        answered = []
        for loop in loops:
            try:
                answered.append(loop.inbox.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                pass
        for loop in loops:
            loop.stopping.set()
            loop.join(timeout=5)
    for ctx in ctxs:
        ctx.destroy(linger=0)
    assert not answered and not any(loop.joined for loop in loops), answered
    return [r.getMessage() for r in caplog.records if r.name == "workers.socket_loop"]


def test_workers_with_unknown_keys_or_the_wrong_router_key_never_join(srv, keys, listen, caplog):
    mine = transport.worker_keys(str(keys / "ours" / "mac2"))
    stranger = transport.worker_keys(str(keys / "theirs" / "stranger"))
    errors = try_to_join(listen, {"remote-stranger-0": (*stranger[:2], mine[2]),  # a key it does not know
                                  "remote-wrong-router-0": (*mine[:2], stranger[2])},  # another router's key
                         2.5, caplog)
    assert sum(f"no answer from the router at {listen}" in e and "keys" in e for e in errors) >= 2, errors
    assert not {"remote-stranger-0", "remote-wrong-router-0"} & set(workers(srv))
    log = srv.log_path.read_text(errors="replace")
    assert f"refused a remote worker from 127.0.0.1: its public key {stranger[0].decode()}" in log
    assert mine[0].decode() not in log  # the wrong-router worker never got as far as the key check


def test_a_remote_worker_serves_and_its_requests_survive_its_death(srv, keys, listen, tmp_path, tiny, local_text):
    """local_text: what the router's own worker answers (mlx-lm's greedy answer:
    tests/e2e/test_e2e_pipeline.py)."""
    local_pid = next(w["pid"] for w in workers(srv).values() if "kv_host" not in w)
    remote = RemoteWorker(listen, keys / "ours" / "mac2", tmp_path / "worker.log", "--model", tiny).start()
    try:
        ws = wait_workers(srv, lambda ws: any(w.get("kv_host") and w["state"] == "ready" for w in ws.values()),
                          "a ready remote worker")
        rid, remote_w = next((i, w) for i, w in ws.items() if w.get("kv_host"))
        assert rid.startswith("remote-") and rid.endswith("-0") and remote_w["role"] == "prefill+decode"
        os.kill(local_pid, signal.SIGSTOP)  # silent: the router drops it, and only the remote one is left
        try:
            wait_workers(srv, lambda ws: set(ws) == {rid}, "the local worker dropped")
            assert "".join(greedy_stream(srv)) == local_text  # served by the remote worker: nobody else could
            pieces = greedy_stream(srv)
            got = [next(pieces) for _ in range(3)]
            os.kill(remote_w["pid"], signal.SIGKILL)  # `tandem worker` restarts it; the stream waits for it
            got += list(pieces)
            assert "".join(got) == local_text
            ws = wait_workers(srv, lambda ws: rid in ws and ws[rid]["pid"] != remote_w["pid"], "the remote back")
            assert set(ws) == {rid}  # the same id over tcp after its restart
            moves = httpx.get(srv.base_url + "/metrics", timeout=10).text
            assert 'tandem_request_moves_total{role="decode"} 1.0' in moves
        finally:
            os.kill(local_pid, signal.SIGCONT)
    finally:
        code = remote.stop()
    assert code == 0, (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
    assert not pid_alive(remote_w["pid"])
    text = (tmp_path / "worker.log").read_text(errors="replace")
    assert "joined the router at " + listen in text
    wait_workers(srv, lambda ws: rid not in ws, "the stopped remote worker gone", timeout=15)


def test_a_remote_prefill_worker_hands_its_kv_to_this_hosts_decoder_by_value(request, tmp_path_factory, keys,
                                                                              tiny, local_text, tmp_path):
    listen = f"tcp://127.0.0.1:{free_port()}"
    # Started first: it loads its model while the server starts, and joins once the router listens
    # (a join timeout longer than that start, so it logs no "no answer" error meanwhile).
    remote = RemoteWorker(listen, keys / "ours" / "mac2", tmp_path / "worker.log", "--model", tiny, "--role",
                          "prefill", "--join-timeout", "60").start()
    request.addfinalizer(lambda: remote.proc.poll() is not None or os.killpg(remote.proc.pid, signal.SIGKILL))
    split = module_server(request, tmp_path_factory, "--model", tiny, "--no-disk-cache", "--worker-listen", listen,
                          "--worker-keys", str(keys / "ours" / "router"))
    try:
        # Both ready before either is told apart: on a loaded box the remote one may join before this
        # host's prefill-0 (which was then not yet in the table to be dropped, and the remote one was).
        ws = wait_workers(split, lambda ws: ws.get("prefill-0", {}).get("state") == "ready" and any(
            w.get("kv_host") and w["state"] == "ready" for w in ws.values()), "a ready remote and local prefill worker")
        local_prefill = ws["prefill-0"]["pid"]
        rid, remote_w = next((i, w) for i, w in ws.items() if w.get("kv_host"))
        assert remote_w["role"] == "prefill" and remote_w["kv_host"] == rid  # its own cache service's KV
        os.kill(local_prefill, signal.SIGSTOP)  # the router drops it: only the remote one prefills
        try:
            wait_workers(split, lambda ws: "prefill-0" not in ws, "the local prefill worker dropped")
            assert "".join(greedy_stream(split)) == local_text
            sent = [line for line in httpx.get(split.base_url + "/metrics", timeout=10).text.splitlines()
                    if line.startswith('tandem_kv_handoff_tokens_total{path="sent"}')]
            assert sent and float(sent[0].split()[-1]) > 0, sent  # the prompt's KV came in the message
        finally:
            os.kill(local_prefill, signal.SIGCONT)
    finally:
        code = remote.stop()
    assert code == 0, (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
