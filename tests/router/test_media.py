"""router/media/decode.py against real bytes: Pillow-encoded images, OpenCV-encoded videos, files on
disk and a real HTTP server in a thread (slow, dripping, huge, redirecting and missing URLs)."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import struct
import sys
import threading
import time
import zlib
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest
from PIL import Image

from router.api.errors import ApiError
from router.media.decode import (
    RecentImages,
    DecodedImage,
    MediaError,
    MediaLimits,
    decode_image_bytes,
    image_content_hash,
)
from router.media.fetch import HostPolicy
from router.media.parts import FETCH_FAILED, fetch_url, load_media_parts
from router.media.video import DecodedVideo, decode_video_bytes
from tests.support.media import make_video

LIMITS = MediaLimits()
# The test server listens on 127.0.0.1, which only --allow-media-hosts opens (tests/router/test_media_ssrf.py).
LOCAL = replace(LIMITS, allowed_hosts=HostPolicy.parse(["127.0.0.1"]))


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def picture(width: int = 48, height: int = 32, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def video_part(url: str, **extra) -> dict:
    return {"type": "video_url", "video_url": {"url": url, **extra}}


def user(*parts: dict) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}


def load(messages: list[dict], limits: MediaLimits = LIMITS) -> list:
    return asyncio.run(load_media_parts(messages, limits))


def refused(messages: list[dict], limits: MediaLimits = LIMITS) -> MediaError:
    with pytest.raises(MediaError) as caught:
        load(messages, limits)
    return caught.value


def png_header_only(width: int, height: int) -> bytes:
    """A PNG claiming width x height whose only pixel data is 16 zero bytes (not even valid zlib)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", bytes(16)) + chunk(b"IEND", b"")


# --------------------------------------------------------------------------- #
# A real HTTP server
# --------------------------------------------------------------------------- #


class Routes(BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}

    def do_GET(self):
        if self.path in self.files:
            return self._send(200, self.files[self.path])
        if self.path == "/slow":  # answers long after the client's deadline
            time.sleep(10)
            return self._send(200, b"late")
        if self.path == "/drip":  # a byte every 0.1 s: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
            return None
        if self.path == "/huge":
            return self._send(200, b"\0" * (2 << 20))
        if self.path == "/huge-unsized":  # no Content-Length: HTTP/1.0, the body ends at close
            self.send_response(200)
            self.end_headers()
            for _ in range(32):
                self.wfile.write(b"\0" * (64 << 10))
            return None
        if self.path == "/loop":
            return self._redirect("/loop")
        if self.path == "/hop":
            return self._redirect("/pic.png")
        return self._send(404, b"not found")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, to: str) -> None:
        self.send_response(302)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # clients that gave up (timeouts, byte limits) leave broken pipes behind


@pytest.fixture(scope="module")
def http():
    Routes.files = {"/pic.png": encode(picture())}
    server = QuietServer(("127.0.0.1", 0), Routes)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# --------------------------------------------------------------------------- #
# Content hash
# --------------------------------------------------------------------------- #


