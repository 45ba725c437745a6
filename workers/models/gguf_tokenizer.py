"""Rebuild a Hugging Face `tokenizers` tokenizer from GGUF metadata.

GGUF keeps the vocabulary (tokens in id order), the BPE merges, a type per
token and the name of the pre-tokenizer (`tokenizer.ggml.pre`); the split
regexes themselves live in llama.cpp's code, so each supported name maps to
its pre-tokenizer here. The output is tokenizer.json + tokenizer_config.json,
which mlx_lm, transformers' AutoTokenizer and the `tokenizers` library load.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from environment.model_folder import ModelError

# GGUF token types (llama.cpp's llama_token_type).
CONTROL, USER_DEFINED = 3, 4

# Llama 3's split: case-insensitive contractions, letters with at most one
# leading non-letter, numbers in groups of up to three, punctuation runs,
# newlines, and whitespace.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm():
    # llama.cpp's "smollm": every digit on its own, then GPT-2's regex.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2()]
    )


def _llama3():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre → (pre-tokenizer factory, ignore_merges). A missing name
# or "default" falls back to GPT-2's byte-level split, as llama.cpp does for
# BPE files written before the key existed. Llama 3 looks whole words up in the
# vocabulary before merging (HF's ignore_merges, llama.cpp does the same).
_PRE = {
    None: (_gpt2, False),
    "default": (_gpt2, False),
    "gpt2": (_gpt2, False),
    "smollm": (_smollm, False),
    "llama-bpe": (_llama3, True),
    "llama3": (_llama3, True),
}


def check_pre_tokenizer(pre: str | None, path) -> None:
    if pre not in _PRE:
        names = ", ".join(sorted(k for k in _PRE if k))
        raise ModelError(f"{path}: unsupported pre-tokenizer {pre!r} (supported: {names})")


def _py(value):
    """mx.array / numpy metadata → plain Python values."""
    return value.tolist() if hasattr(value, "tolist") else value


def build_tokenizer(meta: dict, path="GGUF") -> Tokenizer:
    """A byte-level BPE tokenizer with the GGUF's ids; control tokens become
    special added tokens and user-defined tokens plain added tokens (the
    inverse of how llama.cpp's converter assigns those two types)."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelError(
            f"{path}: unsupported tokenizer model {model!r} "
            "(only byte-level BPE, 'gpt2', is converted; SentencePiece 'llama' is not)"
        )
    pre = meta.get("tokenizer.ggml.pre")
    check_pre_tokenizer(pre, path)
    make_pre, ignore_merges = _PRE[pre]

    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated string keeps its first id
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False))
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()

    types = _py(meta.get("tokenizer.ggml.token_type", [])) or []
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    )
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _special(meta: dict, tokens: list[str], kind: str) -> tuple[str, int] | None:
    i = _py(meta.get(f"tokenizer.ggml.{kind}_token_id"))
    if i is None or not 0 <= i < len(tokens):
        return None
    return tokens[i], i


def _post_processor(meta: dict, tokens: list[str]):
    """Adds BOS/EOS when the GGUF says to; HF's fast tokenizers add them
    through this template, not through tokenizer_config's add_bos_token."""
    bos = _special(meta, tokens, "bos") if _py(meta.get("tokenizer.ggml.add_bos_token", False)) else None
    eos = _special(meta, tokens, "eos") if _py(meta.get("tokenizer.ggml.add_eos_token", False)) else None
    if not (bos or eos):
        return processors.ByteLevel(trim_offsets=False)

    def seq(piece: str, type_id: int) -> str:
        before = f"{bos[0]}:{type_id} " if bos else ""
        after = f" {eos[0]}:{type_id}" if eos else ""
        return f"{before}{piece}:{type_id}{after}"

    return processors.TemplateProcessing(
        single=seq("$A", 0),
        pair=f"{seq('$A', 0)} {seq('$B', 1)}",
        special_tokens=[s for s in (bos, eos) if s],
    )


def tokenizer_config(meta: dict) -> dict:
    tokens = list(meta["tokenizer.ggml.tokens"])
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_py(meta.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": bool(_py(meta.get("tokenizer.ggml.add_eos_token", False))),
        "clean_up_tokenization_spaces": False,
    }
    for kind, gguf_kind in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        s = _special(meta, tokens, gguf_kind)
        if s:
            cfg[f"{kind}_token"] = s[0]
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


def write_tokenizer_files(meta: dict, folder: str | Path, path="GGUF") -> None:
    folder = Path(folder)
    build_tokenizer(meta, path).save(str(folder / "tokenizer.json"))
    text = json.dumps(tokenizer_config(meta), indent=2, ensure_ascii=False)
    (folder / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
