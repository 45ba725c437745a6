"""`tandem generate` on the embedded model, its errors, and the BLAS re-exec."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from deploy import blas, generate_cmd
from workers.models.loading import load_model
from workers.models.store import embedded_gguf, resolve_model

REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    path = tmp_path_factory.getbasetemp() / "tandem-cache"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(path))
    return path


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate_cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


def greedy(model, tokenizer, prompt, max_tokens=32):
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0)))
    return [r.token for r in out], "".join(r.text for r in out)


def test_embedded_model_answers_and_matches_mlx_lm():
    """Tandem's CPU path (the GGUF's Q4_1/Q8_0 weights expanded to float32)
    must give the same greedy tokens as plain `mlx_lm.load` of the converted
    folder, which keeps them quantized and runs in float16. The two compute
    with different precision, so token identity is not guaranteed for every
    prompt; for this one they agree token for token, up to the end token.
    An empty system message: the template's default one would double the
    prompt, and mlx-lm's quantized matmuls on the CPU cost ~0.1 s a token."""
    folder = resolve_model(None)
    model, tokenizer = load_model(folder)
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ours, text = greedy(model, tokenizer, prompt)
    assert "Paris" in text
    assert ours[-1] in tokenizer.eos_token_ids  # stopped on its own

    q_model, q_tokenizer = mlx_lm.load(str(folder))
    assert q_tokenizer.apply_chat_template(messages, add_generation_prompt=True) == prompt
    theirs, _ = greedy(q_model, q_tokenizer, prompt)
    assert ours == theirs


class Recorder(io.StringIO):
    """Counts writes, to see that the answer arrives in pieces."""

    writes = 0

    def write(self, s):
        self.writes += 1
        return super().write(s)


def test_run_streams_the_answer(monkeypatch):
    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert generate_cmd.run(args("--prompt", QUESTION, "--max-tokens", "24")) == 0
    assert "Paris" in out.getvalue() and out.getvalue().endswith("\n")
    assert out.writes > 3


def test_seeded_sampling_is_repeatable(capsys, tmp_path):
    """On a float32 random tiny llama with the embedded model's tokenizer (the
    answer's sense is not under test): its near-uniform next-token
    distribution makes two unseeded samples differ, so a seed that is not
    applied fails the test; the two seeds' answers differ too."""
    from benchmarks.random_models.text import write_random_model

    model = tmp_path / "tiny-llama"
    write_random_model("tiny-llama", model, dtype="float32", seed=3, tokenizer_dir=resolve_model(None))

    def sample(seed: str) -> str:
        a = args("--prompt", "Name a fruit.", "--model", str(model), "--max-tokens", "12", "--temperature", "1.0",
                 "--seed", seed)
        assert generate_cmd.run(a) == 0
        return capsys.readouterr().out

    first = sample("7")
    assert len(first.strip()) > 0
    assert sample("7") == first
    assert sample("8") != first


def test_missing_model_is_one_line_and_exit_2(capsys, tmp_path):
    assert generate_cmd.run(args("--prompt", "hi", "--model", str(tmp_path / "nope.gguf"))) == 2
    err = capsys.readouterr().err
    assert err == f"tandem: {tmp_path / 'nope.gguf'}: no such file or folder\n"


@pytest.mark.parametrize("kind", ["truncated", "uncached-repo"])
def test_command_line_error_has_no_traceback(tmp_path, kind):
    if kind == "truncated":
        model = tmp_path / "cut.gguf"
        model.write_bytes(embedded_gguf().read_bytes()[:5_000_000])
    else:
        model = "tandem-tests/surely-not-cached-model"
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.generate_cmd", "--prompt", "hi", "--model", str(model)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(model) in lines[0]
    assert ("truncated" if kind == "truncated" else "not in the local Hugging Face cache") in lines[0]


PRINT_ENV = "import os, sys; from deploy import blas; blas.reexec_with_openblas(); print(os.environ.get('LD_PRELOAD'), sys.argv[1:])"


@pytest.mark.skipif(blas.openblas_path() is None, reason="OpenBLAS is not installed")
@pytest.mark.parametrize("opt_out", [False, True])
def test_reexec_with_openblas(opt_out):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TANDEM_NO_OPENBLAS")}
    if opt_out:
        env["TANDEM_NO_OPENBLAS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", PRINT_ENV, "x", "--y"], env=env, cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    want = "None" if opt_out else blas.openblas_path()
    assert out == f"{want} ['x', '--y']\n"  # printed once: one re-exec, same arguments
