"""A chat request's images and videos: found in its messages, fetched, decoded.

An `image_url` or `video_url` content part names its media by a `data:` URL, an `http(s)://`
URL (fetched by router/media/fetch.py: public addresses only unless `--allow-media-hosts` says
otherwise, within a byte limit and one deadline for the whole download), or a `file://` URL
inside `MediaLimits.allowed_local_dir` (only when one is set). Anything else is refused, with
a `MediaError` naming the part. The bytes are decoded by router/media/decode.py.

Every http(s) failure but the size limits (a blocked or unknown host, a closed port, a timeout,
an HTTP error, a bad redirect, bytes that are no image or video) is the same 400 with the same
text (`fetch_failed`), so a client cannot map the server's network by the answers; the server
logs the real reason.

A request's media hold bytes of the server's media memory while they are fetched and decoded
(router/media/budget.py): a part that finds it full waits for room (429 past the deadline);
all is given back when the request's media are decoded or refused.

Remote fetches ignore the server's environment (proxy variables, ~/.netrc credentials): the
client picks the URL, so the server's credentials must not travel with it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

import httpx

from router.api.errors import ApiError
from router.media.decode import (
    DecodedImage,
    MediaError,
    MediaLimits,
    RecentImages,
    decode_image_bytes,
    reuse_image,
    too_many_bytes,
)
from router.media.budget import NoRoom, PixelBudget
from router.media.fetch import TooLarge, Unfetchable, fetch_http
from router.media.video import DecodedVideo, decode_video_bytes

log = logging.getLogger("tandem.router.media")

IMAGE_DETAILS = ("auto", "low", "high")
MEDIA_PART_TYPES = {"image_url": "image", "video_url": "video"}
FETCH_FAILED = ("could not fetch media from this URL (unreachable, not allowed by this server, too slow, "
                "or not an image or video it can decode)")


def fetch_failed(where: str) -> MediaError:
    """The one answer to every http(s) failure that could tell a client about the network."""
    return MediaError(where, FETCH_FAILED, code="media_fetch_failed")


# --------------------------------------------------------------------------- #
# Fetching: data:, http(s)://, file://
# --------------------------------------------------------------------------- #


async def fetch_url(url: str, limits: MediaLimits, where: str, max_bytes: int,
                    budget: PixelBudget | None = None) -> tuple[bytes, str]:
    """The bytes a media URL names and its kind ("data", "http", "file"), at most max_bytes,
    taken from `budget`'s media memory (until given back). Never blocks the event loop:
    decoding base64 and reading files run in a thread."""
    budget = budget or PixelBudget(limits.max_total_pixels)
    if url[:5].lower() == "data:":  # before urlsplit: no copies of a large data URL on the event loop
        return await _in_thread(budget, _read_data_url, url, where, max_bytes, budget), "data"
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError:  # e.g. an unclosed '[' in the host
        raise MediaError(where, "not a valid URL", code="invalid_media_url") from None
    if scheme in ("http", "https"):
        return await _fetch_http(url, limits, where, max_bytes, budget), "http"
    if scheme == "file":
        return await _in_thread(budget, _read_local_file, url, limits, where, max_bytes, budget), "file"
    raise MediaError(
        where, f"unsupported URL '{_shown(url)}': expected a data:, http://, https:// or file:// URL",
        code="invalid_media_url",
    )


def _shown(url: str) -> str:
    """The URL as an error message may echo it: short, and what JSON's UTF-8 can carry (a lone
    surrogate, which JSON text may hold, escaped)."""
    url = url if len(url) <= 80 else url[:77] + "..."
    return url.encode("utf-8", "backslashreplace").decode("utf-8")


async def _in_thread(budget: PixelBudget, fn, *args):
    """`fn(*args)` in a thread. A thread never waits for the server's media memory: when it
    finds it full (NoRoom), the room is waited for here, on the event loop (429 past the
    request's deadline), and `fn` runs again with it."""
    while True:
        try:
            return await asyncio.to_thread(fn, *args)
        except NoRoom as short:
            await budget.wait_for_room(short.nbytes, short.where)


def _read_data_url(url: str, where: str, max_bytes: int, budget: PixelBudget) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise MediaError(where, "malformed data URL: no ',' before the data", code="invalid_media_url")
    is_base64 = header.lower().endswith(";base64")
    # The most the payload decodes to, refused before decoding when over the limit.
    most = len(payload) // 4 * 3 + 3 if is_base64 else len(payload)
    if most > (max_bytes + 6 if is_base64 else 3 * max_bytes + 3):
        raise too_many_bytes(where, "the data URL's content", max_bytes)
    budget.take_bytes(most, where)
    if not is_base64:
        data = unquote_to_bytes(payload)  # the rare percent-encoded form
    else:
        try:
            data = base64.b64decode(payload, validate=True)
        except ValueError:  # binascii.Error, or characters outside ASCII
            try:  # MIME-style base64 wrapped over lines
                data = base64.b64decode("".join(payload.split()), validate=True)
            except ValueError as exc:
                raise MediaError(where, f"the data URL's base64 is invalid: {exc}", code="invalid_media_url")
    budget.give_back(most - len(data))
    if len(data) > max_bytes:
        raise too_many_bytes(where, "the data URL's content", max_bytes)
    return data


def _read_local_file(url: str, limits: MediaLimits, where: str, max_bytes: int, budget: PixelBudget) -> bytes:
    if limits.allowed_local_dir is None:
        raise MediaError(where, "file:// URLs are not allowed on this server (no local media directory is set)",
                         code="invalid_media_url")
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not path.startswith("/"):
        raise MediaError(where, f"'{_shown(url)}' is not a file:// URL of an absolute local path",
                         code="invalid_media_url")
    if "\0" in path:  # no file has one; os calls raise ValueError on it
        raise MediaError(where, "a file:// URL's path cannot hold a NUL byte", code="invalid_media_url")
    # Resolve symlinks and '..' first, then require the real path inside the allowed directory.
    # The same answer whether or not an outside file exists, so the URL cannot probe the disk.
    try:
        real = os.path.realpath(path)
        inside = Path(real).is_relative_to(os.path.realpath(limits.allowed_local_dir))
    except (OSError, ValueError):  # a path the OS cannot take (unencodable, too long)
        raise MediaError(where, f"'{_shown(url)}' is not a valid local path", code="invalid_media_url") from None
    if not inside:
        raise MediaError(where, f"'{_shown(url)}' is outside the allowed local media directory",
                         code="invalid_media_url")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer. O_NOFOLLOW: no symlink swapped in.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:
        raise MediaError(where, f"cannot open '{_shown(url)}': {getattr(exc, 'strerror', None) or exc}",
                         code="invalid_media_url")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # before fdopen, which refuses a folder with IsADirectoryError
        os.close(fd)
        raise MediaError(where, f"'{_shown(url)}' is not a regular file", code="invalid_media_url")
    with os.fdopen(fd, "rb") as file:
        if info.st_size > max_bytes:
            raise too_many_bytes(where, f"'{_shown(url)}'", max_bytes)
        budget.take_bytes(info.st_size, where)
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:  # the file grew since fstat
        raise too_many_bytes(where, f"'{_shown(url)}'", max_bytes)
    if len(data) > info.st_size:
        budget.take_bytes(len(data) - info.st_size, where)
    else:
        budget.give_back(info.st_size - len(data))
    return data


async def _fetch_http(url: str, limits: MediaLimits, where: str, max_bytes: int, budget: PixelBudget) -> bytes:
    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL:
        raise MediaError(where, f"'{_shown(url)}' is not a valid URL", code="invalid_media_url") from None
    if not host:
        raise MediaError(where, f"'{_shown(url)}' names no host", code="invalid_media_url")
    try:
        return await fetch_http(url, limits.allowed_hosts, max_bytes, limits.fetch_timeout_s, limits.max_redirects,
                                budget, where)
    except TooLarge as exc:  # only a host the policy allows, and that answered, gets this far
        log.info("%s: the media at %r: %s", where, host, exc)
        raise too_many_bytes(where, "the file at this URL", max_bytes) from None
    except Unfetchable as exc:
        log.info("%s: could not fetch media from %r: %s", where, host, exc)
        raise fetch_failed(where) from None


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
                continue  # text parts, and shapes router/api/openai_request.py reports
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
    budget = budget or PixelBudget(limits.max_total_pixels)
    if part.kind == "image":
        key = b""
        if recent is not None and part.url.startswith("data:"):
            # A data URL is known by its text: no base64 decode (~9 ms for 4 MB) to find it.
            key, known = await asyncio.to_thread(_known_data_url, part.url, recent)
            if known is not None:
                return reuse_image(known, limits, part.where, "data", part.detail, budget)
        data, source = await fetch_url(part.url, limits, part.where, limits.max_image_bytes, budget)
        decode = (decode_image_bytes, data, limits, part.where, source, part.detail, budget, recent, key)
    else:
        data, source = await fetch_url(part.url, limits, part.where, limits.max_video_bytes, budget)
        decode = (decode_video_bytes, data, limits, part.where, part.fps, part.max_frames, source, budget)
    try:
        return await _in_thread(budget, *decode)
    except MediaError as exc:
        if source == "http" and exc.code == "invalid_media":  # what a URL holds tells of the network too
            log.info("%s: the media fetched from a URL: %s", part.where, exc)
            raise fetch_failed(part.where) from None
        raise
    finally:
        budget.give_back(len(data))  # the download: dropped once decoded


async def load_media_parts(
    messages: list[dict], limits: MediaLimits, recent: RecentImages | None = None
) -> list[DecodedImage | DecodedVideo]:
    """Every image and video of a chat request, decoded (images found in `recent`
    are not decoded again), in message order. Parts load concurrently, under the
    server's media memory (limits.memory), all given back on return; the first
    refusal cancels the rest and is raised (a MediaError, or MediaBusy)."""
    parts = find_media_parts(messages, limits)
    budget = PixelBudget(limits.max_total_pixels, limits.memory, limits.fetch_timeout_s)
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(load_part(part, limits, budget, recent)) for part in parts]
    except BaseExceptionGroup as failed:
        refusals = sorted((e for e in failed.exceptions if isinstance(e, ApiError)),
                          key=lambda e: not isinstance(e, MediaError))  # a 400 before a 429
        raise (refusals or list(failed.exceptions))[0] from None
    finally:
        budget.release()
    return [task.result() for task in tasks]
