"""Draft-model drafting: a small model of the same tokenizer guesses the next tokens.

The drafter of workers/decode/speculation.py for `--speculative draft`. Each
row has the draft model's own KV (an mlx-lm cache per row, kept here beside
the batch) and the tokens that KV holds (`fed`). To draft k tokens for a row
whose text is `batch.tokens[i]` + its next input y, the drafter cuts its KV
back to the longest prefix it shares with that text (it may hold drafts the
target rejected), feeds the rest (at a row's first draft: the whole prompt,
in chunks; afterwards the one to k + 1 tokens the last step kept), and then
decodes k tokens greedily, each fed back but the last. A draft that is
always the argmax is a point-mass proposal, which is what the rejection rule
of workers/decode/spec_verify.py takes for sampled rows too.

Rows draft one after another (the draft model runs batch 1): speculation
runs only while the batch is small (Speculation.max_rows), and the draft
model is small. Its caches must be trimmable (plain attention KV).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

# Tokens of a row's prompt fed to the draft model in one pass.
PREFILL_CHUNK = 512


class DraftModel:
    """Drafts from `model` (an mlx-lm model sharing the target's tokenizer)."""

    method = "draft"

    def __init__(self, model, vocab_limit: int | None = None):
        self.model = model
        self.vocab_limit = vocab_limit  # the target's logits width: draft ids past it are never proposed
        # Only plain attention KV can always be cut back (a sliding window
        # can, until it wraps: RotatingKVCache says it is trimmable when empty).
        kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})
        if kinds:
            raise ValueError(f"the draft model's cache cannot be cut back ({', '.join(kinds)}): "
                             "a draft model needs plain attention layers")
        # uid -> (its KV, the tokens it holds, how many of them are the row's text for sure)
        self.rows: Dict[int, Tuple[list, List[int], int]] = {}

    def propose(self, batch, asking, inputs: Sequence[int]) -> List[List[int]]:
        """Drafts for the rows `asking` ((row index, uid, k) each) of `batch`,
        whose next inputs are `inputs`."""
        pending = []
        for i, uid, k in asking:
            cache, fed, shared = self.rows.get(uid) or (make_prompt_cache(self.model), [], 0)
            text = batch.tokens[i] + [int(inputs[i])]
            keep = _common_prefix(fed, text, shared)
            if keep == len(text):  # never: the input is new; keep one to feed
                keep -= 1
            if len(fed) > keep:
                trim_prompt_cache(cache, len(fed) - keep)
            drafts = self._decode(cache, text[keep:], k)
            pending.append((uid, cache, text, drafts))
        mx.eval([d for *_, drafts in pending for d in drafts])
        out = []
        for uid, cache, text, drafts in pending:
            tokens = [int(d.item()) for d in drafts]
            if self.vocab_limit is not None:
                cut = next((j for j, t in enumerate(tokens) if t >= self.vocab_limit), len(tokens))
                tokens = tokens[:cut]
            # `text` stays the row's text (it only grows): the next look
            # compares from its end, not the whole prompt again.
            self.rows[uid] = (cache, text + tokens[:-1] if tokens else text, len(text))
            out.append(tokens)
        return out

    def _decode(self, cache: list, new: List[int], k: int) -> List[mx.array]:
        """Feed `new` (the prompt's last chunk's logits kept), then k greedy
        tokens, each fed but the last; lazy arrays, evaluated by the caller."""
        for start in range(0, len(new) - PREFILL_CHUNK, PREFILL_CHUNK):
            self.model(mx.array([new[start : start + PREFILL_CHUNK]]), cache=cache)
            mx.eval([c.state for c in cache])
        rest = new[(max(len(new) - 1, 0) // PREFILL_CHUNK) * PREFILL_CHUNK:]
        logits = self.model(mx.array([rest]), cache=cache)[:, -1, :]
        drafts = [mx.argmax(logits, axis=-1)]
        for _ in range(k - 1):
            logits = self.model(drafts[-1][None], cache=cache)[:, -1, :]
            drafts.append(mx.argmax(logits, axis=-1))
        return drafts

    def leave(self, uid: int) -> None:
        self.rows.pop(uid, None)


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of a and b's common prefix, known to be at least `start`."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
