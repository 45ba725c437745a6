"""The router process's watchdog (router/main.py): a dispatcher loop that
ends (a bug no handler caught) must stop the router, so that the process exits
non-zero and the supervisor starts a fresh one, instead of serving on, deaf
to its workers. A real Dispatcher on ZeroMQ and real uvicorn; the loop is
ended from outside, as an uncaught exception would end it."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from environment.settings import Settings
from router.routing.dispatcher import Dispatcher
from router.main import serve, uvicorn_config


async def _pong(request):
    return PlainTextResponse("pong")


@pytest.fixture
def settings():
    run_dir = tempfile.mkdtemp(prefix="trm-")  # short: ipc paths are limited to ~100 bytes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield Settings(run_dir=run_dir, port=port, drain_timeout_s=1.0, model_id="m")
    shutil.rmtree(run_dir, ignore_errors=True)


async def _serving(settings: Settings):
    dispatcher = Dispatcher(settings, max_context=1024)
    server = uvicorn.Server(uvicorn_config(Starlette(routes=[Route("/ping", _pong)]), settings))
    task = asyncio.create_task(serve(dispatcher, server, interval_s=0.05))
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline and not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://127.0.0.1:{settings.port}/ping")).text == "pong"
    return dispatcher, server, task


@pytest.mark.parametrize("loop, index, drains", [("receive", 0, False), ("cache", 2, True)])
def test_a_dead_dispatcher_loop_stops_the_router(settings, loop, index, drains):
    async def main():
        dispatcher, server, serving = await _serving(settings)
        dispatcher._tasks[index].cancel()  # the loop ends, as an uncaught exception would end it
        dead = await asyncio.wait_for(serving, 15)
        assert dead == [loop]
        assert server.force_exit is not drains  # no drain without the receive loop: no stream gets a token

    asyncio.run(main())


def test_a_router_asked_to_stop_reports_no_dead_loop(settings):
    async def main():
        _, server, serving = await _serving(settings)
        server.should_exit = True
        assert await asyncio.wait_for(serving, 15) == []

    asyncio.run(main())
