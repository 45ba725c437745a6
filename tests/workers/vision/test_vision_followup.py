"""A follow-up turn about a picture (issue 6): what it does not compute again.

A conversation resends its picture every turn. Once the picture's KV is in
the prefix cache, the turn's new tokens are text: the router tokenizes the
placeholder runs as one token each (router/media/vision_prompt.py), VLMPrefillJob
embeds only the text after the cached prefix and takes its M-RoPE positions
from the rope delta the engine remembers (workers/vision/engine.py), and on a CPU
mlx-vlm's language model attends to the cached picture through
workers/kernels/cpu_attention.py as the text model does. Each test counts the work
taken another way or skipped; the answers stay mlx-vlm's.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from tests.support import dispatcher
from tests.support.cache_fakes import FakeEmbeddingStore
from tests.support.decoding import decode_greedy
from tests.support.tiny_vlms import TINY_GEMMA3, TINY_QWEN3_VL, TINY_QWEN_VL, synthetic_image
from tests.support.vision import N_TOKENS, assert_same, our_prefill, ours, reference, user_turn, vlm_setup
from workers.kv.block_hash import BlockHasher
from workers.kv.prefix_base import PrefixCacheBase

QWENS = (TINY_QWEN_VL, TINY_QWEN3_VL)
ANSWER = "It is a picture of coloured squares on a grey ground."


@pytest.fixture(scope="module", params=QWENS)
def qwen(request, tmp_path_factory):
    return vlm_setup(tmp_path_factory, request.param)


@pytest.fixture(scope="module", params=QWENS + (TINY_GEMMA3,))
def any_vlm(request, tmp_path_factory):
    return vlm_setup(tmp_path_factory, request.param)


class BlockPrefix(PrefixCacheBase):
    """The block prefix cache as VLMPrefillJob uses it (fetch and store by
    image-aware block hashes), in memory: a fetch returns a copy of the
    longest stored run of blocks. The rest of the one prefix-cache
    interface is PrefixCacheBase's."""

    kind = "blocks"
    reuses_blocks = True

    def __init__(self, block_size: int = 16):
        super().__init__(None, None, BlockHasher(b"test", block_size))
        self.stored: list[tuple[list[bytes], list]] = []

    def store(self, tokens, cache, owner="", per_block=None, host=None, later=None, snapshot=None, *, salt="") -> int:
        hashes = self.hasher.hashes(tokens, per_block=per_block)
        self.stored.append((hashes, cache))
        return len(hashes)

    def fetch(self, tokens, n_blocks, owner="", per_block=None, compute_s_per_token=None, *, salt=""):
        want = self.hasher.hashes(tokens, n_blocks, per_block=per_block)
        blocks, cache = 0, None
        for hashes, stored in self.stored:
            k = next((i for i, (a, b) in enumerate(zip(want, hashes)) if a != b), min(len(want), len(hashes)))
            if k > blocks:
                blocks, cache = k, stored
        if not blocks:
            return None, 0
        hit = blocks * self.block_size
        out = []
        for c in cache:
            layer = KVCache()
            layer.keys, layer.values, layer.offset = c.keys[..., :hit, :], c.values[..., :hit, :], hit
            out.append(layer)
        return out, hit


def _decoded(pixels: np.ndarray, where: str):
    from router.media.decode import DecodedImage, image_content_hash

    return DecodedImage(pixels, pixels.shape[1], pixels.shape[0], image_content_hash(pixels), "data", where)


def _answer(s, job) -> list[int]:
    from workers.decode.shifted_rope import shift_rope

    result = job.run()
    delta = result.rope_offset - result.num_tokens
    return [result.first_token] + decode_greedy(s.text_model, shift_rope(result.cache, delta), result.first_token,
                                                N_TOKENS - 1)


def _count_calls(monkeypatch, owner, name: str) -> list:
    """Record each call's arguments of owner.name (still calling it)."""
    calls, original = [], getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


# ---------------------------------------------------------------- the job


