"""The model pool's policy (router/models/pool.py) with the supervisor and the
workers as stand-ins (a control that records loads and unloads, engines that
are ready when told): leases keep a model loaded, the least recently used
idle model makes room, a busy one is waited for within the deadline, a load
that fails fails its requests with the supervisor's reason, keep-alive and
memory pressure unload idle models. The end-to-end side (real supervisor,
real workers) is tests/e2e/test_many_models.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from environment.settings import Settings
from protos.model_messages import ModelSlot
from router.api.errors import ApiError
from router.models import pool as pool_module
from router.models.catalog import model_key
from router.models.control import ModelControlError
from router.models.pool import ModelPool
from router.models.served import ServedModel

GIB = 1 << 30


class FakeEngine:
    def __init__(self, model_id: str, ready: bool = True):
        self.model_id, self.max_context, self.ready = model_id, 4096, ready
        self.started = self.stopped = False

    def health(self):
        return self.ready, {}

    async def start(self):
        self.started = True

    async def stop(self):
        self.stopped = True


class FakeControl:
    """The supervisor: loads what it is told, slot by slot; `refuse` maps a name to (status, message)."""

    def __init__(self):
        self.table: dict[str, ModelSlot] = {}
        self.calls: list[tuple[str, str]] = []
        self.refuse: dict[str, tuple[int, str]] = {}
        self.n = 0

    async def load(self, name):
        self.calls.append(("load", name))
        if name in self.refuse:
            raise ModelControlError(*self.refuse[name])
        self.n += 1
        self.table[name] = ModelSlot(name, name, f"/models/{name}", f"m{self.n}", f"router-m{self.n}", "chat",
                                     GIB, 1, [f"m{self.n}.worker-0"])
        return list(self.table.values())

    async def unload(self, name):
        self.calls.append(("unload", name))
        self.table.pop(name, None)
        return list(self.table.values())

    async def slots(self, timeout_s=None):
        return list(self.table.values())


class FakeCatalog:
    def __init__(self, names):
        self.names = set(names)
        self.default_id = "own"

    def downloaded(self, name):
        return f"/models/{model_key(name)}" if model_key(name) in self.names else None

    def not_found(self, name):
        return ApiError(404, f"The model '{name}' is not downloaded: pull it first", code="model_not_found")

    def cost(self, settings, folder):
        return GIB

    def listing(self):
        return []


class Level:
    def __init__(self):
        self.level = "normal"

    def read(self):
        return self


def make_pool(monkeypatch, **settings) -> tuple[ModelPool, FakeControl, dict]:
    monkeypatch.setattr(ServedModel, "load", classmethod(lambda cls, engine, model_dir: cls(engine, object())))
    monkeypatch.setattr(pool_module, "context_length", lambda folder: 4096)
    engines: dict[str, FakeEngine] = {}

    def make_engine(model_settings, max_context):
        engines[model_settings.model_id] = FakeEngine(model_settings.model_id)
        return engines[model_settings.model_id]

    control = FakeControl()
    base = replace(Settings(), model_id="own", models_memory_bytes=10 * GIB, model_load_timeout_s=2.0,
                   **settings)
    pool = ModelPool(base, ServedModel(FakeEngine("own"), object()), control, make_engine, pressure=Level())
    pool.catalog = FakeCatalog({"x/a", "x/b", "x/c"})
    pool.default.cost = GIB
    return pool, control, engines


def run(coro):
    return asyncio.run(coro)


def test_a_lease_loads_once_for_every_request_waiting_and_names_match_with_a_tag(monkeypatch):
    async def main():
        pool, control, engines = make_pool(monkeypatch)
        leases = await asyncio.gather(*(pool.acquire(n) for n in ("x/a", "x/a:latest", "X/A")))
        assert control.calls == [("load", "x/a")]
        assert {id(lease.model) for lease in leases} == {id(leases[0].model)}
        assert engines["x/a"].started and leases[0].model.model_id == "x/a"
        for lease in leases:
            lease.release()
        assert (await pool.acquire(None)).model is pool.default_model  # the server's own, by no name
    run(main())


def test_the_least_recently_used_idle_model_makes_room_and_a_busy_one_is_never_unloaded(monkeypatch):
    async def main():
        pool, control, engines = make_pool(monkeypatch, max_loaded_models=3)
        for name in ("x/a", "x/b", None):  # used in this order: a is the least recent
            (await pool.acquire(name)).release()
            await asyncio.sleep(0.01)
        assert not [c for c in control.calls if c[0] == "unload"]  # three fit
        b = await pool.acquire("x/b")
        c = await pool.acquire("x/c")
        assert control.calls[-2:] == [("unload", "x/a"), ("load", "x/c")]
        assert engines["x/a"].stopped and not engines["x/b"].stopped
        await asyncio.sleep(0.01)
        c.release()
        await pool.acquire("x/a")  # b busy, own idle longer than c: own goes
        assert control.calls[-2:] == [("unload", "own"), ("load", "x/a")]
        assert {m["name"] for m in pool.loaded()} == {"x/a", "x/b", "x/c"}
        b.release()
    run(main())


def test_a_load_waits_for_a_busy_model_within_the_deadline_then_says_why(monkeypatch):
    async def main():
        pool, control, _ = make_pool(monkeypatch, max_loaded_models=1)
        own = await pool.acquire(None)
        with pytest.raises(ApiError) as err:
            await pool.acquire("x/a")  # own is busy for the whole 2 s deadline
        assert err.value.status == 503 and "busy (own)" in err.value.message
        await asyncio.sleep(0.1)  # the load that gave up has ended: the next request begins another
        waiting = asyncio.create_task(pool.acquire("x/a"))
        await asyncio.sleep(0.2)
        own.release()  # room: the waiting load goes on
        lease = await asyncio.wait_for(waiting, 5)
        assert lease.model.model_id == "x/a" and lease.load_s > 0
    run(main())


def test_a_refused_load_fails_its_requests_with_the_reason_and_the_next_request_tries_again(monkeypatch):
    async def main():
        pool, control, _ = make_pool(monkeypatch)
        control.refuse["x/a"] = (503, "m1.worker-0 died 6 times in 60s")
        with pytest.raises(ApiError) as err:
            await pool.acquire("x/a")
        assert err.value.status == 503 and "died 6 times" in err.value.message
        assert [m["state"] for m in pool.loaded() if m["name"] == "x/a"] == ["failed"]
        del control.refuse["x/a"]
        assert (await pool.acquire("x/a")).model.model_id == "x/a"
        with pytest.raises(ApiError) as err:
            await pool.acquire("x/nope")
        assert err.value.status == 404
    run(main())


def test_a_model_larger_than_the_budget_is_refused_at_once(monkeypatch):
    async def main():
        pool, control, _ = make_pool(monkeypatch)
        pool.budget = GIB // 2
        with pytest.raises(ApiError) as err:
            await pool.acquire("x/a")
        assert err.value.status == 503 and "--models-memory" in err.value.message
        assert control.calls == []
    run(main())


def test_keep_alive_zero_unloads_after_the_answer_and_an_expired_one_at_the_next_pass(monkeypatch):
    async def main():
        pool, control, _ = make_pool(monkeypatch)
        (await pool.acquire("x/a", keep_alive_s=0)).release()
        await asyncio.sleep(0.05)
        assert ("unload", "x/a") in control.calls
        lease = await pool.acquire("x/b", keep_alive_s=0.1)
        assert pool.loaded()[-1]["expires_at"] is None  # in use: it never expires under a request
        lease.release()
        await pool.reap()
        assert ("unload", "x/b") not in control.calls
        await asyncio.sleep(0.15)
        await pool.reap()
        assert ("unload", "x/b") in control.calls
        await pool.reap()
        assert ("unload", "own") not in control.calls  # the server's own stays (forever unless told)
    run(main())


def test_memory_pressure_unloads_idle_models_but_the_most_recently_used(monkeypatch):
    async def main():
        pool, control, _ = make_pool(monkeypatch)
        for name in ("x/a", "x/b"):
            (await pool.acquire(name)).release()
            await asyncio.sleep(0.01)
        pool.pressure.level = "warn"
        await pool.reap()
        assert [c for c in control.calls if c[0] == "unload"] == [("unload", "own"), ("unload", "x/a")]
        assert [m["name"] for m in pool.loaded()] == ["x/b"]
    run(main())


def test_a_restarted_router_adopts_the_models_the_supervisor_still_runs(monkeypatch):
    async def main():
        pool, control, engines = make_pool(monkeypatch)
        await control.load("x/b")  # loaded for the router before this one
        control.calls.clear()
        await pool.start()
        await asyncio.sleep(0.1)
        assert [m["name"] for m in pool.loaded() if m["state"] == "ready"] == ["own", "x/b"]
        assert engines["x/b"].started and control.calls == []  # adopted, not loaded again
        lease = await pool.acquire("x/b")
        assert lease.model.model_id == "x/b" and lease.load_s == 0
        await pool.stop()
    run(main())


def test_a_busy_model_asked_to_stop_goes_once_its_requests_end(monkeypatch):
    async def main():
        pool, control, _ = make_pool(monkeypatch)
        lease = await pool.acquire("x/a")
        assert await pool.unload_soon("x/a", "ollama stop")
        assert ("unload", "x/a") not in control.calls  # never under a request
        lease.release()
        await asyncio.sleep(0.05)
        assert ("unload", "x/a") in control.calls
        assert not await pool.unload_soon("x/a")  # not loaded any more
    run(main())


def test_metrics_of_models_loaded_on_demand_are_labelled_and_each_family_is_once():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from router.metrics import labelled_by_model

    def exposition(tokens: int, extra: bool) -> str:
        registry = CollectorRegistry()
        Counter("tandem_generation_tokens", "Tokens generated", registry=registry).inc(tokens)
        if extra:  # a family only that model's dispatcher has
            Gauge("tandem_worker_up", "Workers up", ["worker"], registry=registry).labels("m1.worker-0").set(1)
        return generate_latest(registry).decode()

    text = labelled_by_model([(None, exposition(5, False)), ("tests/tiny-b", exposition(7, True))])
    lines = text.splitlines()
    assert "tandem_generation_tokens_total 5.0" in lines
    assert 'tandem_generation_tokens_total{model="tests/tiny-b"} 7.0' in lines
    assert 'tandem_worker_up{model="tests/tiny-b",worker="m1.worker-0"} 1.0' in lines
    types = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
