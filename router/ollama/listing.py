"""What /api/tags, /api/ps and /api/show say of a model, read from its
folder (config.json, the safetensors headers, the chat template,
generation_config.json): no model loaded, nothing imported of MLX.

- `details`: format ("mlx", or "gguf" for a GGUF not converted yet),
  family (config's model_type), parameter_size ("135.0M", "7.6B": counted
  from the weights' shapes, a quantized matrix by its bits), quantization
  level ("Q4" for MLX's 4 bits, else the weights' dtype: "BF16", "F16").
- `digest`: the Hub's commit of a pulled model (its snapshot folder's
  name), else the sha256 of its path.
- /api/show's `capabilities`: "completion" (chat and vision models),
  "tools" and "thinking" where the chat template renders them, "vision",
  "embedding"; `parameters` the model's recommended sampling, one per line,
  as Ollama's modelfile PARAMETERs.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from environment.generation_defaults import generation_defaults
from environment.model_folder import context_length, weight_bytes
from router.ollama.names import listed_name

DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
MAX_HEADER_BYTES = 64 << 20  # a safetensors header past this is not one
PARAMETER_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def details(model_dir: str) -> dict:
    path = Path(model_dir) if model_dir else None
    if path is None or not path.exists():
        return {"parent_model": "", "format": "", "family": "", "families": None, "parameter_size": "",
                "quantization_level": ""}
    if path.is_file():  # a .gguf in the Hub's cache, converted when first loaded
        return {"parent_model": "", "format": "gguf", "family": "", "families": None, "parameter_size": "",
                "quantization_level": path.stem.rsplit(".", 1)[-1].rsplit("-", 1)[-1].upper()}
    return dict(_folder_details(str(path), _stamp(path)))


def _stamp(path: Path) -> float:
    try:
        return (path / "config.json").stat().st_mtime
    except OSError:
        return 0.0


@lru_cache(maxsize=64)
def _folder_details(folder: str, stamp: float) -> tuple:
    path = Path(folder)
    config = _config(path)
    family = str(config.get("model_type") or config.get("text_config", {}).get("model_type") or "")
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    bits = quantization.get("bits")
    params = parameter_count(path, quantization)
    level = f"Q{bits}" if bits else DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or ""), "")
    return (("parent_model", ""), ("format", "mlx"), ("family", family), ("families", [family] if family else None),
            ("parameter_size", size_label(params) if params else ""), ("quantization_level", level),
            ("parameter_count", params))


def parameter_count(folder: Path, quantization: dict | None = None) -> int:
    """Parameters in the folder's safetensors, from their headers alone: a
    packed (uint32) quantized matrix counts 32/bits per element (MLX's
    `quantization`: its bits, and a module's own where it names one), its
    scales and biases not at all."""
    quantization = quantization or {}
    bits = quantization.get("bits")
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with open(file, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > MAX_HEADER_BYTES:
                    continue
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            continue
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            if bits and name.endswith((".scales", ".biases")):
                continue
            count = math.prod(info.get("shape") or [1])
            own = quantization.get(name.rsplit(".", 1)[0])
            packed = own.get("bits", bits) if isinstance(own, dict) else bits
            total += count * 32 // packed if packed and info.get("dtype") == "U32" else count
    return total


def size_label(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def digest(model_dir: str) -> str:
    path = Path(model_dir) if model_dir else None
    if path is not None and path.parent.name == "snapshots":
        return path.name
    if path is not None and path.parent.parent.name == "snapshots":  # a .gguf file in a snapshot
        return path.parent.name
    return hashlib.sha256(str(path or "").encode()).hexdigest()


def _public(details_: dict) -> dict:
    return {k: v for k, v in details_.items() if k != "parameter_count"}


def tags_entry(item: dict) -> dict:
    """One model of /api/tags, from the pool's listing."""
    name = listed_name(item["name"])
    model_dir = item.get("model_dir") or ""
    modified = next((item[k] for k in ("modified_at", "loaded_at") if item.get(k) is not None), None)
    size = item.get("size") or (weight_bytes(model_dir) if model_dir and Path(model_dir).is_dir() else 0)
    return {"name": name, "model": name, "modified_at": iso(modified), "size": int(size),
            "digest": digest(model_dir), "details": _public(details(model_dir))}


def ps_entry(item: dict) -> dict:
    """One loaded model of /api/ps. `expires_at` None (in use, or kept
    forever) is said as Ollama says "forever": far in the future."""
    name = listed_name(item["name"])
    model_dir = item.get("model_dir") or ""
    expires = item.get("expires_at")
    return {"name": name, "model": name, "size": int(item.get("size") or 0), "digest": digest(model_dir),
            "details": _public(details(model_dir)), "expires_at": iso(expires) if expires else "2318-01-01T00:00:00Z",
            "size_vram": int(item.get("size") or 0), "context_length": _context(model_dir)}


def _context(model_dir: str) -> int:
    try:
        return context_length(model_dir) or 0 if model_dir and Path(model_dir).is_dir() else 0
    except (OSError, ValueError):
        return 0


def template_text(model_dir: str) -> str:
    from router.text.chat_template import load_templates

    folder = Path(model_dir)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text()) if folder.is_dir() else {}
        templates = load_templates(folder, config if isinstance(config, dict) else {}) if folder.is_dir() else None
    except (OSError, ValueError):
        return ""
    if isinstance(templates, dict):
        return templates.get("default") or next(iter(templates.values()), "")
    return templates or ""


def capabilities(kind: str, template: str) -> list[str]:
    if kind == "embedding":
        return ["embedding"]
    out = ["completion"]
    if "tools" in template:
        out.append("tools")
    if kind == "vision":
        out.append("vision")
    if any(marker in template for marker in ("<think>", "enable_thinking", "reasoning_content")):
        out.append("thinking")
    return out


def show_body(name: str, model_dir: str, kind: str, loaded_at: float | None = None) -> dict:
    """/api/show: the model's template, parameters, details, model_info and capabilities."""
    d = details(model_dir)
    template = template_text(model_dir) if model_dir else ""
    folder = Path(model_dir) if model_dir else None
    defaults = generation_defaults(folder).given() if folder is not None and folder.is_dir() else {}
    parameters = "\n".join(f"{PARAMETER_NAMES[k]:<16}{v:g}" for k, v in defaults.items() if k in PARAMETER_NAMES)
    family = d["family"] or "unknown"
    info = {"general.architecture": family, "general.basename": name, "general.parameter_count": d.get("parameter_count", 0)}
    config = _config(folder) if folder is not None and folder.is_dir() else {}
    if config:
        context = context_length(folder)
        info |= {f"{family}.context_length": context, f"{family}.embedding_length": config.get("hidden_size"),
                 f"{family}.block_count": config.get("num_hidden_layers"),
                 f"{family}.attention.head_count": config.get("num_attention_heads")}
    modelfile = (f"# Modelfile generated by Tandem for {name}\nFROM {model_dir}\n"
                 + (f'TEMPLATE """{template}"""\n' if template else "")
                 + "".join(f"PARAMETER {p}\n" for p in parameters.splitlines()))
    stamp = loaded_at or (folder.stat().st_mtime if folder is not None and folder.exists() else None)
    return {"modelfile": modelfile, "parameters": parameters, "template": template, "details": _public(d),
            "model_info": {k: v for k, v in info.items() if v is not None}, "capabilities": capabilities(kind, template),
            "modified_at": iso(stamp), "license": ""}
