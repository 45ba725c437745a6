"""Turn a llama-architecture GGUF file into a standard MLX model folder.

The folder is what `mlx_lm.load` expects: config.json, model.safetensors,
tokenizer.json and tokenizer_config.json. Weights keep the GGUF's quantization
(MLX's affine format, group size 32, which `mx.load` already produces for
Q4_0, Q4_1 and Q8_0), so the folder is as small as the GGUF.

Every check that can reject a file runs on the header (read and
bounds-checked in gguf_header.py), before `mx.load` touches the tensor
data: MLX's GGUF reader is C code that should only ever see a file whose
header and length we have already verified.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
from gguf import GGMLQuantizationType

from environment.model_folder import ModelError
from workers.models.gguf_header import GROUP_SIZE, QUANT_BITS, SUPPORTED_TYPES, GGUFHeader, read_header
from workers.models.gguf_tokenizer import check_pre_tokenizer, write_tokenizer_files

SUPPORTED_ARCHITECTURES = {"llama"}

# GGUF tensor base names → module paths of mlx_lm's llama model.
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def validate(h: GGUFHeader) -> None:
    """Reject what the converter cannot turn into a working mlx_lm model."""
    arch = h.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{h.path}: unsupported architecture {arch!r} (Tandem converts llama GGUF files only)"
        )
    bad = Counter(t.type_name for t in h.tensors if t.type not in SUPPORTED_TYPES)
    if bad:
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(bad.items()))
        ok = ", ".join(sorted(GGMLQuantizationType(t).name for t in SUPPORTED_TYPES))
        raise ModelError(f"{h.path}: unsupported tensor type {kinds}; supported: {ok}")
    if h.metadata.get("split.count", 1) not in (0, 1):
        raise ModelError(f"{h.path}: split GGUF files are not supported; merge them first")
    for t in h.tensors:
        _module_path(h.path, t.name)  # unknown tensors mean an unknown model variant
    tok_model = h.metadata.get("tokenizer.ggml.model")
    if tok_model != "gpt2":
        raise ModelError(
            f"{h.path}: unsupported tokenizer model {tok_model!r} "
            "(only byte-level BPE, 'gpt2', is converted; SentencePiece 'llama' is not)"
        )
    check_pre_tokenizer(h.metadata.get("tokenizer.ggml.pre"), h.path)
    _check_llama(h)


_REQUIRED_METADATA = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")


def _check_llama(h: GGUFHeader) -> None:
    """Hyperparameters and tensors that every llama needs, and no rope
    variant mlx_lm's llama lacks; without this a stripped or exotic file
    would fail later with a KeyError, a shape mismatch or wrong output."""
    m = h.metadata
    for key in _REQUIRED_METADATA:
        if not isinstance(m.get(f"llama.{key}"), int) or m[f"llama.{key}"] <= 0:
            raise ModelError(f"{h.path}: missing or invalid metadata llama.{key}")
    # mlx_lm's llama rotates the whole head with plain or linear-scaled rope.
    head_dim = m.get("llama.attention.key_length", m["llama.embedding_length"] // m["llama.attention.head_count"])
    if m.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise ModelError(f"{h.path}: partial rotary embedding is not supported")
    if m.get("llama.rope.scaling.type") not in (None, "none", "linear"):
        raise ModelError(f"{h.path}: unsupported rope scaling {m['llama.rope.scaling.type']!r}")
    if not isinstance(h.metadata.get("tokenizer.ggml.tokens"), int):
        raise ModelError(f"{h.path}: missing tokenizer vocabulary (tokenizer.ggml.tokens)")
    names = {t.name for t in h.tensors}
    need = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{part}.weight" for i in range(h.metadata["llama.block_count"]) for part in _PER_LAYER
    ]
    missing = [n for n in need if n not in names]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelError(f"{h.path}: missing tensors {', '.join(missing[:3])}{more}")


def _module_path(path: Path, tensor_name: str) -> str:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`."""
    base, _, suffix = tensor_name.rpartition(".")
    if suffix not in ("weight", "scales", "biases"):
        base, suffix = tensor_name, ""
    parts = base.split(".")
    if base in _TOP_LEVEL:
        mod = _TOP_LEVEL[base]
    elif len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _PER_LAYER:
        mod = f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}"
    else:
        hint = " (Llama 3.1-style rope scaling is not supported)" if base == "rope_freqs" else ""
        raise ModelError(f"{path}: unexpected tensor {tensor_name!r}{hint}")
    return f"{mod}.{suffix}" if suffix else mod


