"""Qwen3-VL (workers/vision/adapters.py `Qwen3VL`) against mlx-vlm's own generate.

A tiny random Qwen3-VL (benchmarks/random_models/vlm.py "tiny-qwen3-vl": interleaved
M-RoPE, DeepStack from two vision blocks into two of three text layers):
prefill through mlx-vlm's language model with the DeepStack rows carried
beside the input embeddings, decode on mlx-lm's qwen3_vl text model with the
rope shifted by the prompt's delta; greedy tokens identical to mlx-vlm's
stream_generate for the same folder, picture and prompt.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.support.cache_fakes import FakeEmbeddingStore
from tests.support.decoding import decode_greedy
from tests.support.media import make_video
from tests.support.server import TandemServer
from tests.support.tiny_vlms import TINY_QWEN3_VL, synthetic_image, tiny_vlm
from tests.support.vision import N_TOKENS, assert_same, our_prefill, ours, reference, user_turn, vlm_setup
from tests.support.vision_chat import (ask, client_for, counters, data_url, image_part, refused, template_form,
                                       text_part)
from tests.support.vision_chat import reference as text_reference


@pytest.fixture(scope="module")
def q3(tmp_path_factory):
    return vlm_setup(tmp_path_factory, TINY_QWEN3_VL)


ONE = ([synthetic_image(64, 96, 1)], [user_turn(None, "What is in this picture?")])
TWO = ([synthetic_image(64, 96, 1), synthetic_image(128, 64, 2)], [user_turn("Compare", None, "with", None, "please.")])


def _merged(batch):
    return [(h // 2, w // 2) for _, h, w in np.array(batch.extra["image_grid_thw"]).tolist()]


# ---------------------------------------------------------------- identity


def test_prompt_tokens_match_mlx_vlm(q3):
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    images, messages = TWO
    eng = q3.engine
    sizes = [(im.height, im.width) for im in images]
    ids = eng.prompt_tokens(messages, eng.image_tokens(sizes))
    inputs = prepare_inputs(q3.vlm_processor, images=images, prompts=eng.prompt_text(messages),
                            add_special_tokens=should_add_special_tokens(eng.model_type, q3.vlm_processor))
    assert ids == inputs["input_ids"][0].tolist()
    assert eng.image_tokens(sizes) == [6, 8] == eng.preprocess(images).tokens_per_image  # 16 px patches, 2x2 merged
    assert ids.count(eng.model.config.image_token_id) == 14


@pytest.mark.parametrize("case", ["one image", "two images", "mid-conversation"])
def test_greedy_matches_mlx_vlm_generate(q3, case):
    images, messages = {"one image": ONE, "two images": TWO}.get(case, (None, None))
    if case == "mid-conversation":
        images = [synthetic_image(96, 96, 3)]
        messages = [user_turn("Hello there, can you look at pictures?"),
                    {"role": "assistant", "content": "Yes, send me one and I will describe it."},
                    user_turn("Here it is:", None, "What colours do you see?")]
    assert_same(ours(q3, messages, images), reference(q3, messages, images))


def test_text_only_prompt_matches_mlx_lm(q3):
    from mlx_lm.generate import generate_step

    messages = [user_turn("Tell me a story about a cat.")]
    ids = q3.engine.prompt_tokens(messages, [])
    want = [int(t) for t, _ in generate_step(mx.array(ids), q3.text_model, max_tokens=N_TOKENS)]
    assert len(set(want)) >= 2
    assert ours(q3, messages, []) == want


def test_language_weights_are_the_text_models(q3):
    from mlx.utils import tree_flatten

    text = {id(a) for _, a in tree_flatten(q3.text_model.parameters())}
    lm = tree_flatten(q3.engine.model.language_model.parameters())
    assert q3.engine.shared_params == len(lm)
    assert all(id(a) in text for _, a in lm)


# ---------------------------------------------------------------- video


def _video_reference(q3, messages, images, frames, fps, n=N_TOKENS):
    from mlx_vlm.generate.dispatch import stream_generate

    last = None
    for last in stream_generate(q3.vlm, q3.vlm_processor, q3.engine.prompt_text(messages), image=images or None,
                                video=[frames], fps=fps, max_tokens=n, temperature=0.0):
        pass
    return list(last.token_ids)


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image then video"])
def test_video_matches_mlx_vlm_generate(q3, with_image):
    """Qwen3-VL's own video path: frames in temporal pairs, each pair a
    "<t.t seconds>" block of video tokens; the prompt is mlx-vlm's token for
    token, the greedy answer too. (Through the server: see
    test_a_video_part_through_the_router_prompt_and_prefill and
    test_served_end_to_end.)"""
    from environment.vision_layout import ImageBatch
    from workers.decode.shifted_rope import shift_rope

    eng = q3.engine
    frames = [synthetic_image(64, 96, s) for s in range(4)]
    images = [synthetic_image(96, 64, 9)] if with_image else []
    parts = ([{"type": "image"}] if with_image else []) + [{"type": "video"},
                                                          {"type": "text", "text": "What happens in this clip?"}]
    messages = [{"role": "user", "content": parts}]
    video = eng.preprocess_video(frames, fps=2.0)
    assert np.array(video.extra["video_grid_thw"]).tolist() == [[2, 4, 6]] and video.tokens_per_image == [12]
    batches = [eng.preprocess(images)] if with_image else []
    ids = eng.prompt_tokens(messages, [n for b in batches for n in b.tokens_per_image], videos=[video])
    text = eng.tokenizer.decode(ids)
    assert "<0.2 seconds><|vision_start|>" in text and "<1.2 seconds><|vision_start|>" in text
    batch = ImageBatch.join(batches + [video])  # prompt order: the image, then the video
    features = mx.concatenate([eng.encode(b) for b in batches + [video]])
    positions, delta = eng.rope_positions(ids, batch)
    assert delta == (-3 if with_image else 0) + 2 * (3 - 6)  # each frame pair: 2x3 merged patches
    cache = eng.make_cache()
    first = int(mx.argmax(eng.prefill(ids, eng.input_embeddings(ids, features, batch), positions, cache)).item())
    got = [first] + decode_greedy(q3.text_model, shift_rope(cache, delta), first, N_TOKENS - 1)
    assert_same(got, _video_reference(q3, messages, images, frames, 2.0))


def test_a_video_part_through_the_router_prompt_and_prefill(q3, tmp_path):
    """The server's path for a video, short of processes: router/media/decode.py
    samples it (4 frames spread over 2.5 s: at 0, 0.6, 1.2 and 1.8 s, not
    k / 1.6 fps), router/media/vision_prompt.py builds the prompt (an image, then
    the video: its grid from its size, its blocks' times from its frames'),
    VLMPrefillJob encodes it, then takes it from the embedding store by size:
    the prompt and the greedy answer are mlx-vlm's for those frames with
    their VideoMetadata."""
    from mlx_vlm.generate.dispatch import stream_generate
    from mlx_vlm.utils import VideoMetadata, prepare_inputs, should_add_special_tokens

    from protos.messages import SamplingParams
    from router.media.decode import DecodedImage, MediaLimits, image_content_hash
    from router.media.video import decode_video_bytes
    from router.media.vision_prompt import VisionPrompter
    from workers.prefill.vlm import VLMPrefillJob
    from workers.decode.shifted_rope import shift_rope

    eng = q3.engine
    where = "messages[0].content[1].video_url"
    video = decode_video_bytes(make_video(tmp_path / "clip.mp4", frames=25, size=(96, 64)), MediaLimits(), where,
                               fps=2.0, max_frames=4)
    assert video.timestamps == pytest.approx([0.0, 0.6, 1.2, 1.8]) and video.fps == pytest.approx(1.6)
    picture = synthetic_image(64, 96, 9)
    pixels = np.asarray(picture)
    image = DecodedImage(pixels, 96, 64, image_content_hash(pixels), "data", "messages[0].content[0].image_url")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                             {"type": "text", "text": "What happens in this clip?"}]}]
    ids, inputs = VisionPrompter(q3.folder).build(messages, [image, video])

    frames = [f.pixels for f in video.frames]
    meta = [VideoMetadata(total_num_frames=25, fps=10.0, frames_indices=[round(t * 10) for t in video.timestamps])]
    prompt = eng.prompt_text(messages)
    want_ids = prepare_inputs(q3.vlm_processor, images=[picture], videos=[frames], video_metadata=meta, prompts=prompt,
                              add_special_tokens=should_add_special_tokens(eng.model_type, q3.vlm_processor))
    assert ids == want_ids["input_ids"][0].tolist()
    text = eng.tokenizer.decode(ids)
    assert "<0.3 seconds><|vision_start|>" in text and "<1.5 seconds><|vision_start|>" in text
    assert [(im.kind, im.content_hash) for im in inputs] == [("image", image.content_hash),
                                                             ("video", video.content_hash)]
    clip = inputs[1]
    video_id = eng.model.config.video_token_id
    where_video = [i for i, t in enumerate(ids) if t == video_id]
    assert clip.n_tokens == len(where_video) == 12 and clip.span > clip.n_tokens  # 2 blocks of 2x3 merged patches
    assert (clip.start, clip.end) == (where_video[0], where_video[-1] + 1)
    assert clip.pixels.shape == (4, 64, 96, 3) and clip.timestamps == video.timestamps

    last = None
    for last in stream_generate(q3.vlm, q3.vlm_processor, prompt, image=[picture], video=[frames], video_metadata=meta,
                                max_tokens=N_TOKENS, temperature=0.0):
        pass
    want = list(last.token_ids)
    store = FakeEmbeddingStore()
    for run in ("encoded", "from the store"):
        job = VLMPrefillJob(eng, ids, inputs, SamplingParams(max_tokens=N_TOKENS, temperature=0.0), embeddings=store)
        result = job.run()
        assert (job.encoded, job.skipped) == ((2, 0) if run == "encoded" else (0, 2))
        got = [result.first_token] + decode_greedy(
            q3.text_model, shift_rope(result.cache, result.rope_offset - result.num_tokens),
            result.first_token, N_TOKENS - 1)
        assert_same(got, want)


# ---------------------------------------------------------------- DeepStack


def test_deepstack_rows_travel_with_the_features(q3):
    """encode: [tokens, (1 + k) * hidden], the merger's output then each
    DeepStack merger's; input_embeddings carries them beside each image
    token's embedding (zero elsewhere)."""
    eng = q3.engine
    images, messages = ONE
    batch = eng.preprocess(images)
    features = eng.encode(batch)
    hidden = eng.model.language_model.model.embed_tokens.weight.shape[1]
    k = len(eng.model.config.vision_config.deepstack_visual_indexes)
    assert k == 2 and eng.feature_dim == (1 + k) * hidden == features.shape[1]
    main, deep = eng.model.vision_tower(batch.pixel_values, batch.extra["image_grid_thw"])
    assert mx.array_equal(features, mx.concatenate([main, *deep], axis=-1)).item()
    ids = eng.prompt_tokens(messages, batch.tokens_per_image)
    embeds = eng.input_embeddings(ids, features, batch)
    assert embeds.shape == (1, len(ids), eng.feature_dim)
    image = np.array(ids) == eng.model.config.image_token_id
    assert mx.array_equal(embeds[0, mx.array(np.flatnonzero(image)), hidden:], features[:, hidden:]).item()
    assert not mx.any(embeds[0, mx.array(np.flatnonzero(~image)), hidden:]).item()


