"""A chat answer's text split into what clients see apart: content, reasoning
and tool calls.

The text arrives a piece at a time (router/text/text_stream.py). Markers (the
tool-call start and end, a reasoning model's think start and end) may span
pieces, so text that could begin one is held back until it is whole or ruled
out: no marker ever leaks into `content`. A call in the JSON convention
(`{"name": ..., "arguments": {...}}`, router/api/tools.py) streams as OpenAI's
deltas do: its id and name once the name is read, then its arguments'
text as it is generated. Other conventions are parsed whole when the call
ends, by mlx-lm's parser for the model.

Whatever ends the answer inside a call (max_tokens, a stop string, the
context, an end of sequence), its markup never becomes content: a call whose
name was read is kept as cut short (`ToolCall.complete` False: its id, name
and the arguments' text so far), one cut before its name is dropped (logged).
A call that ended but does not parse is the model's text (`unparsed`).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

from router.api.tools import ToolFormat, new_call_id

log = logging.getLogger(__name__)

# The head of a JSON-convention call, up to the start of its arguments.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
# A call cut short after its name but before its arguments began.
_NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
# A body this long that is not yet a head never becomes one: parse it whole.
_HEAD_PATIENCE = 256


@dataclass
class ToolCallDelta:
    """A part of call `index`: its id and name come first, alone; then its
    arguments' text, in order."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text; of a call cut short, the text so far (not JSON)
    complete: bool = True  # False: the answer ended inside it


@dataclass
class Split:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def extend(self, other: "Split") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls += other.calls


@dataclass
class OutputShape:
    """What a request's answer may hold besides content: `think` (start,
    end) markers and whether the answer begins inside them (the prompt
    opened the block); `tools` (their format and definitions) when calls
    are to be parsed."""

    think: tuple[str, str] | None = None
    thinking: bool = False
    tools: ToolFormat | None = None
    functions: list = field(default_factory=list)

    @classmethod
    def of(cls, tokenizer, prompt: list[int], tools: ToolFormat | None, functions: list) -> "OutputShape | None":
        """The shape of an answer to `prompt` (None: content alone): a
        reasoning block when the model has one (open already when the
        prompt ends inside it), calls when `tools` are offered."""
        think = None
        if getattr(tokenizer, "has_thinking", False):
            think = (tokenizer.think_start, tokenizer.think_end)
        if think is None and tools is None:
            return None
        thinking = False
        if think is not None:
            start, end = list(tokenizer.think_start_tokens), list(tokenizer.think_end_tokens)
            thinking = _last_at(prompt, start) > _last_at(prompt, end)
        return cls(think, thinking, tools, functions)


class _Call:
    """One call being read: its body so far and how much of it is out."""

    def __init__(self, index: int):
        self.index = index
        self.id = new_call_id()
        self.body = ""
        self.name: str | None = None  # set once announced
        self.args_from = -1  # where its arguments start in body, once the head is read
        self.sent = 0  # argument characters sent
        self.scan = _ValueEnd()

    def stream(self, fmt: ToolFormat) -> list[ToolCallDelta]:
        """Deltas for what `body` now allows sending (JSON convention only)."""
        out = []
        if not fmt.json:
            return out
        if self.name is None:
            head = _CALL_HEAD.match(self.body)
            if head is None:
                return out
            self.name = json.loads(f'"{head.group(1)}"')
            self.args_from = head.end()
            out.append(ToolCallDelta(self.index, self.id, self.name))
        if self.args_from >= 0:
            args = self.body[self.args_from:]
            if self.sent == 0:  # whitespace before the arguments is layout: never a fragment
                if not args.strip():
                    return out
                self.args_from += len(args) - len(args.lstrip())
                args = args.lstrip()
            end = self.scan.feed(args, self.sent)
            if end > self.sent:
                out.append(ToolCallDelta(self.index, arguments=args[self.sent:end]))
                self.sent = end
        return out


