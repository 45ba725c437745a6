"""Every message that crosses a process boundary, one dataclass each.

The codec (`protos.codec`) turns these into ZeroMQ frames: a msgpack header
`{"v": VERSION, "t": <class name>, "b": <fields>}` followed by one frame per
numpy array (out of band, zero-copy). Nothing here is ever pickled.

Keep fields to msgpack-native types (int, float, str, bytes, bool, None, lists,
dicts with str keys), other message dataclasses, or numpy arrays, and annotate
them precisely (`list[int]`, not `list`): the codec checks every value it
receives, list elements included, against these annotations. `Any` is free-form
data (msgpack's own values, no arrays or messages inside).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

VERSION = 1


# --------------------------------------------------------------------------- #
# Shared pieces
# --------------------------------------------------------------------------- #


@dataclass
class SamplingParams:
    """Everything a worker needs to pick tokens the way the client asked."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: Optional[int] = None
    repetition_penalty: float = 1.0  # 1.0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] = field(default_factory=dict)  # {str(token_id): bias}
    logprobs: bool = False
    top_logprobs: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # end of sequence ids
    # An llguidance grammar (protos/grammar.py) every generated token must
    # follow, the first one included; "" when the output is free.
    grammar: str = ""


@dataclass
class ArenaSlice:
    """Where one array lives in the cache service's shared-memory arena."""

    offset: int
    nbytes: int
    dtype: str  # numpy dtype name, e.g. "float32", "float16", "bfloat16" as "uint16"+tag
    shape: list[int]


@dataclass
class HeldBlocks:
    """A prompt's leading full prefix-cache blocks, leased in the cache
    service for one request: `hashes` in prompt order, at `offsets` in
    `arena`, under `lease` (so that none is evicted before decode takes
    them), covering the prompt's first `tokens` tokens. A prefill worker
    holds them (workers.kv.prefix_cache.PrefixCache.hold) and refers to them
    in its KVHandoff; empty (no hashes, lease -1) when nothing is held."""

    hashes: list[bytes] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    arena: str = ""
    lease: int = -1
    tokens: int = 0


@dataclass
class KVShard:
    """Where another rank of a prefill group put its part of a KVHandoff in
    this host's arena, for the same decode rank (workers/group/handoff_shards.py)."""

    arena: str
    allocation: int
    layers: list[list[ArenaSlice]]


@dataclass
class KVHandoff:
    """What decode needs to rebuild a prompt's KV cache. Prefill worker ->
    router on its own (after PrefillDone), router -> decode in DecodeRequest.

    `arena` names the shared-memory segment; `allocation` is the id the cache
    service gave the reservation (decode frees it once loaded). `layers` holds,
    per model layer, the keys slice then the values slice. When prefill and
    decode share a process (`--colocate`), `local` is True and the KV never
    leaves that process: `layers` is empty.

    Models whose caches are not all plain attention KV (sliding window,
    recurrent: see workers.kv.handoff.write_cache) also fill `cache_meta`:
    per layer the cache class and its state with array leaves {"a": i}, the
    i-th slice of that layer's entry in `layers` (any number of slices).
    Empty `cache_meta` means the plain [keys, values] layout above.
    """

    request_id: str
    num_tokens: int  # tokens covered by the KV (the prompt)
    rope_offset: int  # position of the next token (differs from num_tokens for M-RoPE)
    local: bool = False
    arena: str = ""
    allocation: int = -1
    layers: list[list[ArenaSlice]] = field(default_factory=list)  # [[keys, values], ...]
    kv_dtype: str = ""
    bytes_moved: int = 0
    write_ms: float = 0.0
    cache_meta: list[dict[str, Any]] = field(default_factory=list)  # per-layer cache class + state spec; [] for plain KV
    # By reference: the prompt's first `blocks.tokens` tokens are the held
    # prefix-cache blocks, which decode takes from its own memory where it
    # holds them. `layers` then covers only the tokens after them (none, and
    # no allocation, when the prompt ends on a block boundary).
    blocks: HeldBlocks = field(default_factory=HeldBlocks)
    # By value (PrefillRequest.kv_by_value: decode is on another host, which
    # cannot read this host's arena): the bytes of the slices themselves, one
    # out-of-band frame, `layers` offsets into it; arena "", allocation -1, no
    # blocks. None: the KV is in the arena (or local), as above.
    payload: Optional[np.ndarray] = None  # uint8, 1-d
    # From a worker group (--tensor-parallel / --pipeline-parallel, split
    # layout): the fields above are rank 0's part; rank r's is shards[r - 1].
    # Each rank wrote its own into this host's arena; no blocks by reference.
    shards: list[KVShard] = field(default_factory=list)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # [(token_id, logprob), ...]


