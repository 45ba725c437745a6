"""The model folder the peers load: the same weights Tandem computes with.

On MLX's CPU backend Tandem expands quantized (and float16/bfloat16) weights
to float32 at load (workers/models/loading.py), because MLX's CPU quantized and half
precision matmuls are far slower than float32 through BLAS. mlx_lm.server and
vllm-mlx load a folder as it is, so handing them the 4-bit embedded model
would time MLX's slow CPU kernels, not the servers. On the CPU backend they
get a float32 copy made once with Tandem's own loader; on a GPU (Metal, CUDA)
every system loads the folder as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from environment.backend import on_cpu


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def safetensors_dtypes(folder: Path) -> set[str]:
    """The tensor dtypes in a folder's safetensors files, read from their headers only."""
    dtypes = set()
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        dtypes.update(v["dtype"] for k, v in header.items() if k != "__metadata__")
    return dtypes


def safetensors_bytes(folder: Path) -> int:
    """Total tensor bytes in a folder's safetensors files (headers only)."""
    total = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def needs_float32_copy(folder: Path) -> bool:
    config = json.loads((folder / "config.json").read_text())
    return "quantization" in config or bool(safetensors_dtypes(folder) - {"F32"})


def peer_model_folder(model_dir: Path, mode: str, cache_root: Path) -> Path:
    """mode: 'as-is', 'float32', or 'auto' (float32 on the CPU backend when the
    folder holds anything but float32 weights)."""
    if mode == "as-is" or not needs_float32_copy(model_dir):
        return model_dir
    if mode == "auto" and not on_cpu():
        return model_dir
    return float32_copy(model_dir, cache_root)


def float32_copy(model_dir: Path, cache_root: Path) -> Path:
    """Write (once) and return a float32 folder with the same config and tokenizer."""
    stat = (model_dir / "config.json").stat()
    key = hashlib.sha256(f"{model_dir.resolve()}|{stat.st_mtime_ns}|{stat.st_size}".encode()).hexdigest()[:16]
    out = cache_root / f"{model_dir.name}-float32-{key}"
    if (out / ".complete").exists():
        return out
    from mlx_lm.utils import save_config, save_model

    from workers.models.loading import load_model

    model, _ = load_model(model_dir, dequantize=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(tmp, model, donate_model=True)
    config = json.loads((model_dir / "config.json").read_text())
    for key_ in ("quantization", "quantization_config"):
        config.pop(key_, None)
    config["torch_dtype"] = "float32"
    save_config(config, tmp / "config.json")
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, tmp / name)
    (tmp / ".complete").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
