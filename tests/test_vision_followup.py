"""A follow-up turn about a picture (issue 6): what it does not compute again.

A conversation resends its picture every turn. Once the picture's KV is in
the prefix cache, the turn's new tokens are text: on a CPU mlx-vlm's
language model attends to the cached picture through
workers/cpu_attention.py as the text model does. Each test counts the work
taken another way or skipped; the answers stay mlx-vlm's.
"""

from __future__ import annotations

import os

import pytest

from tests.test_vision_engine import _setup, _user, assert_same, reference
from tests.tiny_vlms import TINY_QWEN3_VL, TINY_QWEN_VL, synthetic_image

QWENS = (TINY_QWEN_VL, TINY_QWEN3_VL)


@pytest.fixture(scope="module", params=QWENS)
def qwen(request, tmp_path_factory):
    return _setup(tmp_path_factory, request.param)


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
