"""Where a VLM prompt's images and videos sit: the layout behind `ImageInput.start/n_tokens`.

The router builds a VLM prompt (router/media/vision_prompt.py) and the prefill
worker runs it (workers/vision/): both must agree, token for token, on what
the chat template renders for an image, how many placeholder tokens an image
or a video of a given size takes, and how the prompt text expands. That is
this module: the processor side of each architecture (the model's processor
alone, no weights). workers/vision/adapters.py subclasses each `Layout` with
the model side (encode, merge, rope positions).

Everything architecture-specific is one `Layout` in `LAYOUTS`, keyed by
mlx-vlm's model package (the config's model_type).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from environment.model_folder import ModelError


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


class Layout:
    """The processor side of an architecture: placeholders, token counts and
    prompt expansion. Everything else goes through mlx-vlm's model-agnostic
    interfaces (processor call, get_input_embeddings with
    cached_image_features, language_model(inputs, inputs_embeds, cache))."""

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

    def video_blocks(self, video: ImageBatch) -> int:
        """Runs of video tokens `expand_videos` writes for this video."""
        raise ModelError("this architecture takes a video as its frames, each an image")

    def expand_videos(self, processor, text: str, videos: Sequence[ImageBatch]) -> str:
        if videos:
            raise ModelError("this architecture takes a video as its frames, each an image")
        return text


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


class QwenVLLayout(Layout):
    """Qwen2.5-VL: dynamic resolution, one <|image_pad|> per merged 2x2 patch
    between <|vision_start|> and <|vision_end|>. A video is frame pairs in
    one block of <|video_pad|>."""

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


class Qwen3VLLayout(QwenVLLayout):
    """Qwen3-VL: Qwen2.5-VL's prompt format with 16 px patches.

    Video: as Qwen2.5-VL's, but in the prompt each frame pair is
    "<t.t seconds>" then its own vision_start/end block of video tokens
    (get_rope_index treats each block as one frame). The timestamps and
    block layout are mlx-vlm's processor's own helpers."""

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


class Gemma3Layout(Layout):
    """Gemma 3: fixed-size SigLIP images, pooled to mm_tokens_per_image soft
    tokens between <start_of_image> and <end_of_image>."""

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


# Keyed by mlx-vlm's model package (mlx_vlm.models.<name>, the config's model_type).
LAYOUTS: dict[str, Layout] = {
    "qwen2_5_vl": QwenVLLayout(),
    "qwen3_vl": Qwen3VLLayout(),
    "gemma3": Gemma3Layout(),
}
