"""Prefix-cache helpers the worker-side tests share: a PrefixCache over a
(fake or real) cache service, a request run through prefill and decode with
it, and KV caches filled the way a model fills them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from protos.messages import DecodeRequest, KVHandoff
from workers.decode.engine import DecodeEngine
from workers.kv.prefix_cache import PrefixCache, make_prefix_cache
from workers.prefill.engine import PrefillEngine

BS = 8  # small blocks: short prompts span several


def prefix_for(model, model_dir, client, block_size=BS) -> PrefixCache:
    prefix = make_prefix_cache(model, str(model_dir), block_size, client, client.buffer)
    assert prefix is not None
    return prefix


def run_request(model, prefix, prompt, sp, rid="r", chunk=16):
    """Prefill (reusing/storing blocks) then decode to the end with the same
    prefix cache. Returns (all tokens, prefill result)."""
    res = PrefillEngine(model, chunk_size=chunk, prefix=prefix).run(prompt, sp, owner=rid)
    decode = DecodeEngine(model, max_batch=4, prefix=prefix)
    decode.add(DecodeRequest(rid, prompt, res.first_token, KVHandoff(rid, res.num_tokens, res.rope_offset), sp),
               res.cache)
    tokens = [res.first_token]
    while decode.has_work:
        tokens += [u.token for u in decode.step()]
        decode.commit_finished()
    return tokens, res


def filled_kv(dtype, tokens, seed, layers=3, heads=2, dk=16, dv=8):
    """Per-layer KVCaches of `tokens` random rows, grown in two updates (a
    strided live part, as a model leaves it)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        c = KVCache()
        for n in (tokens - 5, 5):  # grown through update_and_fetch: strided live part
            k = mx.array(rng.standard_normal((1, heads, n, dk)).astype(np.float32)).astype(dtype)
            v = mx.array(rng.standard_normal((1, heads, n, dv)).astype(np.float32)).astype(dtype)
            c.update_and_fetch(k, v)
        out.append(c)
    return out
