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

`write_kv` / `read_kv` / `kv_nbytes` take plain attention KV (mlx_lm KVCache)
only and raise TypeError naming any other type. `write_cache` / `read_cache` /
`cache_nbytes` take any mlx-lm cache list (sliding window, recurrent, mixes as
in Gemma 3 or Qwen3-Next; third part of this file): a plain-KV list takes the
same path and message as write_kv; any other list adds per-layer class and
state metadata (KVHandoff.cache_meta). Snapshots (last part) are that same
state packed into one self-describing byte range for the prefix cache.

Prefix-cache blocks (second part of this file) use another layout: one block
is `block_size` tokens of every layer, keys then values per layer, each a
C-contiguous (kv_heads, block_size, head_dim) array, packed with no padding.
A block is self-contained, so the cache service can store, evict and hand
out blocks one by one and a reader gathers any run of them into a KVCache.
`KVLayout` describes it; `block_nbytes`, `write_blocks`, `read_blocks` use it.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache,
                                 RotatingKVCache)

from protos.messages import ArenaSlice

log = logging.getLogger(__name__)

ALIGN = 64  # cache-line alignment for every slice's start

# MLX dtype -> (name written in ArenaSlice.dtype, numpy storage dtype)
_MX_TO_NAME = {
    mx.float32: "float32",
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
}
# Any state array (recurrent caches also hold int lengths, quantized KV uint32).
_STATE_NAMES = {
    **_MX_TO_NAME,
    mx.int8: "int8", mx.int16: "int16", mx.int32: "int32", mx.int64: "int64",
    mx.uint8: "uint8", mx.uint16: "uint16", mx.uint32: "uint32", mx.uint64: "uint64",
    mx.bool_: "bool",
}
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
            "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
            "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
            "bool": np.bool_}


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
                f"{type(c).__name__} (write_cache / read_cache take any mlx-lm cache)"
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
    return encode_cache(cache).nbytes


def host_view(a) -> np.ndarray:
    """Zero-copy numpy view of an evaluated MLX array (strided views allowed);
    a numpy array as it is. On a GPU reading it moves the bytes off the
    device (page by page: slow, so a thread other than the MLX thread may do
    it; the MLX array must outlive the view)."""
    if isinstance(a, np.ndarray):
        return a
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
    return write_encoded(buf, base_offset, encode_cache(cache))


def write_encoded(buf, base_offset: int, enc: "EncodedCache") -> List[List[ArenaSlice]]:
    """Copy an encoded cache's arrays into `buf` from `base_offset`: per layer
    one ArenaSlice per array, in order (offsets absolute in `buf`)."""
    layers, copy, _held = stage_encoded(buf, base_offset, enc)
    copy()
    return layers


def stage_encoded(buf, base_offset: int, enc: "EncodedCache"):
    """write_encoded in two halves. This one, on the MLX thread: check the
    room, lay the arrays out (on a GPU packed into one array, which the host
    reads at once), evaluate them and take host views. Returns (layers,
    copy, held): `copy()` writes those views into `buf` and touches no MLX
    array, so another thread may run it (on a GPU it is the slow part: the
    bytes come off the device page by page); the MLX arrays in `held` must
    outlive it, and are best dropped on the MLX thread."""
    mx.eval(enc.arrays)
    need = enc.nbytes
    mv = memoryview(buf).cast("B")
    room = mv.nbytes
    _release(mv)
    if base_offset < 0 or base_offset + need > room:
        raise ValueError(f"buffer too small: need {need} bytes at offset {base_offset}, buffer holds {room}")
    layers: List[List[ArenaSlice]] = []
    held = (_layout_layers if _on_cpu() else _layout_packed)(enc.arrays, base_offset, layers)
    sources = [(offset, host_view(a)) for offset, a in held]

    def copy() -> None:
        mv = memoryview(buf).cast("B")
        try:
            for offset, src in sources:
                dst = np.frombuffer(mv, dtype=src.dtype, count=src.size, offset=offset)
                # The one copy: (strided) MLX memory -> contiguous slice of the buffer.
                dst.reshape(src.shape)[...] = src
                del dst
        finally:
            _release(mv)

    return layers, copy, [a for _, a in held]