def test_a_follow_up_turn_embeds_and_positions_only_its_text(qwen, monkeypatch):
    """Turn 2 resends turn 1's picture: with its KV cached, the job looks
    up no embedding, embeds only the tokens past the cached prefix, and
    computes no M-RoPE index over the picture (the delta is remembered from
    turn 1). The answer is mlx-vlm's for the whole conversation."""
    from protos.messages import SamplingParams
    from router.media.vision_prompt import VisionPrompter
    from workers.prefill.vlm import VLMPrefillJob

    eng, prompter = qwen.engine, VisionPrompter(qwen.folder)
    picture = synthetic_image(64, 96, 5)
    image = _decoded(np.asarray(picture), "messages[0].content[0].image_url")
    turn1 = [user_turn(None, "What is in this picture? Tell me about every colour in it, please.")]
    turn2 = turn1 + [{"role": "assistant", "content": ANSWER}, user_turn("And which shape is the largest one?")]
    prefix, store = BlockPrefix(), FakeEmbeddingStore()
    sampling = SamplingParams(max_tokens=N_TOKENS, temperature=0.0)

    ids, inputs = prompter.build(turn1, [image])
    first = VLMPrefillJob(eng, ids, inputs, sampling, prefix=prefix, embeddings=store)
    first.run()
    first.save_prefix()

    rope_index = _count_calls(monkeypatch, eng.arch, "rope_positions")
    embedded = _count_calls(monkeypatch, eng, "input_embeddings")
    ids, inputs = prompter.build(turn2, [image])
    job = VLMPrefillJob(eng, ids, inputs, sampling, prefix=prefix, embeddings=store)
    got = _answer(qwen, job)
    hit = job.result.cached_tokens
    assert hit >= inputs[0].end and len(ids) - hit < 48  # the picture is in the cached prefix
    assert (job.encoded, job.skipped, len(store.gets)) == (0, 1, 1)  # the store was asked on turn 1 only
    assert rope_index == []
    assert [len(args[0]) for args in embedded] == [len(ids) - hit]
    assert_same(got, reference(qwen, turn2, [picture]))


def test_without_the_remembered_delta_the_whole_prompt_is_positioned(qwen, monkeypatch):
    """Another process (no turn 1 seen): the positions come from the whole
    prompt, cut at the cached length, and are the same."""
    from environment.vision_layout import ImageBatch

    eng = qwen.engine
    ids, batch = _prompt(qwen, [synthetic_image(64, 96, 6)], "Tell me more about it")
    start = len(ids) - 5
    eng._deltas.clear()
    rope_index = _count_calls(monkeypatch, eng.arch, "rope_positions")
    cold, cold_delta = eng.rope_positions(ids, batch, start=start)
    warm, warm_delta = eng.rope_positions(ids, ImageBatch.join([batch]), start=start)
    assert len(rope_index) == 1
    assert cold_delta == warm_delta < 0
    assert cold.dtype == warm.dtype and np.array_equal(np.array(cold), np.array(warm))


# ---------------------------------------------------------------- the pieces


def _prompt(s, pictures, question: str, video=None):
    """(ids, the prompt's ImageBatch by size) for a user turn with pictures
    (and a video) and a question, then an answer and one more question."""
    from environment.vision_layout import ImageBatch

    eng = s.engine
    parts = [None] * len(pictures) + [question]
    messages = [user_turn(*parts)]
    if video is not None:
        messages[0]["content"].insert(len(pictures), {"type": "video"})
    messages += [{"role": "assistant", "content": ANSWER}, user_turn("And then? Say it in a few more words.")]
    batches = [eng.sized(p.height, p.width) for p in pictures] + ([video] if video is not None else [])
    ids = eng.prompt_tokens(messages, [b.tokens_per_image[0] for b in batches[: len(pictures)]],
                            videos=[video] if video is not None else ())
    return ids, ImageBatch.join(batches)


