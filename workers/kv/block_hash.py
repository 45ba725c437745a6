"""Chained block hashes: the keys of the shared prefix cache.

A prompt is cut into full blocks of `block_size` tokens; block i's key is

    h_i = SHA-256(h_{i-1} || extra || block_extra_i || tokens of block i as uint32 LE)

with h_{-1} = SEED. Chaining makes a key name the whole prefix up to the end
of its block, so a hit on block i implies blocks 0..i-1 match too, and the
cache service can answer "longest cached run from the start" by walking keys.

A conversation's end rarely falls on a block boundary: the tokens after its
last full block (1 to block_size-1 of them) are kept as a *tail block*,
keyed by

    t = SHA-256(TAIL || h_{n-1} || extra || tokens as uint32 LE, length-prefixed)

so a tail names its whole prefix too, never collides with a full block's key,
and is found by trying the next prompt's candidate lengths, longest first
(`tail_keys`). The next turn of a conversation then reuses every token its
previous answer left, as a single-process server's cache does.

`extra` pins everything besides token ids that changes the KV: the model's
weights (`model_fingerprint`), the KV dtype, the block size, the layout
version, an adapter name. `block_extra_i` is the hook for things that enter
one block only (an image's content hash and offset: two different pictures
share the same placeholder token ids, so those alone must never key KV); it
is empty for text.

A request's cache salt (its API key's tenant and its `cache_salt` field,
router/guards/cache_salt.py) seeds the chain: h_{-1} = chain_seed(salt), SEED for
no salt, so a salted prompt's keys (its tail blocks and snapshots too, which
derive from them) never meet another salt's or the shared cache's, and the
unsalted keys are those of before salts existed.

A rank of a tensor-parallel group (workers/group/) holds only its own KV
heads (or, pipeline parallel, its layers) of every block: its hasher's
`extra` ends with its shard (the split, rank and group size, `shard_extra`), so the ranks keep their shards side by side in
the host's one cache service and never read each other's (or a single
worker's) blocks. A worker alone adds nothing: its keys are those of before.

Every variable-length field is length-prefixed, so no two different inputs
concatenate to the same bytes. Keys are the full 32 bytes, never truncated.
Pure Python + hashlib + numpy (no MLX), so the router can compute the same
keys for cache-aware routing.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional, Sequence

import numpy as np

HASH_BYTES = 32
# h_{-1}: a fixed constant, so the same prompt hashes alike in every process
# and after every restart (no per-process salt, unlike Python's hash()).
SEED = hashlib.sha256(b"tandem kv block chain seed v1").digest()
# Bump when workers/kv/blocks.py changes the byte layout of a block: old
# blocks (in a disk tier) then simply stop matching.
LAYOUT_VERSION = b"tandem-kv-layout-1"
TAIL = b"tandem kv tail block v1"  # sets a tail block's key apart from a full block's
SALT = b"tandem kv cache salt v1"  # sets a salted chain's seed apart from SEED
SHARD = b"tandem kv tensor-parallel shard v1"  # a group rank's shard of each block

_EDGE_BYTES = 1 << 20  # fingerprint reads this much from each end of a weights file
_WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf", ".bin")

BlockExtra = Callable[[int], bytes]  # block index -> bytes that enter that block only


def _field(b: bytes) -> bytes:
    return len(b).to_bytes(4, "little") + b


def chain_seed(salt: str = "") -> bytes:
    """h_{-1} of a chain: SEED for the shared cache (no salt), else a seed of
    the salt's own."""
    if not salt:
        return SEED
    # surrogatepass: a lone surrogate from a JSON string still hashes, never raises
    return hashlib.sha256(SALT + _field(salt.encode("utf-8", "surrogatepass"))).digest()


def model_fingerprint(model_dir: str | os.PathLike) -> bytes:
    """32 bytes naming the weights in `model_dir`, cheap to compute.

    Reads config.json in full and, for each weights file, its name, size and
    the first and last MiB (so a re-quantized or re-trained file of the same
    name and size still differs: the header and the last tensors change).
    The folder's own name goes in too: folders converted from a GGUF are
    named by the GGUF's SHA-256, which makes this exact for them. A full hash
    of gigabytes of weights at every start would cost seconds for no gain.
    """
    folder = Path(model_dir).resolve()
    h = hashlib.sha256(b"tandem model fingerprint v1")
    h.update(_field(folder.name.encode()))
    config = folder / "config.json"
    h.update(_field(config.read_bytes() if config.is_file() else b""))
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    for p in weights:
        size = p.stat().st_size
        h.update(_field(p.name.encode()) + size.to_bytes(8, "little"))
        with open(p, "rb") as f:
            head = f.read(_EDGE_BYTES)
            if size > _EDGE_BYTES:
                f.seek(max(size - _EDGE_BYTES, _EDGE_BYTES))
                tail = f.read(_EDGE_BYTES)
            else:
                tail = b""
        h.update(hashlib.sha256(head).digest() + hashlib.sha256(tail).digest())
    return h.digest()


