"""The media memory (--media-memory), as a crowd of image requests meets it: one request's
media cannot hold more than the whole, a request past it waits for room and then proceeds or
gets a 429 with Retry-After, two requests never wait for each other, and every byte comes back
(success, refusal, cancel)."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from router.media.decode import MediaError, MediaLimits, image_content_hash
from router.media.budget import MediaBusy, MediaMemory
from router.media.fetch import HostPolicy
from router.media.parts import load_media_parts
from tests.support.media import MediaHost, make_video

JUNK = 40_000  # bytes of an ancillary PNG chunk: a download far larger than its pixels


def picture(width: int, height: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def png(pixels: np.ndarray, junk: int = 0) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)
    data = out.getvalue()
    if junk:  # a private ancillary chunk after IHDR, which decoders skip
        body = bytes(junk)
        chunk = struct.pack(">I", len(body)) + b"juNk" + body + struct.pack(">I", zlib.crc32(b"juNk" + body))
        data = data[:33] + chunk + data[33:]
    return data


def chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Wait (a deadline, not a timing) until `condition()`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- #
# MediaMemory alone
# --------------------------------------------------------------------------- #


def test_a_waiter_gets_room_given_back_or_nothing_after_its_deadline():
    async def main():
        memory = MediaMemory(100, wait_s=5)
        first, second = object(), object()
        assert memory.try_take(first, 60)
        assert not memory.try_take(second, 50)
        waiting = asyncio.create_task(memory.take(second, 50, 5.0))
        await until(lambda: memory.waiting == 1, "the second waits")
        memory.give_back(first, 60)
        assert await waiting and memory.used == 50
        assert not await memory.take(first, 60, 0.05)  # no room within its deadline: False, nothing held
        assert memory.used == 50 and memory.waiting == 0
        cancelled = asyncio.create_task(memory.take(first, 60, 5.0))
        await until(lambda: memory.waiting == 1, "a waiter")
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        memory.give_back(second, 50)
        assert memory.used == 0 and memory.waiting == 0

    asyncio.run(main())


def test_two_requests_holding_bytes_never_wait_for_each_other():
    """Each holds 40 of 100 and needs 30 more: waiting both, neither would ever get it. The
    older gets through; the younger gives way (its request answers 429 and releases)."""

    async def main():
        memory = MediaMemory(100, wait_s=5)
        older, younger, newcomer = object(), object(), object()
        assert memory.try_take(older, 40) and memory.try_take(younger, 40)
        younger_wait = asyncio.create_task(memory.take(younger, 30, 5.0))
        await until(lambda: memory.waiting == 1, "the younger waits")
        older_wait = asyncio.create_task(memory.take(older, 30, 5.0))
        assert await younger_wait is False  # gave way at once
        assert not memory.try_take(newcomer, 10)  # room that comes back is the older one's
        memory.give_back(younger, 40)
        assert await older_wait is True and memory.used == 70
        assert memory.try_take(newcomer, 10)
        assert await memory.take(younger, 30, 0.05) is False  # a younger holder never waits on the older
        memory.give_back(older, 70)
        memory.give_back(newcomer, 10)
        assert memory.used == 0

    asyncio.run(main())


# --------------------------------------------------------------------------- #
# Requests
# --------------------------------------------------------------------------- #


def test_an_image_larger_than_the_whole_memory_is_refused_at_once(tmp_path):
    memory = MediaMemory(4000, wait_s=30)
    limits = MediaLimits(memory=memory, fetch_timeout_s=30)
    with pytest.raises(MediaError) as caught:  # 48x32 pixels: 4608 bytes of RGB
        asyncio.run(load_media_parts(chat(data_url(png(picture(48, 32, 0)))), limits))
    error = caught.value
    assert error.status == 400 and error.code == "media_too_large" and "--media-memory" in error.message
    assert error.message.startswith("messages[0].content[0].image_url: ")
    mp4 = make_video(tmp_path / "clip.mp4", frames=25)  # 3 frames of 64x48 sampled: 27648 bytes
    with pytest.raises(MediaError, match="--media-memory"):
        asyncio.run(load_media_parts([{"role": "user", "content": [{"type": "video_url", "video_url": {
            "url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()}}]}], replace(limits, memory=MediaMemory(
                len(mp4) + 20_000, wait_s=30))))
    assert memory.used == 0


@pytest.mark.parametrize("room_comes_back", [True, False])
def test_a_request_past_the_memory_waits_then_proceeds_or_gets_429(room_comes_back):
    """The first request's download (JUNK bytes and a tiny picture) stalls one byte before its
    end, holding its bytes; the second, a 64x64 picture, does not fit beside it."""
    big, small = picture(10, 10, 1), picture(64, 64, 2)
    memory = MediaMemory(JUNK + 10_000, wait_s=30)
    first_limits = MediaLimits(memory=memory, fetch_timeout_s=30, allowed_hosts=HostPolicy.parse(["127.0.0.1"]))
    # The second request's own deadline for waiting is its fetch timeout.
    second_limits = replace(first_limits, fetch_timeout_s=30 if room_comes_back else 0.3)

    async def main(host: MediaHost):
        first = asyncio.create_task(load_media_parts(chat(host.url("/held")), first_limits))
        await until(lambda: memory.used >= JUNK, "the first request holds its download")
        second = asyncio.create_task(load_media_parts(chat(data_url(png(small))), second_limits))
        if room_comes_back:
            await until(lambda: memory.waiting == 1, "the second request waits")
            assert not second.done()
            host.release.set()
            (one,), (two,) = await first, await second
            assert one.content_hash == image_content_hash(big) and two.content_hash == image_content_hash(small)
        else:
            with pytest.raises(MediaBusy) as caught:
                await second
            host.release.set()
            await first
            error = caught.value
            assert (error.status, error.code, error.headers) == (429, "media_busy", {"Retry-After": "1"})
            assert error.message.startswith("messages[0].content[0].image_url: server busy")

    with MediaHost("127.0.0.1") as host:
        host.held_body = png(big, junk=JUNK)
        asyncio.run(main(host))
    assert memory.used == 0 and memory.waiting == 0  # every byte given back


def test_bytes_come_back_after_refusals_and_cancels():
    memory = MediaMemory(1 << 20, wait_s=30)
    limits = MediaLimits(memory=memory, fetch_timeout_s=30)
    good = data_url(png(picture(32, 32, 3)))
    truncated = data_url(png(picture(32, 32, 4))[:200])
    with pytest.raises(MediaError, match="could not be decoded"):
        asyncio.run(load_media_parts(chat(good) + chat(truncated), limits))
    assert memory.used == 0

    async def cancelled():
        held = object()
        assert memory.try_take(held, memory.limit)  # another request holds it all
        task = asyncio.create_task(load_media_parts(chat(good), limits))
        await until(lambda: memory.waiting == 1, "the request waits")
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        memory.give_back(held, memory.limit)

    asyncio.run(cancelled())
    assert memory.used == 0 and memory.waiting == 0
    (image,) = asyncio.run(load_media_parts(chat(good), limits))
    assert image.content_hash == image_content_hash(picture(32, 32, 3)) and memory.used == 0
