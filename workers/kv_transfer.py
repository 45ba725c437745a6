"""Copy a prompt's KV cache into a shared buffer and rebuild it on the other side.

The buffer is anything writable that exposes the buffer protocol: the cache
service arena's `.buf` memoryview, a `multiprocessing.shared_memory` segment's
`.buf`, or a plain bytearray in tests. Only (offset, nbytes, dtype, shape)
handles travel between processes (protos.messages.ArenaSlice).

Layout: per layer, keys then values, each the first `offset` tokens of the
cache as one C-contiguous array of shape (1, kv_heads, tokens, head_dim),
every slice starting on an ALIGN-byte boundary. Copies: one from MLX memory
into the buffer on write, one from the buffer into MLX memory on read (MLX
cannot wrap foreign memory); no intermediate copies.

bfloat16 has no numpy dtype: its raw 16-bit patterns are stored as uint16 and
the slice's dtype says "bfloat16", so the reader views them back as bfloat16.
Note that np.dtype("bfloat16") fails: readers must use `storage_dtype`.

Only plain attention KV (mlx_lm KVCache) is supported; rotating, quantized and
recurrent caches raise TypeError naming the type.
"""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from protos.messages import ArenaSlice

ALIGN = 64  # cache-line alignment for every slice's start

# MLX dtype -> (name written in ArenaSlice.dtype, numpy storage dtype)
_MX_TO_NAME = {
    mx.float32: "float32",
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
}
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype the bytes of a slice named `name` are stored as."""
    try:
        return np.dtype(_STORAGE[name])
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}") from None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _check_supported(cache: Sequence) -> None:
    for i, c in enumerate(cache):
        # Exact type: subclasses (e.g. quantized variants) lay out state differently.
        if type(c) is not KVCache:
            raise TypeError(
                f"KV transfer supports only mlx_lm KVCache layers; layer {i} is "
                f"{type(c).__name__} (rotating/quantized/recurrent caches are not "
                "supported yet)"
            )
        if c.keys is not None and c.keys.shape[0] != 1:
            raise ValueError(f"layer {i}: expected batch size 1, got {c.keys.shape[0]}")


def _layer_arrays(c: KVCache):
    """The live part of one layer: keys/values of the first `offset` tokens (views)."""
    if c.keys is None or c.offset == 0:
        raise ValueError("cannot transfer an empty KV cache")
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


def kv_dtype_name(cache: Sequence) -> str:
    """The dtype name of a cache's KV (KVHandoff.kv_dtype)."""
    _check_supported(cache)
    return _MX_TO_NAME[cache[0].keys.dtype]


def kv_nbytes(cache: Sequence) -> int:
    """Bytes `write_kv` needs for this cache, alignment padding included."""
    _check_supported(cache)
    total = 0
    for c in cache:
        for a in _layer_arrays(c):
            total += _align(a.nbytes)
    return total


def _as_numpy(a: mx.array) -> np.ndarray:
    """Zero-copy numpy view of an evaluated MLX array (strided views allowed)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def write_kv(buf, base_offset: int, cache: Sequence) -> List[List[ArenaSlice]]:
    """Copy `cache` into `buf` starting at `base_offset` (must be ALIGN-aligned
    for aligned slices; any offset works). Returns per layer
    [keys ArenaSlice, values ArenaSlice] with offsets absolute in `buf`.

    `buf` must hold base_offset + kv_nbytes(cache) bytes.
    """
    _check_supported(cache)
    arrays = [_layer_arrays(c) for c in cache]
    mx.eval(arrays)
    need = kv_nbytes(cache)
    mv = memoryview(buf).cast("B")
    layers: List[List[ArenaSlice]] = []
    try:
        if base_offset < 0 or base_offset + need > mv.nbytes:
            raise ValueError(
                f"buffer too small: need {need} bytes at offset {base_offset}, "
                f"buffer holds {mv.nbytes}"
            )
        _write_layers(mv, arrays, base_offset, layers)
    finally:
        _release(mv)
    return layers


def _release(mv: memoryview) -> None:
    """Drop our export of the buffer so shm.close() works after we return."""
    try:
        mv.release()
    except BufferError:  # a traceback still holds a numpy view; GC will free it
        pass


def _write_layers(mv, arrays, offset, layers) -> None:
    for keys, values in arrays:
        pair = []
        for a in (keys, values):
            name = _MX_TO_NAME.get(a.dtype)
            if name is None:
                raise ValueError(f"unsupported KV dtype {a.dtype}")
            src = _as_numpy(a)
            dst = np.frombuffer(mv, dtype=src.dtype, count=src.size, offset=offset)
            # The one copy: strided MLX memory -> contiguous slice of the buffer.
            dst.reshape(src.shape)[...] = src
            pair.append(ArenaSlice(offset=offset, nbytes=a.nbytes, dtype=name,
                                   shape=list(a.shape)))
            offset += _align(a.nbytes)
            del dst
        layers.append(pair)


def _read_slice(mv: memoryview, s) -> mx.array:
    if isinstance(s, dict):  # tolerate codecs that hand back plain dicts
        s = ArenaSlice(**s)
    dtype = storage_dtype(s.dtype)
    count = int(np.prod(s.shape))
    if count * dtype.itemsize != s.nbytes:
        raise ValueError(f"slice nbytes {s.nbytes} does not match {s.dtype}{s.shape}")
    view = np.frombuffer(mv, dtype=dtype, count=count, offset=s.offset).reshape(s.shape)
    arr = mx.array(view)  # the one copy: buffer -> MLX memory
    if s.dtype == "bfloat16":
        arr = arr.view(mx.bfloat16)
    return arr


def read_kv(buf, layers: Sequence) -> List[KVCache]:
    """Rebuild per-layer KVCache objects from slices `write_kv` produced.

    The returned caches own their memory (nothing keeps `buf` exported, so a
    shared-memory segment can be closed right after) and are ready for
    BatchGenerator.insert / DecodeEngine.add.
    """
    mv = memoryview(buf).cast("B")
    caches = []
    try:
        for pair in layers:
            keys, values = (_read_slice(mv, s) for s in pair)
            if keys.shape[2] != values.shape[2]:
                raise ValueError("keys and values cover different token counts")
            c = KVCache()
            c.state = (keys, values, keys.shape[2])
            caches.append(c)
        # mx.array copied eagerly; eval resolves the lazy bfloat16 views too.
        mx.eval([(c.keys, c.values) for c in caches])
    finally:
        _release(mv)
    return caches
