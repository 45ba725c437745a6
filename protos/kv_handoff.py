"""A prompt's KV on its way from prefill to decode: the prefill worker ->
router message (`KVHandoff`, carried on in DecodeRequest) and where its
arrays lie in the cache service's shared-memory arena."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


@dataclass
class ArenaSlice:
    """Where one array lives in the cache service's shared-memory arena."""

    offset: int
    nbytes: int
    dtype: str  # numpy dtype name, e.g. "float32", "float16", "bfloat16" as "uint16"+tag
    shape: list[int]


@dataclass
class HeldBlocks:
    """A prompt's leading full prefix-cache blocks, leased in the cache
    service for one request: `hashes` in prompt order, at `offsets` in
    `arena`, under `lease` (so that none is evicted before decode takes
    them), covering the prompt's first `tokens` tokens. A prefill worker
    holds them (workers.kv.prefix_cache.PrefixCache.hold) and refers to them
    in its KVHandoff; empty (no hashes, lease -1) when nothing is held."""

    hashes: list[bytes] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    arena: str = ""
    lease: int = -1
    tokens: int = 0


@dataclass
class KVShard:
    """Where another rank of a prefill group put its part of a KVHandoff in
    this host's arena, for the same decode rank (workers/group/handoff_shards.py)."""

    arena: str
    allocation: int
    layers: list[list[ArenaSlice]]


@dataclass
class KVHandoff:
    """What decode needs to rebuild a prompt's KV cache. Prefill worker ->
    router on its own (after PrefillDone), router -> decode in DecodeRequest.

    `arena` names the shared-memory segment; `allocation` is the id the cache
    service gave the reservation (decode frees it once loaded). `layers` holds,
    per model layer, the keys slice then the values slice. When prefill and
    decode share a process (`--colocate`), `local` is True and the KV never
    leaves that process: `layers` is empty.

    Models whose caches are not all plain attention KV (sliding window,
    recurrent: see workers.kv.handoff.write_cache) also fill `cache_meta`:
    per layer the cache class and its state with array leaves {"a": i}, the
    i-th slice of that layer's entry in `layers` (any number of slices).
    Empty `cache_meta` means the plain [keys, values] layout above.
    """

    request_id: str
    num_tokens: int  # tokens covered by the KV (the prompt)
    rope_offset: int  # position of the next token (differs from num_tokens for M-RoPE)
    local: bool = False
    arena: str = ""
    allocation: int = -1
    layers: list[list[ArenaSlice]] = field(default_factory=list)  # [[keys, values], ...]
    kv_dtype: str = ""
    bytes_moved: int = 0
    write_ms: float = 0.0
    cache_meta: list[dict[str, Any]] = field(default_factory=list)  # per-layer cache class + state spec; [] for plain KV
    # By reference: the prompt's first `blocks.tokens` tokens are the held
    # prefix-cache blocks, which decode takes from its own memory where it
    # holds them. `layers` then covers only the tokens after them (none, and
    # no allocation, when the prompt ends on a block boundary).
    blocks: HeldBlocks = field(default_factory=HeldBlocks)
    # By value (PrefillRequest.kv_by_value: decode is on another host, which
    # cannot read this host's arena): the bytes of the slices themselves, one
    # out-of-band frame, `layers` offsets into it; arena "", allocation -1, no
    # blocks. None: the KV is in the arena (or local), as above.
    payload: Optional[np.ndarray] = None  # uint8, 1-d
    # From a worker group (--tensor-parallel / --pipeline-parallel, split
    # layout): the fields above are rank 0's part; rank r's is shards[r - 1].
    # Each rank wrote its own into this host's arena; no blocks by reference.
    shards: list[KVShard] = field(default_factory=list)

