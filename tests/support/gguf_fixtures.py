"""Write small GGUF files for tests with the `gguf` package's writer.

`write_tiny_llama` writes a random-weight llama the way llama.cpp's converter
does (Q/K rows permuted for interleaved rope) and returns the weights in
Hugging Face order exactly as the file represents them (after quantization),
so a test can build the same model directly in MLX and compare logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def tiny_vocab():
    """(tokens, merges, token types): specials, the byte alphabet, a few merges."""
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = SPECIALS + USER_DEFINED + byte_alphabet() + [m.replace(" ", "") for m in merges]
    types = [3] * len(SPECIALS) + [4] * len(USER_DEFINED) + [1] * (len(tokens) - len(SPECIALS) - len(USER_DEFINED))
    return tokens, merges, types


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering: within each head, rows (i, i + d/2) become
    neighbours, so interleaved (traditional) rope rotates the pairs that
    rotate-half rope rotates in the Hugging Face layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_llama(cfg: dict, vocab_size: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face-named float32 weights."""
    rng = np.random.default_rng(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def mat(o, n):
        return (rng.standard_normal((o, n)) / np.sqrt(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab_size, h)).astype(np.float32)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w[p + "self_attn.q_proj.weight"] = mat(h, h)
        w[p + "self_attn.k_proj.weight"] = mat(kv, h)
        w[p + "self_attn.v_proj.weight"] = mat(kv, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, h)
        w[p + "mlp.gate_proj.weight"] = mat(i, h)
        w[p + "mlp.up_proj.weight"] = mat(i, h)
        w[p + "mlp.down_proj.weight"] = mat(h, i)
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    w["model.norm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    if not tied:
        w["lm_head.weight"] = mat(vocab_size, h)
    return w


_GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    mod = hf_name.removesuffix(".weight")
    if mod.startswith("model.layers."):
        _, _, n, rest = mod.split(".", 3)
        return f"blk.{n}.{_GGUF_NAMES[rest]}.weight"
    return f"{_GGUF_NAMES[mod]}.weight"


def write_tiny_llama(
    path: Path,
    *,
    types: dict[str, T] | None = None,
    default_type: T = T.F32,
    tied: bool = True,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str | None = "smollm",
    add_bos: bool = False,
    drop: tuple[str, ...] = (),
    seed: int = 0,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Write a tiny llama GGUF. `types` maps GGUF tensor names to their type
    (others use `default_type`; 1-D norms are always F32, as in llama.cpp).
    `drop` names GGUF tensors to leave out (to make a broken file).
    Returns (config, HF-order float32 weights the file represents)."""
    cfg = dict(TINY)
    tokens, merges, token_types = tiny_vocab()
    hf = random_llama(cfg, len(tokens), tied, seed)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    wr = GGUFWriter(str(path), arch)
    wr.add_name("tiny-test-llama")
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv_heads)
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_rope_freq_base(cfg["rope_theta"])
    wr.add_rope_dimension_count(cfg["hidden_size"] // heads)
    wr.add_vocab_size(len(tokens))
    wr.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        wr.add_tokenizer_pre(pre)
    wr.add_token_list(tokens)
    wr.add_token_merges(merges)
    wr.add_token_types(token_types)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_pad_token_id(2)
    wr.add_add_bos_token(add_bos)
    wr.add_chat_template(CHAT_TEMPLATE)

    represented = {}
    for name, w in hf.items():
        gname = gguf_name(name)
        if gname in drop:
            continue
        n_head = heads if ".q_proj" in name else kv_heads if ".k_proj" in name else None
        data = permute_qk(w, n_head) if n_head else w
        qtype = T.F32 if w.ndim == 1 else (types or {}).get(gname, default_type)
        if qtype == T.F32:
            wr.add_tensor(gname, data)
            back = data
        elif qtype == T.F16:
            wr.add_tensor(gname, data.astype(np.float16))
            back = data.astype(np.float16).astype(np.float32)
        else:
            raw = quants.quantize(data, qtype)
            wr.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
            back = quants.dequantize(raw, qtype).astype(np.float32)
        represented[name] = unpermute_qk(back, n_head) if n_head else back

    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    cfg["vocab_size"] = len(tokens)
    cfg["tie_word_embeddings"] = tied
    return cfg, represented


def write_minimal_gguf(path: Path, *, arch: str = "llama", tensors: dict[str, tuple[np.ndarray, T]] = {}) -> None:
    """A GGUF with only an architecture and the given raw tensors: enough
    to reach the converter's checks of architecture and tensor types."""
    wr = GGUFWriter(str(path), arch)
    for name, (raw, qtype) in tensors.items():
        if qtype in (T.F32, T.F16):
            wr.add_tensor(name, raw)
        else:
            wr.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
