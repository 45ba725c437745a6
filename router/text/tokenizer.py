"""The served model's tokenizer in the router, without MLX or transformers.

mlx-lm's `load_tokenizer` (a TokenizerWrapper over transformers' fast
tokenizer) cost every router start ~2.5 CPU-s and mapped MLX's libraries
(1.26 GiB of RSS on a CUDA machine) to tokenize text. This is the same
tokenizer, read from the model folder's files:

- tokenizer.json through the `tokenizers` library, with what transformers
  changes on load (environment/tokenizer_files.py), so the ids, the vocabulary and
  llguidance's view of it (`backend_tokenizer`) are transformers' own;
  `decode` cleans up spaces where transformers would;
- the chat template (chat_template.py), rendered as transformers renders it,
  with `enable_thinking` on by default for a model that thinks, as mlx-lm's
  wrapper passes it;
- the markers mlx-lm infers: the end-of-sequence ids, the thinking markers
  (`_infer_thinking`), the tool-call markers and parser (tool_calls.py);
- each token's bytes as mlx-lm's streaming detokenizers read them
  (`piece_bytes`, for router/text/text_stream.py's TokenBytes).

Its names are TokenizerWrapper's where the router used those, so the router
takes either (the tests' small tokenizer is still loaded through mlx-lm).

Not mirrored: a tokenizer without tokenizer.json (a SentencePiece model
alone: ModelError), mlx-lm's Python chat renderers (`chat_template_type`),
and the model defaults mlx-lm reads from a model's module
(`TOKENIZER_DEFAULTS`: its muse_spark model alone has them).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import Tokenizer

from router.text.chat_template import Templates, load_templates, pick_template, render
from router.text.text_stream import byte_level_bytes
from environment.tokenizer_files import FolderTokenizer, token_id
from router.text.tool_calls import JSON_TOOLS, TOOL_CALL_END, TOOL_CALL_START, parse_json_tool_call, parser_for

log = logging.getLogger(__name__)

# Thinking markers mlx-lm knows as single tokens, in its order.
THINK_TOKENS = (("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"), ("<|think:start|>", "<|think:end|>"))
# tokenizer.json decoders whose pieces mlx-lm streams by bytes: SentencePiece's (with and without
# the leading space stripped) and byte-level BPE's.
_SPM_DECODERS = [[{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                  {"type": "Fuse"}] + tail for tail in ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}], [])]


class ModelTokenizer:
    """Build with `ModelTokenizer.load(folder)`."""

    def __init__(self, files: FolderTokenizer, templates: Templates):
        backend, config = files.backend_tokenizer, files.config
        self.backend_tokenizer = backend  # llguidance builds its view from it (protos/grammar.py)
        self.chat_template = templates
        self.special_tokens_map = files.special_tokens_map  # what templates see as bos_token, eos_token, ...
        self._cleanup = bool(config.get("clean_up_tokenization_spaces", False)) and type(backend.model).__name__ != "BPE"
        self.eos_token_id, self.eos_token_ids = files.eos_token_id, files.eos_token_ids
        self._pieces = _piece_kind(backend)
        self._infer_thinking()
        self._infer_tool_calls(config.get("tool_parser_type"))

    @classmethod
    def load(cls, folder: str | Path) -> "ModelTokenizer":
        files = FolderTokenizer.load(folder)
        return cls(files, load_templates(Path(folder), files.config))

    # ------------------------------------------------------------------ ids and text

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._cleanup else text

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return token_id(self.backend_tokenizer, self.special_tokens_map, token)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def piece_bytes(self, token: int) -> bytes | None:
        """The exact bytes of one token, as mlx-lm's streaming detokenizer
        reads its piece (byte-level BPE: each character a byte; SentencePiece:
        U+2581 a space, <0xNN> a byte); None for another decoder, or an id
        past the vocabulary (decode it)."""
        if self._pieces is None:
            return None
        piece = self.backend_tokenizer.id_to_token(int(token))
        if piece is None:
            return None
        if self._pieces == "spm":
            raw = bytes([int(piece[3:5], 16)]) if piece.startswith("<0x") else piece.encode("utf-8")
            return raw.replace("\u2581".encode(), b" ")
        byte_of = byte_level_bytes()
        return b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in piece)

    # ------------------------------------------------------------------ the chat template

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs):
        """The prompt for `messages`: its token ids, or its text (`tokenize=False`).
        `chat_template`: a named template, or a template's text. `kwargs` go
        to the template (over the special tokens)."""
        kwargs.pop("return_dict", None)  # mlx-lm's callers' flag: ids are returned as a list
        kwargs.setdefault("enable_thinking", self.has_thinking)
        template = pick_template(self.chat_template, chat_template, tools)
        text = render(template, messages, tools, documents, add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ------------------------------------------------------------------ markers

    @property
    def has_thinking(self) -> bool:
        return self.think_start is not None

    @property
    def has_tool_calling(self) -> bool:
        return self.tool_call_start is not None

    def _infer_thinking(self) -> None:
        """Thinking markers as mlx-lm's `_infer_thinking` finds them."""
        self.think_start = self.think_end = self.think_start_tokens = self.think_end_tokens = None
        has = self._has_token
        for start, end in THINK_TOKENS:
            if has(start) and has(end):
                self._think(start, end, (self.convert_tokens_to_ids(start),), (self.convert_tokens_to_ids(end),))
                return
        if has("<|channel>") and has("<channel|>"):
            start, end = "<|channel>thought", "<channel|>"
        elif all(has(t) for t in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")):
            start, end = "<|open|>think<|sep|>", "<|close|>think<|sep|>"
        else:
            return
        self._think(start, end, tuple(self.encode(start, False)), tuple(self.encode(end, False)))

    def _think(self, start: str, end: str, start_tokens: tuple, end_tokens: tuple) -> None:
        self.think_start, self.think_end = start, end
        self.think_start_tokens, self.think_end_tokens = start_tokens, end_tokens

    def _infer_tool_calls(self, configured: str | None) -> None:
        """The tool-call markers and parser mlx-lm picks: the config's
        `tool_parser_type`, else inferred (tool_calls.py). Only its JSON
        format is parsed here; for another the model has no tool calling
        of its own (Tandem's default rendering)."""
        name = configured or parser_for(self.chat_template, self._has_token)
        self.tool_call_start = self.tool_call_end = self.tool_parser = None
        if name == JSON_TOOLS:
            self.tool_call_start, self.tool_call_end, self.tool_parser = TOOL_CALL_START, TOOL_CALL_END, parse_json_tool_call
        elif name is not None:
            log.warning("the chat template's tool calls are mlx-lm's %r format, which the router does not parse: "
                        "tools are rendered in Tandem's default format instead", name)

    def _has_token(self, token: str) -> bool:
        return self.backend_tokenizer.token_to_id(token) is not None


def _piece_kind(backend: Tokenizer) -> str | None:
    """How mlx-lm streams this tokenizer's pieces, from its decoder: "spm",
    "bpe" (byte-level), or None (by decoding)."""
    if backend.decoder is None:
        return None
    decoder = json.loads(backend.decoder.__getstate__())
    if decoder.get("type") == "ByteLevel":
        return "bpe"
    if decoder.get("type") == "Sequence" and decoder.get("decoders") in _SPM_DECODERS:
        return "spm"
    return None


def _clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization` (on when the config asks, never for BPE)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
