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

Prefix-cache blocks (second half of this file) use another layout: one block
is `block_size` tokens of every layer, keys then values per layer, each a
C-contiguous (kv_heads, block_size, head_dim) array, packed with no padding.
A block is self-contained, so the cache service can store, evict and hand
out blocks one by one and a reader gathers any run of them into a KVCache.
`KVLayout` describes it; `block_nbytes`, `write_blocks`, `read_blocks` use it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from protos.messages import ArenaSlice

log = logging.getLogger(__name__)

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
    return _to_mlx(view, s.dtype)  # the one copy: buffer -> MLX memory


def _to_mlx(a: np.ndarray, name: str) -> mx.array:
    """Copy stored bytes into an MLX array of dtype `name` (bfloat16 comes
    back from its uint16 storage as a view, no second copy)."""
    arr = mx.array(a)
    return arr.view(mx.bfloat16) if name == "bfloat16" else arr


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


# --------------------------------------------------------------------------- #
# Prefix-cache blocks
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class KVLayout:
    """The shape of one prefix-cache block: `block_size` tokens of every layer,
    per layer (kv_heads, key_dim, value_dim), all of one dtype."""

    layers: Tuple[Tuple[int, int, int], ...]
    dtype: str  # a name storage_dtype knows: "float32", "float16", "bfloat16"
    block_size: int

    @property
    def token_nbytes(self) -> int:
        item = storage_dtype(self.dtype).itemsize
        return sum(h * (dk + dv) for h, dk, dv in self.layers) * item

    @property
    def block_nbytes(self) -> int:
        return self.token_nbytes * self.block_size


def block_nbytes(layout: KVLayout) -> int:
    """Bytes of one block (no padding inside; the service aligns blocks)."""
    return layout.block_nbytes


def unblockable_reason(cache: Sequence) -> Optional[str]:
    """Why a model's cache cannot be cut into token blocks, or None if it can.

    Block reuse needs every layer to hold one K/V row per token of the whole
    prefix, so that any first n blocks are the KV of the first n*block_size
    tokens. A sliding window drops old rows (and rotates the rest in place);
    a recurrent state folds the whole prefix into one fixed-size array.
    """
    from mlx_lm.models.cache import ArraysCache, QuantizedKVCache, RotatingKVCache

    for i, c in enumerate(cache):
        if type(c) is KVCache:
            continue
        if isinstance(c, RotatingKVCache):
            why = "a sliding window keeps only the last tokens' KV"
        elif isinstance(c, ArraysCache):
            why = "a recurrent state has no per-token KV"
        elif isinstance(c, QuantizedKVCache):
            why = "quantized KV is not supported by the block layout"
        else:
            why = "not a plain attention KV cache"
        return f"layer {i} is {type(c).__name__}: {why}"
    return None


def kv_layout(cache: Sequence, block_size: int) -> KVLayout:
    """The block layout of a filled batch-1 cache."""
    _check_supported(cache)
    if any(c.keys is None for c in cache):
        raise ValueError("kv_layout needs a filled cache")
    names = {_MX_TO_NAME.get(c.keys.dtype) for c in cache} | {_MX_TO_NAME.get(c.values.dtype) for c in cache}
    if len(names) != 1 or None in names:
        raise ValueError(f"KV dtypes {sorted(map(str, names))} cannot share one block layout")
    layers = tuple((int(c.keys.shape[1]), int(c.keys.shape[3]), int(c.values.shape[3])) for c in cache)
    return KVLayout(layers, names.pop(), int(block_size))


