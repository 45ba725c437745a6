"""The router process: the OpenAI-compatible HTTP API under uvicorn.

Owns the tokenizer (router/text/: chat template, detokenizer; no MLX, no
transformers) and the Dispatcher that talks to the workers. SIGTERM or Ctrl-C starts uvicorn's
graceful shutdown: no new connections, in-flight streams get up to
`drain_timeout_s` to finish. A dispatcher loop that ends (it never should)
stops the process with exit code 1, so the supervisor starts a fresh one.

It serves on the listening socket the supervisor hands it (the supervisor
keeps the port open while a router restarts: deploy/service/listen_socket.py);
started without one (tests), uvicorn binds host:port itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
import threading

import uvicorn

from environment.logs import setup_logging
from environment.model_folder import context_length
from environment.settings import Settings
from router.app import create_app
from router.models.control import ModelControl
from router.models.pool import ModelPool
from router.models.served import ServedModel
from router.routing.dispatcher import Dispatcher
from router.guards.slow_clients import BodyDeadline, client_deadline_protocol

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0  # how often the dispatcher's loops are checked
EXIT_BACKSTOP_S = 10.0  # after a dead loop, past the drain: the process exits even if shutdown hangs
# Each client connection is a file descriptor: the usual soft limit (1024, 256
# on macOS) would refuse clients long before memory or the queue does.
OPEN_FILES = 65536


def uvicorn_config(app, settings: Settings) -> uvicorn.Config:
    """No limit_concurrency: uvicorn would count idle keep-alive connections and
    answer past it with a plain-text 503; admission (max_queue, 429 with
    Retry-After) bounds the work, the client deadline and keep-alive how long a
    connection that sends nothing is kept."""
    return uvicorn.Config(
        BodyDeadline(app, settings.client_timeout_s),
        http=client_deadline_protocol(settings.client_timeout_s),
        host=settings.host,
        port=settings.port,
        log_level="warning" if settings.log_level == "info" else settings.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        timeout_keep_alive=max(1, round(settings.keep_alive_s)),
        lifespan="off",
    )


def raise_open_files_limit(wanted: int = OPEN_FILES) -> None:
    """The soft limit on open files up to `wanted`, within the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    for limit in (target, 10240):  # macOS refuses more than its per-process maximum (OPEN_MAX 10240)
        if soft >= limit:
            return
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            return
        except (ValueError, OSError):
            continue


async def watch_loops(dispatcher, server: uvicorn.Server, exit_backstop_s: float | None,
                      interval_s: float = WATCH_INTERVAL_S) -> list[str]:
    """Until one of the dispatcher's background loops ends (a bug no handler
    caught: without its receive loop the router hears no worker again), then
    stop serving and return their names. Without the receive loop no stream
    gets another token: no drain then; otherwise in-flight streams may finish.
    `exit_backstop_s`: the process exits (code 1) this long after, whatever hangs."""
    while True:
        await asyncio.sleep(interval_s)
        dead = dispatcher.dead_loops()
        if dead:
            break
    log.error("dispatcher loop%s %s ended; stopping the router so that the supervisor restarts it",
              "s" if len(dead) > 1 else "", ", ".join(dead))
    server.should_exit = True
    server.force_exit = "receive" in dead
    if exit_backstop_s is not None:
        backstop = threading.Timer(exit_backstop_s, os._exit, args=(1,))
        backstop.daemon = True
        backstop.start()
    return dead


async def serve(dispatcher: Dispatcher, server: uvicorn.Server, exit_backstop_s: float | None = None,
                interval_s: float = WATCH_INTERVAL_S, sockets: list | None = None,
                models: ModelPool | None = None) -> list[str]:
    """Serve until shutdown (on `sockets` when given, else on the config's
    host:port); returns the dispatcher loops that ended, if that is why.
    `models`: the pool of other models, started and stopped with it."""
    await dispatcher.start()
    if models is not None:
        await models.start()
    watched = _Watched(dispatcher, models)
    watchdog = asyncio.create_task(watch_loops(watched, server, exit_backstop_s, interval_s))
    try:
        await server.serve(sockets=sockets)
    finally:
        watchdog.cancel()  # a no-op if it ended the serving
        outcome = (await asyncio.gather(watchdog, return_exceptions=True))[0]
        if models is not None:
            await models.stop()
        await dispatcher.stop()
    return outcome if isinstance(outcome, list) else []


class _Watched:
    """The server's own dispatcher's loops and the pool's, as one."""

    def __init__(self, dispatcher: Dispatcher, models: ModelPool | None):
        self.dispatcher, self.models = dispatcher, models

    def dead_loops(self) -> list[str]:
        return self.dispatcher.dead_loops() + (self.models.dead_loops() if self.models is not None else [])


def run(settings: Settings, sockets: list | None = None) -> None:
    """Process main for the router (a `spawn` target); `sockets`: the
    supervisor's listening sockets, passed through multiprocessing."""
    setup_logging(settings.log_level, "router")
    raise_open_files_limit()
    dispatcher = Dispatcher(settings, max_context=context_length(settings.model_dir))
    served = ServedModel.load(dispatcher, settings.model_dir)
    models = ModelPool(settings, served, ModelControl(settings))
    app = create_app(dispatcher, served.tokenizer, settings, models)
    server = uvicorn.Server(uvicorn_config(app, settings))
    dead = asyncio.run(serve(dispatcher, server, settings.drain_timeout_s + EXIT_BACKSTOP_S, sockets=sockets,
                             models=models))
    if dead:
        sys.exit(1)
    log.info("router stopped")
