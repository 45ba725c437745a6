"""A conversation's next turn in the tokens its last answer was generated as.

An agent sends back our answer as text in its next request. Tokenizing that
text again need not give the tokens the model generated: a text can have
several tokenizations, and an answer whose bytes are not valid UTF-8 does not
come back at all. The prefix cache holds the KV of the prompt and the tokens
*generated* (committed by the decode worker when the answer ends), so every
token after the first that differs is computed again on the next turn, and
with it the rest of the conversation.

The router remembers recent answers' tokens by their text (a digest, with a
token bound) and, when a chat's messages repeat such an answer as an
assistant message, puts those tokens in its place; the text around it is
tokenized piece by piece, each piece checked to give its text back. The
model sees the same text, tokenized as it wrote it, with one exception: a
chat answer's first token often carries a word-separating space that the
client never saw (router/text/text_stream.py trims it); the prompt then has it
again, as the model generated it.

Texts are compared through the tokens' exact bytes (TokenBytes), as
router/text/text_stream.py made the answer from them: `tokenizer.decode` may
clean up spaces or differ on broken UTF-8.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

from router.text.text_stream import TokenBytes

MIN_CHARS = 16  # shorter answers: little to gain, more chances to match the wrong text
CALLS_KEPT = 4096  # answers that made tool calls, by their call ids


class AnswerTokens:
    """Recent answers' generated tokens by their text, LRU under `max_tokens`."""

    def __init__(self, token_bytes: TokenBytes, max_tokens: int = 4_000_000):
        self.token_bytes = token_bytes
        self.max_tokens = max_tokens
        self._by_text: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._tokens = 0
        # An answer that made tool calls comes back as calls with ids, not
        # as its text: the text the model wrote, by the calls' ids, renders
        # them back as written (router/api/tools.py render_default).
        self._by_calls: OrderedDict[tuple, tuple[str, list]] = OrderedDict()
        self.spliced_tokens = 0  # answer tokens put back in prompts, for tests and logs

    @staticmethod
    def _key(text: str) -> bytes:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def _text(self, tokens) -> str:
        return b"".join(self.token_bytes(int(t)) for t in tokens).decode("utf-8", errors="replace")

    def remember(self, text: str, tokens: Sequence[int]) -> None:
        """`tokens` (no end-of-sequence token) were generated as `text` (the
        client's text: its leading space may have been trimmed)."""
        if len(text) < MIN_CHARS or not tokens or len(tokens) > self.max_tokens:
            return
        if self._text(tokens) not in (text, " " + text):
            return  # not this text's tokens: nothing to put back
        key = self._key(text)
        old = self._by_text.pop(key, None)
        if old is not None:
            self._tokens -= len(old)
        self._by_text[key] = np.asarray(tokens, dtype=np.int32)
        self._tokens += len(tokens)
        while self._tokens > self.max_tokens:
            _, dropped = self._by_text.popitem(last=False)
            self._tokens -= len(dropped)

    def remember_calls(self, calls: Sequence[tuple], text: str) -> None:
        """`calls` [(id, name, arguments as a JSON value)] were written as `text`."""
        self._by_calls[tuple(c[0] for c in calls)] = (text, [(name, args) for _, name, args in calls])
        while len(self._by_calls) > CALLS_KEPT:
            self._by_calls.popitem(last=False)

    def written_calls(self, calls: Sequence[tuple]) -> str | None:
        """The text of the recent answer that made exactly these calls
        [(id, name, arguments)]: same ids, and the names and arguments the
        client sends back unchanged (an edited call is rendered as sent)."""
        found = self._by_calls.get(tuple(c[0] for c in calls))
        if found is None or found[1] != [(name, args) for _, name, args in calls]:
            return None
        return found[0]

    def get(self, text: str) -> np.ndarray | None:
        key = self._key(text)
        tokens = self._by_text.get(key)
        if tokens is not None:
            self._by_text.move_to_end(key)
        return tokens

    def splice(self, tokenizer, messages: list[dict], **template_kwargs) -> list[int] | None:
        """The chat template's prompt for `messages` with every remembered
        assistant answer in its generated tokens; None when there is none or
        the text around them does not tokenize back to itself (the caller
        then tokenizes the template as usual)."""
        remembered = {i: ids for i, m in enumerate(messages)
                      if m["role"] == "assistant" and isinstance(m.get("content"), str)
                      and len(m["content"]) >= MIN_CHARS and (ids := self.get(m["content"])) is not None}
        if not remembered:
            return None
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
        # Where each message's content sits in the rendered text: the template
        # renders them in order, so each is searched after the one before; a
        # message it transformed (not found verbatim) ends the search.
        spans, pos = [], 0
        for i, m in enumerate(messages):
            content = m.get("content")
            if not isinstance(content, str) or not content:
                continue
            at = text.find(content, pos)
            if at < 0:
                break
            pos = at + len(content)
            if i in remembered:
                spans.append((at, pos, remembered[i]))
        if not spans:
            return None
        out: list[int] = []
        start = 0
        for at, end, ids in spans + [(len(text), len(text), None)]:
            piece = self._encode(tokenizer, text[start:at])
            if piece is None:
                return None
            out += piece
            if ids is not None:
                out += ids.tolist()
            start = end
        self.spliced_tokens += sum(len(ids) for _, _, ids in spans)
        return out

    def _encode(self, tokenizer, text: str) -> list[int] | None:
        """`text`'s tokens (the rendered template holds its special tokens,
        BOS included, as text); None if they do not give `text` back."""
        if not text:
            return []
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        return ids if self._text(ids) == text else None
