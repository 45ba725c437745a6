"""Random-weight vision-language model folders that mlx-vlm and mlx-lm load offline.

Like text.py, but for VLMs: the folder holds config.json, the
weights (mlx-vlm's own parameter names, the mlx-community layout: mlx-vlm
loads the whole model, mlx-lm's `qwen2_vl` / `gemma3` modules load its text
part from the same files), a tokenizer, a chat template and the image
processor's settings.

No Qwen or Gemma tokenizer ships offline, so the tokenizer is the embedded
default model's (SmolLM2's byte-level BPE) plus the special tokens each
architecture needs, appended after its vocabulary; the config's token ids
(image / video placeholders, vision start and end, begin and end of image,
eos, pad) are those tokens' ids here, and the chat template renders image
parts the way the real model's template does.

    tandem random-model --like qwen2.5-vl-3b|qwen3-vl-2b|tiny-qwen2.5-vl|tiny-qwen3-vl|tiny-gemma3 --out DIR
                        [--seed 0] [--dtype float32]
"""

from __future__ import annotations

import copy
import json
import shutil
import zlib
from pathlib import Path

from benchmarks.random_models.embedded import embedded_model_dir

# ---------------------------------------------------------------------------
# Per-architecture format: special tokens, the config keys that hold their ids,
# the chat template, the processor files. A third architecture is one more entry.

# Rendered by `tokenizer.apply_chat_template`; content is a string or a list of
# parts {"type": "text", "text": ...} / {"type": "image"} / {"type": "image_url", ...}.
_QWEN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL's template: Qwen2.5-VL's without the default system turn.
_QWEN3_VL_TEMPLATE = _QWEN_TEMPLATE.replace(
    "{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}", "")

# Gemma 3: no system role (its text opens the first user turn), the assistant
# is "model", an image part is <start_of_image> (the processor expands it).
_GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}{% set ns.system = messages[0]['content'] %}"
    "{% else %}{% for p in messages[0]['content'] if p['type'] == 'text' %}"
    "{% set ns.system = ns.system + p['text'] %}{% endfor %}{% endif %}"
    "{% endif %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if loop.first and ns.system %}{{ ns.system }}\n\n{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] | trim }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] in ('image', 'image_url') %}<start_of_image>"
    "{% elif p['type'] == 'text' %}{{ p['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# OpenAI CLIP's normalization, which Qwen2.5-VL's preprocessor_config.json uses.
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

ARCHS: dict[str, dict] = {
    "qwen2_5_vl": {
        # Those the borrowed tokenizer already has (<|endoftext|>, <|im_start|>, <|im_end|>) keep their ids.
        "special_tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                           "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],
        "tokenizer": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        # config key -> token (top level, where mlx-vlm and transformers read them)
        "config_ids": {"bos_token_id": "<|endoftext|>", "vision_start_token_id": "<|vision_start|>",
                       "vision_end_token_id": "<|vision_end|>", "vision_token_id": "<|vision_pad|>",
                       "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"},
        "eos_tokens": ["<|im_end|>", "<|endoftext|>"],
        "chat_template": _QWEN_TEMPLATE,
        "processor_class": "Qwen2_5_VLProcessor",
    },
    # Qwen2.5-VL's tokens and ids; its own template and processor.
    "qwen3_vl": {
        "special_tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                           "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],
        "tokenizer": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        "config_ids": {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                       "vision_token_id": "<|vision_pad|>", "image_token_id": "<|image_pad|>",
                       "video_token_id": "<|video_pad|>"},
        "eos_tokens": ["<|im_end|>", "<|endoftext|>"],
        "chat_template": _QWEN3_VL_TEMPLATE,
        "processor_class": "Qwen3VLProcessor",
    },
    "gemma3": {
        "special_tokens": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                           "<start_of_image>", "<end_of_image>", "<image_soft_token>"],
        "tokenizer": {"eos_token": "<eos>", "pad_token": "<pad>", "bos_token": "<bos>",
                      # Gemma3Processor reads these off the tokenizer.
                      "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                               "image_token": "<image_soft_token>"}},
        "config_ids": {"bos_token_id": "<bos>", "pad_token_id": "<pad>",
                       "image_token_index": "<image_soft_token>", "image_token_id": "<image_soft_token>",
                       "boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>"},
        "eos_tokens": ["<eos>", "<end_of_turn>"],
        "chat_template": _GEMMA3_TEMPLATE,
        "processor_class": "Gemma3Processor",
    },
}

