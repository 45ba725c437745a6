"""The vision workload of `tandem bench` (issue 6): what a VLM server's caches save.

- image: a conversation about one picture (`image_size` square, PNG as a data
  URL). Turn 1 sends the picture and a question; turns 2 and 3 resend the
  whole conversation (the same picture, the answers so far, a new question),
  as OpenAI clients do. Then a text-only request, in a fresh conversation,
  with about as many prompt tokens as turn 3 adds to turn 2: what turn 3
  would cost if the picture and the history cost nothing. The ratios issue 6
  asks for: turn 1 / turn 3 time to first token (what the caches save) and
  turn 3 / text-only (how close a cached turn gets to plain text).
- video: for each frame count, a video of that many frames at 1 fps (an mp4
  written with OpenCV), asked about cold, then again with a new question
  (cached: same video, new conversation). The video goes as a data URL, or
  where the system fails on that (mlx-vlm hands the URL to FFmpeg, whose
  data: protocol opens short videos only) as an http URL of a local HTTP
  server thread (vllm-mlx refuses loopback URLs); the warm-up finds out which
  with the longest video, and `video_transport` records it. Token counts are
  what each server's usage reports; systems sample and merge frames
  differently (Qwen2.5-VL's native video path merges frame pairs, Tandem
  encodes each frame as a picture), so compare them with `prompt_tokens`.

Every request is greedy and streamed with `max_tokens` = `vision_max_tokens`.
Each repeat uses a new picture and new videos (a function of seed, repeat and
frame count), so nothing is cached across repeats or across runs with another
seed; the same seed gives the same media to every system. Before measuring,
one picture and one video (never used again) warm the vision path up.
A request a system refuses (a peer without video, a text-only server) is
recorded with its status and error; the workload goes on.
"""

from __future__ import annotations

import base64
import functools
import http.server
import io
import random
import re
import tempfile
import threading
from pathlib import Path

import numpy as np

from benchmarks.bench.workloads.core import Target, WorkloadConfig, _client, _point, scrape_counters, send, words
from benchmarks.bench.workloads.loadgen import Progress, RequestResult, percentile

VIDEO_FPS = 1.0  # the videos' frame rate: every system's default sampling (1-2 fps) keeps every frame


# ---------------------------------------------------------------- media

def bench_picture(size: int, seed: int, salt: str, step: int = 0) -> np.ndarray:
    """A deterministic size x size RGB picture (uint8 H x W x 3): a smooth
    two-colour gradient with a few filled shapes, all chosen by (seed, salt).
    `step` moves the shapes (video frames of one clip share everything else)."""
    from PIL import Image, ImageDraw

    rng = random.Random(f"{seed}:picture:{salt}")
    c0 = np.array([rng.randrange(256) for _ in range(3)], dtype=np.float32)
    c1 = np.array([rng.randrange(256) for _ in range(3)], dtype=np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    axis = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    t = (np.cos(angle) * axis[None, :] + np.sin(angle) * axis[:, None]) * 0.5 + 0.5  # 0..1 along the angle
    pixels = (c0 * (1 - t[..., None]) + c1 * t[..., None]).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        colour = tuple(rng.randrange(256) for _ in range(3))
        r = rng.uniform(0.05, 0.2) * size
        x, y = rng.uniform(0, size), rng.uniform(0, size)
        dx, dy = rng.uniform(-0.06, 0.06) * size, rng.uniform(-0.06, 0.06) * size
        x, y = (x + dx * step) % size, (y + dy * step) % size
        box = (x - r, y - r, x + r, y + r)
        if rng.random() < 0.5:
            draw.ellipse(box, fill=colour)
        else:
            draw.rectangle(box, fill=colour)
    return np.asarray(image)


def png_data_url(pixels: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def write_video(path: Path, frames: int, size: int, seed: int, salt: str, fps: float = VIDEO_FPS) -> Path:
    """An mp4 (MPEG-4 part 2, which every OpenCV/FFmpeg build reads) of `frames` frames at `fps`."""
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (size, size))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {path} (no mp4v encoder in this build)")
    try:
        for k in range(frames):
            writer.write(np.ascontiguousarray(bench_picture(size, seed, salt, step=k)[..., ::-1]))  # BGR
    finally:
        writer.release()
    return path


class MediaServer:
    """Serves the files of one folder over HTTP on 127.0.0.1 from a daemon thread, for the
    length of a `with`. Byte ranges are honoured: FFmpeg (which mlx-vlm hands video URLs to)
    seeks to an mp4's index at its end, and fails on a server that ignores Range."""

    def __init__(self, folder: Path):
        handler = functools.partial(_MediaHandler, Path(folder))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="bench-media", daemon=True)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{name}"

    def __enter__(self) -> MediaServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


