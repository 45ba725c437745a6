"""Constrained decoding: a request's grammar (`SamplingParams.grammar`,
protos/grammar.py) as llguidance matchers, and their token masks on MLX logits.

Both roles sample under it: prefill's first token with a fresh matcher, and
decode's others with a matcher of its own that consumes each of the row's
input tokens (the first one is prefill's) before it masks the next logits.

* `Grammars` (one per worker process): the served model's llguidance
  tokenizer, and compiled grammars by text in a bounded LRU; a request takes
  a `deep_copy` of the compiled matcher, so a schema is compiled once.
* `fill_masks`: the masks of a batch's constrained rows in one
  `fill_next_token_bitmask_par` call (llguidance's threads, GIL released).
* `apply_masks`: disallowed logits to -inf with an `mx.where` over the
  unpacked bitmask. llguidance.mlx is a Metal kernel; this runs on MLX's
  CPU, CUDA and Metal backends alike. Free rows' masks are all ones, so their
  logits are left bit for bit as they were. (On the CPU backend MLX's where
  is its slow op here: ~2-6 ms over 16 x 49k logits on 2 cores, against
  ~0.5 ms for an add; ~1-2% of a step of SmolLM2-135M's shape.)
* `ConstrainedRows`: a decode batch's matchers by row uid, stepped once per
  decode step (workers/kernels/generation_batch.py). A token a matcher refuses
  (the mask should make that impossible) fails that request only.

Logprobs of a constrained row are those of the masked distribution (the
allowed tokens renormalized), as OpenAI reports them: the mask comes before
the logits processors and the normalization.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from environment.backend import on_cpu
from protos.grammar import first_mask_error, ll_tokenizer

log = logging.getLogger(__name__)

# Compiled grammars kept per worker: a swarm's handful of tool schemas and
# response formats, each compiled once (~1 ms for a small schema, much more
# for a large one).
COMPILED_GRAMMARS = 64


class GrammarError(ValueError):
    """A grammar that does not compile, or a token its matcher refuses."""


def first_line(message: str) -> str:
    """llguidance's errors carry the parser state after a first line that says it all."""
    return (message or "unknown grammar error").strip().splitlines()[0]


@lru_cache(maxsize=1)
def executor():
    """The process's one llguidance executor (its own thread pool)."""
    import llguidance

    return llguidance.LLExecutor()


@lru_cache(maxsize=1)
def mask_thread() -> ThreadPoolExecutor:
    """One helper thread that steps a decode batch's matchers while the MLX
    thread queues the forward pass (llguidance only: no MLX call there)."""
    return ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")