def test_without_deepstack_the_answer_diverges(q3):
    """DeepStack matters in the tiny model, so the identity tests could fail
    if it were dropped (mlx-vlm's own cached-features path drops it)."""
    eng = q3.engine
    images, messages = ONE
    batch = eng.preprocess(images)
    hidden = eng.model.language_model.model.embed_tokens.weight.shape[1]
    features = eng.encode(batch)[:, :hidden]  # the merger's output alone
    ids = eng.prompt_tokens(messages, batch.tokens_per_image)
    logits = eng.prefill(ids, eng.input_embeddings(ids, features, batch), eng.rope_positions(ids, batch)[0],
                         eng.make_cache())
    _, first, _, _ = our_prefill(q3, messages, images)
    full = eng.prefill(ids, eng.input_embeddings(ids, eng.encode(batch), batch), eng.rope_positions(ids, batch)[0],
                       eng.make_cache())
    assert not mx.allclose(logits, full, atol=1e-3).item()
    assert int(mx.argmax(full).item()) == first == reference(q3, messages, images)[0]


# ---------------------------------------------------------------- rope offset


def _job(q3, images, messages, store=None):
    from protos.messages import ImageInput, SamplingParams
    from router.media.vision_prompt import _runs
    from workers.prefill.vlm import VLMPrefillJob

    eng = q3.engine
    ids = eng.prompt_tokens(messages, eng.image_tokens([(im.height, im.width) for im in images]))
    runs = _runs(ids, eng.model.config.image_token_id)
    inputs = [ImageInput(f"img{i}", np.asarray(im), s, n) for i, (im, (s, n)) in enumerate(zip(images, runs))]
    job = VLMPrefillJob(eng, ids, inputs, SamplingParams(max_tokens=N_TOKENS, temperature=0.0), embeddings=store)
    return ids, job.run(), job