def test_same_picture_from_data_url_file_and_http_has_one_hash(http, tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    png = encode(picture())
    (allowed / "pic.png").write_bytes(png)
    other = encode(picture(seed=1), "JPEG", quality=90)
    messages = [
        user(image_part(data_url(png)), {"type": "image_url", "image_url": f"file://{allowed}/pic.png"}),
        {"role": "assistant", "content": "seen"},
        user(image_part(f"{http}/pic.png", detail="high"), image_part(data_url(other, "image/jpeg"))),
    ]
    images = load(messages, replace(LOCAL, allowed_local_dir=allowed))

    assert [type(i) for i in images] == [DecodedImage] * 4
    assert [i.source for i in images] == ["data", "file", "http", "data"]
    assert [i.where for i in images] == [
        "messages[0].content[1].image_url", "messages[0].content[2].image_url",
        "messages[2].content[1].image_url", "messages[2].content[2].image_url",
    ]
    assert images[2].detail == "high"
    hashes = {i.content_hash for i in images[:3]}
    assert len(hashes) == 1 and len(hashes.pop()) == 64
    assert images[3].content_hash != images[0].content_hash
    assert images[0].content_hash == image_content_hash(np.asarray(picture()))
    assert (images[0].width, images[0].height) == (48, 32)
    assert np.array_equal(images[0].pixels, np.asarray(picture()))


def test_lossless_reencoding_keeps_the_hash_and_resizing_changes_it():
    image = picture(64, 64)
    fast, small = encode(image, compress_level=0), encode(image, compress_level=9)
    webp = encode(image, "WEBP", lossless=True)
    assert fast != small
    hashes = [decode_image_bytes(b, LIMITS, "x").content_hash for b in (fast, small, webp)]
    assert len(set(hashes)) == 1

    resized = decode_image_bytes(encode(image.resize((32, 32))), LIMITS, "x")
    assert resized.content_hash != hashes[0]
    # Same pixel bytes, other shape: width and height are part of the hash.
    flat = np.asarray(image).reshape(32, 128, 3)
    assert decode_image_bytes(encode(Image.fromarray(flat)), LIMITS, "x").content_hash != hashes[0]


def test_recent_images_skip_decoding_the_same_bytes_again():
    recent = RecentImages(max_bytes=2 * 64 * 64 * 3)
    png = encode(picture(64, 64))
    first = decode_image_bytes(png, LIMITS, "a", recent=recent)
    again = decode_image_bytes(png, LIMITS, "messages[2].content[0].image_url", "http", "low", recent=recent)
    assert recent.hits == 1
    assert again.pixels is first.pixels and again.content_hash == first.content_hash
    assert (again.where, again.source, again.detail) == ("messages[2].content[0].image_url", "http", "low")
    # Other bytes of the same pixels decode (and hash) to the same picture.
    other = decode_image_bytes(encode(picture(64, 64), compress_level=0), LIMITS, "b", recent=recent)
    assert recent.hits == 1 and other.content_hash == first.content_hash
    # Limits still apply to a remembered picture, and the oldest one leaves first.
    with pytest.raises(MediaError, match="pixels"):
        decode_image_bytes(png, replace(LIMITS, max_pixels=100), "c", recent=recent)
    assert recent.hits == 2
    decode_image_bytes(encode(picture(64, 64, seed=3)), LIMITS, "d", recent=recent)
    decode_image_bytes(png, LIMITS, "e", recent=recent)
    assert recent.hits == 3  # png was used last: kept over the compress_level=0 copy
    hits = recent.hits
    decode_image_bytes(encode(picture(64, 64), compress_level=0), LIMITS, "f", recent=recent)
    assert recent.hits == hits  # evicted: decoded again


# --------------------------------------------------------------------------- #
# Decoding
# --------------------------------------------------------------------------- #


def test_every_mode_comes_out_rgb_uint8():
    rgba = Image.new("RGBA", (4, 2), (10, 20, 30, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))  # transparent black → white
    palette = Image.new("P", (4, 2), 1)
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    transparent_palette = palette.copy()
    transparent_palette.info["transparency"] = 1
    sixteen_bit = Image.fromarray(np.full((2, 4), 65535, np.uint16))
    cases = {
        "rgba": (encode(rgba), (255, 255, 255), (10, 20, 30)),
        "la": (encode(Image.new("LA", (4, 2), (60, 255))), (60, 60, 60), (60, 60, 60)),
        "palette": (encode(palette), (200, 100, 50), (200, 100, 50)),
        "palette+transparency": (encode(transparent_palette, transparency=1), (255, 255, 255), (255, 255, 255)),
        "gray": (encode(Image.new("L", (4, 2), 100)), (100, 100, 100), (100, 100, 100)),
        "gray 16-bit": (encode(sixteen_bit), (255, 255, 255), (255, 255, 255)),
        "1-bit": (encode(Image.new("1", (4, 2), 1), "BMP"), (255, 255, 255), (255, 255, 255)),
        "gif": (encode(palette, "GIF"), (200, 100, 50), (200, 100, 50)),
        "cmyk jpeg": (encode(Image.new("CMYK", (4, 2), (0, 0, 0, 0)), "JPEG"), (255, 255, 255), (255, 255, 255)),
    }
    for name, (data, first, last) in cases.items():
        image = decode_image_bytes(data, LIMITS, name)
        assert image.pixels.shape == (2, 4, 3) and image.pixels.dtype == np.uint8, name
        assert not image.pixels.flags.writeable, name
        assert tuple(image.pixels[0, 0]) == first, name
        assert tuple(image.pixels[1, 3]) == last, name
    assert sixteen_bit.mode.startswith("I")  # the case really is 16-bit


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (20, 0, 40, 20))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90° clockwise to display
    decoded = decode_image_bytes(encode(image, "JPEG", exif=exif, quality=95), LIMITS, "x")
    assert (decoded.width, decoded.height) == (20, 40)
    top, bottom = decoded.pixels[5, 10].astype(int), decoded.pixels[35, 10].astype(int)
    assert top[0] > 200 and top[2] < 60  # the left (red) half is now on top
    assert bottom[2] > 200 and bottom[0] < 60


