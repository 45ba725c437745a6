"""The router's HTTP app served by a real uvicorn in a thread (tests of the
API against a scripted engine, tests/support/fake_engine.py)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from environment.settings import Settings
from router.main import uvicorn_config


class ServerThread:
    """uvicorn, configured as the router process configures it, serving `app`
    on a free port of 127.0.0.1, in a thread."""

    def __init__(self, app, settings: Settings):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, settings))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        wait_for(lambda: self.server.started, 15, "uvicorn did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def wait_for(condition, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.01)


def serve_app(engine, tokenizer, **settings) -> ServerThread:
    """The router's app over `engine` (a scripted one) with these settings,
    served in a thread: `with serve_app(engine, tok, api_key=...) as server:`."""
    from router.app import create_app

    config = Settings(model_id=engine.model_id, **settings)
    return ServerThread(create_app(engine, tokenizer, config), config)
