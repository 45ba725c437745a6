"""Prefix-cache blocks in the arena.

One block is `block_size` tokens of every layer, keys then values per layer,
each a C-contiguous (kv_heads, block_size, head_dim) array, packed with no
padding. A block is self-contained, so the cache service can store, evict
and hand out blocks one by one and a reader gathers any run of them into a
KVCache. `KVLayout` describes it; `block_nbytes`, `write_blocks`,
`read_blocks` use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from workers.kv import arena_io
from workers.kv.arena_io import MX_DTYPE_NAMES, host_view, release_view, storage_dtype, to_mlx
from workers.kv.cache_state import check_plain_kv


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
    check_plain_kv(cache)
    if any(c.keys is None for c in cache):
        raise ValueError("kv_layout needs a filled cache")
    names = {MX_DTYPE_NAMES.get(c.keys.dtype) for c in cache} | {MX_DTYPE_NAMES.get(c.values.dtype) for c in cache}
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
    start it early and copy later (workers/decode/engine.py does, between steps)."""
    bs = layout.block_size
    start, end = first_block * bs, (first_block + n) * bs
    if first_block < 0 or any(c.offset < end for c in cache):
        raise ValueError(f"cache holds {min(c.offset for c in cache)} tokens; blocks need "
                         f"tokens [{start}, {end})")
    if kv_layout(cache, bs) != layout:
        raise ValueError(f"cache layout {kv_layout(cache, bs)} is not the prefix cache's {layout}")
    if arena_io.rearrange_on_host():
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
        release_view(mv)
    return len(offsets) * layout.block_nbytes


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
    if arena_io.rearrange_on_host():
        mv = memoryview(buf).cast("B")
        try:
            if len(set(layout.layers)) == 1:
                k, v = _gather_uniform(mv, offsets, layout)
                k_and_v = [a[i:i + 1] for i in range(k.shape[0]) for a in (k, v)]
            else:
                k_and_v = _gather_per_layer(mv, offsets, layout)
        finally:
            release_view(mv)
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
        return to_mlx(staging, layout.dtype)
    finally:
        release_view(mv)


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
    if arena_io.rearrange_on_host():
        mv = memoryview(buf).cast("B")
        try:
            keys, values = _gather_uniform(mv, offsets, layout)
        finally:
            release_view(mv)
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
    return to_mlx(keys, layout.dtype), to_mlx(values, layout.dtype)


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
    return [to_mlx(a, layout.dtype) for a in staging]
