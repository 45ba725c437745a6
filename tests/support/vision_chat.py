"""Chats about pictures with a served tiny VLM through the `openai` client,
and mlx-vlm's answer to compare with (`reference`)."""

from __future__ import annotations

import base64
import io

import openai
import pytest

from tests.support.server import metric

MAX_TOKENS = 12


def client_for(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def ask(client, messages, max_tokens=MAX_TOKENS):
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def refused(client, content, where: str, words: str):
    """The server answers a user message of `content` with a 400 naming `where` and saying `words`."""
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, [{"role": "user", "content": content}])
    message = err.value.body["message"] if isinstance(err.value.body, dict) else str(err.value)
    assert where in message and words in message, message


def counters(srv):
    """(embedding lookups, embedding hits) of the server's vision cache."""
    return (metric(srv, "tandem_vision_cache_queries_total"), metric(srv, "tandem_vision_cache_hits_total"))


_refs: dict = {}


def reference(folder, messages, images, n: int = MAX_TOKENS, **video) -> str:
    """mlx-vlm's greedy answer, as text. `messages` in the template's form
    ({"type": "image"} parts; {"type": "video"} with `video=[frames]` and
    `video_metadata`)."""
    from mlx_vlm import load as vlm_load
    from mlx_vlm.generate.dispatch import stream_generate

    if folder not in _refs:
        _refs[folder] = vlm_load(str(folder))
    model, processor = _refs[folder]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    last = None
    for last in stream_generate(model, processor, prompt, image=list(images), max_tokens=n, temperature=0.0, **video):
        pass
    ids = list(last.token_ids)
    assert len(ids) >= 8 and len(set(ids)) >= 2, f"degenerate reference {ids}"
    eos = getattr(processor.tokenizer, "eos_token_ids", None)
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    return processor.tokenizer.decode([t for t in ids if t not in eos])


def template_form(messages):
    """`messages` as the chat template takes them: each image_url part an {"type": "image"}."""
    out = []
    for m in messages:
        c = m["content"]
        if isinstance(c, list):
            c = [{"type": "image"} if p["type"] == "image_url" else p for p in c]
        out.append({"role": m["role"], "content": c})
    return out
