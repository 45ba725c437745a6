"""Model names between Ollama's `name:tag` and Tandem's.

Tandem names a model as `tandem pull` and `--model` do: a Hugging Face repo
id (`REPO[:FILE][@REVISION]`, FILE a GGUF repo's file by quantization, much
like an Ollama tag), or the embedded model's name. Ollama clients send
`name:tag` and treat a name without a tag as `name:latest`.

So: `REPO` and `REPO:latest` are one model (the default branch). /api/tags
and /api/ps list a name without a tag as `REPO:latest`, as Ollama lists
`llama3.2:latest`; a name with a tag (`REPO:Q4_0`) is listed as it is. Every
name listed can be sent back, with or without `:latest`.
"""

from __future__ import annotations

LATEST = "latest"


def tandem_name(name: str) -> str:
    """The model an Ollama name means: `:latest` dropped."""
    name = name.strip()
    base, colon, tag = name.rpartition(":")
    if colon and tag == LATEST and base and "/" not in tag:
        return base
    return name


def listed_name(model: str) -> str:
    """How /api/tags and /api/ps name `model`: with `:latest` unless it has a tag."""
    last = model.rsplit("/", 1)[-1]
    return model if ":" in last else f"{model}:{LATEST}"


def same_model(a: str, b: str) -> bool:
    return tandem_name(a) == tandem_name(b)
