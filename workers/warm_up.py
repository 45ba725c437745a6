"""A worker's first prompt and decode steps, run before it says it is ready.

A process's first calls pay for set-up that later ones do not: MLX compiles
kernels on first use (Metal and CUDA JIT kernels, mx.compile's functions on
the CPU), BLAS, cuBLAS and cuDNN make their handles and plans, allocators
fill their caches. A launchd service restarts with nobody watching, and its
first client should not be the one who pays. So a worker runs a short prompt
(two chunks: the second over the first's cache, as a follow-up turn does)
and a few decode steps of it beside a shorter one, with greedy sampling,
and a prefill worker two follow-ups of it in one batch (workers/prefill/batch.py),
before it reports "ready": two rows of different lengths make a padded
batch, whose steps take the decode attention of a busy server (on CUDA
workers/kernels/cuda_decode_attention.py, whose kernels compile at their first
call). Nothing here reads or writes the prefix cache, counts in the
metrics or in the loop clock: the engines' clocks are not set yet, the
prefill engine here has no prefix cache, and the decode engine's is
detached for the duration.

Not done, measured (docs/benchmarks-log.md, session 12): a sweep of every prompt
size at start-up, to set up per-shape state before the first client. On
MLX's CUDA backend that state is mostly CUDA graphs, one per new shape in a
cache of 400; a sweep over every token count to 128 and every 8th to 512,
over 64 and 1,536 cached tokens (12-32 s at start), filled that cache and
left a follow-up picture turn as slow as before. Workers now run without
CUDA graphs instead (workers/models/loading.py set_cuda_graphs).
"""

from __future__ import annotations

import logging
import time

from protos.messages import DecodeRequest, KVHandoff, SamplingParams
from workers.role import Role, Unit

log = logging.getLogger(__name__)

PROMPT_TOKENS = 40  # two chunks of a short prompt, then its last token alone
SHORTER_TOKENS = 25  # the second row's prompt: the first's first tokens
DECODE_TOKENS = 4
REQUEST_ID = "tandem-warm-up"


def warm_up(model, decode=None, batch: bool = False, fatal: bool = False) -> float:
    """Prefill a fixed prompt with `model` and, given a DecodeEngine, decode a
    few tokens of it there; with `batch` (a worker that prefills batches of
    prompts), also two follow-ups of it in one batch. Returns the seconds
    taken. Any failure is logged and swallowed: a worker that cannot warm up
    still serves (the first request then fails or pays, as it would have).
    `fatal` (a group's rank): raised instead, as a rank that stopped halfway
    would leave the others waiting in a collective it never joins."""
    from workers.prefill.engine import PrefillEngine

    t0 = time.perf_counter()
    greedy = SamplingParams(max_tokens=DECODE_TOKENS + 1, temperature=0.0)
    # Ids below 1,000 exist in every vocabulary; which ones does not matter.
    tokens = [10 + (i * 7919) % 1000 for i in range(PROMPT_TOKENS)]
    try:
        engine = PrefillEngine(model, chunk_size=PROMPT_TOKENS // 2)
        rows = [(REQUEST_ID, tokens, engine.run(tokens, greedy))]
        if batch:
            _batch(engine, tokens, rows[0][2].cache, greedy)
        if decode is not None:
            shorter = tokens[:SHORTER_TOKENS]
            rows.append((REQUEST_ID + "-2", shorter, engine.run(shorter, greedy)))
            _decode(decode, [row for row in rows if row[2].first_token not in decode.eos_token_ids], greedy,
                    speculate=not fatal)
    except Exception as e:  # noqa: BLE001 - never fatal but in a group; see the docstring
        if fatal:
            raise
        log.warning("warm-up failed (%s: %s); the first request will pay for set-up", type(e).__name__, e)
    return time.perf_counter() - t0


def _batch(engine, tokens: list, cache: list, sampling: SamplingParams) -> None:
    """Two follow-up prompts of `tokens` in one batch (workers/prefill/batch.py),
    over cached prefixes of different lengths (`cache`'s first tokens) and
    with new tails of different lengths: every kernel a batch runs (its
    padded pass, its one token a row over left padding, RoPE at a position
    per row) is set up. On an H100 a new process's first batches took 1-2 s
    each without it (docs/benchmarks-log.md, session 17)."""
    from mlx_lm.models.cache import KVCache

    from workers.prefill.batch import run_batch

    def head(n: int) -> list:
        out = []
        for c in cache:
            h = KVCache()
            h.state = (c.keys[..., :n, :], c.values[..., :n, :], n)
            out.append(h)
        return out

    jobs = []
    for cached, new in ((SHORTER_TOKENS, 9), (PROMPT_TOKENS - 8, 4)):
        job = engine.start(tokens[:cached] + tokens[-new:], sampling)
        job.load(cached=(head(cached), cached))
        jobs.append(job)
    run_batch(jobs)


def _decode(decode, rows: list, sampling: SamplingParams, speculate: bool = True) -> None:
    """Decode `rows` ([(request id, prompt tokens, PrefillResult)]) together;
    without drafts unless `speculate` (a group's ranks: the warm-up is one
    unit, whose steps carry no step costs from rank 0, and ranks that timed
    their steps apart could draft apart: workers/group/members.py)."""
    prefix, decode.prefix = decode.prefix, None  # nothing of the warm-up is committed
    speculation = decode.speculation
    if not speculate:
        decode.speculation = None
    try:
        for rid, tokens, result in rows:
            decode.add(DecodeRequest(rid, tokens, result.first_token,
                                     KVHandoff(rid, result.num_tokens, result.rope_offset, local=True), sampling),
                       result.cache)
        for _ in range(4 * DECODE_TOKENS):  # bounded: a request ends after max_tokens
            if not decode.has_work:
                break
            decode.step()
    finally:
        for rid, _, _ in rows:
            decode.cancel(rid, save=False)  # still there only if a step failed
        decode.prefix, decode.speculation = prefix, speculation


class WarmUpRole(Role):
    """The warm-up the power policy deferred (on battery in saver,
    environment/power/policy.py), as a role of the loop: its one unit is
    due once no other role has work and a policy allows it, and runs once.
    `run()` warms the process up."""

    def __init__(self, run, *, worker_id: str, outbox, clock, deferred: bool = True):
        super().__init__(worker_id, outbox, clock)
        self.deferred = deferred
        self.cold = True
        self.unit = Unit("warm up", self.warm)
        self._run = run

    def units(self, busy_elsewhere):
        if self.cold and not self.deferred and not busy_elsewhere():
            yield self.unit

    def unit_kinds(self) -> list[Unit]:
        return [self.unit]

    def limit(self, limits) -> str:
        self.deferred = bool(limits.defer_warm_up)
        return ""

    def warm(self, wait: bool = False) -> None:
        self._run()
        self.cold = False
