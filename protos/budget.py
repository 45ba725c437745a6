"""A request's token budget: how many tokens its answer may hold, how many
it holds. The one length check (`exhausted`) lives here, as nano-vllm's
scheduler keeps it in one place; prefill, decode, the speculative step and
the router ask a budget instead of counting with +1 / -1 of their own.

The messages carry its two numbers (`SamplingParams.max_tokens` and
`generated`, protos/worker_messages.py) and hand it out as `.budget`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenBudget:
    """`allowed`: the answer's most tokens (the client's max_tokens as the
    router resolved it); `produced`: the answer's tokens so far: a resumed
    request's answer before prefill samples its next token, and every token
    since, the first one from prefill included."""

    allowed: int
    produced: int = 0

    def __post_init__(self):
        if self.allowed < 0 or self.produced < 0:
            raise ValueError(f"a token budget counts from 0: allowed {self.allowed}, produced {self.produced}")

    @property
    def left(self) -> int:
        """Tokens the answer may still take."""
        return max(self.allowed - self.produced, 0)

    @property
    def exhausted(self) -> bool:
        """The answer is as long as allowed: it ends with "length"."""
        return self.produced >= self.allowed

    def after(self, tokens: int = 1) -> TokenBudget:
        """The budget once `tokens` more are produced (after(1): once prefill's
        first token is, which decode's budget starts from)."""
        return TokenBudget(self.allowed, self.produced + tokens)

    def fit_draft(self, k: int) -> int:
        """How many of `k` drafted tokens a speculative step may check: the
        step returns its next token (sampled the step before) first, then
        the drafts it keeps, all within what is left."""
        return max(min(k, self.left - 1), 0)
