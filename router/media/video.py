"""Videos → sampled, size-checked, content-hashed RGB frames.

Decoded with OpenCV (`cv2`, the opencv-python wheel, which mlx-vlm already
uses) from a private temporary file, deleted as soon as the frames are out;
only self-contained containers reach FFmpeg. Frames are sampled at the
request's rate (at most the video's own), or spread evenly over the whole
video when `max_frames` is fewer, and decoding has a deadline. Apart from
the images (decode.py) because a video is a container, a clock and a
sampling, not a picture; each frame is a DecodedImage all the same, and
every refusal the same MediaError.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from router.media.budget import MediaError, NoRoom, PixelBudget
from router.media.decode import DecodedImage, MediaLimits, check_pixels, image_content_hash, too_many_bytes


@dataclass(frozen=True)
class DecodedVideo:
    frames: list[DecodedImage]
    timestamps: list[float]  # seconds into the video of each frame
    fps: float  # the sampling rate used: the requested one, lowered to fit max_frames
    content_hash: str  # SHA-256 hex of the frames' hashes and the sampling settings
    source: str
    where: str


def video_content_hash(frame_hashes: list[str], fps: float, max_frames: int) -> str:
    digest = hashlib.sha256(b"video")
    digest.update(repr(float(fps)).encode() + b"/" + str(max_frames).encode())
    for frame_hash in frame_hashes:
        digest.update(bytes.fromhex(frame_hash))
    return digest.hexdigest()


def _video_suffix(data: bytes) -> str | None:
    """The file suffix of the container, known by its magic bytes. Only self-contained formats
    reach FFmpeg: a playlist (HLS, concat) would make it open other files or URLs."""
    if data[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip"):
        return ".mp4"  # and MOV
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return ".mkv"  # and WebM
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return ".avi"
    return None


def _sample_indices(count: int, source_fps: float, fps: float, max_frames: int) -> tuple[list[int], float]:
    """Frame indices to keep and the rate they sample: `fps` (at most the video's own rate)
    from the start, or `max_frames` spread evenly over the whole video when that is fewer."""
    duration = count / source_fps
    rate = min(fps, source_fps)
    n = max(1, math.ceil(duration * rate - 1e-9))
    if n > max_frames:
        n, rate = max_frames, max_frames / duration
    indices = sorted({min(count - 1, int(k / rate * source_fps + 1e-6)) for k in range(n)})
    return indices, rate


def decode_video_bytes(
    data: bytes,
    limits: MediaLimits,
    where: str,
    fps: float | None = None,
    max_frames: int | None = None,
    source: str = "data",
    budget: PixelBudget | None = None,
) -> DecodedVideo:
    """Encoded video → sampled RGB frames. Blocking (seconds for long videos): call it in a thread."""
    fps = limits.video_fps if fps is None else fps
    max_frames = limits.max_frames if max_frames is None else max_frames
    if len(data) > limits.max_video_bytes:
        raise too_many_bytes(where, "video", limits.max_video_bytes)
    suffix = _video_suffix(data)
    if suffix is None:
        raise MediaError(where, "not a video in a supported container (MP4/MOV, WebM/Matroska, AVI)")
    try:
        import cv2
    except ImportError:
        raise MediaError(
            where, "video input needs OpenCV (the opencv-python package), which is not installed",
            code="unsupported_value",
        )
    deadline = time.monotonic() + limits.video_decode_timeout_s
    # OpenCV reads videos from paths. (Its newer in-memory streams are missing from some
    # opencv-python releases, and keep no reference to the stream they read.)
    with tempfile.NamedTemporaryFile(prefix="tandem-video-", suffix=suffix) as file:
        file.write(data)
        file.flush()
        try:
            return _decode_video(cv2, file.name, limits, where, fps, max_frames, source, budget, deadline)
        except (MediaError, NoRoom):
            raise
        except Exception as exc:  # noqa: BLE001 - cv2.error and numpy's on malformed streams
            raise MediaError(where, f"the video could not be decoded: {exc}")


def _decode_video(cv2: Any, path: str, limits: MediaLimits, where: str, fps: float, max_frames: int,
                  source: str, budget: PixelBudget | None, deadline: float) -> DecodedVideo:
    capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG)
    try:
        if not capture.isOpened():
            raise MediaError(where, "the video could not be opened (corrupt, or a codec FFmpeg lacks)")
        width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if width < 1 or height < 1:
            raise MediaError(where, "the video declares no frame size")
        check_pixels(width, height, limits, where, "each video frame")
        source_fps = capture.get(cv2.CAP_PROP_FPS)
        count = capture.get(cv2.CAP_PROP_FRAME_COUNT)
        if not (math.isfinite(source_fps) and source_fps > 0):
            raise MediaError(where, "the video declares no frame rate")
        if not (math.isfinite(count) and count >= 1):  # e.g. WebM from a browser's recorder
            count = _count_frames(cv2, path, deadline, limits, where)
        if count < 1:
            raise MediaError(where, "the video has no frames")
        indices, rate = _sample_indices(int(count), source_fps, fps, max_frames)
        if budget is not None:  # all frames at once, before any is decoded (a NoRoom retry redoes nothing)
            budget.take(len(indices) * width * height, where)
        frames, timestamps = [], []
        for index, bgr in _read_frames(cv2, capture, indices, source_fps, deadline, limits, where):
            frame_where = f"{where}.frames[{len(frames)}]"
            if bgr.shape[0] * bgr.shape[1] > width * height:  # counted at the declared size
                raise MediaError(frame_where, f"video frame is {bgr.shape[1]}x{bgr.shape[0]}, larger than the "
                                 f"{width}x{height} the video declares")
            rgb = np.ascontiguousarray(bgr[..., ::-1])
            rgb.setflags(write=False)
            frames.append(DecodedImage(rgb, rgb.shape[1], rgb.shape[0], image_content_hash(rgb), source, frame_where))
            timestamps.append(index / source_fps)
    finally:
        capture.release()
    if not frames:
        raise MediaError(where, "no frame of the video could be decoded")
    content_hash = video_content_hash([f.content_hash for f in frames], fps, max_frames)
    return DecodedVideo(frames, timestamps, rate, content_hash, source, where)


def _read_frames(cv2: Any, capture: Any, indices: list[int], source_fps: float, deadline: float,
                 limits: MediaLimits, where: str):
    """Yield (index, BGR frame) for each wanted index while the video has them. Gaps longer
    than a second are seeked over (decoding from the keyframe before), shorter ones read."""
    position = 0  # the index the next grab() returns
    for index in indices:
        if index - position > source_fps:
            capture.set(cv2.CAP_PROP_POS_FRAMES, index)
            position = index
        while position <= index:
            _check_deadline(deadline, limits, where)
            if not capture.grab():
                return  # the video is shorter than it declared: keep what was read
            position += 1
        ok, frame = capture.retrieve()
        if not ok:
            return
        yield index, frame


def _count_frames(cv2: Any, path: str, deadline: float, limits: MediaLimits, where: str) -> int:
    capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG)
    try:
        count = 0
        while capture.grab():
            _check_deadline(deadline, limits, where)
            count += 1
        return count
    finally:
        capture.release()


def _check_deadline(deadline: float, limits: MediaLimits, where: str) -> None:
    if time.monotonic() > deadline:
        raise MediaError(
            where, f"decoding the video took longer than the limit of {limits.video_decode_timeout_s:g} s",
            code="media_too_large",
        )