def test_rope_offset_for_decode_after_an_image_prompt(q3):
    """The handoff's rope_offset = n + delta, delta = sum over images of
    max(h, w) - h * w merged patches (negative); decode from that offset is
    mlx-vlm's answer, from n it is not. The second run takes the features
    from the embedding store ((1 + k) * hidden columns), by size alone."""
    from workers.decode.shifted_rope import shift_rope

    images, messages = TWO
    want = reference(q3, messages, images)
    store = FakeEmbeddingStore()
    for run in ("encoded", "from the store"):
        ids, result, job = _job(q3, images, messages, store)
        merged = _merged(q3.engine.preprocess(images))
        delta = sum(max(h, w) - h * w for h, w in merged)
        assert delta == (3 - 6) + (4 - 8)
        assert result.num_tokens == len(ids) and result.rope_offset == len(ids) + delta
        assert (job.encoded, job.skipped) == ((2, 0) if run == "encoded" else (0, 2))
        got = [result.first_token] + decode_greedy(
            q3.text_model, shift_rope(result.cache, result.rope_offset - result.num_tokens),
            result.first_token, N_TOKENS - 1)
        assert_same(got, want)
    assert set(store.gets) == {q3.engine.feature_dim}
    _, result, _ = _job(q3, images, messages)
    unshifted = [result.first_token] + decode_greedy(q3.text_model, result.cache, result.first_token, N_TOKENS - 1)
    assert unshifted[: len(want)] != want


