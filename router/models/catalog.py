"""The models a request may name: the one the server started with, and every
whole model in the Hugging Face cache (environment/hub_cache.py; no network).

Names are Hub repo ids (`owner/name`, `owner/name-GGUF:Q4_0`, `@revision`).
Ollama's clients add a tag (`owner/name:latest`): ":latest" is the repo's
own name. Case is ignored, as the Hub ignores it.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from environment.hub_cache import cached, downloaded_models, parse_ref
from environment.model_folder import ModelError, weight_bytes
from environment.settings import Settings
from router.api.errors import ApiError

LISTING_TTL_S = 5.0  # the cache's scan, reused this long (a client polling /v1/models)


def model_key(name: str) -> str:
    """What two names of one model share."""
    return without_tag(name.strip()).lower()


def without_tag(name: str) -> str:
    return name[: -len(":latest")] if name.lower().endswith(":latest") else name


class Catalog:
    def __init__(self, default_id: str):
        self.default_id = default_id
        self._listing: tuple[float, list[dict]] = (0.0, [])

    def downloaded(self, name: str) -> Path | None:
        """(Blocking.) The local model of a Hub name, when the cache holds all
        of it. parse_ref refuses anything but a repo id (a path never loads)."""
        if not isinstance(name, str):
            return None
        try:
            return cached(parse_ref(without_tag(name.strip())))
        except (ModelError, ValueError, OSError):
            return None

    def not_found(self, name) -> ApiError:
        return ApiError(404, f"The model '{name}' does not exist or is not downloaded: pull it first (tandem pull "
                             f"{name}). Models: GET /v1/models; the server's own: {self.default_id} (alias: default)",
                        param="model", code="model_not_found")

    def cost(self, settings: Settings, folder) -> int:
        """Bytes of weights the model's processes would hold, all together."""
        if not folder:
            return 0
        path = Path(folder)
        size = path.stat().st_size if path.is_file() else weight_bytes(path)  # a .gguf is converted to about its size
        model_dir = str(path) if path.is_dir() else ""
        plan = replace(settings, model_dir=model_dir).worker_plan()
        return size * max(1, len(plan)) * max(1, settings.group_size)

    def forget(self) -> None:
        """The cache changed (a pull, a delete): the next listing scans it again."""
        self._listing = (0.0, [])

    def listing(self) -> list[dict]:
        """(Blocking.) The whole downloaded models, as /v1/models lists them."""
        at, models = self._listing
        if time.monotonic() - at < LISTING_TTL_S:
            return models
        models = [{"name": m.name, "model": m.name, "model_dir": str(m.path), "kind": m.kind, "size": m.size,
                   "format": m.format, "modified_at": _mtime(m.path), "state": "downloaded"}
                  for m in downloaded_models() if m.lacks is None]
        self._listing = (time.monotonic(), models)
        return models


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
