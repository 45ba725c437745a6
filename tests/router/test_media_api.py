"""Media refusals as a client sees them through the router's HTTP API (a real uvicorn, a
scripted engine, a tiny random VLM's folder): a private image URL, a NUL byte in a file://
path, and a full media memory each get a clear error in the endpoint's own shape, never a 500,
and the private server sees nothing; an allowed host's picture reaches the engine."""

from __future__ import annotations

import io
import json
import socket

import httpx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from PIL import Image

from environment.settings import Settings
from router.app import create_app
from router.media.decode import image_content_hash
from router.media.parts import FETCH_FAILED
from tests.support.fake_engine import FakeEngine
from tests.support.media import FakeDNS, MediaHost
from tests.support.router_server import ServerThread
from tests.support.tiny_vlms import tiny_vlm

PICTURE = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
WHERE = "messages[0].content[0].image_url"


def png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(PICTURE).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "pic.png").write_bytes(png())
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory, media_dir):
    """(server, engine, the app's media limits): images.test may be fetched from (by name)."""
    folder = tiny_vlm(tmp_path_factory)
    tokenizer = load_tokenizer(folder)
    engine = FakeEngine(tokenizer, max_context=4096)
    settings = Settings(model_id=engine.model_id, model_dir=str(folder), allow_local_media=str(media_dir),
                        allow_media_hosts=("images.test",), media_fetch_timeout_s=1.0, request_timeout_s=30)
    app = create_app(engine, tokenizer, settings)
    api = next(route.endpoint.__self__ for route in app.routes if route.path == "/v1/chat/completions")
    with ServerThread(app, settings) as server:
        yield server, engine, api.media_limits


@pytest.fixture
def target(monkeypatch):
    """A real server on 127.0.0.1 that must see nothing unless reached as images.test (a name
    the resolver double maps to it)."""
    monkeypatch.setattr(socket, "getaddrinfo", FakeDNS({"images.test": ["127.0.0.1"]}))
    with MediaHost("127.0.0.1", files={"/pic.png": png()}) as host:
        yield host


def chat(served, url: str) -> httpx.Response:
    server, engine, _ = served
    engine.reset()
    engine.say("A picture.")
    body = {"model": engine.model_id, "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}]}
    # json.dumps escapes what UTF-8 cannot carry (a lone surrogate), as a hostile client may send it
    return httpx.post(server.url + "/v1/chat/completions", content=json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=30)


def anthropic(served, url: str) -> httpx.Response:
    server, engine, _ = served
    body = {"model": engine.model_id, "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": url}},
                                     {"type": "text", "text": "?"}]}]}
    return httpx.post(server.url + "/v1/messages", json=body, timeout=30)


def test_a_private_image_url_is_one_400_and_never_fetched(served, target):
    for url in (target.url("/pic.png"), target.url("/pic.png", host="localhost"),
                f"http://2130706433:{target.port}/pic.png", "http://169.254.169.254/latest/meta-data/"):
        answer = chat(served, url)
        assert answer.status_code == 400, url
        assert answer.json()["error"] == {"message": f"{WHERE}: {FETCH_FAILED}", "type": "invalid_request_error",
                                          "param": WHERE, "code": "media_fetch_failed"}, url
        answer = anthropic(served, url)
        assert answer.status_code == 400 and answer.json()["type"] == "error"
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert FETCH_FAILED in answer.json()["error"]["message"]
    assert target.requests == []

    answer = chat(served, target.url("/pic.png", host="images.test"))  # --allow-media-hosts images.test
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "A picture."
    (image,) = served[1].requests[-1].images
    assert image.content_hash == image_content_hash(PICTURE)
    assert target.requests == [("/pic.png", f"images.test:{target.port}")]


def test_a_nul_byte_or_broken_path_in_a_file_url_is_a_400_naming_the_part(served, media_dir):
    cases = [f"file://{media_dir}/pic%00.png", f"file://{media_dir}/pic\x00.png", f"file://{media_dir}/%ff%fe.png",
             f"file://{media_dir}/{'x' * 5000}.png", "file://[oops/pic.png"]
    for url in cases:
        answer = chat(served, url)
        assert answer.status_code == 400, (url, answer.text)
        error = answer.json()["error"]
        assert error["param"] == WHERE and error["message"].startswith(WHERE + ": "), (url, error)
    # A lone surrogate is refused with the body, before any part is read (router/api/openai_request.py).
    answer = chat(served, f"file://{media_dir}/pic.png\ud800")
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json", answer.text
    assert chat(served, f"file://{media_dir}/pic.png").status_code == 200  # the control


def test_a_full_media_memory_is_a_429_with_retry_after_in_each_shape(served, media_dir):
    _, _, limits = served
    memory = limits.memory
    other = object()  # a double for other requests holding all the media memory
    assert memory.try_take(other, memory.limit)
    try:
        url = f"file://{media_dir}/pic.png"
        answer = chat(served, url)
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        error = answer.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (WHERE, "media_busy", "rate_limit_error")
        answer = anthropic(served, url)
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["type"] == "rate_limit_error"
    finally:
        memory.give_back(other, memory.limit)
    assert chat(served, f"file://{media_dir}/pic.png").status_code == 200
    assert memory.used == 0
