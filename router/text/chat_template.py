"""A model's chat template, found and rendered as transformers finds and renders it.

The router renders prompts without importing transformers (its import alone
cost the router ~1 CPU-s and its libraries' memory), so this mirrors
transformers 5's `apply_chat_template` (tokenization_utils_base.py,
utils/chat_template_utils.py), which mlx-lm's TokenizerWrapper called:

- where the template comes from: tokenizer_config.json's `chat_template`
  (a string, or a list of named ones), replaced by chat_template.jinja, with
  additional_chat_templates/*.jinja as named ones; a processor's
  chat_template.json only when the tokenizer has none (transformers' tokenizer
  never reads it; a VLM's processor does);
- which one a request gets: "tool_use" when tools are passed and the model
  names one, else "default";
- the environment: jinja2's ImmutableSandboxedEnvironment with trim_blocks and
  lstrip_blocks, the loopcontrols extension and `{% generation %}` blocks,
  `tojson` as json.dumps (no HTML escaping, non-ASCII kept), the
  `raise_exception` and `strftime_now` globals, `dict` and a `namespace` that
  refuses underscore names;
- what the template sees: messages without their None-valued keys, copied to
  plain JSON data, a message's reasoning under `reasoning_content` and
  `thinking` alike; `tools`, `documents`, `add_generation_prompt`, the special
  tokens (`bos_token`, `eos_token`, ...) and any other arguments.

tests/router/test_chat_template.py renders every test model's template both
ways and compares the token ids.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

Templates = str | dict[str, str] | None

# Names a message's reasoning comes under; templates read the first (gpt-oss's, `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def load_templates(folder: Path, config: dict) -> Templates:
    """The model's chat template, or its named templates, as transformers'
    tokenizer loads them; None when it has none."""
    templates: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    for path in sorted(extra.glob("*.jinja")) if extra.is_dir() else ():
        templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:  # files replace the config's template, named ones and all
        return templates["default"] if list(templates) == ["default"] else templates
    found = config.get("chat_template")
    if isinstance(found, (list, tuple)):
        return {t["name"]: t["template"] for t in found}
    if found is None and (folder / "chat_template.json").is_file():
        found = json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    return found


def pick_template(templates: Templates, name: str | None = None, tools: list | None = None) -> str:
    """The template to render: `name` (a named template, or a template's own
    text), else "tool_use" with tools when the model has one, else its
    default. ValueError when there is none to pick (the router answers 400)."""
    if isinstance(templates, dict):
        if name is not None and name in templates:
            return templates[name]
        if name is None:
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError("This model has multiple chat templates with no default specified; "
                             f"its templates are {sorted(templates)}")
        return name
    if name is not None:
        return name
    if templates is None:
        raise ValueError("this model has no chat template")
    return templates


def render(template: str, messages: list[dict], tools: list[dict] | None = None, documents: list[dict] | None = None,
           add_generation_prompt: bool = False, **variables) -> str:
    """`messages` through `template`, as transformers renders one conversation.
    `variables`: the special tokens and any other template arguments."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        chat.append(_plain({k: v for k, v in message.items() if v is not None}))
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    return compiled(template).render(messages=_with_reasoning_aliases(chat), tools=_plain(tools),
                                     documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                                     **_plain(variables))


@functools.lru_cache(maxsize=8)
def compiled(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def _with_reasoning_aliases(chat: list[dict]) -> list[dict]:
    """A message's reasoning under every name templates read it by."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (the template sees no object's
    methods): anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):  # subclasses (enums, numpy scalars) as their base type
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and type(value).__name__ != "ndarray":  # a numpy scalar (np.bool_)
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks an
    assistant's tokens with it): its body, rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateDict:
    """`dict(...)` in a template, without the type itself (no attribute walks to its internals)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed names (CPython internals)."""

    def __init__(*args, **kwargs):  # jinja's own signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env
