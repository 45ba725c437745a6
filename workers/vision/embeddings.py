"""Image (and video) embeddings in the cache service, keyed by content.

An image's (or a video's: router/media/decode.py's hash names its frames and
sampling) features (the vision tower + projector output, [n_tokens, hidden])
are stored as one cache entry, float32, under

    key = SHA-256("tandem-embedding-v1" || model fingerprint
                  || preprocessing settings || image content hash)

(the content hash covers the decoded RGB pixels, width and height: see
router/media/decode.py), with the same two-phase put as KV blocks (reserve ->
write into the arena -> commit), so every worker shares them, they are
evicted LRU by bytes with the KV blocks, and the disk tier keeps them across
restarts. Any failure is a miss: the image is then encoded.
"""

from __future__ import annotations

import hashlib
import json
import logging

import mlx.core as mx
import numpy as np

from cache_service.client import CacheUnavailable

log = logging.getLogger(__name__)

LEASE_S = 10.0
TTL_S = 30.0


def preprocessing_settings(processor) -> bytes:
    """What the image processor (and the video processor, if any: Qwen3-VL
    encodes videos with it) does to pixels (size limits, patching, normalisation),
    canonical JSON: part of the embedding key."""
    settings = _settings(getattr(processor, "image_processor", processor))
    video = getattr(processor, "video_processor", None)
    if video is not None:
        settings = {"image": settings, "video": _settings(video)}
    return json.dumps(settings, sort_keys=True, default=str).encode()


def _settings(component) -> dict:
    try:
        return component.to_dict()
    except Exception:  # noqa: BLE001 - a processor without to_dict: its attributes
        return {k: v for k, v in vars(component).items() if not k.startswith("_")}


def embedding_key(fingerprint: bytes, settings: bytes, content_hash: str) -> bytes:
    h = hashlib.sha256(b"tandem-embedding-v1")
    for part in (fingerprint, settings, bytes.fromhex(content_hash)):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.digest()


class EmbeddingStore:
    def __init__(self, client, arena_buf, fingerprint: bytes, settings: bytes):
        self.client = client  # cache_service.client.CacheClient (lookup/release/reserve/commit)
        self.arena_buf = arena_buf  # arena name -> writable buffer
        self.fingerprint = fingerprint
        self.settings = settings

    def key(self, content_hash: str) -> bytes:
        return embedding_key(self.fingerprint, self.settings, content_hash)

    def get(self, content_hash: str, n_tokens: int, hidden: int, owner: str) -> mx.array | None:
        """The image's features [n_tokens, hidden] (float32), or None."""
        key = self.key(content_hash)
        try:
            reply = self.client.lookup([key], owner=owner, lease_s=LEASE_S)
            if not reply.ok or not reply.blocks:
                return None
            try:
                ref = reply.blocks[0]
                want = n_tokens * hidden * 4
                if bytes(ref.hash) != key or ref.nbytes < want:
                    return None
                buf = self.arena_buf(reply.arena)
                data = np.frombuffer(buf, dtype=np.float32, count=n_tokens * hidden, offset=ref.offset).copy()
            finally:
                self.client.release(reply.lease)
            return mx.array(data.reshape(n_tokens, hidden))
        except (CacheUnavailable, ValueError) as exc:
            log.warning("embedding lookup failed (%s); encoding", exc)
            return None

    def has(self, content_hash: str, owner: str) -> bool:
        """Whether the image's features are stored (no read)."""
        key = self.key(content_hash)
        try:
            reply = self.client.lookup([key], owner=owner, lease_s=LEASE_S)
            if not reply.ok:
                return False
            self.client.release(reply.lease)
            return bool(reply.blocks) and bytes(reply.blocks[0].hash) == key
        except CacheUnavailable as exc:
            log.warning("embedding lookup failed (%s)", exc)
            return False

    def put(self, content_hash: str, features: mx.array, owner: str) -> bool:
        """Store the image's features; False when the service refused."""
        key = self.key(content_hash)
        data = np.ascontiguousarray(np.array(features.astype(mx.float32)))
        try:
            reply = self.client.reserve([key], data.nbytes, owner=owner, ttl_s=TTL_S)
            refs = [r for r in reply.blocks if bytes(r.hash) == key] if reply.ok else []
            if not refs or refs[0].nbytes < data.nbytes:
                return False  # cached already, being written, or no room
            buf = self.arena_buf(reply.arena)
            np.frombuffer(buf, dtype=np.uint8, count=data.nbytes, offset=refs[0].offset)[:] = data.view(np.uint8).reshape(-1)
            return bool(self.client.commit([key], owner=owner).ok)
        except (CacheUnavailable, ValueError) as exc:
            log.warning("embedding store failed: %s", exc)
            return False