class _ValueEnd:
    """Finds where one JSON value ends in text that grows; until then, how
    far it may be sent (all of it)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.pos = 0
        self.done = False

    def feed(self, text: str, _sent: int) -> int:
        while self.pos < len(text) and not self.done:
            c = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    self.done = self.depth == 0
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.done = self.depth <= 0
            elif self.depth == 0 and c in ",}":  # a bare value ended (never seen: arguments are objects)
                self.pos -= 1
                self.done = True
        return self.pos


class ChatOutput:
    """One answer's splitter: `add` each piece of text, `finish` at the end;
    `calls` then holds the answer's tool calls, parsed."""

    def __init__(self, shape: OutputShape):
        self.shape = shape
        self.mode = "reasoning" if shape.think and shape.thinking else "content"
        self.held = ""
        self.calls: list[ToolCall] = []
        self._call: _Call | None = None
        self._started = 0  # calls begun: the next one's index (one that will not parse keeps its own)
        self._content_started = False
        self._whitespace = ""  # content of only whitespace: sent once something follows it
        self.unparsed = ""  # calls that would not parse, as written: content in a full response

    def add(self, text: str) -> Split:
        out = Split()
        self.held += text
        while self.held:
            if not self._step(out, final=False):
                break
        return out

    def finish(self) -> Split:
        out = Split()
        if self.held and self.mode == "content" and self.shape.tools is not None:
            # The answer ended inside a call's start marker: markup, not content.
            if len(self.held) > 1 and self.shape.tools.start.startswith(self.held):
                log.info("an answer ended inside a tool call's start marker (%r): dropped", self.held)
                self.held = self._whitespace = ""  # and the layout before it
        while self.held and self._step(out, final=True):
            pass
        if self._call is not None:
            self._end_call(out, cut=True)
        if not self.calls and self._whitespace and self._content_started:
            out.content += self._whitespace
        return out

    @property
    def made_calls(self) -> bool:
        """The answer made calls, all of them whole (none cut short)."""
        return bool(self.calls) and all(c.complete for c in self.calls)

    # ----------------------------------------------------------- internal
    def _markers(self) -> list[tuple[str, str]]:
        """(marker, mode it opens) that can end the current mode."""
        s = self.shape
        if self.mode == "reasoning":
            return [(s.think[1], "content")]
        if self.mode == "call":
            return [(s.tools.end, "content")]
        found = []
        if s.tools is not None:
            found.append((s.tools.start, "call"))
        if s.think is not None:
            found.append((s.think[0], "reasoning"))
        return found

    def _step(self, out: Split, final: bool) -> bool:
        """Consume what `held` allows; True when a marker switched modes
        (call again), False when the rest must wait for more text."""
        markers = self._markers()
        hits = [(self.held.find(m), m, mode) for m, mode in markers if m and m in self.held]
        if hits:
            at, marker, mode = min(hits)
            self._emit(out, self.held[:at])
            self.held = self.held[at + len(marker):]
            self._switch(out, mode)
            return True
        keep = 0 if final else max((_partial_len(self.held, m) for m, _ in markers if m), default=0)
        self._emit(out, self.held[: len(self.held) - keep])
        self.held = self.held[len(self.held) - keep:]
        return False

    def _switch(self, out: Split, mode: str) -> None:
        if self.mode == "call":
            self._end_call(out)
        elif mode == "call":
            self._call = _Call(self._started)
            self._started += 1
        self.mode = mode

    def _emit(self, out: Split, text: str) -> None:
        if not text:
            return
        if self.mode == "reasoning":
            out.reasoning += text
        elif self.mode == "call":
            self._call.body += text
            out.calls += self._call.stream(self.shape.tools)
        else:
            self._emit_content(out, text)

    def _emit_content(self, out: Split, text: str) -> None:
        # Whitespace between markers (after the reasoning, around calls) is
        # layout, not an answer: held until text follows it.
        if not text.strip():
            self._whitespace += text
            return
        if not self._content_started:
            text, self._whitespace = (self._whitespace + text).lstrip(), ""
            self._content_started = True
        body = text.rstrip()
        out.content += self._whitespace + body
        self._whitespace = text[len(body):]

    def _end_call(self, out: Split, cut: bool = False) -> None:
        """The call read so far, ended by its end marker or (`cut`) by the
        end of the answer."""
        call, self._call = self._call, None
        fmt = self.shape.tools
        if call.name is not None and call.scan.done:  # streamed whole: the end marker may be missing
            arguments = call.body[call.args_from:][:call.sent]
            try:
                json.loads(arguments)
                self.calls.append(ToolCall(call.id, call.name, arguments))
                return
            except ValueError:
                pass
        try:
            parsed = fmt.parse(call.body, self.shape.functions)
        except Exception as exc:  # the parsers raise anything on a malformed call
            if cut:
                self._cut_call(out, call)
                return
            log.warning("a tool call did not parse (%s: %s); returned as text", type(exc).__name__, exc)
            self.unparsed += fmt.start + call.body
            return
        for i, one in enumerate(parsed if isinstance(parsed, list) else [parsed]):
            name, arguments = one.get("name"), one.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            index = call.index if i == 0 else self._started
            self._started += i > 0
            call_id = call.id if i == 0 else new_call_id()
            out.calls.append(ToolCallDelta(index, call_id, name))
            out.calls.append(ToolCallDelta(index, arguments=arguments))
            self.calls.append(ToolCall(call_id, name, arguments))

    def _cut_call(self, out: Split, call: _Call) -> None:
        """A call the answer ended inside: kept as far as it got once its
        name is read, else dropped. Never text."""
        if call.name is None:
            head = _NAME_HEAD.match(call.body) if self.shape.tools.json else None
            if head is None:
                log.warning("the answer ended inside a tool call before its name (%d characters): dropped",
                            len(call.body))
                self._whitespace = ""  # the layout before it
                return
            call.name = json.loads(f'"{head.group(1)}"')
            out.calls.append(ToolCallDelta(call.index, call.id, call.name))
        arguments = call.body[call.args_from:][:call.sent] if call.args_from >= 0 else ""
        self.calls.append(ToolCall(call.id, call.name, arguments, complete=False))


