"""The vision add-on: images in, input embeddings out, for decode by mlx-lm's text model.

A VLM request runs in four steps, each on mlx-vlm's own code for the model:

1. `preprocess(images)`: the model's processor turns pictures into
   `ImageBatch` (pixel values, plus what the architecture needs besides,
   e.g. Qwen's `image_grid_thw`, and how many placeholder tokens each image
   takes in the prompt).
2. `encode(batch)`: vision tower + projector, one row per placeholder token
   ([n_image_tokens, hidden]); what the cache service keys by image hash.
3. `prompt_tokens(messages, tokens_per_image)`: the chat template, with each
   image's placeholder expanded to its token count, tokenized: plain token ids
   the router hashes into blocks like any prompt (block keys must also carry
   the images' hashes: every image of the same size has the same ids).
4. `input_embeddings(ids, features, batch)` (text embeddings with the image
   features scattered into the placeholders: mlx-vlm's `get_input_embeddings`
   with the features passed as `cached_image_features`, so each model's own
   merge and scaling apply), `rope_positions(ids, batch)` (Qwen-VL's 3-D
   M-RoPE positions and rope delta from the language model's
   `get_rope_index`; None and 0 for plain rope), then `prefill(...)`: the
   language model over an mlx-lm KV cache, the last token's logits out.

Decode then continues on mlx-lm's *text* model over that same cache, its
rope shifted by the delta (workers/decode/shifted_rope.py).

The mlx-vlm model's language model shares the text model's weight arrays (no
second copy); only the vision tower and projector are the add-on's own.
Everything architecture-specific is one adapter in workers/vision/adapters.py's
`ARCHS` (its processor side, shared with the router, in environment/vision_layout.py).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from environment.backend import on_cpu
from environment.model_folder import ModelError
from environment.vision_layout import ImageBatch
from workers.kernels import mlx_hooks
from workers.vision.adapters import ARCHS

# Rope deltas VisionEngine remembers, by the tokens through a prompt's last image.
DELTAS_KEPT = 1024

# --------------------------------------------------------------------------
# The engine


class VisionEngine:
    """A VLM folder's vision tower, projector and processor (mlx-vlm), driving
    prefill through mlx-vlm's language model with the text model's weights.

    `text_model`: the mlx-lm model loaded from the same folder (what decode
    runs). Without it the add-on keeps mlx-vlm's own language weights and
    `make_cache` is unavailable. `encoder_only`: load only what `preprocess`
    and `encode` need (a vision worker); the language weights stay unread.
    """

    def __init__(self, folder: str | os.PathLike, text_model=None, dequantize: bool | None = None,
                 encoder_only: bool = False):
        from mlx_vlm.utils import get_model_and_args, load_model, load_processor

        self.folder = Path(folder)
        try:
            self.config = json.loads((self.folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{self.folder}: cannot read config.json ({e})") from None
        try:
            _, self.model_type = get_model_and_args(self.config)
        except (ImportError, KeyError, ValueError) as e:
            raise ModelError(f"{self.folder}: mlx-vlm cannot build this model ({e})") from None
        if self.model_type not in ARCHS:
            raise ModelError(f"{self.folder}: no vision add-on for {self.model_type!r} "
                             f"(supported: {', '.join(sorted(ARCHS))})")
        self.arch = ARCHS[self.model_type]
        # Lazy: the language weights are never read from disk when the text
        # model's arrays replace them below.
        self.model = load_model(self.folder, lazy=True)
        if on_cpu() if dequantize is None else dequantize:
            _to_float32(self.model)
        self.text_model = text_model
        self.shared_params = _share_language_weights(self.model, text_model) if text_model is not None else 0
        if text_model is not None:  # our prefill: this backend's kernels (workers/kernels/mlx_hooks.py)
            mlx_hooks.install_vlm(self.model.language_model)
        if encoder_only:
            # A vision worker: only the tower and projector are ever read
            # (preprocess + encode); the lazily loaded language weights stay on disk.
            mx.eval({k: v for k, v in self.model.children().items() if k != "language_model"})
        else:
            mx.eval(self.model.parameters())
        self.processor = load_processor(self.folder, add_detokenizer=False)
        self.tokenizer = self.processor.tokenizer
        self._deltas: OrderedDict[bytes, int] = OrderedDict()  # rope_positions' memory

    # -------------------------------------------------------------- images
    def image_tokens(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        """Placeholder tokens each image of (height, width) takes, from its
        size alone (what the router needs to build the prompt)."""
        return [self.arch.tokens_for_size(self.processor, int(h), int(w)) for h, w in sizes]

    def preprocess(self, images: Sequence[Any]) -> ImageBatch:
        """PIL images or HxWx3 uint8 arrays -> ImageBatch, through the model's own processor."""
        from PIL import Image

        if not images:
            raise ValueError("no images")
        pil = []
        for im in images:
            if isinstance(im, np.ndarray):
                if im.ndim != 3 or im.shape[2] != 3 or im.dtype != np.uint8:
                    raise ValueError(f"an image array must be HxWx3 uint8, got {im.shape} {im.dtype}")
                im = Image.fromarray(im, "RGB")
            elif im.mode != "RGB":
                im = im.convert("RGB")
            pil.append(im)
        text = self.arch.placeholder(self.processor) * len(pil)
        out = self.processor(text=[text], images=pil, padding=True, return_tensors="mlx")
        data = {k: (v if isinstance(v, mx.array) else mx.array(np.asarray(v))) for k, v in out.items()
                if k not in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")}
        pixel_values = data.pop("pixel_values")
        counts = self.arch.tokens_per_image(self.processor, data, len(pil))
        return ImageBatch(pixel_values, data, counts)

    @property
    def native_video(self) -> bool:
        """Whether this architecture takes a video as a video (Qwen2.5-VL, Qwen3-VL)."""
        return self.arch.native_video

    def preprocess_video(self, frames: Sequence[Any], fps: float, timestamps: Sequence[float] | None = None
                         ) -> ImageBatch:
        """A video's frames (PIL images or HxWx3 uint8 arrays, sampled at `fps`;
        `timestamps`: each frame's seconds into the video, else k / fps) ->
        one ImageBatch (Qwen-VL: video_grid_thw; `encode` takes it like an
        image's). Architectures without a video path raise ModelError."""
        return self.arch.preprocess_video(self.processor, list(frames), fps, timestamps)

    def sized_video(self, n_frames: int, height: int, width: int, fps: float = 0.0,
                    timestamps: Sequence[float] | None = None) -> ImageBatch:
        """A video's ImageBatch from its frame count and size alone (no pixel values)."""
        return self.arch.video_for_size(self.processor, int(n_frames), int(height), int(width), fps, timestamps)

    def preprocess_input(self, item) -> ImageBatch:
        """A protos ImageInput (an image, or a video's frames) through the processor."""
        pixels = np.asarray(item.pixels, dtype=np.uint8)
        if item.kind == "video":
            if pixels.ndim != 4:
                raise ValueError(f"a video's frames must be TxHxWx3 uint8, got {pixels.shape}")
            return self.preprocess_video(list(pixels), item.fps, item.timestamps or None)
        if item.kind != "image":
            raise ValueError(f"unknown media kind {item.kind!r}")
        return self.preprocess([pixels])

    def sized_input(self, item) -> ImageBatch | None:
        """`sized` (or `sized_video`) for a protos ImageInput."""
        shape = np.shape(item.pixels)
        if item.kind == "video":
            return self.sized_video(shape[0], shape[1], shape[2], item.fps, item.timestamps or None)
        return self.sized(*shape[:2])

    def sized(self, height: int, width: int) -> ImageBatch | None:
        """An ImageBatch of one image known by its size only (no pixel
        values), or None when the architecture needs the pixels for it."""
        extra = self.arch.extra_for_size(self.processor, int(height), int(width))
        if extra is None:
            return None
        return ImageBatch(None, extra, self.image_tokens([(height, width)]))

    @property
    def feature_dim(self) -> int:
        """Columns of an image's features (hidden; Qwen3-VL: (1 + DeepStack layers) * hidden)."""
        return self.arch.feature_dim(self.model)

    def encode(self, batch: ImageBatch) -> mx.array:
        """Image features [n_image_tokens, feature_dim] (vision tower + projector), evaluated."""
        features = self.arch.encode(self.model, batch.pixel_values, batch.extra)
        if features.shape[0] != sum(batch.tokens_per_image):
            raise RuntimeError(f"{features.shape[0]} image features for {sum(batch.tokens_per_image)} placeholders")
        mx.eval(features)
        return features

    # -------------------------------------------------------------- prompt
    def prompt_text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template's text, one placeholder per image part."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_tokens(self, messages_or_text, tokens_per_image: Sequence[int],
                      add_generation_prompt: bool = True, videos: Sequence[ImageBatch] = ()) -> list[int]:
        """Token ids of the templated prompt, each image's placeholder expanded
        to its token count (and each {"type": "video"} part to its video's
        blocks: `videos` from preprocess_video), tokenized as mlx-vlm's
        generate does."""
        from mlx_vlm.utils import should_add_special_tokens

        text = messages_or_text if isinstance(messages_or_text, str) else self.prompt_text(
            messages_or_text, add_generation_prompt)
        text = self.arch.expand_videos(self.processor, text, list(videos))
        text = self.arch.expand(self.processor, text, list(tokens_per_image))
        add_special = should_add_special_tokens(self.model_type, self.processor)
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    # -------------------------------------------------------------- prefill
    def input_embeddings(self, token_ids: Sequence[int], features: mx.array | None,
                         batch: ImageBatch | None = None) -> mx.array:
        """[1, n, hidden]: token embeddings, image features in the placeholders.
        `batch` carries the images' extra data (Qwen: image_grid_thw).
        Qwen3-VL with images: [1, n, (1 + k) * hidden], each token's DeepStack
        rows beside its embedding (see _Qwen3VL); `prefill` takes either."""
        ids = mx.array([list(token_ids)], dtype=mx.int32)
        kwargs: dict[str, Any] = {"mask": mx.ones_like(ids)}
        if features is None:
            return self.model.get_input_embeddings(ids, None, **kwargs).inputs_embeds
        extra = batch.extra if batch is not None else {}
        features, beside = self.arch.split_features(self.model, features)
        kwargs.update(self.arch.merge_kwargs(extra))
        kwargs["cached_image_features"] = self.arch.cached_features(features, extra)
        # The features are passed in (cached_image_features, mlx-vlm's own
        # vision-cache hook); pixel_values must only be non-None.
        embeds = self.model.get_input_embeddings(ids, mx.zeros((1,)), **kwargs).inputs_embeds
        if beside is None:
            return embeds
        # Scattered in prompt order into the image tokens' rows, as
        # get_input_embeddings scatters the features.
        where = np.flatnonzero(np.array(self.arch.visual_mask(self.model, ids)[0]))
        if where.size != beside.shape[0]:
            raise ValueError(f"{beside.shape[0]} image features for {where.size} placeholders")
        rows = mx.zeros((ids.shape[1], beside.shape[-1]), dtype=embeds.dtype)
        rows[mx.array(where, dtype=mx.uint32)] = beside.astype(embeds.dtype)
        return mx.concatenate([embeds, rows[None]], axis=-1)

    def rope_positions(self, token_ids: Sequence[int], batch: ImageBatch | None = None, start: int = 0
                       ) -> tuple[mx.array | None, int]:
        """(positions, delta): the positions `prefill` passes to the language
        model for prompt tokens [start, n) (Qwen-VL: M-RoPE's [3, 1, n - start];
        None for plain rope, which the model derives from the cache offset);
        delta = the next token's position minus n (0 for plain rope).

        After the last image a token's three M-RoPE components are all its
        index + delta. So when every image ends before `start` (a follow-up
        turn whose pictures are in the cached prefix) and this process saw
        the same tokens through the last image before, only the tail's
        positions are made: the whole prompt's (get_rope_index: ~1.5 ms for
        a 1024x1024 picture on a CPU) are not computed again."""
        token_ids = list(token_ids)
        extra = batch.extra if batch is not None else {}
        key, last = self.arch.visual_prefix(self.model, token_ids, extra)
        delta = self._deltas.get(key) if key is not None else None
        if delta is not None and last < start:
            self._deltas.move_to_end(key)
            return self.arch.text_positions(start, len(token_ids), delta), delta
        ids = mx.array([token_ids], dtype=mx.int32)
        positions, delta = self.arch.rope_positions(self.model, ids, extra)
        if key is not None:
            self._deltas[key] = delta
            while len(self._deltas) > DELTAS_KEPT:
                self._deltas.popitem(last=False)
        return (positions[..., start:] if positions is not None and start else positions), delta

    def make_cache(self) -> list:
        """A fresh mlx-lm cache for the text model (what decode continues)."""
        from mlx_lm.models.cache import make_prompt_cache

        if self.text_model is None:
            raise RuntimeError("make_cache needs the text model (VisionEngine(folder, text_model=...))")
        return make_prompt_cache(self.text_model)

    def prefill_chunk(self, token_ids: Sequence[int], embeddings: mx.array, positions: mx.array | None,
                      cache: list):
        """Run these prompt tokens into `cache` (mlx-lm caches) through the
        language model with `embeddings` [1, n, width] as its input and
        `positions` (M-RoPE) or None; returns the language model's output
        (lazy: the caller evaluates what it needs)."""
        ids = mx.array([list(token_ids)], dtype=mx.int32)
        n = ids.shape[1]
        if embeddings.shape[1] != n:
            raise ValueError(f"{embeddings.shape[1]} embeddings for {n} tokens")
        if positions is not None and positions.shape[-1] != n:
            raise ValueError(f"{positions.shape[-1]} positions for {n} tokens")
        inputs, kwargs = self.arch.prefill_inputs(self.model, ids, embeddings)
        if positions is not None:
            kwargs["position_ids"] = positions
        return self.model.language_model(ids, inputs_embeds=inputs, cache=cache, **kwargs)

    def prefill(self, token_ids: Sequence[int], embeddings: mx.array, positions: mx.array | None,
                cache: list, chunk: int = 512) -> mx.array:
        """The whole prompt through prefill_chunk; returns the last position's
        logits [vocab]. In chunks (only the cache is evaluated), the final
        one with the head over its last position alone (mlx_hooks.head_at)."""
        token_ids = list(token_ids)
        n = len(token_ids)
        if embeddings.shape[1] != n:
            raise ValueError(f"{embeddings.shape[1]} embeddings for {n} tokens")

        def run(s: int, e: int):
            return self.prefill_chunk(token_ids[s:e], embeddings[:, s:e],
                                      None if positions is None else positions[..., s:e], cache)

        start = 0
        while n - start > chunk:
            run(start, start + chunk)
            mx.eval([c.state for c in cache])
            start += chunk
        with mlx_hooks.head_at(self.model.language_model, [n - start - 1]):
            logits = run(start, n).logits[0, -1]
        mx.eval(logits, [c.state for c in cache])
        return logits


# --------------------------------------------------------------------------
# Loading helpers


def _to_float32(model) -> None:
    """The CPU policy of workers.models.loading: quantized layers expanded, float32."""
    from mlx_lm.utils import dequantize_model

    if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
        model.set_dtype(mx.float32)
        dequantize_model(model)
    model.set_dtype(mx.float32)


def _share_language_weights(vlm, text_model) -> int:
    """Point the mlx-vlm model's language parameters at the text model's
    arrays where name and shape agree (mlx-lm's qwen2_vl / gemma3 wrappers
    use mlx-vlm's names); a tied text model's embedding stands in for an
    lm_head it lacks. Returns the parameters shared."""
    from mlx.utils import tree_flatten, tree_unflatten

    theirs = dict(tree_flatten(text_model.parameters()))
    shared = []
    for name, p in tree_flatten(vlm.language_model.parameters()):
        full = f"language_model.{name}"
        src = theirs.get(full)
        if src is None and full.endswith("lm_head.weight"):
            src = theirs.get(full[: -len("lm_head.weight")] + "model.embed_tokens.weight")
        if src is not None and src.shape == p.shape:
            shared.append((name, src))
    vlm.language_model.update(tree_unflatten(shared))
    return len(shared)