# ---------------------------------------------------------------------------
# Shapes. `init`: embedding std and lm_head gain of the random weights (see
# random_weights); `image`: the image processor's settings; `dtype`: the
# default weight dtype; `params`: the count mlx-vlm must build (checked).
#
# The tiny ones tie lm_head to an N(0, 0.05^2) embedding: with larger
# embeddings (0.3 and up) the input token dominates the residual stream and
# greedy decoding repeats one token; at 0.05 both models' greedy output
# wanders over the vocabulary and changes with the image.

SHAPES: dict[str, dict] = {
    # https://huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct/blob/main/config.json and
    # https://huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct/blob/main/preprocessor_config.json
    # mlx-vlm builds 3,754,622,976 parameters for it (the tied embedding
    # once): the checkpoint's "3.75B", 668,684,288 of them in the vision tower.
    "qwen2.5-vl-3b": {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 128000,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
        "max_window_layers": 70, "sliding_window": 32768, "use_sliding_window": False,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                          "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                          "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                          "tokens_per_second": 2, "temporal_patch_size": 2, "hidden_act": "silu"},
        "image": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                  "merge_size": 2, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD},
        "init": {"embed_std": 0.1, "lm_head_gain": 1.0}, "dtype": "bfloat16", "params": 3_754_622_976,
    },
    # Not a real model: a few-MB Qwen2.5-VL for tests. Head dim 16, so the
    # M-RoPE sections (t, h, w) split its 8 frequencies 2/3/3; the vision
    # tower's window (56 px = 2x2 merged patches) is smaller than a 112 px
    # image, so windowed and full attention blocks both do something. Images
    # are resized to 56..112 px a side: 4 to 16 image tokens.
    "tiny-qwen2.5-vl": {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 0, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_chans": 3,
                          "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                          "spatial_patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1],
                          "tokens_per_second": 2, "temporal_patch_size": 2, "hidden_act": "silu"},
        "image": {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2,
                  "merge_size": 2, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD},
        "init": {"embed_std": 0.05, "lm_head_gain": 1.0}, "dtype": "float32",
    },
    # https://huggingface.co/Qwen/Qwen3-VL-2B-Instruct/blob/main/config.json,
    # preprocessor_config.json and video_preprocessor_config.json (pixel
    # budgets: size.shortest_edge / longest_edge). DeepStack: the outputs of
    # vision blocks 5, 11 and 17 are merged and added to the hidden states of
    # text layers 0-2 at the image tokens. mlx-vlm builds 2,127,532,032
    # parameters for it (the tied embedding once), 406,957,056 in the vision tower.
    "qwen3-vl-2b": {
        "model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
        "tie_word_embeddings": True,
        "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 2048, "intermediate_size": 6144,
                        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 262144,
                        "rope_theta": 5000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                        "attention_bias": False, "hidden_act": "silu",
                        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                         "rope_type": "default"}},
        "vision_config": {"model_type": "qwen3_vl", "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
                          "num_heads": 16, "in_channels": 3, "out_hidden_size": 2048, "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
                          "deepstack_visual_indexes": [5, 11, 17], "hidden_act": "gelu_pytorch_tanh"},
        "image": {"min_pixels": 65536, "max_pixels": 16777216, "patch_size": 16, "temporal_patch_size": 2,
                  "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        "video": {"min_pixels": 4096, "max_pixels": 25165824, "fps": 2, "min_frames": 4, "max_frames": 768},
        "init": {"embed_std": 0.1, "lm_head_gain": 1.0}, "dtype": "bfloat16", "params": 2_127_532_032,
    },
    # Not a real model: a few-MB Qwen3-VL for tests. Head dim 16: interleaved
    # M-RoPE gives its 8 frequencies to t, h, w as t h w t h w t t ([4, 2, 2]);
    # vision blocks 0 and 1 feed DeepStack into text layers 0 and 1 of 3.
    # 16 px patches, merged 2x2: images are resized to 64..128 px a side
    # (multiples of 32), 4 to 16 image tokens; a video frame pair of 64x64 px
    # is 4 tokens.
    "tiny-qwen3-vl": {
        "model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
        "tie_word_embeddings": True,
        "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 16, "vocab_size": 0, "max_position_embeddings": 4096,
                        "rope_theta": 5000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                        "attention_bias": False, "hidden_act": "silu",
                        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2],
                                         "rope_type": "default"}},
        "vision_config": {"model_type": "qwen3_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 2, "in_channels": 3, "out_hidden_size": 64, "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
                          "deepstack_visual_indexes": [0, 1], "hidden_act": "gelu_pytorch_tanh"},
        "image": {"min_pixels": 64 * 64, "max_pixels": 128 * 128, "patch_size": 16, "temporal_patch_size": 2,
                  "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        "video": {"min_pixels": 64 * 64, "max_pixels": 64 * 64 * 8, "fps": 2, "min_frames": 2, "max_frames": 8},
        "init": {"embed_std": 0.05, "lm_head_gain": 1.0}, "dtype": "float32",
    },
    # Not a real model: a few-MB Gemma 3 for tests. SigLIP on 84 px images
    # (6x6 patches of 14 px), pooled to 3x3 = 9 image tokens; text layers
    # alternate a 32-token sliding window (RotatingKVCache) and global attention.
    "tiny-gemma3": {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 9,
        "text_config": {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                        "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                        "rope_global_base_freq": 1000000.0, "rope_local_base_freq": 10000.0,
                        "sliding_window": 32, "sliding_window_pattern": 2, "max_position_embeddings": 4096,
                        "mm_tokens_per_image": 9, "vocab_size": 0},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 14, "image_size": 84,
                          "num_channels": 3, "layer_norm_eps": 1e-6, "vision_use_head": False},
        "image": {"size": 84, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        "init": {"embed_std": 0.05, "lm_head_gain": 1.0}, "dtype": "float32",
    },
}
REAL_SHAPES = [name for name in SHAPES if not name.startswith("tiny")]


