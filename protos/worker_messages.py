"""Router <-> model workers (the router binds ROUTER, workers connect
DEALER): hellos and limits, the requests each role runs, what comes back.
A request's sampling and token budget (protos/budget.py) travel in them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from protos.budget import TokenBudget
from protos.kv_handoff import KVHandoff


@dataclass
class SamplingParams:
    """Everything a worker needs to pick tokens the way the client asked."""

    max_tokens: int = 256  # the answer's tokens at most: its TokenBudget's `allowed`
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
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # [(token_id, logprob), ...]


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

    @property
    def budget(self) -> TokenBudget:
        """Its answer's tokens: allowed, and produced before this prefill."""
        return TokenBudget(self.sampling.max_tokens, self.generated)


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
class EmbedRequest:
    """Router -> embed worker (workers/embed/): one vector per input, each
    input's token ids as the router tokenized them (special tokens included)."""

    request_id: str
    inputs: list[list[int]]
    # Matryoshka: the first `dimensions` components, renormalised (a model
    # trained for it: environment/embedding_config.py); 0: the model's own width.
    dimensions: int = 0


@dataclass
class EmbedResult:
    """Embed worker -> router: every input's vector, L2-normalised, row i for
    input i, as one out-of-band frame. A failure is a RequestFailed."""

    request_id: str
    vectors: np.ndarray  # float32 [len(inputs), dimensions or the model's width]
    prompt_tokens: int = 0  # tokens embedded, every input's together
    passes: int = 0  # forward passes its inputs ran in (shared with other requests' inputs)


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

    @property
    def budget(self) -> TokenBudget:
        """Its answer's tokens: allowed, and produced so far (first_token included)."""
        return TokenBudget(self.sampling.max_tokens, self.generated)

    @property
    def answer(self) -> list[int]:
        """The answer so far before first_token, which the prompt ends with
        (a resumed request's; first_token is not in the prompt)."""
        return self.prompt_tokens[len(self.prompt_tokens) - max(self.generated - 1, 0):]


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

