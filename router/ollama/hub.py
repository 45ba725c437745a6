"""/api/pull and /api/delete: models in the Hugging Face cache, through the
same code as `tandem pull` and `tandem rm` (environment/hub_pull.py,
environment/hub_cache.py).

A pull streams Ollama's progress lines: {"status": "pulling manifest"}, per
file {"status": "pulling <digest's first 12>", "digest", "total",
"completed"} as its bytes land, {"status": "verifying sha256 digest"},
{"status": "success"}; a failure is an {"error": ...} line (a status code
when not streamed). The download runs in a thread; a client that goes away
does not stop it (huggingface_hub has no cancel), and a pull asked again
takes only what is still missing. A GGUF repo's file is converted when the
model is first loaded.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

from starlette.types import Receive, Scope, Send

from environment.hub_cache import parse_ref, remove
from environment.hub_pull import FileProgress, pull
from environment.model_folder import ModelError
from environment.settings import default_cache_dir
from router.api.errors import ApiError
from router.ollama.ndjson_format import NDJSON, line

log = logging.getLogger("tandem.router")

QUIET_S = 1.0  # how often a waiting stream looks whether the download's thread has ended
# What a pull's failure means, by the words hub_pull says it in (its one line).
PULL_STATUSES = (("no such model", 404), ("no revision", 404), ("not downloaded", 404), ("cannot reach", 502),
                 ("answered", 502), ("checksum", 502), ("of disk", 507), ("disk filled", 507))


def pull_status(error: ModelError) -> int:
    text = str(error)
    return next((status for words, status in PULL_STATUSES if words in text), 400)


def hub_ref(name: str, field: str = "model"):
    try:
        return parse_ref(name)
    except ModelError as exc:
        raise ApiError(400, str(exc), param=field) from None


def _status(stage: str, files: list[FileProgress]) -> list[dict]:
    if stage == "listing":
        return [{"status": "pulling manifest"}]
    if stage == "verifying":
        return [{"status": "verifying sha256 digest"}]
    return [{"status": f"pulling {f.digest[:12]}", "digest": f"{'sha256' if f.sha256 else 'sha1'}:{f.digest}",
             "total": f.total, "completed": f.completed} for f in files]


class PullResponse:
    """The pull of `name`, streamed as NDJSON lines or answered once."""

    def __init__(self, name: str, stream: bool, on_success=None):
        self.ref = hub_ref(name)
        self.stream = stream
        self.on_success = on_success  # called once the model is whole (the pool's listing refreshed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sent: dict[str, int] = {}  # digest -> bytes last reported

        def progress(stage: str, files: list[FileProgress]) -> None:
            changed = [f for f in files if sent.get(f.digest) != f.completed] if stage == "files" else files
            for f in changed:
                sent[f.digest] = f.completed
            if stage != "files" or changed:
                loop.call_soon_threadsafe(queue.put_nowait, _status(stage, changed))

        task = asyncio.ensure_future(asyncio.to_thread(pull, self.ref, progress))
        log.info("pulling %s for an Ollama client", self.ref)
        if self.stream:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", NDJSON.encode())]})
        while not (task.done() and queue.empty()):
            try:
                async with asyncio.timeout(QUIET_S):  # not wait_for: 3.11's can lose a cancel (router/power_watch.py)
                    statuses = await queue.get()
            except TimeoutError:
                continue
            if self.stream:
                await send({"type": "http.response.body", "body": b"".join(map(line, statuses)), "more_body": True})
        error = task.exception()
        if error is None and self.on_success is not None:
            self.on_success()
        final, status = _final(error, self.ref)
        if self.stream:
            await send({"type": "http.response.body", "body": line(final), "more_body": False})
            return
        body = line(final)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _final(error: BaseException | None, ref) -> tuple[dict, int]:
    if error is None:
        log.info("pulled %s", ref)
        return {"status": "success"}, 200
    if isinstance(error, ModelError):
        log.warning("pull of %s failed: %s", ref, error)
        return {"error": str(error)}, pull_status(error)
    log.error("pull of %s failed", ref, exc_info=error)
    return {"error": f"{ref}: the pull failed ({type(error).__name__})"}, 500


def delete_model(name: str) -> int:
    """(Blocking.) Delete `name` from the Hub's cache, and a GGUF's
    conversion; returns the bytes freed. ApiError 404 when not downloaded."""
    ref = hub_ref(name)
    try:
        freed, ggufs = remove(ref)
    except ModelError as exc:
        raise ApiError(404, f'model "{name}" not found: {exc}') from None
    for sha in ggufs:  # the MLX folder a GGUF was converted into is named by the file's sha256 (as `tandem rm`)
        conversion = Path(default_cache_dir()) / "models" / sha
        if conversion.is_dir():
            shutil.rmtree(conversion, ignore_errors=True)
    return freed