def test_positions_after_the_last_image_are_plain(q3):
    """Interleaved M-RoPE with three equal components is plain RoPE: after the
    last image every component is index + delta, what the text model's
    shifted rope computes."""
    eng = q3.engine
    images, messages = TWO
    batch = eng.preprocess(images)
    ids = eng.prompt_tokens(messages, batch.tokens_per_image)
    positions, delta = eng.rope_positions(ids, batch)
    assert positions.shape == (3, 1, len(ids))
    last_image = max(i for i, t in enumerate(ids) if t == eng.model.config.image_token_id)
    tail = np.array(positions[:, 0, last_image + 2:])  # past <|vision_end|>
    assert (tail == (np.arange(last_image + 2, len(ids)) + delta)[None]).all()


@pytest.mark.parametrize("ragged", [False, True], ids=["padded batch (GPU)", "ragged rows (CPU)"])
def test_decode_engine_carries_the_rope_offset(q3, ragged):
    """The decode worker's engine, given the handoff's rope offset: two
    image requests with different deltas and a text one, batched."""
    from protos.messages import DecodeRequest, KVHandoff, SamplingParams
    from workers.decode.engine import DecodeEngine

    requests = [ONE, ([], [user_turn("Tell me a story about a river.")]), TWO]
    engine = DecodeEngine(q3.text_model, max_batch=4, ragged=ragged)
    got, wants, deltas = {}, {}, []
    for i, (images, messages) in enumerate(requests):
        ids, first, cache, delta = our_prefill(q3, messages, images)
        deltas.append(delta)
        rid = f"r{i}"
        wants[rid], got[rid] = reference(q3, messages, images), [first]
        engine.add(DecodeRequest(rid, ids, first, KVHandoff(rid, len(ids), len(ids) + delta),
                                 SamplingParams(max_tokens=N_TOKENS, temperature=0.0)), cache)
    assert len(set(deltas)) == 3
    while engine.has_work:
        for u in engine.step():
            got[u.request_id].append(u.token)
    for rid in got:
        assert_same(got[rid], wants[rid])


# ---------------------------------------------------------------- shapes


def test_qwen3_vl_2b_shape_has_the_published_parameter_count():
    """The real shape builds (lazily: nothing is allocated) with the count
    the table records, the vocabulary padded to the borrowed tokenizer."""
    import copy

    from benchmarks.random_models.vlm import SHAPES, build_model, count_parameters

    config = copy.deepcopy(SHAPES["qwen3-vl-2b"])
    for key in ("init", "image", "video", "dtype", "params"):
        config.pop(key)
    config.update(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)
    assert count_parameters(build_model(config), config) == SHAPES["qwen3-vl-2b"]["params"]


