"""Token ids in, text out: incremental detokenization with stop strings.

Two things make this more than `tokenizer.decode`:
- One character may span several tokens (an emoji is four byte-tokens in a byte-level
  BPE). Token bytes go through an incremental UTF-8 decoder, which holds a partial
  character back until it is whole, so no chunk ever carries half a character.
- A stop string may span several tokens ("ST" + "OP"). Text that could be the start of a
  stop string is held back until the next token either completes the match (cut there,
  stop) or rules it out (release it).
"""

from __future__ import annotations

import codecs
import functools
from typing import Sequence


class TextStream:
    """One request's detokenizer. `add` each generated token; `flush` at the end."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), keep_leading_space: bool = False):
        self._bytes = TokenBytes(tokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # A chat answer's first token often carries the word-separating space of
        # its tokenizer ("▁The"); a completion continues the prompt and keeps it.
        self._trim_space = not keep_leading_space
        self._stops = [s for s in stop if s]
        self._held = ""  # decoded text not yet released: it may begin a stop string
        self.stopped = False  # a stop string matched; nothing more will be released
        self.stop_sequence: str | None = None  # the stop string that matched

    def add(self, token: int) -> str:
        """Feed one token; return the text that is now safe to send (may be "")."""
        if self.stopped:
            return ""
        return self._release(self._decode(self._bytes(token), final=False), final=False)

    def flush(self) -> str:
        """The generation ended: return whatever text was still held back."""
        if self.stopped:
            return ""
        return self._release(self._decode(b"", final=True), final=True)

    def _decode(self, data: bytes, final: bool) -> str:
        text = self._utf8.decode(data, final)
        if self._trim_space and text:
            self._trim_space = False
            text = text[1:] if text[0] == " " else text
        return text

    def _release(self, new_text: str, final: bool) -> str:
        text = self._held + new_text
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return text[:cut]
        hold = 0 if final else self._partial_stop_len(text)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold]

    def _first_stop(self, text: str) -> int | None:
        found = [(i, s) for i, s in ((text.find(s), s) for s in self._stops) if i >= 0]
        if not found:
            return None
        at, self.stop_sequence = min(found, key=lambda f: f[0])
        return at

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


class TokenBytes:
    """The exact bytes of single tokens, for logprobs ("bytes" and "token" fields).

    `tokenizer.decode([id])` cannot tell the bytes of a partial UTF-8 character (it gives
    U+FFFD), so read the token's piece: byte-level BPE stores tokens as byte-alphabet
    strings, SentencePiece as raw bytes with U+2581 for spaces. The router's
    ModelTokenizer reads them itself (`piece_bytes`); mlx-lm's TokenizerWrapper (the
    tests' small tokenizer) holds them in its detokenizer's token map.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._piece_bytes = getattr(tokenizer, "piece_bytes", None)
        detokenizer = getattr(tokenizer, "detokenizer", None) if self._piece_bytes is None else None
        self._tokenmap = getattr(detokenizer, "tokenmap", None)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        found = self._cache.get(token)
        if found is None:
            found = self._cache[token] = self._lookup(token)
        return found

    def text(self, token: int) -> str:
        return self(token).decode("utf-8", errors="replace")

    def _lookup(self, token: int) -> bytes:
        if self._piece_bytes is not None:
            found = self._piece_bytes(token)
            return found if found is not None else self._tokenizer.decode([token]).encode("utf-8")
        piece = self._tokenmap[token] if self._tokenmap and token < len(self._tokenmap) else None
        if isinstance(piece, bytes):
            return piece.replace("\u2581".encode(), b" ")
        if isinstance(piece, str):
            byte_of = byte_level_bytes()
            return b"".join(
                bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in piece
            )
        return self._tokenizer.decode([token]).encode("utf-8")


@functools.cache
def byte_level_bytes() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for
    (GPT-2's table: printable Latin-1 bytes as themselves, every other byte
    as chr(256 + n) in byte order). Ours, not mlx-lm's private one."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table
