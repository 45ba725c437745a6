"""Turn a request's SamplingParams into mlx-lm samplers and logits processors.

Everything here reuses mlx-lm's pieces (greedy_sampler, the top-p / min-p /
top-k filters, make_logits_processors) so that our tokens match mlx_lm.generate.
The one thing mlx-lm does not give us is a *per-request* random stream: its
categorical sampler draws from MLX's global PRNG, so a request's output would
depend on what else shares the batch. `SeededSampler` owns its own PRNG key.

Runs on the worker's MLX thread only (like all MLX work).
"""

from __future__ import annotations

import math
import secrets
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from protos.messages import SamplingParams, TokenLogprob

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# One object for every greedy request: BatchGenerator samples the whole batch
# in one call when all rows share the same sampler object.
GREEDY_SAMPLER: Sampler = greedy_sampler


class SeededSampler:
    """Temperature sampling with top-p / min-p / top-k and its own PRNG stream.

    Draw i uses the i-th subkey of the chain `key_{i+1}, sub_i = split(key_i)`
    starting from `mx.random.key(seed)`. `skip` draws can be consumed up front
    so that a decode worker continues the exact stream prefill started (prefill
    drew once for the first token; decode passes skip=1).

    Called with log-probabilities of shape (1, vocab) — one request's row — and
    returns shape (1,), like mlx-lm samplers.
    """

    # Set by RowFaults.guard: a failure inside a batch's step is reported
    # there (the row is failed alone) and a placeholder token returned.
    on_fault: Optional[Callable[[Exception], None]] = None

    def __init__(self, params: SamplingParams, seed: int, skip: int = 0):
        self.seed = seed
        self.temperature = float(params.temperature)
        self._filters = []
        # Same filter order and conditions as mlx_lm.sample_utils.make_sampler.
        if 0 < params.top_p < 1.0:
            self._filters.append(lambda x, p=float(params.top_p): apply_top_p(x, p))
        if params.min_p != 0.0:
            self._filters.append(lambda x, p=float(params.min_p): apply_min_p(x, p, 1))
        if params.top_k > 0:
            # mlx-lm rejects top_k >= vocab; clients send that meaning "off".
            self._filters.append(
                lambda x, k=int(params.top_k): apply_top_k(x, k) if k < x.shape[-1] else x
            )
        self._key = mx.random.key(seed)
        for _ in range(skip):
            self._next_key()

    def _next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def __call__(self, logprobs: mx.array) -> mx.array:
        try:
            return self.draw(self.distribution(logprobs))
        except Exception as exc:  # noqa: BLE001 - this row fails, not its batch
            if self.on_fault is None:
                raise
            self.on_fault(exc)
            return mx.zeros((logprobs.shape[0],), mx.uint32)

    def distribution(self, logprobs: mx.array) -> mx.array:
        """The unnormalised log-probabilities this sampler draws from (its
        filters, then its temperature), row by row: speculative decoding's
        rejection rule needs them (workers/decode/spec_verify.py)."""
        for f in self._filters:
            logprobs = f(logprobs)
        return logprobs * (1.0 / self.temperature)

    def draw(self, logits: mx.array) -> mx.array:
        """One token per row of `logits` (from distribution()), from this stream."""
        return mx.random.categorical(logits, key=self._next_key())

    def uniform(self, n: int) -> mx.array:
        """n uniform draws in [0, 1) from this stream."""
        return mx.random.uniform(shape=(n,), key=self._next_key())


def random_seed() -> int:
    """A fresh 63-bit seed for requests that did not give one."""
    return secrets.randbits(63)


SEED_LIMIT = 2**64  # mx.random.key takes seeds in [0, 2**64)


def check_sampling(params: SamplingParams, vocab: Optional[int] = None) -> None:
    """ValueError naming the first of `params` a sampler or processor here
    cannot take (the router refuses these with a 400; a worker checks again
    before a request shares a batch, so one bad request fails alone). `vocab`:
    the width of the model's logits, which logit_bias ids must fall within."""
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if params.temperature < 0 or not 0 <= params.min_p <= 1 or params.repetition_penalty <= 0:
        raise ValueError(f"temperature {params.temperature}, min_p {params.min_p} or repetition_penalty "
                         f"{params.repetition_penalty} out of range")
    if not isinstance(params.top_k, int) or params.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0, got {params.top_k!r}")
    if params.seed is not None and not (isinstance(params.seed, int) and 0 <= params.seed < SEED_LIMIT):
        raise ValueError(f"seed must be an integer in [0, 2**64), got {params.seed!r}")
    for key, value in (params.logit_bias or {}).items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else -1  # in-process callers' ids
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:  # the wire's
            token = int(key)
        if not 0 <= token < (vocab or 2**32):
            raise ValueError(f"logit_bias key {key!r} is not a token id of this model"
                             + (f" (0 to {vocab - 1})" if vocab else ""))
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"logit_bias value for {key!r} must be a finite number, got {value!r}")


