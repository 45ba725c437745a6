"""The supervisor owns the HTTP port (deploy/service/listen_socket.py), on a
real supervisor process whose router is a stub: a tiny uvicorn app served on
the socket the supervisor hands it through multiprocessing's spawn. No model.

- a request sent while the router is dead waits in the backlog and is answered
  by the next router (before, it was refused);
- a port in use fails the start at once, exit 1, no child started;
- restarts running out: exit 1 (launchd's KeepAlive and systemd's
  Restart=on-failure restart the service on it);
- systemd's socket handoff for real: systemd-socket-activate passes the port
  as LISTEN_FDS exactly as systemd does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server import free_port, pid_alive

REPO = Path(__file__).resolve().parents[2]

SUPERVISOR = textwrap.dedent("""
    import signal, sys
    from deploy import supervisor as sup
    from environment.logs import setup_logging
    from environment.settings import Settings

    port, gate, router, max_restarts = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])

    class StubRouter(sup.Supervisor):
        def _plan(self):
            self.children.append(sup.Child("router", router, lambda: (gate, self.listeners.sockets)))

    setup_logging("info", "supervisor")
    sup.MAX_RESTARTS = max_restarts
    supervisor = StubRouter(Settings(model_id="m", host="127.0.0.1", port=port, drain_timeout_s=1.0))
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    sys.exit(supervisor.run())
""")
STUB_ROUTER = "tests.deploy.test_supervisor_socket:stub_router"


def stub_router(gate: str, sockets: list) -> None:
    """The router's side of the handoff (a spawn child): once the gate file
    exists, serve {pid, LISTEN_FDS} on the supervisor's sockets, as
    router/main.py serves the API (uvicorn's serve(sockets=...))."""
    import uvicorn

    while not os.path.exists(gate):
        time.sleep(0.02)

    async def app(scope, receive, send):
        body = json.dumps({"pid": os.getpid(), "listen_fds": os.environ.get("LISTEN_FDS")}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning")).run(sockets=sockets)


def fail_at_once(gate: str, sockets: list) -> None:
    os._exit(1)


def _start(tmp_path: Path, port: int, router: str = STUB_ROUTER, max_restarts: int = 5,
           prefix: tuple = ()) -> tuple[subprocess.Popen, Path]:
    gate = tmp_path / "gate"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = [*prefix, sys.executable, "-c", SUPERVISOR, str(port), str(gate), router, str(max_restarts)]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    return proc, gate


def _get(port: int, timeout: float = 60.0) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/", timeout=timeout).json()


def _first_answer(port: int, proc: subprocess.Popen) -> dict:
    """The first answer once the port is open (the supervisor, or systemd's
    tool, takes a moment to start listening)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            return _get(port)
        except httpx.ConnectError:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
    raise AssertionError(f"nothing listened on port {port}")


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
    return proc.returncode, err


def test_a_request_sent_while_the_router_is_down_is_answered_by_the_next_router(tmp_path):
    port = free_port()
    proc, gate = _start(tmp_path, port)
    try:
        gate.touch()
        first = _first_answer(port, proc)["pid"]
        gate.unlink()  # the next router waits before serving: the port has no server meanwhile
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(first) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not pid_alive(first)
        answers, errors = [], []

        def ask():
            try:
                answers.append(_get(port))
            except httpx.HTTPError as exc:  # a refused connection would land here at once
                errors.append(exc)

        asker = threading.Thread(target=ask)
        asker.start()
        asker.join(timeout=1.0)
        assert errors == [] and asker.is_alive(), "the request did not wait for the next router"
        gate.touch()
        asker.join(timeout=60)
        assert errors == [] and len(answers) == 1
        assert answers[0]["pid"] not in (first, proc.pid)
    finally:
        gate.touch()
        code, err = _stop(proc)
    assert code == 0, err


def test_a_port_in_use_fails_the_start_at_once_and_starts_no_child(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc, _ = _start(tmp_path, taken.getsockname()[1])
        code, err = _stop_when_exited(proc)
    assert code == 1
    assert "already in use" in err and "--port" in err
    assert "started router" not in err


def test_restarts_running_out_exit_non_zero(tmp_path):
    proc, _ = _start(tmp_path, free_port(), router="tests.deploy.test_supervisor_socket:fail_at_once", max_restarts=1)
    code, err = _stop_when_exited(proc)
    assert code == 1
    assert "router died 2 times" in err


def _stop_when_exited(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        return _stop(proc)
    return proc.returncode, err


ACTIVATE = shutil.which("systemd-socket-activate")


@pytest.mark.skipif(ACTIVATE is None, reason="systemd-socket-activate (systemd's own handoff tool) is not installed")
def test_systemd_socket_activation_hands_the_port_to_the_supervisor(tmp_path):
    """systemd-socket-activate binds the port, waits for a connection, then
    execs the supervisor with the socket as fd 3, LISTEN_FDS=1 and LISTEN_PID
    its own pid: what systemd does for a .socket unit. Had the supervisor
    bound the port itself, that port being taken, it would exit 1."""
    port = free_port()
    proc, gate = _start(tmp_path, port, prefix=(ACTIVATE, "-l", f"127.0.0.1:{port}"))
    gate.touch()
    try:
        answer = _first_answer(port, proc)
        assert answer["listen_fds"] is None  # taken by the supervisor, not left to its children
    finally:
        code, err = _stop(proc)
    assert code == 0, err
    assert f"127.0.0.1:{port} (systemd;" in err


def test_tandem_serve_exits_non_zero_when_it_gives_up_before_serving(tmp_path, embedded_model_dir):
    """The real CLI: a model not found (2), the port in use (1, no child
    started). launchd's KeepAlive {SuccessfulExit: false} and systemd's
    Restart=on-failure restart only on such codes; 0 is a requested stop
    (test_supervisor_cleanup.py)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cli = [sys.executable, "-m", "deploy.cli", "serve", "--no-disk-cache"]
    missing = subprocess.run([*cli, "--model", str(tmp_path / "no-such-model")], capture_output=True, text=True,
                             timeout=120, cwd=REPO, env=env)
    assert missing.returncode == 2 and "no-such-model" in missing.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = subprocess.run([*cli, "--port", str(taken.getsockname()[1])], capture_output=True, text=True,
                              timeout=120, cwd=REPO, env=env)
    assert busy.returncode == 1 and "already in use" in busy.stderr
    assert "started " not in busy.stderr
