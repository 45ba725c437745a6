"""A chat request's images and videos: found in its messages, fetched, decoded.

An `image_url` or `video_url` content part names its media by a `data:` URL, an `http(s)://`
URL (fetched within a byte limit and one deadline for the whole download), or a `file://` URL
inside `MediaLimits.allowed_local_dir` (only when one is set). Anything else is refused, with
a `MediaError` naming the part. The bytes are decoded by router/media.py.

Remote fetches ignore the server's environment (proxy variables, ~/.netrc credentials): the
client picks the URL, so the server's credentials must not travel with it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

import httpx

from router.media import (
    DecodedImage,
    DecodedVideo,
    MediaError,
    MediaLimits,
    PixelBudget,
    RecentImages,
    decode_image_bytes,
    decode_video_bytes,
    reuse_image,
    too_many_bytes,
)

IMAGE_DETAILS = ("auto", "low", "high")
MEDIA_PART_TYPES = {"image_url": "image", "video_url": "video"}


# --------------------------------------------------------------------------- #
# Fetching: data:, http(s)://, file://
# --------------------------------------------------------------------------- #


async def fetch_url(url: str, limits: MediaLimits, where: str, max_bytes: int) -> tuple[bytes, str]:
    """The bytes a media URL names and its kind ("data", "http", "file"), at most max_bytes.
    Never blocks the event loop: decoding base64 and reading files run in a thread."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "data":
        return await asyncio.to_thread(_read_data_url, url, where, max_bytes), "data"
    if scheme in ("http", "https"):
        return await _fetch_http(url, limits, where, max_bytes), "http"
    if scheme == "file":
        return await asyncio.to_thread(_read_local_file, url, limits, where, max_bytes), "file"
    shown = url if len(url) <= 80 else url[:77] + "..."
    raise MediaError(
        where, f"unsupported URL '{shown}': expected a data:, http://, https:// or file:// URL",
        code="invalid_media_url",
    )


def _read_data_url(url: str, where: str, max_bytes: int) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise MediaError(where, "malformed data URL: no ',' before the data", code="invalid_media_url")
    if not header.lower().endswith(";base64"):
        data = unquote_to_bytes(payload)  # the rare percent-encoded form
    elif len(payload) // 4 * 3 > max_bytes + 3:  # refuse before decoding
        raise too_many_bytes(where, "the data URL's content", max_bytes)
    else:
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error:
            try:  # MIME-style base64 wrapped over lines
                data = base64.b64decode("".join(payload.split()), validate=True)
            except binascii.Error as exc:
                raise MediaError(where, f"the data URL's base64 is invalid: {exc}", code="invalid_media_url")
    if len(data) > max_bytes:
        raise too_many_bytes(where, "the data URL's content", max_bytes)
    return data


def _read_local_file(url: str, limits: MediaLimits, where: str, max_bytes: int) -> bytes:
    if limits.allowed_local_dir is None:
        raise MediaError(where, "file:// URLs are not allowed on this server (no local media directory is set)",
                         code="invalid_media_url")
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not path.startswith("/"):
        raise MediaError(where, f"'{url}' is not a file:// URL of an absolute local path", code="invalid_media_url")
    # Resolve symlinks and '..' first, then require the real path inside the allowed directory.
    # The same answer whether or not an outside file exists, so the URL cannot probe the disk.
    real = os.path.realpath(path)
    if not Path(real).is_relative_to(os.path.realpath(limits.allowed_local_dir)):
        raise MediaError(where, f"'{url}' is outside the allowed local media directory", code="invalid_media_url")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer. O_NOFOLLOW: no symlink swapped in.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise MediaError(where, f"cannot open '{url}': {exc.strerror}", code="invalid_media_url")
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(where, f"'{url}' is not a regular file", code="invalid_media_url")
        if info.st_size > max_bytes:
            raise too_many_bytes(where, f"'{url}'", max_bytes)
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:  # the file grew since fstat
        raise too_many_bytes(where, f"'{url}'", max_bytes)
    return data


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # One context for all fetches: building one loads the CA bundle (milliseconds each time).
    return httpx.create_ssl_context()


