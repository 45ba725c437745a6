"""The images whose embeddings a vision worker has stored in the cache
service, as the router remembers them: a request whose images are all there
skips the vision worker (a follow-up turn never queues behind another user's
encoding), and sends prefill their sizes alone."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Sequence

import numpy as np

from protos.messages import ImageInput

STORED_IMAGES_KEPT = 4096  # content hashes remembered (a few hundred KB of strings)


class StoredImages:
    """Content hashes, newest last. If the cache service evicted one since,
    prefill answers 503 and the request comes again with its pixels."""

    def __init__(self, kept: int = STORED_IMAGES_KEPT):
        self.kept = kept
        self._hashes: OrderedDict[str, None] = OrderedDict()

    def all_stored(self, hashes: Sequence[str]) -> bool:
        return all(h in self._hashes for h in hashes)

    def add(self, hashes: Sequence[str]) -> None:
        """Stored now, or used again: newest."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.kept:
            self._hashes.popitem(last=False)

    def touch(self, hashes: Sequence[str]) -> None:
        self.add([h for h in hashes if h in self._hashes])

    def forget(self, hashes: Sequence[str]) -> None:
        for h in hashes:
            self._hashes.pop(h, None)

    def for_prefill(self, images: Sequence[ImageInput], pixels: bool) -> list:
        """The images as prefill gets them: a stored picture by its size alone
        (unless `pixels`): prefill takes its features from the cache service,
        or needs none when it is in the cached prefix, and a 1024x1024
        picture's 3 MB cost ~1 ms of every turn about it."""
        return [im if pixels or im.content_hash not in self._hashes else _sized_only(im) for im in images]


def _sized_only(im: ImageInput) -> ImageInput:
    """The picture (or video) known by its size alone: its pixels' shape with
    no channels, which is all prefill needs to place cached features."""
    if not isinstance(im.pixels, np.ndarray) or not im.pixels.size:
        return im
    return replace(im, pixels=np.empty(im.pixels.shape[:-1] + (0,), np.uint8))