def _release(mv: memoryview) -> None:
    """Drop our export of the buffer so shm.close() works after we return."""
    try:
        mv.release()
    except BufferError:  # a traceback still holds a numpy view; GC will free it
        pass


def _slice_of(a, offset: int) -> ArenaSlice:
    name = _STATE_NAMES.get(a.dtype)
    if name is None:
        raise ValueError(f"unsupported KV dtype {a.dtype}")
    return ArenaSlice(offset=offset, nbytes=a.nbytes, dtype=name, shape=list(a.shape))


def _layout_layers(arrays, offset, layers) -> list:
    """[(offset, array)] to copy one by one (plain KV: [keys, values] per
    layer; any cache: its state arrays); fills `layers`."""
    out = []
    for layer in arrays:
        slices = []
        for a in layer:
            slices.append(_slice_of(a, offset))
            if a.size:
                out.append((offset, a))
            offset += _align(a.nbytes)
        layers.append(slices)
    return out


def _layout_packed(arrays, offset, layers) -> list:
    """GPU: the same bytes as _layout_layers, laid out on the device as one
    array that the host reads once. Read array by array, strided device
    memory cost page faults per few KB: a 15-token tail of 28 layers took
    22 ms per request on an H100."""
    flat, pos = [], offset
    for layer in arrays:
        slices = []
        for a in layer:
            slices.append(_slice_of(a, pos))
            if a.nbytes:
                flat.append(mx.contiguous(a).reshape(-1).view(mx.uint8))
                if _align(a.nbytes) > a.nbytes:
                    flat.append(mx.zeros((_align(a.nbytes) - a.nbytes,), mx.uint8))
            pos += _align(a.nbytes)
        layers.append(slices)
    if not flat:
        return []
    packed = mx.concatenate(flat)
    mx.eval(packed)
    return [(offset, packed)]


def _arena_slice(s) -> ArenaSlice:
    return ArenaSlice(**s) if isinstance(s, dict) else s  # tolerate codecs that hand back plain dicts


def _slice_view(mv: memoryview, s) -> np.ndarray:
    """The bytes of one ArenaSlice as a numpy array of its storage dtype (no copy)."""
    s = _arena_slice(s)
    dtype = storage_dtype(s.dtype)
    count = int(np.prod(s.shape, dtype=np.int64))
    if count * dtype.itemsize != s.nbytes:
        raise ValueError(f"slice nbytes {s.nbytes} does not match {s.dtype}{s.shape}")
    if s.offset < 0 or s.offset + s.nbytes > mv.nbytes:
        raise ValueError(f"slice at {s.offset} (+{s.nbytes}) is outside the buffer of {mv.nbytes} bytes")
    return np.frombuffer(mv, dtype=dtype, count=count, offset=s.offset).reshape(s.shape)


def arena_kv_views(buf, layers: Sequence) -> List[np.ndarray]:
    """Numpy views (no copies) of plain KV that write_kv put in `buf`: layer 0
    keys, layer 0 values, layer 1 keys, ... as blocks_for_write's CPU form,
    which write_prepared_blocks copies blocks from. They keep `buf` exported
    until dropped."""
    mv = memoryview(buf).cast("B")
    return [_slice_view(mv, s) for pair in layers for s in pair]


def _read_slice(mv: memoryview, s) -> mx.array:
    s = _arena_slice(s)
    return _to_mlx(_slice_view(mv, s), s.dtype)  # the one copy: buffer -> MLX memory


def _to_mlx(a: np.ndarray, name: str) -> mx.array:
    """Copy stored bytes into an MLX array of dtype `name`."""
    return _as_stored(mx.array(a), name)


