"""Cache-aware routing: send a prompt to the prefill worker that last saw its prefix.

All prefill workers share one cache service, so a prefix committed by one is
reused by all. What routing still decides is the in-flight case: the 50
agents of a swarm arrive together with one system prompt; if they spread over
workers, each worker computes that prompt before any has committed it. Sent
to the worker already computing it, they queue behind it and reuse its blocks.

Keys are chained hashes of full token blocks, like the cache's own keys but
without the model fingerprint (one router serves one model). A request's cache
salt seeds the chain, as it seeds the cache's: prompts of different salts
share no blocks, so they have no reason to follow each other.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from array import array

MAX_BLOCKS = 256  # prefixes longer than this many blocks route by their first 256


def prefix_keys(tokens: list[int], block_size: int, salt: str = "") -> list[bytes]:
    """Routing keys of the prompt's full blocks (the first MAX_BLOCKS) under
    `salt` (router/guards/cache_salt.py; "": the shared cache's keys)."""
    keys, parent = [], b"tandem-route"
    if salt:
        parent = hashlib.sha256(b"tandem-route salt\x00" + salt.encode("utf-8", "surrogatepass")).digest()
    n_blocks = min(len(tokens) // block_size, MAX_BLOCKS)
    for i in range(n_blocks):
        block = array("I", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        keys.append(parent)
    return keys


class PrefixAffinity:
    """An LRU map from prefix key to the worker that last prefilled it."""

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def matched_blocks(self, keys: list[bytes]) -> dict[str, int]:
        """For each worker, how many leading blocks of this prompt it saw last."""
        best: dict[str, int] = {}
        for depth, key in enumerate(keys, 1):
            owner = self._owner.get(key)
            if owner is not None:
                best[owner] = depth
        return best

    def record(self, keys: list[bytes], worker_id: str) -> None:
        for key in keys:
            self._owner[key] = worker_id
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        for key in [k for k, w in self._owner.items() if w == worker_id]:
            del self._owner[key]
