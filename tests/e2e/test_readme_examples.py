"""The README's examples, run as written against `tandem serve` on the embedded
model (its address changed to the test server's): each one ends by itself or
at the model's default length, so none can run for minutes, and each prints
an answer. The first thing a new user runs is checked here."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.server import module_server

README = Path(__file__).resolve().parents[2] / "README.md"
ADDRESS = "127.0.0.1:8000"
EMBEDDED_MAX_TOKENS = 256  # workers/models/store.py EMBEDDED_SAMPLING


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in `language` that talk to the server."""
    found = re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)
    return [b for b in found if ADDRESS in b]


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return module_server(request, tmp_path_factory)  # the README's `tandem serve`: no flags


def test_the_readme_has_the_three_examples():
    assert len(blocks("sh")) == 1 and len(blocks("python")) == 2
    assert "make serve" in README.read_text() and "make test" in README.read_text()


def test_the_curl_example_answers(server):
    command = blocks("sh")[0].replace(ADDRESS, server.base_url.removeprefix("http://"))
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    choice = answer["choices"][0]
    assert choice["message"]["content"].strip()
    assert choice["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] <= EMBEDDED_MAX_TOKENS  # the model's default, not 4,096


@pytest.mark.parametrize("which", ["openai", "anthropic"])
def test_the_python_examples_answer(server, which):
    code = next(b for b in blocks("python") if f"import {which}" in b or f"from {which}" in b)
    printed = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(ADDRESS, server.base_url.removeprefix("http://")), f"README ({which})", "exec"),
             scope)
    assert printed.getvalue().strip()
    if which == "anthropic":
        assert scope["reply"].stop_reason in ("end_turn", "max_tokens")
        assert scope["reply"].usage.output_tokens <= EMBEDDED_MAX_TOKENS


def test_the_models_defaults_are_shown(server):
    import httpx

    card = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]
    assert card["generation_defaults"] == {"temperature": 0.2, "top_p": 0.9, "max_tokens": EMBEDDED_MAX_TOKENS}
