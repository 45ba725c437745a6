"""The router's dispatcher on real ZeroMQ sockets, with workers the test scripts."""

from __future__ import annotations

import asyncio
import tempfile
import time

import zmq
import zmq.asyncio

from environment.settings import Settings
from protos import transport
from protos.messages import SamplingParams, WorkerHello, WorkerLimits
from router.routing.dispatcher import Dispatcher
from router.routing.engine_api import GenerationRequest


class ScriptedWorker:
    """A DEALER that speaks the worker protocol as the test tells it to."""

    def __init__(self, ctx, settings, wid, roles):
        self.hello = WorkerHello(wid, roles, pid=1000 + len(wid), state="ready")
        self.sock = transport.make_socket(ctx, zmq.DEALER, identity=wid)
        self.sock.connect(transport.ipc_address(settings.run_dir, "router"))
        self.limits: list[WorkerLimits] = []  # what the power policy sent it

    async def beat(self):
        await transport.asend(self.sock, self.hello)

    async def next(self, timeout=5.0):
        """The next message other than WorkerLimits, which it applies as a
        worker does: its heartbeats echo the version from then on."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            assert await self.sock.poll(int(left * 1000)), "nothing arrived"
            msg = await transport.arecv(self.sock)
            if not isinstance(msg, WorkerLimits):
                return msg
            self.limits.append(msg)
            self.hello.limits_version = msg.version

    async def silent_for(self, seconds: float) -> bool:
        """True when nothing but WorkerLimits arrives within `seconds`."""
        deadline = time.monotonic() + seconds
        while await self.sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            msg = await transport.arecv(self.sock)
            if not isinstance(msg, WorkerLimits):
                return False
            self.limits.append(msg)
            self.hello.limits_version = msg.version
        return True


def run(coro_fn, **overrides):
    """Run `coro_fn(dispatcher, worker)` against a started Dispatcher, where
    `worker(wid, roles)` makes a ScriptedWorker; Settings take `overrides`.
    A worker is dropped after 5 s of silence, so one that beat once stays
    through an event-loop stall on a loaded box; a test of a silent worker
    being dropped passes a small heartbeat_timeout_s."""
    async def main(tmp):
        settings = Settings(**{"run_dir": tmp, "heartbeat_interval_s": 0.05, "heartbeat_timeout_s": 5.0,
                               "model_id": "m", "cache_call_timeout_s": 0.2, **overrides})
        disp = Dispatcher(settings, max_context=1024)
        await disp.start()
        ctx = zmq.asyncio.Context()
        try:
            await coro_fn(disp, lambda wid, roles: ScriptedWorker(ctx, settings, wid, roles))
        finally:
            await disp.stop()
            ctx.destroy(linger=0)

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(capped(main(tmp), RUN_CAP_S))


RUN_CAP_S = 30.0


async def capped(coro, seconds: float):
    """`coro`'s result, or an AssertionError after `seconds` that says where
    every task still stood (a test stuck in the dispatcher's stop, say,
    names the loop that did not end)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if done:
        return task.result()
    here = asyncio.current_task()
    where = [f"{t.get_name()} {t.get_coro().__qualname__}: "
             + " <- ".join(f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}" for f in t.get_stack())
             for t in asyncio.all_tasks() if t is not here]
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    raise AssertionError(f"the scripted run did not end within {seconds:g} s; tasks then:\n" + "\n".join(where))


async def wait_for(pred, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


def request(rid="r1", n=3):
    return GenerationRequest(rid, [1, 2, 3], SamplingParams(max_tokens=n, temperature=0.0))
