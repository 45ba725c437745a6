"""What the decode engine checks of a handed-off cache before a request joins
the batch (workers/decode/engine.py `DecodeEngine.add`): per layer, a kind
the batch can merge, filled, one row, holding the tokens the handoff says."""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache, CacheList

from protos.messages import DecodeRequest


def check_cache(cache: list, request: DecodeRequest) -> None:
    if not cache:
        raise ValueError(f"request {request.request_id!r}: empty cache")
    for i, c in enumerate(cache):
        _check_layer(c, f"layer {i}", request.handoff.num_tokens)


def _check_layer(c, where: str, num_tokens: int) -> None:
    if isinstance(c, CacheList):
        for j, sub in enumerate(c.caches):
            _check_layer(sub, f"{where}.{j}", num_tokens)
        return
    if not hasattr(type(c), "merge"):  # what BatchGenerator batches with history
        raise TypeError(f"decode cannot batch {type(c).__name__} ({where})")
    if c.empty():
        raise ValueError(f"{where}: expected a filled batch-1 cache")
    batch = c.batch_size if isinstance(c, ArraysCache) else c.keys.shape[0]
    if batch != 1:
        raise ValueError(f"{where}: expected a filled batch-1 cache, got batch size {batch}")
    # Attention caches count the tokens they have seen (a window too); a
    # recurrent state does not.
    offset = getattr(c, "offset", None)
    if isinstance(offset, int) and offset != num_tokens:
        raise ValueError(f"{where} holds {offset} tokens, handoff says {num_tokens}")
