"""The router's side of the worker protocol: the `Engine` the HTTP layer calls.

It owns the state of every request in flight and of every worker it has heard
from. A request goes: PrefillRequest to the least-loaded prefill worker ->
PrefillDone (the first token, streamed at once) -> KVHandoff (the KV is in
the arena, or in the message when it must leave its host; with --colocate it
stays in the worker and PrefillDone carries the handoff: router/routing/handoff_route.py)
-> DecodeRequest to the least-loaded decode worker -> TokenBatch
updates until finish. An embedding model's request (`embed`): EmbedRequest to
the least-loaded embed worker -> EmbedResult. Any worker silent for
`heartbeat_timeout_s`, or replaced by a new process, is dead
(router/routing/worker_table.py): each of its requests (an embed call: sent
again) resumes on a live or restarted worker (`_move`: the prompt and the answer so
far prefilled again, the stream going on where it was), and fails only if no
worker comes back within migrate_timeout_s. A request's record:
router/routing/request_state.py; its moves: router/routing/request_moves.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from typing import AsyncIterator, Optional

import zmq
import zmq.asyncio

from cache_service.client import AsyncCacheClient, CacheUnavailable
from environment.settings import Settings
from protos.messages import (Cancel, DecodeRequest, EmbedRequest, EmbedResult, KVHandoff, PrefillDone, PrefillRequest,
                             RequestFailed, TokenBatch, VisionDone, VisionRequest, WorkerHello)
from router.routing.engine_api import EngineError, EngineEvent, GenerationRequest
from router.routing.handoff_route import HandoffRoute
from router.metrics import Metrics
from router.power_watch import PowerWatch
from router.routing.prefix_affinity import prefix_keys
from router.routing.request_moves import RequestMoves
from router.routing.request_state import VISION_LOST, RequestState
from router.media.stored_images import StoredImages
from router.routing.worker_socket import WorkerSockets
from router.routing.worker_table import WorkerState, WorkerTable

log = logging.getLogger(__name__)

ORPHANS_KEPT = 4096  # wire ids of unknown requests already cancelled
EMBED_LOST = object()  # an embed call's answer when its worker died under it
STOP_LOOPS_S = 5.0  # how long stop waits for its cancelled loops


class Dispatcher(RequestMoves):
    """Implements router.routing.engine_api.Engine over ZeroMQ."""

    def __init__(self, settings: Settings, max_context: int):
        self.settings = settings
        self.model_id = settings.model_id
        self.max_context = max_context
        self.table = WorkerTable(settings)
        self.requests: dict[str, RequestState] = {}  # by wire id
        self.cache_ok = False
        self.cache_stats: dict = {}
        self._ctx: Optional[zmq.asyncio.Context] = None
        self._socks: Optional[WorkerSockets] = None
        self._cache: Optional[AsyncCacheClient] = None
        self._tasks: list[asyncio.Task] = []
        self._moving: set[asyncio.Task] = set()
        self.started = time.monotonic()  # this router process's; /health's uptime_s
        self.power = PowerWatch(settings)  # the power policy in force; sent to workers with their heartbeats
        self.metrics = Metrics(self)
        self.kv = HandoffRoute(self.table, self.metrics, self._moving)
        self._stored_images = StoredImages()
        # Wire ids no request here has (client gone, moved, router restarted): cancelled once.
        self._orphans: OrderedDict[str, None] = OrderedDict()
        self._embeds: dict[str, tuple[str, asyncio.Future]] = {}  # wire id -> (its embed worker, its answer)

    @property
    def workers(self) -> dict[str, WorkerState]:
        return self.table.workers

    # ---------------------------------------------------------- lifecycle --
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._socks = WorkerSockets(self._ctx, self.settings)
        self._cache = self.kv.cache = AsyncCacheClient(self.settings, ctx=self._ctx)
        self._tasks = [asyncio.create_task(c) for c in (self._receive_loop(), self._watch_loop(), self._cache_loop(),
                                                        self.power.run())]

    def dead_loops(self) -> list[str]:
        """The background loops that ended (they never should): the router must be restarted."""
        return [name for name, task in zip(("receive", "watch", "cache", "power"), self._tasks) if task.done()]

    async def stop(self) -> None:
        tasks = self._tasks + list(self._moving)
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: a loop that swallowed its cancel must not hold the router's stop (or a test) forever
            _, stuck = await asyncio.wait(tasks, timeout=STOP_LOOPS_S)
            for task in stuck:
                log.error("a dispatcher task did not end within %.0f s of its cancel: %s", STOP_LOOPS_S, task.get_coro())
        for st in list(self.requests.values()):
            st.events.put_nowait(EngineError(503, "server is shutting down"))
        if self._cache:
            self._cache.close()
        if self._socks is not None:
            self._socks.close()
        if self._ctx is not None:
            self._ctx.term()

    # ------------------------------------------------------------- health --
    def health(self) -> tuple[bool, dict]:
        ready, body = self.table.health(self.model_id, self.cache_ok, self.cache_stats, len(self.requests))
        return ready, {**body, "uptime_s": round(time.monotonic() - self.started, 1), "power": self.power.health()}

    async def metrics_text(self) -> str:
        return self.metrics.text()

    # ------------------------------------------------------------ routing --
    async def _send(self, worker_id: str, msg, quiet: bool = False) -> bool:
        try:
            await self._socks.send(worker_id, msg)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone
            if not quiet:
                log.warning("cannot reach worker %s: %s", worker_id, exc)
            return False

    async def _prefill_worker(self, keys: list[bytes]) -> WorkerState:
        """The prefill worker for a new request; while one restarts, wait for
        it (up to migrate_timeout_s) rather than refuse."""
        try:
            return self.table.pick_prefill(keys)
        except EngineError:
            deadline = time.monotonic() + self.settings.migrate_timeout_s
            if not await self.table.wait_ready(("prefill",), deadline):
                raise
            return self.table.pick_prefill(keys)

    def _keys(self, st: RequestState) -> list[bytes]:
        return prefix_keys(st.prompt(), self.settings.block_size, st.req.cache_salt)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineEvent]:
        st = RequestState(req, asyncio.Queue(), "", wire_id=req.request_id)
        try:  # admitted already (router/guards/admission.py): only a worker is needed
            keys = self._keys(st)
            prefill = await self._prefill_worker(keys)
        except EngineError as exc:  # refused at admission: counted, never queued
            self.metrics.requests.labels(status=str(exc.status)).inc()
            raise
        st.prefill_worker = prefill.hello.worker_id
        self.requests[st.wire_id] = st
        prefill.assigned.add(st.wire_id)
        self.table.affinity.record(keys, prefill.hello.worker_id)
        m = self.metrics
        m.prompt_tokens.inc(len(req.prompt_tokens))
        outcome, last = "cancelled", None
        try:
            if req.images:
                await self._vision(st)
            sized_only = await self._prefill(st)
            while True:
                try:
                    item = await self._next_event(st)
                except EngineError as exc:
                    if not (sized_only and last is None and exc.status == 503):
                        raise
                    # A picture's features went from the cache service since a vision worker stored them.
                    self._stored_images.forget([im.content_hash for im in req.images])
                    sized_only = await self._prefill(st, pixels=True)
                    continue
                now = time.monotonic()
                (m.ttft if last is None else m.itl).observe(now - (st.started if last is None else last))
                last = now
                m.generation_tokens.inc()
                if item.finish_reason is not None:
                    outcome = "ok"
                    m.duration.observe(now - st.started)
                yield item
                if item.finish_reason is not None:
                    return
        except EngineError as exc:
            outcome = str(exc.status)
            raise
        finally:
            m.requests.labels(status=outcome).inc()
            await self._finish(st)

    async def _prefill(self, st: RequestState, pixels: bool = False) -> bool:
        """Send the request to its prefill worker, its stored pictures by their
        sizes alone unless `pixels` (router/media/stored_images.py). Returns whether
        any went without."""
        w = self.workers.get(st.prefill_worker)
        if w is None:  # it died meanwhile (during the vision step): move on at once
            self._relocate(st, "prefill worker went away before the prompt reached it", strike=False)
            return False
        local = self.table.decodes_own(w)  # the KV stays where it was computed
        images = self._stored_images.for_prefill(st.req.images, pixels)
        if not await self._send(st.prefill_worker, PrefillRequest(
                st.wire_id, st.prompt(), st.req.sampling, st.prefill_worker if local else "", images,
                generated=st.budget().produced, cache_salt=st.req.cache_salt, kv_by_value=self.kv.by_value(w))):
            self._relocate(st, "prefill worker unreachable", strike=False)
        return any(a is not b for a, b in zip(images, st.req.images))

    async def _next_event(self, st: RequestState):
        """The request's next event from the workers, within the deadline on
        progress (settings.request_timeout_s since the last one: a request
        that stalls fails, a long one that goes on does not); an EngineError
        event is raised."""
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns an event that arrives
            # in the instant its task is cancelled and drops the cancel, and the
            # request went on decoding for a client that had gone.
            async with asyncio.timeout(self.settings.request_timeout_s):
                item = await st.events.get()
        except TimeoutError:
            raise EngineError(504, f"request made no progress for {self.settings.request_timeout_s:g} s",
                              code="timeout") from None
        if isinstance(item, EngineError):
            raise item
        return item

    async def _vision(self, st: RequestState) -> None:
        """Have a vision worker store the images' embeddings before prefill.
        Without one alive (or if it dies), or with all stored already, prefill
        takes them from the cache service, encoding only what is missing."""
        w = self.table.least("vision")
        hashes = [im.content_hash for im in st.req.images]
        if w is None or self._stored_images.all_stored(hashes):
            self._stored_images.touch(hashes)
            return
        st.phase, st.vision_worker = "vision", w.hello.worker_id
        w.assigned.add(st.wire_id)
        try:
            if not await self._send(w.hello.worker_id, VisionRequest(st.wire_id, list(st.req.images))):
                return
            item = await self._next_event(st)
            if item is VISION_LOST:
                return
            st.vision = item
            self._stored_images.add(hashes)
            m = self.metrics
            m.vision_queries.inc(item.encoded + item.cached)
            m.vision_hits.inc(item.cached)
            if item.encoded:
                m.vision_encode.observe(item.encode_s)
        finally:
            st.phase = "prefill"
            w.assigned.discard(st.wire_id)

    async def embed(self, inputs: list[list[int]], dimensions: int, deadline: float):
        """(vectors: float32 [len(inputs), d], tokens embedded) from the
        least-loaded embed worker, by `deadline` (time.monotonic(); past it
        504). A worker that dies under it: sent again to another (or to it,
        restarted within migrate_timeout_s), up to max_migrations times; none
        ready: 503. A worker's refusal is its status (400 for bad input)."""
        base = f"embd-{uuid.uuid4().hex}"
        for attempt in range(self.settings.max_migrations + 1):
            w = await self._ready_worker("embed", deadline)
            wid, wire_id = w.hello.worker_id, f"{base}~{attempt}" if attempt else base
            answer = asyncio.get_running_loop().create_future()
            self._embeds[wire_id] = (wid, answer)
            w.assigned.add(wire_id)
            try:
                if not await self._send(wid, EmbedRequest(wire_id, inputs, dimensions)):
                    answer.set_result(EMBED_LOST)
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    result = await answer
            except TimeoutError:
                raise EngineError(504, "the embed worker did not answer in time", code="timeout") from None
            finally:
                self._embeds.pop(wire_id, None)
                self.table.unassign(wire_id, wid)
                # The client left, or the deadline passed (either cancels the future awaited).
                if (not answer.done() or answer.cancelled()) and wid in self.workers:
                    await self._send(wid, Cancel(wire_id), quiet=True)
            if isinstance(result, EmbedResult):
                self.metrics.prompt_tokens.inc(result.prompt_tokens)
                return result.vectors, result.prompt_tokens
            if isinstance(result, RequestFailed):
                raise EngineError(result.status, result.message)
            log.info("embeddings %s: its worker %s went away; sending it again (attempt %d)", base, wid, attempt + 2)
        raise EngineError(502, f"{self.settings.max_migrations + 1} embed workers died running this request, "
                               "so it is not sent again")

    async def _ready_worker(self, role: str, deadline: float) -> WorkerState:
        """The least-loaded ready worker of `role`; while one restarts, wait
        for it (up to migrate_timeout_s, and `deadline`) rather than refuse (503)."""
        try:
            return self.table.pick(role)
        except EngineError:
            until = min(deadline, time.monotonic() + self.settings.migrate_timeout_s)
            if not await self.table.wait_ready((role,), until):
                raise
            return self.table.pick(role)

    def _embed_answer(self, wid: str, msg) -> bool:
        """An embed worker's EmbedResult or RequestFailed for a call waiting
        on it (whether one was)."""
        wid_answer = self._embeds.get(msg.request_id)
        if wid_answer is None or wid_answer[0] != wid or wid_answer[1].done():
            return False
        wid_answer[1].set_result(msg)
        return True

    def _moved_off(self, wid: str, w: WorkerState, why: str) -> None:
        """A worker is gone: its embed calls are sent again (`embed`), its
        generations move (RequestMoves)."""
        for wire_id, (owner, answer) in list(self._embeds.items()):
            if owner == wid and not answer.done():
                answer.set_result(EMBED_LOST)
        super()._moved_off(wid, w, why)

    async def _finish(self, st: RequestState) -> None:
        self.requests.pop(st.wire_id, None)
        self.table.unassign(st.wire_id, st.prefill_worker, st.decode_worker)
        if st.phase == "done":
            return
        # The client left or the request failed: stop the work wherever it is.
        target = {"prefill": st.prefill_worker, "decode": st.decode_worker}.get(st.phase)
        if target in self.workers:
            await self._send(target, Cancel(st.wire_id))

    # ------------------------------------------------------------ inbound --
    async def _receive_loop(self) -> None:
        while True:
            try:
                peer, msg = await self._socks.receive()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                log.error("router socket error: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if msg is None:
                continue
            try:
                await self._on_message(peer.decode(errors="replace"), msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the loop
                log.exception("failed to handle %s from %s", type(msg).__name__, peer)

    async def _on_message(self, wid: str, msg) -> None:
        if isinstance(msg, WorkerHello):
            dropped, why = self.table.on_hello(wid, msg)
            if dropped is not None:
                self._moved_off(wid, dropped, why)
            limits = self.power.limits_for(msg) if wid in self.workers else None
            if limits is not None:
                await self._send(wid, limits, quiet=True)
        elif isinstance(msg, TokenBatch):
            await self._on_tokens(wid, msg)
        elif isinstance(msg, VisionDone):
            st = self.requests.get(msg.request_id)
            if st is not None and st.phase == "vision" and st.vision_worker == wid:
                st.events.put_nowait(msg)
        elif isinstance(msg, PrefillDone):
            await self._on_prefill_done(wid, msg)
        elif isinstance(msg, KVHandoff):
            await self._on_handoff(wid, msg)
        elif isinstance(msg, EmbedResult):
            self._embed_answer(wid, msg)
        elif isinstance(msg, RequestFailed):
            if self._embed_answer(wid, msg):
                return
            st = self.requests.get(msg.request_id)
            if st is not None and wid in (st.prefill_worker, st.decode_worker, st.vision_worker):
                st.events.put_nowait(EngineError(msg.status, msg.message))
        else:
            log.error("unexpected %s from worker %s", type(msg).__name__, wid)

    async def _on_tokens(self, wid: str, batch: TokenBatch) -> None:
        """A decode step's tokens; only the worker decoding a request speaks for it."""
        orphans = []
        for u in batch.updates:
            st = self.requests.get(u.request_id)
            if st is None:
                orphans.append(u.request_id)
            elif st.phase == "decode" and st.decode_worker == wid:
                st.answer.append(u.token)
                if u.finish_reason is not None:
                    st.phase = "done"
                st.events.put_nowait(EngineEvent(u.token, u.logprob, u.finish_reason))
        for wire_id in orphans:  # nobody reads these: stop them (a router restart leaves many)
            if self._orphaned(wire_id):
                await self._send(wid, Cancel(wire_id), quiet=True)

    def _orphaned(self, wire_id: str) -> bool:
        """Remember a wire id nobody reads (the newest ORPHANS_KEPT); False if known already."""
        if wire_id in self._orphans:
            return False
        self._orphans[wire_id] = None
        while len(self._orphans) > ORPHANS_KEPT:
            self._orphans.popitem(last=False)
        return True

    async def _on_prefill_done(self, wid: str, done: PrefillDone) -> None:
        st = self.requests.get(done.request_id)
        if st is None or st.phase != "prefill" or st.prefill_worker != wid:  # the client left, or it moved
            if done.handoff is not None and done.handoff.local:  # the worker keeps that KV until told
                await self._send(wid, Cancel(done.request_id), quiet=True)
            elif done.handoff is not None:
                self.kv.free(done.handoff)
            return
        self.metrics.prefix_queries.inc()
        self.metrics.prefix_hit_tokens.inc(done.cached_tokens)
        log.debug("request %s: first token %.2f ms after dispatch, %.2f ms of it prefill (%d of %d tokens cached)",
                  done.request_id, (time.monotonic() - st.started) * 1000, done.prefill_ms, done.cached_tokens,
                  len(st.req.prompt_tokens))
        if st.req.images and st.vision is None:  # no vision worker: prefill encoded
            self.metrics.vision_queries.inc(done.images_encoded + done.images_cached)
            self.metrics.vision_hits.inc(done.images_cached)
            if done.images_encoded:
                self.metrics.vision_encode.observe(done.encode_s)
        # A moved request's prompt includes its answer: only the first prefill's cached count is the client's.
        cached = 0 if st.answer else done.cached_tokens
        st.answer.append(done.first_token)
        st.first_token = done.first_token
        if done.finish_reason is not None:
            st.phase = "done"
        st.events.put_nowait(EngineEvent(done.first_token, done.logprob, done.finish_reason, cached))
        if done.finish_reason is None and done.handoff is not None:
            await self._on_handoff(wid, done.handoff)

    async def _on_handoff(self, wid: str, h: KVHandoff) -> None:
        """The prompt's KV is ready: pass the request to a decode worker."""
        st = self.requests.get(h.request_id)
        if st is None or st.phase != "prefill" or st.first_token is None or st.prefill_worker != wid:
            self.kv.free(h)  # the client left, or the request failed or moved
            return
        decode = self.kv.decode_for(wid, h)
        if decode is None:  # the decode worker died: prefill again once one is back
            self.kv.free(h)
            self._relocate(st, "no decode worker was ready for its KV", strike=False)
            return
        st.phase, st.decode_worker, st.handoff = "decode", decode.hello.worker_id, h
        self.table.unassign(st.wire_id, st.prefill_worker)
        decode.assigned.add(st.wire_id)
        ok = await self._send(st.decode_worker, DecodeRequest(
            st.wire_id, st.prompt(), st.first_token, h, st.req.sampling,
            generated=st.budget().after(1).produced,  # prefill's first token is produced
            media=[im.content_hash for im in st.req.images], cache_salt=st.req.cache_salt))
        if not ok:
            self.kv.free(h)
            self._relocate(st, "decode worker unreachable", st.decode_worker, strike=False)

    # ---------------------------------------------------------- watchdog --
    async def _watch_loop(self) -> None:
        while True:
            now = time.monotonic()
            for wid in self.table.silent():
                w = self.table.drop(wid)
                if w is not None:
                    self._moved_off(wid, w, f"missed heartbeats for {now - w.last_seen:.1f}s")
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def _cache_loop(self) -> None:
        """The cache service has no heartbeat of its own: ask it for stats."""
        while True:
            try:
                self.cache_stats = await self._cache.stats()
                self.cache_ok = True
            except CacheUnavailable:
                if self.cache_ok:
                    log.warning("cache service unavailable")
                self.cache_ok = False
            await asyncio.sleep(self.settings.heartbeat_interval_s)
