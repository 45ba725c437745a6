"""A text model's folder with a real architecture's shape and random weights.

Speed depends on shapes, not on weight values, so a random-weight model of a
real size measures what the real one would, without downloading it. The
tokenizer (and chat template) is borrowed from the embedded default model, so
every server can tokenize and template requests for it.

    tandem random-model --like qwen3-0.6b --out /tmp/qwen3-0.6b-random [--dtype bfloat16] [--seed 0]

(the command: random_model_cmd.py; VLMs: vlm.py)
"""

from __future__ import annotations

import importlib
import json
import shutil
import zlib
from pathlib import Path

from benchmarks.random_models.embedded import embedded_model_dir

# Hyperparameters from each model's published config.json on the Hugging Face
# Hub (main branch). `params` is the count of distinct parameters; each one
# follows from the shape (a tied lm_head counts once) and equals the published
# size: SmolLM2-135M 134,515,008 and Qwen2.5-0.5B 494,032,768 (their
# safetensors totals), Llama-3.2-1B 1,235,814,400 ("1.23B" on its card),
# Qwen3-0.6B 596,049,920 ("0.6B, 0.44B non-embedding" on its card; its
# checkpoint file also stores the tied lm_head again, 752M in all).
SHAPES: dict[str, dict] = {
    # https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json
    "qwen3-0.6b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        params=596_049_920),
    # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
    "llama-3.2-1b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        params=1_235_814_400),
    # https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json (q/k/v projections have biases)
    "qwen2.5-0.5b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        params=494_032_768),
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json
    "smollm2-135m": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        params=134_515_008),
    # Not a real model: a few-MB shape for unit tests (vocab = the borrowed tokenizer's 49152).
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "qwen3-8b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        params=8_190_735_360),
    # https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json (--layers cuts it to fit a disk)
    "llama-3-70b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        params=70_553_706_496),
    "tiny-llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        params=3_219_776),
    # Not a real model either: tiny-llama's size as a Qwen3 (q/k norms), heads and KV heads
    # divisible by 2 (a tensor-parallel test splits it over two ranks).
    "tiny-qwen3": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        params=3_219_840),
    # Not a real model: tiny-llama's width as a Qwen2 (q/k/v biases; mlx-lm can pipeline it),
    # 3 layers, so a pipeline-parallel test over two ranks splits them unevenly (2 + 1).
    "tiny-qwen2": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        params=3_257_152),
}
REAL_SHAPES = [name for name in SHAPES if not name.startswith("tiny")]
DTYPES = ("float16", "bfloat16", "float32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")
# Embedding rows are N(0, EMBED_STD^2). Small next to the unit-scale layer
# outputs, so the last hidden state is not just the input token's embedding
# (with tied embeddings that would make the model repeat its input forever),
# yet large enough that the logits are peaked over the real vocabulary.
EMBED_STD = 0.1
# Queries and keys are scaled up so attention logits have std ~4: random
# attention that is sharp (each position looks at a few others) keeps the
# output varied; flat attention averages the context into a slowly changing
# vector and the model repeats one token (seen with SmolLM2's shape).
ATTN_SHARPNESS = 2.0


def build_config(like: str, dtype: str, tokenizer_dir: Path, seed: int, layers: int | None = None) -> dict:
    shape = {k: v for k, v in SHAPES[like].items() if k != "params"}
    if layers is not None:  # fewer layers than the real model: its width, on a smaller disk
        shape["num_hidden_layers"] = layers
    src = json.loads((tokenizer_dir / "config.json").read_text()) if (tokenizer_dir / "config.json").is_file() else {}
    n_tok = tokenizer_size(tokenizer_dir)
    shape["vocab_size"] = max(shape["vocab_size"], n_tok)  # every id the tokenizer makes needs a row
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the ids of the borrowed tokenizer
        if key in src:
            shape[key] = src[key]
    shape["torch_dtype"] = dtype
    shape["tandem_random_model"] = {"like": like, "seed": seed, "tokenizer_size": n_tok, "layers": layers}
    return shape


