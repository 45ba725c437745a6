"""Prefill on MLX: run a prompt into a fresh KV cache and sample its first token.

The computation of mlx_lm.generate_step's prompt phase, so the first token is
the one mlx_lm.generate would produce: the prompt goes through the model in
chunks, and the final chunk's last position gives the logits, which go
through the request's logits processors (context: the whole prompt) and
sampler. generate_step runs the last token in a pass of its own, so that the
head does not run over a whole chunk; here the head runs over that one
position inside the final chunk (mlx_hooks.logits_at), which saves a pass
(a read of all weights) per prompt.

Two ways to drive it, both on the worker's single MLX thread:
  engine.run(tokens, sampling)           -> PrefillResult (all chunks at once)
  job = engine.start(tokens, sampling)   -> PrefillJob; call job.step() until it
                                            returns a PrefillResult (one chunk
                                            per call, so a colocated worker can
                                            run decode steps in between), then
                                            job.save_prefix() (run() does both).

With a prefix cache (workers.kv.prefix_cache.PrefixCache) the job's first step
loads the longest cached run of the prompt's first (n-1)//block_size full
blocks (at least one token is always computed: its logits give the first
token) and computes only the rest; a hit is left unread when loading it is
expected to take longer than computing it (the engine's measured seconds per
token against the cache's measured seconds per block: on a fast GPU with a
small model, moving KV through host memory can lose). `save_prefix` then stores the prompt's
full blocks that the cache lacks; the worker calls it after sending
PrefillDone, so writing new blocks never delays the first token.

With a snapshot cache (workers.kv.prefix_cache.SnapshotCache: sliding-window and
recurrent models) the first step resumes from the latest snapshot of a prefix
of the prompt, if any; the chunks then stop at the prompt's snapshot point
b (its last block boundary <= n-1), where the state is copied to host memory,
and `save_prefix` stores that copy. The copy costs one memcpy of the state
before the first token; storing it waits until after PrefillDone.

A request with a grammar (workers/grammar.py; the engine's `grammars`) gets
its matcher when its job starts (a grammar that does not compile fails the
request there), and its first token is sampled under the matcher's first
mask, filled while the final chunk computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from protos.budget import TokenBudget
from protos.messages import SamplingParams, TokenLogprob
from workers.grammar import GrammarError, apply_masks, consume, fill_masks, logits_width, matcher_after
from workers.kernels import mlx_hooks
from workers.loop_clock import part
from workers.kv.prefix_base import RecentMin
from workers.sampling import build_sampling, check_sampling, token_logprob, wants_logprobs


@dataclass
class PrefillResult:
    first_token: int
    logprob: Optional[TokenLogprob]  # set only when the request asked for logprobs
    cache: list  # per-layer mlx_lm caches holding the whole prompt (batch size 1)
    num_tokens: int  # prompt tokens covered by the cache
    rope_offset: int  # position of the next token (== num_tokens for plain rope)
    prefill_ms: float  # compute time spent inside step()/run(), not wall time
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class PrefillJob:
    """One prompt being prefilled, one chunk per `step()`."""

    def __init__(self, engine: "PrefillEngine", prompt_tokens: Sequence[int],
                 sampling: SamplingParams, owner: str = "", budget: Optional[TokenBudget] = None, salt: str = ""):
        if len(prompt_tokens) == 0:
            raise ValueError("empty prompt")
        self.engine = engine
        # Bad sampling fails the request here, before it can share a batched pass.
        check_sampling(sampling, engine.vocab)
        self.sampling = sampling
        # A resumed request's (produced > 0) prompt ends with its answer so
        # far: its grammar follows that answer, its seeded stream drew for it.
        self.budget = budget if budget is not None else TokenBudget(sampling.max_tokens)
        self.matcher = matcher_after(engine.grammars, sampling,
                                     prompt_tokens[len(prompt_tokens) - self.budget.produced:])
        self.owner = owner  # request id: names leases and reservations in the cache service
        self.salt = salt  # the request's cache salt: its blocks are found and stored under it
        self.tokens = [int(t) for t in prompt_tokens]
        self.prompt = mx.array(self.tokens, dtype=mx.int32)
        self.total = len(prompt_tokens)
        self.processed = 0  # prompt tokens already in the cache
        self.cached_tokens = 0  # of which loaded from the prefix cache
        self.cache = None  # made (or loaded from the prefix cache) by the first step
        self.snapshot_at = 0  # snapshot caches: where to copy the state (0: nowhere)
        self.snapshot = None  # that copy (workers.kv.snapshot.Snapshot), for save_prefix
        self.result: Optional[PrefillResult] = None
        self._saved = False
        self._compute_s = 0.0
        self.parts: dict[str, float] = {}  # this prompt's parts, seconds (its debug line)
        self.ane = None  # its uncached part through the Neural Engine's program, or None: MLX

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def remaining(self) -> int:
        """Prompt tokens left to compute (before its first step: all of them,
        its cached prefix not known yet)."""
        return self.total - self.processed

    def step(self) -> Optional[PrefillResult]:
        """Process the next chunk; returns the result once the prompt is done.

        The last token runs in the final chunk, whose head computes its
        logits alone (mlx_hooks.logits_at), so a prompt takes
        max(1, ceil(n_new / chunk)) calls and no pass of its own.
        """
        if self.result is not None:
            return self.result
        tic = time.perf_counter()
        model, chunk = self.engine.model, self.engine.chunk_size
        self.load()
        with mx.stream(generation_stream):
            remaining = self.total - self.processed
            n = min(chunk, remaining)
            if self.snapshot_at > self.processed:  # a chunk ends at the snapshot point
                n = min(n, self.snapshot_at - self.processed)
            t_chunk = time.perf_counter()
            with part(self.engine.clock, "chunk", self.parts):
                if n < remaining:
                    if self.ane is not None:  # the Neural Engine's program (workers/prefill/ane/bridge.py)
                        self.ane.extend(self.prompt[None, self.processed : self.processed + n], self.cache)
                    else:
                        model(self.prompt[None, self.processed : self.processed + n], cache=self.cache)
                    mx.eval([c.state for c in self.cache])
                else:
                    self.result = self._finish()
            self.engine.observe_compute(n, time.perf_counter() - t_chunk)
            self.processed += n
            if self.processed == self.snapshot_at:
                self.snapshot = self.engine.prefix.capture(self.cache, self.processed)
        self._compute_s += time.perf_counter() - tic
        if self.result is not None:
            self.result.prefill_ms = self._compute_s * 1000.0
        return self.result

    def load(self, cached: Optional[tuple] = None) -> None:
        """The first step's start: the cache, with the longest cached prefix
        loaded (once; later calls do nothing). `cached`: (per-layer caches,
        n) holding the prompt's first n tokens, used instead of the prefix
        cache (the warm-up, benchmarks)."""
        if self.cache is not None:
            return
        if cached is not None:
            self.cache, self.processed = cached
            self.cached_tokens = self.processed
            return
        with part(self.engine.clock, "load prefix", self.parts):
            self._load_prefix()
        self.ane = self.engine.ane_for(self.processed, self.total - self.processed)

    def _load_prefix(self) -> None:
        prefix = self.engine.prefix
        if prefix is not None:
            self.snapshot_at = prefix.snapshot_point(self.total)
            # (n-1)//bs: the last prompt token is never cached here, it must
            # run to give the first token's logits.
            cache, hit = prefix.fetch(self.tokens, (self.total - 1) // prefix.block_size, self.owner,
                                      compute_s_per_token=self.engine.compute_cost.value, salt=self.salt)
            if cache is not None:
                self.cache, self.processed, self.cached_tokens = cache, hit, hit
                if hit >= self.snapshot_at:  # this very snapshot: nothing new to store
                    self.snapshot_at = 0
                return
        self.cache = make_prompt_cache(self.engine.model)

    def save_prefix(self, host=None, later=None) -> int:
        """Store the prompt's full blocks that the prefix cache lacks, or its
        snapshot (once, after the result). Returns the blocks (snapshots)
        written; 0 without a cache. `host`, `later`: as PrefixCache.store's."""
        prefix = self.engine.prefix
        if prefix is None or self.result is None or self._saved:
            return 0
        self._saved = True
        snapshot, self.snapshot = self.snapshot, None  # host memory: drop it once stored
        return prefix.store(self.tokens, self.result.cache, self.owner, host=host, later=later, snapshot=snapshot,
                            salt=self.salt)

    def _finish(self) -> PrefillResult:
        """The final chunk, the last token with it, and the first token."""
        if self.ane is not None:
            logits = self.ane.last_logits(self.prompt[None, self.processed:], self.cache)
        else:
            logits = mlx_hooks.logits_at(self.engine.model, self.prompt[None, self.processed:], self.cache)
        first, lp = sample_first(logits, self.prompt, self.sampling, self.cache, self.matcher, self.budget.produced)
        return PrefillResult(
            first_token=first,
            logprob=lp,
            cache=self.cache,
            num_tokens=self.total,
            rope_offset=self.total,
            prefill_ms=0.0,
            cached_tokens=self.cached_tokens,
        )


