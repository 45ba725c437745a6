"""The models this router serves, loaded on demand and unloaded when idle.

A request names its model (`model`); the pool hands it a lease on that
model's ServedModel (router/models/served.py), loading it first when it is
downloaded but not loaded: the supervisor starts its workers
(router/models/control.py -> deploy/models/), the router a dispatcher on the
model's own socket, and the request waits (at most `model_load_timeout_s`)
until its workers are ready. Requests for a model that is loading wait for
the same load.

A model with leases out (requests in flight) is never unloaded. An idle one
goes:
- when its keep-alive runs out (the last request's `keep_alive` / `ttl`, else
  `--keep-alive`; the model `tandem serve` started with stays unless a
  request says otherwise), at once for `keep_alive: 0`;
- to make room, least recently used first, when a load would pass
  `--max-loaded-models` or the memory budget (weights times the processes
  holding them);
- under memory pressure or the power saver: every idle model but the most
  recently used one (whose workers shrink their caches instead).
The model the server started with keeps its dispatcher when unloaded (its
workers come back on the same socket when it is loaded again); others' go.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

from environment.memory_pressure import PressureReader
from environment.model_folder import context_length
from environment.settings import Settings, default_models_memory
from protos.model_messages import ModelSlot
from router.api.errors import ApiError
from router.models.catalog import Catalog, model_key, without_tag
from router.models.control import ModelControl, ModelControlError
from router.models.keep_alive import FOREVER
from router.models.served import ServedModel

log = logging.getLogger(__name__)

MODEL_ALIAS = "default"  # always the model the server started with
REAP_INTERVAL_S = 1.0
SLOT_POLL_S = 1.0  # how often a load asks the supervisor whether its workers keep dying


@dataclass
class _Entry:
    name: str  # as the supervisor knows it
    served: ServedModel | None = None
    slot: ModelSlot | None = None
    state: str = "loading"  # "loading" | "ready" | "failed"
    error: str = ""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    keep_alive_s: float = FOREVER
    cost: int = 0  # bytes of weights it holds, all processes together
    loaded_at: float = field(default_factory=time.time)
    load_s: float = 0.0  # how long its load took
    stage: str = ""  # where its load is: what a request that gave up waiting is told
    task: asyncio.Task | None = None

    def expires_at(self) -> float | None:
        """Wall-clock time it goes if nothing uses it (None: never, or in use)."""
        if self.in_flight or self.keep_alive_s == FOREVER or self.state != "ready":
            return None
        return time.time() + (self.last_used + self.keep_alive_s - time.monotonic())


class ModelLease:
    """A request's hold on its model: released once, when the request ends."""

    def __init__(self, pool: "ModelPool", entry: _Entry):
        self._pool, self._entry = pool, entry
        self.model: ServedModel = entry.served
        self.load_s = 0.0  # what this request waited for a load
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self._entry)


EngineFactory = Callable[[Settings, int], object]  # (a model's settings, its context) -> an unstarted dispatcher


