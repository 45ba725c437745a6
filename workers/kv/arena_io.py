"""Copy MLX arrays into a shared buffer and back: the one place that lays
arrays out in the cache service's arena and reads them out again.

The buffer is anything writable that exposes the buffer protocol: the cache
service arena's `.buf` memoryview, a `multiprocessing.shared_memory` segment's
`.buf`, or a plain bytearray in tests. Only (offset, nbytes, dtype, shape)
handles travel between processes (protos.messages.ArenaSlice). Every slice
starts on an ALIGN-byte boundary. Copies: one from MLX memory into the
buffer on write, one from the buffer into MLX memory on read (MLX cannot
wrap foreign memory); no intermediate copies.

bfloat16 has no numpy dtype: its raw 16-bit patterns are stored as uint16 and
the slice's dtype says "bfloat16", so the reader views them back as bfloat16.
Note that np.dtype("bfloat16") fails: readers must use `storage_dtype`.

The layouts built on this: the handoff's per-layer slices (handoff.py),
prefix-cache blocks (blocks.py), any cache's state and snapshots
(cache_state.py).
"""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx
import numpy as np

from environment.backend import on_cpu
from protos.messages import ArenaSlice


ALIGN = 64  # cache-line alignment for every slice's start

# MLX dtype -> (name written in ArenaSlice.dtype, numpy storage dtype)
MX_DTYPE_NAMES = {
    mx.float32: "float32",
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
}
# Any state array (recurrent caches also hold int lengths, quantized KV uint32).
STATE_DTYPE_NAMES = {
    **MX_DTYPE_NAMES,
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


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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


def arrays_nbytes(arrays: Sequence[Sequence]) -> int:
    """Bytes `write_arrays` needs for per-layer `arrays`, alignment padding included."""
    return sum(align(a.nbytes) for layer in arrays for a in layer)


def write_arrays(buf, base_offset: int, arrays: Sequence[Sequence]) -> List[List[ArenaSlice]]:
    """Copy per-layer arrays (an encoded cache's, cache_state.EncodedCache.arrays)
    into `buf` from `base_offset`: per layer one ArenaSlice per array, in
    order (offsets absolute in `buf`)."""
    layers, copy, _held = stage_arrays(buf, base_offset, arrays)
    copy()
    return layers


def stage_arrays(buf, base_offset: int, arrays: Sequence[Sequence]):
    """write_arrays in two halves. This one, on the MLX thread: check the
    room, lay the arrays out (on a GPU packed into one array, which the host
    reads at once), evaluate them and take host views. Returns (layers,
    copy, held): `copy()` writes those views into `buf` and touches no MLX
    array, so another thread may run it (on a GPU it is the slow part: the
    bytes come off the device page by page); the MLX arrays in `held` must
    outlive it, and are best dropped on the MLX thread."""
    mx.eval(arrays)
    need = arrays_nbytes(arrays)
    mv = memoryview(buf).cast("B")
    room = mv.nbytes
    release_view(mv)
    if base_offset < 0 or base_offset + need > room:
        raise ValueError(f"buffer too small: need {need} bytes at offset {base_offset}, buffer holds {room}")
    layers: List[List[ArenaSlice]] = []
    held = (_layout_layers if rearrange_on_host() else _layout_packed)(arrays, base_offset, layers)
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
            release_view(mv)

    return layers, copy, [a for _, a in held]


def release_view(mv: memoryview) -> None:
    """Drop our export of the buffer so shm.close() works after we return."""
    try:
        mv.release()
    except BufferError:  # a traceback still holds a numpy view; GC will free it
        pass


def _slice_of(a, offset: int) -> ArenaSlice:
    name = STATE_DTYPE_NAMES.get(a.dtype)
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
            offset += align(a.nbytes)
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
                if align(a.nbytes) > a.nbytes:
                    flat.append(mx.zeros((align(a.nbytes) - a.nbytes,), mx.uint8))
            pos += align(a.nbytes)
        layers.append(slices)
    if not flat:
        return []
    packed = mx.concatenate(flat)
    mx.eval(packed)
    return [(offset, packed)]


def as_arena_slice(s) -> ArenaSlice:
    return ArenaSlice(**s) if isinstance(s, dict) else s  # tolerate codecs that hand back plain dicts


def slice_view(mv: memoryview, s) -> np.ndarray:
    """The bytes of one ArenaSlice as a numpy array of its storage dtype (no copy)."""
    s = as_arena_slice(s)
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
    return [slice_view(mv, s) for pair in layers for s in pair]


def read_slice(mv: memoryview, s) -> mx.array:
    s = as_arena_slice(s)
    return to_mlx(slice_view(mv, s), s.dtype)  # the one copy: buffer -> MLX memory


def to_mlx(a: np.ndarray, name: str) -> mx.array:
    """Copy stored bytes into an MLX array of dtype `name`."""
    return as_stored(mx.array(a), name)


def as_stored(arr: mx.array, name: str) -> mx.array:
    """An array copied from storage as dtype `name` (bfloat16 comes back from
    its uint16 storage as a view, no second copy)."""
    return arr.view(mx.bfloat16) if name == "bfloat16" else arr


def rearrange_on_host() -> bool:
    """Where MLX runs. On its CPU backend numpy reads MLX memory in place and
    rearranges KV faster than MLX's own copies (a 64-block write 31 vs 57 ms,
    a read 61 vs 104 ms); on a GPU the rearranging belongs on the device
    (_pack_blocks)."""
    return on_cpu()
