"""What the tests of worker groups (tests/e2e/test_tensor_parallel.py,
test_group_hosts.py) share: float32 random models with the embedded model's
tokenizer, built once a session; prompts of different lengths asked at once;
sixteen short streams at once (a load); greedy completions, whole or
streamed; what mlx-lm's own greedy generation gives for the prompts in one
process, computed once a folder; a group's rank 0 made slow (the test fault
of Settings.slow_step_dir)."""

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
# Sixteen short streams of different lengths at once: a load on a group, cheap on a tiny model.
LOAD_PROMPTS = [f"{p} Number {i}." for i in range(4) for p in PROMPTS]
LOAD_TOKENS = [3 + i % 4 for i in range(16)]

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


def stream_all_at_once(srv, prompts: list, max_tokens: list, timeout: float = 120) -> list:
    """Each prompt's greedy completion streamed, all at once: the texts, in order."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda pm: "".join(stream(srv, *pm, timeout=timeout)), zip(prompts, max_tokens)))


def slow_rank0_step(folder, group: str, seconds: float) -> None:
    """Make `group`'s rank 0 sleep `seconds` at the end of its next unit, once
    (a server started with TANDEM_TEST_SLOW_STEP_DIR=folder)."""
    (Path(folder) / group).write_text(str(seconds))


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


def one_process(folder, prompts: list = PROMPTS, max_tokens: list = MAX_TOKENS) -> list:
    """What mlx-lm's own greedy generation gives for each prompt on the whole
    model, in this process (a one-process Tandem server gives the same:
    tests/e2e/test_e2e_pipeline.py), as (text, tokens). Computed once a
    folder and prompts a session."""
    key = (str(folder), tuple(prompts), tuple(max_tokens))
    if key not in _one_process:
        from mlx_lm.generate import stream_generate

        from workers.models.loading import load_model

        model, tokenizer = load_model(str(folder))
        out = []
        for prompt, n in zip(prompts, max_tokens):
            tokens = [r.token for r in stream_generate(model, tokenizer, prompt=tokenizer.encode(prompt), max_tokens=n)]
            out.append((tokenizer.decode(tokens), len(tokens)))
        _one_process[key] = out
    return list(_one_process[key])