class Grammars:
    """The grammars one worker process follows, over `tokenizer` (its
    backend_tokenizer and eos_token_ids: the folder's FolderTokenizer, or
    mlx-lm's TokenizerWrapper) and `n_vocab`, the width of the model's logits (may
    exceed the tokenizer's vocabulary; None: the tokenizer's)."""

    def __init__(self, tokenizer, n_vocab: Optional[int] = None, capacity: int = COMPILED_GRAMMARS):
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.capacity = capacity
        self.eos_ids = sorted(int(t) for t in (getattr(tokenizer, "eos_token_ids", None)
                                               or [tokenizer.eos_token_id]))
        self._ll = None
        self._lock = threading.Lock()  # prepare() may run on a helper thread
        self._compiled: "OrderedDict[str, object]" = OrderedDict()

    @property
    def ll_tokenizer(self):
        """llguidance's tokenizer, built at first use (~0.4 s; `prepare`).
        GrammarError when this tokenizer cannot be given to llguidance."""
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = ll_tokenizer(self.tokenizer, self.n_vocab)
                except Exception as exc:  # noqa: BLE001 - one message for every way it fails
                    self._ll = GrammarError(f"grammars are not available for this model's tokenizer: "
                                            f"{type(exc).__name__}: {exc}")
            if isinstance(self._ll, GrammarError):
                raise self._ll
            return self._ll

    def prepare(self) -> None:
        """Build the tokenizer now (a worker does it on a helper thread while
        it warms up, so the first constrained request does not pay it)."""
        try:
            self.ll_tokenizer  # noqa: B018 - built and kept
        except GrammarError as exc:
            log.warning("%s", exc)

    def matcher(self, grammar: str):
        """A fresh matcher for `grammar`; GrammarError when it does not compile."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            import llguidance

            # log_level 0: its warnings would go to stderr; errors are ours to report.
            compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            problem = first_mask_error(compiled)  # the mask it computes stays with the compiled copy
            if problem:
                raise GrammarError(f"invalid grammar: {problem}")
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return compiled.deep_copy()


def logits_width(model) -> Optional[int]:
    """The width of `model`'s logits (its config's vocab_size; None if unknown)."""
    args = getattr(model, "args", None) or getattr(getattr(model, "language_model", None), "args", None)
    width = getattr(args, "vocab_size", None)
    return int(width) if width else None


def matcher_for(grammars: Optional[Grammars], sampling):
    """The matcher a request samples under (None: free output)."""
    if not sampling.grammar:
        return None
    if grammars is None:
        raise GrammarError("this worker has no tokenizer to follow a grammar with")
    return grammars.matcher(sampling.grammar)


def matcher_after(grammars: Optional[Grammars], sampling, answer: Sequence[int]):
    """The matcher of a request resumed after its worker died, having
    followed `answer` (its tokens so far); None: free output. Raises
    GrammarError if the grammar refuses them (it accepted them before)."""
    matcher = matcher_for(grammars, sampling)
    for token in answer if matcher is not None else ():
        refused = consume(matcher, token)
        if refused is not None:
            raise GrammarError(f"the answer so far does not follow the grammar: {refused}")
    return matcher


def fill_masks(rows: Sequence[Tuple[object, int]], batch: int, width: int) -> np.ndarray:
    """The token bitmask (batch, ceil(width / 32)) int32 of a batch whose
    rows `rows` [(matcher, row index)] are constrained; the other rows allow
    every token."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    bitmask = allocate_token_bitmask(batch, width)  # all ones
    if rows:
        fill_next_token_bitmask_par(executor(), list(rows), bitmask)
    return bitmask