# ---------------------------------------------------------------------------
# Tokenizer

def build_tokenizer(arch: str, base_dir: Path):
    """The borrowed tokenizer (a `tokenizers.Tokenizer`) with `arch`'s special
    tokens added; those it already has keep their ids."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    missing = [t for t in ARCHS[arch]["special_tokens"] if tok.token_to_id(t) is None]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    return tok


def token_ids(arch: str, tok) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in ARCHS[arch]["special_tokens"]}


def write_tokenizer(arch: str, tok, out: Path) -> None:
    spec = ARCHS[arch]
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
           "clean_up_tokenization_spaces": False, "model_max_length": 131072, "unk_token": None,
           "chat_template": spec["chat_template"]}
    cfg.update({k: v for k, v in spec["tokenizer"].items()})
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    special = {k: v for k, v in spec["tokenizer"].items() if k.endswith("_token") and v}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    # mlx-vlm's processors read the template from here (load_chat_template).
    (out / "chat_template.jinja").write_text(spec["chat_template"])


# ---------------------------------------------------------------------------
# Config and processor files

def build_config(like: str, ids: dict[str, int], n_tok: int, dtype: str, seed: int) -> dict:
    shape = copy.deepcopy(SHAPES[like])
    for key in ("init", "image", "video", "dtype", "params"):
        shape.pop(key, None)
    arch = ARCHS[shape["model_type"]]
    text = shape.get("text_config", shape)
    text["vocab_size"] = max(text["vocab_size"], n_tok)  # every id the tokenizer makes needs a row
    shape["vocab_size"] = text["vocab_size"]
    for key, token in arch["config_ids"].items():
        shape[key] = ids[token]
    shape["eos_token_id"] = [ids[t] for t in arch["eos_tokens"]]
    shape["torch_dtype"] = dtype
    shape["tandem_random_model"] = {"like": like, "seed": seed, "tokenizer_size": n_tok}
    return shape


def write_processor_files(like: str, out: Path) -> None:
    """preprocessor_config.json and friends, each file mlx-vlm's processor
    would otherwise try to fetch from the Hub."""
    shape = SHAPES[like]
    model_type, image = shape["model_type"], shape["image"]
    proc_class = ARCHS[model_type]["processor_class"]
    if model_type == "qwen2_5_vl":
        pre = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": proc_class,
               "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
               "resample": 3, **image}
        (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
        video = {**pre, "video_processor_type": "Qwen2VLVideoProcessor"}
        video.pop("image_processor_type")
        (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
        (out / "processor_config.json").write_text(json.dumps({"processor_class": proc_class}, indent=2))
    elif model_type == "qwen3_vl":
        # Qwen3-VL's files give the pixel budgets as size.shortest_edge /
        # longest_edge (mlx-vlm reads both forms).
        common = {k: image[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")}
        common.update({"processor_class": proc_class, "do_rescale": True, "rescale_factor": 1 / 255,
                       "do_normalize": True, "do_convert_rgb": True, "resample": 3})
        pre = {**common, "image_processor_type": "Qwen2VLImageProcessorFast",
               "size": {"shortest_edge": image["min_pixels"], "longest_edge": image["max_pixels"]}}
        (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
        video = shape["video"]
        vid = {**common, "video_processor_type": "Qwen3VLVideoProcessor",
               "size": {"shortest_edge": video["min_pixels"], "longest_edge": video["max_pixels"]},
               **{k: video[k] for k in ("fps", "min_frames", "max_frames")}}
        (out / "video_preprocessor_config.json").write_text(json.dumps(vid, indent=2))
        (out / "processor_config.json").write_text(json.dumps({"processor_class": proc_class}, indent=2))
    elif model_type == "gemma3":
        size = image["size"]
        pre = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": proc_class,
               "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
               "do_resize": True, "image_mean": image["image_mean"], "image_std": image["image_std"],
               "resample": 2, "rescale_factor": 1 / 255, "size": {"height": size, "width": size},
               "image_seq_length": shape["mm_tokens_per_image"]}
        (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
        (out / "processor_config.json").write_text(json.dumps(
            {"processor_class": proc_class, "image_seq_length": shape["mm_tokens_per_image"]}, indent=2))
    else:  # pragma: no cover - every ARCHS entry has a branch
        raise ValueError(model_type)


def write_generation_config(config: dict, out: Path) -> None:
    gen = {"do_sample": False, "eos_token_id": config["eos_token_id"]}
    for key in ("bos_token_id", "pad_token_id"):
        if key in config:
            gen[key] = config[key]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


# ---------------------------------------------------------------------------
# Model and weights

def build_model(config: dict):
    """mlx-vlm's module for `config`, configured the way mlx_vlm.utils.load_model does."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    cfg = copy.deepcopy(config)
    arch, _ = get_model_and_args(config=cfg)
    cfg.setdefault("text_config", {})
    cfg.setdefault("vision_config", {})
    model_config = arch.ModelConfig.from_dict(cfg)
    model_config = update_module_configs(model_config, arch, cfg, ["text", "vision", "perceiver", "projector"])
    return arch.Model(model_config)