# ---------------------------------------------------------------- end to end


def test_served_end_to_end(request, tmp_path_factory):
    """`tandem serve --colocate` (one worker process: prefill, decode and
    vision; the cache service stores the embeddings as in the split layout)
    with the openai client: the answer equals mlx-vlm's; a follow-up turn reuses the
    prompt's KV and the stored embedding (DeepStack rows included) without
    running the encoder; a video_url part goes in as a video (frame pairs,
    "<t.t seconds>" blocks from its frames' times) and its answer equals
    mlx-vlm's for those frames with their VideoMetadata; a second turn about
    it skips the encoder and reuses the prompt's KV; the picture and the clip
    in one message are answered as mlx-vlm answers them. Colocated: two
    processes fewer to start; an M-RoPE prompt's KV and rope offset handed
    from a prefill process to a decode process is tests/e2e/test_e2e_vision.py's
    (a split Qwen2.5-VL server; the offset is a number, whatever the model)."""
    from mlx_vlm.utils import VideoMetadata

    folder = tiny_vlm(tmp_path_factory, TINY_QWEN3_VL)
    media = tmp_path_factory.mktemp("media")
    srv = TandemServer("--model", str(folder), "--no-disk-cache", "--colocate", "--block-size", "16",
                       "--allow-local-media", str(media), log_path=tmp_path_factory.mktemp("srv") / "server.log")
    request.addfinalizer(srv.stop)
    srv.start()
    client = client_for(srv)
    image = synthetic_image(64, 96, 5)
    messages = [{"role": "user", "content": [text_part("Here is a photo."), image_part(data_url(image)),
                                             text_part("Describe it in detail: the colours, the shapes, the light, "
                                                       "and anything unusual you notice about it.")]}]
    answer, usage = ask(client, messages)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert answer == text_reference(folder, template_form(messages), [image]).lstrip(" ")
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the corners?"}]
    answer, usage = ask(client, messages)
    assert usage.prompt_tokens_details.cached_tokens >= 16
    assert counters(srv) == (2, 1)
    assert answer == text_reference(folder, template_form(messages), [image]).lstrip(" ")

    from router.media.decode import MediaLimits
    from router.media.video import decode_video_bytes

    data = make_video(media / "clip.mp4", frames=25, fps=10.0, size=(96, 64))
    video = decode_video_bytes(data, MediaLimits(), "v", 2.0, 4, "file", None)
    assert video.timestamps == pytest.approx([0.0, 0.6, 1.2, 1.8])  # not k / 1.6 fps
    frames = [f.pixels for f in video.frames]
    meta = [VideoMetadata(total_num_frames=25, fps=10.0, frames_indices=[round(t * 10) for t in video.timestamps])]
    part = {"type": "video_url", "video_url": {"url": f"file://{media}/clip.mp4", "fps": 2.0, "max_frames": 4}}
    question = text_part("What happens in this clip? Describe the motion, the colours and the light in detail.")
    messages = [{"role": "user", "content": [part, question]}]
    form = [{"role": "user", "content": [{"type": "video"}, question]}]
    answer, usage = ask(client, messages)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert counters(srv) == (3, 1)
    assert answer == text_reference(folder, form, [], video=[frames], video_metadata=meta).lstrip(" ")
    follow = [{"role": "assistant", "content": answer}, {"role": "user", "content": "And at the end?"}]
    answer, usage = ask(client, messages + follow)
    assert usage.prompt_tokens_details.cached_tokens >= 16
    assert counters(srv) == (4, 2)  # the video's features were not encoded again
    assert answer == text_reference(folder, form + follow, [], video=[frames], video_metadata=meta).lstrip(" ")

    # The picture and the clip in one message, in that order: both from the
    # embedding store, the answer mlx-vlm's for the two together.
    both = [{"role": "user", "content": [image_part(data_url(image)), part, question]}]
    answer, usage = ask(client, both)
    assert counters(srv) == (6, 4)
    assert answer == text_reference(folder, [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, question]}],
                                    [image], video=[frames], video_metadata=meta).lstrip(" ")

    make_video(media / "small.mp4", frames=4, size=(24, 24))  # under the video processor's 32 px
    small = {"type": "video_url", "video_url": {"url": f"file://{media}/small.mp4"}}
    refused(client, [text_part("Look:"), small], "messages[0].content[1].video_url", "cannot take this video")
