"""The vision role: a VLM's images in, their embeddings in the cache service.

A VisionRequest's images (or videos) whose embeddings the cache service
lacks are run through the vision tower and projector (workers/vision/engine.py)
and stored there, keyed by content (workers/vision/embeddings.py); a prefill
with images then finds them instead of encoding. A prefill worker of a VLM
loads the same engine (`load_vision`) for the images no vision worker
encoded; only a process with the vision role takes VisionRequests.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from protos.messages import VisionDone, VisionRequest
from workers.kv.block_hash import model_fingerprint
from workers.role import Role, Unit
from workers.vision.embeddings import EmbeddingStore, preprocessing_settings
from workers.vision.engine import VisionEngine


def load_vision(model_dir: str, text_model, client, arena_buf: Callable[[str], object]):
    """(VisionEngine, EmbeddingStore): the vision tower and projector
    (mlx-vlm), and where embeddings live (`client`: a CacheClient). With a
    text model (a prefill worker) the language weights are the text model's;
    a vision-only worker keeps mlx-vlm's own."""
    engine = VisionEngine(model_dir, text_model=text_model, encoder_only=text_model is None)
    embeddings = EmbeddingStore(client, arena_buf, model_fingerprint(model_dir),
                                preprocessing_settings(engine.processor))
    return engine, embeddings


class VisionRole(Role):
    """A worker's vision encoder: `engine` (a VisionEngine) and `embeddings`
    (an EmbeddingStore) over the VisionRequests it is sent."""

    def __init__(self, engine, embeddings, *, worker_id: str, outbox, clock, fail=None):
        super().__init__(worker_id, outbox, clock, fail)
        self.engine = engine
        self.embeddings = embeddings
        self.queue: deque[VisionRequest] = deque()
        self.encode_unit = Unit("vision", self.timed_step)

    def handle(self, msg: VisionRequest) -> None:
        self.queue.append(msg)

    def has_work(self) -> bool:
        return bool(self.queue)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def units(self, busy_elsewhere):
        if self.has_work():
            yield self.encode_unit

    def unit_kinds(self) -> list[Unit]:
        return [self.encode_unit]

    def timed_step(self, wait: bool = False) -> None:
        with self.clock.phase("vision"):
            self.step()

    def step(self) -> None:
        """The next request's images; a failure fails that request."""
        req = self.queue.popleft()
        self.guarded(req.request_id, self.encode_images, req)

    def encode_images(self, req: VisionRequest) -> None:
        """Store every image's (or video's) embedding that the cache service lacks."""
        done, seen = VisionDone(req.request_id), set()
        for im in req.images:
            repeated = im.content_hash in seen
            seen.add(im.content_hash)
            if repeated or self.embeddings.has(im.content_hash, req.request_id):
                done.cached += 1
                continue
            t0 = time.perf_counter()
            features = self.engine.encode(self.engine.preprocess_input(im))
            done.encode_s += time.perf_counter() - t0
            done.encoded += 1
            self.embeddings.put(im.content_hash, features, req.request_id)
        self.outbox.send(done)
