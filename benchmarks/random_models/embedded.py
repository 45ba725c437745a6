"""The embedded default model's folder: where every random model borrows its tokenizer from."""

from __future__ import annotations

from pathlib import Path

from workers.models.store import resolve_model


def embedded_model_dir() -> Path:
    return resolve_model(None)