def _as_stored(arr: mx.array, name: str) -> mx.array:
    """An array copied from storage as dtype `name` (bfloat16 comes back from
    its uint16 storage as a view, no second copy)."""
    return arr.view(mx.bfloat16) if name == "bfloat16" else arr


def read_kv(buf, layers: Sequence) -> List[KVCache]:
    """Rebuild per-layer KVCache objects from slices `write_kv` produced.

    The returned caches own their memory: mx.array copies out of `buf` at
    once (nothing keeps `buf` exported, so a shared-memory segment can be
    closed or its slot reused right after). Nothing here waits on the
    device: the caller's next evaluation does what is left (a bfloat16 view).
    """
    return kv_from_copies(copy_kv(buf, layers), layers)


def copy_kv(buf, layers: Sequence) -> List[tuple]:
    """read_kv's copies alone: per layer (keys, values) as MLX arrays of the
    stored dtype (bfloat16 as its uint16 storage). Array creation and
    nothing else (no lazy op, no evaluation), so on MLX's CUDA backend,
    whose allocator takes a lock, a thread other than the MLX thread may
    run it: there these copies are the slow part (page by page into managed
    memory)."""
    mv = memoryview(buf).cast("B")
    try:
        return [tuple(mx.array(_slice_view(mv, _arena_slice(s))) for s in pair) for pair in layers]
    finally:
        _release(mv)


def kv_from_copies(copies: Sequence[tuple], layers: Sequence) -> List[KVCache]:
    """copy_kv's arrays as read_kv's caches (on the MLX thread)."""
    caches = []
    for pair, arrays in zip(layers, copies):
        keys, values = (_as_stored(a, _arena_slice(s).dtype) for a, s in zip(arrays, pair))
        if keys.shape[2] != values.shape[2]:
            raise ValueError("keys and values cover different token counts")
        c = KVCache()
        c.state = (keys, values, keys.shape[2])
        caches.append(c)
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
    arrays = blocks_for_write(cache, first_block, len(offsets), layout)
    mx.eval(arrays)
    return write_prepared_blocks(buf, offsets, arrays, range(len(offsets)), layout)


def blocks_for_write(cache: Sequence, first_block: int, n: int, layout: KVLayout) -> List[mx.array]:
    """Blocks first_block .. first_block+n-1 of `cache` as the (lazy) arrays
    write_prepared_blocks copies from: on a GPU one packed (n, block
    elements) array; on the CPU each layer's keys and values over those
    tokens. Evaluating them is the only wait on the device, so a caller may
    start it early and copy later (workers/decode.py does, between steps)."""
    bs = layout.block_size
    start, end = first_block * bs, (first_block + n) * bs
    if first_block < 0 or any(c.offset < end for c in cache):
        raise ValueError(f"cache holds {min(c.offset for c in cache)} tokens; blocks need "
                         f"tokens [{start}, {end})")
    if kv_layout(cache, bs) != layout:
        raise ValueError(f"cache layout {kv_layout(cache, bs)} is not the prefix cache's {layout}")
    if _on_cpu():
        return [a[..., start:end, :] for c in cache for a in (c.keys, c.values)]
    return [_pack_blocks(cache, start, n, bs)]


def write_prepared_blocks(buf, offsets: Sequence[int], arrays: Sequence[mx.array], indices: Sequence[int],
                          layout: KVLayout) -> int:
    """Copy blocks `indices` (counted from the first block of evaluated
    `arrays`, blocks_for_write's, or host copies in its CPU form: see
    arena_kv_views) into `buf` at `offsets`, one per offset. Returns the
    bytes written."""
    if len(indices) != len(offsets):
        raise ValueError(f"{len(indices)} blocks for {len(offsets)} offsets")
    mv = memoryview(buf).cast("B")
    try:
        if arrays[0].ndim != 2:  # per-layer keys and values (the CPU's form, a handoff's tail)
            _write_strided(mv, offsets, arrays, indices, layout)
        else:  # packed (n, block elements), on the device or already a host view of it
            host = host_view(arrays[0])  # one transfer of exactly the blocks' bytes
            for j, off in zip(indices, offsets):
                block = _block_view(mv, off, layout)
                block[...] = host[j]  # contiguous -> contiguous
                del block
    finally:
        _release(mv)
    return len(offsets) * layout.block_nbytes