def apply_masks(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """`logits` [batch, ..., vocab] with the tokens `bitmask` [batch, words]
    disallows set to -inf (vocab columns past the mask's are disallowed)."""
    batch, width = logits.shape[0], logits.shape[-1]
    allowed = _unpack_on_host(bitmask) if on_cpu() else _unpack_on_device(bitmask)
    if allowed.shape[1] >= width:
        allowed = allowed[:, :width]
    else:
        allowed = mx.concatenate([allowed, mx.zeros((batch, width - allowed.shape[1]), mx.bool_)], axis=1)
    allowed = allowed.reshape(batch, *([1] * (logits.ndim - 2)), width)
    return mx.where(allowed, logits, mx.array(float("-inf"), logits.dtype))


def _unpack_on_host(bitmask: np.ndarray) -> mx.array:
    """Bit i of word w is token 32w + i (little-endian hosts). On the CPU
    backend numpy's unpack takes ~0.2 ms for 16 rows of 49k tokens, MLX's
    shifts ~2 ms."""
    return mx.array(np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").view(np.bool_))


@lru_cache(maxsize=1)
def _bit_positions() -> mx.array:
    return mx.arange(32, dtype=mx.int32)


def _unpack_on_device(bitmask: np.ndarray) -> mx.array:
    """On a GPU the words cross to the device, 32 times fewer bytes than the
    unpacked mask, and unpack there (0.05 ms of host time against 0.7 ms
    for 16 rows of 152k tokens on an H100)."""
    words = mx.array(bitmask)
    return ((words[:, :, None] >> _bit_positions()) & 1).reshape(words.shape[0], -1).astype(mx.bool_)


def consume(matcher, token: int) -> Optional[str]:
    """Advance `matcher` by `token`; the error when it refuses it (None: taken)."""
    # A matcher in error takes end-of-sequence ids: is_error() says it all.
    if matcher.consume_token(int(token)) and not matcher.is_error():
        return None
    return first_line(matcher.get_error())


def _consumed(matcher, token: int):
    """matcher.consume_token's answer, or the exception it raised."""
    try:
        return matcher.consume_token(token)
    except Exception as exc:  # noqa: BLE001
        return exc


class ConstrainedRows:
    """The matchers of a decode batch's constrained rows, by row uid.

    Each step `masks(uids, inputs)` has every matcher consume its row's
    input token (the token the step feeds: for a row that just joined,
    prefill's first token), then fills all their masks in one call. A row
    whose matcher refuses its token goes to `failed` (uid -> error) and is
    left unconstrained until the engine drops it."""

    def __init__(self):
        self.matchers: Dict[int, object] = {}
        self.failed: Dict[int, str] = {}
        self.fill_s = 0.0  # the last masks()'s host time

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, uid: int, matcher) -> None:
        self.matchers[uid] = matcher

    def keep(self, uids: Sequence[int]) -> None:
        """Forget the rows that left the batch (`uids`: those that stay)."""
        if self.matchers:
            live = set(uids)
            self.matchers = {u: m for u, m in self.matchers.items() if u in live}

    def take_failed(self) -> Dict[int, str]:
        failed, self.failed = self.failed, {}
        for uid in failed:
            self.matchers.pop(uid, None)
        return failed

    def rows(self, uids: Sequence[int]) -> List[Tuple[int, int, object]]:
        """(row index, uid, matcher) of the batch's constrained rows still following."""
        return [(i, u, self.matchers[u]) for i, u in enumerate(uids)
                if u in self.matchers and u not in self.failed]

    def masks(self, uids: Sequence[int], inputs: Sequence[int], width: int) -> Optional[np.ndarray]:
        """Consume this step's input tokens, then the batch's bitmask (None:
        no row of this batch is constrained)."""
        rows = self.rows(uids)
        if not rows:
            return None
        t0 = time.perf_counter()
        pairs = [(m, int(inputs[i])) for i, _, m in rows]
        par = getattr(executor(), "consume_token_par", None)  # llguidance >= 1.7
        try:
            taken = par(pairs) if par is not None else [m.consume_token(t) for m, t in pairs]
        except Exception:  # noqa: BLE001 - a matcher that raises fails its row alone
            taken = [_consumed(m, t) for m, t in pairs]
        for (i, uid, m), ok in zip(rows, taken):
            if isinstance(ok, Exception):
                self.failed[uid] = f"its grammar failed: {type(ok).__name__}: {ok}"
            elif not ok or m.is_error():  # see consume()
                self.failed[uid] = (f"token {int(inputs[i])} does not follow the grammar: "
                                    f"{first_line(m.get_error())}")
        bitmask = self._fill([(i, u, m) for i, u, m in rows if u not in self.failed], len(uids), width)
        self.fill_s = time.perf_counter() - t0
        return bitmask

    def _fill(self, rows: List[Tuple[int, int, object]], batch: int, width: int) -> np.ndarray:
        """The batch's masks; a matcher llguidance raises on fails its row
        alone (each then tried apart, the rest filled again)."""
        try:
            return fill_masks([(m, i) for i, _, m in rows], batch, width)
        except Exception:  # noqa: BLE001 - find the row
            for i, uid, m in rows:
                try:
                    fill_masks([(m, 0)], 1, width)
                except Exception as exc:  # noqa: BLE001
                    self.failed[uid] = f"its grammar failed: {type(exc).__name__}: {exc}"
            return fill_masks([(m, i) for i, u, m in rows if u not in self.failed], batch, width)

    def start_masks(self, uids: Sequence[int], inputs: Sequence[int], width: int) -> "Future":
        """masks() on the helper thread (nothing else may touch these rows
        until its result is taken)."""
        return mask_thread().submit(self.masks, list(uids), list(inputs), width)