def test_pixel_limits_are_checked_before_decoding():
    # The file holds no pixel data: decoding would fail as truncated, so this error
    # can only come from the header.
    small = replace(LIMITS, max_pixels=1_000_000)
    error = refused([user(image_part(data_url(png_header_only(5000, 5000))))], small)
    assert str(error) == (
        "messages[0].content[1].image_url: image is 5000x5000 = 25000000 pixels, over the limit of 1000000"
    )
    assert error.status == 400 and error.param == "messages[0].content[1].image_url"
    assert error.code == "media_too_large"
    with pytest.warns(Image.DecompressionBombWarning):  # Pillow warns; ours refuses
        error = refused([user(image_part(data_url(png_header_only(12000, 12000))))])
    assert "12000x12000 = 144000000 pixels, over the limit of" in str(error)
    # Past twice Pillow's own threshold, Pillow refuses first: still our error.
    error = refused([user(image_part(data_url(png_header_only(100000, 100000))))])
    assert error.code == "media_too_large" and "messages[0].content[1]" in str(error)


def test_the_request_pixel_budget_covers_all_parts():
    png = encode(picture(100, 100))
    limits = replace(LIMITS, max_total_pixels=25_000)
    error = refused([user(image_part(data_url(png)), image_part(data_url(png)), image_part(data_url(png)))], limits)
    assert "25000 pixels in all" in str(error)


def test_bad_parts_name_their_path():
    png = encode(picture())
    cases = [
        (image_part(data_url(b"this is not an image")), "not an image in a supported format"),
        (image_part(data_url(png[:60])), "could not be decoded"),  # truncated
        (image_part("ftp://example.com/a.png"), "unsupported URL"),
        (image_part("pictures/a.png"), "unsupported URL"),
        (image_part("/etc/passwd"), "unsupported URL"),
        (image_part("http:///a.png"), "names no host"),
        ({"type": "image_url", "image_url": {}}, "missing its 'url'"),
        ({"type": "image_url"}, "missing its 'url'"),
        (image_part(""), "missing its 'url'"),
        (image_part("data:image/png;base64,@@@@"), "base64 is invalid"),
        (image_part("data:image/png;base64"), "malformed data URL"),
        (image_part(data_url(png), detail="ultra"), "expected one of auto, low, high"),
        (image_part(data_url(encode(picture(), "ICO"))), "not an image in a supported format"),
    ]
    for part, problem in cases:
        error = refused([{"role": "system", "content": "be brief"}, user(part)])
        assert str(error).startswith("messages[1].content[1]"), (problem, str(error))
        assert problem in str(error), (problem, str(error))
        assert isinstance(error, ApiError) and error.status == 400
        assert error.param.startswith("messages[1].content[1]")