def _on_cpu() -> bool:
    """Where MLX runs. On its CPU backend numpy reads MLX memory in place and
    rearranges KV faster than MLX's own copies (a 64-block write 31 vs 57 ms,
    a read 61 vs 104 ms); on a GPU the rearranging belongs on the device
    (_pack_blocks)."""
    return mx.default_device().type == mx.DeviceType.cpu


def _write_strided(mv, offsets, arrays, indices, layout: KVLayout) -> None:
    """CPU: one numpy copy per block and array, strided MLX memory -> block bytes."""
    bs = layout.block_size
    srcs = [host_view(a)[0] for a in arrays]  # (heads, tokens, dim) views, no copy
    parts = list(_block_parts(layout))
    for j, off in zip(indices, offsets):
        block = _block_view(mv, off, layout)
        for src, (pos, count, shape) in zip(srcs, parts):
            block[pos:pos + count].reshape(shape)[...] = src[:, j * bs:(j + 1) * bs, :]
        del block


def _pack_blocks(cache: Sequence, start: int, n: int, bs: int) -> mx.array:
    """Tokens [start, start + n*bs) of `cache` in the block format, one row
    per block: (n, block elements). The rearranging runs in MLX (on the GPU
    where there is one), so the host reads one contiguous array rather than
    layers x blocks strided pieces of device memory (each of which cost a
    page fault per few KB on an H100: 33 ms per request's new blocks)."""
    parts = []
    for c in cache:
        for a in (c.keys, c.values):
            h, d = a.shape[1], a.shape[3]
            piece = a[0, :, start:start + n * bs, :].reshape(h, n, bs, d)
            parts.append(mx.transpose(piece, (1, 0, 2, 3)).reshape(n, h * bs * d))
    return mx.concatenate(parts, axis=1)


def read_blocks(buf, offsets: Sequence[int], layout: KVLayout) -> List[KVCache]:
    """Gather the blocks at `offsets` (in token order) into fresh per-layer
    KVCaches holding len(offsets)*block_size tokens.

    The result is evaluated and owns its memory, so the blocks may be
    released (or evicted) as soon as this returns.
    """
    if not offsets:
        raise ValueError("read_blocks needs at least one block")
    if _on_cpu():
        mv = memoryview(buf).cast("B")
        try:
            if len(set(layout.layers)) == 1:
                k, v = _gather_uniform(mv, offsets, layout)
                k_and_v = [a[i:i + 1] for i in range(k.shape[0]) for a in (k, v)]
            else:
                k_and_v = _gather_per_layer(mv, offsets, layout)
        finally:
            _release(mv)
    else:
        k_and_v = _unpack_blocks(_gather(buf, offsets, layout), layout)
    tokens = len(offsets) * layout.block_size
    caches = []
    for keys, values in zip(k_and_v[0::2], k_and_v[1::2]):
        c = KVCache()
        c.state = (keys, values, tokens)
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def _gather(buf, offsets: Sequence[int], layout: KVLayout) -> mx.array:
    """The blocks at `offsets`, packed (n, block elements) into MLX: one
    host copy per block into a staging buffer, then one copy into MLX (it
    cannot wrap foreign memory)."""
    dtype = storage_dtype(layout.dtype)
    n, elems = len(offsets), layout.block_nbytes // dtype.itemsize
    mv = memoryview(buf).cast("B")
    try:
        (staging,) = _STAGING.arrays([(n, elems)], dtype)
        for j, off in enumerate(offsets):
            block = _block_view(mv, off, layout)
            staging[j] = block
            del block
        return _to_mlx(staging, layout.dtype)
    finally:
        _release(mv)


