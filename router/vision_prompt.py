"""VLM prompts in the router: images' placeholder tokens from their sizes alone.

The router holds only the model's processor (tokenizer, chat template, image
processor settings: no weights). For a chat with images it renders the chat
template with one placeholder per image, expands each to the number of tokens
the image takes (workers/vision.py's per-architecture `_Arch`, the same code
the prefill worker runs), tokenizes as mlx-vlm does, and finds each image's
run of placeholder tokens: the `ImageInput`s a PrefillRequest carries.
"""

from __future__ import annotations

import json
from pathlib import Path

from protos.messages import ImageInput
from workers.model_store import is_vlm  # noqa: F401 - re-exported for the router


class VisionPrompter:
    def __init__(self, model_dir: str | Path):
        from mlx_vlm.utils import get_model_and_args, load_processor

        from workers.model_store import ModelError
        from workers.vision import ARCHS

        config = json.loads((Path(model_dir) / "config.json").read_text())
        # Imports mlx-vlm's model package, which registers its own processors
        # (transformers' Qwen2-VL video processor would need torch).
        get_model_and_args(config)
        self.model_type = config.get("model_type")
        if self.model_type not in ARCHS:
            raise ModelError(f"{model_dir}: no vision add-on for {self.model_type!r}")
        self.arch = ARCHS[self.model_type]
        self.processor = load_processor(Path(model_dir), add_detokenizer=False)
        self.tokenizer = self.processor.tokenizer
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.arch.image_token(self.processor))

    def tokens_for(self, height: int, width: int) -> int:
        return self.arch.tokens_for_size(self.processor, int(height), int(width))

    def build(self, messages: list[dict], images: list) -> tuple[list[int], list[ImageInput]]:
        """(prompt token ids, one ImageInput per image) for `messages` whose
        content lists hold {"type": "image"} parts, one per entry of `images`
        (router.media.DecodedImage), in order. Blocking (tokenizer work): run
        it in a thread."""
        from mlx_vlm.utils import should_add_special_tokens

        counts = [self.tokens_for(im.height, im.width) for im in images]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text = self.arch.expand(self.processor, text, counts)
        add_special = should_add_special_tokens(self.model_type, self.processor)
        ids = [int(t) for t in self.tokenizer(text, add_special_tokens=add_special)["input_ids"]]
        starts = _runs(ids, self.image_token_id)
        if [n for _, n in starts] != counts:
            raise ValueError(f"placeholder runs {[n for _, n in starts]} do not match the images' tokens {counts}")
        return ids, [ImageInput(im.content_hash, im.pixels, s, n) for im, (s, n) in zip(images, starts)]


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