async def _fetch_http(url: str, limits: MediaLimits, where: str, max_bytes: int) -> bytes:
    host = urlsplit(url).netloc.rpartition("@")[2]  # never echo credentials in URLs
    if not host:
        raise MediaError(where, f"'{url[:80]}' names no host", code="invalid_media_url")
    timed_out = MediaError(
        where, f"fetching from {host} took longer than the limit of {limits.fetch_timeout_s:g} s",
        code="media_fetch_timeout",
    )
    try:
        async with (
            asyncio.timeout(limits.fetch_timeout_s),  # one deadline for the whole fetch
            httpx.AsyncClient(
                follow_redirects=True,
                max_redirects=limits.max_redirects,
                timeout=limits.fetch_timeout_s,
                trust_env=False,
                verify=_tls_context(),
            ) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise MediaError(where, f"fetching from {host} returned HTTP {response.status_code}",
                                 code="invalid_media_url")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise too_many_bytes(where, f"the file at {host}", max_bytes)
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():  # decompressed: counts gzip bombs too
                size += len(chunk)
                if size > max_bytes:
                    raise too_many_bytes(where, f"the file at {host}", max_bytes)
                chunks.append(chunk)
            return b"".join(chunks)
    except (TimeoutError, httpx.TimeoutException):
        raise timed_out from None
    except httpx.TooManyRedirects:
        raise MediaError(where, f"fetching from {host} took more than {limits.max_redirects} redirects",
                         code="invalid_media_url")
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise MediaError(where, f"could not fetch from {host}: {exc or type(exc).__name__}",
                         code="invalid_media_url")


# --------------------------------------------------------------------------- #
# Chat messages
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class MediaPart:
    kind: str  # "image" | "video"
    url: str
    where: str  # e.g. "messages[0].content[1].image_url"
    detail: str = "auto"
    fps: float | None = None
    max_frames: int | None = None


def find_media_parts(messages: list[dict], limits: MediaLimits) -> list[MediaPart]:
    """The image and video parts of all messages, in order, checked for shape and count."""
    found: list[MediaPart] = []
    counts = {"image": 0, "video": 0}
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            part_type = part.get("type") if isinstance(part, dict) else None
            kind = MEDIA_PART_TYPES.get(part_type) if isinstance(part_type, str) else None
            if kind is None:
                continue  # text parts, and shapes router/schemas.py reports
            counts[kind] += 1
            most = limits.max_images if kind == "image" else limits.max_videos
            if counts[kind] > most:
                raise MediaError(f"messages[{i}].content[{j}]", f"over the limit of {most} {kind}s per request",
                                 code="media_too_large")
            found.append(_media_part(kind, part, f"messages[{i}].content[{j}].{part['type']}", limits))
    return found


def _media_part(kind: str, part: dict, where: str, limits: MediaLimits) -> MediaPart:
    spec = part.get(part["type"])
    if isinstance(spec, str):  # some clients send "image_url": "https://..."
        spec = {"url": spec}
    url = spec.get("url") if isinstance(spec, dict) else None
    if not isinstance(url, str) or not url:
        raise MediaError(where, "missing its 'url' (a string)", code="invalid_media_url")
    if kind == "image":
        detail = spec.get("detail") or "auto"
        if detail not in IMAGE_DETAILS:
            raise MediaError(where + ".detail", f"expected one of {', '.join(IMAGE_DETAILS)}, but got {detail!r}")
        return MediaPart(kind, url, where, detail=detail)
    fps, max_frames = spec.get("fps"), spec.get("max_frames")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float))
                            or not 0 < fps <= limits.max_video_fps):
        raise MediaError(where + ".fps", f"expected a number in (0, {limits.max_video_fps:g}], but got {fps!r}")
    if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int)
                                   or not 1 <= max_frames <= limits.max_frames):
        raise MediaError(where + ".max_frames",
                         f"expected an integer in [1, {limits.max_frames}], but got {max_frames!r}")
    return MediaPart(kind, url, where, fps=None if fps is None else float(fps), max_frames=max_frames)


def _known_data_url(url: str, recent: RecentImages) -> tuple[bytes, DecodedImage | None]:
    key = hashlib.sha256(url.encode("utf-8", "surrogatepass")).digest()
    return key, recent.get(key)


async def load_part(
    part: MediaPart, limits: MediaLimits, budget: PixelBudget | None = None, recent: RecentImages | None = None
) -> DecodedImage | DecodedVideo:
    if part.kind == "image":
        key = b""
        if recent is not None and part.url.startswith("data:"):
            # A data URL is known by its text: no base64 decode (~9 ms for 4 MB) to find it.
            key, known = await asyncio.to_thread(_known_data_url, part.url, recent)
            if known is not None:
                return reuse_image(known, limits, part.where, "data", part.detail, budget)
        data, source = await fetch_url(part.url, limits, part.where, limits.max_image_bytes)
        return await asyncio.to_thread(decode_image_bytes, data, limits, part.where, source, part.detail, budget,
                                       recent, key)
    data, source = await fetch_url(part.url, limits, part.where, limits.max_video_bytes)
    return await asyncio.to_thread(
        decode_video_bytes, data, limits, part.where, part.fps, part.max_frames, source, budget
    )


async def load_media_parts(
    messages: list[dict], limits: MediaLimits, recent: RecentImages | None = None
) -> list[DecodedImage | DecodedVideo]:
    """Every image and video of a chat request, decoded (images found in `recent`
    are not decoded again), in message order. Parts load concurrently; the first
    refusal cancels the rest and is raised as a MediaError."""
    parts = find_media_parts(messages, limits)
    budget = PixelBudget(limits.max_total_pixels)
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(load_part(part, limits, budget, recent)) for part in parts]
    except BaseExceptionGroup as failed:
        media_errors = [e for e in failed.exceptions if isinstance(e, MediaError)]
        raise (media_errors or list(failed.exceptions))[0] from None
    return [task.result() for task in tasks]
