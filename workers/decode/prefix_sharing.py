"""Rows of a ragged decode batch that share one copy of a common prompt prefix.

A swarm's agents resend one system prompt; their rows in a decode batch
(workers/decode/ragged_kv.py) then hold its KV once and attention reads it
once per step for all of them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from workers.decode.ragged_kv import RaggedKVCache, RowKVCache
from workers.decode.ragged_rows import SharedKV


class _Member:
    __slots__ = ("group", "request_id", "rows", "tokens")

    def __init__(self, request_id, tokens, rows):
        self.request_id, self.tokens, self.rows, self.group = request_id, tokens, rows, None


class _Group:
    __slots__ = ("layers", "members", "tokens")

    def __init__(self, tokens, layers):
        self.tokens, self.layers, self.members = tokens, layers, set()


class PrefixSharing:
    """Finds rows of a decode batch whose prompts begin with the same tokens
    (agents of a swarm resending one system prompt) and makes them share one
    copy of that prefix's KV: attention reads it once per step for all of
    them (workers/decode/ragged_attention.py) and memory holds it once.

    Equal tokens at equal positions give equal KV, so tokens decide; callers
    pass only requests whose KV is a function of their tokens (no images, no
    rope shift). A prefix is shared from `min_tokens` on; each row shares at
    most one prefix (the longest found when it joins)."""

    def __init__(self, min_tokens: int = 256):
        self.min_tokens = min_tokens
        self._members: dict = {}  # request id -> _Member
        self.groups_formed = 0  # a counter, for the worker's stats

    @property
    def saved_tokens(self) -> int:
        """Prefix tokens of KV the batch does not hold twice right now."""
        groups = {id(m.group): m.group for m in self._members.values() if m.group is not None}
        return sum(len(g.tokens) * (len(g.members) - 1) for g in groups.values())

    def admit(self, request_id: str, tokens, cache: list) -> int:
        """Register a joining request (its cache from rows_of); share a prefix
        with a live one if it can. Returns the tokens shared (0 if none)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        rows = [c.row for c in cache if isinstance(c, RowKVCache)]
        if not rows or len(tokens) < self.min_tokens:
            return 0
        best_group, best_member, best_len = None, None, self.min_tokens - 1
        for m in self._members.values():
            if m.group is not None and len(m.group.tokens) > best_len and _starts_with(tokens, m.group.tokens):
                best_group, best_member, best_len = m.group, None, len(m.group.tokens)
        for m in self._members.values():
            if m.group is None and len(m.rows) == len(rows):
                n = _common_prefix(tokens, m.tokens)
                if n > best_len:
                    best_group, best_member, best_len = None, m, n
        if best_member is not None:  # the first two rows of a new group
            best_group = _Group(tokens[:best_len], [
                SharedKV(*(mx.contiguous(a[..., :best_len, :]) for a in r.view()))
                for r in best_member.rows])
            self._join(best_member, best_group)
            self.groups_formed += 1
        member = _Member(request_id, tokens, rows)
        self._members[request_id] = member
        if best_group is None:
            return 0
        self._join(member, best_group)
        return len(best_group.tokens)

    def leave(self, request_id: str) -> None:
        member = self._members.pop(request_id, None)
        if member is not None and member.group is not None:
            member.group.members.discard(request_id)

    def _join(self, member: _Member, group: _Group) -> None:
        for row, layer in zip(member.rows, group.layers):
            row.share(layer, RaggedKVCache.step)
        group.members.add(member.request_id)
        member.group = group


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _starts_with(tokens, prefix) -> bool:
    return len(tokens) >= len(prefix) and bool(np.array_equal(tokens[: len(prefix)], prefix))
