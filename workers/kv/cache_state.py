"""Any mlx-lm cache as data: per-layer class and state, and snapshots.

Plain attention KV goes between processes as [keys, values] per layer
(handoff.py); every other cache kind (sliding window, recurrent, mixes) as
its class name and `.state`, rebuilt with `from_state`. Snapshots
(snapshot.py) are that same state packed into one self-describing byte
range for the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache,
                                 RotatingKVCache)

from workers.kernels.mlx_cache import write_index
from workers.kv.arena_io import MX_DTYPE_NAMES, arrays_nbytes


def check_plain_kv(cache: Sequence) -> None:
    for i, c in enumerate(cache):
        # Exact type: subclasses (e.g. quantized variants) lay out state differently.
        if type(c) is not KVCache:
            raise TypeError(
                f"KV transfer supports only mlx_lm KVCache layers; layer {i} is "
                f"{type(c).__name__} (write_cache / read_cache take any mlx-lm cache)"
            )
        if c.keys is not None and c.keys.shape[0] != 1:
            raise ValueError(f"layer {i}: expected batch size 1, got {c.keys.shape[0]}")


def _layer_arrays(c: KVCache):
    """The live part of one layer: keys/values of the first `offset` tokens (views)."""
    if c.keys is None or c.offset == 0:
        raise ValueError("cannot transfer an empty KV cache")
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


# --------------------------------------------------------------------------- #
# Any mlx-lm cache: per layer its class name and `state` (sliding window,
# recurrent, mixes of them)
# --------------------------------------------------------------------------- #
#
# mlx-lm (0.32) keeps a cache's whole state in `.state` (arrays plus the ints
# that say how to read them: offset, keep, max_size, _idx, ...; there is no
# separate meta_state in this version) and rebuilds one with
# `cls.from_state(state)`; save_prompt_cache / load_prompt_cache rely on
# exactly that. We do the same with arena slices instead of a file: a layer's
# spec is {"cls": name, "state": tree} whose array leaves are {"a": i} (the
# layer's i-th slice) and whose other leaves are the ints, None, ... as they
# are; a CacheList is {"cls": "CacheList", "caches": [spec, ...]}. Tuples come
# back as lists, which every from_state accepts.

# Rebuilt by name: only these classes, never a name taken from the wire as is.
_STATE_CLASSES = {cls.__name__: cls for cls in (
    KVCache, RotatingKVCache, ArraysCache, CacheList, QuantizedKVCache, ChunkedKVCache)}


@dataclass
class EncodedCache:
    """A cache list as data: per-layer specs and arrays (lazy views of the
    live state, not copies)."""

    meta: list  # per-layer specs; [] when every layer is a plain KVCache ([keys, values])
    arrays: list  # per layer [mx.array, ...], in the order the spec's {"a": i} leaves name them

    @property
    def nbytes(self) -> int:
        """Bytes `arena_io.write_arrays` needs, alignment padding included."""
        return arrays_nbytes(self.arrays)


def is_plain_kv(cache: Sequence) -> bool:
    return bool(cache) and all(type(c) is KVCache for c in cache)


def encode_cache(cache: Sequence, with_meta: bool = False) -> EncodedCache:
    """Describe `cache` for transfer. A list of plain KVCaches keeps the
    KVHandoff format of old ([keys, values] per layer, no meta) unless
    `with_meta` (snapshots always carry their meta). TypeError for a cache
    class this file does not know (a model's own class: its state may hold
    anything)."""
    if not cache:
        raise ValueError("cannot transfer an empty cache list")
    if is_plain_kv(cache) and not with_meta:
        check_plain_kv(cache)
        return EncodedCache([], [list(_layer_arrays(c)) for c in cache])
    meta, arrays = [], []
    for i, c in enumerate(cache):
        layer: list = []
        meta.append(_encode_layer(c, layer, f"layer {i}"))
        arrays.append(layer)
    return EncodedCache(meta, arrays)


def _encode_layer(c, arrays: list, where: str) -> dict:
    cls = _STATE_CLASSES.get(type(c).__name__)
    if cls is not type(c):  # exact class: a subclass may keep state elsewhere
        raise TypeError(f"{where} is {type(c).__name__}, not an mlx_lm cache class that "
                        f"state transfer knows ({', '.join(_STATE_CLASSES)})")
    if cls is CacheList:
        return {"cls": "CacheList",
                "caches": [_encode_layer(sub, arrays, f"{where}.{j}") for j, sub in enumerate(c.caches)]}
    return {"cls": cls.__name__, "state": _tree(_live_state(c), arrays, where)}


def _live_state(c) -> list:
    """`c.state`, minus a KV buffer's unused capacity (rows past `offset`,
    grown 256 at a time). A RotatingKVCache has such rows only before its
    window first fills, when `_idx == offset`: cutting there is what its
    own keys_and_values() does, and it grows again on the next update."""
    state = list(c.state)
    if type(c) in (KVCache, RotatingKVCache) and c.keys is not None and c.offset < c.keys.shape[2]:
        if type(c) is KVCache or write_index(c) == c.offset:
            state[0] = c.keys[..., : c.offset, :]
            state[1] = c.values[..., : c.offset, :]
    return state


def _tree(x, arrays: list, where: str):
    if isinstance(x, mx.array):
        arrays.append(x)
        return {"a": len(arrays) - 1}
    if isinstance(x, (list, tuple)):
        return [_tree(v, arrays, where) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"{where}: its state holds a {type(x).__name__}, which cannot be transferred")


def _untree(x, arrays: list):
    if isinstance(x, dict):
        i = x.get("a")
        if set(x) != {"a"} or not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(arrays):
            raise ValueError(f"bad array reference {x!r} in cache state")
        return arrays[i]
    if isinstance(x, list):
        return [_untree(v, arrays) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise ValueError(f"bad leaf {type(x).__name__} in cache state")


def decode_layer(spec, arrays: list):
    name = spec.get("cls") if isinstance(spec, dict) else None
    cls = _STATE_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown cache class in {spec!r:.80}")
    if cls is CacheList:
        subs = spec.get("caches")
        if not isinstance(subs, list):
            raise ValueError("CacheList spec without caches")
        return CacheList(*[decode_layer(sub, arrays) for sub in subs])
    try:
        return cls.from_state(_untree(spec.get("state"), arrays))
    except (TypeError, ValueError) as exc:  # e.g. the wrong number of fields for the class
        raise ValueError(f"cannot rebuild {name} from its state: {exc}") from None


def cache_nbytes(cache: Sequence) -> int:
    """Bytes `write_cache` needs for this cache (any kind)."""
    return encode_cache(cache).nbytes


def cache_dtype_name(cache: Sequence) -> str:
    """The dtype of a cache's first floating-point array (KVHandoff.kv_dtype)."""
    for layer in encode_cache(cache).arrays:
        for a in layer:
            name = MX_DTYPE_NAMES.get(a.dtype)
            if name is not None:
                return name
    return ""
