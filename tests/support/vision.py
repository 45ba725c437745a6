"""Our vision path on a tiny random VLM, and mlx-vlm's to compare it with.

`vlm_setup` loads a tiny VLM (tests/support/tiny_vlms.py) once per session
three ways: our VisionEngine (prefill on the text model's weights), mlx-lm's
text model (decode) and mlx-vlm's own model (the reference). `ours` is our
greedy answer (prefill, then decode with the rope shifted by the prompt's
delta), `reference` mlx-vlm's stream_generate for the same folder, pictures
and prompt; `assert_same` compares them and refuses a reference too short or
degenerate to fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from tests.support.decoding import decode_greedy
from tests.support.tiny_vlms import tiny_vlm
from workers.decode.shifted_rope import shift_rope

N_TOKENS = 16


@dataclass
class Setup:
    like: str
    folder: object
    engine: object  # workers.vision.engine.VisionEngine (prefill on shared text weights)
    text_model: object  # mlx-lm's model of the same folder (decode)
    vlm: object  # mlx_vlm.load: the reference
    vlm_processor: object


_setups: dict = {}


def vlm_setup(tmp_path_factory, like: str) -> Setup:
    """The session's Setup for the tiny VLM `like`, loaded on first use."""
    if like not in _setups:
        from mlx_vlm import load as vlm_load

        from workers.models.loading import load_model
        from workers.vision.engine import VisionEngine

        folder = tiny_vlm(tmp_path_factory, like)
        text_model, _ = load_model(folder)
        engine = VisionEngine(folder, text_model)
        vlm, processor = vlm_load(str(folder))
        _setups[like] = Setup(like, folder, engine, text_model, vlm, processor)
    return _setups[like]


def user_turn(*parts):
    """A user message in the chat template's form: None is a picture, a string a text part."""
    content = []
    for p in parts:
        content.append({"type": "image"} if p is None else {"type": "text", "text": p})
    return {"role": "user", "content": content}


def our_prefill(s: Setup, messages, images):
    """Our prefill: (token ids, first token, cache, rope delta)."""
    eng = s.engine
    if images:
        batch = eng.preprocess(images)
        ids = eng.prompt_tokens(messages, batch.tokens_per_image)
        features = eng.encode(batch)
    else:
        batch, features = None, None
        ids = eng.prompt_tokens(messages, [])
    embeddings = eng.input_embeddings(ids, features, batch)
    positions, delta = eng.rope_positions(ids, batch)
    cache = eng.make_cache()
    logits = eng.prefill(ids, embeddings, positions, cache)
    return ids, int(mx.argmax(logits).item()), cache, delta


def ours(s: Setup, messages, images, n: int = N_TOKENS, shift: bool = True):
    _, first, cache, delta = our_prefill(s, messages, images)
    return [first] + decode_greedy(s.text_model, shift_rope(cache, delta if shift else 0), first, n - 1)


def reference(s: Setup, messages, images, n: int = N_TOKENS):
    """mlx-vlm's greedy tokens (it stops early at an EOS)."""
    from mlx_vlm.generate.dispatch import stream_generate

    last = None
    for last in stream_generate(s.vlm, s.vlm_processor, s.engine.prompt_text(messages), image=list(images),
                                max_tokens=n, temperature=0.0):
        pass
    return list(last.token_ids)


def assert_same(got, want):
    assert len(want) >= 8, f"mlx-vlm stopped after {len(want)} tokens: pick another prompt"
    assert len(set(want)) >= 2, f"degenerate reference {want}: the comparison could not fail"
    assert got[: len(want)] == want