def _unpack_blocks(packed: mx.array, layout: KVLayout) -> List[mx.array]:
    """Packed blocks -> per layer keys then values, (1, heads, n*bs, dim)
    each, rearranged in MLX (lazy)."""
    n, bs, pos, out = packed.shape[0], layout.block_size, 0, []
    for h, dk, dv in layout.layers:
        for d in (dk, dv):
            piece = packed[:, pos:pos + h * bs * d].reshape(n, h, bs, d)
            out.append(mx.transpose(piece, (1, 0, 2, 3)).reshape(1, h, n * bs, d))
            pos += h * bs * d
    return out


class _StagingBuffer:
    """Host memory that block reads gather into before MLX copies it, kept
    between reads: a fresh 100 MB numpy array costs ~25k page faults, more
    than the copy itself (GPU profile: 48 of a 68 ms read). mx.array copies
    at once, so the next read may reuse it; only the worker's MLX thread
    reads blocks. Reads above `keep_bytes` get memory of their own, so one
    huge prompt does not pin its size for the life of the process."""

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self._buf = np.empty(0, np.uint8)

    def arrays(self, shapes: Sequence[tuple], dtype: np.dtype) -> List[np.ndarray]:
        sizes = [int(np.prod(s)) * dtype.itemsize for s in shapes]
        total = sum(sizes)
        if total > self.keep_bytes:
            return [np.empty(s, dtype) for s in shapes]
        if self._buf.nbytes < total:
            self._buf = np.empty(total, np.uint8)
        out, pos = [], 0
        for shape, size in zip(shapes, sizes):
            out.append(self._buf[pos:pos + size].view(dtype).reshape(shape))
            pos += size
        return out


_STAGING = _StagingBuffer(keep_bytes=256 << 20)


def read_blocks_stacked(buf, offsets: Sequence[int], layout: KVLayout) -> Tuple[mx.array, mx.array]:
    """Like read_blocks, for a layout whose layers are alike: keys and values
    of every layer stacked, (layers, kv_heads, tokens, head_dim), copied out
    of `buf` at once (on a GPU the rearranging is left lazy: no wait on the
    device)."""
    if not offsets:
        raise ValueError("read_blocks_stacked needs at least one block")
    if len(set(layout.layers)) != 1:
        raise ValueError("read_blocks_stacked needs layers of one shape")
    if _on_cpu():
        mv = memoryview(buf).cast("B")
        try:
            keys, values = _gather_uniform(mv, offsets, layout)
        finally:
            _release(mv)
        mx.eval(keys, values)
        return keys, values
    (h, dk, dv), n_layers = layout.layers[0], len(layout.layers)
    n, bs = len(offsets), layout.block_size
    packed = _gather(buf, offsets, layout).reshape(n, n_layers, h * bs * (dk + dv))

    def stacked(lo: int, d: int) -> mx.array:
        piece = packed[:, :, lo:lo + h * bs * d].reshape(n, n_layers, h, bs, d)
        return mx.transpose(piece, (1, 2, 0, 3, 4)).reshape(n_layers, h, n * bs, d)

    keys, values = stacked(0, dk), stacked(h * bs * dk, dv)
    return keys, values


def _gather_uniform(mv, offsets, layout: KVLayout):
    """CPU, every layer alike: two numpy copies per block into all layers'
    keys (L, heads, tokens, key_dim) and values at once, stacked."""
    (h, dk, dv), n_layers = layout.layers[0], len(layout.layers)
    bs, n = layout.block_size, len(offsets)
    dtype = storage_dtype(layout.dtype)
    keys, values = _STAGING.arrays([(n_layers, h, n * bs, dk), (n_layers, h, n * bs, dv)], dtype)
    split = h * bs * dk
    for j, off in enumerate(offsets):
        block = _block_view(mv, off, layout).reshape(n_layers, -1)
        keys[:, :, j * bs:(j + 1) * bs, :] = block[:, :split].reshape(n_layers, h, bs, dk)
        values[:, :, j * bs:(j + 1) * bs, :] = block[:, split:].reshape(n_layers, h, bs, dv)
        del block
    return _to_mlx(keys, layout.dtype), _to_mlx(values, layout.dtype)


