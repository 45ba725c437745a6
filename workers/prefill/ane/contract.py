"""The one contract every converted prefill program keeps (Core ML, Core AI,
the NumPy reference): one chunk of at most Q tokens over a cache of S slots.

Inputs
- `x`: (1, Q, hidden) float16: the chunk's input embeddings (looked up in MLX;
  rows past the chunk's real length are padding, any value).
- `pos`: (1,) int32: how many tokens the cache holds before the chunk, i.e.
  the absolute position of the chunk's first token; 0 <= pos <= S.
- `k_cache`, `v_cache`: (L, KV, S, Dh) float16: every layer's keys (after
  rope and any k-norm) and values of the tokens before the chunk, slots
  [0, pos) valid, the rest any finite value (a masked NaN still poisons a
  softmax's 0 x NaN: the bridge zero-fills them).

Outputs
- `k_new`, `v_new`: (L, KV, Q, Dh) float16: the chunk's keys (after rope,
  after k-norm) and values, every layer; padded rows any value.
- `h`: (1, Q, hidden) float16: the last layer's hidden states after the final
  norm; the head (in MLX) takes row n-1 for the next token.

Attention: chunk row i (absolute position pos + i) sees cache slots j < pos
and chunk rows <= i; nothing else. Rope at absolute positions, by the model's
own tables (weights.py: `rope_cos`/`rope_sin`, as MLX computes them).

Buckets: a program is built for fixed (Q, S); a prompt's chunks are padded
to Q and its cache to the smallest S that holds it (`bucket_for`).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CHUNK = 64  # Q: the Neural Engine wants fixed, small query lengths (Anemll: 64)
DEFAULT_CACHES = (512, 1024, 2048, 4096)  # S: doubling cache lengths (Core AI's recipe)


@dataclass(frozen=True)
class Bucket:
    chunk: int  # Q
    cache: int  # S

    @property
    def name(self) -> str:
        return f"q{self.chunk}_s{self.cache}"


def buckets(chunk: int = DEFAULT_CHUNK, caches: tuple = DEFAULT_CACHES) -> list[Bucket]:
    return [Bucket(chunk, s) for s in sorted(caches)]


def bucket_for(cached: int, chunk_tokens: int, available: list[Bucket]) -> Bucket | None:
    """The smallest bucket whose chunk holds `chunk_tokens` and whose cache holds
    the `cached` tokens before it plus a whole padded chunk (a stateful program
    writes all Q rows at pos); None when none does."""
    for b in sorted(available, key=lambda b: (b.cache, b.chunk)):
        if chunk_tokens <= b.chunk and cached + b.chunk <= b.cache:
            return b
    return None