def block_extra(fingerprint: bytes, kv_dtype: str, block_size: int, adapter: str = "") -> bytes:
    """The `extra` bytes shared by every block of one model configuration."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    return b"".join(_field(f) for f in (
        LAYOUT_VERSION, fingerprint, kv_dtype.encode(), str(int(block_size)).encode(), adapter.encode()))


class Shard(NamedTuple):
    """Which share of every block a group's rank keeps: its KV heads
    ("tensor") or its layers ("pipeline"), as rank `rank` of `size`."""

    rank: int
    size: int
    split: str = "tensor"


def shard_extra(extra: bytes, rank: int, size: int, split: str = "tensor") -> bytes:
    """`extra` for rank `rank` of a group of `size` ranks, whose KV is that
    rank's share alone: its KV heads (`split` "tensor") or its layers
    ("pipeline"; the split goes in: a tensor rank's block and a pipeline
    rank's may be the same size). A group of one holds the whole KV:
    `extra` unchanged, as for a worker alone."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    if split not in ("tensor", "pipeline"):
        raise ValueError(f"no {split!r} split of a model")
    if size == 1:
        return bytes(extra)
    shard = split.encode() + int(rank).to_bytes(4, "little") + int(size).to_bytes(4, "little")
    return bytes(extra) + _field(SHARD) + _field(shard)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4").tobytes()


class BlockHasher:
    """Hashes prompts for one model configuration (one `extra`, one block size)."""

    def __init__(self, extra: bytes, block_size: int):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.extra = bytes(extra)
        self.block_size = int(block_size)
        # The last chain computed: (token bytes, per_block, keys). A prompt is
        # hashed up to three times (its prefix lookup, its handoff's lease,
        # its store), and a swarm's prompts share long system prompts: the
        # keys of a common leading run are reused, not recomputed.
        self._last: tuple = (b"", None, "", [])

    def for_shard(self, shard: "Shard | None") -> "BlockHasher":
        """The hasher of one rank's shard of the KV (shard_extra); None: a
        worker alone's, this one."""
        if shard is None:
            return self
        return BlockHasher(shard_extra(self.extra, shard.rank, shard.size, shard.split), self.block_size)

    def full_blocks(self, n_tokens: int) -> int:
        return n_tokens // self.block_size

    def hashes(self, tokens: Sequence[int], n_blocks: Optional[int] = None,
               per_block: Optional[BlockExtra] = None, salt: str = "") -> List[bytes]:
        """Keys of the first `n_blocks` full blocks of `tokens` (default: all
        full blocks; a partial last block never gets a key), in the cache of
        `salt` ("": the shared one)."""
        bs = self.block_size
        full = len(tokens) // bs
        n = full if n_blocks is None else min(int(n_blocks), full)
        data = _token_bytes(tokens[: n * bs])
        width = 4 * bs
        last_data, last_per_block, last_salt, last_keys = self._last
        same = _common_blocks(data, last_data, width) if per_block is last_per_block and salt == last_salt else 0
        out: List[bytes] = last_keys[:same]
        prev = out[-1] if out else chain_seed(salt)
        for i in range(same, n):
            h = hashlib.sha256(prev)
            h.update(self.extra)
            h.update(_field(per_block(i) if per_block is not None else b""))
            h.update(data[i * width:(i + 1) * width])
            prev = h.digest()
            out.append(prev)
        if n >= len(last_keys) or same < n:  # keep the longer chain when this one is its prefix
            self._last = (data, per_block, salt, out)
        return list(out)


    def tail_key(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        """Key of the tail block holding `tokens` (fewer than a block) after
        the full block whose key is `parent` (chain_seed(salt): from the start)."""
        if not 0 < len(tokens) < self.block_size:
            raise ValueError(f"a tail holds 1 to {self.block_size - 1} tokens, not {len(tokens)}")
        h = hashlib.sha256(TAIL)
        h.update(parent)
        h.update(self.extra)
        h.update(_field(_token_bytes(tokens)))
        return h.digest()

    def tail_keys(self, tokens: Sequence[int], parent: bytes, start: int, end: int) -> List[tuple]:
        """[(length, key), ...] of the tail blocks that could follow `parent`
        (the key of the block ending at `start`) within tokens[start:end],
        longest first."""
        longest = min(self.block_size - 1, end - start)
        return [(k, self.tail_key(parent, tokens[start:start + k])) for k in range(longest, 0, -1)]


def _common_blocks(a: bytes, b: bytes, width: int) -> int:
    """How many leading blocks of `width` bytes `a` and `b` share."""
    lo, hi = 0, min(len(a), len(b)) // width
    if a[:hi * width] == b[:hi * width]:
        return hi
    while lo < hi:  # a[:lo] matches, a[:hi] does not
        mid = (lo + hi + 1) // 2
        if a[:mid * width] == b[:mid * width]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def image_block_extra(images: Sequence, block_size: int) -> Optional[BlockExtra]:
    """The `per_block` hook for a prompt with images (protos ImageInput:
    content_hash, start, end; a video's span covers all its blocks): block i carries, for every image
    overlapping it, the image's content hash and its start relative to the
    block's first token (negative: it began in an earlier block). Blocks
    before the first image get b"" and hash exactly like text. None when
    there are no images."""
    spans = [(int(im.start), int(im.end), bytes.fromhex(im.content_hash)) for im in images]
    if not spans:
        return None
    bs = int(block_size)

    def per_block(i: int) -> bytes:
        lo, hi = i * bs, (i + 1) * bs
        return b"".join(_field(h) + (s - lo).to_bytes(8, "little", signed=True)
                        for s, e, h in spans if s < hi and e > lo)

    return per_block