@pytest.mark.parametrize("media", ["a picture", "two pictures", "a picture and a video"])
def test_text_after_the_pictures_is_positioned_and_embedded_as_in_the_whole_prompt(any_vlm, media):
    """The tail's positions from the remembered delta, and its embeddings
    from its own tokens, equal the whole prompt's cut at the same place
    (exactly: same values, same dtype)."""
    eng = any_vlm.engine
    pictures = [synthetic_image(64, 96, 1)] + ([synthetic_image(96, 64, 2)] if media == "two pictures" else [])
    video = None
    if media.endswith("video"):
        if not eng.native_video:
            pytest.skip("this architecture takes a video as its frames")
        video = eng.sized_video(4, 64, 96, 2.0)
    ids, batch = _prompt(any_vlm, pictures, "What do you see?", video)
    features = mx.concatenate([eng.encode(eng.preprocess([p])) for p in pictures]
                              + ([eng.encode(eng.preprocess_video([np.asarray(synthetic_image(64, 96, k))
                                                                   for k in range(4)], 2.0))] if video else []))
    whole = eng.input_embeddings(ids, features, batch)
    positions, delta = eng.rope_positions(ids, batch)  # remembers the delta
    visual = [i for i, t in enumerate(ids) if t in _visual_ids(eng)]
    for start in (visual[-1] + 1, len(ids) - 7):
        tail = eng.input_embeddings(ids[start:], None)
        hidden = tail.shape[-1]
        assert np.array_equal(np.array(tail), np.array(whole[:, start:, :hidden]))
        assert not np.any(np.array(whole[:, start:, hidden:]))  # DeepStack rows: none off the picture
        got, got_delta = eng.rope_positions(ids, batch, start=start)
        assert got_delta == delta
        if positions is None:
            assert got is None
        else:
            assert got.dtype == positions.dtype
            assert np.array_equal(np.array(got), np.array(positions[..., start:]))


def _visual_ids(eng) -> set[int]:
    cfg = eng.model.config
    return {getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None),
            getattr(cfg, "image_token_index", None)} - {None}


def test_the_vlm_prefill_attends_through_cpu_attention(qwen, monkeypatch):
    """On a CPU, our prefill's attention (mlx-vlm's language model over the
    text model's cache) takes workers/kernels/cpu_attention.py's fast-exp softmax;
    mlx-vlm's own generate, over its own caches, keeps MLX's."""
    from workers.kernels import cpu_attention
    from environment.backend import on_cpu

    if not on_cpu() or os.environ.get("TANDEM_MLX_EXP"):
        pytest.skip("the CPU backend's fast-exp attention")
    pictures = [synthetic_image(64, 96, 3)]
    messages = [user_turn(None, "What is in this picture?")]
    calls = _count_calls(monkeypatch, cpu_attention, "attention")
    our_prefill(qwen, messages, pictures)
    layers = len(qwen.engine.model.language_model.model.layers)
    assert len(calls) == layers  # the prompt's one chunk, its last token with it
    want = reference(qwen, messages, pictures)
    assert len(calls) == layers
    assert_same(ours(qwen, messages, pictures), want)


def test_the_vlm_prefills_head_computes_its_last_position_only(any_vlm, monkeypatch):
    """The prompt's last token runs in its final chunk, and the language
    model's head (lm_head, or the tied embedding) runs over that one
    position (mlx_hooks.head_at); the answer stays mlx-vlm's."""
    lm = any_vlm.engine.model.language_model
    heads = []
    if "lm_head" in lm:
        head = lm["lm_head"]
        monkeypatch.setitem(lm, "lm_head", lambda x: heads.append(x.shape[1]) or head(x))
    else:
        embed = lm["model"]["embed_tokens"]
        as_linear = embed.as_linear
        monkeypatch.setattr(embed, "as_linear", lambda x: heads.append(x.shape[1]) or as_linear(x))
    pictures = [synthetic_image(64, 96, 4)]
    messages = [user_turn(None, "What is in this picture?")]
    ids, _, _, _ = our_prefill(any_vlm, messages, pictures)
    assert len(ids) > 1 and heads == [1]
    monkeypatch.undo()
    assert_same(ours(any_vlm, messages, pictures), reference(any_vlm, messages, pictures))


# ---------------------------------------------------------------- the router