def _outside_layers(shape: dict) -> int:
    """Parameters outside the layers: embeddings (and an untied head), the final norm."""
    embed = shape["vocab_size"] * shape["hidden_size"]
    return embed * (1 if shape.get("tie_word_embeddings", True) else 2) + shape["hidden_size"]


def tokenizer_size(tokenizer_dir: Path) -> int:
    """Ids the tokenizer can produce: its vocabulary plus added tokens."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = list(data.get("model", {}).get("vocab", {}).values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1 if ids else 0


def build_model(config: dict):
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return arch.Model(arch.ModelArgs.from_dict(config))


def random_weights(model, config: dict, dtype: str, seed: int) -> dict:
    """Scaled-normal init for every parameter: linear weights N(0, 1/fan_in)
    (unit-scale activations), norms 1, biases 0, embeddings N(0, EMBED_STD^2)
    with the rows past the tokenizer's ids zeroed, so greedy decoding never
    picks a token that cannot be detokenized; queries and keys scaled by
    ATTN_SHARPNESS (through q_norm/k_norm where the model has them). Each tensor's key comes from the
    seed and its name, so the result does not depend on traversal order."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    n_tok = config["tandem_random_model"]["tokenizer_size"]
    target = getattr(mx, dtype)
    params = tree_flatten(model.parameters())
    has_qk_norm = any("q_norm" in name for name, _ in params)
    weights = {}
    for name, p in params:
        key = mx.random.key((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**32)
        leaf = name.rsplit(".", 1)[-1]
        if "q_norm" in name or "k_norm" in name:
            w = mx.full(p.shape, ATTN_SHARPNESS)
        elif "norm" in name:
            w = mx.ones(p.shape)
        elif leaf == "bias":
            w = mx.zeros(p.shape)
        elif "embed_tokens" in name or "lm_head" in name:
            w = mx.random.normal(p.shape, key=key) * EMBED_STD
            if p.shape[0] > n_tok:
                w = mx.concatenate([w[:n_tok], mx.zeros((p.shape[0] - n_tok, *p.shape[1:]))])
        else:
            w = mx.random.normal(p.shape, key=key) * (p.shape[-1] ** -0.5)
            if name.endswith(("q_proj.weight", "k_proj.weight")) and not has_qk_norm:
                w = w * ATTN_SHARPNESS
        weights[name] = w.astype(target)
    return weights


def count_parameters(model) -> int:
    from mlx.utils import tree_flatten

    return sum(p.size for _, p in tree_flatten(model.parameters()))


def write_random_model(like: str, out: Path, *, dtype: str = "bfloat16", seed: int = 0,
                       tokenizer_dir: Path | None = None, layers: int | None = None) -> dict:
    """Write the folder; returns {model_type, params, weight_bytes}. Raises if
    the architecture built by mlx-lm does not have the table's parameter count."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import save_config, save_model

    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else embedded_model_dir()
    config = build_config(like, dtype, tokenizer_dir, seed, layers)
    model = build_model(config)
    n_params = count_parameters(model)
    full = SHAPES[like]["num_hidden_layers"]
    per_layer = (SHAPES[like]["params"] - _outside_layers(SHAPES[like])) // full
    expected = SHAPES[like]["params"] - (full - config["num_hidden_layers"]) * per_layer
    expected += (config["vocab_size"] - SHAPES[like]["vocab_size"]) * config["hidden_size"] * (
        1 if config.get("tie_word_embeddings", True) else 2)
    if n_params != expected:
        raise RuntimeError(f"{like}: mlx-lm builds {n_params:,} parameters, the table says {expected:,}")
    weights = random_weights(model, config, dtype, seed)
    model.update(tree_unflatten(list(weights.items())))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    del model
    mx.clear_cache()
    return {"model_type": config["model_type"], "params": n_params,
            "weight_bytes": n_params * getattr(mx, dtype).size}
