"""A follow-up turn about a picture (issue 6): what it does not compute again.

A conversation resends its picture every turn. Once the picture's KV is in
the prefix cache, the turn's new tokens are text: the router tokenizes the
placeholder runs as one token each (router/vision_prompt.py), and on a CPU
mlx-vlm's language model attends to the cached picture through
workers/cpu_attention.py as the text model does. Each test counts the work
taken another way or skipped; the answers stay mlx-vlm's.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.test_vision_engine import _setup, _user, assert_same, reference
from tests.tiny_vlms import TINY_GEMMA3, TINY_QWEN3_VL, TINY_QWEN_VL, synthetic_image

QWENS = (TINY_QWEN_VL, TINY_QWEN3_VL)
ANSWER = "It is a picture of coloured squares on a grey ground."


@pytest.fixture(scope="module", params=QWENS)
def qwen(request, tmp_path_factory):
    return _setup(tmp_path_factory, request.param)


@pytest.fixture(scope="module", params=QWENS + (TINY_GEMMA3,))
def any_vlm(request, tmp_path_factory):
    return _setup(tmp_path_factory, request.param)


def _decoded(pixels: np.ndarray, where: str):
    from router.media import DecodedImage, image_content_hash

    return DecodedImage(pixels, pixels.shape[1], pixels.shape[0], image_content_hash(pixels), "data", where)


def _count_calls(monkeypatch, owner, name: str) -> list:
    """Record each call's arguments of owner.name (still calling it)."""
    calls, original = [], getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def test_the_vlm_prefill_attends_through_cpu_attention(qwen, monkeypatch):
    """On a CPU, our prefill's attention (mlx-vlm's language model over the
    text model's cache) takes workers/cpu_attention.py's fast-exp softmax;
    mlx-vlm's own generate, over its own caches, keeps MLX's."""
    from workers import cpu_attention
    from workers.loading import on_cpu

    from tests.test_vision_engine import _prefill, ours

    if not on_cpu() or os.environ.get("TANDEM_MLX_EXP"):
        pytest.skip("the CPU backend's fast-exp attention")
    pictures = [synthetic_image(64, 96, 3)]
    messages = [_user(None, "What is in this picture?")]
    calls = _count_calls(monkeypatch, cpu_attention, "attention")
    _prefill(qwen, messages, pictures)
    layers = len(qwen.engine.model.language_model.model.layers)
    assert len(calls) == 2 * layers  # the prompt's chunk, then its last token
    want = reference(qwen, messages, pictures)
    assert len(calls) == 2 * layers
    assert_same(ours(qwen, messages, pictures), want)


# ---------------------------------------------------------------- the router


@pytest.mark.parametrize("media", ["a picture", "two pictures", "a picture and a video"])
def test_the_router_tokenizes_each_placeholder_run_as_one_token(any_vlm, monkeypatch, media):
    """VisionPrompter.build's ids are those of the fully expanded prompt
    text (VisionEngine.prompt_tokens), but the tokenizer never sees a run of
    placeholders: each is one placeholder, repeated as ids afterwards."""
    from router.media import DecodedVideo
    from router.vision_prompt import VisionPrompter

    eng = any_vlm.engine
    prompter = VisionPrompter(any_vlm.folder)
    pictures = [np.asarray(synthetic_image(64, 96, 1))] + ([np.asarray(synthetic_image(96, 64, 2))]
                                                           if media == "two pictures" else [])
    media_in = [_decoded(p, f"messages[0].content[{i}].image_url") for i, p in enumerate(pictures)]
    parts = [{"type": "image"} for _ in pictures]
    videos = []
    if media.endswith("video"):
        if not eng.native_video:
            pytest.skip("this architecture takes a video as its frames")
        frames = [_decoded(np.asarray(synthetic_image(64, 96, k)), f"f{k}") for k in range(4)]
        media_in.append(DecodedVideo(frames, [0.0, 0.5, 1.0, 1.5], 2.0, "ab" * 32, "data", "v"))
        parts.append({"type": "video"})
        videos = [eng.sized_video(4, 64, 96, 2.0, [0.0, 0.5, 1.0, 1.5])]
    messages = [{"role": "user", "content": parts + [{"type": "text", "text": "What do you see?"}]},
                {"role": "assistant", "content": ANSWER}, _user("And then?")]
    want = eng.prompt_tokens(messages, [eng.image_tokens([p.shape[:2]])[0] for p in pictures], videos=videos)

    texts = []
    tokenizer = prompter.tokenizer
    original = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, text, **kw: texts.append(text) or original(
        self, text, **kw))
    ids, inputs = prompter.build(messages, media_in)
    assert ids == want
    assert len(inputs) == len(media_in)
    placeholders = list(prompter._placeholders)
    assert placeholders  # every tiny architecture's placeholders are special tokens
    assert len(texts) == 1 and not any(p * 2 in texts[0] for p in placeholders)
