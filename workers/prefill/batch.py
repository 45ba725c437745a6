"""Several prompts' prefills in one forward pass: a burst of short suffixes.

A swarm's agents get their answers at about the same moment, so their next
turns reach the prefill worker together: 32 prompts of ~1,500 tokens whose
cached prefixes leave ~65 new tokens each. One at a time, each pays a whole
forward pass for 65 tokens, which on a GPU costs about what 500 would (the
host's launches, the weights read once a pass: docs/benchmarks-log.md, session 16,
17.5 ms of a prompt's 40 on an H100).

Here the prompts' jobs (workers.prefill.engine.PrefillJob, each with its cached
prefix loaded) run as one batch, the way mlx_lm.generate's prompt phase runs
one prompt:
  * their cached prefixes go into mlx-lm's left-padded BatchKVCache;
  * all new tokens, right-padded to the longest, run as one pass
    (`prepare(right_padding=...)`, then `finalize()` moves the padding to
    the left, as mlx-lm's BatchGenerator does), whose head computes each
    row's last real position only (mlx_hooks.logits_at);
  * each row samples those logits with its own request's processors and
    sampler. (mlx-lm runs the last tokens as a pass of their own; one pass
    fewer is one read of the weights fewer.)
Each row then leaves with a plain per-layer cache of its own (views of the
batch's buffers), which the worker hands off and stores as for a prompt
prefilled alone.

A batch holds rows whose new tokens, padded to the longest, fit one chunk
(`PrefillEngine.chunk_size`), so it takes about as long as a chunk, which
is what a colocated worker's decode streams wait for between steps.
"""

from __future__ import annotations

import time
from typing import List, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import BatchKVCache, KVCache

from workers.kernels import mlx_hooks
from workers.kernels.mlx_cache import set_write_index, write_index
from workers.kv.cache_state import is_plain_kv
from workers.loop_clock import part
from workers.prefill.engine import PrefillJob, PrefillResult, sample_firsts


def new_tokens(job: PrefillJob) -> int:
    """Tokens the job's pass computes (its prefix loaded)."""
    return job.total - job.processed


def batchable(job: PrefillJob) -> bool:
    """Whether `job` (its prefix loaded) can run in a batch: a text prompt
    with nothing computed yet, plain KV (no window, no recurrent state, no
    snapshot to take), not sent to the Neural Engine, and its new tokens within one chunk."""
    return (type(job) is PrefillJob and job.result is None and job.cache is not None and job.ane is None
            and job.processed == job.cached_tokens and job.snapshot_at == 0
            and is_plain_kv(job.cache) and new_tokens(job) <= job.engine.chunk_size)


def fits(jobs: Sequence[PrefillJob], job: PrefillJob) -> bool:
    """Whether `job` can join `jobs` with the batch's padded new tokens within one chunk."""
    longest = max([new_tokens(j) for j in jobs] + [new_tokens(job)])
    return longest * (len(jobs) + 1) <= job.engine.chunk_size


def run_batch(jobs: Sequence[PrefillJob]) -> List[PrefillResult]:
    """Prefill `jobs` (batchable, same engine) together; their results, in
    order (a row whose first token its grammar refused: that GrammarError)."""
    engine = jobs[0].engine
    model, clock = engine.model, engine.clock
    tic = time.perf_counter()
    parts: dict[str, float] = {}
    with mx.stream(generation_stream):
        lengths = [new_tokens(j) for j in jobs]
        longest = max(lengths)
        cache = [_padded(layer, room=longest) for layer in zip(*(j.cache for j in jobs))]
        with part(clock, "chunk", parts):
            pad = [longest - n for n in lengths]
            tokens = mx.array([j.tokens[j.processed:] + [0] * p for j, p in zip(jobs, pad)], dtype=mx.int32)
            if max(pad) > 0:
                for c in cache:
                    c.prepare(right_padding=pad)
            logits = mlx_hooks.logits_at(model, tokens, cache, last=[n - 1 for n in lengths])
            for c in cache:
                c.finalize()
            starts = cache[0].left_padding.tolist()  # every layer's padding is the same
            rows = [[_row(c, i, start) for c in cache] for i, start in enumerate(starts)]
            firsts = sample_firsts([(logits[i:i + 1], j.prompt, j.sampling, j.matcher, j.budget.produced) for i, j in enumerate(jobs)],
                                   [c for row in rows for c in row])
    ms = (time.perf_counter() - tic) * 1000.0
    results = []
    for job, row, first in zip(jobs, rows, firsts):
        if isinstance(first, Exception):
            results.append(first)
            continue
        first, lp = first
        job.processed = job.total
        job.cache = row
        job.parts.update(parts)
        job.result = PrefillResult(first_token=first, logprob=lp, cache=row, num_tokens=job.total,
                                   rope_offset=job.total, prefill_ms=ms, cached_tokens=job.cached_tokens)
        results.append(job.result)
    return results


def _row(batch: BatchKVCache, i: int, start: int) -> KVCache:
    """Row i of a batch as a plain cache: views of the batch's buffers (its
    handoff and store copy what they send; nothing else needs a copy)."""
    row = KVCache()
    end = write_index(batch)
    row.keys = batch.keys[i:i + 1, :, start:end]
    row.values = batch.values[i:i + 1, :, start:end]
    row.offset = end - start
    return row


def _padded(layers: Sequence, room: int) -> BatchKVCache:
    """One layer's per-row KVCaches as a left-padded BatchKVCache, with room
    for `room` more positions (so the passes write in place, where mlx-lm's
    BatchKVCache.merge leaves none and the first pass copies it all again)."""
    sizes = [c.offset if c.keys is not None else 0 for c in layers]
    width = max(sizes)
    batch = BatchKVCache([width - n for n in sizes])
    some = next((c for c in layers if c.keys is not None), None)
    if some is None:  # nothing cached in any row: the first pass makes the buffers
        return batch
    _, heads, _, k_dim = some.keys.shape
    v_dim = some.values.shape[3]
    keys = mx.zeros((len(layers), heads, width + room, k_dim), some.keys.dtype)
    values = mx.zeros((len(layers), heads, width + room, v_dim), some.values.dtype)
    for i, (c, n) in enumerate(zip(layers, sizes)):
        if n:
            keys[i, :, width - n:width] = c.keys[0, :, :n]
            values[i, :, width - n:width] = c.values[0, :, :n]
    batch.keys, batch.values = keys, values
    batch.offset = batch.offset + width
    set_write_index(batch, width)
    return batch