class _MediaHandler(http.server.BaseHTTPRequestHandler):
    def __init__(self, folder: Path, *args, **kwargs):
        self.folder = folder
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        self._serve(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        name = self.path.split("?", 1)[0].lstrip("/")
        path = self.folder / name
        if not name or "/" in name or name.startswith(".") or not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start, end, status = 0, len(data) - 1, 200
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", (self.headers.get("Range") or "").strip())
        if m and (m[1] or m[2]):
            start, end = (int(m[1]), int(m[2]) if m[2] else len(data) - 1) if m[1] else \
                (max(0, len(data) - int(m[2])), len(data) - 1)
            end = min(end, len(data) - 1)
            if start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "video/mp4" if name.endswith(".mp4") else "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if body:
            try:
                self.wfile.write(data[start:end + 1])
            except (BrokenPipeError, ConnectionResetError):  # a reader that seeks elsewhere hangs up
                pass

    def log_message(self, format, *args) -> None:  # the base class's signature; quiet
        pass


# ---------------------------------------------------------------- messages

def question(seed: int, salt: str, n_words: int = 12) -> str:
    return f"[{salt}] Describe what you see, then use these words: {words(n_words, seed, 'q:' + salt)}"


def image_turn(data_url: str, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                        {"type": "text", "text": text}]}


def video_turn(url: str, frames: int, text: str) -> dict:
    # fps / max_frames are Tandem's fields (router/media/decode.py); the peers ignore them and sample
    # this 1 fps video at their own default rate (2 fps), which keeps every frame too. (mlx-vlm's
    # 16-frame cap is for processors without native video; Qwen2.5-VL's has it.)
    return {"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url, "fps": VIDEO_FPS, "max_frames": frames}},
        {"type": "text", "text": text}]}


def text_words_for(new_tokens: int | None, overhead: int | None, fallback: int) -> int:
    """Words for the text-only request: the prompt tokens to match, less the chat template's own."""
    if new_tokens is None:
        return fallback
    return max(1, new_tokens - (overhead or 0))


# ---------------------------------------------------------------- the workload

async def vision(target: Target, cfg: WorkloadConfig, metrics_url: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="tandem-bench-media-") as tmp:
        folder = Path(tmp)
        with MediaServer(folder) as media:
            async with _client(2) as client:
                warmup, transport = await _warm_up(client, target, cfg, folder, media)
                before = await _vision_counters(metrics_url)  # the measured requests' own
                image = await _image_conversations(client, target, cfg)
                video = await _videos(client, target, cfg, folder, media, transport or "data")
    after = await _vision_counters(metrics_url)
    out = {"image_size": cfg.image_size, "video_size": cfg.video_size, "max_tokens": cfg.vision_max_tokens,
           "warmup_errors": warmup, "video_transport": transport, **image, "video": video, "vision_cache": None}
    if before and after:
        out["vision_cache"] = {"queries": after[0] - before[0], "hits": after[1] - before[1]}
    return out


def video_url(path: Path, transport: str, media: MediaServer) -> str:
    if transport == "http":
        return media.url(path.name)
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