# --------------------------------------------------------------------------- #
# Worker <-> router (router binds ROUTER, workers connect DEALER)
# --------------------------------------------------------------------------- #


@dataclass
class WorkerHello:
    """Sent by a worker when it connects and then as its heartbeat."""

    worker_id: str
    roles: list[str]  # ["prefill"], ["decode"], ["prefill", "decode"]
    pid: int
    state: str  # "loading" | "ready" | "stopping"
    model_id: str = ""
    running: int = 0  # requests in the decode batch or being prefilled
    waiting: int = 0  # requests queued inside the worker
    kv_bytes: int = 0  # bytes of KV the worker holds for live requests
    max_context: int = 0
    hot_kv_bytes: int = 0  # prefix-cache blocks it keeps as MLX arrays (workers/kv/hot_blocks.py)
    hot_kv_hits: int = 0  # blocks it took from there instead of the arena, since start
    memory_pressure: int = 0  # the level it last read: 0 normal, 1 warn, 2 critical (environment/memory_pressure.py)
    memory_freed_bytes: int = 0  # hot KV and MLX's freed buffers it let go under pressure, since start
    batched_prompts: int = 0  # prompts it prefilled in a pass with others (workers/prefill/batch.py), since start
    limits_version: int = 0  # the WorkerLimits it applies (0: none yet: the settings' own)
    max_batch: int = 0  # decode rows per step it allows now (0: no decode role)
    spec_method: str = ""  # its speculative decoding ("prompt-lookup", "draft"; "": none)
    spec_proposed: int = 0  # tokens it drafted, since start
    spec_accepted: int = 0  # drafted tokens kept, since start
    # Where its KV lives: "" for a worker on the router's host (its arena), else
    # the remote host (deploy/worker_cmd.py); the router hands a prompt's KV
    # only to a decode worker of the same kv_host (router/routing/worker_table.py).
    kv_host: str = ""
    # A worker group's split of the model ("tensor 2", "pipeline 2"; "": the
    # whole model): a group's handoff goes only to a group of the same split,
    # rank by rank on one host (router/routing/handoff_route.py).
    kv_shard: str = ""


@dataclass
class WorkerLimits:
    """Router -> model worker: what the power policy in force allows
    (environment/power/policy.py). Sent again while the worker's hello does not
    echo `version`, so a restarted worker, or one that missed it, gets it."""

    version: int
    policy: str  # "performance" | "balanced" | "saver"
    max_batch: int  # decode rows per step (rows beyond finish; none join)
    prefill_batch: int  # prompts per prefill pass
    pace_tokens_per_s: float = 0.0  # decode steps per second at most; 0: unpaced
    defer_warm_up: bool = False  # a worker that has not warmed up waits for a policy that allows it
    prefill_on_ane: bool = False  # every prompt to the Neural Engine (--prefill-backend auto)


@dataclass
class PrefillRequest:
    """Router -> prefill worker: run the prompt, sample the first token."""

    request_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams
    decode_worker: str  # worker id that will decode; equal to self: keep KV local
    images: list[ImageInput] = field(default_factory=list)  # prompt order; [] for text-only
    # A request resumed after its worker died (router/routing/dispatcher.py): the
    # last `generated` prompt tokens are its answer so far. They count toward
    # max_tokens and its grammar has followed them; the token sampled next
    # continues the answer. 0: a new request.
    generated: int = 0
    # Callers share cached KV only under the same salt (router/guards/cache_salt.py):
    # it is mixed into every block key. "": the shared, unsalted cache.
    cache_salt: str = ""
    # The KV goes by value (KVHandoff.payload): its decode worker is on
    # another host than this worker's KV (router/routing/handoff_route.py).
    kv_by_value: bool = False


