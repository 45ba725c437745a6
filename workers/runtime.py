"""A worker process: one or more roles (prefill, decode) over one copy of the weights.

The main thread owns every MLX call: it loads the model, runs prefill chunks
and decode steps, and reads/writes KV in the shared-memory arena. The socket
loop thread (workers.socket_loop) moves messages to and from the router.

Scheduling inside the process is simple and bounded: between any two units of
MLX work (one prefill chunk, one decode step) the inbox is drained, so a
cancel lands within one step, and with both roles prefill chunks and decode
steps alternate, so a long prompt never freezes the streams for its whole
prefill.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from collections import deque

import zmq

from cache_service.arena import ArenaAttachment
from cache_service.client import CacheClient, CacheUnavailable
from deploy.logs import setup_logging
from deploy.settings import Settings
from protos import transport
from protos.messages import (
    Cancel,
    DecodeRequest,
    KVHandoff,
    PrefillDone,
    PrefillRequest,
    RequestFailed,
    TokenBatch,
    VisionDone,
    VisionRequest,
    WorkerHello,
)
from workers.loop_clock import LoopClock, part, tally_line
from workers.model_store import is_vlm
from workers.prefill_mlx import first_token_finishes
from workers.socket_loop import Outbox, SocketLoop

log = logging.getLogger(__name__)

# Handoff reservations outlive any sane gap between prefill and decode, and
# still free themselves when a decode worker dies holding one.
HANDOFF_TTL_S = 120.0
# Prefix-cache calls get a short deadline of their own: the service answers
# in microseconds when alive, and a request is better off computing its
# prompt than waiting the full cache_call_timeout_s for an optimisation.
PREFIX_CALL_TIMEOUT_S = 1.0
# The store thread's sends give up after this (the socket loop has stopped;
# the router's deadline then fails the request) rather than block for ever.
HANDOFF_SEND_S = 5.0
# A handoff's copy on the reader thread takes milliseconds; past this the
# request fails rather than hold the decode loop.
HANDOFF_READ_S = 30.0


class Worker:
    def __init__(self, settings: Settings, roles: list[str], worker_id: str, ctx: zmq.Context, loop: SocketLoop):
        self.settings = settings
        self.roles = roles
        self.worker_id = worker_id
        self.ctx = ctx
        self.loop = loop
        self.hello = loop.hello
        self.outbox: Outbox | None = None
        self.cache: CacheClient | None = None
        self.prefix_client: CacheClient | None = None
        self.prefix = None  # workers.prefix_cache.PrefixCache or SnapshotCache; None when caching is off
        self.stores = None  # workers.store_thread.StoreThread: block stores off the MLX thread
        self.arenas = ArenaAttachment()  # re-attaches when a restarted cache service has a new arena
        self.prefill = None
        self.vision = None  # workers.vision.VisionEngine when the model takes images
        self.embeddings = None  # workers.vision_cache.EmbeddingStore: image features in the cache service
        self.decode = None
        # A CUDA decode worker copies handoffs out of the arena on a thread
        # (`reader`): DecodeRequests wait here, in arrival order, with the
        # copy's future (None: nothing to copy), until start_decode.
        self.reader = None
        self.reading: deque[tuple] = deque()
        self.prefill_queue: deque[PrefillRequest] = deque()
        self.vision_queue: deque[VisionRequest] = deque()
        self.current = None  # (PrefillRequest, incremental prefill job)
        self.local_kv: dict[str, list] = {}  # colocated handoffs: the KV never leaves the process
        self.held: dict = {}  # request id -> its blocks' hold (or None), leased before a batched pass
        self.stopping = False
        self.clock = LoopClock(f"worker {worker_id}")

    # ------------------------------------------------------------ set-up --
    def load(self) -> None:
        from workers.decode import DecodeEngine
        from workers.prefix_cache import make_prefix_cache
        from workers.loading import context_length, hot_kv_bytes, load_model, on_cpu, on_cuda, size_buffer_cache
        from workers.prefill_mlx import PrefillEngine

        t0 = time.perf_counter()
        size_buffer_cache(len(self.settings.worker_plan()))
        self.cache = CacheClient(self.settings)
        self.prefix_client = self.prefix_cache_client()
        model = None
        if "prefill" in self.roles or "decode" in self.roles:
            model, _tokenizer = load_model(self.settings.model_dir)
            hot = self.settings.hot_kv_bytes
            if hot is None:
                import mlx.core as mx

                hot = hot_kv_bytes(on_cpu(), mx.device_info(), len(self.settings.worker_plan()))
            self.prefix = make_prefix_cache(model, self.settings.model_dir, self.settings.block_size,
                                            self.prefix_client, lambda name: self.arenas.get(name).buf,
                                            hot_bytes=hot)
        if "prefill" in self.roles:
            self.prefill = PrefillEngine(model, chunk_size=self.settings.prefill_chunk, prefix=self.prefix)
        if ("prefill" in self.roles or "vision" in self.roles) and is_vlm(self.settings.model_dir):
            self.load_vision(model)
        if "decode" in self.roles:
            self.decode = DecodeEngine(model, max_batch=self.settings.max_batch, prefix=self.prefix)
        if model is not None and self.settings.warm_up:
            from workers.warm_up import warm_up

            batch = self.prefill is not None and self.settings.prefill_batch > 1
            log.info("worker %s warmed up in %.2fs", self.worker_id, warm_up(model, self.decode, batch))
        self.outbox = Outbox(self.ctx)
        blocks = getattr(self.prefix, "kind", "") == "blocks"
        # A prefill's stores need the hot tier (without it, the next prompt
        # would miss blocks still being stored); a decode worker's send the
        # last token after the commit, and pay off only on a GPU (a CPU's
        # copies are cheap, and read KV that its batch still writes).
        prefill_stores = self.prefill is not None and blocks and self.prefix.hot.enabled
        decode_stores = self.decode is not None and blocks and not on_cpu()
        if prefill_stores or decode_stores:
            from workers.store_thread import StoreThread

            outbox = self.outbox
            self.stores = StoreThread(self.prefix, self.prefix_cache_client(),
                                      lambda msg: outbox.send(msg, wait_s=HANDOFF_SEND_S))
            if decode_stores:
                self.decode.stores = self.stores
        if self.decode is not None and on_cuda():
            # On CUDA a handoff's copy into managed memory is ~8 ms that the
            # decode loop would otherwise stand still for. The reader only
            # creates arrays (MLX's CUDA allocator takes a lock); elsewhere
            # MLX stays on one thread, as DESIGN.md says (Metal crashes when
            # two threads touch MLX), and the copy is ~1 ms on a CPU.
            from concurrent.futures import ThreadPoolExecutor

            self.reader = ThreadPoolExecutor(1, thread_name_prefix="handoff-read")
        self.hello.max_context = context_length(self.settings.model_dir)
        self.hello.state = "ready"
        log.info("worker %s %s ready in %.1fs (pid %d)", self.worker_id, "+".join(self.roles),
                 time.perf_counter() - t0, os.getpid())

    def prefix_cache_client(self) -> CacheClient:
        """A cache client with the prefix cache's short deadline (one per thread)."""
        return CacheClient(self.settings, timeout_s=min(self.settings.cache_call_timeout_s, PREFIX_CALL_TIMEOUT_S))

    def load_vision(self, text_model) -> None:
        """The vision tower and projector (mlx-vlm). With a text model (a
        prefill worker) the language weights are the text model's; a
        vision-only worker keeps mlx-vlm's own."""
        from workers.block_hash import model_fingerprint
        from workers.vision import VisionEngine
        from workers.vision_cache import EmbeddingStore, preprocessing_settings

        self.vision = VisionEngine(self.settings.model_dir, text_model=text_model,
                                   encoder_only=text_model is None)
        self.embeddings = EmbeddingStore(
            self.prefix_client, lambda name: self.arenas.get(name).buf,
            model_fingerprint(self.settings.model_dir), preprocessing_settings(self.vision.processor))

    # ---------------------------------------------------------- main loop --
    def serve(self) -> None:
        self.clock = LoopClock(f"worker {self.worker_id}")  # from here: loading is not the loop's time
        for engine in (self.decode, self.prefill):
            if engine is not None:
                engine.clock = self.clock
        while not self.stopping:
            self.drain_inbox(block=not self.has_work())
            if self.stopping:
                break
            if self.vision_queue:
                req = self.vision_queue.popleft()
                with self.clock.phase("vision"):
                    self.guarded(req.request_id, self.encode_images, req)
            if self.prefill is not None and (self.current or self.prefill_queue):
                with self.clock.phase("prefill"):
                    self.guarded(self.current[0].request_id if self.current else self.prefill_queue[0].request_id,
                                 self.prefill_chunk)
            if self.reading:
                self.take_reads(wait=not (self.decode.has_work or self.current or self.prefill_queue))
            if self.decode is not None and self.decode.has_work:
                self.decode_step()
            if self.stores is not None:
                self.stores.release_done()  # what its finished jobs read, freed on this (MLX) thread
            self.update_load()
            self.clock.maybe_report()

    def has_work(self) -> bool:
        return bool(self.current or self.prefill_queue or self.vision_queue or self.reading
                    or (self.decode is not None and self.decode.has_work))

    def drain_inbox(self, block: bool) -> None:
        timeout = 0.25 if block else None
        while True:
            try:
                with self.clock.phase("wait"):
                    msg = self.loop.inbox.get(block=block, timeout=timeout) if block else self.loop.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if msg is None:  # stop signal from the socket loop or SIGTERM
                self.stopping = True
                return
            # Taking in a handoff (reading its KV from the arena) is timed here.
            with self.clock.phase(f"handle {type(msg).__name__}"):
                self.handle(msg)

    def handle(self, msg) -> None:
        if isinstance(msg, PrefillRequest) and self.prefill is not None:
            self.prefill_queue.append(msg)
        elif isinstance(msg, VisionRequest) and "vision" in self.roles and self.vision is not None:
            self.vision_queue.append(msg)
        elif isinstance(msg, DecodeRequest) and self.decode is not None:
            self.read_handoff(msg)
        elif isinstance(msg, Cancel):
            self.cancel(msg.request_id)
        else:
            log.error("worker %s (%s) ignores %s", self.worker_id, "+".join(self.roles), type(msg).__name__)

    def guarded(self, request_id: str, fn, *args) -> None:
        """Run one unit of work; a failure fails that request, never the process."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the client
            self.fail(request_id, exc)

    def fail(self, request_id: str, exc: Exception) -> None:
        """Drop a request that `exc` broke, and tell the router why."""
        log.error("request %s failed in worker %s", request_id, self.worker_id, exc_info=exc)
        self.cancel(request_id, save=False)
        status = 503 if isinstance(exc, CacheUnavailable) else 500
        self.outbox.send(RequestFailed(request_id, f"{type(exc).__name__}: {exc}", status))

    def cancel(self, request_id: str, save: bool = True) -> None:
        """Drop a request wherever it is. A decoding request's KV goes to the
        prefix cache (unless `save` is False: its batch is suspect)."""
        self.prefill_queue = deque(r for r in self.prefill_queue if r.request_id != request_id)
        dropped = [req for req, _ in self.reading if req.request_id == request_id]
        if dropped:
            self.reading = deque(e for e in self.reading if e[0].request_id != request_id)
            self.drop_handoff(dropped[0].handoff)
        if self.current and self.current[0].request_id == request_id:
            self.current = None
        self.local_kv.pop(request_id, None)
        self.unhold(request_id)
        if self.decode is not None:
            self.decode.cancel(request_id, save=save)

    def update_load(self) -> None:
        running = (1 if self.current else 0) + (self.decode.running if self.decode else 0)
        self.hello.running = running
        self.hello.waiting = (len(self.prefill_queue) + len(self.vision_queue) + len(self.reading)
                              + (self.decode.waiting if self.decode else 0))
        self.hello.kv_bytes = self.decode.kv_bytes if self.decode else 0
        hot = getattr(self.prefix, "hot", None)
        if hot is not None:
            self.hello.hot_kv_bytes, self.hello.hot_kv_hits = hot.nbytes, hot.hits

    # ------------------------------------------------------------ prefill --
    def prefill_chunk(self) -> None:
        if self.current is None:
            req = self.prefill_queue.popleft()
            self.current = (req, self.start_prefill(req))
        if self.prefill_queue and self.settings.prefill_batch > 1 and self.prefill_batch():
            return
        req, job = self.current
        result = job.step()
        if result is None:
            return
        self.current = None
        self.finish_prefill(req, job, result)

    def prefill_batch(self) -> bool:
        """Prefill the current prompt together with the queued ones behind
        it that fit one pass (workers/prefill_batch.py: a swarm's burst of
        short suffixes); False when it cannot join a batch. The first queued
        prompt that does not fit, its prefix loaded, becomes the current one."""
        from workers.prefill_batch import batchable, fits, run_batch
        from workers.prefill_mlx import PrefillJob

        req, job = self.current
        if type(job) is not PrefillJob:
            return False
        job.load()
        if not batchable(job):
            return False
        rows, spare = [(req, job)], None
        # A batch's handoffs all sit in the arena until decode takes them (one
        # prompt's used to be gone before the next was made): together they
        # take at most an eighth of it.
        room = self.settings.cache_memory_bytes // 8 - self.handoff_bytes(req, job)
        while self.prefill_queue and len(rows) < self.settings.prefill_batch and not self.prefill_queue[0].images:
            nxt = self.prefill_queue.popleft()
            try:
                other = self.start_prefill(nxt)
                other.load()
                joins = batchable(other) and fits([j for _, j in rows], other)
                nbytes = self.handoff_bytes(nxt, other) if joins else 0
            except Exception as exc:  # noqa: BLE001 - that request fails, not the batch
                self.fail(nxt.request_id, exc)
                continue
            if not joins or nbytes > room:
                spare = (nxt, other)
                break
            room -= nbytes
            rows.append((nxt, other))
        self.current = spare
        if len(rows) == 1:  # alone after all: batchable, so one step
            self.guarded(req.request_id, lambda: self.finish_prefill(req, job, job.step()))
            return True
        try:
            results = run_batch([j for _, j in rows])
        except Exception as exc:  # noqa: BLE001 - a broken pass fails its rows, not the worker
            for r, _ in rows:
                self.fail(r.request_id, exc)
            return True
        self.clock.count("batched prompts", len(rows))
        self.hello.batched_prompts += len(rows)
        for (r, j), result in zip(rows, results):
            self.guarded(r.request_id, self.finish_prefill, r, j, result)
        return True

    def handoff_bytes(self, req: PrefillRequest, job) -> int:
        """The KV a batch's row will put in the arena (0 colocated), its
        blocks held for it now (`held`): what the cache service lacks."""
        if self.keeps_kv(req):
            return 0
        if req.request_id not in self.held:  # a prompt that did not fit the last batch holds its blocks still
            self.held[req.request_id] = self.hold_blocks(req, job, job.cache, job.total)
        hold = self.held[req.request_id]
        by_ref = len(hold.hashes) * self.prefix.block_size if hold is not None else 0
        return (job.total - by_ref) * self.prefill.token_nbytes()

    def unhold(self, request_id: str) -> None:
        hold = self.held.pop(request_id, None)
        if hold is not None:
            self.prefix.release(hold.lease)

    def finish_prefill(self, req: PrefillRequest, job, result) -> None:
        """A prompt is prefilled: its first token out, then its KV handed
        off (or kept, colocated) and its new blocks stored."""
        first = result.first_token
        finish = first_token_finishes(first, req.sampling)
        local = finish is not None or self.keeps_kv(req)
        if local:
            self.unhold(req.request_id)  # a batch's row that ended at its first token
        handoff = None  # None: the KVHandoff follows PrefillDone
        if local:  # nothing to hand over, or the KV stays in this process
            handoff = KVHandoff(req.request_id, result.num_tokens, result.rope_offset, local=True)
            if finish is None:
                self.local_kv[req.request_id] = result.cache
        self.outbox.send(PrefillDone(req.request_id, first, handoff, result.logprob, finish,
                                     result.prefill_ms, cached_tokens=result.cached_tokens,
                                     images_encoded=getattr(job, "encoded", 0),
                                     images_cached=getattr(job, "skipped", 0),
                                     encode_s=getattr(job, "encode_s", 0.0)))
        # The first token is on its way; the KV copy to the arena follows
        # (with a store thread, the copy itself is that thread's: `staged`).
        staged = [] if self.stores is not None else None
        if not local:
            if req.request_id in self.held:  # a batch's row: leased before its pass
                hold = self.held.pop(req.request_id)
            else:
                with part(self.clock, "hold blocks", job.parts):
                    hold = self.hold_blocks(req, job, result.cache, result.num_tokens)
            with part(self.clock, "hand off", job.parts):
                handoff = self.hand_off(req, result, hold, staged)
        # The prompt's new blocks: from the handoff's tail, in host memory (a
        # host copy, not another transfer from the device), before the
        # handoff is sent, after which a decode worker may free the tail and
        # another prefill worker reuse it. The tail's copy, the blocks' copy
        # and the commit, and then the handoff, are the store thread's when
        # there is one; so is a colocated prompt's blocks' copy (from device
        # copies: on an H100 swarm ~29 ms a prompt on the MLX thread).
        later = []
        with part(self.clock, "store", job.parts):
            self.after_reply("prefix store", lambda: job.save_prefix(
                host=None if local else self.handoff_tail(handoff), later=later.append if self.stores else None))
        prepared = later[0] if later else None
        kept = prepared.kept if prepared is not None else []
        message = None if local else handoff
        if staged:
            copy, held = staged[0]
            self.stores.submit(prepared, message, copy=copy, keep=list(held) + kept, failed=RequestFailed(
                req.request_id, "the KV handoff could not be written to shared memory", 500))
        elif prepared is not None:
            self.stores.submit(prepared, message, keep=kept)
        elif not local:
            self.outbox.send(handoff)
        log.debug("prefill %s: %d tokens, %d cached, %.1f ms to the first token (%s)", req.request_id,
                  result.num_tokens, result.cached_tokens, result.prefill_ms, tally_line(job.parts))

    # ------------------------------------------------------------- vision --
    def encode_images(self, req: VisionRequest) -> None:
        """Store every image's (or video's) embedding that the cache service lacks."""
        done, seen = VisionDone(req.request_id), set()
        for im in req.images:
            repeated = im.content_hash in seen
            seen.add(im.content_hash)
            if repeated or self.embeddings.has(im.content_hash, req.request_id):
                done.cached += 1
                continue
            t0 = time.perf_counter()
            features = self.vision.encode(self.vision.preprocess_input(im))
            done.encode_s += time.perf_counter() - t0
            done.encoded += 1
            self.embeddings.put(im.content_hash, features, req.request_id)
        self.outbox.send(done)

    def start_prefill(self, req: PrefillRequest):
        if not req.images:
            return self.prefill.start(req.prompt_tokens, req.sampling, owner=req.request_id)
        if self.vision is None:
            raise ValueError("this model does not take images")
        from workers.prefill_vlm import VLMPrefillJob

        job = VLMPrefillJob(self.vision, req.prompt_tokens, req.images, req.sampling,
                            chunk_size=self.settings.prefill_chunk, owner=req.request_id, prefix=self.prefix,
                            embeddings=self.embeddings)
        job.clock = self.clock
        return job

    def after_reply(self, what: str, fn) -> None:
        """Work done after the client's answer is on its way: a failure is
        logged, never reported (the request already succeeded)."""
        try:
            fn()
        except Exception:  # noqa: BLE001
            log.exception("%s failed in worker %s", what, self.worker_id)

    def keeps_kv(self, req: PrefillRequest) -> bool:
        """Whether this worker decodes what it prefills for `req` (colocated)."""
        return req.decode_worker == self.worker_id and self.decode is not None

    def hold_blocks(self, req: PrefillRequest, job, cache, num_tokens: int):
        """For a handoff by reference: lease the prompt's leading full blocks
        that the cache service already has (its cached prefix, mostly) for the
        request. The decode worker takes most of them from its own memory (a
        swarm's system prompt, the conversation it answered last turn), so
        only the rest crosses the arena, in the handoff's tail. The prompt's
        new blocks are stored from that tail (prefill_chunk), not before it
        is written: storing them first copied them off the device twice, and
        put a reserve, a copy and a commit (~15 ms on the H100) between every
        first token and its decode. A prompt with images
        is held under its image-aware block keys. None when the handoff must
        carry all the KV: no block cache, a cache that is not plain KV
        (Gemma 3's sliding window)."""
        from workers.kv_transfer import is_plain_kv

        if (self.prefix is None or getattr(self.prefix, "kind", "") != "blocks"
                or not is_plain_kv(cache) or len(req.prompt_tokens) != num_tokens):
            return None
        hold = self.prefix.hold(req.prompt_tokens, owner=req.request_id, lease_s=HANDOFF_TTL_S,
                                per_block=getattr(job, "per_block", None))
        return hold if hold.hashes else None

    def handoff_tail(self, h: KVHandoff):
        """(first token, host views) of a handoff's plain-KV tail in the
        arena, as PrefixCache.store's `host`; None when it has none."""
        from workers.kv_transfer import arena_kv_views

        if not h.layers or h.cache_meta:
            return None
        return h.block_tokens, arena_kv_views(self.arenas.get(h.arena).buf, h.layers)

    def hand_off(self, req: PrefillRequest, result, hold=None, staged: list | None = None) -> KVHandoff:
        """Put the prompt's KV in the arena, where a decode worker will find it
        (after `hold`'s blocks only, when given: those are referred to). With
        `staged` (a list) the copy into the arena is left to the caller:
        (copy, held) is appended (kv_transfer.stage_encoded's)."""
        from workers.hot_blocks import tail_of
        from workers.kv_transfer import cache_dtype_name, encode_cache, stage_encoded

        t0 = time.perf_counter()
        cache, by_ref = result.cache, {}
        if hold is not None:
            skip = len(hold.hashes) * self.prefix.block_size
            cache = tail_of(cache, skip) if skip < result.num_tokens else None
            by_ref = dict(block_hashes=hold.hashes, block_offsets=hold.offsets, block_arena=hold.arena,
                          block_lease=hold.lease, block_tokens=skip)
        dtype = cache_dtype_name(result.cache)
        if cache is None:  # the prompt ends on a block boundary: all of it is referred to
            return KVHandoff(req.request_id, result.num_tokens, result.rope_offset, kv_dtype=dtype, **by_ref)
        # Any mlx-lm cache: plain KV as [keys, values] per layer (no meta),
        # sliding-window / recurrent layers as class + state (cache_meta).
        enc = encode_cache(cache)
        nbytes = enc.nbytes
        reply = self.cache.alloc(nbytes, owner=req.request_id, ttl_s=HANDOFF_TTL_S)
        if not reply.ok:
            if hold is not None:
                self.prefix.release(hold.lease)
            raise CacheUnavailable(f"KV handoff of {nbytes} bytes refused: {reply.error}")
        layers, copy, held = stage_encoded(self.arenas.get(reply.arena).buf, reply.offset, enc)
        if staged is None:
            copy()
        handoff = KVHandoff(req.request_id, result.num_tokens, result.rope_offset, arena=reply.arena,
                            allocation=reply.allocation, layers=layers, kv_dtype=dtype, bytes_moved=nbytes,
                            write_ms=(time.perf_counter() - t0) * 1000, cache_meta=enc.meta, **by_ref)
        if staged is not None:
            def timed_copy():  # the handoff's write time counts its copy, wherever it runs
                t = time.perf_counter()
                copy()
                handoff.write_ms += (time.perf_counter() - t) * 1000

            staged.append((timed_copy, held))
        log.debug("handoff %s: %s %d bytes in %.2f ms (%d tokens by reference)", req.request_id,
                  "wrote" if staged is None else "laid out", nbytes, handoff.write_ms, by_ref.get("block_tokens", 0))
        return handoff

    # ------------------------------------------------------------- decode --
    def read_handoff(self, req: DecodeRequest) -> None:
        """Start a decode request, or with a reader thread queue it behind
        the copy of its handoff (and behind those queued before it)."""
        from workers.kv_transfer import copy_kv

        h, copies = req.handoff, None
        if self.reader is not None and h.layers and not h.local and not h.cache_meta:
            copies = self.reader.submit(copy_kv, self.arenas.get(h.arena).buf, h.layers)
        elif not self.reading:  # nothing to copy, and nothing queued before it
            self.guarded(req.request_id, self.start_decode, req)
            return
        self.reading.append((req, copies))

    def take_reads(self, wait: bool) -> None:
        """Start the queued decode requests whose copies are done, in order;
        with `wait`, wait for them (the loop has nothing else to do)."""
        from concurrent.futures import wait as wait_for

        while self.reading:
            req, copies = self.reading[0]
            if copies is not None and not copies.done():
                if not wait:
                    return
                with self.clock.phase("wait"):
                    wait_for([copies], timeout=HANDOFF_READ_S)
            self.reading.popleft()
            with self.clock.phase("handle DecodeRequest"):
                self.guarded(req.request_id, self.start_decode, req, copies)

    def drop_handoff(self, h: KVHandoff) -> None:
        """Give back what a handoff holds in the cache service (a request
        cancelled before it started decoding); their TTLs end them otherwise."""
        try:
            if h.allocation >= 0:
                self.cache.free(allocations=[h.allocation], arena=h.arena, wait=False)
            if h.block_hashes:
                self.cache.release(h.block_lease)
        except CacheUnavailable:
            pass

    def start_decode(self, req: DecodeRequest, copies=None) -> None:
        """Take a request's KV (colocated, from the arena, or `copies`: the
        reader thread's future of copy_kv) and add it to the decode batch."""
        from workers.hot_blocks import join
        from workers.kv_transfer import kv_from_copies, read_cache

        h = req.handoff
        if h.local:
            cache = self.local_kv.pop(req.request_id, None)
            if cache is None:
                raise RuntimeError("colocated KV for this request is gone (cancelled or never prefilled here)")
        else:
            t0 = time.perf_counter()
            cache = None
            if h.layers:
                with self.clock.part("read handoff"):
                    if copies is not None:
                        cache = kv_from_copies(copies.result(timeout=0), h.layers)
                    else:
                        cache = read_cache(self.arenas.get(h.arena).buf, h.layers, h.cache_meta)
            if h.allocation >= 0:  # the arena slot is free to reuse once the KV is ours
                self.cache.free(allocations=[h.allocation], arena=h.arena, wait=False)
            if h.block_hashes:
                with self.clock.part("take blocks"):
                    blocks = self.take_blocks(h)
                with self.clock.part("join"):
                    cache = join(blocks, cache)
            log.debug("handoff %s: read %d bytes and %d tokens by reference in %.2f ms (write took %.2f ms)",
                      req.request_id, h.bytes_moved, h.block_tokens, (time.perf_counter() - t0) * 1000, h.write_ms)
        with self.clock.part("add"):
            self.decode.add(req, cache)

    def take_blocks(self, h: KVHandoff) -> list:
        """The blocks a handoff refers to (see KVHandoff.block_hashes)."""
        bs = getattr(self.prefix, "block_size", 0)
        if getattr(self.prefix, "kind", "") != "blocks" or h.block_tokens != len(h.block_hashes) * bs:
            try:
                self.cache.release(h.block_lease)
            except CacheUnavailable:
                pass  # its TTL ends it
            raise ValueError(f"handoff refers to {len(h.block_hashes)} blocks of {h.block_tokens} tokens; "
                             f"this worker's prefix cache has blocks of {bs}")
        return self.prefix.take([bytes(x) for x in h.block_hashes], h.block_arena, h.block_offsets, h.block_lease)

    def decode_step(self) -> None:
        try:
            with self.clock.phase("decode step"):
                updates = self.decode.step()
        except Exception as exc:  # noqa: BLE001 - a broken batch fails its requests, not the worker
            log.exception("decode step failed in worker %s", self.worker_id)
            ended = self.decode.abandon_commits()  # finished before the failure: their answers stand
            if ended:
                self.outbox.send(TokenBatch(ended))
            for rid in self.decode.request_ids():
                self.decode.cancel(rid, save=False)
                self.outbox.send(RequestFailed(rid, f"decode failed: {type(exc).__name__}: {exc}", 500))
            return
        # A request's last token comes back from step() only once its KV is
        # committed to the prefix cache (workers/decode.py): an agent sends
        # its next turn the moment it has the answer, and that turn must find
        # the answer's blocks.
        self.clock.count("tokens", len(updates))
        if updates:
            self.outbox.send(TokenBatch(updates))

    def close(self) -> None:
        if self.reader:
            self.reader.shutdown(wait=True, cancel_futures=True)
        if self.stores:
            self.stores.close()  # its queued handoffs go out first
        if self.outbox:
            self.outbox.close()
        if self.cache:
            self.cache.close()
        if self.prefix_client:
            self.prefix_client.close()
        self.arenas.close()


def run(settings: Settings, roles: list[str], worker_id: str) -> None:
    """Process main for a worker (a `spawn` target)."""
    from workers.loading import set_cuda_graphs

    set_cuda_graphs()  # before any GPU work: MLX reads it once
    setup_logging(settings.log_level, f"worker:{worker_id}")
    ctx = zmq.Context()
    hello = WorkerHello(worker_id=worker_id, roles=list(roles), pid=os.getpid(), state="loading",
                        model_id=settings.model_id)
    loop = SocketLoop(ctx, transport.ipc_address(settings.run_dir, "router"), hello, settings.heartbeat_interval_s)
    worker = Worker(settings, roles, worker_id, ctx, loop)

    def on_signal(signum, _frame):
        worker.stopping = True
        loop.inbox.put(None)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    loop.start()
    try:
        worker.load()
        _serve_profiled(worker, os.environ.get("TANDEM_PROFILE_DIR"))
    finally:
        if worker.stores:
            worker.stores.close()  # while the socket loop runs: its queued handoffs still go out
        loop.stopping.set()
        loop.join(timeout=2)
        worker.close()
        ctx.term() if not loop.is_alive() else None
        log.info("worker %s stopped", worker_id)


def _serve_profiled(worker: Worker, profile_dir: str | None) -> None:
    """Serve; with TANDEM_PROFILE_DIR set, under cProfile, its stats written
    there at stop (worker-<id>-<pid>.pstats): where a slow loop's time goes,
    function by function, on a machine that has no other profiler."""
    if not profile_dir:
        worker.serve()
        return
    import cProfile

    prof = cProfile.Profile()
    try:
        prof.runcall(worker.serve)
    finally:
        os.makedirs(profile_dir, exist_ok=True)
        path = os.path.join(profile_dir, f"worker-{worker.worker_id}-{os.getpid()}.pstats")
        prof.dump_stats(path)
        log.info("profile written to %s", path)