async def _warm_up(client, target: Target, cfg: WorkloadConfig, folder: Path,
                   media: MediaServer) -> tuple[list[str], str | None]:
    """One conversation as the image workload has them (three turns about a
    picture, then a text-only request) and one video of the most frames asked
    for (of 4 where that fails both ways), never used again: first-call costs
    (compilation, lazy loading, kernels for a follow-up turn's shapes) stay
    out of every system's numbers. Returns the warm-up's errors and the video
    transport that worked ("data", "http", or None: neither, or no videos
    asked for)."""
    conversation = await _conversation(client, target, cfg, "vision-warmup", None)
    errors = [f"image, {key}: {_error_line(p)}" for key in ("turn1", "turn2", "turn3", "text")
              if (p := conversation[key]) is not None and not p["ok"]]
    if not cfg.video_frames:
        return errors, None
    # The longest video first: a server may read short data URLs only (mlx-vlm hands the URL to
    # FFmpeg, whose data: protocol fails on long ones), and the transport must carry every size.
    video_errors = []
    for n in dict.fromkeys((max(cfg.video_frames), 4)):
        path = write_video(folder / f"warmup-{n}.mp4", n, cfg.video_size, cfg.seed, f"video-warmup-{n}")
        for transport in ("data", "http"):
            r = await send(client, target, cfg, [video_turn(video_url(path, transport, media), n,
                                                            question(cfg.seed, "video-warmup"))], cfg.vision_max_tokens)
            if r.ok:
                return errors + video_errors, transport  # a refused data URL stays on record
            video_errors.append(f"{n}-frame video as {transport} URL: {r.status} {r.error}"[:300])
    return errors + video_errors, None


async def _image_conversations(client, target: Target, cfg: WorkloadConfig) -> dict:
    progress = Progress(f"{target.name} vision image", cfg.vision_repeats * 4 + 1)
    # The chat template's own tokens: a one-word prompt's prompt_tokens less one.
    probe = await send(client, target, cfg, [{"role": "user", "content": "ok"}], 1)
    progress.update(probe)
    overhead = probe.prompt_tokens - 1 if probe.ok and probe.prompt_tokens else None
    runs = [await _conversation(client, target, cfg, f"vision-{rep}", overhead, progress)
            for rep in range(cfg.vision_repeats)]
    progress.close()
    out: dict = {"repeats": runs, "template_overhead_tokens": overhead}
    for key in ("turn1", "turn2", "turn3", "text"):
        pts = [r[key] for r in runs if r[key] is not None]
        out[f"{key}_ttft_s"] = percentile([p["ttft_s"] for p in pts if p["ok"] and p["ttft_s"] is not None], 50)
        out[f"{key}_prompt_tokens"] = _first(p["prompt_tokens"] for p in pts)
        out[f"{key}_cached_tokens"] = _first(p["cached_tokens"] for p in pts)
    p3, c3 = out["turn3_prompt_tokens"], out["turn3_cached_tokens"]
    out["turn3_added_tokens"] = _first(r["turn3_added_tokens"] for r in runs)
    out["turn3_computed_tokens"] = p3 - c3 if p3 is not None and c3 is not None else None
    out["turn1_over_turn3"] = _ratio(out["turn1_ttft_s"], out["turn3_ttft_s"])
    out["turn3_over_text"] = _ratio(out["turn3_ttft_s"], out["text_ttft_s"])
    failed = [p for r in runs for p in (r["turn1"], r["turn2"], r["turn3"], r["text"]) if p and not p["ok"]]
    out["errors"] = len(failed) + (0 if probe.ok else 1)
    out["first_error"] = _error_line(failed[0]) if failed else (None if probe.ok else _error_line(_point(probe)))
    return out


