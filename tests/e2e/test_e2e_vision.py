"""Images end to end: a real `tandem serve` on tiny random VLMs of each
supported architecture, the real `openai` client, greedy output compared with
mlx-vlm's own generate for the same folder, image and prompt."""

from __future__ import annotations

import http.server
import threading

import numpy as np
import openai
import pytest

from tests.support.media import make_video
from tests.support.server import TandemServer, metric
from tests.support.tiny_vlms import TINY_GEMMA3, TINY_QWEN_VL, synthetic_image, tiny_vlm
from tests.support.vision_chat import (ask, client_for, counters, data_url, image_part, reference, refused,
                                       template_form, text_part)


class _Files(http.server.SimpleHTTPRequestHandler):
    requested: list = []  # every path asked for, in order
    hang_up = threading.Event()  # set when the module ends: a /slow... request waits no longer

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.requested.append(self.path)
        if self.path.startswith("/slow"):
            self.hang_up.wait(timeout=10)  # past the server's 3 s limit; then hang up
            self.close_connection = True
            return None
        return super().do_GET()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def http_base(media_dir):
    """A local web server over media_dir; /slow... hangs up after 10 s (or when the module ends)."""
    _Files.hang_up.clear()
    handler = lambda *a, **kw: _Files(*a, directory=str(media_dir), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _Files.hang_up.set()
    server.shutdown()


def _server(request, tmp_path_factory, like, media_dir):
    folder = tiny_vlm(tmp_path_factory, like)
    srv = TandemServer("--model", str(folder), "--no-disk-cache", "--block-size", "16",
                       "--allow-local-media", str(media_dir), "--max-images", "3",
                       # 3 s: a loaded 2-core box took more than 1 s to fetch a small picture from http_base
                       "--media-fetch-timeout", "3", "--allow-media-hosts", "127.0.0.1",
                       log_path=tmp_path_factory.mktemp("srv") / "server.log")
    request.addfinalizer(srv.stop)
    srv.start()
    srv.folder, srv.like = folder, like
    return srv


@pytest.fixture(scope="module", params=[TINY_QWEN_VL, TINY_GEMMA3])
def vlm_server(request, tmp_path_factory, media_dir):
    return _server(request, tmp_path_factory, request.param, media_dir)


def test_follow_up_turns_skip_the_encoder_and_reuse_kv(vlm_server):
    """Turns two and three about one picture: no encoding, the prompt's KV
    through the picture comes from the prefix cache (counted), answers equal
    mlx-vlm's for the whole conversation."""
    client = client_for(vlm_server)
    image = synthetic_image(56, 56, 7)
    messages = [{"role": "user", "content": [text_part("Here is a photo."), image_part(data_url(image)),
                                             text_part("Describe it in detail: the colours, the shapes, the light, "
                                                       "and anything unusual you notice about it.")]}]
    q0, h0 = counters(vlm_server)
    handed = lambda path: metric(vlm_server, "tandem_kv_handoff_tokens_total", f'{{path="{path}"}}')  # noqa: E731
    referenced0, copied0 = handed("referenced"), handed("copied")
    answer, usage = ask(client, messages)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert counters(vlm_server) == (q0 + 1, h0)
    prompts, cached = usage.prompt_tokens, 0
    for turn, question in enumerate(["What colour dominates?", "And the corners?"], start=1):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        answer, usage = ask(client, messages)
        prompts += usage.prompt_tokens
        cached += usage.prompt_tokens_details.cached_tokens
        assert usage.prompt_tokens_details.cached_tokens >= 16, f"turn {turn}: nothing reused"
        assert counters(vlm_server) == (q0 + 1 + turn, h0 + turn), f"turn {turn} ran the encoder"
        assert answer == reference(vlm_server.folder, template_form(messages), [image]).lstrip(" ")
    referenced, copied = handed("referenced") - referenced0, handed("copied") - copied0
    if vlm_server.like == TINY_QWEN_VL:
        # Plain KV: decode gets the blocks each prompt found cached (image-aware
        # keys) by reference; only what its prefill computed is copied.
        assert referenced + copied == prompts and cached <= referenced < cached + 3 * 16, \
            (referenced, copied, cached, prompts)
    else:  # Gemma 3's sliding-window layers are not blocks: all of it is copied
        assert referenced == 0 and copied == prompts, (referenced, copied, prompts)


def test_greedy_matches_mlx_vlm(vlm_server):
    image = synthetic_image(56, 84, 1)
    messages = [{"role": "user", "content": [image_part(data_url(image)), text_part("What is in this picture?")]}]
    got, usage = ask(client_for(vlm_server), messages)
    # (a chat answer drops the first token's leading space)
    assert got == reference(vlm_server.folder, template_form(messages), [image]).lstrip(" ")
    assert usage.prompt_tokens > 20
    # The encoder is a process of its own, and its time is measured.
    _, health = vlm_server.health()
    assert [w["role"] for w in health["workers"]].count("vision") == 1
    assert metric(vlm_server, "tandem_vision_encode_seconds_count") >= 1


LONG_SYSTEM = ("You are a careful assistant who looks at pictures and answers questions about them "
               "briefly, precisely and politely, naming colours and shapes where it helps.")


def test_same_picture_as_data_url_file_and_http_is_encoded_once(vlm_server, media_dir, http_base):
    image = synthetic_image(64, 48, 11)
    image.save(media_dir / "same.png")
    client = client_for(vlm_server)
    q0, h0 = counters(vlm_server)
    answers = []
    for url in (data_url(image), f"file://{media_dir}/same.png", f"{http_base}/same.png"):
        messages = [{"role": "user", "content": [image_part(url), text_part(
            "Please describe this picture in a few words, mentioning its main colours and shapes.")]}]
        answers.append(ask(client, messages))
    assert counters(vlm_server) == (q0 + 3, h0 + 2)
    assert answers[0][0] == answers[1][0] == answers[2][0]
    assert answers[0][1].prompt_tokens_details.cached_tokens == 0
    assert answers[2][1].prompt_tokens_details.cached_tokens >= 16
    # Other text before it: no KV to reuse, the embeddings come from the cache service.
    messages = [{"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": [image_part(data_url(image)), text_part("And now?")]}]
    got, _ = ask(client, messages)
    assert counters(vlm_server) == (q0 + 4, h0 + 3)
    assert got == reference(vlm_server.folder, template_form(messages), [image]).lstrip(" ")


def test_two_pictures_never_share_kv_past_the_text_before_them(vlm_server):
    client = client_for(vlm_server)
    first, second = synthetic_image(56, 56, 21), synthetic_image(56, 56, 22)

    def messages(image):
        return [{"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": [image_part(data_url(image)), text_part("What do you see in it?")]}]

    q0, h0 = counters(vlm_server)
    ask(client, messages(first))
    got, usage = ask(client, messages(second))
    assert counters(vlm_server) == (q0 + 2, h0)  # encoded twice
    before = len(client_prompt_ids(vlm_server, LONG_SYSTEM))
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached <= before  # the system prompt's blocks at most
    if "gemma" not in vlm_server.folder.name:  # (Gemma 3 snapshots only at the prompt's end)
        assert cached > 0
    assert got == reference(vlm_server.folder, template_form(messages(second)), [second]).lstrip(" ")


def client_prompt_ids(srv, system: str) -> list:
    """Token ids of the templated system message alone (an upper bound on the
    text shared before an image that follows it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(srv.folder))
    text = tok.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_same_bytes_resized_is_another_entry(vlm_server):
    client = client_for(vlm_server)
    image = synthetic_image(56, 56, 31)
    question = text_part("Please describe this picture in a few words, mentioning its main colours and shapes.")
    q0, h0 = counters(vlm_server)
    ask(client, [{"role": "user", "content": [image_part(data_url(image)), question]}])
    ask(client, [{"role": "user", "content": [image_part(data_url(image.resize((84, 56)))), question]}])
    assert counters(vlm_server) == (q0 + 2, h0)


def test_image_in_the_middle_of_a_conversation_reuses_the_text_before_it(vlm_server):
    """A text-only chat first (the VLM's text path, filling the text prefix
    cache), then the same conversation goes on with a picture."""
    client = client_for(vlm_server)
    messages = [{"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": "Hello! I will show you something in a moment."}]
    answer, usage = ask(client, messages)
    assert answer and usage.prompt_tokens > 16
    image = synthetic_image(48, 64, 41)
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": [text_part("Here it is:"), image_part(data_url(image))]}]
    got, usage = ask(client, messages)
    assert usage.prompt_tokens_details.cached_tokens >= 16
    assert got == reference(vlm_server.folder, template_form(messages), [image]).lstrip(" ")


def test_bad_media_is_a_400_naming_the_part(vlm_server, media_dir, http_base, tmp_path):
    client = client_for(vlm_server)
    good = image_part(data_url(synthetic_image(32, 32, 1)))
    refused(client, [text_part("Look"), image_part("data:image/png;base64,aGVsbG8gd29ybGQ=")],
             "messages[0].content[1].image_url", "")
    refused(client, [good, good, good, good], "messages[0].content[3]", "limit of 3")
    synthetic_image(32, 32, 2).save(tmp_path / "outside.png")
    refused(client, [good, image_part(f"file://{tmp_path}/outside.png")], "messages[0].content[1].image_url", "")
    refused(client, [image_part(f"{http_base}/slow/same.png")], "messages[0].content[0].image_url",
             "could not fetch media")
    # A field Tandem does not honour, or a malformed one, is refused before any picture is fetched.
    for kwargs, param in [(dict(extra_body={"guided_json": {"type": "object"}}), "guided_json"),
                          (dict(response_format={"type": "xml"}), "response_format.type"),
                          (dict(tool_choice="required"), "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="default", **kwargs, messages=[
                {"role": "user", "content": [image_part(f"{http_base}/never.png"), text_part("JSON?")]}])
        assert err.value.body["param"] == param and "/never.png" not in _Files.requested
    # Still serving.
    answer, _ = ask(client, [{"role": "user", "content": [good, text_part("Fine?")]}])
    assert answer


def test_a_text_model_refuses_images():
    from router.api.errors import ApiError
    from router.api.openai_request import _messages

    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    with pytest.raises(ApiError) as err:
        _messages(body)  # what parse_chat runs for a model without vision
    assert err.value.status == 400 and "messages[0].content[1]" in str(err.value) and "images" in str(err.value)


def test_image_block_hashes():
    """Blocks before an image hash like text; from the block holding it on,
    two pictures (or one picture at another offset) never share a key."""
    from protos.messages import ImageInput
    from workers.kv.block_hash import BlockHasher, image_block_extra

    hasher, tokens = BlockHasher(b"x", 4), list(range(16))
    a, b = "aa" * 32, "bb" * 32

    def keys(h, start=5):
        return hasher.hashes(tokens, None, image_block_extra([ImageInput(h, None, start, 4)], 4))

    text = hasher.hashes(tokens)
    assert keys(a)[0] == keys(b)[0] == text[0]
    assert all(x != y for x, y in zip(keys(a)[1:], keys(b)[1:]))
    assert all(x != y for x, y in zip(keys(a)[1:], text[1:]))
    assert keys(a) == keys(a) and keys(a, 6)[1] != keys(a)[1]
    # A video's tokens come in blocks with text between them: its span covers them all.
    video = hasher.hashes(tokens, None, image_block_extra([ImageInput(a, None, 2, 4, "video", span=10)], 4))
    assert video[:2] == keys(a, 2)[:2] and video[2] != keys(a, 2)[2]


def test_colocated_worker_takes_images(request, tmp_path_factory, media_dir):
    """--colocate: one worker process holds prefill, decode and vision."""
    folder = tiny_vlm(tmp_path_factory, TINY_QWEN_VL)
    srv = TandemServer("--model", str(folder), "--no-disk-cache", "--colocate",
                       log_path=tmp_path_factory.mktemp("srv") / "server.log")
    request.addfinalizer(srv.stop)
    srv.start()
    _, health = srv.health()
    assert [w["role"] for w in health["workers"]] == ["prefill+decode+vision"]
    client = client_for(srv)
    image = synthetic_image(56, 84, 5)
    messages = [{"role": "user", "content": [image_part(data_url(image)), text_part(
        "Describe it in detail: the colours, the shapes, the light, and anything unusual.")]}]
    answer, _ = ask(client, messages)
    assert answer == reference(folder, template_form(messages), [image]).lstrip(" ")
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the corners?"}]
    answer, usage = ask(client, messages)
    assert usage.prompt_tokens_details.cached_tokens >= 16
    assert counters(srv) == (2, 1)
    assert answer == reference(folder, template_form(messages), [image]).lstrip(" ")


def test_a_video_goes_in_as_a_video_or_as_its_frames(vlm_server, media_dir):
    """A video_url part, sampled to frames by the router: Qwen2.5-VL takes it
    as a video (the answer equals mlx-vlm's for that video); Gemma 3, which
    has no video path, gets the frames as images, in order (the answer equals
    mlx-vlm's for those frames as images). Qwen3-VL: tests/workers/vision/test_vision_qwen3vl.py."""
    from PIL import Image

    from router.media.decode import MediaLimits
    from router.media.video import decode_video_bytes

    data = make_video(media_dir / "clip.mp4", frames=20, fps=10.0, size=(64, 48))
    video = decode_video_bytes(data, MediaLimits(), "v", 2.0, 2, "file", None)
    frames = [Image.fromarray(np.asarray(f.pixels), "RGB") for f in video.frames]
    assert len(frames) == 2
    part = {"type": "video_url", "video_url": {"url": f"file://{media_dir}/clip.mp4", "fps": 2.0, "max_frames": 2}}
    messages = [{"role": "user", "content": [part, text_part("What happens in this clip?")]}]
    got, _ = ask(client_for(vlm_server), messages)
    if vlm_server.like == TINY_QWEN_VL:
        want = [{"role": "user", "content": [{"type": "video"}, text_part("What happens in this clip?")]}]
        assert got == reference(vlm_server.folder, want, [], video=[frames], fps=2.0).lstrip(" ")
        # The same clip again with another question: its features come from the store.
        queries, hits = counters(vlm_server)
        messages[0]["content"][1] = want[0]["content"][1] = text_part("Who is in this clip?")
        got, _ = ask(client_for(vlm_server), messages)
        assert counters(vlm_server) == (queries + 1, hits + 1)
        assert got == reference(vlm_server.folder, want, [], video=[frames], fps=2.0).lstrip(" ")
        return
    want = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, text_part("What happens in this clip?")]}]
    assert got == reference(vlm_server.folder, want, frames).lstrip(" ")
