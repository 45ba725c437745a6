"""The router's own tokenizer (router/text/) against mlx-lm's TokenizerWrapper
over transformers, which the router loaded before: for every tokenizer the
tests serve (the embedded SmolLM2; the tiny random text models and VLMs, which
borrow it with their own special tokens and templates; the router tests' small
ChatML tokenizers) plus a Qwen3-style tool-calling template and a
SentencePiece-style tokenizer, the same backend (so the same ids and
llguidance vocabulary), special tokens, markers, prompts (token for token,
with and without tools, multi-turn, reasoning, the generation prompt),
encode/decode, token bytes and streamed text."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import httpx
import pytest
from mlx_lm.tool_parsers import json_tools
from mlx_lm.tokenizer_utils import _infer_tool_parser
from mlx_lm.utils import load_config, load_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from benchmarks.random_models import text as random_text
from benchmarks.random_models import vlm as random_vlm
from router.api.tools import ToolFormat
from router.text.text_stream import TextStream, TokenBytes
from router.text.tokenizer import ModelTokenizer
from router.text.tool_calls import parse_json_tool_call, parser_for
from tests.support.fake_engine import FakeEngine, build_tokenizer
from tests.support.router_server import serve_app

# Written for these tests in the manner of Qwen3's template: tools as JSON in the
# system turn, calls in <tool_call> tags, results grouped in a user turn, the
# reasoning of answers after the last user query kept, enable_thinking.
QWEN3_STYLE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nFunction signatures in <tools></tools> tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nCall one as <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
  {%- set i = messages|length - loop.index0 - 1 %}
  {%- if message.role == 'user' and message.content is string and not message.content.startswith('<tool_response>') %}
    {%- set ns.last_query = i %}{% break %}
  {%- endif %}
{%- endfor %}
{%- for message in messages %}
  {%- set content = message.content if message.content is string else '' %}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
  {%- elif message.role == 'assistant' %}
    {%- set reasoning = '' %}
    {%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}
    {%- elif '</think>' in content %}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if loop.index0 > ns.last_query and reasoning %}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}
    {{- content }}
    {%- for tool_call in message.tool_calls | default([]) %}
      {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
      {%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}
      {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
      {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
      {{- '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
  {%- elif not loop.first %}
    {{- raise_exception('Unexpected role: ' + message.role) }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
  {%- if enable_thinking is not defined %}{{- '(unset)' }}{%- endif %}
{%- endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city — «aujourd'hui» <b>&</b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
         {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
CHATS = {
    "one turn": [{"role": "user", "content": "What is the capital of France?"}],
    "multi-turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <b>&</b> 👍 東京"},
                   {"role": "assistant", "content": "Hi there!"}, {"role": "user", "content": "Again, in  two  words."}],
    "tool calls": [{"role": "user", "content": "Weather in Zürich, and 1 + 2?"},
                   {"role": "assistant", "content": "", "tool_calls": CALLS},
                   {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 °C"},
                   {"role": "tool", "tool_call_id": "call_2", "content": "3"},
                   {"role": "assistant", "content": "Sunny; 3."}, {"role": "user", "content": "Thanks"}],
    "None keys": [{"role": "user", "content": "Call it"},
                  {"role": "assistant", "content": None, "tool_calls": CALLS[:1], "name": None},
                  {"role": "tool", "tool_call_id": "call_1", "content": "Rain"}],
    "reasoning": [{"role": "user", "content": "2 + 2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
                  {"role": "user", "content": "3 + 3?"},
                  {"role": "assistant", "content": "<think>\nsix\n</think>\n\n6"}],
    "reasoning alias": [{"role": "user", "content": "2 + 2?"},
                        {"role": "assistant", "content": "4", "reasoning": "A quick sum."}],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "image"},
                                           {"type": "text", "text": " this."}]}],
    "bad role": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "meanwhile"}],
}


def _spm_folder(folder: Path) -> None:
    """A SentencePiece-style tokenizer (Metaspace, byte fallback, the SPM decoder mlx-lm streams by bytes)."""
    folder.mkdir(parents=True)
    bpe = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    bpe.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    bpe.train_from_iterator(["Hello world. The capital of France is Paris.", "the quick brown fox"] * 5,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])  # BOS
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{{ pad_token }}{% endif %}"}))
    # The config lists no added tokens, so this file's tokens win; a pad token the vocabulary lacks gets a new id.
    pad = {"content": "<pad>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": pad}))


def _qwen3_style_folder(folder: Path, small: Path) -> None:
    """The small ChatML tokenizer with Qwen3's markers as added tokens, listed
    in the config's added_tokens_decoder, and the Qwen3-style template."""
    folder.mkdir(parents=True)
    shutil.copyfile(small / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((small / "tokenizer_config.json").read_text())
    n = len(json.loads((small / "tokenizer.json").read_text())["model"]["vocab"])
    added = {str(n + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                          "special": False} for i, t in enumerate(["<think>", "</think>", "<tool_call>", "</tool_call>"])}
    config.update(added_tokens_decoder={**config.get("added_tokens_decoder", {}), **added}, chat_template=QWEN3_STYLE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    # As Qwen's and Gemma's: the model's config ends generation on more than the tokenizer's eos,
    # generation_config.json's list over config.json's.
    ids = Tokenizer.from_file(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": ids.token_to_id("<|im_end|>")}))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids.token_to_id("<|im_end|>"), ids.token_to_id("<|endoftext|>")]}))


def _named_templates_folder(folder: Path, small: Path) -> None:
    """Named templates in files: chat_template.jinja and additional_chat_templates/tool_use.jinja."""
    (folder / "additional_chat_templates").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(small / name, folder / name)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(
        "{{ tools | tojson(indent=2) }}\n{% for m in messages %}{{ m.role | upper }}> {{ m.content }}\n{% endfor %}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, embedded_model_dir) -> dict[str, Path]:
    base, embedded = tmp_path_factory.mktemp("tokenizers"), Path(embedded_model_dir)
    out = {"smollm2": embedded}  # tiny-llama's files are these, its config a llama's too
    for like in ("tiny-qwen3", "tiny-qwen2"):  # a random text model's tokenizer files, as written
        folder = out[like] = base / like
        folder.mkdir()
        for name in random_text.TOKENIZER_FILES:
            if (embedded / name).is_file():
                shutil.copyfile(embedded / name, folder / name)
        (folder / "config.json").write_text(json.dumps(random_text.build_config(like, "float32", embedded, 0)))
    for like in ("tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-gemma3"):  # a tiny VLM's tokenizer files, as written
        folder = out[like] = base / like
        folder.mkdir()
        arch = random_vlm.SHAPES[like]["model_type"]
        tok = random_vlm.build_tokenizer(arch, embedded)
        random_vlm.write_tokenizer(arch, tok, folder)
        config = random_vlm.build_config(like, random_vlm.token_ids(arch, tok), tok.get_vocab_size(), "float32", 0)
        (folder / "config.json").write_text(json.dumps(config))
    build_tokenizer(base / "chatml")
    build_tokenizer(base / "chatml-thinking", thinking=True)
    out.update({"chatml": base / "chatml", "chatml-thinking": base / "chatml-thinking"})
    _spm_folder(out.setdefault("spm", base / "spm"))
    _qwen3_style_folder(out.setdefault("qwen3-style", base / "qwen3-style"), base / "chatml")
    _named_templates_folder(out.setdefault("named-templates", base / "named-templates"), base / "chatml")
    return out


@pytest.fixture(scope="module")
def pairs(folders) -> dict[str, tuple[ModelTokenizer, object]]:
    """(ours, mlx-lm's as mlx_lm.load gives it: with the config's eos ids) per folder."""
    def mlx_lms(folder: Path):
        eos = load_config(folder).get("eos_token_id") if (folder / "config.json").is_file() else None
        return load_tokenizer(folder, eos_token_ids=eos)

    return {name: (ModelTokenizer.load(folder), mlx_lms(Path(folder))) for name, folder in folders.items()}


def test_the_same_backend_special_tokens_and_markers(pairs):
    for name, (ours, theirs) in pairs.items():
        # The whole pipeline, added tokens included: the same ids, and llguidance's vocabulary.
        assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str(), name
        assert len(ours) == len(theirs) and ours.eos_token_ids == theirs.eos_token_ids, name
        assert ours.special_tokens_map == theirs.special_tokens_map, name
        for attr in ("has_thinking", "think_start", "think_end", "think_start_tokens", "think_end_tokens",
                     "has_tool_calling", "tool_call_start", "tool_call_end"):
            assert getattr(ours, attr) == getattr(theirs, attr), (name, attr)
        assert (ours.tool_parser is None) == (theirs.tool_parser is None), name
    assert pairs["chatml-thinking"][0].has_thinking and pairs["qwen3-style"][0].has_thinking
    assert len(pairs["qwen3-style"][0].eos_token_ids) == 2  # <|endoftext|> too, from generation_config.json
    spm = pairs["spm"][0]
    assert spm.special_tokens_map["pad_token"] == "<pad>" and spm.convert_tokens_to_ids("<pad>") == len(spm) - 1
    assert spm.encode("Hello")[0] == 1 and spm.encode("Hello", add_special_tokens=False)[0] != 1
    qwen = ToolFormat.of(pairs["qwen3-style"][0])
    assert qwen.native and qwen.json and qwen.parse is parse_json_tool_call


def _both(ours, theirs, messages, **kwargs):
    """Each tokenizer's prompt ids and text, or the exception it raised."""
    out = []
    for tok in (ours, theirs):
        try:
            ids = list(tok.apply_chat_template(messages, **kwargs))
            out.append((ids, tok.apply_chat_template(messages, tokenize=False, **kwargs)))
        except Exception as exc:  # the router turns these into a 400; the same type either way
            out.append(type(exc))
    return out


@pytest.mark.parametrize("chat", list(CHATS))
def test_prompts_are_token_identical(pairs, chat):
    for name, (ours, theirs) in pairs.items():
        for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                       {"add_generation_prompt": True, "tools": TOOLS}, {"add_generation_prompt": True,
                                                                         "enable_thinking": False}):
            mine, reference = _both(ours, theirs, json.loads(json.dumps(CHATS[chat])), **kwargs)
            assert mine == reference, (name, chat, kwargs)


def test_the_qwen3_style_prompt_renders_what_it_should(pairs):
    """Not only equal: the features the comparison rests on were exercised."""
    ours, _ = pairs["qwen3-style"]
    text = ours.apply_chat_template(CHATS["tool calls"], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"description": "Weather in a city — «aujourd\'hui» <b>&</b>"' in text  # tojson: no escaping, no \\u
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nSunny, 21 °C\n</tool_response>\n<tool_response>\n3" in text
    reasoning = ours.apply_chat_template(CHATS["reasoning"], tokenize=False)
    assert "<think>\nsix\n</think>\n\n6" in reasoning and "Two and two" not in reasoning  # before the last query
    assert "<think>\nA quick sum.\n</think>\n\n4" in ours.apply_chat_template(CHATS["reasoning alias"], tokenize=False)
    assert "(unset)" not in ours.apply_chat_template(CHATS["one turn"], add_generation_prompt=True, tokenize=False)
    off = ours.apply_chat_template(CHATS["one turn"], add_generation_prompt=True, enable_thinking=False)
    assert ours.decode(off).endswith("<think>\n\n</think>\n\n") and ours.think_start_tokens[0] in off


def test_named_templates_are_picked_as_transformers_picks_them(pairs):
    ours, theirs = pairs["named-templates"]
    assert set(ours.chat_template) == {"default", "tool_use"}
    for kwargs in ({}, {"tools": TOOLS}, {"chat_template": "tool_use", "tools": []}, {"chat_template": "{{ 'x' }}"}):
        mine, reference = _both(ours, theirs, CHATS["multi-turn"], **kwargs)
        assert mine == reference, kwargs
    assert ours.apply_chat_template(CHATS["one turn"], tools=TOOLS, tokenize=False).startswith('[\n  {\n    "type"')


TEXTS = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n\treturn {'a': x ** 2}  # square\n\n\n",
         "Café, naïve façade: São Paulo, Zürich.", "東京は日本の首都です。你好，世界！", "Emoji 👍🏽 family 👨‍👩‍👧 done",
         "  leading and trailing spaces   \r\n tabs\t\tand 2024-11-22 12,345.678 ", "<|im_end|> in text <think>"]


def test_encode_and_decode_match_and_round_trip(pairs):
    rng = random.Random(0)
    for name, (ours, theirs) in pairs.items():
        for text in TEXTS:
            for special in (True, False):
                assert ours.encode(text, special) == list(theirs.encode(text, add_special_tokens=special)), name
            ids = ours.encode(text, add_special_tokens=False)
            assert ours.decode(ids) == theirs.decode(ids), name
            if name != "spm":  # SentencePiece's decoder strips the leading space, and <unk> stands for what it lost
                assert ours.decode(ids) == text, name
        for _ in range(20):
            ids = [rng.randrange(len(ours)) for _ in range(rng.randrange(1, 30))]
            assert ours.decode(ids) == theirs.decode(ids), (name, ids)
            assert ours.convert_tokens_to_ids(ours.backend_tokenizer.id_to_token(ids[0])) == \
                theirs.convert_tokens_to_ids(theirs.backend_tokenizer.id_to_token(ids[0]))


def test_token_bytes_are_mlx_lms(pairs):
    """Every token's bytes (logprobs' "bytes", the streamed text) as mlx-lm's detokenizer map gives them."""
    rng = random.Random(2)
    for name in ("smollm2", "tiny-qwen2", "tiny-gemma3", "chatml-thinking", "spm"):
        ours, theirs = pairs[name]
        mine, reference = TokenBytes(ours), TokenBytes(theirs)
        ids = range(len(ours)) if len(ours) < 1000 else [*range(300), *rng.sample(range(len(ours)), 3000),
                                                          *range(ours.backend_tokenizer.get_vocab_size(False), len(ours))]
        assert [mine(t) for t in ids] == [reference(t) for t in ids], name


def _mlx_lm_text(tokenizer, tokens: list[int]) -> str:
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for t in tokens:
        detokenizer.add_token(t)
    detokenizer.finalize()
    return detokenizer.text


def _streamed(tokenizer, tokens: list[int]) -> str:
    stream = TextStream(tokenizer)
    return "".join(stream.add(t) for t in tokens) + stream.flush()


def test_streamed_text_is_mlx_lms_on_random_tokens(pairs):
    """TextStream over our tokenizer against mlx-lm's streaming detokenizer:
    random token sequences, and sequences made of many small byte tokens
    (split UTF-8 characters). mlx-lm's byte-level table reads the NUL byte's
    character (U+0100) as text, not as a byte: left out."""
    rng = random.Random(1)
    for name in ("smollm2", "tiny-qwen2", "tiny-qwen2.5-vl", "chatml", "spm"):
        ours, theirs = pairs[name]
        if name == "spm":  # decoding keeps its <unk> pieces' text; bytes keep theirs
            usable = [t for t in range(len(ours)) if t != ours.convert_tokens_to_ids("<unk>")]
        else:
            usable = [t for t in range(len(ours)) if "\u0100" not in ours.backend_tokenizer.id_to_token(t)]
        short = [t for t in usable if len(ours.backend_tokenizer.id_to_token(t)) == 1]
        for _ in range(60):
            pool = short if rng.random() < 0.5 else usable
            tokens = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
            assert _streamed(ours, tokens) == _mlx_lm_text(theirs, tokens), (name, tokens)
        for text in TEXTS:
            tokens = ours.encode(text, add_special_tokens=False)
            if name == "spm" and text.startswith("  "):  # mlx-lm trims spaces until its text is not empty;
                assert _streamed(ours, tokens) == ours.decode(tokens)  # one, as decoding does
                continue
            assert _streamed(ours, tokens) == _mlx_lm_text(theirs, tokens), (name, text)


def test_the_tool_parser_is_mlx_lms():
    samples = ['{"name": "get_weather", "arguments": {"city": "Zürich"}}', '\n  {"name": "f", "arguments": {}}\n\n',
               '{"name": "a", "arguments": {"x": [1, 2.5, null, true], "y": "\\u00e9\\n"}}', "[1, 2]"]
    for text in samples:
        assert parse_json_tool_call(text) == json_tools.parse_tool_call(text, None)
    for bad in ('{"name": "f", "arguments": {', "", "not json"):
        with pytest.raises(ValueError):
            parse_json_tool_call(bad)
        with pytest.raises(ValueError):
            json_tools.parse_tool_call(bad)


class _Vocab:
    """What mlx-lm's `_infer_tool_parser` reads of a tokenizer."""

    def __init__(self, template, vocab=()):
        self.chat_template = template
        self.vocab = {t: i for i, t in enumerate(vocab)}

    def get_vocab(self):
        return self.vocab


def test_the_tool_format_is_inferred_as_mlx_lm_infers_it(pairs):
    templates = ["<minimax:tool_call>", "<|tool_call>x<tool_call|>", "<start_function_call>", "<longcat_tool_call>",
                 "<arg_key>", "<|tool_list_start|>", "<|tool_call_start|>", "<tool_call>\n<function=",
                 "<tool_call>\\n<function=", "<|tool_calls_section_begin|>", '<function name="x"><param name="y">',
                 "[TOOL_CALLS]", "<atem:function_calls>", "<tool_call>{{ tool_call.name }}", "<tool_call> only",
                 "tool_call.name only", "plain", None, {"default": "<tool_call>{{ tool_call.name }}"}]
    vocabs = [(), ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"), ("<|tool_call_start|>", "<|tool_call_end|>")]
    for template in templates:
        for vocab in vocabs:
            ref = _Vocab(template, vocab)
            assert parser_for(template, ref.vocab.__contains__) == _infer_tool_parser(ref), (template, vocab)
    for name, (ours, theirs) in pairs.items():
        has = ours.backend_tokenizer.token_to_id
        assert parser_for(ours.chat_template, lambda t: has(t) is not None) == _infer_tool_parser(theirs), name



def _served(tokenizer, body: dict, answer: str) -> tuple[list, dict, list]:
    """What the router's app over `tokenizer` makes of a chat and a completion,
    the engine saying `answer`: (the engine's prompts, the chat's message and
    finish, the completion's text and tokens), ids left out."""
    engine = FakeEngine(tokenizer, max_context=4096)
    engine.say(answer)
    with serve_app(engine, tokenizer, request_timeout_s=30) as server:
        chat = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()
        completion = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": "tandem-test", "prompt": TEXTS[4], "max_tokens": 200, "logprobs": 0}).json()
    choice = chat["choices"][0]
    for call in choice["message"].get("tool_calls") or []:
        call.pop("id")
    texts = [completion["choices"][0]["text"], completion["choices"][0]["logprobs"]["tokens"]]
    return [list(r.prompt_tokens) for r in engine.requests], {**choice, "usage": chat["usage"]}, texts


def test_the_router_serves_the_same_prompts_and_answers_over_either_tokenizer(pairs):
    """The router's app over our tokenizer against the same app over mlx-lm's
    (what it served before), the same request: a reasoning model with tools in
    its template (native tools, JSON calls parsed, reasoning split off) and
    the embedded model without (Tandem's default rendering; a forced call,
    its grammar checked by llguidance over the vocabulary), token logprobs'
    bytes included."""
    messages = json.loads(json.dumps(CHATS["tool calls"]))
    for call in messages[1]["tool_calls"]:
        if not isinstance(call["function"]["arguments"], str):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    answer = ("<think>Thinking it over.</think>\n\nLet me look. 👍🏽\n"
              '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    for name, choice in (("qwen3-style", "auto"), ("smollm2", {"type": "function", "function": {"name": "add"}})):
        body = {"model": "tandem-test", "messages": messages, "tools": TOOLS, "tool_choice": choice,
                "max_tokens": 200, "logprobs": True}
        ours, theirs = pairs[name]
        served = _served(ours, body, answer)
        assert served == _served(theirs, body, answer), name
        message = served[1]["message"]
        assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}, name
        assert (message.get("reasoning_content") == "Thinking it over.") is (name == "qwen3-style"), name
        assert served[2][0] == answer and len(served[2][1]) > len(answer.encode()) // 4, name  # bytes tokens


def test_llguidances_view_lives_as_long_as_its_tokenizer(embedded_model_dir):
    """Built once per tokenizer and kept while it lives: a model the router
    unloads takes its llguidance tokenizer (tens of MiB) with it."""
    import gc

    from protos import grammar

    tokenizer = ModelTokenizer.load(str(embedded_model_dir))
    first = grammar.ll_tokenizer(tokenizer)
    assert grammar.ll_tokenizer(tokenizer) is first and grammar.ll_tokenizer(tokenizer, 49408) is not first
    before = len(grammar._BUILT)
    del tokenizer, first
    gc.collect()
    assert len(grammar._BUILT) == before - 1


def test_the_routers_schema_checks_keep_no_tokenizer_alive(embedded_model_dir):
    """A schema checked for a model's tokenizer is remembered for it alone,
    and forgotten with it: an unloaded model leaves nothing behind (each
    load-unload cycle kept ~60 MiB of tokenizers in the router before)."""
    import gc
    import weakref

    from router.api.structured import _check

    tokenizer = ModelTokenizer.load(str(embedded_model_dir))
    gone = weakref.ref(tokenizer)
    grammar = '%llguidance {}\nstart: "a" | "b"\n'
    assert _check(tokenizer, grammar) == _check(tokenizer, grammar)
    del tokenizer
    gc.collect()
    assert gone() is None
