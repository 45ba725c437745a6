"""What the tests of worker groups (tests/e2e/test_tensor_parallel.py,
test_group_hosts.py) share: float32 random models with the embedded model's
tokenizer, built once a session; prompts of different lengths asked at once;
greedy completions, whole or streamed; and what mlx-lm's own greedy
generation gives for the prompts in one process, computed once a folder."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

# Different lengths, asked at once: prefill chunks and a decode batch whose
# rows join and end at different steps, all replayed by the follower.
PROMPTS = ["Tell me a story about a cat.", "What is two plus two?",
           "Write a poem about the sea, the wind and the lighthouse keeper who watched them.", "List colors."]
MAX_TOKENS = [24, 9, 17, 30]

_models: dict = {}
_one_process: dict = {}


def random_model(tmp_path_factory, like: str, tokenizer_dir) -> Path:
    """The session's float32 random `like` (seed 3, the embedded model's
    tokenizer), written on first use: both group test modules serve tiny-qwen3."""
    from benchmarks.random_models.text import write_random_model

    key = (like, str(tmp_path_factory.getbasetemp()))
    if key not in _models:
        folder = tmp_path_factory.mktemp("group-models") / like
        write_random_model(like, folder, dtype="float32", seed=3, tokenizer_dir=tokenizer_dir)
        _models[key] = folder
    return _models[key]


def ask(srv, prompt: str, max_tokens: int, timeout: float = 60) -> tuple[str, int]:
    r = httpx.post(srv.base_url + "/v1/completions", timeout=timeout,
                   json={"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def ask_all_at_once(srv) -> list:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda pm: ask(srv, *pm), zip(PROMPTS, MAX_TOKENS)))


def stream(srv, prompt: str, max_tokens: int, timeout: float = 90):
    """A greedy completion's text pieces as the client gets them (iterator)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text = json.loads(line[6:])["choices"][0]["text"]
                if text:
                    yield text


def one_process(folder) -> list:
    """What mlx-lm's own greedy generation gives for each prompt on the whole
    model, in this process (a one-process Tandem server gives the same:
    tests/e2e/test_e2e_pipeline.py). Computed once a folder a session."""
    folder = str(folder)
    if folder not in _one_process:
        from mlx_lm.generate import stream_generate

        from workers.models.loading import load_model

        model, tokenizer = load_model(folder)
        out = []
        for prompt, n in zip(PROMPTS, MAX_TOKENS):
            tokens = [r.token for r in stream_generate(model, tokenizer, prompt=tokenizer.encode(prompt), max_tokens=n)]
            out.append((tokenizer.decode(tokens), len(tokens)))
        _one_process[folder] = out
    return list(_one_process[folder])