@dataclass
class ImageInput:
    """One image of a VLM prompt, or one video for an architecture that takes
    video (Qwen3-VL): its decoded RGB pixels (an out-of-band frame) and where
    its placeholder tokens sit in the prompt."""

    content_hash: str  # SHA-256 hex over width, height and RGB pixels; a video's names its sampling (router/media/decode.py)
    # numpy uint8 [H, W, 3]; a video: its sampled frames [T, H, W, 3]. [H, W, 0] ([T, H, W, 0]):
    # its size alone, for a picture whose embedding a vision worker stored (router/routing/dispatcher.py)
    pixels: Optional[np.ndarray] = None
    start: int = 0  # index of its first placeholder token in prompt_tokens
    n_tokens: int = 0  # placeholder tokens it takes (a video: in all its blocks)
    kind: str = "image"  # "image" | "video"
    fps: float = 0.0  # a video's sampling rate
    timestamps: list[float] = field(default_factory=list)  # a video: seconds into it of each frame
    # Prompt tokens from `start` through its last placeholder; 0: n_tokens. A
    # video's per-frame-pair blocks have timestamps and markers between them.
    span: int = 0

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.start + (self.span or self.n_tokens)


@dataclass
class VisionRequest:
    """Router -> vision worker: put these images' embeddings in the cache
    service (workers/vision/embeddings.py), encoding those it lacks."""

    request_id: str
    images: list[ImageInput]


@dataclass
class VisionDone:
    """Vision worker -> router: every image's embedding is stored (or was)."""

    request_id: str
    encoded: int = 0  # images the encoder ran for
    cached: int = 0  # images whose embeddings were there already
    encode_s: float = 0.0


@dataclass
class PrefillDone:
    """Prefill worker -> router: the first token, sent the moment it exists.

    `handoff` is where the KV is when it is already known (kept local with
    --colocate, or nothing to hand over because the first token ends the
    request); None when the KV is still being written to the arena: then
    the KVHandoff follows as a message of its own, so the client's first
    token never waits for that copy."""

    request_id: str
    first_token: int
    handoff: Optional[KVHandoff]
    logprob: Optional[TokenLogprob] = None
    finish_reason: Optional[str] = None  # set when the first token already ends it
    prefill_ms: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    images_encoded: int = 0  # images the vision encoder ran for
    images_cached: int = 0  # images it did not need (cached KV past them)
    encode_s: float = 0.0  # vision encoder seconds


@dataclass
class DecodeRequest:
    """Router -> decode worker: continue a prefilled request."""

    request_id: str
    prompt_tokens: list[int]  # context for repetition / presence / frequency penalties
    first_token: int
    handoff: KVHandoff
    sampling: SamplingParams
    # Tokens already produced (counts toward max_tokens): first_token, and
    # before it the last `generated - 1` prompt tokens (a resumed request's answer so far).
    generated: int = 1
    # Content hashes of the prompt's images, in order; [] for text. Equal
    # tokens then no longer mean equal KV (every image of one size has the
    # same placeholder ids), so decode shares no prefix with such a request.
    media: list[str] = field(default_factory=list)
    cache_salt: str = ""  # as PrefillRequest's: KV is shared and stored only under it


@dataclass
class TokenUpdate:
    request_id: str
    token: int
    logprob: Optional[TokenLogprob] = None
    finish_reason: Optional[str] = None


@dataclass
class TokenBatch:
    """Decode worker -> router: the tokens of one decode step, all requests."""

    updates: list[TokenUpdate]


@dataclass
class Cancel:
    """Router -> worker: drop a request (client gone, stop string matched)."""

    request_id: str


@dataclass
class RequestFailed:
    """Worker -> router: a request could not be served; tell the client."""

    request_id: str
    message: str
    status: int = 500


