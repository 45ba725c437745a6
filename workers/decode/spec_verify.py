"""Which drafted tokens a row keeps, given the target model's logits over them.

A speculative step feeds a row [y, d1 .. dk] (y: its next input, d: drafts)
and gets the target's log-probabilities at each of those k + 1 positions:
position j's distribution is the one the target would sample token j + 1
from. The row keeps the longest run of drafts the target agrees with and
one token more from the target itself (the "bonus": the correction at the
first disagreement, or the token after the last draft), so a step always
gains at least one token.

Greedy rows (temperature 0) keep d_j while it is the argmax at position
j - 1: token for token what decoding without drafts gives.

Sampled rows use speculative sampling's rejection rule for a proposal that
is one token, not a distribution (prompt lookup, and a draft model decoding
greedily): d_j is kept with probability p_{j-1}(d_j); at the first
rejection the bonus is drawn from p_{j-1} without d_j (renormalised), and
after k acceptances from p_k. Each emitted token is then distributed
exactly as the target's p (Leviathan et al. 2023, with q a point mass: the
residual max(p - q, 0) is p with d's mass removed). `p` is the row's
sampler's own distribution (its temperature and top-p / min-p / top-k:
workers/sampling.py `SeededSampler.distribution`), and the draws come from
the row's own random stream.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import mlx.core as mx


def greedy_accepts(targets: Sequence[int], drafts: Sequence[int]) -> int:
    """Drafts kept: how many of `drafts` equal the target's argmax at the
    position before them (`targets[j]` is the argmax at position j)."""
    n = 0
    while n < len(drafts) and int(targets[n]) == int(drafts[n]):
        n += 1
    return n


def sampled_accepts(sampler, logprobs: mx.array, drafts: Sequence[int]) -> Tuple[int, int]:
    """(drafts kept, the bonus token) for a sampled row. `logprobs`:
    (k + 1, vocab), the target's at the row's positions; `sampler`: a
    workers.sampling.SeededSampler (its distribution and random stream)."""
    k = len(drafts)
    logits = sampler.distribution(logprobs)  # (k + 1, vocab), unnormalised log-probabilities
    probs = mx.softmax(logits, axis=-1)
    if k:
        chosen = mx.take_along_axis(probs[:k], mx.array([[int(d)] for d in drafts]), axis=-1)[:, 0]
        u = sampler.uniform(k)
        keep = (u < chosen).tolist()
    else:
        keep = []
    n = 0
    while n < k and keep[n]:
        n += 1
    row = logits[n]
    if n < k:  # the residual: p without the rejected draft
        row = mx.where(mx.arange(row.shape[-1]) == int(drafts[n]), mx.array(-mx.inf, row.dtype), row)
    return n, int(sampler.draw(row[None]).item())


def emitted(y: int, drafts: Sequence[int], accepted: int) -> List[int]:
    """The tokens a row's KV now holds from this step: its input and the drafts kept."""
    return [int(y)] + [int(d) for d in drafts[:accepted]]