def sample_first(logits: mx.array, prompt: mx.array, sampling: SamplingParams, cache: list, matcher=None,
                 draws: int = 0):
    """The first token from the prompt's last logits [1, vocab], sampled as
    decode samples (under `matcher`'s mask when the request has a grammar,
    then the request's processors over the whole prompt, its sampler),
    evaluated with `cache`: (token id, TokenLogprob or None). Raises
    GrammarError if the matcher refuses the token (or whatever its sampling
    raised). `draws`: tokens a seeded request already drew (a resumed one's
    answer so far)."""
    first = sample_firsts([(logits, prompt, sampling, matcher, draws)], cache)[0]
    if isinstance(first, Exception):
        raise first
    return first


def sample_firsts(rows, cache) -> list:
    """sample_first for several prompts, [(logits [1, vocab], prompt,
    sampling, matcher or None, draws), ...], evaluated together with `cache` (one
    wait, not one a row). A row's entry is (token id, TokenLogprob or None),
    or the exception that fails that row alone: a GrammarError (its first
    token refused), or whatever its sampling raised."""
    out: list = [None] * len(rows)
    constrained = [(r[3], i) for i, r in enumerate(rows) if r[3] is not None]
    bitmask = None
    if constrained:
        mx.async_eval([r[0] for r in rows])  # the final chunk computes while the masks fill
        bitmask = _masks(constrained, len(rows), rows[0][0].shape[-1], out)
    drawn = {}
    for i, (logits, prompt, sampling, matcher, draws) in enumerate(rows):
        if out[i] is None:
            drawn[i] = _row_or_error(_draw, logits, prompt, sampling, matcher, draws, bitmask, i)
    _evaluate(drawn, cache)
    for i, d in drawn.items():
        out[i] = d if isinstance(d, Exception) else _row_or_error(_first_of, d, rows[i][2], rows[i][3])
    return out