def test_image_count_and_byte_limits():
    png = encode(picture())
    limits = replace(LIMITS, max_images=2)
    error = refused([user(image_part(data_url(png))), user(image_part(data_url(png)), image_part(data_url(png)))], limits)
    assert str(error) == "messages[1].content[2]: over the limit of 2 images per request"

    error = refused([user(image_part(data_url(png)))], replace(LIMITS, max_image_bytes=100))
    assert "larger than the limit of 100 bytes" in str(error)
    with pytest.raises(MediaError, match="larger than the limit of 100 bytes"):
        decode_image_bytes(png, replace(LIMITS, max_image_bytes=100), "x")


def test_parts_come_back_in_order_across_turns():
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    urls = [data_url(encode(Image.new("RGB", (8, 8), c))) for c in colors]
    messages = [user(image_part(urls[0]), image_part(urls[1])), {"role": "assistant", "content": "ok"},
                user(image_part(urls[2]))]
    assert [tuple(i.pixels[0, 0]) for i in load(messages)] == colors
    assert load([user(), {"role": "assistant", "content": "no media"}]) == []


# --------------------------------------------------------------------------- #
# Local files
# --------------------------------------------------------------------------- #


def test_file_urls_stay_inside_the_allowed_directory(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    png = encode(picture())
    (allowed / "pic.png").write_bytes(png)
    (outside / "secret.png").write_bytes(png)
    (allowed / "inner-link.png").symlink_to(allowed / "pic.png")
    (allowed / "outer-link.png").symlink_to(outside / "secret.png")
    (allowed / "dir-link").symlink_to(outside)
    os.mkfifo(allowed / "fifo.png")
    limits = replace(LIMITS, allowed_local_dir=allowed)

    ok = load([user(image_part(f"file://{allowed}/inner-link.png"), image_part(f"file://localhost{allowed}/pic.png"))],
              limits)
    assert ok[0].content_hash == ok[1].content_hash

    for url in (
        f"file://{outside}/secret.png",
        f"file://{allowed}/../outside/secret.png",
        f"file://{allowed}/outer-link.png",
        f"file://{allowed}/dir-link/secret.png",
        f"file://{outside}/does-not-exist.png",  # same answer as for a file that exists
        "file:///etc/passwd",
    ):
        error = refused([user(image_part(url))], limits)
        assert "outside the allowed local media directory" in str(error), url
        assert str(error).startswith("messages[0].content[1].image_url: "), url

    assert "cannot open" in str(refused([user(image_part(f"file://{allowed}/missing.png"))], limits))
    started = time.monotonic()
    assert "not a regular file" in str(refused([user(image_part(f"file://{allowed}/fifo.png"))], limits))
    assert time.monotonic() - started < 2  # a FIFO with no writer does not hang the read
    (allowed / "folder").mkdir()
    for folder in (f"file://{allowed}/folder", f"file://{allowed}/folder/", f"file://{allowed}"):
        assert "not a regular file" in str(refused([user(image_part(folder))], limits)), folder  # not IsADirectoryError
    assert "not a file:// URL of an absolute local path" in str(
        refused([user(image_part(f"file://elsewhere{allowed}/pic.png"))], limits))
    assert "larger than the limit" in str(
        refused([user(image_part(f"file://{allowed}/pic.png"))], replace(limits, max_image_bytes=100)))
    error = refused([user(image_part(f"file://{allowed}/pic.png"))])  # no allowed directory at all
    assert "file:// URLs are not allowed" in str(error)


# --------------------------------------------------------------------------- #
# HTTP
# --------------------------------------------------------------------------- #


def test_http_one_redirect_is_followed(http):
    (image,) = load([user(image_part(f"{http}/hop"))], LOCAL)
    assert image.source == "http" and image.content_hash == image_content_hash(np.asarray(picture()))


@pytest.mark.parametrize("path", ["/slow", "/drip"])
def test_http_deadline_covers_the_whole_fetch(http, path):
    limits = replace(LOCAL, fetch_timeout_s=0.5)
    ticks = 0

    async def fetch_while_ticking() -> None:
        async def tick() -> None:  # one tick per turn of the loop
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            await load_media_parts([user(image_part(f"{http}{path}"))], limits)
        finally:
            ticker.cancel()

    started = time.monotonic()
    with pytest.raises(MediaError) as caught:
        asyncio.run(fetch_while_ticking())
    elapsed, error = time.monotonic() - started, caught.value
    # The event loop kept running while the fetch waited: a free loop turns
    # thousands of times in the 0.5 s; a fetch that blocked it would allow a
    # turn per blocking read at most (the drip: ~5 in 0.5 s), none for /slow.
    assert ticks >= 100, ticks
    assert str(error) == f"messages[0].content[1].image_url: {FETCH_FAILED}"  # as any other failure
    assert error.code == "media_fetch_failed"
    # The 0.5 s limit, with room for a loaded box; without a deadline on the
    # whole fetch, /slow answers after 10 s and /drip takes 10 s.
    assert elapsed < 5


def test_http_failures_are_clear_errors(http):
    limits = replace(LOCAL, max_image_bytes=1 << 20)
    cases = {
        "/huge": "larger than the limit of 1048576 bytes",
        "/huge-unsized": "larger than the limit of 1048576 bytes",
        "/loop": FETCH_FAILED,  # more than 3 redirects
        "/missing": FETCH_FAILED,  # HTTP 404
    }
    for path, problem in cases.items():
        error = refused([user(image_part(f"{http}{path}"))], limits)
        assert problem in str(error) and str(error).startswith("messages[0].content[1]"), (path, str(error))

    with socket_closed_port() as port:
        error = refused([user(image_part(f"http://127.0.0.1:{port}/pic.png"))], limits)
    assert str(error) == f"messages[0].content[1].image_url: {FETCH_FAILED}"

    data, source = asyncio.run(fetch_url(f"{http}/pic.png", LOCAL, "x", 1 << 20))
    assert source == "http" and data == Routes.files["/pic.png"]


class socket_closed_port:
    """A port nothing listens on: bound, then closed."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        pass


# --------------------------------------------------------------------------- #
# Video
# --------------------------------------------------------------------------- #


def test_video_sampling_by_fps_and_max_frames(tmp_path):
    mp4 = make_video(tmp_path / "clip.mp4", frames=25)  # 2.5 s at 10 fps
    (video,) = load([user(video_part(data_url(mp4, "video/mp4")))])
    assert isinstance(video, DecodedVideo)
    assert len(video.frames) == 3 and video.timestamps == [0.0, 1.0, 2.0] and video.fps == 1.0
    for frame, level in zip(video.frames, (0, 40, 80)):
        assert frame.pixels.shape == (48, 64, 3) and frame.pixels.dtype == np.uint8
        assert abs(int(np.median(frame.pixels)) - level) <= 3
        assert frame.content_hash == image_content_hash(frame.pixels)
    assert video.frames[1].where == "messages[0].content[1].video_url.frames[1]"

    # 2 fps over 2.5 s wants 5 frames; max_frames 4 spreads 4 over the whole video instead.
    (spread,) = load([user(video_part(data_url(mp4, "video/mp4"), fps=2, max_frames=4))])
    assert len(spread.frames) == 4 and spread.fps == pytest.approx(1.6)
    assert spread.timestamps == pytest.approx([0.0, 0.6, 1.2, 1.8])


def test_video_hash_is_stable_and_names_its_sampling(tmp_path, http):
    mp4 = make_video(tmp_path / "clip.mp4", frames=25)
    Routes.files["/clip.mp4"] = mp4
    limits = replace(LOCAL, allowed_local_dir=tmp_path)
    videos = load([user(video_part(data_url(mp4, "video/mp4")), video_part(f"file://{tmp_path}/clip.mp4"),
                        video_part(f"{http}/clip.mp4"), video_part(data_url(mp4, "video/mp4"), fps=2.0))], limits)
    assert [v.source for v in videos] == ["data", "file", "http", "data"]
    assert videos[0].content_hash == videos[1].content_hash == videos[2].content_hash
    assert videos[3].content_hash != videos[0].content_hash
    again = decode_video_bytes(mp4, LIMITS, "x")
    assert again.content_hash == videos[0].content_hash


def test_seeking_gives_the_frames_reading_gives(tmp_path):
    mp4 = make_video(tmp_path / "long.mp4", frames=60)  # 6 s at 10 fps
    every = decode_video_bytes(mp4, replace(LIMITS, max_video_fps=10, max_frames=60), "x", fps=10, max_frames=60)
    assert len(every.frames) == 60
    sparse = decode_video_bytes(mp4, LIMITS, "x", max_frames=2)  # frames 0 and 30: a 3 s gap is seeked over
    assert sparse.timestamps == [0.0, 3.0]
    assert sparse.frames[1].content_hash == every.frames[30].content_hash


def test_video_refusals(tmp_path, monkeypatch):
    mp4 = make_video(tmp_path / "clip.mp4", frames=5)
    where = "messages[0].content[1].video_url"
    cases = [
        (video_part(data_url(mp4), fps=100), LIMITS, f"{where}.fps: expected a number in (0, 8]"),
        (video_part(data_url(mp4), fps=True), LIMITS, f"{where}.fps: expected a number"),
        (video_part(data_url(mp4), max_frames=33), LIMITS, f"{where}.max_frames: expected an integer in [1, 32]"),
        (video_part(data_url(mp4)), replace(LIMITS, max_pixels=1000),
         f"{where}: each video frame is 64x48 = 3072 pixels, over the limit of 1000"),
        (video_part(data_url(mp4)), replace(LIMITS, max_video_bytes=100), f"{where}: the data URL's content is larger"),
        (video_part(data_url(encode(picture()))), LIMITS, f"{where}: not a video in a supported container"),
        (video_part(data_url(b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n")), LIMITS,  # a playlist
         f"{where}: not a video in a supported"),
        (video_part(data_url(mp4[:32] + b"\0" * 200)), LIMITS, f"{where}: the video could not be opened"),
        (video_part(data_url(mp4)), replace(LIMITS, max_total_pixels=3000), f"{where}: the request's"),
    ]
    for part, limits, problem in cases:
        error = refused([user(part)], limits)
        assert str(error).startswith(problem), (problem, str(error))
    error = refused([user(video_part(data_url(mp4)), video_part(data_url(mp4)))], replace(LIMITS, max_videos=1))
    assert str(error) == "messages[0].content[2]: over the limit of 1 videos per request"

    monkeypatch.setitem(sys.modules, "cv2", None)  # as if opencv-python were not installed
    error = refused([user(video_part(data_url(mp4)))])
    assert "opencv-python" in str(error) and error.status == 400


def test_a_data_url_seen_lately_is_not_even_base64_decoded(monkeypatch):
    import router.media.parts as media

    recent = RecentImages()
    url = data_url(encode(picture(40, 30)))
    first = asyncio.run(load_media_parts([user(image_part(url))], LIMITS, recent))[0]
    monkeypatch.setattr(media, "_read_data_url", lambda *a: pytest.fail("decoded the data URL again"))
    again = asyncio.run(load_media_parts([user(image_part(url, detail="low"))], LIMITS, recent))[0]
    assert recent.hits == 1 and again.content_hash == first.content_hash and again.detail == "low"
    with pytest.raises(MediaError, match="pixels"):  # this request's limits still apply
        asyncio.run(load_media_parts([user(image_part(url))], replace(LIMITS, max_pixels=100), recent))