def tied_lm_head(config: dict) -> bool:
    """Whether the checkpoint leaves lm_head out (it is the embedding).
    Gemma 3 always ties: mlx-vlm copies the embedding into lm_head at load."""
    return config["model_type"] == "gemma3" or bool(config.get("tie_word_embeddings", False))


def random_weights(model, config: dict, like: str, dtype: str, seed: int) -> dict:
    """Seeded random values for every parameter the checkpoint stores.
    Matrices (2-D and up, MLX layout: fan-in on the trailing axes) are
    N(0, 1/fan_in), the token embedding N(0, embed_std^2) with the rows past
    the tokenizer's ids zeroed (greedy decoding never picks an id that cannot
    be detokenized), lm_head N(0, 1/fan_in) times lm_head_gain (a "hot" head
    keeps tiny models' greedy output varied), biases 0, other vectors (norm
    scales) as the module initializes them. Each tensor's key comes from the
    seed and its name, so the result does not depend on traversal order."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    init = SHAPES[like]["init"]
    n_tok = config["tandem_random_model"]["tokenizer_size"]
    target = getattr(mx, dtype)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("lm_head.weight") and tied_lm_head(config):
            continue
        key = mx.random.key((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**32)
        if p.ndim < 2:
            w = mx.zeros(p.shape) if name.endswith(".bias") else p
        elif name.endswith("embed_tokens.weight"):
            w = mx.random.normal(p.shape, key=key) * init["embed_std"]
        else:
            fan_in = 1
            for d in p.shape[1:]:
                fan_in *= d
            w = mx.random.normal(p.shape, key=key) * (fan_in ** -0.5)
            if name.endswith("lm_head.weight"):
                w = w * init["lm_head_gain"]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and p.shape[0] > n_tok:
            w = mx.concatenate([w[:n_tok], mx.zeros((p.shape[0] - n_tok, *p.shape[1:]))])
        weights[name] = w.astype(target)
    return weights


def count_parameters(model, config: dict) -> int:
    from mlx.utils import tree_flatten

    return sum(p.size for name, p in tree_flatten(model.parameters())
               if not (name.endswith("lm_head.weight") and tied_lm_head(config)))


def make_random_vlm(like: str, out, seed: int = 0, *, dtype: str | None = None,
                    tokenizer_dir: Path | None = None) -> dict:
    """Write the folder `out` (replaced if present). Returns {model_type,
    params, weight_bytes, token_ids}. `dtype` defaults to the shape's (float32
    for the tiny ones, which the CPU runs fastest; bfloat16 for real sizes)."""
    import mlx.core as mx
    from mlx_lm.utils import make_shards

    if like not in SHAPES:
        raise ValueError(f"unknown shape {like!r} (known: {', '.join(SHAPES)})")
    out = Path(out)
    dtype = dtype or SHAPES[like]["dtype"]
    model_type = SHAPES[like]["model_type"]
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else embedded_model_dir()
    tok = build_tokenizer(model_type, tokenizer_dir)
    ids = token_ids(model_type, tok)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    config = build_config(like, ids, n_tok, dtype, seed)

    mx.random.seed(seed)
    model = build_model(config)
    n_params = count_parameters(model, config)
    expected = SHAPES[like].get("params")
    if expected is not None:
        text = config.get("text_config", config)
        extra_rows = text["vocab_size"] - SHAPES[like].get("text_config", SHAPES[like])["vocab_size"]
        expected += extra_rows * text["hidden_size"] * (1 if tied_lm_head(config) else 2)
        if n_params != expected:
            raise RuntimeError(f"{like}: mlx-vlm builds {n_params:,} parameters, the table says {expected:,}")
    weights = random_weights(model, config, like, dtype, seed)
    del model

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shards = make_shards(weights)
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for name, shard in zip(names, shards):
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    weight_bytes = sum(v.nbytes for v in weights.values())
    del weights, shards
    mx.clear_cache()

    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(model_type, tok, out)
    write_processor_files(like, out)
    write_generation_config(config, out)
    return {"model_type": model_type, "params": n_params, "weight_bytes": weight_bytes, "token_ids": ids}