def closed_prefix(text: str) -> dict:
    """The arguments of a call cut short as an object: the largest prefix of
    `text` that closes into valid JSON, its open strings, arrays and objects
    closed after the last value written whole (a member cut inside its key
    or value is left out, as the anthropic SDK's partial parser leaves it);
    {} when no member is whole. `{"city": "Paris", "days":` -> {"city": "Paris"}."""
    ends = [(0, "")]  # (prefix length, what closes it)
    stack: list[list] = []  # per open container: [closer, expecting a key]
    in_string = escape = False
    for i, c in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
                if stack and not stack[-1][1]:  # a value ended (not a key)
                    ends.append((i + 1, _closers(stack)))
        elif c == '"':
            in_string = True
        elif c in "{[":
            stack.append(["}" if c == "{" else "]", c == "{"])
            ends.append((i + 1, _closers(stack)))
        elif c in "}]":
            if stack:
                stack.pop()
            ends.append((i + 1, _closers(stack)))
            if not stack:
                break
        elif c == ":" and stack:
            stack[-1][1] = False
        elif c == "," and stack:
            stack[-1][1] = stack[-1][0] == "}"
        elif not c.isspace() and stack and not stack[-1][1] and (i + 1 == len(text) or text[i + 1] in ",}] \n"):
            ends.append((i + 1, _closers(stack)))  # a number or literal may end here
    for end, closers in reversed(ends):
        try:
            value = json.loads(text[:end].rstrip().rstrip(",") + closers)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def _closers(stack: list[list]) -> str:
    return "".join(closer for closer, _ in reversed(stack))


def _partial_len(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _last_at(tokens: list[int], seq: list[int]) -> int:
    n = len(seq)
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i:i + n] == seq:
            return i
    return -1