def make_sampler(params: SamplingParams, draws_done: int = 0) -> Sampler:
    """The sampler for one request.

    draws_done: tokens already sampled for this request elsewhere (prefill), so
    a seeded request continues its random stream instead of repeating it.
    """
    if params.temperature == 0:
        return GREEDY_SAMPLER
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    seed = params.seed if params.seed is not None else random_seed()
    return SeededSampler(params, seed, skip=draws_done)


def make_processors(params: SamplingParams) -> List[LogitsProcessor]:
    """mlx-lm logits processors for bias and the three penalties (may be empty)."""
    # The wire format keys logit_bias by str (msgpack maps); mlx-lm wants ints.
    bias = {int(k): float(v) for k, v in (params.logit_bias or {}).items()}
    return make_logits_processors(
        logit_bias=bias or None,
        # mlx-lm treats 1.0 as a real (no-op) penalty; skip it to save work.
        repetition_penalty=(
            params.repetition_penalty if params.repetition_penalty != 1.0 else None
        ),
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )


def build_sampling(
    params: SamplingParams, draws_done: int = 0, vocab: Optional[int] = None
) -> Tuple[Sampler, List[LogitsProcessor]]:
    """(sampler, logits_processors) for one request, its parameters checked
    first (check_sampling: ValueError)."""
    check_sampling(params, vocab)
    return make_sampler(params, draws_done), make_processors(params)


class RowFaults:
    """What one row's sampler or logits processors raised inside a batch's
    step (a decode step samples every row in one call, mlx-lm's
    GenerationBatch): kept by request id, the row given a placeholder, so
    the step goes on and the engine fails that request alone."""

    def __init__(self):
        self.faults: Dict[str, Exception] = {}

    def guard(self, request_id: str, sampler: Sampler,
              processors: List[LogitsProcessor]) -> Tuple[Sampler, List[LogitsProcessor]]:
        """`sampler` and `processors` reporting here. The greedy sampler,
        shared by every greedy row and called once for a whole batch, takes
        nothing of one request's and is left as it is."""
        report = lambda exc: self.faults.setdefault(request_id, exc)  # noqa: E731
        if isinstance(sampler, SeededSampler):
            sampler.on_fault = report
        return sampler, [self._guarded(p, report) for p in processors]

    @staticmethod
    def _guarded(processor: LogitsProcessor, report) -> LogitsProcessor:
        def run(tokens: mx.array, logits: mx.array) -> mx.array:
            try:
                return processor(tokens, logits)
            except Exception as exc:  # noqa: BLE001 - this row fails, not its batch
                report(exc)
                return logits
        return run

    def take(self) -> Dict[str, Exception]:
        faults, self.faults = self.faults, {}
        return faults


def wants_logprobs(params: SamplingParams) -> bool:
    return bool(params.logprobs) or params.top_logprobs > 0


def token_logprob(
    logprobs: mx.array, token: int, top_n: int = 0
) -> TokenLogprob:
    """TokenLogprob for `token` from one row of normalized log-probabilities.

    `logprobs` is the (vocab,) or (1, vocab) vector mlx-lm yields (after the
    logits processors, before temperature and filters: the same vector
    mlx_lm.generate reports; under a grammar, the masked distribution's).
    top is [[id, logprob], ...], best first.
    Only call it for requests that asked: it forces a sync and a partition.
    """
    row = logprobs.reshape(-1)
    chosen = row[token]
    if top_n <= 0:
        return TokenLogprob(token=int(token), logprob=chosen.item())
    top_n = min(int(top_n), row.shape[0])
    # argpartition is O(vocab); only the top_n survivors get sorted.
    idx = mx.argpartition(-row, kth=top_n - 1)[:top_n]
    vals = row[idx]
    mx.eval(chosen, idx, vals)
    # Tokens a grammar's mask ruled out (-inf) are no alternatives: left out.
    pairs = sorted(((i, v) for i, v in zip(idx.tolist(), vals.tolist()) if v != float("-inf")),
                   key=lambda p: -p[1])
    return TokenLogprob(
        token=int(token),
        logprob=chosen.item(),
        top=[[int(i), float(v)] for i, v in pairs],
    )
