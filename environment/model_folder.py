"""Facts about a model folder that every process needs without MLX: is it a
VLM, what kind of model is it, is it whole, how long a context was it trained
for, and the error a model problem raises. Reads config.json and file names
only (stdlib), so the supervisor, the router and the workers can all ask."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path


class ModelError(Exception):
    """A model cannot be found, read or converted. The message is one line
    that names the file or repo and the problem; the CLI prints only it."""


@functools.lru_cache(maxsize=16)
def is_vlm(model_dir: str | Path) -> bool:
    """A folder whose config names a vision tower (mlx-vlm's layout)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


# Files only a sentence-transformers model has (its pooling and normalising modules).
EMBEDDING_FILES = ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")


def model_kind(model_dir: str | Path) -> str:
    """'vision' (a vision tower), 'embedding' (a sentence-transformers model,
    or one whose architectures all lack a generation head, e.g. BertModel or
    MistralModel: no ForCausalLM or ForConditionalGeneration), else 'chat'."""
    folder = Path(model_dir)
    if is_vlm(folder):
        return "vision"
    if any((folder / name).is_file() for name in EMBEDDING_FILES):
        return "embedding"
    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        archs = []
    if archs and all(isinstance(a, str) and a.endswith("Model") for a in archs):
        return "embedding"
    return "chat"


def missing_part(model_dir: str | Path) -> str | None:
    """What keeps the folder from being a whole model (None: nothing lacks):
    its config, a weight shard its index names, any weights, a tokenizer. A
    download cut short leaves one of these out (the Hugging Face cache links a
    file into a snapshot only once it is complete)."""
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        return "no config.json"
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{index.name} is unreadable"
        absent = sorted(s for s in shards if not (folder / s).is_file())
        if absent:
            return f"no {absent[0]} (which {index.name} names)"
    if not any(p.is_file() for p in folder.glob("*.safetensors")):
        return "no weights (*.safetensors)"
    if not any((folder / n).is_file() for n in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        return "no tokenizer"
    return None


def context_length(folder: str | os.PathLike) -> int | None:
    """The model's trained context (max_position_embeddings), if it says."""
    with open(Path(folder) / "config.json") as f:
        cfg = json.load(f)
    n = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
    return int(n) if n else None


def weight_bytes(folder: str | os.PathLike) -> int:
    """Bytes of the folder's weight files (*.safetensors) as stored: a lower
    bound of a worker's copy (the CPU backend expands quantized weights)."""
    try:
        return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors") if p.is_file())
    except OSError:
        return 0


def vocabulary_mismatch(target_dir: str | Path, draft_dir: str | Path) -> str | None:
    """Why the draft model's tokenizer cannot draft for the target's (None:
    it can): every token of the target's vocabulary must have the same id in
    the draft's (a draft is checked by the target, so nothing else matters
    for exactness; a draft of another family is merely never accepted).
    Reads the tokenizers without MLX (the supervisor calls it: workers/decode/draft_model.py drafts)."""
    tv, dv = _vocabulary(Path(target_dir)), _vocabulary(Path(draft_dir))
    differ = [t for t, i in tv.items() if dv.get(t) != i]
    if differ:
        sample = ", ".join(repr(t) for t in sorted(differ)[:3])
        return (f"{len(differ)} of the target's {len(tv)} tokens have another id (or none) in the draft "
                f"model's tokenizer (e.g. {sample}): a draft model must share the target's tokenizer")
    return None


def _vocabulary(folder: Path) -> dict:
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).get_vocab()
