"""The one settings object. `tandem serve` fills it from the command line and
hands a copy to every process it spawns."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from environment.backend import on_cpu
from environment.model_folder import is_vlm, model_kind


def default_cache_dir() -> str:
    """The user's cache folder: ~/Library/Caches on macOS, XDG elsewhere."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return os.environ["TANDEM_CACHE_DIR"]
    if os.uname().sysname == "Darwin":
        base = os.path.expanduser("~/Library/Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "tandem")


MIN_CACHE_MEMORY = 256 << 20
MAX_CACHE_MEMORY = 8 << 30


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def default_cache_memory(ram: int | None = None, weights: int = 0, copies: int = 0) -> int:
    """The KV arena: a tenth of physical memory (`ram`: this machine's),
    between 256 MiB and 8 GiB, and at most a quarter of what the model's
    weights leave (`copies` model worker processes of `weights` bytes each):
    a 16 GB Mac serving an 8 GB model split gets the floor, not 1.6 GB it
    would have to swap for. It is the KV cache's budget, the one share of
    memory that grows with use (its pages are touched as conversations are
    cached); memory pressure shrinks it (cache_service/pressure.py)."""
    ram = physical_memory() if ram is None else ram
    left = max(0, ram - weights * copies)
    return max(MIN_CACHE_MEMORY, min(MAX_CACHE_MEMORY, ram // 10, left // 4 if copies else ram))


def default_models_memory(ram: int | None = None, cache_bytes: int = 0) -> int:
    """Bytes loaded models' weights may take together: three quarters of
    physical memory (on a Mac the GPU's share of unified memory is about
    that) less the KV arena, at least 1 GiB."""
    ram = physical_memory() if ram is None else ram
    return max(1 << 30, ram * 3 // 4 - cache_bytes)


def default_block_size() -> int:
    """Tokens per KV block: 4 where MLX runs on the CPU, 8 on a GPU.

    A prompt recomputes what follows its last full block (half a block on
    average), against costs per block (hashing, round trips, stores, and on
    a GPU a copy per block into the hot tier). On the 2-core CPU box 4-token
    blocks served a warm request faster (benchmarks/probes/block_size.py: 21.8 ms
    of reuse costs against 32.0 at 8; prefix_restart.py: 0.22-0.25 s against
    0.28-0.30 s) and cached more of a swarm's turns; on the H100 8- and
    16-token blocks timed the same (docs/benchmarks-log.md, sessions 14 and 15)."""
    return 4 if on_cpu() else 8


def default_spec_rows() -> int:
    """Decode rows above which steps stop speculating (workers/decode/speculation.py):
    past them a step of several tokens a row is compute-bound and costs more
    than the tokens it gains (BENCHMARKS.md, "Speculative decoding")."""
    return 4 if on_cpu() else 8


def default_prefill_chunk() -> int:
    """Tokens per prefill step: 512 on a GPU, 128 where MLX runs on the CPU.

    A step is what a short prompt beside a long one waits for (prompts take
    turns a chunk at a time: workers/prefill/turns.py), and in --colocate
    what every decode row waits for. On the 2-core CPU box a 512-token
    chunk of the embedded model took ~3.5 s: one short prompt beside a
    1,053-token prompt waited 3.9 s (10.1x its 0.39 s alone); at 128 it
    took 1.04x, the long prompt 11.8 s against 11.4 s (the box's noise;
    in-process the 128-token chunks were faster: 16.1-16.6 s against
    18.8-19.4 s). On a GPU a 512-token chunk of an 8B model is ~30 ms
    (docs/benchmarks-log.md, session 30)."""
    return 128 if on_cpu() else 512


def default_prefill_batch() -> int:
    """Prompts one prefill pass may take together: 16 on a GPU, 1 (none)
    where MLX runs on the CPU. On an H100 a burst's passes cost 3.8-11x less
    a prompt batched (benchmarks/probes/prefill_batch.py), a 32-agent swarm's TTFT
    p99 fell from 1.4-2.1 s to 1.0-1.2 s, and with --colocate its wall time
    from 17.5 s to 12.3-14.6 s. On the 2-core CPU a 16-agent swarm's
    prefill worker was as busy either way (80 s; its passes compete with
    the decode steps for the same cores) and its wall time moved within
    the box's noise (150-189 s batched, 162-166 s not): docs/benchmarks-log.md,
    session 17."""
    return 1 if on_cpu() else 16


@dataclass
class Settings:
    # What is served
    model: str | None = None  # as given: None (embedded default), folder, .gguf, or HF repo id
    model_dir: str = ""  # the resolved local MLX model folder
    model_id: str = ""  # the id clients see in /v1/models
    # Many models on one endpoint (router/models/, protos/model_messages.py): a
    # request naming another downloaded model loads it (its own workers, its own
    # socket to the router); an idle one goes after its keep-alive (the request's
    # `keep_alive` or `ttl`, else this; the --model one stays unless told), and
    # the least recently used idle one makes room when a load would pass
    # `max_loaded_models` or `models_memory_bytes` (weights times the processes
    # holding them; None: sized by the machine, default_models_memory).
    model_keep_alive_s: float = 300.0  # < 0: forever
    max_loaded_models: int = 3
    models_memory_bytes: int | None = None
    model_load_timeout_s: float = 300.0  # a request waits this long for its model to be ready
    # The ipc name this model's workers and the router's dispatcher for it meet
    # on (protos/transport.py ipc_address): "router" for the --model one,
    # "router-m1", ... for those loaded on demand; a slot's settings say its own.
    router_socket: str = "router"
    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    # API keys (--api-key, repeatable, or --api-key-file): any one opens /v1;
    # each key is a cache tenant (router/guards/http_guard.py, router/guards/cache_salt.py).
    api_keys: tuple = ()
    max_request_bytes: int = 8 * 1024 * 1024
    # Browser safety (router/guards/http_guard.py): Origins allowed cross-site, ["*"]: any.
    cors_origins: tuple = ()
    # Host names the server also answers to besides localhost and --host
    # (a name a proxy forwards, a LAN name); ["*"]: any (router/guards/http_guard.py).
    allowed_hosts: tuple = ()
    # A client must send its request headers and body within this, and take
    # its answer's bytes: a full write buffer not drained within it closes the
    # connection and cancels the request (router/guards/slow_clients.py).
    client_timeout_s: float = 30.0
    # Process layout
    prefill_workers: int = 1
    decode_workers: int = 1
    colocate: bool = False
    # Ranks each model worker is split over (tensor parallel, workers/group/):
    # 1 is one process with the whole model; N > 1 (with colocate only, for
    # now) is a group of N processes, rank 0 facing the router, over
    # mx.distributed (`ring` on the CPU and Metal, `nccl` on CUDA).
    tensor_parallel: int = 1
    # Or split by layers (pipeline parallel, mlx-lm's `pipeline`): each of N
    # ranks keeps a run of whole layers. At most one of the two is > 1 (serve
    # refuses both: 2-D groups are not built); `group_size` is the group's size.
    pipeline_parallel: int = 1

    @property
    def group_size(self) -> int:
        """Processes each model worker is (1: one, the whole model)."""
        return max(self.tensor_parallel, self.pipeline_parallel)

    # A group's unit of work (a prefill chunk, a decode step) running longer
    # than this: a rank is stuck in a collective; the group restarts.
    group_unit_timeout_s: float = 300.0
    # A group across hosts (--hosts, deploy/hosts_flags.py): mlx.launch's hostfile's
    # entries (ssh name, ips, rdma), rank i on entry i, entry 0 this host; its "envs" and
    # "backend" ("": ring, or nccl on CUDA; "jaccl"/"jaccl-ring" on Macs); the
    # command that starts a rank on another host; rank 0's CURVE folder (its pair and the
    # other hosts' ranks' public keys, `tandem keys`) and each other host's rank's folder
    # (the same path on every host). (): a group on this host, as before.
    group_hosts: tuple = ()
    group_envs: tuple = ()
    group_backend: str = ""
    ssh_command: str = "ssh -o BatchMode=yes -o ConnectTimeout=10"
    group_keys: str = ""
    rank_keys: str = ""
    # Tests only (fault injection): a folder where a file named after a group (its rank
    # 0's name, "decode-0") holding seconds makes that rank 0 sleep so long after its
    # next unit, once (it takes the file): a slow step on a rank that stays alive
    # (workers/group/members.py). From TANDEM_TEST_SLOW_STEP_DIR; None: off.
    slow_step_dir: str | None = field(default_factory=lambda: os.environ.get("TANDEM_TEST_SLOW_STEP_DIR") or None)
    # The processes' ipc sockets; the supervisor makes one per run (deploy/run_dir.py).
    run_dir: str = ""
    # Remote workers (deploy/worker_cmd.py, router/routing/worker_socket.py). The router's side:
    # a tcp:// address it also listens on for workers of other hosts, CURVE-encrypted,
    # and the folder of its pair (server.key_secret) and the workers' public keys
    # (NAME.key; no other joins); "": none, no tcp socket and no authenticator.
    worker_listen: str = ""
    worker_keys: str = ""
    # A worker's side (`tandem worker`): the router's address ("": this host's ipc
    # socket), the folder of its own pair and the router's public key (server.key),
    # where its KV lives ("": the router's host; WorkerHello.kv_host), and how long
    # its hellos may go unanswered before it logs that it cannot join.
    router_address: str = ""
    router_keys: str = ""
    kv_host: str = ""
    router_join_timeout_s: float = 10.0
    # Cache service
    arena_name: str = ""  # shared-memory segment; the supervisor picks a fresh one per start
    cache_memory_bytes: int = field(default_factory=default_cache_memory)
    # Prefix cache
    block_size: int = field(default_factory=default_block_size)  # tokens per KV block
    cache_dir: str | None = field(default_factory=lambda: os.path.join(default_cache_dir(), "kv"))  # None: no disk tier
    cache_disk_bytes: int = 8 << 30
    cache_disk_ttl_s: float = 7 * 86400.0  # disk-tier blocks unused this long are deleted
    # Blocks each model worker keeps as MLX arrays (workers/kv/hot_blocks.py);
    # None: sized by the device (workers.models.loading.hot_kv_bytes), 0: none.
    hot_kv_bytes: int | None = None
    # Memory pressure (environment/memory_pressure.py), read this often by the cache
    # service and each model worker; under pressure they shrink their caches.
    memory_poll_s: float = 2.0
    # The level read from this file ("normal", "warn" or "critical") instead of
    # PSI / macOS: tests drive a running server with it.
    memory_pressure_file: str | None = None
    # Scheduling and admission
    max_batch: int = 32  # decode batch size per decode worker
    # Tokens per prefill step: what a short prompt beside a long one, and colocated decode, wait for.
    prefill_chunk: int = field(default_factory=default_prefill_chunk)
    # Where prompts are prefilled (workers/prefill/ane/): "mlx" (the GPU), "ane"
    # (the Neural Engine, every prompt its buckets hold; macOS only), "auto"
    # (uncached parts of ane_min_tokens or more there, the rest on the GPU).
    prefill_backend: str = "mlx"
    ane_min_tokens: int = 256
    # Prompts one prefill pass may take together, their new tokens (padded
    # to the longest) within prefill_chunk: a burst of short suffixes.
    prefill_batch: int = field(default_factory=default_prefill_batch)
    # Requests admitted beyond what the decode batches hold (waiting for a
    # template, media, prefill or a decode slot), beyond which 429 (router/guards/admission.py).
    max_queue: int = 256
    # Bytes of request bodies admitted at once (router/guards/admission.py): past
    # it 429, a body larger than all of it 413.
    admitted_body_bytes: int = 256 << 20
    # Stored Responses (router/api/response_store.py), in bytes they hold: in all,
    # and per API key (its oldest evicted first; another key's never for it).
    stored_responses_bytes: int = 512 << 20
    stored_responses_key_bytes: int = 256 << 20
    # Speculative decoding in the decode batch (workers/decode/speculation.py):
    # "auto" (the draft model when one is given, else prompt lookup), "off",
    # "prompt-lookup" (drafts from the request's own text) or "draft".
    speculative: str = "auto"
    draft_model_dir: str | None = None  # a small model of the same tokenizer (--draft-model)
    spec_tokens: int = 8  # drafted tokens per row and step, at most
    spec_max_batch: int = field(default_factory=default_spec_rows)
    warm_up: bool = True  # model workers run a short prompt before "ready" (workers/warm_up.py)
    # Deadlines (seconds)
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    cache_call_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    # A request whose worker died resumes on another (router/routing/dispatcher.py);
    # it fails only if no worker of the role is ready within this, or once
    # more than max_migrations workers died running it with no token gained
    # between (a request that keeps killing workers).
    migrate_timeout_s: float = 60.0
    max_migrations: int = 3
    drain_timeout_s: float = 30.0
    # An idle HTTP connection stays open this long. Longer than clients' own idle
    # expiry (httpx, under the openai client: 5 s), so the client drops it first and
    # never sends a request on a socket the server is closing at that instant.
    keep_alive_s: float = 75.0
    log_level: str = "info"
    # Media (VLMs): file:// image URLs only from under this folder (None: refused)
    allow_local_media: str | None = None
    max_images: int = 16  # image parts (plus video frames) per request
    max_image_pixels: int = 8192 * 6144
    media_fetch_timeout_s: float = 10.0  # a whole http(s) download
    # http(s) media only from public addresses, except these host names or
    # networks (CIDR), e.g. ("images.internal", "10.1.0.0/16") (router/media/decode.py).
    allow_media_hosts: tuple = ()
    # Bytes of media (downloads and decoded pixels) all requests together may
    # hold at once while being fetched and decoded; a request past it waits.
    media_budget_bytes: int = 1 << 30
    max_video_frames: int = 32
    # Power (environment/power/): "auto" follows the power source, Low Power Mode and
    # the thermal state; "performance", "balanced" and "saver" pin a policy.
    power_policy: str = "auto"
    power_poll_s: float = 5.0  # how often the power state is read
    # Power states read from this JSON file instead of the machine (tests; trying
    # a policy on a desktop): {"source": "battery", "percent": 15, ...}.
    power_state_file: str | None = None

    def spec_method(self) -> str | None:
        """The drafting method decode workers use ("prompt-lookup", "draft"), or None."""
        if self.speculative == "off":
            return None
        if self.speculative == "auto":
            return "draft" if self.draft_model_dir else "prompt-lookup"
        return self.speculative

    def worker_plan(self) -> list[tuple[str, list[str]]]:
        """The model worker processes these settings ask for: (name, roles),
        what the supervisor starts, /health waits for, and each worker sizes
        its share of the accelerator's memory by."""
        if self.model_dir and model_kind(self.model_dir) == "embedding":
            return [("embed-0", ["embed"])]  # its own role (workers/embed/): no prefill or decode
        vlm = bool(self.model_dir) and is_vlm(self.model_dir)
        if self.colocate:
            return [(f"worker-{i}", ["prefill", "decode"] + (["vision"] if vlm else []))
                    for i in range(self.prefill_workers)]
        return ([(f"prefill-{i}", ["prefill"]) for i in range(self.prefill_workers)]
                + [(f"decode-{i}", ["decode"]) for i in range(self.decode_workers)]
                + ([("vision-0", ["vision"])] if vlm else []))  # the image encoder: embeddings into the cache

