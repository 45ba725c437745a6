"""The vision add-on (workers/vision/engine.py) against mlx-vlm's own generate.

For tiny random Qwen2.5-VL and Gemma 3 models: our path (preprocess → encode
→ prompt tokens → input embeddings + rope positions → prefill on mlx-vlm's
language model → decode on mlx-lm's *text* model, its rope shifted by the
prompt's rope delta) gives greedy tokens identical to `mlx_vlm`'s
stream_generate for the same folder, image and prompt.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.support.decoding import decode_greedy
from tests.support.tiny_vlms import TINY_GEMMA3, TINY_QWEN_VL, TINY_VLMS, make_tiny_vlm, synthetic_image, tiny_vlm
from tests.support.vision import (N_TOKENS, Setup, assert_same, our_prefill, ours, reference, user_turn,
                                  vlm_setup)


@pytest.fixture(scope="module", params=TINY_VLMS)
def setup(request, tmp_path_factory) -> Setup:
    return vlm_setup(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Setup:
    return vlm_setup(tmp_path_factory, TINY_QWEN_VL)


# ---------------------------------------------------------------- identity


def test_prompt_tokens_match_mlx_vlm(setup):
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    images = [synthetic_image(56, 84, 1)]
    messages = [user_turn("Look:", None, "What is in this picture?")]
    eng = setup.engine
    ids = eng.prompt_tokens(messages, eng.image_tokens([(56, 84)]))
    inputs = prepare_inputs(setup.vlm_processor, images=images, prompts=eng.prompt_text(messages),
                            add_special_tokens=should_add_special_tokens(eng.model_type, setup.vlm_processor))
    assert ids == inputs["input_ids"][0].tolist()
    image_id = eng.model.config.image_token_id if setup.like == TINY_QWEN_VL else eng.model.config.image_token_index
    assert ids.count(image_id) == eng.image_tokens([(56, 84)])[0]


def test_greedy_matches_mlx_vlm_generate(setup):
    images = [synthetic_image(56, 84, 1)]
    messages = [user_turn(None, "What is in this picture?")]
    assert_same(ours(setup, messages, images), reference(setup, messages, images))


def test_image_in_the_middle_of_a_conversation(setup):
    images = [synthetic_image(64, 64, 3)]
    messages = [
        user_turn("Hello there, can you look at pictures?"),
        {"role": "assistant", "content": "Yes, send me one and I will describe it."},
        user_turn("Here it is:", None, "What colours do you see?"),
    ]
    assert_same(ours(setup, messages, images), reference(setup, messages, images))


def test_two_images(qwen):
    images = [synthetic_image(56, 84, 1), synthetic_image(112, 56, 2)]
    messages = [user_turn("Compare", None, "with", None, "please.")]
    batch = qwen.engine.preprocess(images)
    assert batch.tokens_per_image == [6, 8]
    assert_same(ours(qwen, messages, images), reference(qwen, messages, images))


def test_images_encoded_one_at_a_time(qwen):
    """As the cache service holds them: each image preprocessed and encoded
    on its own, the batches joined for the prompt. (Features differ from a
    two-image encode only by float rounding, ~1e-6.)"""
    from environment.vision_layout import ImageBatch
    from workers.decode.shifted_rope import shift_rope

    eng = qwen.engine
    images = [synthetic_image(56, 84, 1), synthetic_image(112, 56, 2)]
    messages = [user_turn("Compare", None, "with", None, "please.")]
    batches = [eng.preprocess([im]) for im in images]
    features = mx.concatenate([eng.encode(b) for b in batches])
    batch = ImageBatch.join(batches)
    ids = eng.prompt_tokens(messages, batch.tokens_per_image)
    positions, delta = eng.rope_positions(ids, batch)
    cache = eng.make_cache()
    first = int(mx.argmax(eng.prefill(ids, eng.input_embeddings(ids, features, batch), positions, cache)).item())
    got = [first] + decode_greedy(qwen.text_model, shift_rope(cache, delta), first, N_TOKENS - 1)
    assert_same(got, reference(qwen, messages, images))


def test_a_prefill_job_runs_in_steps_and_matches_mlx_vlm(setup):
    """VLMPrefillJob, as a worker drives it: one image encoded per step, then
    one chunk of the prompt per step (the worker drains its inbox and runs
    decode steps between them), the last token with the final chunk. The
    answer is mlx-vlm's, whatever the chunk size."""
    from protos.messages import SamplingParams
    from router.media.decode import DecodedImage, image_content_hash
    from router.media.vision_prompt import VisionPrompter
    from workers.prefill.vlm import VLMPrefillJob
    from workers.decode.shifted_rope import shift_rope

    pictures = [synthetic_image(56, 84, 1), synthetic_image(64, 56, 2)]
    messages = [user_turn("Look at", None, "and then at", None, "and tell me which one is darker, and why.")]
    decoded = [DecodedImage(np.asarray(p), p.width, p.height, image_content_hash(np.asarray(p)), "data",
                            f"messages[0].content[{1 + 2 * i}].image_url") for i, p in enumerate(pictures)]
    ids, inputs = VisionPrompter(setup.folder).build(messages, decoded)
    want = reference(setup, messages, pictures)
    for chunk in (7, 4096):
        job = VLMPrefillJob(setup.engine, ids, inputs, SamplingParams(max_tokens=N_TOKENS, temperature=0.0),
                            chunk_size=chunk)
        steps, encoded = 0, []
        while (result := job.step()) is None:
            steps += 1
            encoded.append(job.encoded)
        # Step 1 encodes the first image, step 2 the second, then the chunks.
        assert encoded[:2] == [1, 2]
        chunks = -(-len(ids) // chunk)  # the last token rides in the final chunk
        assert steps + 1 == 2 + chunks
        got = [result.first_token] + decode_greedy(
            setup.text_model, shift_rope(result.cache, result.rope_offset - result.num_tokens),
            result.first_token, N_TOKENS - 1)
        assert_same(got, want)


def test_language_weights_are_the_text_models(setup):
    """The add-on holds no second copy of the language model."""
    from mlx.utils import tree_flatten

    text = {id(a) for _, a in tree_flatten(setup.text_model.parameters())}
    lm = tree_flatten(setup.engine.model.language_model.parameters())
    assert setup.engine.shared_params == len(lm)
    assert all(id(a) in text for _, a in lm)


def test_text_only_prompt_matches_mlx_lm(qwen):
    """No image: embeddings are the token embeddings, positions plain; the
    result is mlx-lm's own greedy generation on the text model."""
    from mlx_lm.generate import generate_step

    messages = [user_turn("Tell me a story about a cat.")]
    ids = qwen.engine.prompt_tokens(messages, [])
    want = [int(t) for t, _ in generate_step(mx.array(ids), qwen.text_model, max_tokens=N_TOKENS)]
    assert len(set(want)) >= 2
    assert ours(qwen, messages, []) == want


# ---------------------------------------------------------------- features


def test_features_follow_the_image(setup):
    eng = setup.engine
    a, b = synthetic_image(56, 84, 1), synthetic_image(56, 84, 2)
    fa = eng.encode(eng.preprocess([a]))
    hidden = eng.model.language_model.model.embed_tokens.weight.shape[1]
    assert fa.shape == (eng.image_tokens([(56, 84)])[0], hidden)
    again = eng.encode(eng.preprocess([a.copy()]))
    assert mx.array_equal(fa, again).item()  # same pixels, same features, bit for bit
    fb = eng.encode(eng.preprocess([b]))
    assert not mx.allclose(fa, fb, atol=1e-3).item()
    # Two images in one batch: each one's rows are its own features.
    both = eng.encode(eng.preprocess([a, b]))
    n = fa.shape[0]
    assert mx.allclose(both[:n], fa, atol=1e-5).item() and mx.allclose(both[n:], fb, atol=1e-5).item()


def test_image_tokens_from_size(qwen):
    eng = qwen.engine
    sizes = [(56, 56), (56, 84), (112, 56), (100, 37), (300, 200)]
    counts = eng.image_tokens(sizes)
    for (h, w), n in zip(sizes, counts):
        assert eng.preprocess([synthetic_image(h, w, 0)]).tokens_per_image == [n]
    assert counts[0] == 4 and max(counts) <= 16  # min/max pixels of the tiny processor



def test_a_batch_from_the_size_alone_matches_the_processor(setup):
    """What a cached image's prefill uses instead of the processor's resize
    and normalise: the same extra data (Qwen: image_grid_thw) and token
    count, and no pixels."""
    eng = setup.engine
    for h, w in [(56, 56), (56, 84), (112, 56), (100, 37), (300, 200), (1024, 768)]:
        full, sized = eng.preprocess([synthetic_image(h, w, 0)]), eng.sized(h, w)
        assert sized is not None and sized.pixel_values is None
        assert sized.tokens_per_image == full.tokens_per_image
        assert sized.extra.keys() == full.extra.keys()
        for k in full.extra:
            assert np.array_equal(np.array(sized.extra[k]), np.array(full.extra[k])), (h, w, k)


# ---------------------------------------------------------------- rope shift


def test_rope_delta(setup):
    eng = setup.engine
    images = [synthetic_image(56, 84, 1), synthetic_image(112, 56, 2)]
    batch = eng.preprocess(images)
    ids = eng.prompt_tokens([user_turn(None, None, "Which is brighter?")], batch.tokens_per_image)
    positions, delta = eng.rope_positions(ids, batch)
    if setup.like == TINY_GEMMA3:
        assert positions is None and delta == 0
        return
    # An image of h x w merged patches takes h*w tokens, advances positions by max(h, w).
    merged = [(h // 2, w // 2) for _, h, w in np.array(batch.extra["image_grid_thw"]).tolist()]
    assert delta == sum(max(h, w) - h * w for h, w in merged) == (3 - 6) + (4 - 8)
    assert positions.shape == (3, 1, len(ids))
    # After the last image all three components agree and run on as n + delta.
    last = positions[:, 0, -1].tolist()
    assert last == [len(ids) - 1 + delta] * 3


def test_decode_without_the_shift_diverges(qwen):
    """The shift is what makes the text model's decode right (so the
    identity tests above could fail)."""
    images = [synthetic_image(112, 112, 4)]  # 16 image tokens, delta -12
    messages = [user_turn(None, "Describe it.")]
    want = reference(qwen, messages, images)
    assert_same(ours(qwen, messages, images), want)
    assert ours(qwen, messages, images, shift=False)[: len(want)] != want


def test_batched_decode_with_per_row_shifts(qwen):
    """Two VLM requests with different rope deltas decode together in one
    mlx-lm BatchKVCache (merged like BatchGenerator merges), each row shifted
    by its own delta after the merge."""
    from mlx_lm.models.cache import BatchKVCache

    from workers.decode.shifted_rope import shift_batch_rope

    requests = [([synthetic_image(56, 84, 1)], [user_turn(None, "What is in this picture?")]),
                ([synthetic_image(112, 112, 4)], [user_turn("Please describe", None, "in detail.")])]
    firsts, caches, deltas, wants = [], [], [], []
    for images, messages in requests:
        _, first, cache, delta = our_prefill(qwen, messages, images)
        firsts.append(first), caches.append(cache), deltas.append(delta)
        wants.append(reference(qwen, messages, images))
    assert deltas[0] != deltas[1]
    batch = [BatchKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    shift_batch_rope(batch, deltas)
    rows = [[f] for f in firsts]
    y = mx.array([[f] for f in firsts])
    for _ in range(N_TOKENS - 1):
        y = mx.argmax(qwen.text_model(y, cache=batch)[:, -1, :], axis=-1)[:, None]
        for row, t in zip(rows, y[:, 0].tolist()):
            row.append(int(t))
    for got, want in zip(rows, wants):
        assert_same(got, want)


def test_ragged_decode_rows_carry_the_shift(qwen):
    """The decode worker's batch (mlx-lm BatchGenerator over
    workers/decode/ragged_kv.py rows, each with its own rope_shift)."""
    ragged_kv = pytest.importorskip("workers.decode.ragged_kv")
    if not hasattr(ragged_kv, "rows_of"):
        pytest.skip("workers.decode.ragged_kv has no rows_of")
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    requests = [([synthetic_image(56, 84, 1)], [user_turn(None, "What is in this picture?")]),
                ([synthetic_image(112, 112, 4)], [user_turn("Please describe", None, "in detail.")])]
    from workers.kernels import mlx_hooks

    assert mlx_hooks.install(qwen.text_model)
    gen = BatchGenerator(qwen.text_model, sampler=make_sampler(0.0), completion_batch_size=4,
                         prefill_batch_size=4)
    try:
        uids, firsts, wants = [], {}, {}
        for images, messages in requests:
            _, first, cache, delta = our_prefill(qwen, messages, images)
            (uid,) = gen.insert([[first]], max_tokens=[N_TOKENS - 1], caches=[ragged_kv.rows_of(cache, delta)])
            uids.append(uid)
            firsts[uid], wants[uid] = first, reference(qwen, messages, images)
        got = {uid: [firsts[uid]] for uid in uids}
        while any(len(v) < N_TOKENS for v in got.values()):
            responses = gen.next_generated()
            assert responses, "the batch stopped early"
            for r in responses:
                got[r.uid].append(int(r.token))
    finally:
        gen.close()
    for uid in uids:
        assert_same(got[uid], wants[uid])



@pytest.mark.parametrize("ragged", [False, True], ids=["padded batch (GPU)", "ragged rows (CPU)"])
def test_decode_engine_carries_each_requests_shift(qwen, ragged):
    """The decode worker's own engine, both batch kinds: two image requests
    with different rope deltas and a text one, the second image request
    joining while the others run, each greedy == mlx-vlm generate."""
    from protos.messages import DecodeRequest, KVHandoff, SamplingParams
    from workers.decode.engine import DecodeEngine

    requests = [([synthetic_image(56, 84, 1)], [user_turn(None, "What is in this picture?")]),
                ([], [user_turn("Tell me a story about a river.")]),
                ([synthetic_image(112, 112, 4)], [user_turn("Please describe", None, "in detail.")])]
    engine = DecodeEngine(qwen.text_model, max_batch=4, ragged=ragged)
    got, wants, deltas = {}, {}, []
    for i, (images, messages) in enumerate(requests):
        ids, first, cache, delta = our_prefill(qwen, messages, images)
        deltas.append(delta)
        rid = f"r{i}"
        wants[rid], got[rid] = reference(qwen, messages, images), [first]
        engine.add(DecodeRequest(rid, ids, first, KVHandoff(rid, len(ids), len(ids) + delta),
                                 SamplingParams(max_tokens=N_TOKENS, temperature=0.0)), cache)
        if i == 1:  # the last request joins a running batch
            for _ in range(3):
                for u in engine.step():
                    got[u.request_id].append(u.token)
    assert deltas[0] != deltas[2] and deltas[1] == 0 and deltas[0] != 0
    while engine.has_work:
        for u in engine.step():
            got[u.request_id].append(u.token)
    for rid in got:
        assert_same(got[rid], wants[rid])


# ---------------------------------------------------------------- the random folders


def test_random_vlm_is_deterministic(tmp_path):
    def digest(folder):
        import hashlib

        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

    a = digest(make_tiny_vlm(tmp_path / "a", TINY_GEMMA3, seed=0))
    b = digest(make_tiny_vlm(tmp_path / "b", TINY_GEMMA3, seed=0))
    c = digest(make_tiny_vlm(tmp_path / "c", TINY_GEMMA3, seed=1))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    # Only the weights and the seed recorded in config.json depend on the seed.
    def rest(d):
        return {k: v for k, v in d.items() if k not in ("config.json", "model.safetensors")}

    assert rest(a) == rest(c)


@pytest.mark.parametrize("like", TINY_VLMS)
def test_a_vision_worker_reads_only_the_tower_and_projector(like, tmp_path_factory):
    """encoder_only (what a vision-only worker loads): the language weights,
    most of a VLM's bytes, stay unread on disk."""
    import gc

    from mlx.utils import tree_flatten

    from workers.vision.engine import VisionEngine

    folder = tiny_vlm(tmp_path_factory, like)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    engine = VisionEngine(folder, encoder_only=True)
    loaded = mx.get_active_memory() - before
    language = sum(p.nbytes for _, p in tree_flatten(engine.model.language_model.parameters()))
    rest = sum(p.nbytes for name, m in engine.model.children().items() if name != "language_model"
               for _, p in tree_flatten(m.parameters()))
    assert language > 10 * rest  # the check below means something
    assert loaded < rest + language // 10, (loaded, rest, language)
    features = engine.encode(engine.preprocess([synthetic_image(56, 56)]))
    assert features.shape[0] > 0


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image then video"])
def test_qwen25_video_matches_mlx_vlm_generate(qwen, with_image):
    """Qwen2.5-VL takes a video as a video (mlx-vlm's processor): frames in
    temporal pairs, one vision_start/end block of all its tokens; the prompt
    is mlx-vlm's token for token, the greedy answer too."""
    from mlx_vlm.generate.dispatch import stream_generate

    from environment.vision_layout import ImageBatch
    from workers.decode.shifted_rope import shift_rope

    eng = qwen.engine
    assert eng.native_video
    frames = [synthetic_image(56, 84, s) for s in range(4)]
    images = [synthetic_image(84, 56, 9)] if with_image else []
    parts = ([{"type": "image"}] if with_image else []) + [{"type": "video"},
                                                          {"type": "text", "text": "What happens in this clip?"}]
    messages = [{"role": "user", "content": parts}]
    video = eng.preprocess_video(frames, fps=2.0)
    t, h, w = np.array(video.extra["video_grid_thw"])[0].tolist()
    assert t == 2 and video.tokens_per_image == [t * h * w // 4]
    sized = eng.sized_video(4, 56, 84, 2.0)
    assert np.array(sized.extra["video_grid_thw"]).tolist() == [[t, h, w]]
    batches = [eng.preprocess(images)] if with_image else []
    ids = eng.prompt_tokens(messages, [n for b in batches for n in b.tokens_per_image], videos=[video])
    video_id = eng.model.config.video_token_id
    assert sum(1 for i in ids if i == video_id) == video.tokens_per_image[0]
    batch = ImageBatch.join(batches + [video])  # prompt order: the image, then the video
    features = mx.concatenate([eng.encode(b) for b in batches + [video]])
    positions, delta = eng.rope_positions(ids, batch)
    assert delta < 0  # a frame pair of h x w patches takes fewer positions than tokens
    cache = eng.make_cache()
    first = int(mx.argmax(eng.prefill(ids, eng.input_embeddings(ids, features, batch), positions, cache)).item())
    got = [first] + decode_greedy(qwen.text_model, shift_rope(cache, delta), first, N_TOKENS - 1)
    last = None
    for last in stream_generate(qwen.vlm, qwen.vlm_processor, eng.prompt_text(messages), image=images or None,
                                video=[frames], fps=2.0, max_tokens=N_TOKENS, temperature=0.0):
        pass
    assert_same(got, list(last.token_ids))
