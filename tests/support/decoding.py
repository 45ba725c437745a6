"""Decode as a decode worker does, for tests that check a prefill's cache."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step


def decode_greedy(text_model, cache: list, first_token: int, max_tokens: int) -> list[int]:
    """Greedy tokens after `first_token` with mlx-lm's generate_step over
    `cache` (already shifted with workers/decode/shifted_rope.py's shift_rope
    where needed): what a decode worker computes for one request."""
    tokens = []
    for token, _ in generate_step(mx.array([int(first_token)]), text_model, max_tokens=max_tokens,
                                  prompt_cache=cache):
        tokens.append(int(token))
    return tokens
