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

Decode then continues on mlx-lm's *text* model over that same cache. After
the last image every M-RoPE component of a text token is the same number,
`token_index + rope_delta`, and M-RoPE with three equal components is plain
RoPE (each of the t/h/w frequency sections rotates by the same position), so
mlx-lm's qwen2 computes exactly Qwen2.5-VL's decode step if its rope offset is
shifted by the delta (`rope_delta`, negative: an image of h x w merged patches
takes h*w tokens but advances positions by max(h, w)). mlx-lm's attention
reads the rope position from `cache.offset`:

* `KVCache.offset` is also the write index and the mask offset, so it cannot
  be shifted. `shift_rope(cache, delta)` turns each plain KVCache into a
  batch-of-one `BatchKVCache` (same buffers, no copy) whose per-row `offset`
  (an array) only feeds rope, while writes go by `_idx` and the mask by
  `_idx` and `left_padding`.
* In a running `BatchKVCache` a row's shift survives `filter`, `extend` and
  `trim` (they carry `offset` along) but not `merge` or `extract`, which
  rebuild `offset` from the lengths. So a request must get its shift after
  it has joined the batch (BatchGenerator merges on insert;
  `shift_batch_rope` shifts rows of a merged batch), or ride in a cache that
  carries it into the merge: `ShiftedKVCache` (the decode worker's padded
  batches, on a GPU) or workers/ragged_kv.py's rows (on the CPU).
* Gemma 3 (plain rope, sliding-window layers in a RotatingKVCache) has delta 0.

The mlx-vlm model's language model shares the text model's weight arrays (no
second copy); only the vision tower and projector are the add-on's own.
Everything architecture-specific is one `_Arch` entry in `ARCHS`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from workers.batch_cache import SlotBatchKVCache
from workers.model_store import ModelError


@dataclass
class ImageBatch:
    """Preprocessed images, in prompt order. `pixel_values` is None for a
    batch made from image sizes alone (VisionEngine.sized: enough for the
    prompt's positions and embeddings when the features come from a cache)."""

    pixel_values: mx.array | None
    extra: dict[str, mx.array] = field(default_factory=dict)  # e.g. image_grid_thw
    tokens_per_image: list[int] = field(default_factory=list)
    # A video's batch (VisionEngine.preprocess_video, Qwen-VL): its frames'
    # sampling rate and, when known, each frame's seconds into the video, for
    # the prompt's timestamps; None for images.
    fps: float | None = None
    timestamps: list[float] | None = None

    @property
    def n_images(self) -> int:
        return len(self.tokens_per_image)

    @classmethod
    def join(cls, batches: Sequence[ImageBatch]) -> ImageBatch:
        """One batch of several, in order (e.g. images preprocessed, encoded
        and cached one at a time, then met again in one prompt). Every array
        is per image or per patch along its first axis."""
        if not batches:
            raise ValueError("no batches")
        # (Images and videos together: each kind's grids in their own key.)
        keys = dict.fromkeys(k for b in batches for k in b.extra)
        pixels = [b.pixel_values for b in batches if b.pixel_values is not None]
        return cls(mx.concatenate(pixels) if pixels else None,
                   {k: mx.concatenate([b.extra[k] for b in batches if k in b.extra]) for k in keys},
                   [n for b in batches for n in b.tokens_per_image])


# --------------------------------------------------------------------------
# Per-architecture adapters


