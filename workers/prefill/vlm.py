"""Prefill of a prompt with images: workers/vision/engine.py's VisionEngine drives
mlx-vlm's language model (sharing the text model's weights) with the image
features in the placeholders and M-RoPE positions, into an mlx-lm cache that
decode continues on the text model (`rope_offset = num_tokens + delta`).

`VLMPrefillJob` has PrefillJob's interface (`step()` -> PrefillResult once
done, `save_prefix()`), so workers/worker.py drives both alike: one step
loads the cached prefix, each next one encodes at most one image, then each
runs one chunk of the prompt.

Prefix reuse: the prompt's block hashes carry every overlapping image's
content hash and offset (workers.kv.block_hash.image_block_extra), so a cached
block after an image is only ever reused for that same picture at the same
place. The job loads the longest cached prefix (KV blocks, or for sliding-
window models such as Gemma 3 a snapshot), then computes only the rest:

* images (and videos, for Qwen3-VL: one entry spanning all their frame-pair
  blocks) that lie wholly inside the cached prefix are never encoded (their
  placeholders get zero features: those positions' embeddings are cut off
  with the cached part); the others come from the embedding store
  (workers/vision/embeddings.py: the cache service, keyed by content hash) or are
  encoded one image at a time and stored there;
* the input embeddings and M-RoPE positions are computed for the whole
  prompt (positions depend on every earlier image's grid) and sliced at the
  cached length.

The first token is sampled exactly as workers/prefill/engine.py's PrefillJob
does (same grammar mask, processors over the whole prompt, sampler).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from cache_service.client import CacheUnavailable
from protos.budget import TokenBudget
from protos.messages import ImageInput, SamplingParams
from environment.vision_layout import ImageBatch
from workers.grammar import matcher_after
from workers.kernels import mlx_hooks
from workers.kv.block_hash import image_block_extra
from workers.loop_clock import part
from workers.prefill.engine import PrefillResult, sample_first


class VLMPrefillJob:
    clock = None  # the worker's LoopClock: parts of a prefill, timed

    def __init__(self, engine, prompt_tokens: Sequence[int], images: Sequence[ImageInput],
                 sampling: SamplingParams, chunk_size: int = 512, owner: str = "", prefix=None,
                 embeddings=None, grammars=None, budget: Optional[TokenBudget] = None, salt: str = ""):
        if not prompt_tokens:
            raise ValueError("empty prompt")
        self.engine = engine  # workers.vision.engine.VisionEngine with the text model
        self.tokens = [int(t) for t in prompt_tokens]
        self.images = list(images)
        # A resumed request: as PrefillJob's (workers/prefill/engine.py).
        self.sampling = sampling
        self.budget = budget if budget is not None else TokenBudget(sampling.max_tokens)
        self.matcher = matcher_after(grammars, sampling, self.tokens[len(self.tokens) - self.budget.produced:])
        self.chunk_size = chunk_size
        self.owner = owner
        self.salt = salt  # the request's cache salt: its blocks are found and stored under it
        self.prefix = prefix  # workers.kv.prefix_cache.PrefixCache / SnapshotCache, or None
        self.embeddings = embeddings  # workers.vision.embeddings.EmbeddingStore, or None
        self.per_block = image_block_extra(self.images, prefix.block_size) if prefix is not None else None
        self.result: Optional[PrefillResult] = None
        self.snapshot = None
        self.encoded = 0  # images run through the vision encoder
        self.skipped = 0  # images not encoded: inside the cached prefix, or their embeddings cached
        self.encode_s = 0.0
        self._saved = False
        self._dtype = None  # the encoder's output dtype (cached features are float32)
        self._compute_s = 0.0
        self.parts: dict[str, float] = {}  # this prompt's parts, seconds (its debug line)
        # Stages, one per step(): the cache (and cached length), then features
        # image by image, then the input embeddings, then chunks.
        self._cache, self._hit = None, 0
        self._parts, self._batches = [], []
        self._embeds = self._positions = None
        self._delta = 0
        self._done = 0  # prompt tokens in the cache
        self._snapshot_at = 0

    def step(self) -> Optional[PrefillResult]:
        """One unit of work; the result once the prompt is done. A call
        encodes at most one image (cached embeddings cost nothing) or runs one
        chunk of the prompt (the first also loads the cached prefix); the last
        token runs in the same call as the final chunk, as PrefillJob's. A worker thus drains its inbox (cancels,
        new requests, decode steps when colocated) between chunks of a long
        prompt with pictures, as it does for text."""
        if self.result is not None:
            return self.result
        tic = time.perf_counter()
        with mx.stream(generation_stream):
            if self._cache is None:
                with part(self.clock, "load prefix", self.parts):
                    self._cache, self._hit = self._load_prefix()
            encoded = False
            if self._embeds is None:
                with part(self.clock, "image features", self.parts):
                    encoded = self._next_feature()
                if len(self._parts) == len(self.images):
                    with part(self.clock, "inputs", self.parts):
                        self._inputs_ready()
            if self._embeds is not None and not encoded:
                self._chunk()
        self._compute_s += time.perf_counter() - tic
        if self.result is not None:
            self.result.prefill_ms = self._compute_s * 1000.0
        return self.result

    @property
    def remaining(self) -> int:
        """Prompt tokens left to compute (workers/prefill/turns.py's order)."""
        return 0 if self.result is not None else len(self.tokens) - self._done

    def run(self) -> PrefillResult:
        """Step to the end (tests, simple callers)."""
        while (result := self.step()) is None:
            pass
        return result

    def _inputs_ready(self) -> None:
        """The input embeddings and positions of the prompt past the cached
        length. With a picture there, the whole prompt's are made and cut
        (positions depend on every earlier image's grid); when every picture
        is in the cached prefix (a follow-up turn), only the text after it
        is embedded, and its positions come from the delta the engine
        remembers (workers/vision/engine.py rope_positions)."""
        eng, hit = self.engine, self._hit
        batch = ImageBatch.join(self._batches)
        if all(im.end <= hit for im in self.images):
            # Every picture is in the cached prefix: the rest is text.
            self._embeds = eng.input_embeddings(self.tokens[hit:], None)
        else:
            embed = eng.model.language_model.model.embed_tokens.weight
            dtype = self._dtype or embed.dtype
            features = mx.concatenate([p.astype(dtype) for p in self._parts])
            self._embeds = eng.input_embeddings(self.tokens, features, batch)[:, hit:]
        self._positions, self._delta = eng.rope_positions(self.tokens, batch, start=hit)
        self._parts = self._batches = None  # the embeddings hold what is needed now
        self._done = hit
        self._snapshot_at = self.prefix.snapshot_point(len(self.tokens)) if self.prefix is not None else 0

    def _chunk(self) -> None:
        """The next chunk; the final one takes the last token too, with the
        head over that position alone (mlx_hooks.head_at), and samples the
        first token."""
        eng, n = self.engine, len(self.tokens)
        start = self._done
        end = min(start + self.chunk_size, n)
        if self._snapshot_at > start:  # a chunk ends at the snapshot point (< n)
            end = min(end, self._snapshot_at)
        with part(self.clock, "chunk", self.parts):
            if end < n:
                eng.prefill_chunk(*self._inputs(start, end), self._cache)
                mx.eval([c.state for c in self._cache])
            else:
                with mlx_hooks.head_at(eng.model.language_model, [end - start - 1]):
                    logits = eng.prefill_chunk(*self._inputs(start, end), self._cache).logits[:, -1]
                first, lp = sample_first(logits, mx.array(self.tokens, dtype=mx.int32), self.sampling, self._cache,
                                         self.matcher, self.budget.produced)
        self._done = end
        if end == self._snapshot_at:
            self.snapshot = self.prefix.capture(self._cache, end)
        if end < n:
            return
        self._embeds = self._positions = None
        self.result = PrefillResult(first, lp, self._cache, n, n + int(self._delta), 0.0, self._hit)

    def _inputs(self, start: int, end: int):
        """Prompt positions [start, end): tokens, input embeddings, M-RoPE positions (or None)."""
        s, e = start - self._hit, end - self._hit  # the embeddings start at the cached length
        return (self.tokens[start:end], self._embeds[:, s:e],
                None if self._positions is None else self._positions[..., s:e])

    def _load_prefix(self) -> tuple[list, int]:
        n, prefix = len(self.tokens), self.prefix
        cache, hit = None, 0
        if prefix is not None:
            cache, hit = prefix.fetch(self.tokens, (n - 1) // prefix.block_size, self.owner,
                                      per_block=self.per_block, salt=self.salt)
        if cache is None:
            return self.engine.make_cache(), 0
        return cache, hit

    def _next_feature(self) -> bool:
        """Features for the next images, up to and including one that must be
        encoded (then True): an image ending inside the cached prefix gets zeros, the
        others their cached embeddings or their encoder output. Only an image
        that is encoded goes through the processor's resize and normalise;
        the others are known by their size."""
        eng, hit = self.engine, self._hit
        embed = eng.model.language_model.model.embed_tokens.weight
        width = eng.feature_dim  # hidden; Qwen3-VL: its DeepStack rows too
        while len(self._parts) < len(self.images):
            im = self.images[len(self._parts)]  # a video (Qwen3-VL) is one entry: its grid, its features
            batch, features = eng.sized_input(im), None
            if im.end <= hit:
                features = mx.zeros((im.n_tokens, width), dtype=embed.dtype)
            elif self.embeddings is not None:
                features = self.embeddings.get(im.content_hash, im.n_tokens, width, self.owner)
            encoded = features is None
            if not encoded:
                self.skipped += 1
            else:
                batch = eng.preprocess_input(_with_pixels(im))
                t0 = time.perf_counter()
                features = eng.encode(batch)
                mx.eval(features)
                self._dtype = features.dtype
                self.encode_s += time.perf_counter() - t0
                self.encoded += 1
                if self.embeddings is not None:
                    self.embeddings.put(im.content_hash, features, self.owner)
            if batch is None:  # this architecture needs the pixels even for positions
                batch = eng.preprocess_input(_with_pixels(im))
            if batch.tokens_per_image[0] != im.n_tokens:
                raise ValueError(f"an image takes {batch.tokens_per_image[0]} tokens, "
                                 f"the prompt has {im.n_tokens}")
            self._parts.append(features)
            self._batches.append(batch)
            if encoded:
                return True
        return False

    def save_prefix(self, host=None, later=None) -> int:
        """Store the prompt's blocks (or snapshot) under image-aware hashes.
        `host`, `later`: as PrefixCache.store's."""
        if self.prefix is None or self.result is None or self._saved:
            return 0
        self._saved = True
        snapshot, self.snapshot = self.snapshot, None  # host memory: drop it once stored
        return self.prefix.store(self.tokens, self.result.cache, self.owner, per_block=self.per_block, host=host,
                                 later=later, snapshot=snapshot, salt=self.salt)


def _with_pixels(im: ImageInput) -> ImageInput:
    """`im`, which is about to be preprocessed. The router sends a picture
    whose features a vision worker stored by its size alone (its pixels'
    shape, no channels): if those features are gone since, the request fails
    as a cache miss (503), and the router sends it again with the pixels."""
    if np.size(im.pixels) == 0:
        raise CacheUnavailable(f"the features of image {im.content_hash[:16]} are no longer stored, "
                               "and the request came without its pixels")
    return im
