"""What one worker process holds, built at its start: the model (a group
rank's shard of it), the engines over it, the prefix cache, the cache
clients, the store thread, and the role objects the loop (workers/worker.py)
steps. Built on the main thread, which then owns every MLX call.

A group's rank is built as a worker alone is, but for its shard
(workers/models/sharding.py), a prefix cache whose hits the ranks agree on
(workers/group/prefix_agreement.py), handoffs made and read rank by rank
(workers/group/handoff_shards.py), and a warm-up that fails the process
rather than go on with ranks out of step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx

from cache_service.arena import ArenaAttachment
from cache_service.client import CacheClient
from environment.backend import on_cpu, on_cuda
from environment.model_folder import context_length, is_vlm
from environment.settings import Settings
from environment.tokenizer_files import FolderTokenizer
from protos.messages import DecodeRequest, EmbedRequest, PrefillRequest, VisionRequest
from workers.decode.engine import DecodeEngine
from workers.decode.role import DecodeRole
from workers.decode.speculation import speculation_for
from workers.embed.engine import EmbedEngine
from workers.embed.role import EmbedRole
from workers.grammar import Grammars, logits_width
from workers.group.prefix_agreement import group_prefix, min_and_max, rank_shard
from workers.kv.block_hash import Shard
from workers.kv.prefix_cache import make_prefix_cache
from workers.kv.store_thread import StoreThread
from workers.loop_clock import LoopClock
from workers.memory_relief import relieve_memory
from workers.models.loading import hot_kv_bytes, load_weights, size_buffer_cache
from workers.models.sharding import shard_model
from workers.power_limits import PowerLimits
from workers.prefill.ane.backend import make_ane_body
from workers.prefill.engine import PrefillEngine
from workers.prefill.role import PrefillRole
from workers.vision.role import VisionRole, load_vision
from workers.warm_up import WarmUpRole, warm_up

log = logging.getLogger(__name__)

# Prefix-cache calls get a short deadline of their own: the service answers
# in microseconds when alive, and a request is better off computing its
# prompt than waiting the full cache_call_timeout_s for an optimisation.
PREFIX_CALL_TIMEOUT_S = 1.0
# The store thread's sends give up after this (the socket loop has stopped;
# the router's deadline then fails the request) rather than block for ever.
HANDOFF_SEND_S = 5.0


class WorkerParts:
    """The parts of a process with `names` (roles: "prefill", "decode",
    "vision"; or "embed" alone), answering through `outbox`, its heartbeat `hello`. `group`: a
    group's mx.distributed.Group (None: a worker alone, the whole model);
    `prefix_here`: False on a rank whose host has no cache service (its
    cache is built, as its probe runs the collectives every rank's does,
    then dropped: the whole group then goes without)."""

    def __init__(self, settings: Settings, names: list[str], worker_id: str, hello, outbox, power: PowerLimits,
                 group=None, prefix_here: bool = True):
        self.settings, self.names, self.worker_id = settings, names, worker_id
        self.hello, self.outbox, self.power = hello, outbox, power
        self.group = group
        self.prefix_here = prefix_here
        self.cache: CacheClient | None = None
        self.prefix_client: CacheClient | None = None
        self.prefix = None  # workers.kv.prefix_base.PrefixCacheBase; None when caching is off
        self.stores: StoreThread | None = None  # block stores off the MLX thread
        self.arenas = ArenaAttachment()  # re-attaches when a restarted cache service has a new arena
        self.local_kv: dict[str, list] = {}  # colocated handoffs: the KV never leaves the process
        self.clock = LoopClock(f"worker {worker_id}")  # the loop's replaces it when serving starts
        self.model = None
        self.roles: list = []  # in the loop's order: vision, prefill, decode, a deferred warm-up
        self.takes: dict[type, object] = {}  # request type -> the role that takes it
        self.decode: DecodeRole | None = None

    def load(self) -> None:
        t0 = time.perf_counter()
        names = self.names
        size_buffer_cache(len(self.settings.worker_plan()))
        if "embed" in names:  # an embedding model's worker: this role alone, no KV, no cache service
            return self.load_embed(t0)
        self.cache = CacheClient(self.settings)
        self.prefix_client = self.prefix_cache_client()
        grammars = None
        if "prefill" in names or "decode" in names:
            grammars = self.load_model()
        prefill = self.make_prefill(grammars) if "prefill" in names else None
        vision = None
        if ("prefill" in names or "vision" in names) and is_vlm(self.settings.model_dir):
            vision = load_vision(self.settings.model_dir, self.model, self.prefix_client, self.arena_buf)
        decode = None
        if "decode" in names:
            decode = DecodeEngine(self.model, max_batch=self.settings.max_batch, prefix=self.prefix,
                                  grammars=grammars, speculation=speculation_for(self.settings, self.model))
        cold = self.model is not None and self.settings.warm_up
        # On battery in saver the warm-up waits for a policy that allows it (workers/power_limits.py).
        deferred = cold and self.power.defers_warm_up()
        if cold and not deferred:
            self.warm_up(prefill, decode)
        self.start_stores(prefill, decode)
        self.build_roles(prefill, decode, vision)
        if deferred:
            self.roles.append(WarmUpRole(lambda: self.warm_up(prefill, decode), worker_id=self.worker_id,
                                         outbox=self.outbox, clock=self.clock))
        self.hello.max_context = context_length(self.settings.model_dir)
        self.hello.max_batch = self.settings.max_batch if decode is not None else 0
        self.hello.state = "ready"
        log.info("worker %s %s ready in %.1fs (pid %d)", self.worker_id, "+".join(names),
                 time.perf_counter() - t0, os.getpid())

    def load_embed(self, t0: float) -> None:
        """The embed role (workers/embed/): inputs batched a pass of
        --prefill-chunk tokens at a time."""
        engine = EmbedEngine(self.settings.model_dir, self.settings.prefill_chunk)
        role = EmbedRole(engine, worker_id=self.worker_id, outbox=self.outbox, clock=self.clock)
        self.roles, self.takes[EmbedRequest] = [role], role
        self.hello.max_context = context_length(self.settings.model_dir) or 0
        self.hello.state = "ready"
        log.info("worker %s embed ready in %.1fs (pid %d)", self.worker_id, time.perf_counter() - t0, os.getpid())

    def load_model(self) -> Grammars:
        """The model (a group's: this rank's shard) and its prefix cache; the
        grammars over its tokenizer."""
        group, pipeline = self.group, self.settings.pipeline_parallel > 1
        model = load_weights(self.settings.model_dir, lazy=group is not None)
        tokenizer = FolderTokenizer.load(self.settings.model_dir)  # the grammars' vocabulary, no transformers
        if group is not None:
            shard_model(model, group, pipeline=pipeline)
        self.model = model
        prefix = self.make_prefix(model, None if group is None else rank_shard(group, pipeline))
        if group is not None and prefix is not None and not self.prefix_here:
            log.info("prefix caching off on rank %d: no cache service on its host", group.rank())
            prefix = None
        # A group's ranks each keep their own shard of every block and agree on each hit.
        self.prefix = prefix if group is None else group_prefix(prefix, group)
        # Requests with a grammar (workers/grammar.py); llguidance's view of
        # the tokenizer is built beside the warm-up (no MLX in it).
        grammars = Grammars(tokenizer, logits_width(model))
        threading.Thread(target=grammars.prepare, name="grammar-tokenizer", daemon=True).start()
        return grammars

    def make_prefill(self, grammars) -> PrefillEngine:
        prefill = PrefillEngine(self.model, chunk_size=self.settings.prefill_chunk, prefix=self.prefix,
                                grammars=grammars)
        prefill.ane = make_ane_body(self.model, self.settings)  # --prefill-backend ane|auto, on a Mac
        prefill.ane_mode, prefill.ane_min_tokens = self.settings.prefill_backend, self.settings.ane_min_tokens
        if self.group is not None and not self.settings.colocate:
            # A batch's room is counted in handoff bytes, which every rank must
            # count alike (a pipeline rank holds fewer layers than another).
            prefill.fix_token_nbytes(min_and_max(prefill.token_nbytes(), self.group)[1])
        return prefill

    def warm_up(self, prefill: PrefillEngine | None, decode: DecodeEngine | None) -> None:
        batch = prefill is not None and self.settings.prefill_batch > 1
        log.info("worker %s warmed up in %.2fs", self.worker_id, warm_up(self.model, decode, batch,
                                                                          fatal=self.group is not None))

    def make_prefix(self, model, shard: Shard | None):
        hot = self.settings.hot_kv_bytes
        if hot is None:
            hot = hot_kv_bytes(on_cpu(), mx.device_info(), len(self.settings.worker_plan()))
        return make_prefix_cache(model, self.settings.model_dir, self.settings.block_size, self.prefix_client,
                                 self.arena_buf, hot_bytes=hot, shard=shard)

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
        common = dict(worker_id=self.worker_id, outbox=self.outbox, clock=self.clock)
        vision_role = prefill_role = None
        if vision is not None:
            vision_role = VisionRole(*vision, **common)
            if "vision" in self.names:
                self.takes[VisionRequest] = vision_role
        if decode is not None:
            # On CUDA a thread copies handoffs out of the arena (workers/decode/role.py).
            reader = ThreadPoolExecutor(1, thread_name_prefix="handoff-read") if on_cuda() else None
            rank = (0, 1) if self.group is None else (self.group.rank(), self.group.size())
            self.decode = DecodeRole(decode, prefix=self.prefix, cache=self.cache, arena_buf=self.arena_buf,
                                     local_kv=self.local_kv, reader=reader, rank=rank,
                                     max_batch=self.settings.max_batch, **common)
            self.takes[DecodeRequest] = self.decode
        if prefill is not None:
            prefill_role = PrefillRole(self.settings, prefill, prefix=self.prefix, cache=self.cache,
                                       arena_buf=self.arena_buf, hello=self.hello, local_kv=self.local_kv,
                                       colocated=self.decode is not None, stores=self.stores, vision=vision_role,
                                       group=self.group, **common)
            self.takes[PrefillRequest] = prefill_role
        self.roles = [r for r in (vision_role, prefill_role, self.decode) if r is not None]

    def prefix_cache_client(self) -> CacheClient:
        """A cache client with the prefix cache's short deadline (one per thread)."""
        return CacheClient(self.settings, timeout_s=min(self.settings.cache_call_timeout_s, PREFIX_CALL_TIMEOUT_S))

    def arena_buf(self, name: str):
        return self.arenas.get(name).buf

    # ------------------------------------------------- after every pass --
    def relieve(self) -> None:
        """Under memory pressure: the hot KV tier and MLX's freed buffers go."""
        relieve_memory(self.settings, self.prefix, self.hello)

    def after_pass(self) -> None:
        """The loop's housekeeping, on the MLX thread: what the store thread's
        finished jobs read is freed, the prefix cache's counters reported,
        memory relieved."""
        if self.stores is not None:
            self.stores.release_done()
        if self.prefix is not None:
            self.hello.hot_kv_bytes, self.hello.hot_kv_hits = self.prefix.hot.nbytes, self.prefix.hot.hits
        self.relieve()

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