def probe_kv_layout(model, block_size: int) -> KVLayout:
    """The block layout of `model`'s cache, found by running one token (the
    only way that works for every architecture: head counts and dims live
    under different config names). TypeError if the cache cannot be blocked."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    reason = unblockable_reason(cache)
    if reason is not None:
        raise TypeError(reason)
    model(mx.array([[0]], dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache])
    return kv_layout(cache, block_size)


def _block_view(mv: memoryview, offset: int, layout: KVLayout) -> np.ndarray:
    dtype = storage_dtype(layout.dtype)
    nbytes = layout.block_nbytes
    if offset < 0 or offset + nbytes > mv.nbytes:
        raise ValueError(f"block at {offset} (+{nbytes}) is outside the buffer of {mv.nbytes} bytes")
    return np.frombuffer(mv, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)


def _block_parts(layout: KVLayout):
    """(start, count, shape) of each array inside a flat block, in order:
    layer 0 keys, layer 0 values, layer 1 keys, ..."""
    bs, pos = layout.block_size, 0
    for h, dk, dv in layout.layers:
        for d in (dk, dv):
            yield pos, h * bs * d, (h, bs, d)
            pos += h * bs * d


def write_blocks(buf, offsets: Sequence[int], cache: Sequence, first_block: int, layout: KVLayout) -> int:
    """Copy blocks first_block, first_block+1, ... of `cache` (one per offset)
    into `buf` at `offsets`. Returns the bytes written.

    Only the written token range is evaluated and read; the cache stays as is.
    """
    if not offsets:
        return 0
    bs = layout.block_size
    start, end = first_block * bs, (first_block + len(offsets)) * bs
    if first_block < 0 or any(c.offset < end for c in cache):
        raise ValueError(f"cache holds {min(c.offset for c in cache)} tokens; blocks need "
                         f"tokens [{start}, {end})")
    if kv_layout(cache, bs) != layout:
        raise ValueError(f"cache layout {kv_layout(cache, bs)} is not the prefix cache's {layout}")
    arrays = [a[..., start:end, :] for c in cache for a in (c.keys, c.values)]
    mx.eval(arrays)
    srcs = [_as_numpy(a)[0] for a in arrays]  # (heads, tokens, dim) views, no copy
    parts = list(_block_parts(layout))
    mv = memoryview(buf).cast("B")
    try:
        for j, off in enumerate(offsets):
            block = _block_view(mv, off, layout)
            for src, (pos, count, shape) in zip(srcs, parts):
                # The one copy: strided MLX memory -> packed block bytes.
                block[pos:pos + count].reshape(shape)[...] = src[:, j * bs:(j + 1) * bs, :]
            del block
    finally:
        _release(mv)
    return len(offsets) * layout.block_nbytes


def read_blocks(buf, offsets: Sequence[int], layout: KVLayout) -> List[KVCache]:
    """Gather the blocks at `offsets` (in token order) into fresh per-layer
    KVCaches holding len(offsets)*block_size tokens.

    The result is evaluated and owns its memory, so the blocks may be
    released (or evicted) as soon as this returns.
    """
    if not offsets:
        raise ValueError("read_blocks needs at least one block")
    mv = memoryview(buf).cast("B")
    try:
        # Two copies (arena -> numpy staging -> MLX; MLX cannot wrap foreign
        # memory), few numpy calls: per-call overhead, not bandwidth, is what
        # makes small blocks slow.
        if len(set(layout.layers)) == 1:
            pairs = _gather_uniform(mv, offsets, layout)
        else:
            pairs = _gather_per_layer(mv, offsets, layout)
    finally:
        _release(mv)
    tokens = len(offsets) * layout.block_size
    caches = []
    for keys, values in pairs:
        c = KVCache()
        c.state = (keys, values, tokens)
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def _gather_uniform(mv, offsets, layout: KVLayout):
    """Every layer alike (the usual case): two numpy copies per block into
    all layers' keys (L, heads, tokens, key_dim) and values at once; each
    layer's cache is then a slice of one MLX array (no further copy)."""
    (h, dk, dv), n_layers = layout.layers[0], len(layout.layers)
    bs, n = layout.block_size, len(offsets)
    dtype = storage_dtype(layout.dtype)
    keys = np.empty((n_layers, h, n * bs, dk), dtype)
    values = np.empty((n_layers, h, n * bs, dv), dtype)
    split = h * bs * dk
    for j, off in enumerate(offsets):
        block = _block_view(mv, off, layout).reshape(n_layers, -1)
        keys[:, :, j * bs:(j + 1) * bs, :] = block[:, :split].reshape(n_layers, h, bs, dk)
        values[:, :, j * bs:(j + 1) * bs, :] = block[:, split:].reshape(n_layers, h, bs, dv)
        del block
    k, v = _to_mlx(keys, layout.dtype), _to_mlx(values, layout.dtype)
    return [(k[i:i + 1], v[i:i + 1]) for i in range(n_layers)]


def _gather_per_layer(mv, offsets, layout: KVLayout):
    """Layers of different shapes: one staging array per layer and kind."""
    bs, n = layout.block_size, len(offsets)
    dtype = storage_dtype(layout.dtype)
    parts = list(_block_parts(layout))
    staging = [np.empty((1, shape[0], n * bs, shape[2]), dtype) for _, _, shape in parts]
    for j, off in enumerate(offsets):
        block = _block_view(mv, off, layout)
        for dst, (pos, count, shape) in zip(staging, parts):
            dst[0, :, j * bs:(j + 1) * bs, :] = block[pos:pos + count].reshape(shape)
        del block
    arrays = [_to_mlx(a, layout.dtype) for a in staging]
    return list(zip(arrays[0::2], arrays[1::2]))


# --------------------------------------------------------------------------- #
# The worker's side of the shared prefix cache
# --------------------------------------------------------------------------- #

