"""A prefilled request on its way into the decode batch: checked when it is
added (its handed-off cache, its stop ids, its grammar, its token budget),
then joined at a step boundary as `JoiningRows` (workers/kernels/generation_batch.py),
whose first input is the first token prefill sampled.

A request that its first token already finishes (a stop id, or a budget
that token exhausts) never gets here: the prefill side reports it
(workers.prefill.engine.first_token_finishes), and `Joining.of` refuses it
rather than emit a token past the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import ArraysCache, CacheList

from protos.messages import DecodeRequest
from workers.decode import ragged_kv
from workers.decode.shifted_rope import ShiftedKVCache
from workers.grammar import matcher_after
from workers.kernels.generation_batch import JoiningRows
from workers.sampling import GREEDY_SAMPLER, RowFaults, build_sampling


@dataclass
class Joining:
    """An added request, waiting for a place in the batch."""

    request: DecodeRequest
    cache: list  # its KV as the batch takes it (ragged rows, or ShiftedKVCache layers)
    stop_ids: List[int]
    sampler: object
    processors: list
    matcher: object = None  # an llguidance matcher when the request follows a grammar

    @classmethod
    def of(cls, request: DecodeRequest, cache: list, grammars, eos_token_ids: List[int], ragged: bool,
           vocab: Optional[int] = None, faults: Optional[RowFaults] = None) -> "Joining":
        """The request checked; ValueError (GrammarError: its answer so far
        breaks its grammar; its sampling out of range for `vocab`, the
        logits' width) when it cannot join. `faults`: where its sampler and
        processors report a failure in a step (the engine's)."""
        rid, sp = request.request_id, request.sampling
        # A resumed request's grammar follows its answer so far first.
        matcher = matcher_after(grammars, sp, request.answer)
        stop_ids = set(int(t) for t in sp.stop_token_ids) | set(eos_token_ids)
        if matcher is not None:
            stop_ids |= set(grammars.eos_ids)
        if request.first_token in stop_ids:
            raise ValueError(f"request {rid!r}: first token is a stop token; "
                             "the caller must finish it (never send it to decode)")
        if request.budget.exhausted:
            raise ValueError(f"request {rid!r}: max_tokens already reached; "
                             "the caller must finish it (never send it to decode)")
        check_cache(cache, request)
        # M-RoPE prompts (Qwen-VL) leave the next rope position away from the
        # token count: ragged rows, or the padded batch's per-row offsets
        # (ShiftedKVCache), carry it.
        shift = request.handoff.rope_offset - request.handoff.num_tokens
        cache = ragged_kv.rows_of(cache, shift) if ragged else ShiftedKVCache.of(cache, shift)
        # draws_done: the answer's tokens were drawn from a seeded stream;
        # continue it rather than replay it.
        sampler, processors = build_sampling(sp, draws_done=request.budget.produced, vocab=vocab)
        if faults is not None:
            sampler, processors = faults.guard(rid, sampler, processors)
        return cls(request, cache, sorted(stop_ids), sampler, processors, matcher)


def joining_rows(model, uids: List[int], joining: List[Joining]) -> JoiningRows:
    """The batch rows of `joining` (uids in order), for DecodeBatch.extend."""
    return JoiningRows(
        model, uids,
        mx.array([int(j.request.first_token) for j in joining], dtype=mx.uint32),
        _merge([j.cache for j in joining]),
        # The KV's tokens; the batch appends first_token when it feeds it,
        # and penalties see the same context as in generate_step.
        [[int(t) for t in j.request.prompt_tokens] for j in joining],
        [j.sampler for j in joining], GREEDY_SAMPLER, [j.processors for j in joining],
        [StopSequences([[t] for t in j.stop_ids]) for j in joining],
        [j.request.budget for j in joining],
    )


def _merge(caches: List[list]) -> list:
    """Per-request caches -> per-layer batch caches (each layer's class merges,
    as mlx-lm's BatchGenerator does)."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]


def check_cache(cache: list, request: DecodeRequest) -> None:
    """What a handed-off cache must be to join: per layer, a kind the batch
    can merge, filled, one row, holding the tokens the handoff says."""
    if not cache:
        raise ValueError(f"request {request.request_id!r}: empty cache")
    for i, c in enumerate(cache):
        _check_layer(c, f"layer {i}", request.handoff.num_tokens)


def _check_layer(c, where: str, num_tokens: int) -> None:
    if isinstance(c, CacheList):
        for j, sub in enumerate(c.caches):
            _check_layer(sub, f"{where}.{j}", num_tokens)
        return
    if not hasattr(type(c), "merge"):  # what BatchGenerator batches with history
        raise TypeError(f"decode cannot batch {type(c).__name__} ({where})")
    if c.empty():
        raise ValueError(f"{where}: expected a filled batch-1 cache")
    batch = c.batch_size if isinstance(c, ArraysCache) else c.keys.shape[0]
    if batch != 1:
        raise ValueError(f"{where}: expected a filled batch-1 cache, got batch size {batch}")
    # Attention caches count the tokens they have seen (a window too); a
    # recurrent state does not.
    offset = getattr(c, "offset", None)
    if isinstance(offset, int) and offset != num_tokens:
        raise ValueError(f"{where} holds {offset} tokens, handoff says {num_tokens}")