def _masks(constrained, batch: int, width: int, out: list):
    """The batch's masks; a matcher llguidance raises on fails its row alone."""
    try:
        return fill_masks(constrained, batch, width)
    except Exception:  # noqa: BLE001 - find the row: each alone
        for matcher, i in constrained:
            failed = _row_or_error(fill_masks, [(matcher, 0)], 1, width)
            if isinstance(failed, Exception):
                out[i] = failed
        return fill_masks([(m, i) for m, i in constrained if out[i] is None], batch, width)


def _row_or_error(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - one row's failure is that row's alone
        return exc


def _draw(logits, prompt, sampling, matcher, draws, bitmask, i):
    """One row's token and log-probabilities, queued (not evaluated)."""
    if matcher is not None:
        logits = apply_masks(logits, bitmask[i:i + 1])
    sampler, processors = build_sampling(sampling, draws_done=draws)
    for proc in processors:
        logits = proc(prompt, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs), logprobs


def _evaluate(drawn: dict, cache: list) -> None:
    """The rows' draws (row -> arrays, or the exception that failed it) and
    the prompts' KV in one wait; a row whose arrays fail to compute fails
    alone (each then evaluated apart)."""
    try:
        mx.eval([d for d in drawn.values() if not isinstance(d, Exception)], [c.state for c in cache])
    except Exception:  # noqa: BLE001 - find the row
        for i, d in drawn.items():
            failed = d if isinstance(d, Exception) else _row_or_error(mx.eval, d)
            if isinstance(failed, Exception):
                drawn[i] = failed
        mx.eval([c.state for c in cache])


def _first_of(drawn, sampling: SamplingParams, matcher):
    """(token id, TokenLogprob or None) of an evaluated draw; a GrammarError
    when its matcher refuses the token."""
    token, logprobs = drawn
    first = int(token.item())
    refused = consume(matcher, first) if matcher is not None else None
    if refused is not None:
        return GrammarError(f"first token {first} does not follow the grammar: {refused}")
    return first, token_logprob(logprobs, first, sampling.top_logprobs) if wants_logprobs(sampling) else None


class PrefillEngine:
    """Prefills prompts with `model` in chunks of `chunk_size` tokens, reusing
    and filling `prefix` (a workers.kv.prefix_cache.PrefixCache) when given."""

    def __init__(self, model, chunk_size: int = 512, prefix=None, grammars=None):
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        self.model = model
        self.vocab = logits_width(model)  # the logits' width: logit_bias ids within it (None: unknown)
        self.grammars = grammars  # workers.grammar.Grammars, or None: no grammar can be followed
        self.chunk_size = chunk_size
        self.prefix = prefix
        # Seconds per prompt token, recent chunks of at least MIN_TIMED_CHUNK
        # tokens: the prefix cache weighs loading a hit against recomputing it.
        self.compute_cost = RecentMin()
        self.clock = None  # the worker's LoopClock: parts of a prefill, timed
        self._token_nbytes = None
        # Prefill on the Neural Engine (workers/prefill/ane/): the bridge, and when
        # a prompt goes there: "ane" every prompt that fits its buckets; "auto"
        # uncached parts of ane_min_tokens or more (short ones stay on the GPU),
        # all of them while the power policy says so (`ane_all`, saver).
        self.ane = None
        self.ane_mode = "mlx"
        self.ane_min_tokens = 256
        self.ane_all = False
        mlx_hooks.install(model)  # on the CPU, attention and SwiGLU without MLX's slow exp

    MIN_TIMED_CHUNK = 64  # shorter chunks are mostly fixed per-call cost

    def ane_for(self, cached: int, new_tokens: int):
        """The Neural Engine bridge for a prompt of `new_tokens` after `cached`, or None (MLX)."""
        if self.ane is None or self.ane_mode == "mlx":
            return None
        if self.ane_mode == "auto" and not self.ane_all and new_tokens < self.ane_min_tokens:
            return None
        return self.ane if self.ane.fits(cached, new_tokens) else None

    def fix_token_nbytes(self, nbytes: int) -> None:
        """What token_nbytes says from now (a worker group's ranks count alike)."""
        self._token_nbytes = int(nbytes)

    def token_nbytes(self) -> int:
        """Bytes of one token's KV over all layers (plain KV caches; found once)."""
        if self._token_nbytes is None:
            from workers.kv.blocks import probe_kv_layout

            self._token_nbytes = probe_kv_layout(self.model, 1).token_nbytes
        return self._token_nbytes

    def observe_compute(self, tokens: int, seconds: float) -> None:
        if tokens >= self.MIN_TIMED_CHUNK:
            self.compute_cost.add(seconds / tokens)

    def start(self, prompt_tokens: Sequence[int], sampling: SamplingParams, owner: str = "",
              budget: Optional[TokenBudget] = None, salt: str = "") -> PrefillJob:
        """A job for the prompt; `budget`: a resumed request's (None: a new one's)."""
        return PrefillJob(self, prompt_tokens, sampling, owner, budget, salt)

    def run(self, prompt_tokens: Sequence[int], sampling: SamplingParams, owner: str = "") -> PrefillResult:
        """Prefill to the end and save the prompt's blocks (tests, simple callers)."""
        job = self.start(prompt_tokens, sampling, owner)
        while (result := job.step()) is None:
            pass
        job.save_prefix()
        return result


def first_token_finishes(result_token: int, sampling: SamplingParams, eos_token_ids: Sequence[int] = (),
                         budget: Optional[TokenBudget] = None) -> Optional[str]:
    """finish_reason if the first (prefill) token already ends the request
    (`budget`: a resumed request's, before that token; None: a new one's).

    Such requests must NOT be sent to the decode engine (DecodeEngine.add
    rejects them): the caller reports the token with this finish_reason.
    """
    if result_token in set(sampling.stop_token_ids) | set(eos_token_ids):
        return "stop"
    if (budget if budget is not None else TokenBudget(sampling.max_tokens)).after(1).exhausted:
        return "length"
    return None
