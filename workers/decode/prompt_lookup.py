"""Prompt-lookup drafting: a row's next tokens guessed from its own text.

An agent that edits a file, fills JSON from a document or repeats a tool's
arguments writes long runs of tokens that already appear in its prompt (or
earlier in its answer). When the row's last few tokens occurred before, the
tokens that followed them then are a good guess for what follows now; the
target model checks the guess in one batched forward pass
(workers/decode/speculation.py) and keeps what it agrees with. No second
model, no device work: a dictionary lookup per row per step.

`NgramIndex` keeps, for each n-gram of n_min..n_max tokens, where it last
ended; it is updated as tokens are appended, so a lookup never scans the
text. The longest n-gram that matches wins (a longer match is a better
guess); ties go to the latest occurrence (the text nearest the answer).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple


class NgramIndex:
    """One row's tokens and, per n-gram, the position after its latest
    occurrence that is not the row's current suffix."""

    __slots__ = ("n_max", "n_min", "tokens", "_after")

    def __init__(self, tokens: Sequence[int] = (), n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: List[int] = []
        self._after: Dict[Tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens (accepted ones: the row's text grows)."""
        for t in tokens:
            # The n-grams that end just before this token now have a
            # continuation: this token's position.
            p = len(self.tokens)
            for n in range(self.n_min, min(self.n_max, p) + 1):
                self._after[tuple(self.tokens[p - n : p])] = p
            self.tokens.append(int(t))

    def propose(self, k: int, tail: Sequence[int] = ()) -> List[int]:
        """Up to k tokens that followed the latest earlier occurrence of the
        longest matching suffix of tokens + tail (tail: tokens known but not
        yet appended, e.g. the next input). [] when nothing matches."""
        if k <= 0:
            return []
        text = self.tokens
        tail = [int(t) for t in tail]
        whole = len(text) + len(tail)
        recent = text[max(len(text) - self.n_max, 0):] + tail  # the suffixes' tokens, nothing more
        for n in range(min(self.n_max, len(recent)), self.n_min - 1, -1):
            start = self._after.get(tuple(recent[len(recent) - n :]))
            if start is None:
                continue
            # The continuation may run into the tail (and on: text that
            # repeats itself is proposed again).
            out: List[int] = []
            pos = start
            while len(out) < k and pos < whole:
                out.append(text[pos] if pos < len(text) else tail[pos - len(text)])
                pos += 1
            if out:
                return out
        return []


class PromptLookup:
    """The prompt-lookup drafter of workers/decode/speculation.py: an
    NgramIndex per row, following the row's tokens (`batch.tokens[i]`,
    the tokens its KV holds) as they grow."""

    method = "prompt-lookup"

    def __init__(self, n_min: int = 2, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max
        self.rows: Dict[int, NgramIndex] = {}

    def propose(self, batch, asking, inputs: Sequence[int]) -> List[List[int]]:
        """Drafts for the rows `asking` ((row index, uid, k) each) of `batch`,
        whose next inputs are `inputs`."""
        out = []
        for i, uid, k in asking:
            index = self.rows.get(uid)
            if index is None:
                index = self.rows[uid] = NgramIndex((), self.n_min, self.n_max)
            tokens = batch.tokens[i]
            index.extend(tokens[len(index.tokens):])
            out.append(index.propose(k, tail=(inputs[i],)))
        return out

    def leave(self, uid: int) -> None:
        self.rows.pop(uid, None)
