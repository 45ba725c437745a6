"""What /api/tags, /api/ps and /api/show say of a model, read from its folder
(router/ollama/listing.py): folders written here, headers only, no MLX."""

from __future__ import annotations

import json
import struct
import time

from router.ollama.listing import details, ps_entry, show_body, tags_entry

TEMPLATE = "{% if tools %}{{ tools }}{% endif %}{% for m in messages %}<think>{{ m.content }}{% endfor %}"


def safetensors(path, tensors: dict) -> None:
    """A safetensors file's header (the sizes it names are not written: only headers are read)."""
    header = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}
                         for name, (dtype, shape) in tensors.items()}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def folder(tmp_path, name="snapshots/0123abcd") -> str:
    d = tmp_path / "models--o--r" / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "max_position_embeddings": 4096, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "quantization": {"group_size": 32, "bits": 4,
                                                   "model.embed_tokens": {"group_size": 32, "bits": 8}}}))
    safetensors(d / "model.safetensors", {
        "model.embed_tokens.weight": ("U32", [1000, 16]),  # 8 bits: 4 a word -> 64,000
        "model.embed_tokens.scales": ("F16", [1000, 2]), "model.embed_tokens.biases": ("F16", [1000, 2]),
        "model.layers.0.mlp.up_proj.weight": ("U32", [128, 8]),  # 4 bits: 8 a word -> 8,192
        "model.layers.0.mlp.up_proj.scales": ("F16", [128, 2]), "model.norm.weight": ("F16", [64]),
    })
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20,
                                                          "repetition_penalty": 1.05}))
    return str(d)


def test_details_count_quantized_parameters_by_each_modules_bits(tmp_path):
    d = details(folder(tmp_path))
    assert d["parameter_count"] == 64_000 + 8_192 + 64
    assert {k: d[k] for k in ("format", "family", "families", "parameter_size", "quantization_level")} == {
        "format": "mlx", "family": "qwen3", "families": ["qwen3"], "parameter_size": "0.1M",
        "quantization_level": "Q4"}
    gguf = tmp_path / "x" / "snapshots" / "c0ffee" / "model-Q8_0.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    assert details(str(gguf))["format"] == "gguf" and details(str(gguf))["quantization_level"] == "Q8_0"


def test_tags_and_ps_entries_name_models_as_ollama_lists_them(tmp_path):
    path = folder(tmp_path)
    entry = tags_entry({"name": "o/r", "model_dir": path, "size": 1234, "modified_at": 0.0})
    assert entry["name"] == entry["model"] == "o/r:latest" and entry["digest"] == "0123abcd"
    assert entry["size"] == 1234 and entry["modified_at"] == "1970-01-01T00:00:00.000000Z"
    assert "parameter_count" not in entry["details"] and entry["details"]["family"] == "qwen3"
    soon = time.time() + 300
    ps = ps_entry({"name": "o/r", "model_dir": path, "size": 99, "expires_at": soon})
    assert ps["name"] == "o/r:latest" and ps["size_vram"] == 99 and ps["context_length"] == 4096
    assert ps["expires_at"].startswith(time.strftime("%Y-", time.gmtime(soon)))
    assert ps_entry({"name": "o/r", "model_dir": path, "expires_at": None})["expires_at"].startswith("2318")


def test_show_gives_template_parameters_model_info_and_capabilities(tmp_path):
    body = show_body("o/r:latest", folder(tmp_path), "chat")
    assert body["template"] == TEMPLATE and body["capabilities"] == ["completion", "tools", "thinking"]
    assert body["parameters"].split() == ["temperature", "0.6", "top_k", "20", "repeat_penalty", "1.05"]
    assert body["model_info"]["general.architecture"] == "qwen3"
    assert body["model_info"]["qwen3.context_length"] == 4096 and body["model_info"]["qwen3.block_count"] == 2
    assert "PARAMETER temperature" in body["modelfile"] and TEMPLATE in body["modelfile"]
    assert show_body("e", folder(tmp_path, "snapshots/e"), "embedding")["capabilities"] == ["embedding"]
    assert show_body("v", folder(tmp_path, "snapshots/v"), "vision")["capabilities"][:3] == [
        "completion", "tools", "vision"]
