"""Start a real `tandem serve` for end-to-end tests and take it down cleanly.

The server runs as the user runs it: `python -m deploy.cli serve ...` in its
own process group, on a free loopback port. Every wait has a deadline.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except ProcessLookupError:  # reaped between the open and the read (ESRCH)
        return False
    except FileNotFoundError:
        return sys.platform == "darwin"


def metric(srv: "TandemServer", name: str, labels: str = "") -> float:
    """One sample of the server's /metrics page: `name` with exactly
    `labels` (e.g. '{path="referenced"}'); fails the test when absent."""
    text = httpx.get(srv.base_url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


class TandemServer:
    def __init__(self, *args: str, log_path: Path | None = None, env: dict | None = None, warm_up: bool = False):
        self.port = free_port()
        if not warm_up and "--no-warm-up" not in args:
            # On the CPU the warm-up costs 2-4 s a start and the first request
            # no less without it (measured: 14.0/11.2 s against 10.0/9.5 s to
            # healthy, 1.8-1.9 s against 1.6 s for the first answer): tests
            # start ~25 servers. The warm-up has its own tests (tests/workers/test_warm_up.py)
            # and runs in every server the bench tests start.
            args = (*args, "--no-warm-up")
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.own_cache_dir = None
        if "--cache-dir" not in args and "--no-disk-cache" not in args:
            # Never touch the user's KV disk tier from a test.
            self.own_cache_dir = tempfile.mkdtemp(prefix="tandem-kv-")
            args = (*args, "--cache-dir", self.own_cache_dir)
        self.args = ["--port", str(self.port), *args]
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.child_pids: list[int] = []

    def start(self, timeout: float = 120.0) -> "TandemServer":
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", *self.args],
                                     stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.wait_healthy(timeout)
        self.child_pids = self.pids()
        return self

    def health(self) -> tuple[int, dict]:
        """(status, body) of /health; (0, {}) when nothing answers. 10 s: a test's
        probe mid-stream on a loaded 2-core box waited 3.7 s for its answer (2 s
        read it as no answer at all); a server not yet listening refuses at once."""
        try:
            r = httpx.get(self.base_url + "/health", timeout=10.0)
            return r.status_code, r.json()
        except (httpx.HTTPError, ValueError):
            return 0, {}

    def wait_healthy(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode}; log: {self.log_tail()}")
            code, body = self.health()
            if code == 200:
                return body
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout}s: {self.health()}; log: {self.log_tail()}")

    def wait_status(self, status: int, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code, body = self.health()
            if code == status:
                return body
            time.sleep(0.1)
        raise TimeoutError(f"/health never returned {status}: {self.health()}")

    def pids(self) -> list[int]:
        """Every child of the supervisor (router, workers, cache service)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def worker_pid(self, role: str) -> int:
        _, body = self.health()
        return next(w["pid"] for w in body["workers"] if w["role"] == role)

    def log_tail(self, n: int = 4000) -> str:
        if not self.log_path or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the supervisor; wait for it and every child to be gone."""
        try:
            return self._stop(timeout)
        finally:
            if self.own_cache_dir:
                shutil.rmtree(self.own_cache_dir, ignore_errors=True)

    def _stop(self, timeout: float) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        pids = self.pids()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(timeout=10)
            raise
        return self.proc.returncode

    def __enter__(self) -> "TandemServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def module_server(request, tmp_path_factory, *args: str, warm_up: bool = False) -> TandemServer:
    """A server shared by one test module (set-up costs seconds; most tests
    only read), from a module-scoped fixture; stopped when the module ends."""
    srv = TandemServer(*args, log_path=tmp_path_factory.mktemp("srv") / "server.log", warm_up=warm_up)
    request.addfinalizer(srv.stop)
    return srv.start()