async def _conversation(client, target: Target, cfg: WorkloadConfig, salt: str, overhead: int | None,
                        progress: Progress | None = None) -> dict:
    """Three turns about one new picture, then a text-only request of the
    prompt tokens turn 3 added: one repeat of the image workload."""
    pic = png_data_url(bench_picture(cfg.image_size, cfg.seed, salt))
    history = [image_turn(pic, question(cfg.seed, f"{salt}-q0"))]
    turns: list[RequestResult] = []
    for k in range(3):
        if k:
            history += [{"role": "assistant", "content": turns[-1].text},
                        {"role": "user", "content": question(cfg.seed, f"{salt}-q{k}")}]
        r = await send(client, target, cfg, history, cfg.vision_max_tokens)
        if progress:
            progress.update(r)
        turns.append(r)
        if not r.ok:
            break
    t2, t3 = (turns + [None, None])[1:3]
    # The prompt tokens turn 3 adds to turn 2 (turn 2's answer and the new question): what
    # it computes with a perfect cache. The same for every system that answers alike.
    added = t3.prompt_tokens - t2.prompt_tokens if t3 and t3.ok and t2.prompt_tokens and t3.prompt_tokens \
        else None
    n_words = text_words_for(added, overhead, cfg.vision_max_tokens + 20)
    text = await send(client, target, cfg, [{"role": "user", "content": words(n_words, cfg.seed, salt + "-text")}],
                      cfg.vision_max_tokens)
    if progress:
        progress.update(text)
    points = [_point(r) for r in turns] + [None] * (3 - len(turns))
    return {"turn1": points[0], "turn2": points[1], "turn3": points[2], "text": _point(text),
            "turn3_added_tokens": added, "text_words": n_words}


async def _videos(client, target: Target, cfg: WorkloadConfig, folder: Path, media: MediaServer,
                  transport: str) -> list[dict]:
    rows = []
    progress = Progress(f"{target.name} vision video", len(cfg.video_frames) * cfg.vision_repeats * 2)
    for n in cfg.video_frames:
        runs = []
        for rep in range(cfg.vision_repeats):
            salt = f"video-{n}-{rep}"
            path = write_video(folder / f"{salt}.mp4", n, cfg.video_size, cfg.seed, salt)
            url = video_url(path, transport, media)
            cold = await send(client, target, cfg, [video_turn(url, n, question(cfg.seed, salt + "-q0"))],
                              cfg.vision_max_tokens)
            cached = await send(client, target, cfg, [video_turn(url, n, question(cfg.seed, salt + "-q1"))],
                                cfg.vision_max_tokens)
            for r in (cold, cached):
                progress.update(r)
            runs.append({"cold": _point(cold), "cached": _point(cached)})
        row: dict = {"frames": n, "repeats": runs}
        for key in ("cold", "cached"):
            pts = [r[key] for r in runs]
            row[f"{key}_ttft_s"] = percentile([p["ttft_s"] for p in pts if p["ok"] and p["ttft_s"] is not None], 50)
            row[f"{key}_prompt_tokens"] = _first(p["prompt_tokens"] for p in pts)
            row[f"{key}_cached_tokens"] = _first(p["cached_tokens"] for p in pts)
        row["cold_over_cached"] = _ratio(row["cold_ttft_s"], row["cached_ttft_s"])
        failed = [p for r in runs for p in r.values() if not p["ok"]]
        row["errors"] = len(failed)
        row["first_error"] = _error_line(failed[0]) if failed else None
        rows.append(row)
    progress.close()
    return rows


# ---------------------------------------------------------------- helpers

def _first(values):
    return next((v for v in values if v is not None), None)


def _ratio(a, b):
    return a / b if a is not None and b else None


def _error_line(point: dict) -> str:
    return f"{point['status']} {(point.get('error') or '').strip().splitlines()[0] if point.get('error') else ''}"[:300]


async def _vision_counters(metrics_url: str | None) -> tuple[float, float] | None:
    """(queries, hits) of Tandem's vision embedding cache, or None (a peer: no such counters)."""
    return await scrape_counters(metrics_url, "tandem_vision_cache_queries_total", "tandem_vision_cache_hits_total")
