"""A speculative step of the decode batch: every row's drafts checked in one pass.

It lives in workers/kernels/ because it drives mlx-lm's GenerationBatch from
the inside (its `_next_tokens`, stop matchers and token contexts), as
workers/kernels/generation_batch.py does for an ordinary step; a row's token
budget it spends through that module's `DecodeBatch.spend`.

An ordinary step feeds each row its next input y (sampled by the step
before) and samples the token after it. A speculative step feeds each row
[y, d1 .. dk] (its drafts, workers/decode/speculation.py; rows without
drafts are padded with y and use only the first position), runs one
forward pass over the batch, and keeps for each row y, the drafts the
target agrees with and one more token from the target, which becomes the
row's next input (workers/decode/spec_verify.py). Each row's KV then drops
the positions it did not keep (`trim_rows` of the batch's cache layers:
workers/decode/ragged_kv.py on the CPU, workers/kernels/slot_batch_cache.py
on a GPU), so the batch's invariants hold as after ordinary steps: a row's
KV holds exactly `batch.tokens[i]`, and `_next_tokens` is its next input.
The two kinds of step therefore interleave freely.

Rows without drafts are sampled exactly as an ordinary step samples them
(their logits processors, grammar masks and samplers on the first
position). A row that stops or reaches max_tokens inside its kept run ends
there: the tokens after are dropped from its answer and its KV.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import List, Sequence

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from workers.decode.spec_verify import emitted, greedy_accepts, sampled_accepts
from workers.grammar import apply_masks
from workers.kernels.slot_batch_cache import SlotBatchKVCache, share_row_state
from workers.sampling import SeededSampler


@dataclass
class Verified:
    """What a speculative step gave: the batch's responses (several per row,
    in order) and, per row (the batch's order before finished rows left),
    its drafts and how many were kept."""

    responses: list
    drafted: List[int]
    accepted: List[int]


def _core():
    """`mx` as mlx-lm's generate module sees it (on the CPU, mlx_hooks' stand-in
    with the fast logsumexp): a speculative step normalises logits as a step does."""
    return sys.modules[GenerationBatch.__module__].mx


def can_trim(batch) -> bool:
    """Whether every cache layer of `batch` can drop positions row by row
    (plain attention KV; not windows or recurrent state)."""
    return bool(batch.prompt_cache) and all(hasattr(c, "trim_rows") for c in batch.prompt_cache)


def verify_step(batch, inputs: List[int], drafts: List[List[int]]) -> Verified:
    """One speculative step of `batch` (a workers.kernels.generation_batch.DecodeBatch
    whose `_next_tokens` are `inputs`, on the host): see the module doc."""
    n_rows = len(batch.uids)
    width = 1 + max(len(d) for d in drafts)
    fed = [[inputs[i]] + list(drafts[i]) + [inputs[i]] * (width - 1 - len(drafts[i])) for i in range(n_rows)]
    logits = batch.model(mx.array(fed, dtype=mx.uint32), cache=batch.prompt_cache)  # (B, width, vocab)
    logprobs = logits - _core().logsumexp(logits, axis=-1, keepdims=True)
    bonus = _plain_rows(batch, inputs, drafts, logits)
    greedy = [i for i in range(n_rows) if drafts[i] and not isinstance(batch.samplers[i], SeededSampler)]
    targets = mx.argmax(logprobs[mx.array(greedy)], axis=-1) if greedy else None
    mx.eval(bonus, targets if targets is not None else [])
    bonus = bonus.tolist()
    targets = dict(zip(greedy, targets.tolist())) if targets is not None else {}
    accepted = [0] * n_rows
    for i in range(n_rows):
        if not drafts[i]:
            continue
        if i in targets:
            accepted[i] = greedy_accepts(targets[i], drafts[i])
            bonus[i] = targets[i][accepted[i]]
        else:
            accepted[i], bonus[i] = sampled_accepts(batch.samplers[i], logprobs[i, : len(drafts[i]) + 1], drafts[i])
    responses = _respond(batch, inputs, drafts, accepted, logprobs, width)
    batch._current_tokens = mx.array(inputs, dtype=mx.uint32)
    batch._next_tokens = mx.array(bonus, dtype=mx.uint32)
    batch._next_logprobs = [logprobs[i, accepted[i]] for i in range(n_rows)]
    return Verified(_finish(batch, responses), [len(d) for d in drafts], accepted)


def _plain_rows(batch, inputs: List[int], drafts: List[List[int]], logits) -> mx.array:
    """The next input of each row as an ordinary step samples it, from the
    first position (used for the rows without drafts): grammar masks for
    the rows that follow one, their logits processors, their samplers."""
    first = logits[:, 0, :]
    constrained = batch.constrained
    if constrained and constrained.rows(batch.uids):
        bitmask = constrained.masks(batch.uids, inputs, first.shape[-1])
        if bitmask is not None:
            first = apply_masks(first, bitmask)
    if any(batch.logits_processors):
        rows = []
        ys = mx.array(inputs, dtype=mx.uint32)
        for e in range(len(batch.uids)):
            row = first[e : e + 1]
            processors = batch.logits_processors[e] or ()
            if processors and not drafts[e]:
                context = batch._token_context[e].update_and_fetch(ys[e : e + 1])
                for processor in processors:
                    row = processor(context, row)
            rows.append(row)
        first = mx.concatenate(rows, axis=0)
    logprobs = first - _core().logsumexp(first, axis=-1, keepdims=True)
    samplers = [batch.fallback_sampler if s is None else s for s in batch.samplers]
    plain = [i for i in range(len(batch.uids)) if not drafts[i]]
    if not plain:
        return mx.zeros((len(batch.uids),), mx.uint32)
    if all(s is samplers[0] for s in samplers) and (len(plain) == len(samplers)
                                                    or not isinstance(samplers[0], SeededSampler)):
        return samplers[0](logprobs).astype(mx.uint32)
    # Only the rows without drafts draw here: a sampled row with drafts
    # draws in its rejection step, and its stream must not move twice.
    return mx.concatenate([samplers[i](logprobs[i : i + 1]) if not drafts[i] else mx.zeros((1,), mx.uint32)
                           for i in range(len(batch.uids))]).astype(mx.uint32)


def _respond(batch, inputs, drafts, accepted, logprobs, width) -> list:
    """Per row: its kept tokens as responses, up to a stop or max_tokens;
    the KV trimmed to them; the batch's token lists extended."""
    responses, trims = [], []
    for i in range(len(batch.uids)):
        tokens = emitted(inputs[i], drafts[i], accepted[i])
        finish, kept = None, 0
        for tok in tokens:
            kept += 1
            if batch.spend(i).exhausted:
                finish = "length"
            if batch._matchers[i].advance(tok):
                finish = "stop"
            if finish is not None:
                break
        tokens = tokens[:kept]
        batch.tokens[i].extend(tokens)
        trims.append(width - kept)
        lps = [batch._next_logprobs[i]] + [logprobs[i, j] for j in range(kept - 1)]
        responses.append((i, tokens, lps, finish))
    trim_batch(batch.prompt_cache, trims)
    return responses


def trim_batch(caches: list, counts: List[int]) -> None:
    """Every layer's trim_rows(counts); a padded batch's moved rows are
    copied for all layers with one wait."""
    moving = {id(c): c.rows_to_move(counts) for c in caches if isinstance(c, SlotBatchKVCache)}
    if any(moving.values()):
        mx.eval([a for rows in moving.values() for a in rows])
    for c in caches:
        if id(c) in moving:
            c.trim_rows(counts, moving[id(c)])
        else:
            c.trim_rows(counts)
    share_row_state(caches)


def _finish(batch, rows: Sequence[tuple]) -> list:
    """The step's responses (GenerationBatch.Response, several per row);
    finished rows leave the batch."""
    out, keep = [], []
    for i, tokens, lps, finish in rows:
        for j, (tok, lp) in enumerate(zip(tokens, lps)):
            last = j == len(tokens) - 1
            done = finish if last else None
            out.append(batch.Response(
                uid=batch.uids[i], token=tok, logprobs=lp, finish_reason=done,
                prompt_cache=batch.extract_cache(i) if done else None,
                all_tokens=batch.tokens[i] if done else None))
        if finish is None:
            keep.append(i)
    if len(keep) < len(batch.uids):
        batch.filter(keep)
    return out
