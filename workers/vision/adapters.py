"""The model side of each VLM architecture: encode, merge, rope positions.

Each adapter is its architecture's `Layout` (environment/vision_layout.py: the
processor side the router shares) plus what needs the mlx-vlm model: the
vision tower and projector, the merge into the text embeddings, the language
model's positions and inputs. `VisionEngine` (workers/vision/engine.py)
drives them; everything architecture-specific is one entry in `ARCHS`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from environment.vision_layout import LAYOUTS, Gemma3Layout, Layout, Qwen3VLLayout, QwenVLLayout


class Arch(Layout):
    """What differs between architectures on the model side. Everything
    else goes through mlx-vlm's model-agnostic interfaces
    (get_input_embeddings with cached_image_features,
    language_model(inputs, inputs_embeds, cache))."""

    def encode(self, model, pixel_values: mx.array, extra: dict[str, mx.array]) -> mx.array:
        """[n_image_tokens, hidden]: what get_input_embeddings merges."""
        raise NotImplementedError

    def cached_features(self, features: mx.array, extra: dict[str, mx.array]):
        """`features` in the form get_input_embeddings takes as cached_image_features."""
        return features

    def merge_kwargs(self, extra: dict[str, mx.array]) -> dict[str, Any]:
        return {}

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


class QwenVL(QwenVLLayout, Arch):
    """Qwen2.5-VL: M-RoPE positions. A video's positions are mlx-vlm's: one
    time step per frame pair (mlx-vlm's get_rope_index leaves out the
    model's tokens_per_second scaling; we answer as mlx-vlm does)."""

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


class Qwen3VL(Qwen3VLLayout, QwenVL):
    """Qwen3-VL: Qwen2.5-VL's get_rope_index (interleaved M-RoPE, which is
    plain RoPE once the three components agree, as after the last image),
    plus DeepStack: the outputs of a few vision blocks
    (`deepstack_visual_indexes`), each through its own merger, are added to
    the hidden states after text layers 0..k-1 at the image tokens.

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


class Gemma3(Gemma3Layout, Arch):
    """Gemma 3: SigLIP tower and projector; plain rope."""

    def encode(self, model, pixel_values, extra):
        dtype = model.language_model.model.embed_tokens.weight.dtype
        hidden, _, _ = model.vision_tower(pixel_values.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
        features = model.multi_modal_projector(hidden)
        return features.reshape(-1, features.shape[-1])

    def cached_features(self, features, extra):
        return features[None]  # [1, tokens, hidden]: its merge reads the last axis, scatters in order


# Keyed as environment/vision_layout.py's LAYOUTS: each architecture's model side over its layout.
ARCHS: dict[str, Arch] = {
    "qwen2_5_vl": QwenVL(),
    "qwen3_vl": Qwen3VL(),
    "gemma3": Gemma3(),
}
assert ARCHS.keys() == LAYOUTS.keys(), "an architecture without both its layout and its adapter"
