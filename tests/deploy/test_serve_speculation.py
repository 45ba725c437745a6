"""`tandem serve`'s speculative-decoding flags: a draft model is checked
against the target's tokenizer before anything starts, and flags that could
not take effect are refused, never ignored."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import pytest

from environment.model_folder import ModelError, vocabulary_mismatch
from deploy.serve_cmd import add_arguments, draft_model_dir
from environment.settings import Settings


def _args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(flags))


def _renumbered(src, dst):
    """A copy of the model folder's tokenizer with two tokens' ids swapped."""
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, dst / name)
    data = json.loads((dst / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


def test_the_same_tokenizer_drafts(embedded_model_dir):
    assert vocabulary_mismatch(embedded_model_dir, embedded_model_dir) is None
    args = _args("--draft-model", str(embedded_model_dir))
    assert draft_model_dir(args, embedded_model_dir) == str(embedded_model_dir)


def test_another_numbering_is_refused_with_the_tokens_named(embedded_model_dir, tmp_path):
    other = _renumbered(embedded_model_dir, tmp_path / "other")
    why = vocabulary_mismatch(embedded_model_dir, other)
    assert why and "2 of the target's" in why and "'hello'" in why
    with pytest.raises(ModelError, match="must share the target's tokenizer"):
        draft_model_dir(_args("--draft-model", str(other)), embedded_model_dir)


def test_flags_that_cannot_take_effect_are_refused(embedded_model_dir):
    with pytest.raises(ModelError, match="needs --draft-model"):
        draft_model_dir(_args("--speculative", "draft"), embedded_model_dir)
    with pytest.raises(ModelError, match="only with --speculative draft or auto"):
        draft_model_dir(_args("--speculative", "off", "--draft-model", str(embedded_model_dir)), embedded_model_dir)
    assert draft_model_dir(_args(), embedded_model_dir) is None


def test_the_method_each_setting_gives():
    assert Settings().spec_method() == "prompt-lookup"
    assert Settings(draft_model_dir="/m").spec_method() == "draft"
    assert Settings(speculative="off", draft_model_dir="/m").spec_method() is None
    assert Settings(speculative="prompt-lookup", draft_model_dir="/m").spec_method() == "prompt-lookup"


def test_serve_exits_2_with_the_reason():
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--speculative", "draft"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--speculative draft needs --draft-model" in done.stderr
