"""How an embedding model's folder says its vectors are made, read without
MLX (the router checks `dimensions` and tokenizes by it; the embed worker,
workers/embed/, pools by it): its sentence-transformers files where it has
them (modules.json naming a Pooling module, whose config.json says which
pooling), else the architecture's convention.

- "last": a decoder's final hidden state (after the final norm) of the last
  token, which the tokenizer makes an end token: the Qwen3-Embedding family,
  run through mlx-lm's own model. Trained with Matryoshka losses: its
  vectors may be cut to their first `dimensions` components, renormalised.
- "mean" (over the input's tokens) or "cls" (the first token's): BERT-family
  encoders, run through mlx-embeddings. No `dimensions`.

Every vector is L2-normalised, as OpenAI's are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from environment.model_folder import ModelError

POOLINGS = ("last", "mean", "cls")
# sentence-transformers' Pooling config flags, by the pooling each means.
_MODE_FLAGS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_MODE_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
# Encoders (pooled over the whole input, by mean unless their files say CLS).
ENCODER_TYPES = frozenset(("bert", "roberta", "xlm-roberta", "xlm_roberta", "modernbert", "nomic_bert", "distilbert",
                           "mpnet", "electra", "deberta-v2"))


@dataclass(frozen=True)
class EmbeddingConfig:
    pooling: str  # "last", "mean" or "cls"

    @property
    def decoder(self) -> bool:
        """Run through mlx-lm's model (a decoder's last token), else mlx-embeddings."""
        return self.pooling == "last"

    @property
    def matryoshka(self) -> bool:
        """Whether `dimensions` may cut its vectors (the Qwen3-Embedding family)."""
        return self.pooling == "last"


def embedding_config(model_dir: str | Path) -> EmbeddingConfig:
    folder = Path(model_dir)
    pooling = _st_pooling(folder)
    if pooling is None:
        model_type = _read(folder / "config.json").get("model_type", "")
        pooling = "mean" if model_type in ENCODER_TYPES else "last"
    return EmbeddingConfig(pooling)


def _st_pooling(folder: Path) -> str | None:
    """The pooling sentence-transformers' files name; None without them.
    ModelError for one Tandem does not run (max, weighted mean, several)."""
    modules = _read(folder / "modules.json", default=[])
    path = next((m.get("path", "") for m in modules if isinstance(m, dict)
                 and str(m.get("type", "")).endswith("Pooling")), None) if isinstance(modules, list) else None
    if path is None:
        return None
    cfg = _read(folder / path / "config.json")
    if isinstance(cfg.get("pooling_mode"), str):  # newer sentence-transformers write the mode by name
        modes = [_MODE_NAMES.get(cfg["pooling_mode"], cfg["pooling_mode"])]
    else:
        modes = [name for flag, name in _MODE_FLAGS.items() if cfg.get(flag)]
        modes += [flag for flag, on in cfg.items() if flag.startswith("pooling_mode_") and on and flag not in _MODE_FLAGS]
    if len(modes) != 1 or modes[0] not in POOLINGS:
        raise ModelError(f"{folder}: pooling {modes or 'none'} in {path}/config.json is not supported "
                         f"(Tandem pools by {', '.join(POOLINGS)})")
    return modes[0]


def _read(path: Path, default=None):
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {} if default is None else default
    return value if isinstance(value, type(default if default is not None else {})) else (default or {})