class _Arch:
    """What differs between architectures. Everything else goes through
    mlx-vlm's model-agnostic interfaces (processor call, get_input_embeddings
    with cached_image_features, language_model(inputs, inputs_embeds, cache))."""

    def placeholder(self, processor) -> str:
        """What the chat template renders for one image."""
        raise NotImplementedError

    def expand(self, processor, text: str, tokens_per_image: Sequence[int]) -> str:
        """`text` with each image's placeholder expanded as the processor does."""
        raise NotImplementedError

    def image_token(self, processor) -> str:
        """The token repeated once per image feature (what features replace)."""
        return processor.image_token

    def tokens_for_size(self, processor, height: int, width: int) -> int:
        raise NotImplementedError

    def tokens_per_image(self, processor, extra: dict[str, mx.array], n_images: int) -> list[int]:
        raise NotImplementedError

    def extra_for_size(self, processor, height: int, width: int) -> dict[str, mx.array] | None:
        """One image's `extra` (what positions and the merge need) from its
        size alone, without the processor's resize and normalise (~80 ms for
        1024x1024 on a CPU); None where it cannot be known without them."""
        return None

    def encode(self, model, pixel_values: mx.array, extra: dict[str, mx.array]) -> mx.array:
        """[n_image_tokens, hidden]: what get_input_embeddings merges."""
        raise NotImplementedError

    def cached_features(self, features: mx.array, extra: dict[str, mx.array]):
        """`features` in the form get_input_embeddings takes as cached_image_features."""
        return features

    def merge_kwargs(self, extra: dict[str, mx.array]) -> dict[str, Any]:
        return {}

    # Whether a video goes in as a video (else the router sends its frames as images).
    native_video = False

    def preprocess_video(self, processor, frames: list, fps: float, timestamps=None) -> ImageBatch:
        raise ModelError("this architecture takes a video as its frames, each an image")

    def video_for_size(self, processor, n_frames: int, height: int, width: int, fps: float,
                       timestamps=None) -> ImageBatch:
        """A video's ImageBatch without pixel values: its grid and tokens
        from the frame count and size alone (what the router's prompt and a
        prefill from cached features need). ValueError for a size the
        processor refuses."""
        raise ModelError("this architecture takes a video as its frames, each an image")

    def expand_videos(self, processor, text: str, videos: Sequence[ImageBatch]) -> str:
        if videos:
            raise ModelError("this architecture takes a video as its frames, each an image")
        return text

    def feature_dim(self, model) -> int:
        """Columns of `encode`'s output (what the cache service stores per image token)."""
        return model.language_model.model.embed_tokens.weight.shape[-1]

    def split_features(self, model, features: mx.array) -> tuple[mx.array, mx.array | None]:
        """(what get_input_embeddings merges, per-token rows that ride along
        beside the input embeddings into prefill, or None)."""
        return features, None

    def prefill_inputs(self, model, input_ids: mx.array, embeddings: mx.array) -> tuple[mx.array, dict[str, Any]]:
        """(inputs_embeds, other language-model kwargs) for one chunk of
        `input_embeddings`' output."""
        return embeddings, {}

    def rope_positions(self, model, input_ids: mx.array, extra: dict[str, mx.array]) -> tuple[mx.array | None, int]:
        """(positions for the language model, or None where it derives them
        from the cache offset; rope delta)."""
        return None, 0

    def visual_prefix(self, model, token_ids: Sequence[int], extra: dict[str, mx.array]) -> tuple[bytes | None, int]:
        """(a key naming what the rope delta of text after the last image
        depends on: the tokens through the last image, and the grids; the
        index of that last image token). Key None: nothing to remember (plain
        rope has no delta; a prompt without images)."""
        return None, -1


def _times(timestamps, n_frames: int) -> list[float] | None:
    if timestamps is None:
        return None
    if len(timestamps) != n_frames:
        raise ValueError(f"{len(timestamps)} timestamps for {n_frames} video frames")
    return [float(t) for t in timestamps]


def _split_expand(text: str, marker: str, expansions: Sequence[str]) -> str:
    parts = text.split(marker)
    if len(parts) - 1 != len(expansions):
        raise ValueError(f"the prompt has {len(parts) - 1} image placeholders for {len(expansions)} images")
    out = [parts[0]]
    for exp, part in zip(expansions, parts[1:]):
        out += [exp, part]
    return "".join(out)


