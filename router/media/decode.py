"""Images → decoded, size-checked, content-hashed RGB pixels; the limits on
all media (videos: router/media/video.py, whose frames are these images).

What a chat request's media parts hold once fetched (router/media/parts.py) is
decoded here. Every refusal is a `MediaError` (router/media/budget.py): an
`ApiError` (400) whose message starts with the part's path, e.g.
`messages[1].content[2].image_url: image is 12000x12000 = 144000000 pixels,
over the limit of 50331648`. Sizes are checked before pixels are decoded, and
the pixels' bytes taken from the server's media memory (a `NoRoom` when it is
full: the caller waits for room and decodes again).

The content hash is SHA-256 over the decoded RGB pixels plus width and height, so one picture
gives one hash however it arrives or is (losslessly) encoded; the vision cache keys on it.

Choices:
- Transparency is composited on white (what a viewer shows; dropping alpha turns transparent
  areas, often stored as black, into black).
- Animated images (GIF, WebP, APNG) give their first frame.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from environment.settings import Settings
from router.media.budget import MediaError, MediaMemory, NoRoom, PixelBudget
from router.media.fetch import HostPolicy

MiB = 1 << 20

# Pillow opens many formats by sniffing; these are the ones chat clients send. The rest (EPS
# runs Ghostscript, PSD, ICNS, ...) are attack surface with no use here.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG covers MPO (phone photos)


@dataclass(frozen=True)
class MediaLimits:
    # OpenAI's own per-image limit; a 48 MP phone JPEG is 10-15 MB.
    max_image_bytes: int = 20 * MiB
    # 48 MP phone photos (8064x6048) fit; one image is then at most 150 MB of RGB. Below Pillow's
    # bomb threshold (Image.MAX_IMAGE_PIXELS, 89 M), so our check is the one that refuses.
    max_pixels: int = 8192 * 6144
    # All images and video frames of one request: 32 frames of 4K video fit; ~800 MB of RGB.
    max_total_pixels: int = 1 << 28
    # Image parts per request: several screenshots or pages, not an album.
    max_images: int = 16
    # Video parts per request: each may download max_video_bytes and decode max_frames.
    max_videos: int = 4
    # Deadline for a whole download (not per read), so a slow host cannot hold a request.
    fetch_timeout_s: float = 10.0
    # CDNs and URL shorteners redirect once or twice; more is a loop or a detour.
    max_redirects: int = 3
    # Minutes of phone video at 1080p; the router holds it in memory while decoding.
    max_video_bytes: int = 100 * MiB
    # Frames sampled per video: the default and the most a request may ask for. Each frame
    # costs hundreds of vision tokens.
    max_frames: int = 32
    # Sampling rate when a part asks for none (frames per second of video).
    video_fps: float = 1.0
    # The highest sampling rate a part may ask for.
    max_video_fps: float = 8.0
    # Decoding a video runs in a thread that cannot be killed; it gives up after this long.
    video_decode_timeout_s: float = 30.0
    # file:// URLs are served only from inside this directory (symlinks resolved); None: refused.
    allowed_local_dir: Path | None = None
    # http(s) media from public addresses, and from these (--allow-media-hosts; router/media/fetch.py).
    allowed_hosts: HostPolicy = HostPolicy()
    # The bytes all requests' media may hold at once (--media-memory); None: no bound.
    memory: MediaMemory | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> MediaLimits:
        """The limits `tandem serve`'s options set; the rest keep their defaults. One
        MediaMemory per call: the app builds its limits once, and all its requests share it."""
        return cls(max_images=settings.max_images, max_pixels=settings.max_image_pixels,
                   fetch_timeout_s=settings.media_fetch_timeout_s, max_frames=settings.max_video_frames,
                   allowed_local_dir=Path(settings.allow_local_media) if settings.allow_local_media else None,
                   allowed_hosts=HostPolicy.parse(settings.allow_media_hosts),
                   memory=MediaMemory(settings.media_budget_bytes, settings.media_fetch_timeout_s))


@dataclass(frozen=True)
class DecodedImage:
    pixels: np.ndarray  # H x W x 3 uint8 RGB, read-only so it always matches content_hash
    width: int
    height: int
    content_hash: str  # SHA-256 hex of width, height and pixels
    source: str  # "data" | "http" | "file"
    where: str  # the part's path, e.g. "messages[0].content[1].image_url"
    detail: str = "auto"  # OpenAI's image_url.detail


# --------------------------------------------------------------------------- #
# Hashes
# --------------------------------------------------------------------------- #


def image_content_hash(pixels: np.ndarray) -> str:
    height, width, _ = pixels.shape
    digest = hashlib.sha256(b"rgb")
    digest.update(width.to_bytes(8, "little") + height.to_bytes(8, "little"))
    digest.update(np.ascontiguousarray(pixels, dtype=np.uint8).data)
    return digest.hexdigest()


def check_pixels(width: int, height: int, limits: MediaLimits, where: str, what: str = "image") -> None:
    if width * height > limits.max_pixels:
        raise MediaError(
            where,
            f"{what} is {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels}",
            code="media_too_large",
        )


def too_many_bytes(where: str, what: str, limit: int) -> MediaError:
    return MediaError(where, f"{what} is larger than the limit of {limit} bytes", code="media_too_large")


# --------------------------------------------------------------------------- #
# Images
# --------------------------------------------------------------------------- #


class RecentImages:
    """Pictures this router decoded lately, by the SHA-256 of what arrived (a
    data URL's text, or the bytes fetched from a URL or a file). A
    conversation resends its picture on every turn; decoding it again
    (base64, inflate, orientation, RGB, the pixel hash: ~35 ms for a 1024²
    PNG on the CPU) was most of what a cached picture turn cost. Bounded by
    the pixels' bytes, least recently used first out; thread-safe (images
    are decoded in threads)."""

    def __init__(self, max_bytes: int = 256 * MiB):
        self.max_bytes = max_bytes
        self.hits = 0
        self._images: OrderedDict[bytes, DecodedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> DecodedImage | None:
        with self._lock:
            image = self._images.get(key)
            if image is not None:
                self._images.move_to_end(key)
                self.hits += 1
            return image

    def put(self, key: bytes, image: DecodedImage) -> None:
        size = image.pixels.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._images:
                return
            self._images[key] = image
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._images.popitem(last=False)
                self._bytes -= old.pixels.nbytes


def decode_image_bytes(
    data: bytes,
    limits: MediaLimits,
    where: str,
    source: str = "data",
    detail: str = "auto",
    budget: PixelBudget | None = None,
    recent: RecentImages | None = None,
    key: bytes = b"",
) -> DecodedImage:
    """Encoded image → RGB pixels. Blocking (a 48 MP JPEG takes ~1 s): call it in a thread.
    With `recent`, bytes decoded lately are not decoded again (same pixels, same hash);
    `key` names them there (default: their SHA-256)."""
    if len(data) > limits.max_image_bytes:
        raise too_many_bytes(where, "image", limits.max_image_bytes)
    if recent is not None:
        key = key or hashlib.sha256(data).digest()
        known = recent.get(key)
        if known is not None:
            return reuse_image(known, limits, where, source, detail, budget)
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            # Image.open reads only the header: refuse by size before decoding anything.
            check_pixels(*image.size, limits, where)
            if budget is not None:
                budget.take(image.size[0] * image.size[1], where)
            image.load()
            ImageOps.exif_transpose(image, in_place=True)  # phones store portraits sideways
            pixels = _rgb_pixels(image)
    except (MediaError, NoRoom):
        raise
    except Image.DecompressionBombError as exc:
        raise MediaError(where, f"image has more pixels than allowed: {exc}", code="media_too_large")
    except UnidentifiedImageError:
        raise MediaError(where, f"not an image in a supported format ({', '.join(IMAGE_FORMATS)})")
    except Exception as exc:  # noqa: BLE001 - Pillow's decoders raise many types on bad data
        raise MediaError(where, f"the image could not be decoded: {exc}")
    height, width, _ = pixels.shape
    image = DecodedImage(pixels, width, height, image_content_hash(pixels), source, where, detail)
    if recent is not None:
        recent.put(key, image)
    return image


def reuse_image(known: DecodedImage, limits: MediaLimits, where: str, source: str, detail: str,
           budget: PixelBudget | None) -> DecodedImage:
    """A remembered picture for this part, under this request's limits."""
    check_pixels(known.width, known.height, limits, where)
    if budget is not None:
        budget.take(known.width * known.height, where, decoded=False)  # its pixels exist already
    return replace(known, source=source, where=where, detail=detail)


def _rgb_pixels(image: Image.Image) -> np.ndarray:
    if image.mode.startswith("I;16") or image.mode == "I":
        # 16-bit grayscale: scale to 8 bits (Pillow's own conversion clips at 255: all white).
        wide = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
        image = Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), "L")
    elif image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba)
    pixels = np.asarray(image.convert("RGB"))
    pixels.setflags(write=False)  # no-op when numpy already made it read-only
    return pixels
