"""The router's tests share one small real tokenizer per module (tests/support/fake_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fake_engine import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(Path(tmp_path_factory.mktemp("tokenizer")))