class _QwenVL(_Arch):
    """Qwen2.5-VL: dynamic resolution, one <|image_pad|> per merged 2x2 patch
    between <|vision_start|> and <|vision_end|>, M-RoPE positions. A video
    is frame pairs in one block of <|video_pad|>, with mlx-vlm's positions:
    one time step per pair (mlx-vlm's get_rope_index leaves out the model's
    tokens_per_second scaling; we answer as mlx-vlm does)."""

    def placeholder(self, processor) -> str:
        return processor.image_token

    def expand(self, processor, text, tokens_per_image):
        return _split_expand(text, processor.image_token, [processor.image_token * n for n in tokens_per_image])

    def tokens_for_size(self, processor, height, width):
        from mlx_vlm.utils import estimate_num_image_tokens

        return int(estimate_num_image_tokens(processor, height, width))

    def tokens_per_image(self, processor, extra, n_images):
        merge = processor.image_processor.merge_size ** 2
        return [int(np.prod(g)) // merge for g in np.array(extra["image_grid_thw"]).tolist()]

    def extra_for_size(self, processor, height, width):
        ip = processor.image_processor
        # The processor's own sizing (what num_image_tokens, and so the
        # router's placeholder count, uses); absent in other versions.
        resolve = getattr(ip, "_resolved_size", None)
        if resolve is None:
            return None
        h, w = resolve(height, width)
        return {"image_grid_thw": mx.array([[1, h // ip.patch_size, w // ip.patch_size]], dtype=mx.int64)}

    # Video (mlx-vlm's Qwen2.5-VL and Qwen3-VL processors share one numpy
    # video processor, with their own patch sizes): frames in temporal pairs,
    # one grid of t pairs, t * h * w / merge^2 video tokens.
    native_video = True

    def preprocess_video(self, processor, frames, fps, timestamps=None):
        out = processor.video_processor(videos=[list(frames)])
        grid = np.asarray(out["video_grid_thw"])
        n = int(grid[0].prod()) // processor.video_processor.merge_size ** 2
        return ImageBatch(mx.array(np.asarray(out["pixel_values_videos"])),
                          {"video_grid_thw": mx.array(grid, dtype=mx.int64)}, [n], float(fps),
                          _times(timestamps, len(frames)))

    def video_for_size(self, processor, n_frames, height, width, fps, timestamps=None):
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import _smart_resize_video

        vp = processor.video_processor
        # The sizing the video processor's _process_one does before resizing.
        h, w = _smart_resize_video(n_frames, height, width, vp.temporal_patch_size, vp.patch_size * vp.merge_size,
                                   vp.min_pixels, vp.max_pixels)
        grid = [-(-n_frames // vp.temporal_patch_size), h // vp.patch_size, w // vp.patch_size]
        return ImageBatch(None, {"video_grid_thw": mx.array([grid], dtype=mx.int64)},
                          [int(np.prod(grid)) // vp.merge_size ** 2], float(fps), _times(timestamps, n_frames))

    def video_blocks(self, video: ImageBatch) -> int:
        """Runs of video tokens `expand_videos` writes for this video."""
        return 1

    def expand_videos(self, processor, text, videos):
        """Qwen2.5-VL: one vision_start/end block of all the video's tokens
        (mlx-vlm's processor; get_rope_index steps time once per frame pair)."""
        # (Qwen2.5-VL's processor names no vision_start/end tokens; its
        # chat template writes these.)
        start = getattr(processor, "vision_start_token", "<|vision_start|>")
        end = getattr(processor, "vision_end_token", "<|vision_end|>")
        blocks = [start + processor.video_token * v.tokens_per_image[0] + end for v in videos]
        return _split_expand(text, start + processor.video_token + end, blocks)

    def visual_mask(self, model, input_ids):
        """Where get_input_embeddings puts features: image and video tokens."""
        cfg = model.config
        return (input_ids == cfg.image_token_id) | (input_ids == cfg.video_token_id)

    def encode(self, model, pixel_values, extra):
        dtype = model.vision_tower.patch_embed.proj.weight.dtype
        grid = extra["image_grid_thw"] if "image_grid_thw" in extra else extra["video_grid_thw"]
        return model.vision_tower(pixel_values.astype(dtype), grid, output_hidden_states=False)

    def merge_kwargs(self, extra):
        return {k: extra[k] for k in ("image_grid_thw", "video_grid_thw") if k in extra}

    def visual_prefix(self, model, token_ids, extra):
        cfg = model.config
        where = np.flatnonzero(np.isin(np.asarray(token_ids), (cfg.image_token_id, cfg.video_token_id)))
        if not where.size:
            return None, -1
        last = int(where[-1])
        h = hashlib.sha256(np.asarray(token_ids[: last + 1], dtype="<i8").tobytes())
        for name in ("image_grid_thw", "video_grid_thw"):
            grid = np.asarray(extra[name], dtype="<i8") if name in extra else np.zeros(0, "<i8")
            h.update(name.encode() + len(grid.tobytes()).to_bytes(8, "little") + grid.tobytes())
        return h.digest(), last

    def text_positions(self, start: int, end: int, delta: int) -> mx.array:
        """M-RoPE positions [3, 1, end - start] of text after the last image."""
        return mx.broadcast_to((mx.arange(start, end, dtype=mx.int32) + delta)[None, None], (3, 1, end - start))

    def rope_positions(self, model, input_ids, extra):
        grid, video = extra.get("image_grid_thw"), extra.get("video_grid_thw")
        if grid is None and video is None:
            # Text only: plain positions, but explicit. Without position_ids
            # the language model falls back to positions it kept from its
            # previous call (_position_ids), which belong to another prompt.
            n = input_ids.shape[1]
            return mx.broadcast_to(mx.arange(n)[None, None], (3, 1, n)), 0
        positions, delta = model.language_model.get_rope_index(input_ids, grid, video, mx.ones_like(input_ids))
        return positions, int(np.array(delta).reshape(-1)[0])


class _Qwen3VL(_QwenVL):
    """Qwen3-VL: Qwen2.5-VL's prompt format and get_rope_index (16 px
    patches; interleaved M-RoPE, which is plain RoPE once the three
    components agree, as after the last image), plus DeepStack: the outputs
    of a few vision blocks (`deepstack_visual_indexes`), each through its
    own merger, are added to the hidden states after text layers 0..k-1 at
    the image tokens.

    mlx-lm's qwen3_vl text model (mlx-lm's qwen3) cannot prefill an image
    prompt even with a wrapper feeding DeepStack: its rope takes one scalar
    position per token (the cache offset), not three. So, as for Qwen2.5-VL,
    prefill runs mlx-vlm's language model (over the text model's weights),
    which takes `visual_pos_masks` and `deepstack_visual_embeds` itself; the
    text model decodes from its cache with the rope shifted by the delta.

    The DeepStack features travel with the image's features: `encode`
    returns [tokens, (1 + k) * hidden] (the merger's output, then each
    DeepStack layer's, side by side), so the cache service stores and
    returns them like any features, and `input_embeddings` returns
    [1, n, (1 + k) * hidden]: the input embeddings, then each token's
    DeepStack additions (zero off the image tokens). Slicing that by token
    (a cached prefix, chunks) keeps them together; `prefill_inputs` splits
    each chunk back into what the language model takes."""

    def _hidden(self, model) -> int:
        return model.language_model.model.embed_tokens.weight.shape[-1]

    # Video: as Qwen2.5-VL's, but in the prompt each frame pair is
    # "<t.t seconds>" then its own vision_start/end block of video tokens
    # (get_rope_index treats each block as one frame). The timestamps and
    # block layout are mlx-vlm's processor's own helpers.
    def video_blocks(self, video):
        return int(np.asarray(video.extra["video_grid_thw"])[0][0])  # one per frame pair

    def expand_videos(self, processor, text, videos):
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import (
            _timestamped_video_placeholder,
            _video_group_timestamps,
        )

        vp = processor.video_processor
        blocks = []
        for v in videos:
            t, h, w = np.asarray(v.extra["video_grid_thw"])[0].tolist()
            # Known frame times go in as "indices" at 1 fps: the helper's own
            # pairing and padding over the real times (as with mlx-vlm's
            # VideoMetadata); else frames evenly spaced at fps.
            meta = None if v.timestamps is None else {"frames_indices": list(v.timestamps), "fps": 1.0}
            stamps = _video_group_timestamps(t, vp.temporal_patch_size, v.fps, meta)
            block = _timestamped_video_placeholder(stamps, h * w // vp.merge_size ** 2,
                                                   processor.vision_start_token, processor.vision_end_token)
            blocks.append(block.replace("<|placeholder|>", processor.video_token))
        wrapped = processor.vision_start_token + processor.video_token + processor.vision_end_token
        return _split_expand(text, wrapped, blocks)

    def _deepstack_layers(self, model) -> int:
        return len(model.config.vision_config.deepstack_visual_indexes)

    def encode(self, model, pixel_values, extra):
        dtype = model.vision_tower.patch_embed.proj.weight.dtype
        grid = extra["image_grid_thw"] if "image_grid_thw" in extra else extra["video_grid_thw"]
        features, deepstack = model.vision_tower(pixel_values.astype(dtype), grid)
        return mx.concatenate([features, *deepstack], axis=-1)

    def feature_dim(self, model):
        return self._hidden(model) * (1 + self._deepstack_layers(model))

    def split_features(self, model, features):
        hidden = self._hidden(model)
        if features.shape[-1] == hidden:
            return features, None
        return features[:, :hidden], features[:, hidden:]

    def prefill_inputs(self, model, input_ids, embeddings):
        hidden = self._hidden(model)
        if embeddings.shape[-1] == hidden:
            return embeddings, {}
        inputs, deep = embeddings[..., :hidden], embeddings[..., hidden:]
        mask = self.visual_mask(model, input_ids)
        where = np.flatnonzero(np.array(mask[0]))
        if where.size == 0:
            return inputs, {}
        rows = deep[0, mx.array(where, dtype=mx.uint32)]  # [visual tokens, k * hidden]
        k = rows.shape[-1] // hidden
        # mlx-vlm's layout: per DeepStack layer, the visual tokens' rows in order.
        layers = rows.reshape(rows.shape[0], k, hidden).transpose(1, 0, 2)
        return inputs, {"visual_pos_masks": mask, "deepstack_visual_embeds": layers}


class _Gemma3(_Arch):
    """Gemma 3: fixed-size SigLIP images, pooled to mm_tokens_per_image soft
    tokens between <start_of_image> and <end_of_image>; plain rope."""

    def placeholder(self, processor) -> str:
        return processor.boi_token

    def expand(self, processor, text, tokens_per_image):
        # Gemma3Processor's own expansion, blank lines included (they merge
        # with neighbouring text when tokenized, so this stays in text space).
        tok = processor.tokenizer
        seqs = [f"\n\n{tok.boi_token}{tok.image_token * n}{tok.eoi_token}\n\n" for n in tokens_per_image]
        return _split_expand(text, processor.boi_token, seqs)

    def image_token(self, processor):
        return processor.tokenizer.image_token

    def tokens_for_size(self, processor, height, width):
        return int(processor.image_seq_length)

    def tokens_per_image(self, processor, extra, n_images):
        return [int(processor.image_seq_length)] * n_images

    def extra_for_size(self, processor, height, width):
        return {}  # fixed-size images: nothing but the pixels

    def encode(self, model, pixel_values, extra):
        dtype = model.language_model.model.embed_tokens.weight.dtype
        hidden, _, _ = model.vision_tower(pixel_values.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
        features = model.multi_modal_projector(hidden)
        return features.reshape(-1, features.shape[-1])

    def cached_features(self, features, extra):
        return features[None]  # [1, tokens, hidden]: its merge reads the last axis, scatters in order


# Rope deltas VisionEngine remembers, by the tokens through a prompt's last image.
DELTAS_KEPT = 1024

# Keyed by mlx-vlm's model package (mlx_vlm.models.<name>, the config's model_type).
ARCHS: dict[str, _Arch] = {
    "qwen2_5_vl": _QwenVL(),
    "qwen3_vl": _Qwen3VL(),
    "gemma3": _Gemma3(),
}


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

        from workers import mlx_hooks
        from workers.loading import on_cpu

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
        if text_model is not None:  # our prefill: this backend's kernels (workers/mlx_hooks.py)
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
        from workers import mlx_hooks

        with mlx_hooks.head_at(self.model.language_model, [n - start - 1]):
            logits = run(start, n).logits[0, -1]
        mx.eval(logits, [c.state for c in cache])
        return logits


# --------------------------------------------------------------------------
# Decode after a VLM prefill


def shift_rope(cache: list, delta: int) -> list:
    """The prefilled `cache` ready for mlx-lm's text model to decode with its
    rope positions moved by `delta` (see the module doc). delta 0: the cache
    itself. Otherwise each plain KVCache becomes a batch-of-one BatchKVCache
    over the same buffers (no copy) whose rope offset is `length + delta`; other kinds
    (windows, recurrent state) cannot carry a shift and raise."""

    if not delta:
        return cache
    out = []
    for c in cache:
        if type(c) is not KVCache:
            raise TypeError(f"cannot shift the rope of a {type(c).__name__}")
        b = BatchKVCache([0])
        b.keys, b.values, b._idx = c.keys, c.values, c.offset
        b.offset = mx.array([c.offset + int(delta)])
        out.append(b)
    return out


class ShiftedKVCache(KVCache):
    """A request's plain KVCache layer plus its rope shift, which
    BatchGenerator's merge (`caches[0].merge`) adds to the merged
    BatchKVCache's per-row offsets; filter and extend then carry it along.
    Every row of a batch must be one of these (shift 0 for text), since the
    first row's class does the merge."""

    rope_shift: int = 0

    @classmethod
    def of(cls, cache: list, delta: int) -> list:
        """`cache` (per-layer KVCaches, one request) as ShiftedKVCaches over
        the same buffers; other layer kinds pass through when delta is 0
        and raise otherwise (a window or recurrent state has no offset to move)."""
        out = []
        for c in cache:
            if type(c) is not KVCache:
                if delta:
                    raise TypeError(f"cannot shift the rope of a {type(c).__name__}")
                out.append(c)
                continue
            s = cls()
            s.keys, s.values, s.offset, s.rope_shift = c.keys, c.values, c.offset, int(delta)
            out.append(s)
        return out

    @classmethod
    def merge(cls, caches):
        batch = SlotBatchKVCache.merge(caches)  # workers/batch_cache.py: joins and leaves in place
        shifts = [getattr(c, "rope_shift", 0) for c in caches]
        if any(shifts):
            batch.offset = batch.offset + mx.array(shifts)
        return batch


def shift_batch_rope(cache: list, deltas: Sequence[int]) -> list:
    """Per-row rope shifts on a running batch's caches (mlx-lm BatchKVCache
    layers, e.g. after BatchKVCache.merge), in place: row i's rope positions
    move by deltas[i]. Call it once the batch is built: merge and extract
    rebuild offsets from the lengths and drop any shift."""
    shift = mx.array([int(d) for d in deltas])
    for c in cache:
        if not isinstance(c, BatchKVCache):
            raise TypeError(f"cannot shift the rope of a {type(c).__name__}")
        c.offset = c.offset + shift
    return cache


def decode_greedy(text_model, cache: list, first_token: int, max_tokens: int) -> list[int]:
    """Greedy tokens after `first_token` with mlx-lm's generate_step over
    `cache` (already shifted with shift_rope where needed): what a decode
    worker computes for one request."""
    from mlx_lm.generate import generate_step

    tokens = []
    for token, _ in generate_step(mx.array([int(first_token)]), text_model, max_tokens=max_tokens,
                                  prompt_cache=cache):
        tokens.append(int(token))
    return tokens


# --------------------------------------------------------------------------
# Loading helpers


def _to_float32(model) -> None:
    """The CPU policy of workers.loading: quantized layers expanded, float32."""
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