class ModelPool:
    def __init__(self, settings: Settings, default: ServedModel, control: ModelControl | None = None,
                 make_engine: EngineFactory | None = None, pressure: PressureReader | None = None):
        self.settings = settings
        self.control = control  # None: one model, the default, and no other (tests, a router alone)
        self.make_engine = make_engine or _dispatcher
        self.catalog = Catalog(default.model_id)
        self.budget = settings.models_memory_bytes or default_models_memory(cache_bytes=settings.cache_memory_bytes)
        self.pressure = pressure or PressureReader(settings.memory_pressure_file)
        self.default = _Entry(default.model_id, default, state="ready")
        self.default.ready.set()
        self.default.cost = self.catalog.cost(settings, settings.model_dir)
        self.entries: dict[str, _Entry] = {model_key(default.model_id): self.default}
        self.changed = asyncio.Event()  # set on every release and unload: loads waiting for room look again
        self.loads = self.unloads = 0
        self._reaper: asyncio.Task | None = None
        self._adopting: asyncio.Task | None = None

    @property
    def default_model(self) -> ServedModel:
        return self.default.served

    # ---------------------------------------------------------- lifecycle --
    async def start(self) -> None:
        """Watch for idle models; adopt (in the background) the models a
        previous router of this server loaded."""
        self._reaper = asyncio.create_task(self._reap_loop())
        if self.control is not None:
            self._adopting = asyncio.create_task(self._adopt())

    async def _adopt(self) -> None:
        try:
            slots = await self.control.slots(timeout_s=10.0)
        except ModelControlError as exc:
            log.warning("could not list the loaded models: %s", exc)
            return
        for slot in slots:
            if slot.slot and slot.state != "failed" and model_key(slot.name) not in self.entries:
                entry = self.entries.setdefault(model_key(slot.name), _Entry(slot.name))
                entry.keep_alive_s = self.settings.model_keep_alive_s
                entry.task = asyncio.create_task(self._load(entry, slot))

    async def stop(self) -> None:
        tasks = [t for t in [self._reaper, self._adopting, *(e.task for e in self.entries.values())] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for entry in list(self.entries.values()):
            if entry is not self.default and entry.served is not None:
                await entry.served.engine.stop()

    def dead_loops(self) -> list[str]:
        """Background loops that ended, in any loaded model's dispatcher or here."""
        dead = [f"{e.name}: {loop}" for e in self.entries.values() if e is not self.default and e.served is not None
                for loop in getattr(e.served.engine, "dead_loops", lambda: [])()]
        return dead + (["models"] if self._reaper is not None and self._reaper.done() else [])

    # ------------------------------------------------------------- leases --
    async def acquire(self, name: str | None, keep_alive_s: float | None = None) -> ModelLease:
        """A lease on the model `name` (None or "default": the server's own),
        loaded first if need be. ApiError 404 for a model that is not
        downloaded, 503 for one that cannot be loaded in time."""
        t0 = time.monotonic()
        entry = self._find(name)
        if entry is None or entry.state in ("unloaded", "failed") and (entry.task is None or entry.task.done()):
            entry = await self._begin_load(name, entry)
        entry.keep_alive_s = keep_alive_s if keep_alive_s is not None else self._keep_alive_default(entry)
        entry.in_flight += 1  # from here the entry cannot be unloaded under the request
        waited = entry.state != "ready"
        try:
            if waited:
                await self._wait_ready(entry, t0)
        except BaseException:
            self._release(entry)
            raise
        entry.last_used = time.monotonic()
        lease = ModelLease(self, entry)
        lease.load_s = time.monotonic() - t0 if waited else 0.0
        return lease

    def _keep_alive_default(self, entry: _Entry) -> float:
        return FOREVER if entry is self.default else self.settings.model_keep_alive_s

    def _release(self, entry: _Entry) -> None:
        entry.in_flight -= 1
        entry.last_used = time.monotonic()
        self.changed.set()
        if entry.in_flight == 0 and entry.keep_alive_s == 0 and entry.state == "ready":
            asyncio.get_running_loop().create_task(self.unload(entry.name, "keep_alive 0"))

    def _find(self, name: str | None) -> _Entry | None:
        if name is None or name in ("", MODEL_ALIAS):
            return self.default
        key = model_key(name)
        return self.entries.get(key) or next((e for e in self.entries.values() if e.served is not None
                                              and model_key(e.served.model_id) == key), None)

    # -------------------------------------------------------------- loads --
    async def _begin_load(self, name: str | None, entry: _Entry | None) -> _Entry:
        """The load of a model not loaded (or unloaded, or failed before) begun."""
        if self.control is None:
            raise self.catalog.not_found(name)
        if entry is None:
            folder = await asyncio.to_thread(self.catalog.downloaded, name)
            if folder is None:
                raise self.catalog.not_found(name)
            entry = self.entries.setdefault(model_key(name), _Entry(without_tag(name.strip()),
                                                                    cost=self.catalog.cost(self.settings, folder)))
        if entry.task is None or entry.task.done():
            entry.state, entry.error = "loading", ""
            entry.ready.clear()
            entry.task = asyncio.create_task(self._load(entry))
        return entry

    async def _wait_ready(self, entry: _Entry, t0: float) -> None:
        left = self.settings.model_load_timeout_s - (time.monotonic() - t0)
        try:
            await asyncio.wait_for(asyncio.shield(entry.ready.wait()), max(0.0, left))
        except asyncio.TimeoutError:
            raise ApiError(503, f"The model '{entry.name}' did not load within {self.settings.model_load_timeout_s:g} s "
                                f"({entry.stage or 'loading'})", code="model_loading") from None
        if entry.state != "ready":
            raise ApiError(503, f"The model '{entry.name}' could not be loaded: {entry.error}", code="model_load_failed")

    async def _load(self, entry: _Entry, slot: ModelSlot | None = None) -> None:
        """The whole load of one model, in its own task (a request that gives
        up does not stop it for the others waiting)."""
        t0 = time.monotonic()
        try:
            if slot is None:
                await self._make_room(entry)
                entry.stage = "starting its workers"
                slot = _slot_named(await self.control.load(entry.name), entry.name)
            entry.slot = slot
            entry.cost = slot.weight_bytes * max(1, slot.processes) or entry.cost
            if entry is not self.default:
                engine = self.make_engine(self._settings_for(slot), context_length(slot.model_dir))
                await engine.start()
                entry.served = await asyncio.to_thread(ServedModel.load, engine, slot.model_dir)
            entry.stage = "waiting for its workers to be ready"
            await self._until_workers_ready(entry)
            entry.state, entry.load_s, entry.loaded_at = "ready", time.monotonic() - t0, time.time()
            self.loads += 1
            log.info("model %s loaded in %.1f s (%s)", entry.name, entry.load_s, ", ".join(slot.workers))
        except asyncio.CancelledError:
            raise
        except (ModelControlError, ApiError) as exc:
            await self._fail(entry, exc.message)
        except Exception as exc:  # noqa: BLE001 - a load that breaks fails its requests, not the router
            log.exception("loading %s failed", entry.name)
            await self._fail(entry, f"{type(exc).__name__}: {exc}")
        finally:
            entry.ready.set()

    async def _fail(self, entry: _Entry, why: str) -> None:
        entry.state, entry.error = "failed", why
        log.error("model %s could not be loaded: %s", entry.name, why)
        if entry.slot is not None:
            await self._stop_workers(entry)

    async def _until_workers_ready(self, entry: _Entry) -> None:
        deadline = time.monotonic() + self.settings.model_load_timeout_s
        next_poll = time.monotonic() + SLOT_POLL_S
        while not entry.served.engine.health()[0]:
            if time.monotonic() > deadline:
                raise ModelControlError(503, f"its workers were not ready within {self.settings.model_load_timeout_s:g} s")
            if time.monotonic() > next_poll:  # workers that keep dying: the supervisor says so
                next_poll = time.monotonic() + SLOT_POLL_S
                slot = _slot_named(await self.control.slots(), entry.name, required=False)
                if slot is None or slot.state == "failed":
                    raise ModelControlError(503, slot.error if slot is not None else "its workers were stopped")
            await asyncio.sleep(0.05)

    def _settings_for(self, slot: ModelSlot) -> Settings:
        return replace(self.settings, model=slot.name, model_dir=slot.model_dir, model_id=slot.model_id,
                       router_socket=slot.router_socket, worker_listen="", draft_model_dir=None)

    # --------------------------------------------------------------- room --
    async def _make_room(self, entry: _Entry) -> None:
        """Unload idle models, least recently used first, until `entry` fits;
        wait for busy ones to become idle, within the load's deadline."""
        if entry.cost > self.budget:
            raise ModelControlError(503, f"it needs {_gib(entry.cost)} of memory and the budget for loaded models is "
                                         f"{_gib(self.budget)} (--models-memory)")
        deadline = time.monotonic() + self.settings.model_load_timeout_s
        while True:
            others = [e for e in self.entries.values() if e is not entry and e.state in ("ready", "loading")]
            used = sum(e.cost for e in others)
            if len(others) < self.settings.max_loaded_models and used + entry.cost <= self.budget:
                return
            idle = sorted((e for e in others if e.in_flight == 0 and e.state == "ready"), key=lambda e: e.last_used)
            if idle:
                await self.unload(idle[0].name, "room for " + entry.name)
                continue
            entry.stage = "waiting for room: every loaded model is busy (" + ", ".join(e.name for e in others) + ")"
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ModelControlError(503, "no room: every loaded model is busy (" +
                                        ", ".join(e.name for e in others) + ")")
            try:
                async with asyncio.timeout(left):  # not wait_for: 3.11's can lose a cancel (router/power_watch.py)
                    await self.changed.wait()
            except TimeoutError:
                pass

    async def unload(self, name: str, why: str = "asked") -> bool:
        """Unload an idle model (False: not loaded, or in use)."""
        entry = self._find(name)
        if entry is None or entry.in_flight or entry.state == "loading":
            return False
        log.info("unloading model %s (%s)", entry.name, why)
        entry.state = "unloaded"
        entry.ready.clear()
        if entry is not self.default:
            self.entries.pop(model_key(entry.name), None)
        self.unloads += 1
        self.changed.set()
        await self._stop_workers(entry)
        return True

    async def unload_soon(self, name: str, why: str = "asked") -> bool:
        """Unload now if idle, else once its requests end (Ollama's `ollama stop`
        on a busy model); False when it is not loaded."""
        entry = self._find(name)
        if entry is None or entry.state not in ("ready", "loading"):
            return False
        if not await self.unload(name, why):
            entry.keep_alive_s = 0  # its last request's release unloads it
        return True

    async def _stop_workers(self, entry: _Entry) -> None:
        if self.control is not None:
            try:
                await self.control.unload(entry.slot.name if entry.slot is not None else entry.name)
            except ModelControlError as exc:
                log.warning("unloading %s: %s", entry.name, exc.message)
        if entry is self.default:
            table = getattr(entry.served.engine, "table", None)
            for wid in list(table.workers) if table is not None else []:  # gone: none may look ready at the next load
                table.drop(wid)
        elif entry.served is not None:
            await entry.served.engine.stop()
            entry.served = None
            _give_back_memory()

    # -------------------------------------------------------------- idle --
    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                await self.reap()
            except Exception:  # noqa: BLE001 - one bad pass must not end the loop
                log.exception("unloading idle models")

    async def reap(self) -> None:
        """One pass: idle models past their keep-alive go, and under memory
        pressure or the power saver, idle ones but the most recently used."""
        now = time.monotonic()
        idle = sorted((e for e in self.entries.values() if e.state == "ready" and e.in_flight == 0),
                      key=lambda e: e.last_used)
        for entry in idle:
            if entry.keep_alive_s != FOREVER and now - entry.last_used >= entry.keep_alive_s:
                await self.unload(entry.name, f"idle for {entry.keep_alive_s:g} s")
        if self.control is None:
            return
        level = await asyncio.to_thread(lambda: self.pressure.read().level)
        saver = getattr(getattr(getattr(self.default_model.engine, "power", None), "policy", None), "name", "") == "saver"
        if level == "critical" or level == "warn" or saver:
            loaded = [e for e in self.entries.values() if e.state == "ready"]
            # The most recent stays: unloading the model in use only trades the
            # pressure for a reload at the next request (its caches shrink instead).
            keep = max(loaded, key=lambda e: e.last_used) if loaded else None
            for entry in idle:
                if entry is not keep and entry.state == "ready":
                    await self.unload(entry.name, "memory pressure " + level if level in ("warn", "critical")
                                      else "power saver")

    def other_engines(self) -> list[tuple[str, object]]:
        """(name, engine) of every model loaded on demand and ready: their
        dispatchers' /metrics, labelled with the model (router/metrics.py)."""
        return [(e.name, e.served.engine) for e in self.entries.values()
                if e is not self.default and e.state == "ready" and e.served is not None]

    def metrics_text(self) -> str:
        ready = sum(e.state == "ready" for e in self.entries.values())
        return (f"# HELP tandem_models_loaded Models loaded now\n# TYPE tandem_models_loaded gauge\n"
                f"tandem_models_loaded {ready}\n"
                f"# HELP tandem_model_loads_total Models loaded on demand since start\n"
                f"# TYPE tandem_model_loads_total counter\ntandem_model_loads_total {self.loads}\n"
                f"# HELP tandem_model_unloads_total Models unloaded since start (idle, room, pressure, asked)\n"
                f"# TYPE tandem_model_unloads_total counter\ntandem_model_unloads_total {self.unloads}\n")

    # ------------------------------------------------------------ listing --
    def loaded(self) -> list[dict]:
        """The models loaded or loading now: /health, /api/ps."""
        out = []
        for e in self.entries.values():
            if e.state not in ("ready", "loading", "failed"):
                continue
            out.append({"name": e.name, "model": e.served.model_id if e.served is not None else e.name,
                        "model_dir": e.served.model_dir if e.served is not None else "",
                        "kind": e.served.kind if e.served is not None else "", "state": e.state,
                        "size": e.cost, "in_flight": e.in_flight, "expires_at": e.expires_at(),
                        "keep_alive_s": e.keep_alive_s, "loaded_at": e.loaded_at,
                        "workers": self._workers_of(e),
                        **({"error": e.error} if e.error else {})})
        return out

    @staticmethod
    def _workers_of(entry: _Entry) -> list[str]:
        if entry.slot is not None:
            return list(entry.slot.workers)
        table = getattr(entry.served.engine, "table", None) if entry.served is not None else None
        return sorted(table.workers) if table is not None else []

    async def available(self) -> list[dict]:
        """Every model a request may name: the loaded ones and the downloaded
        ones (/v1/models, /api/tags)."""
        loaded = {model_key(e["name"]): e for e in self.loaded()}
        downloaded = await asyncio.to_thread(self.catalog.listing) if self.control is not None else []
        out = [{**e, "loaded": e["state"] == "ready"} for e in loaded.values()]
        out += [{**d, "loaded": False} for d in downloaded if model_key(d["name"]) not in loaded]
        return out


def _slot_named(slots: list[ModelSlot], name: str, required: bool = True) -> ModelSlot | None:
    key = model_key(name)
    for slot in slots:
        if key in (model_key(slot.name), model_key(slot.model_id)):
            return slot
    if required:
        raise ModelControlError(503, "the supervisor lists no such model after loading it")
    return None


def _give_back_memory() -> None:
    """An unloaded model's tokenizer and tables freed, and the heap's free
    pages handed back to the system (glibc keeps them otherwise; macOS's
    allocator returns them itself)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _dispatcher(settings: Settings, max_context: int):
    from router.routing.dispatcher import Dispatcher

    return Dispatcher(settings, max_context=max_context)