# --------------------------------------------------------------------------- #
# Anyone <-> cache service (service binds ROUTER, clients connect DEALER)
# Every call carries a call_id; the reply echoes it.
# --------------------------------------------------------------------------- #


@dataclass
class CacheAlloc:
    """Reserve `nbytes` in the arena for `owner` (a request id).

    The reservation expires after `ttl_s` unless freed first, so a holder that
    dies never leaks arena space.
    """

    call_id: int
    nbytes: int
    owner: str
    ttl_s: float = 120.0


@dataclass
class CacheAllocReply:
    call_id: int
    ok: bool
    allocation: int = -1
    offset: int = 0
    nbytes: int = 0
    arena: str = ""
    error: str = ""


@dataclass
class CacheFree:
    """Release reservations by id, or every reservation of an owner.

    `arena` (when set) must name the service's current arena: ids restart when
    the service restarts, so a free meant for the old arena is refused instead
    of releasing someone else's new reservation.
    """

    call_id: int
    allocations: list[int] = field(default_factory=list)
    owner: str = ""
    arena: str = ""


@dataclass
class CacheStats:
    call_id: int


@dataclass
class CacheReply:
    """Generic reply: ok flag, an error text, and a dict of numbers."""

    call_id: int
    ok: bool
    error: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- #
# Prefix cache: KV blocks keyed by chained block hashes (same cache service socket)
# A block holds the KV of `block_size` tokens for every layer, in the layout
# workers/kv/ defines; the service only sees opaque byte ranges.
# --------------------------------------------------------------------------- #


@dataclass
class BlockRef:
    hash: bytes  # 32-byte chained block hash, never truncated
    offset: int  # in the arena named by the reply
    nbytes: int


@dataclass
class KVLookup:
    """Find the longest run of cached blocks from the start of `hashes` and
    lease them: leased blocks are never evicted until released or expired.
    With `first`, lease only the first of `hashes` that is cached: a tail
    block's candidates, longest first (workers/kv/block_hash.py)."""

    call_id: int
    hashes: list[bytes]  # chained, in prompt order (or candidates, with `first`)
    owner: str
    lease_s: float = 30.0
    first: bool = False


@dataclass
class KVLookupReply:
    call_id: int
    ok: bool
    arena: str = ""
    lease: int = -1  # give back with KVRelease (or let it expire)
    blocks: list[BlockRef] = field(default_factory=list)  # for hashes[0:len(blocks)]
    error: str = ""


@dataclass
class KVRelease:
    call_id: int
    lease: int


@dataclass
class KVReserve:
    """Phase one of a put: space for blocks not cached yet (evicting unleased
    LRU blocks if needed). Reserved blocks are invisible to lookups until
    KVCommit; a reservation not committed within `ttl_s` is dropped."""

    call_id: int
    hashes: list[bytes]
    nbytes: int  # per block
    owner: str
    ttl_s: float = 30.0


@dataclass
class KVReserveReply:
    call_id: int
    ok: bool
    arena: str = ""
    blocks: list[BlockRef] = field(default_factory=list)  # to write; cached or in-flight hashes are left out
    error: str = ""


@dataclass
class KVCommit:
    """Phase two: the reserved blocks are written; make them visible. Reply: CacheReply
    (stats: committed, unknown). With `owner` set, only that owner's reservations
    are committed: a writer whose reservation expired cannot publish the block
    another writer has since reserved and not yet written."""

    call_id: int
    hashes: list[bytes]
    owner: str = ""


ALL_MESSAGES = [
    SamplingParams,
    ArenaSlice,
    HeldBlocks,
    KVShard,
    KVHandoff,
    TokenLogprob,
    WorkerHello,
    WorkerLimits,
    PrefillRequest,
    ImageInput,
    VisionRequest,
    VisionDone,
    PrefillDone,
    DecodeRequest,
    TokenUpdate,
    TokenBatch,
    Cancel,
    RequestFailed,
    CacheAlloc,
    CacheAllocReply,
    CacheFree,
    CacheStats,
    CacheReply,
    BlockRef,
    KVLookup,
    KVLookupReply,
    KVRelease,
    KVReserve,
    KVReserveReply,
    KVCommit,
]