def _gather_per_layer(mv, offsets, layout: KVLayout):
    """CPU, layers of different shapes: one staging array per layer and kind
    (per layer keys then values)."""
    bs, n = layout.block_size, len(offsets)
    dtype = storage_dtype(layout.dtype)
    parts = list(_block_parts(layout))
    staging = _STAGING.arrays([(1, shape[0], n * bs, shape[2]) for _, _, shape in parts], dtype)
    for j, off in enumerate(offsets):
        block = _block_view(mv, off, layout)
        for dst, (pos, count, shape) in zip(staging, parts):
            dst[0, :, j * bs:(j + 1) * bs, :] = block[pos:pos + count].reshape(shape)
        del block
    return [_to_mlx(a, layout.dtype) for a in staging]


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
        """Bytes `write_encoded` needs, alignment padding included."""
        return sum(_align(a.nbytes) for layer in self.arrays for a in layer)


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
        _check_supported(cache)
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
        if type(c) is KVCache or c._idx == c.offset:
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


def _decode_layer(spec, arrays: list):
    name = spec.get("cls") if isinstance(spec, dict) else None
    cls = _STATE_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown cache class in {spec!r:.80}")
    if cls is CacheList:
        subs = spec.get("caches")
        if not isinstance(subs, list):
            raise ValueError("CacheList spec without caches")
        return CacheList(*[_decode_layer(sub, arrays) for sub in subs])
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
            name = _MX_TO_NAME.get(a.dtype)
            if name is not None:
                return name
    return ""


def write_cache(buf, base_offset: int, cache: Sequence) -> Tuple[List[List[ArenaSlice]], list]:
    """Copy any mlx-lm cache list into `buf` (as write_kv does). Returns
    (layers, meta) for KVHandoff.layers and KVHandoff.cache_meta; for plain
    KV, meta is [] and layers are exactly write_kv's."""
    enc = encode_cache(cache)
    return write_encoded(buf, base_offset, enc), enc.meta


def read_cache(buf, layers: Sequence, meta: Sequence) -> list:
    """Rebuild what `write_cache` wrote: per-layer caches that own their
    memory (copied out of `buf` at once), ready for DecodeEngine.add."""
    if not meta:
        return read_kv(buf, layers)
    if len(meta) != len(layers):
        raise ValueError(f"{len(meta)} layer specs for {len(layers)} layers of slices")
    mv = memoryview(buf).cast("B")
    try:
        arrays = [[_read_slice(mv, s) for s in layer] for layer in layers]
    finally:
        _release(mv)
    mx.eval(arrays)
    return [_decode_layer(spec, layer) for spec, layer in zip(meta, arrays)]


# --------------------------------------------------------------------------- #
# Snapshots: a whole cache state at one token boundary as one byte range
# --------------------------------------------------------------------------- #
#
# For caches that cannot be cut into blocks, the prefix cache keeps the state
# at one point of a prompt. The cache service sees one opaque entry, so the
# entry describes itself:
#
#   [magic 8 B][header length u32 LE][header JSON][pad to ALIGN][arrays...]
#
# header = {"tokens": n, "layers": [spec, ...], "slices": per layer
# [[offset from the data start, nbytes, dtype, shape], ...]}; each array
# starts on an ALIGN boundary from the data start.

SNAPSHOT_MAGIC = b"TDSNAP01"
_SNAP_HEAD = struct.Struct("<8sI")
_MAX_HEADER = 16 << 20  # a header is kilobytes; anything larger is garbage


@dataclass
class Snapshot:
    """A cache's state at `tokens`, copied to host memory at that point (the
    live cache goes on being updated in place by the chunks that follow)."""

    tokens: int
    header: bytes
    arrays: list  # numpy copies (bfloat16 as its uint16 bits), in header order
    data_offset: int  # where the arrays start, from the snapshot's start
    nbytes: int  # the whole entry


