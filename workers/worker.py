"""A worker process's loop: one or more roles (prefill, decode, vision) over
one copy of the weights.

The main thread owns every MLX call: it loads the model, then runs the
schedule below, in which each role (workers/prefill/role.py,
workers/decode/role.py, workers/vision/role.py) does one unit of MLX work
at a time. The socket loop thread (workers/socket_loop.py) moves messages
to and from the router; the process main is workers/main.py.

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
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import zmq

from cache_service.arena import ArenaAttachment
from cache_service.client import CacheClient
from environment.backend import on_cpu, on_cuda
from environment.model_folder import context_length, is_vlm
from environment.settings import Settings
from environment.power.policy import decide
from environment.power.readers import read_power
from protos.messages import Cancel, DecodeRequest, PrefillRequest, VisionRequest, WorkerLimits
from workers.decode.engine import DecodeEngine
from workers.decode.speculation import speculation_for
from workers.decode.role import DecodeRole
from workers.grammar import Grammars, logits_width
from workers.group.handoff_shards import own_part
from workers.group.prefix_agreement import group_prefix, min_and_max
from workers.kv.prefix_cache import make_prefix_cache
from workers.kv.store_thread import StoreThread
from workers.loop_clock import LoopClock
from workers.memory_relief import relieve_memory
from workers.models.loading import hot_kv_bytes, load_model, size_buffer_cache
from workers.models.sharding import shard_model
from workers.prefill.ane.backend import make_ane_body
from workers.prefill.engine import PrefillEngine
from workers.prefill.role import PrefillRole
from workers.role import request_failed
from workers.socket_loop import Outbox, SocketLoop
from workers.vision.role import VisionRole, load_vision
from workers.warm_up import warm_up

log = logging.getLogger(__name__)

# Prefix-cache calls get a short deadline of their own: the service answers
# in microseconds when alive, and a request is better off computing its
# prompt than waiting the full cache_call_timeout_s for an optimisation.
PREFIX_CALL_TIMEOUT_S = 1.0
# The store thread's sends give up after this (the socket loop has stopped;
# the router's deadline then fails the request) rather than block for ever.
HANDOFF_SEND_S = 5.0


class Worker:
    """The sockets, the inbox and the schedule of one worker process, over
    the roles `load` builds for `roles` (names: "prefill", "decode", "vision")."""

    def __init__(self, settings: Settings, roles: list[str], worker_id: str, ctx: zmq.Context, loop: SocketLoop,
                 group=None):
        self.settings = settings
        # A tensor-parallel group's mx.distributed.Group (workers/group/): the
        # model is this rank's shard; None: a worker alone, the whole model.
        self.group = group
        self.role_names = roles
        self.worker_id = worker_id
        self.ctx = ctx
        self.loop = loop
        self.hello = loop.hello
        self.outbox: Outbox | None = None
        self.cache: CacheClient | None = None
        self.prefix_client: CacheClient | None = None
        self.prefix = None  # workers.kv.prefix_base.PrefixCacheBase; None when caching is off
        self.stores: StoreThread | None = None  # block stores off the MLX thread
        self.arenas = ArenaAttachment()  # re-attaches when a restarted cache service has a new arena
        self.prefill: PrefillRole | None = None
        self.decode: DecodeRole | None = None
        self.vision: VisionRole | None = None  # a VLM's; a prefill worker's too (images no vision worker encoded)
        self.roles: list = []  # the role objects, each cancelled and counted alike
        self.takes: dict[type, object] = {}  # request type -> the role that takes it
        self.local_kv: dict[str, list] = {}  # colocated handoffs: the KV never leaves the process
        self.stopping = False
        self.clock = LoopClock(f"worker {worker_id}")
        self.model = None
        self.cold = False  # the warm-up has not run (deferred by the power policy)
        self.defer_warm_up = False

    # ------------------------------------------------------------ set-up --
    def load(self) -> None:
        t0 = time.perf_counter()
        names = self.role_names
        size_buffer_cache(len(self.settings.worker_plan()))
        self.cache = CacheClient(self.settings)
        self.prefix_client = self.prefix_cache_client()
        model = prefill = decode = vision = grammars = None
        if "prefill" in names or "decode" in names:
            model, tokenizer = load_model(self.settings.model_dir, lazy=self.group is not None)
            if self.group is not None:
                shard_model(model, self.group, pipeline=self.settings.pipeline_parallel > 1)
            # A group's ranks each keep their own shard of every block and agree on each hit.
            self.prefix = self.make_prefix(model) if self.group is None else group_prefix(
                self.make_prefix(model), self.group, pipeline=self.settings.pipeline_parallel > 1)
            # Requests with a grammar (workers/grammar.py); llguidance's view of
            # the tokenizer is built beside the warm-up (no MLX in it).
            grammars = Grammars(tokenizer, logits_width(model))
            threading.Thread(target=grammars.prepare, name="grammar-tokenizer", daemon=True).start()
        if "prefill" in names:
            prefill = PrefillEngine(model, chunk_size=self.settings.prefill_chunk, prefix=self.prefix,
                                    grammars=grammars)
            prefill.ane = make_ane_body(model, self.settings)  # --prefill-backend ane|auto, on a Mac
            prefill.ane_mode, prefill.ane_min_tokens = self.settings.prefill_backend, self.settings.ane_min_tokens
            if self.group is not None and not self.settings.colocate:
                # A batch's room is counted in handoff bytes, which every rank must
                # count alike (a pipeline rank holds fewer layers than another).
                prefill.fix_token_nbytes(min_and_max(prefill.token_nbytes(), self.group)[1])
        if ("prefill" in names or "vision" in names) and is_vlm(self.settings.model_dir):
            vision = load_vision(self.settings.model_dir, model, self.prefix_client, self.arena_buf)
        if "decode" in names:
            decode = DecodeEngine(model, max_batch=self.settings.max_batch, prefix=self.prefix, grammars=grammars,
                                  speculation=speculation_for(self.settings, model))
        self.model, self.cold = model, model is not None and self.settings.warm_up
        # On battery in saver (environment/power/policy.py) the warm-up waits for a policy that allows it.
        # A group warms up at once, every rank in step (workers/group/).
        self.defer_warm_up = self.cold and self.group is None and decide(read_power(self.settings),
                                                                           self.settings).defer_warm_up
        if self.cold and not self.defer_warm_up:
            self.warm_up(prefill, decode)
        self.outbox = self.make_outbox()
        self.start_stores(prefill, decode)
        self.build_roles(prefill, decode, vision)
        self.hello.max_context = context_length(self.settings.model_dir)
        self.hello.max_batch = self.settings.max_batch if decode is not None else 0
        self.hello.state = "ready"
        log.info("worker %s %s ready in %.1fs (pid %d)", self.worker_id, "+".join(names),
                 time.perf_counter() - t0, os.getpid())

    def warm_up(self, prefill: PrefillEngine | None, decode: DecodeEngine | None) -> None:
        batch = prefill is not None and self.settings.prefill_batch > 1
        log.info("worker %s warmed up in %.2fs", self.worker_id, warm_up(self.model, decode, batch,
                                                                          fatal=self.group is not None))
        self.cold = False

    def make_outbox(self):
        return Outbox(self.ctx)

    def make_prefix(self, model):
        hot = self.settings.hot_kv_bytes
        if hot is None:
            hot = hot_kv_bytes(on_cpu(), mx.device_info(), len(self.settings.worker_plan()))
        return make_prefix_cache(model, self.settings.model_dir, self.settings.block_size, self.prefix_client,
                                 self.arena_buf, hot_bytes=hot)

    def start_stores(self, prefill: PrefillEngine | None, decode: DecodeEngine | None) -> None:
        """The store thread, where it pays. A prefill's stores need the hot
        tier (without it, the next prompt would miss blocks still being
        stored); a decode worker's send the last token after the commit, and
        pay off only on a GPU (a CPU's copies are cheap, and read KV that its
        batch still writes)."""
        prefix = self.prefix
        prefill_stores = prefill is not None and prefix is not None and prefix.hot.enabled
        decode_stores = decode is not None and prefix is not None and prefix.reuses_blocks and not on_cpu()
        if not (prefill_stores or decode_stores):
            return
        outbox = self.outbox
        self.stores = StoreThread(prefix, self.prefix_cache_client(), lambda msg: outbox.send(msg, wait_s=HANDOFF_SEND_S))
        if decode_stores:
            decode.stores = self.stores

    def build_roles(self, prefill: PrefillEngine | None, decode: DecodeEngine | None, vision) -> None:
        """The role objects over the loaded engines (`vision`: load_vision's)."""
        common = dict(worker_id=self.worker_id, outbox=self.outbox, clock=self.clock, fail=self.fail)
        if vision is not None:
            self.vision = VisionRole(*vision, **common)
            if "vision" in self.role_names:
                self.takes[VisionRequest] = self.vision
        if decode is not None:
            # On CUDA a thread copies handoffs out of the arena (workers/decode/role.py).
            reader = ThreadPoolExecutor(1, thread_name_prefix="handoff-read") if on_cuda() else None
            self.decode = DecodeRole(decode, prefix=self.prefix, cache=self.cache, arena_buf=self.arena_buf,
                                     local_kv=self.local_kv, reader=reader, **common)
            self.takes[DecodeRequest] = self.decode
        if prefill is not None:
            self.prefill = PrefillRole(self.settings, prefill, prefix=self.prefix, cache=self.cache,
                                       arena_buf=self.arena_buf, hello=self.hello, local_kv=self.local_kv,
                                       colocated=self.decode is not None, stores=self.stores, vision=self.vision,
                                       group=self.group, **common)
            self.takes[PrefillRequest] = self.prefill
        self.roles = [r for r in (self.vision, self.prefill, self.decode) if r is not None]

    def prefix_cache_client(self) -> CacheClient:
        """A cache client with the prefix cache's short deadline (one per thread)."""
        return CacheClient(self.settings, timeout_s=min(self.settings.cache_call_timeout_s, PREFIX_CALL_TIMEOUT_S))

    def rank_and_size(self) -> tuple[int, int]:
        """This process's rank in its group and the group's size (0, 1 alone)."""
        return (0, 1) if self.group is None else (self.group.rank(), self.group.size())

    def arena_buf(self, name: str):
        return self.arenas.get(name).buf

    # ---------------------------------------------------------- main loop --
    def start_clock(self) -> None:
        self.clock = LoopClock(f"worker {self.worker_id}")  # from here: loading is not the loop's time
        for role in self.roles:
            role.clock = self.clock
        for role in (self.decode, self.prefill):
            if role is not None:
                role.engine.clock = self.clock

    def serve(self) -> None:
        self.start_clock()
        while not self.stopping:
            self.drain_inbox(block=not self.has_work())
            if self.stopping:
                break
            if self.vision is not None and self.vision.has_work():
                self.run_unit("vision")
            if self.prefill is not None and self.prefill.has_work():
                self.run_unit("prefill")
            if self.decode is not None and self.decode.reading:
                busy = self.decode.engine.has_work or (self.prefill is not None and self.prefill.has_work())
                self.run_unit("reads", wait=not busy)
            if self.decode is not None and self.decode.engine.has_work:
                delay = self.decode.pace_delay()  # the power policy's pace
                if delay > 0:
                    if not (self.prefill is not None and self.prefill.has_work()):
                        self.drain_inbox(block=True, timeout=delay)
                else:
                    self.run_unit("decode")
            elif self.cold and not self.defer_warm_up and not self.has_work():
                self.run_unit("warm up")
            if self.stores is not None:
                self.stores.release_done()  # what its finished jobs read, freed on this (MLX) thread
            self.update_load()
            relieve_memory(self.settings, self.prefix, self.hello)  # under memory pressure: hot KV, MLX's freed buffers
            self.clock.maybe_report()

    def run_unit(self, unit: str, wait: bool = False) -> None:
        """One unit of MLX work, by name (a group's other ranks replay these
        names after rank 0: workers/group/lockstep.py)."""
        if unit == "vision":
            with self.clock.phase("vision"):
                self.vision.step()
        elif unit == "prefill":
            with self.clock.phase("prefill"):
                self.prefill.step()
        elif unit == "reads":
            self.decode.take_reads(wait=wait)
        elif unit == "decode":
            self.decode.step()
        elif unit == "warm up":
            self.warm_up(self.prefill.engine if self.prefill else None, self.decode.engine if self.decode else None)
        else:
            raise ValueError(f"no unit of work called {unit!r}")

    def has_work(self) -> bool:
        return any(role.has_work() for role in self.roles)

    def drain_inbox(self, block: bool, timeout: float = 0.25) -> None:
        timeout = timeout if block else None
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
        role = self.takes.get(type(msg))
        if role is not None:
            # A request whose message cannot be taken in (a handoff naming an
            # arena that is gone, say) fails alone, never the worker.
            try:
                if isinstance(msg, DecodeRequest):  # a group's rank reads its own part of the KV
                    msg = own_part(msg, *self.rank_and_size())
                role.handle(msg)
            except Exception as exc:  # noqa: BLE001
                self.fail(msg.request_id, exc)
        elif isinstance(msg, Cancel):
            self.cancel(msg.request_id)
        elif isinstance(msg, WorkerLimits):
            self.apply_limits(msg)
        else:
            log.error("worker %s (%s) ignores %s", self.worker_id, "+".join(self.role_names), type(msg).__name__)

    def apply_limits(self, limits: WorkerLimits) -> None:
        """The power policy's limits (router/power_watch.py), never above the settings'.
        A smaller decode batch lets the rows beyond it finish; none join until below."""
        pace = limits.pace_tokens_per_s
        if self.decode is not None:
            self.decode.engine.max_batch = max(1, min(limits.max_batch, self.settings.max_batch))
            self.decode.pace_s = 1.0 / pace if 0.0 < pace < 1e6 else 0.0
            self.hello.max_batch = self.decode.engine.max_batch
        if self.prefill is not None:
            self.prefill.batch_limit = max(1, min(limits.prefill_batch, self.settings.prefill_batch))
            self.prefill.engine.ane_all = bool(limits.prefill_on_ane)
        self.defer_warm_up = bool(limits.defer_warm_up)
        if limits.version != self.hello.limits_version:
            log.info("worker %s: power policy %s (decode batch %d, prefill batch %d, pace %s)", self.worker_id,
                     limits.policy, self.hello.max_batch, self.prefill.batch_limit if self.prefill else 0,
                     f"{pace:g} tok/s" if self.decode and self.decode.pace_s else "off")
        self.hello.limits_version = limits.version

    def fail(self, request_id: str, exc: Exception) -> None:
        """Drop a request that `exc` broke, and tell the router why."""
        log.error("request %s failed in worker %s", request_id, self.worker_id, exc_info=exc)
        self.cancel(request_id, save=False)
        self.outbox.send(request_failed(request_id, exc))

    def cancel(self, request_id: str, save: bool = True) -> None:
        """Drop a request wherever it is, in every role. A decoding request's
        KV goes to the prefix cache (unless `save` is False: its batch is suspect)."""
        for role in self.roles:
            role.cancel(request_id, save=save)

    def update_load(self) -> None:
        self.hello.running = sum(role.running for role in self.roles)
        self.hello.waiting = sum(role.waiting for role in self.roles)
        self.hello.kv_bytes = self.decode.engine.kv_bytes if self.decode else 0
        spec = self.decode.engine.speculation if self.decode else None
        if spec is not None:
            self.hello.spec_method, self.hello.spec_proposed, self.hello.spec_accepted = (
                spec.method, spec.proposed, spec.accepted)
        if self.prefix is not None:
            self.hello.hot_kv_bytes, self.hello.hot_kv_hits = self.prefix.hot.nbytes, self.prefix.hot.hits

    def close(self) -> None:
        if self.decode:
            self.decode.close()  # its reader thread
        if self.stores:
            self.stores.close()  # its queued handoffs go out first
        if self.outbox:
            self.outbox.close()
        if self.cache:
            self.cache.close()
        if self.prefix_client:
            self.prefix_client.close()
        self.arenas.close()