@pytest.mark.parametrize("media", ["a picture", "two pictures", "a picture and a video"])
def test_the_router_tokenizes_each_placeholder_run_as_one_token(any_vlm, monkeypatch, media):
    """VisionPrompter.build's ids are those of the fully expanded prompt
    text (VisionEngine.prompt_tokens), but the tokenizer never sees a run of
    placeholders: each is one placeholder, repeated as ids afterwards."""
    from router.media.video import DecodedVideo
    from router.media.vision_prompt import VisionPrompter

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
                {"role": "assistant", "content": ANSWER}, user_turn("And then?")]
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


# ---------------------------------------------------------------- the pixels


def test_prefill_takes_a_stored_picture_by_its_size_alone(qwen):
    """A picture whose features are in the embedding store needs no pixels:
    the job places them by the picture's size (the router sends a
    channel-less array), and answers as mlx-vlm does. If they are gone, the
    job fails as a cache miss, which the router answers with the pixels."""
    from cache_service.client import CacheUnavailable
    from protos.messages import SamplingParams
    from router.media.stored_images import _sized_only
    from router.media.vision_prompt import VisionPrompter
    from workers.prefill.vlm import VLMPrefillJob

    picture = synthetic_image(64, 96, 8)
    image = _decoded(np.asarray(picture), "messages[0].content[0].image_url")
    messages = [user_turn(None, "What is in this picture?")]
    ids, inputs = VisionPrompter(qwen.folder).build(messages, [image])
    sized = [_sized_only(im) for im in inputs]
    assert sized[0].pixels.shape == (64, 96, 0) and sized[0].pixels.nbytes == 0
    sampling = SamplingParams(max_tokens=N_TOKENS, temperature=0.0)
    with pytest.raises(CacheUnavailable):
        VLMPrefillJob(qwen.engine, ids, sized, sampling, embeddings=FakeEmbeddingStore()).run()
    store = FakeEmbeddingStore()
    VLMPrefillJob(qwen.engine, ids, inputs, sampling, embeddings=store).run()  # encodes and stores
    job = VLMPrefillJob(qwen.engine, ids, sized, sampling, embeddings=store)
    got = _answer(qwen, job)
    assert (job.encoded, job.skipped) == (0, 1)
    assert_same(got, reference(qwen, messages, [picture]))


def test_the_router_sends_a_stored_picture_by_its_size_and_its_pixels_after_a_miss():
    """Through the dispatcher, with scripted workers: once a vision worker
    stored a picture, prefill gets it without pixels (the first time too);
    a 503 from prefill (its features were evicted) brings the same request
    again with the pixels, and the next turn asks the vision worker again."""
    import asyncio

    from protos import transport
    from protos.messages import (ImageInput, KVHandoff, PrefillDone, PrefillRequest, RequestFailed, VisionDone,
                                 VisionRequest)

    pixels = np.zeros((32, 48, 3), np.uint8)

    async def body(disp, worker):
        vis, pre = worker("vision-0", ["vision"]), worker("prefill-0", ["prefill", "decode"])
        await vis.beat()
        await pre.beat()
        await dispatcher.wait_for(lambda: len(disp.workers) == 2)

        def with_image(rid):
            r = dispatcher.request(rid, n=1)
            r.images = [ImageInput("h1", pixels, 0, 1)]
            return r

        async def play(rid, expect_vision, evicted):
            if expect_vision:
                assert isinstance(await vis.next(), VisionRequest)
                await transport.asend(vis.sock, VisionDone(rid, encoded=1))
            msg = await pre.next()
            assert isinstance(msg, PrefillRequest) and msg.images[0].pixels.shape == (32, 48, 0)
            if evicted:
                await transport.asend(pre.sock, RequestFailed(rid, "CacheUnavailable: features gone", 503))
                msg = await pre.next()
                assert isinstance(msg, PrefillRequest) and np.array_equal(msg.images[0].pixels, pixels)
            done = PrefillDone(rid, 7, KVHandoff(rid, 3, 3, local=True), finish_reason="length")
            await transport.asend(pre.sock, done)

        for rid, expect_vision, evicted in (("a", True, False), ("b", False, True), ("c", True, False)):
            player = asyncio.create_task(play(rid, expect_vision, evicted))
            assert [e.token async for e in disp.generate(with_image(rid))] == [7]
            await player

    dispatcher.run(body)
