"""The router's side of the worker protocol: the `Engine` the HTTP layer calls.

It owns the state of every request in flight and of every worker it has heard
from. A request goes: PrefillRequest to the least-loaded prefill worker ->
PrefillDone (the first token, streamed at once) -> KVHandoff (the KV is in
the arena; with --colocate it stays in the worker and PrefillDone carries the
handoff) -> DecodeRequest to the least-loaded decode worker -> TokenBatch
updates until finish. Any worker silent for `heartbeat_timeout_s` is dead: its requests end
with an error at once and it leaves the routing table until it says hello again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Optional

import numpy as np
import zmq
import zmq.asyncio

from cache_service.client import AsyncCacheClient, CacheUnavailable
from deploy.settings import Settings
from protos import transport
from protos.messages import (
    Cancel,
    DecodeRequest,
    ImageInput,
    KVHandoff,
    PrefillDone,
    PrefillRequest,
    RequestFailed,
    TokenBatch,
    VisionDone,
    VisionRequest,
    WorkerHello,
)
from router.engine_api import EngineError, EngineEvent, GenerationRequest
from router.metrics import Metrics
from router.prefix_affinity import PrefixAffinity, prefix_keys

log = logging.getLogger(__name__)

# How many more in-flight requests the affine prefill worker may have than the
# least-loaded one before routing ignores affinity.
AFFINITY_SLACK = 2
# Image hashes the router remembers as encoded (a few hundred KB of strings).
STORED_IMAGES_KEPT = 4096


@dataclass
class WorkerState:
    hello: WorkerHello
    last_seen: float
    assigned: set = field(default_factory=set)  # request ids this worker holds now

    @property
    def ready(self) -> bool:
        return self.hello.state == "ready"

    def load(self) -> int:
        return len(self.assigned)


@dataclass
class RequestState:
    req: GenerationRequest
    events: asyncio.Queue
    prefill_worker: str
    decode_worker: str = ""
    phase: str = "prefill"  # prefill -> decode -> done
    vision: object = None  # the VisionDone of its images, if a vision worker stored them
    first_token: Optional[int] = None  # from PrefillDone; decode continues after it
    started: float = field(default_factory=time.monotonic)


class Dispatcher:
    """Implements router.engine_api.Engine over ZeroMQ."""

    def __init__(self, settings: Settings, max_context: int):
        self.settings = settings
        self.model_id = settings.model_id
        self.max_context = max_context
        self.workers: dict[str, WorkerState] = {}
        self.requests: dict[str, RequestState] = {}
        self.cache_ok = False
        self.cache_stats: dict = {}
        self._ctx: Optional[zmq.asyncio.Context] = None
        self._sock = None
        self._cache: Optional[AsyncCacheClient] = None
        self._tasks: list[asyncio.Task] = []
        self.metrics = Metrics(self)
        self.affinity = PrefixAffinity()
        # Content hashes a vision worker has stored embeddings for, newest
        # last: a request whose images are all here skips the vision worker
        # (a follow-up turn never queues behind another user's encoding). If
        # the cache service evicted one, prefill encodes it itself.
        self._stored_images: OrderedDict[str, None] = OrderedDict()
        self._expected_roles = self._expected()  # fixed by the settings: read the model's config once

    # ---------------------------------------------------------- lifecycle --
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = transport.make_socket(self._ctx, zmq.ROUTER)
        # A restarted worker reconnects under its old id; let it take the id over.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.bind(transport.ipc_address(self.settings.run_dir, "router"))
        self._cache = AsyncCacheClient(self.settings, ctx=self._ctx)
        self._tasks = [asyncio.create_task(c) for c in (self._receive_loop(), self._watch_loop(), self._cache_loop())]

    def dead_loops(self) -> list[str]:
        """The background loops that ended (they never should): the router
        process cannot serve without them and must be restarted."""
        names = ("receive", "watch", "cache")
        return [name for name, task in zip(names, self._tasks) if task.done()]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for st in list(self.requests.values()):
            st.events.put_nowait(EngineError(503, "server is shutting down"))
        if self._cache:
            self._cache.close()
        if self._sock is not None:
            self._sock.close()
        if self._ctx is not None:
            self._ctx.term()

    # ------------------------------------------------------------- health --
    def _expected(self) -> dict[str, int]:
        """Live workers per role the settings ask for (what /health waits for)."""
        expected: dict[str, int] = {}
        for _, roles in self.settings.worker_plan():
            for role in roles:
                expected[role] = expected.get(role, 0) + 1
        return expected

    def _ready_with(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.ready and role in w.hello.roles]

    def health(self) -> tuple[bool, dict]:
        expected = self._expected_roles
        ready = self.cache_ok and all(len(self._ready_with(r)) >= n for r, n in expected.items())
        workers = [
            {
                "id": wid,
                "role": "+".join(w.hello.roles),
                "pid": w.hello.pid,
                "state": w.hello.state,
                "running": w.hello.running,
                "waiting": w.hello.waiting,
                "last_seen_s": round(time.monotonic() - w.last_seen, 3),
            }
            for wid, w in sorted(self.workers.items())
        ]
        cache = {"role": "cache", "state": "ready" if self.cache_ok else "unavailable", **self.cache_stats}
        body = {
            "status": "ok" if ready else "unavailable",
            "model": self.model_id,
            "workers": workers,
            "cache_service": cache,
            "expected": expected,
            "requests_in_flight": len(self.requests),
        }
        return ready, body

    async def metrics_text(self) -> str:
        return self.metrics.text()

    # ------------------------------------------------------------ routing --
    def _pick(self, role: str) -> WorkerState:
        """The least-loaded ready worker of a role."""
        candidates = self._ready_with(role)
        if not candidates:
            raise EngineError(503, f"no {role} worker is alive; retry shortly", retry_after=1.0)
        return min(candidates, key=lambda w: (w.load(), w.hello.running + w.hello.waiting))

    def _pick_prefill(self, keys: list[bytes]) -> WorkerState:
        """Cache-aware: the worker that last prefilled the longest part of this
        prompt, unless it is busier than the least-loaded one by more than
        AFFINITY_SLACK requests (then reuse is not worth the wait)."""
        least = self._pick("prefill")
        matched = self.affinity.matched_blocks(keys)
        ready = {w.hello.worker_id: w for w in self._ready_with("prefill")}
        best = max((wid for wid in matched if wid in ready), key=lambda wid: matched[wid], default=None)
        if best is not None and ready[best].load() - least.load() <= AFFINITY_SLACK:
            return ready[best]
        return least

    async def _send(self, worker_id: str, msg) -> bool:
        try:
            await transport.asend(self._sock, msg, to=worker_id.encode())
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone
            log.warning("cannot reach worker %s: %s", worker_id, exc)
            return False

    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineEvent]:
        try:
            waiting = sum(1 for st in self.requests.values() if st.phase == "prefill")
            if waiting >= self.settings.max_queue:
                raise EngineError(429, f"server busy: {waiting} requests are queued for prefill; retry later",
                                  retry_after=1.0)
            keys = prefix_keys(req.prompt_tokens, self.settings.block_size)
            prefill = self._pick_prefill(keys)
        except EngineError as exc:  # refused at admission: counted, never queued
            self.metrics.requests.labels(status=str(exc.status)).inc()
            raise
        rid = req.request_id
        st = RequestState(req, asyncio.Queue(), prefill.hello.worker_id)
        # With both roles in one process the KV stays where it was computed.
        local = "decode" in prefill.hello.roles and self.settings.colocate
        self.requests[rid] = st
        prefill.assigned.add(rid)
        self.affinity.record(keys, prefill.hello.worker_id)
        m = self.metrics
        m.prompt_tokens.inc(len(req.prompt_tokens))
        outcome, last = "cancelled", None
        try:
            if req.images:
                await self._vision(st)
            sized_only = await self._prefill(st, local)
            while True:
                try:
                    item = await self._next_event(st)
                except EngineError as exc:
                    if not (sized_only and last is None and exc.status == 503):
                        raise
                    # A picture's features went from the cache service since a vision worker stored them.
                    for im in req.images:
                        self._stored_images.pop(im.content_hash, None)
                    sized_only = await self._prefill(st, local, pixels=True)
                    continue
                now = time.monotonic()
                (m.ttft if last is None else m.itl).observe(now - (st.started if last is None else last))
                last = now
                m.generation_tokens.inc()
                if item.finish_reason is not None:
                    st.phase, outcome = "done", "ok"
                    m.duration.observe(now - st.started)
                yield item
                if st.phase == "done":
                    return
        except EngineError as exc:
            outcome = str(exc.status)
            raise
        finally:
            m.requests.labels(status=outcome).inc()
            await self._finish(st)

    async def _prefill(self, st: RequestState, local: bool, pixels: bool = False) -> bool:
        """Send the request to its prefill worker. A picture whose features a
        vision worker stored goes by its size alone (unless `pixels`): prefill
        takes its features from the cache service, or needs none when it is
        in the cached prefix, and a 1024x1024 picture's 3 MB cost ~1 ms of
        every turn about it. If they are gone, prefill answers 503 and the
        request comes again with its pixels. Returns whether any went without."""
        images = [im if pixels or im.content_hash not in self._stored_images else _sized_only(im)
                  for im in st.req.images]
        if not await self._send(st.prefill_worker, PrefillRequest(
                st.req.request_id, list(st.req.prompt_tokens), st.req.sampling,
                st.prefill_worker if local else "", images)):
            raise EngineError(503, "prefill worker unreachable; retry shortly", retry_after=1.0)
        return any(a is not b for a, b in zip(images, st.req.images))

    async def _next_event(self, st: RequestState):
        """The request's next event from the workers, within its whole-request
        deadline; an EngineError event is raised."""
        deadline = st.started + self.settings.request_timeout_s
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns an event that arrives
            # in the instant its task is cancelled and drops the cancel, and the
            # request went on decoding for a client that had gone.
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                item = await st.events.get()
        except TimeoutError:
            raise EngineError(504, f"request exceeded {self.settings.request_timeout_s:.0f}s") from None
        if isinstance(item, EngineError):
            raise item
        return item

    async def _vision(self, st: RequestState) -> None:
        """Have a vision worker store the images' embeddings (encoding those
        the cache service lacks) before prefill. Without one alive, or when
        a vision worker already stored every one of them, prefill takes what
        it needs from the cache service (encoding only what was evicted)."""
        ready = self._ready_with("vision")
        hashes = [im.content_hash for im in st.req.images]
        if not ready or all(h in self._stored_images for h in hashes):
            for h in hashes:
                if h in self._stored_images:
                    self._stored_images.move_to_end(h)
            return
        w = min(ready, key=lambda w: (w.load(), w.hello.running + w.hello.waiting))
        rid = st.req.request_id
        w.assigned.add(rid)
        try:
            if not await self._send(w.hello.worker_id, VisionRequest(rid, list(st.req.images))):
                return
            item = await self._next_event(st)
            st.vision = item
            for h in hashes:
                self._stored_images[h] = None
                self._stored_images.move_to_end(h)
            while len(self._stored_images) > STORED_IMAGES_KEPT:
                self._stored_images.popitem(last=False)
            m = self.metrics
            m.vision_queries.inc(item.encoded + item.cached)
            m.vision_hits.inc(item.cached)
            if item.encoded:
                m.vision_encode.observe(item.encode_s)
        finally:
            w.assigned.discard(rid)

    async def _finish(self, st: RequestState) -> None:
        rid = st.req.request_id
        self.requests.pop(rid, None)
        for wid in (st.prefill_worker, st.decode_worker):
            w = self.workers.get(wid)
            if w is not None:
                w.assigned.discard(rid)
        if st.phase == "done":
            return
        # The client left or the request failed: stop the work wherever it is.
        targets = {st.prefill_worker} if st.phase == "prefill" else {st.decode_worker}
        for wid in targets:
            if wid in self.workers:
                await self._send(wid, Cancel(rid))

    # ------------------------------------------------------------ inbound --
    async def _receive_loop(self) -> None:
        while True:
            try:
                peer, msg = await transport.arecv(self._sock, routed=True)
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
            self._on_hello(wid, msg)
        elif isinstance(msg, TokenBatch):
            for u in msg.updates:
                st = self.requests.get(u.request_id)
                if st is not None:
                    st.events.put_nowait(EngineEvent(u.token, u.logprob, u.finish_reason))
        elif isinstance(msg, VisionDone):
            st = self.requests.get(msg.request_id)
            if st is not None:
                st.events.put_nowait(msg)
        elif isinstance(msg, PrefillDone):
            await self._on_prefill_done(wid, msg)
        elif isinstance(msg, KVHandoff):
            await self._on_handoff(wid, msg)
        elif isinstance(msg, RequestFailed):
            st = self.requests.get(msg.request_id)
            if st is not None:
                st.events.put_nowait(EngineError(msg.status, msg.message))
        else:
            log.error("unexpected %s from worker %s", type(msg).__name__, wid)

    def _on_hello(self, wid: str, hello: WorkerHello) -> None:
        w = self.workers.get(wid)
        if w is None:
            if hello.state == "stopping":
                return
            log.info("worker %s (%s, pid %d) connected: %s", wid, "+".join(hello.roles), hello.pid, hello.state)
            self.workers[wid] = WorkerState(hello, time.monotonic())
            return
        if w.hello.pid != hello.pid:  # restarted under the same id: the old one is dead
            self._drop_worker(wid, "was replaced by a new process")
            self._on_hello(wid, hello)
            return
        if w.hello.state != hello.state:
            log.info("worker %s (pid %d): %s -> %s", wid, hello.pid, w.hello.state, hello.state)
        w.hello, w.last_seen = hello, time.monotonic()
        if hello.state == "stopping":
            self._drop_worker(wid, "is stopping")

    async def _on_prefill_done(self, wid: str, done: PrefillDone) -> None:
        st = self.requests.get(done.request_id)
        if st is None:  # the client left while prefill ran
            if done.handoff is not None:
                await self._free(done.handoff)
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
        st.events.put_nowait(EngineEvent(done.first_token, done.logprob, done.finish_reason, done.cached_tokens))
        st.first_token = done.first_token
        if done.finish_reason is None and done.handoff is not None:
            await self._on_handoff(wid, done.handoff)

    async def _on_handoff(self, wid: str, h: KVHandoff) -> None:
        """The prompt's KV is ready: pass the request to a decode worker."""
        st = self.requests.get(h.request_id)
        if st is None or st.phase != "prefill" or st.first_token is None:
            await self._free(h)  # the client left, or the request already failed
            return
        if h.local:
            self.metrics.handoff_tokens.labels("local").inc(h.num_tokens)
            decode = self.workers.get(wid)
        else:
            self.metrics.handoff.observe(h.write_ms / 1000)
            self.metrics.handoff_tokens.labels("copied").inc(h.num_tokens - h.blocks.tokens)
            self.metrics.handoff_tokens.labels("referenced").inc(h.blocks.tokens)
            try:
                decode = self._pick("decode")
            except EngineError as exc:
                await self._free(h)
                st.events.put_nowait(exc)
                return
        if decode is None:
            st.events.put_nowait(EngineError(502, f"worker {wid} vanished after prefill"))
            return
        st.phase, st.decode_worker = "decode", decode.hello.worker_id
        if st.prefill_worker in self.workers:
            self.workers[st.prefill_worker].assigned.discard(h.request_id)
        decode.assigned.add(h.request_id)
        ok = await self._send(st.decode_worker, DecodeRequest(
            h.request_id, list(st.req.prompt_tokens), st.first_token, h, st.req.sampling, generated=1,
            media=[im.content_hash for im in st.req.images]))
        if not ok:
            await self._free(h)
            st.events.put_nowait(EngineError(502, "decode worker unreachable"))

    async def _free(self, handoff) -> None:
        """A handoff that no decode worker will take: its allocation and its
        blocks' lease go back now rather than when their TTL ends."""
        if handoff.local:
            return
        try:
            if handoff.allocation >= 0:
                await self._cache.free(allocations=[handoff.allocation], arena=handoff.arena)
            await self._cache.release(handoff.blocks.lease)
        except CacheUnavailable:
            pass  # the reservation's and the lease's TTLs free them

    # ---------------------------------------------------------- watchdog --
    def _drop_worker(self, wid: str, why: str) -> None:
        w = self.workers.pop(wid, None)
        if w is None:
            return
        self.affinity.forget(wid)
        log.warning("worker %s (%s, pid %d) %s; failing %d request(s)", wid, "+".join(w.hello.roles),
                    w.hello.pid, why, len(w.assigned))
        for rid in w.assigned:
            st = self.requests.get(rid)
            if st is not None:
                st.events.put_nowait(EngineError(
                    502, f"{'+'.join(w.hello.roles)} worker (pid {w.hello.pid}) {why} during this request"))

    async def _watch_loop(self) -> None:
        while True:
            now = time.monotonic()
            for wid, w in list(self.workers.items()):
                if now - w.last_seen > self.settings.heartbeat_timeout_s:
                    self._drop_worker(wid, f"missed heartbeats for {now - w.last_seen:.1f}s")
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


def _sized_only(im: ImageInput) -> ImageInput:
    """The picture (or video) known by its size alone: its pixels' shape with
    no channels, which is all prefill needs to place cached features."""
    if not isinstance(im.pixels, np.ndarray) or not im.pixels.size:
        return im
    return replace(im, pixels=np.empty(im.pixels.shape[:-1] + (0,), np.uint8))
