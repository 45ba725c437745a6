"""Fixtures for constrained decoding (workers/grammar.py): the embedded model's
tokenizer, a tiny random llama over the same vocabulary (its free output is
garbage, so only a mask can make it JSON), a worker's Grammars over both, and
a JSON schema with a nested object, an array and an enum."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.tiny_models import load_tiny_model, make_tiny_llama

# Strings and arrays are bounded so that a random model's output ends well
# within a test's max_tokens.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                 "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="session")
def smollm_tokenizer(embedded_model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(embedded_model_dir))


@pytest.fixture(scope="session")
def vocab_model(tmp_path_factory, smollm_tokenizer):
    """A tiny random llama whose logits cover the embedded tokenizer's vocabulary."""
    return load_tiny_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-49k"), vocab_size=49152))


@pytest.fixture(scope="session")
def grammars(smollm_tokenizer, vocab_model):
    from workers.grammar import Grammars, logits_width

    return Grammars(smollm_tokenizer, logits_width(vocab_model))


@pytest.fixture(scope="session")
def person_grammar():
    """(schema, grammar text): compact JSON (flexible whitespace lets a random
    model pad forever)."""
    import llguidance

    return PERSON_SCHEMA, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(PERSON_SCHEMA), defaults={"whitespace_flexible": False})


@pytest.fixture(scope="session")
def json_of(smollm_tokenizer):
    """tokens -> the JSON they spell (end-of-sequence ids dropped); raises
    ValueError when they are not JSON."""

    def parse(tokens):
        eos = set(smollm_tokenizer.eos_token_ids)
        return json.loads(smollm_tokenizer.decode([t for t in tokens if t not in eos]))

    return parse
