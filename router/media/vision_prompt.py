"""VLM prompts in the router: images' placeholder tokens from their sizes alone.

The router holds only the model's processor (tokenizer, chat template, image
processor settings: no weights). For a chat with images it renders the chat
template with one placeholder per image, expands each to the number of tokens
the image takes (environment/vision_layout.py's per-architecture `Layout`, the same code
the prefill worker runs), tokenizes as mlx-vlm does, and finds each image's
run of placeholder tokens: the `ImageInput`s a PrefillRequest carries.

An architecture that takes video (`native_video`: Qwen2.5-VL, Qwen3-VL)
gets a video part as one video: its grid from the frame count and size, the
prompt's blocks of video tokens (Qwen3-VL: one per frame pair, stamped
"<t.t seconds>" from its frames' times; the same `Layout` code), and one
`ImageInput` of kind "video" spanning all its blocks. Others get a video's
frames as images (router/app.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from environment.model_folder import ModelError
from protos.messages import ImageInput
from environment.vision_layout import LAYOUTS
from router.media.decode import MediaError
from router.media.video import DecodedVideo


class VisionPrompter:
    def __init__(self, model_dir: str | Path):
        from mlx_vlm.utils import get_model_and_args, load_processor  # only a VLM's router loads mlx-vlm

        config = json.loads((Path(model_dir) / "config.json").read_text())
        # Imports mlx-vlm's model package, which registers its own processors
        # (transformers' Qwen2-VL video processor would need torch).
        get_model_and_args(config)
        self.model_type = config.get("model_type")
        if self.model_type not in LAYOUTS:
            raise ModelError(f"{model_dir}: no vision add-on for {self.model_type!r}")
        self.layout = LAYOUTS[self.model_type]
        self.processor = load_processor(Path(model_dir), add_detokenizer=False)
        self.tokenizer = self.processor.tokenizer
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.layout.image_token(self.processor))
        self.video_token_id = (self.tokenizer.convert_tokens_to_ids(self.processor.video_token)
                               if self.native_video else None)
        # Placeholder text -> id, for those the tokenizer keeps whole (see _tokenize).
        tokens = {self.layout.image_token(self.processor): self.image_token_id}
        if self.native_video:
            tokens[self.processor.video_token] = self.video_token_id
        self._placeholders = {t: i for t, i in tokens.items()
                              if self.tokenizer(t * 2, add_special_tokens=False)["input_ids"] == [i, i]}
        self._placeholder_ids = set(self._placeholders.values())
        self._runs_of = (re.compile("(" + "|".join(map(re.escape, self._placeholders)) + ")\\1*")
                         if self._placeholders else None)

    @property
    def native_video(self) -> bool:
        """Whether a video goes to the model as a video (else as its frames, each an image)."""
        return self.layout.native_video

    def tokens_for(self, height: int, width: int) -> int:
        return self.layout.tokens_for_size(self.processor, int(height), int(width))

    def build(self, messages: list[dict], media: list, **template_kwargs) -> tuple[list[int], list[ImageInput]]:
        """(prompt token ids, one ImageInput per image or video, in prompt
        order) for `messages` whose content lists hold {"type": "image"} and
        {"type": "video"} parts, one per entry of `media` (router.media.decode's
        DecodedImage, or DecodedVideo where `native_video`), in order.
        Blocking (tokenizer work): run it in a thread."""
        from mlx_vlm.utils import should_add_special_tokens

        images = [m for m in media if not isinstance(m, DecodedVideo)]
        videos = [m for m in media if isinstance(m, DecodedVideo)]
        counts = [self.tokens_for(im.height, im.width) for im in images]
        grids = [self._video(v) for v in videos]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
        text = self.layout.expand_videos(self.processor, text, grids)
        text = self.layout.expand(self.processor, text, counts)
        ids = self._tokenize(text, should_add_special_tokens(self.model_type, self.processor))
        starts = _runs(ids, self.image_token_id)
        if [n for _, n in starts] != counts:
            raise ValueError(f"placeholder runs {[n for _, n in starts]} do not match the images' tokens {counts}")
        inputs = [ImageInput(im.content_hash, im.pixels, s, n) for im, (s, n) in zip(images, starts)]
        if videos:
            inputs += self._video_inputs(ids, videos, grids)
            inputs.sort(key=lambda im: im.start)
        return ids, inputs

    def _tokenize(self, text: str, add_special: bool) -> list[int]:
        """Token ids of the expanded prompt, as the tokenizer gives them. Each
        run of a placeholder (an image's or video's hundreds to thousands of
        tokens) is tokenized as one placeholder and then repeated as ids: a
        special token is split out before anything else is tokenized, so the
        ids are the same, and tokenizing the runs' text was most of a cached
        picture turn's templating (1,369 image tokens: 2.5 of 2.7 ms)."""
        runs: list[tuple[int, int]] = []  # (placeholder id, run length) in prompt order

        def one(match: re.Match) -> str:
            token = match.group(1)
            runs.append((self._placeholders[token], len(match.group(0)) // len(token)))
            return token

        short = self._runs_of.sub(one, text) if self._runs_of is not None else text
        ids = [int(t) for t in self.tokenizer(short, add_special_tokens=add_special)["input_ids"]]
        if not runs:
            return ids
        if [t for t in ids if t in self._placeholder_ids] != [t for t, _ in runs]:  # not split out: tokenize it all
            return [int(t) for t in self.tokenizer(text, add_special_tokens=add_special)["input_ids"]]
        out, lengths = [], iter(n for _, n in runs)
        for t in ids:
            out.extend([t] * next(lengths) if t in self._placeholder_ids else (t,))
        return out

    def _video(self, video):
        """The video's ImageBatch by size (its grid and tokens), or a 400 naming the part."""
        first = video.frames[0]
        try:
            return self.layout.video_for_size(self.processor, len(video.frames), first.height, first.width,
                                            video.fps, video.timestamps)
        except ValueError as exc:
            raise MediaError(video.where, f"the model cannot take this video: {exc}") from None

    def _video_inputs(self, ids: list[int], videos: list, grids: list) -> list[ImageInput]:
        """One ImageInput per video: its blocks (runs of video tokens: one per
        frame pair for Qwen3-VL, one in all for Qwen2.5-VL) from the first
        through the last, in order."""
        runs, out = _runs(ids, self.video_token_id), []
        for video, batch in zip(videos, grids):
            pairs = self.layout.video_blocks(batch)
            mine, runs = runs[:pairs], runs[pairs:]
            n = batch.tokens_per_image[0]
            if len(mine) != pairs or sum(k for _, k in mine) != n or len({k for _, k in mine}) != 1:
                raise ValueError(f"video placeholder runs {[k for _, k in mine]} do not match its {pairs} blocks "
                                 f"of {n} tokens in all")
            start, (last, k) = mine[0][0], mine[-1]
            frames = np.stack([f.pixels for f in video.frames])
            out.append(ImageInput(video.content_hash, frames, start, n, "video", float(video.fps),
                                  [float(t) for t in video.timestamps], last + k - start))
        if runs:
            raise ValueError(f"{len(runs)} video placeholder runs left over")
        return out


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in `ids`."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            out.append((i, j - i))
            i = j
        else:
            i += 1
    return out
