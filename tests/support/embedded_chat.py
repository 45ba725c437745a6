"""Chats with a served embedded model, and mlx-lm's answer to compare with."""

from __future__ import annotations

import json

from mlx_lm.generate import batch_generate, stream_generate

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


def references(embedded_model, conversations, max_tokens) -> list[str]:
    """`reference`'s texts for many conversations, from one mlx-lm batch
    (batch_generate: a batched prefill, then batched steps): 12 CPU-s for
    sixteen short chats against 30 one by one, and the same tokens for each
    (checked for the pipeline module's sixteen when written). Remembered as
    `reference`'s are, so a later `reference` call finds them."""
    model, tokenizer = embedded_model
    keys = [(id(model), json.dumps(m, sort_keys=True), max_tokens) for m in conversations]
    todo = [i for i, key in enumerate(keys) if key not in _REFERENCES]
    if todo:
        prompts = [tokenizer.apply_chat_template(conversations[i], add_generation_prompt=True) for i in todo]
        out = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True)
        for i, prompt, tokens in zip(todo, prompts, out.token_ids):
            tokens = [int(t) for t in tokens]
            text = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])
            _REFERENCES[keys[i]] = (tokens, text, len(prompt))
    return [_REFERENCES[key][1] for key in keys]
