"""The KV bridge: a prompt's chunks through a converted program (contract.py)
instead of MLX's transformer body, their KV appended to the job's own mlx-lm
caches in the model's KV dtype, the head (last row only) in MLX.

So the prefix cache (a hit is loaded into those caches first and handed to
the program as its cache input), the handoff, the decode worker and the
vision path see ordinary MLX caches and need no change. The program runs
in fixed buckets (Q tokens over a cache of S): a chunk is padded to Q, the
cache to S; a prompt no bucket holds raises AneUnfit and the job goes on in
MLX from where it is.

A runner is anything callable as `runner(x, pos, k_cache, v_cache) ->
(k_new, v_new, h)` on NumPy arrays, per the contract: Core ML's predict on
macOS, Core AI's runtime, or the NumPy reference (tests, `--check`). A
runner whose program keeps the cache as its own state (`keeps_state`: the
stateful Core ML package) is handed the cache only when its state does not
hold it already: the next chunk of the same prompt in the same bucket gets
None, and neither side copies the whole cache again.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from workers.prefill.ane.contract import Bucket, bucket_for


class AneUnfit(Exception):
    """No bucket holds this chunk over this cache: the job goes on in MLX."""


def head(model, h: mx.array) -> mx.array:
    """The model's head over final-norm hidden states (llama family: a tied
    embedding or lm_head)."""
    args = getattr(model, "args", None)
    if getattr(args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def cache_input(cache: list, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every layer's keys and values before the chunk as (L, KV, size, Dh)
    float16, zero past what they hold."""
    first = cache[0]
    _, kv, _, dh = first.keys.shape if first.keys is not None else (1, 0, 0, 0)
    k = np.zeros((len(cache), kv, size, dh), np.float16)
    v = np.zeros_like(k)
    for i, c in enumerate(cache):
        if c.offset:
            k[i, :, :c.offset] = np.array(c.keys[0, :, :c.offset].astype(mx.float32))
            v[i, :, :c.offset] = np.array(c.values[0, :, :c.offset].astype(mx.float32))
    return k, v


def kv_dtype(model):
    """The dtype MLX's own prefill keeps this model's KV in (its norms' weights' dtype:
    never quantized)."""
    return model.model.norm.weight.dtype


class AneBody:
    """Chunks of a prompt through `runner_for(bucket)` over `buckets`."""

    def __init__(self, model, runner_for: Callable[[Bucket], Callable], buckets: list[Bucket], kv_heads: int,
                 head_dim: int):
        self.model = model
        self.runner_for = runner_for
        self.buckets = list(buckets)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype = kv_dtype(model)
        self.chunks = 0  # program calls, since start
        # (runner, the caches' tag, their offset): what a stateful runner's state holds now. A tag,
        # set on the caches' first layer, not id(): a new prompt's caches may reuse a freed address.
        self._holds = None
        self._tags = 0

    def fits(self, cached: int, tokens: int) -> bool:
        """Whether the whole of `tokens` after `cached` goes through buckets."""
        largest = max((b.cache for b in self.buckets), default=0)
        chunk = max((b.chunk for b in self.buckets), default=0)
        return chunk > 0 and cached + -(-tokens // chunk) * chunk <= largest

    def extend(self, tokens: mx.array, cache: list) -> mx.array:
        """Run `tokens` (1, n) after what `cache` holds; append their KV to
        `cache`; the last sub-chunk's final-norm hidden states (1, m, hidden)."""
        n, start, h = tokens.shape[1], 0, None
        while start < n:
            cached = cache[0].offset
            bucket = bucket_for(cached, 1, self.buckets)
            if bucket is None:
                raise AneUnfit(f"no bucket holds {cached} cached tokens plus a chunk")
            m = min(bucket.chunk, n - start)
            h = self._chunk(tokens[:, start:start + m], cache, bucket)
            start += m
        return h

    def _chunk(self, tokens: mx.array, cache: list, bucket: Bucket) -> mx.array:
        m, pos = tokens.shape[1], cache[0].offset
        emb = np.array(self.model.model.embed_tokens(tokens).astype(mx.float32))
        x = np.zeros((1, bucket.chunk, emb.shape[-1]), np.float16)
        x[:, :m] = emb
        runner = self.runner_for(bucket)
        keeps = getattr(runner, "keeps_state", False)
        tag = getattr(cache[0], "ane_tag", None)
        if keeps and tag is not None and self._holds == (runner, tag, pos):
            k_cache = v_cache = None  # its state holds exactly these caches
        elif cache[0].keys is None:
            k_cache = np.zeros((len(cache), self.kv_heads, bucket.cache, self.head_dim), np.float16)
            v_cache = np.zeros_like(k_cache)
        else:
            k_cache, v_cache = cache_input(cache, bucket.cache)
        self._holds = None
        k_new, v_new, h = runner(x, np.array([pos], np.int32), k_cache, v_cache)
        if keeps:
            if tag is None:
                self._tags += 1
                tag = cache[0].ane_tag = self._tags
            self._holds = (runner, tag, pos + m)
        for i, c in enumerate(cache):
            c.update_and_fetch(mx.array(k_new[i, :, :m])[None].astype(self.dtype),
                               mx.array(v_new[i, :, :m])[None].astype(self.dtype))
        self.chunks += 1
        return mx.array(h[:, :m]).astype(self.dtype)

    def last_logits(self, tokens: mx.array, cache: list) -> mx.array:
        """`tokens` (1, n) run as `extend` does; the logits (1, vocab) at the last."""
        h = self.extend(tokens, cache)
        return head(self.model, h[:, -1:, :])[:, 0, :]
