"""Chats with a served embedded model, and mlx-lm's answer to compare with."""

from __future__ import annotations

import json

from mlx_lm.generate import stream_generate

# Longer than several prefill chunks of 32 tokens and several cache blocks.
LONG_SYSTEM = (
    "You are a meticulous travel assistant. You answer in short sentences, you never invent facts, "
    "and when you are unsure you say so. You know European capitals, rivers, mountains and the dates "
    "of major festivals. Always mention the country when you name a city. Prefer metric units. "
    "If the user asks for a list, give at most three items. Keep a friendly, calm tone throughout."
)


_REFERENCES: dict = {}  # greedy output is a function of its inputs: each computed once per session


def reference(embedded_model, messages, max_tokens):
    """Greedy tokens from mlx_lm itself on the same weights (the end-of-sequence
    token included, as usage counts it), and their text. Remembered for the
    session: tests of both layouts, and their variants, ask for the same ones."""
    model, tokenizer = embedded_model
    key = (id(model), json.dumps(messages, sort_keys=True), max_tokens)
    if key not in _REFERENCES:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        tokens = [r.token for r in stream_generate(model, tokenizer, prompt=prompt, max_tokens=max_tokens)]
        text = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])
        _REFERENCES[key] = (tokens, text, len(prompt))
    tokens, text, n = _REFERENCES[key]
    return list(tokens), text, n