def capture_snapshot(cache: Sequence, tokens: int) -> Snapshot:
    """Copy `cache` (holding exactly the first `tokens` tokens) to host memory."""
    enc = encode_cache(cache, with_meta=True)
    mx.eval(enc.arrays)
    host, slices, pos = [], [], 0
    for layer in enc.arrays:
        out = []
        for a in layer:
            name = _STATE_NAMES.get(a.dtype)
            if name is None:
                raise ValueError(f"unsupported state dtype {a.dtype}")
            host.append(np.array(host_view(a)))  # the copy (contiguous)
            out.append([pos, a.nbytes, name, list(a.shape)])
            pos += _align(a.nbytes)
        slices.append(out)
    header = json.dumps({"tokens": int(tokens), "layers": enc.meta, "slices": slices},
                        separators=(",", ":")).encode()
    data = _align(_SNAP_HEAD.size + len(header))
    return Snapshot(int(tokens), header, host, data, data + pos)


def write_snapshot(buf, offset: int, snap: Snapshot) -> None:
    """Copy a snapshot into `buf` at `offset` (snap.nbytes bytes)."""
    mv = memoryview(buf).cast("B")
    try:
        if offset < 0 or offset + snap.nbytes > mv.nbytes:
            raise ValueError(f"snapshot of {snap.nbytes} bytes at {offset} is outside the buffer "
                             f"of {mv.nbytes} bytes")
        _SNAP_HEAD.pack_into(mv, offset, SNAPSHOT_MAGIC, len(snap.header))
        start = offset + _SNAP_HEAD.size
        mv[start:start + len(snap.header)] = snap.header
        pos = offset + snap.data_offset
        for a in snap.arrays:
            if a.size:
                dst = np.frombuffer(mv, dtype=a.dtype, count=a.size, offset=pos)
                dst[...] = a.reshape(-1)
                del dst
            pos += _align(a.nbytes)
    finally:
        _release(mv)


def read_snapshot(buf, offset: int, nbytes: int) -> Tuple[list, int]:
    """Rebuild the caches of the snapshot entry at `offset` (`nbytes` long).
    Returns (caches, tokens they hold); they own their memory. ValueError for
    anything that is not a whole, well-formed snapshot."""
    mv = memoryview(buf).cast("B")
    try:
        if offset < 0 or nbytes < _SNAP_HEAD.size or offset + nbytes > mv.nbytes:
            raise ValueError(f"snapshot at {offset} (+{nbytes}) is outside the buffer of {mv.nbytes} bytes")
        magic, hlen = _SNAP_HEAD.unpack_from(mv, offset)
        if magic != SNAPSHOT_MAGIC:
            raise ValueError("not a snapshot (bad magic)")
        if hlen > min(_MAX_HEADER, nbytes - _SNAP_HEAD.size):
            raise ValueError(f"snapshot header of {hlen} bytes does not fit its {nbytes}-byte entry")
        start = offset + _SNAP_HEAD.size
        raw = bytes(mv[start:start + hlen])
    finally:
        _release(mv)
    try:
        header = json.loads(raw)
        tokens, meta, slices = int(header["tokens"]), header["layers"], header["slices"]
        data, end = offset + _align(_SNAP_HEAD.size + hlen), offset + nbytes
        layers = [[ArenaSlice(offset=data + int(o), nbytes=int(nb), dtype=str(dt), shape=[int(d) for d in shape])
                   for o, nb, dt, shape in layer] for layer in slices]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"bad snapshot header: {exc}") from None
    if any(s.offset < data or s.offset + s.nbytes > end for layer in layers for s in layer):
        raise ValueError("snapshot slice outside its entry")
    if not meta or not isinstance(meta, list):
        raise ValueError("snapshot without layers")
    return read_cache(buf, layers, meta), tokens
