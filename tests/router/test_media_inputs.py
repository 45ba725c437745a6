"""Hostile media bytes and URLs: whatever a client sends in an image or video part, the answer
is the picture or a 400 naming the part (a MediaError), never another exception (a 500).
Mutated and truncated files of every accepted format (hypothesis), decompression bombs, huge
declared sizes, broken base64 and paths the OS cannot take."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from router.media.decode import IMAGE_FORMATS, MediaError, MediaLimits, decode_image_bytes
from router.media.parts import load_media_parts
from router.media.video import decode_video_bytes
from tests.support.media import make_video

LIMITS = MediaLimits(max_pixels=1 << 20, fetch_timeout_s=2.0)
PIXELS = np.random.default_rng(0).integers(0, 256, (24, 32, 3), dtype=np.uint8)
SAVE_AS = {"PNG": {}, "JPEG": {"quality": 80}, "WEBP": {}, "GIF": {}, "BMP": {}, "TIFF": {"compression": "tiff_lzw"}}
assert set(SAVE_AS) == set(IMAGE_FORMATS)


def encoded(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(PIXELS).save(out, fmt, **SAVE_AS[fmt])
    return out.getvalue()


FILES = {fmt: encoded(fmt) for fmt in IMAGE_FORMATS}


def part_error(url: str, kind: str = "image", limits: MediaLimits = LIMITS) -> MediaError | None:
    """What loading one part of `url` raises: None (decoded) or a MediaError naming it; any
    other exception fails the test."""
    part = {"type": f"{kind}_url", f"{kind}_url": {"url": url}}
    try:
        asyncio.run(load_media_parts([{"role": "user", "content": [part]}], limits))
    except MediaError as error:
        assert error.status == 400 and error.param.startswith("messages[0].content[0]"), error
        return error
    return None


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(IMAGE_FORMATS), cut=st.integers(0, 4000),
       flips=st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 255)), max_size=6))
def test_mutated_and_truncated_images_decode_or_are_refused(fmt, cut, flips):
    data = bytearray(FILES[fmt])
    for at, xor in flips:
        data[at % len(data)] ^= xor
    data = bytes(data[: max(1, len(data) - cut % len(data))])
    try:
        image = decode_image_bytes(data, LIMITS, "x")
    except MediaError as error:
        assert error.status == 400 and error.param == "x"
    else:
        assert image.pixels.dtype == np.uint8 and image.pixels.shape == (image.height, image.width, 3)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_bombs_and_huge_declared_sizes_are_refused_before_decoding():
    # A PNG whose IDAT inflates to 16 MiB of zeros from 16 KiB: 4096x4096 gray, over the 1 M pixels allowed.
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 4096, 4096, 8, 0, 0, 0, 0))
    bomb = b"\x89PNG\r\n\x1a\n" + header + png_chunk(b"IDAT", zlib.compress(bytes(4096 * 4097), 9)) + png_chunk(
        b"IEND", b"")
    # A GIF of one 65535x65535 frame, a few bytes of LZW.
    gif = (b"GIF89a" + struct.pack("<HHBBB", 65535, 65535, 0, 0, 0)
           + b"," + struct.pack("<HHHHB", 0, 0, 65535, 65535, 0) + b"\x02\x02\x44\x01\x00;")
    bmp = b"BM" + struct.pack("<IHHI", 70, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, 60000, 60000, 1, 24, 0, 0, 0,
                                                                    0, 0, 0) + bytes(16)
    for name, data in [("png bomb", bomb), ("gif", gif), ("bmp", bmp)]:
        error = part_error("data:image/png;base64," + base64.b64encode(data).decode())
        assert error is not None and error.code == "media_too_large", (name, error)


@pytest.mark.parametrize("url", [
    "data:image/png;base64,iVBORw0KGgoé",  # outside ASCII
    "data:image/png;base64,\ud800\udfff",  # lone surrogates (JSON can carry them)
    "data:image/png;base64,====",
    "data:image/png;base64," + base64.b64encode(b"\0" * 100).decode(),
    "data:image/png," + "%89PNG%0D%0A%1A%0A" + "%00" * 20,  # percent-encoded, truncated
    "data:,",
    "http://[::1/pic.png", "https://[fe80::1%25eth0]/pic.png", "http://exa mple.com/pic.png",
    "http://example.com:99999/pic.png", "http://\ud800.example/pic.png", "file://[::1/pic.png",
    "HTTP://", "\0", "javascript:alert(1)",
])
def test_broken_urls_are_a_400_naming_the_part(url):
    error = part_error(url)
    assert error is not None
    error.message.encode("utf-8")  # what a JSON body can carry


def test_broken_videos_are_a_400_naming_the_part(tmp_path):
    mp4 = make_video(tmp_path / "clip.mp4", frames=10)
    cases = [mp4[: len(mp4) // 2], mp4[:64], b"\x1a\x45\xdf\xa3" + bytes(500), b"RIFF\0\0\0\0AVI " + bytes(200),
             bytes(8) + mp4[8:], mp4[:40] + bytes(len(mp4) - 40)]
    for data in cases:
        url = "data:video/mp4;base64," + base64.b64encode(data).decode()
        try:
            decode_video_bytes(data, LIMITS, "v")
        except MediaError as error:
            assert error.status == 400 and error.param.startswith("v")
        part_error(url, "video")  # through the request path: decoded, or a MediaError
    assert part_error("data:video/mp4;base64," + base64.b64encode(mp4).decode(), "video",
                      replace(LIMITS, max_pixels=100)).code == "media_too_large"