# ---------------------------------------------------------------- config


def _config(h: GGUFHeader) -> dict:
    m = h.metadata
    heads = m["llama.attention.head_count"]
    hidden = m["llama.embedding_length"]
    embd = next(t for t in h.tensors if t.name == "token_embd.weight")
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": m["llama.block_count"],
        "intermediate_size": m["llama.feed_forward_length"],
        "num_attention_heads": heads,
        "num_key_value_heads": m.get("llama.attention.head_count_kv", heads),
        "head_dim": m.get("llama.attention.key_length", hidden // heads),
        "rms_norm_eps": m.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": m.get("llama.rope.freq_base", 10000.0),
        # llama.cpp permutes Q/K rows for interleaved rope; traditional rope
        # on the permuted weights is the same model as HF's rotate-half.
        "rope_traditional": True,
        "max_position_embeddings": m.get("llama.context_length", 2048),
        "vocab_size": m.get("llama.vocab_size", embd.shape[-1]),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in h.tensors),
        "tandem_source_gguf": h.path.name,
    }
    if m.get("llama.rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": m.get("llama.rope.scaling.factor", 1.0)}
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id")):
        if f"tokenizer.ggml.{key}_token_id" in m:
            cfg[name] = m[f"tokenizer.ggml.{key}_token_id"]
    # End-of-turn differs from end-of-text in some chat models (Llama 3's
    # <|eot_id|>); generation must stop on either.
    eot = m.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot != cfg.get("eos_token_id"):
        cfg["eos_token_id"] = [x for x in (cfg.get("eos_token_id"), eot) if x is not None]
    quant = _quantization(h)
    if quant:
        cfg["quantization"] = quant
        cfg["quantization_config"] = quant
    return cfg


def _quantization(h: GGUFHeader) -> dict | None:
    """Top-level {group_size, bits} from the most common quantized type, with a
    per-module entry for each module whose bits differ (GGUF files often keep
    the embedding at 8 bits), so mlx_lm builds matching Quantized* layers."""
    bits = {
        _module_path(h.path, t.name).removesuffix(".weight"): QUANT_BITS[t.type]
        for t in h.tensors
        if t.type in QUANT_BITS
    }
    if not bits:
        return None
    common = Counter(bits.values()).most_common(1)[0][0]
    quant = {"group_size": GROUP_SIZE, "bits": common}
    for mod, b in sorted(bits.items()):
        if b != common:
            quant[mod] = {"group_size": GROUP_SIZE, "bits": b}
    return quant


# ---------------------------------------------------------------- convert


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert `gguf_path` into the MLX model folder `out_dir` and return it.

    Atomic: everything is written into a temporary folder beside `out_dir`
    and renamed into place, so `out_dir` either does not exist or is complete.
    An `out_dir` that already holds a config.json is a finished conversion
    (it can only have appeared by that rename) and is returned as is; if it
    appears while we convert, another process won and ours is discarded.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    header = read_header(gguf_path)
    validate(header)
    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-{os.getpid()}-", dir=out_dir.parent))
    try:
        _write_folder(header, tmp)
        try:
            os.rename(tmp, out_dir)  # replaces only a missing or empty out_dir
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process won
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_folder(header: GGUFHeader, folder: Path) -> None:
    try:
        tensors, meta = mx.load(str(header.path), return_metadata=True)
    except Exception as e:  # the header was sound, so this is damaged data
        raise ModelError(f"{header.path}: cannot read tensors ({' '.join(str(e).split())})") from None
    weights = {_module_path(header.path, k): v for k, v in tensors.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(_config(header), indent=2) + "\n")
    write_tokenizer_files(meta, folder, header.path)
    _fsync_tree(folder)


def _fsync_tree(folder: Path) -> None:
    """Flush file contents before the rename publishes them, so a crash
    cannot leave a published folder with empty files."""
    for p in folder.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_abandoned(out_dir: Path) -> None:
    """Delete temporary folders left by conversions that were killed: their
    name carries the converting process's id, and that process is gone."""
    prefix = f".{out_dir.name}.partial-"
    for p in out_dir.parent.glob(prefix + "*"):
        pid = p.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
