"""A model folder's tokenizer files read as transformers 5 reads them, into a
`tokenizers` backend, its named special tokens and its end-of-sequence ids
(FolderTokenizer): what the router's ModelTokenizer builds on, and all a
worker needs of a tokenizer (its grammars' vocabulary and end) without
transformers (~0.7 CPU-s of every worker start).

What transformers does on load besides reading tokenizer.json, mirrored here
so that the router's ids are the ones mlx-lm's tokenizer gave:

- special tokens: tokenizer_config.json's (special_tokens_map.json's over
  them when the config lists no `added_tokens_decoder`), model-specific ones
  (`image_token`, a dict of `extra_special_tokens`) too; the config's added
  tokens and any special token the tokenizer lacks are added to it (a
  missing one gets a new id past the vocabulary);
- no truncation or padding; a post-processor that adds nothing where
  tokenizer.json has none;
- the Qwen2 pipeline: transformers builds a Qwen tokenizer (the config's
  `tokenizer_class` Qwen2Tokenizer, or model_type qwen2, whatever that
  class says) with its own normalizer and pre-tokenizer over the vocabulary.
  A real Qwen model's tokenizer.json says the same; a test model that
  borrows another tokenizer under a qwen2 config (tiny-qwen2) does not.

Other classes that rebuild their pipeline in Python (LlamaTokenizer,
GemmaTokenizer, ...) are read from tokenizer.json, which their real models'
files match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors

from environment.model_folder import ModelError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers 5's Qwen2Tokenizer: its split pattern, and its special tokens where the config names none.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_DEFAULTS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
# Model types whose tokenizer transformers builds as Qwen2Tokenizer when the config names no class.
QWEN2_MODEL_TYPES = frozenset(("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "qwen3", "qwen3_moe", "qwen3_next",
                               "qwen3_vl", "qwen3_vl_moe"))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


@dataclass(eq=False)  # hashed by identity: per-tokenizer caches hold it weakly (protos/grammar.py)
class FolderTokenizer:
    """A model folder's tokenizer: `FolderTokenizer.load(folder)`."""

    backend_tokenizer: Tokenizer  # llguidance builds its view from it (protos/grammar.py)
    config: dict  # tokenizer_config.json
    special_tokens_map: dict[str, str]  # what templates see as bos_token, eos_token, ...
    eos_token_id: int | None  # the tokenizer's own
    eos_token_ids: set[int]  # where generation ends: the tokenizer's and the model config's

    @classmethod
    def load(cls, folder: str | Path) -> "FolderTokenizer":
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ModelError(f"{folder}: no tokenizer.json (Tandem reads a model's tokenizer from it)")
        config = read_json(folder / "tokenizer_config.json")
        backend, special = load_backend(folder, config)
        eos = token_id(backend, special, special["eos_token"]) if "eos_token" in special else None
        return cls(backend, config, special, eos, model_eos_ids(folder) | ({eos} if eos is not None else set()))


def token_id(backend: Tokenizer, special: dict[str, str], token: str) -> int | None:
    """`token`'s id, else the unknown token's (as transformers converts it)."""
    found = backend.token_to_id(token)
    if found is None and "unk_token" in special:
        return backend.token_to_id(special["unk_token"])
    return found


def model_eos_ids(folder: Path) -> set[int]:
    """The end-of-sequence ids the model's config names, generation_config.json's
    over config.json's, as mlx-lm's `load` reads them: a chat model often ends
    its turn with one its tokenizer does not call eos (Gemma 3's <end_of_turn>,
    Llama 3's <|eom_id|>)."""
    ids = read_json(folder / "generation_config.json").get("eos_token_id") \
        or read_json(folder / "config.json").get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return {int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool)}


def load_backend(folder: Path, config: dict) -> tuple[Tokenizer, dict[str, str]]:
    """(the backend, its named special tokens' texts) for the folder, whose
    tokenizer_config.json is `config`."""
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    if backend.post_processor is None:  # as transformers sets it (no BOS or EOS added): llguidance reads it
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    values = _special_values(config, folder)
    qwen2 = _is_qwen2(config, read_json(folder / "config.json").get("model_type"))
    if qwen2:
        _qwen2_pipeline(backend)
        values = {**{k: v for k, v in QWEN2_DEFAULTS.items() if k not in values and k not in config}, **values}
    _add_tokens(backend, config, values)
    texts = {k: _content(v) for k, v in values.items()}
    if qwen2:  # Qwen2Tokenizer adds its special tokens once more, over the new pipeline
        backend.add_tokens([AddedToken(t, special=True) for t in dict.fromkeys(texts.values())])
    return backend, texts


def _is_qwen2(config: dict, model_type: str | None) -> bool:
    named = (config.get("tokenizer_class") or "").removesuffix("Fast")
    return model_type == "qwen2" or named == "Qwen2Tokenizer" or (not named and model_type in QWEN2_MODEL_TYPES)


def _qwen2_pipeline(backend: Tokenizer) -> None:
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    model = backend.model
    model.dropout, model.unk_token, model.fuse_unk, model.byte_fallback = None, None, False, False
    model.continuing_subword_prefix = model.end_of_word_suffix = ""


def _content(value) -> str | None:
    """A special token's text: a string, or an AddedToken's serialized dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _added_token(value) -> AddedToken:
    """A special token as transformers adds it."""
    if isinstance(value, dict):
        keys = ("content", "single_word", "lstrip", "rstrip", "normalized")
        return AddedToken(**{k: v for k, v in value.items() if k in keys}, special=True)
    return AddedToken(value, special=True)


def _special_values(config: dict, folder: Path) -> dict:
    """Named special tokens as transformers reads them (strings or
    AddedTokens' dicts): the config's, with special_tokens_map.json over them
    when the config lists no added tokens; model-specific names too."""
    values = dict(config)
    if "added_tokens_decoder" not in config:
        values.update(read_json(folder / "special_tokens_map.json"))
    out = {k: values[k] for k in SPECIAL_TOKENS if values.get(k) is not None}
    for key, value in values.items():
        if key not in SPECIAL_TOKENS and key.endswith("_token") and _content(value):
            out[key] = value
    extra = values.get("extra_special_tokens") or values.get("additional_special_tokens")
    if isinstance(extra, dict):
        out.update(extra)
    return out


def _add_tokens(backend: Tokenizer, config: dict, named: dict) -> None:
    """Add to `backend` what transformers adds on load: the config's added
    tokens (a named special token among them made special), then every
    special token it does not have yet."""
    listed = [AddedToken(**{k: v for k, v in t.items() if k != "__type"})
              for _, t in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))]
    named_texts = {_content(v) for v in named.values()}
    for token in listed:
        if not token.special and token.content in named_texts:
            token.special = True
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    known = {t.content for t in backend.get_added_tokens_decoder().values()} | {t.content for t in listed}
    missing = []
    for value in list(named.values()) + (list(extra) if isinstance(extra, (list, tuple)) else []):
        if _content(value) and _content(value) not in known:
            missing.append(_added_token(value))
            known.add(_content(value))
    if listed or missing:
        backend.add_tokens(listed + missing)
