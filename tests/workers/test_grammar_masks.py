"""workers/grammar.py: the compile cache, masks applied to MLX logits (any
backend) as llguidance's own numpy reference applies them, and a decode
batch's constrained rows (a refused token fails that row alone)."""

from __future__ import annotations

import llguidance
import mlx.core as mx
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from protos.messages import SamplingParams
from workers.grammar import ConstrainedRows, Grammars, GrammarError, apply_masks, fill_masks, matcher_for


def _random_bitmask(rows: int, words: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-2**31, 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("width,words", [(49152, 1536), (100, 4), (130, 4), (64, 3)])
def test_masks_match_llguidance_reference(width, words):
    """Same -inf positions as llguidance.numpy's apply: a vocabulary wider
    than the mask's words disallows the rest; narrower, the mask is cut."""
    rng = np.random.default_rng(width)
    logits = rng.standard_normal((3, width)).astype(np.float32)
    bitmask = _random_bitmask(3, words, width)
    want = logits.copy()
    apply_token_bitmask_inplace(want, bitmask)
    got = np.array(apply_masks(mx.array(logits), bitmask))
    np.testing.assert_array_equal(got, want)
    # [batch, 1, vocab], as the model returns a decode step's logits
    got3 = np.array(apply_masks(mx.array(logits)[:, None, :], bitmask))
    np.testing.assert_array_equal(got3[:, 0], want)


def test_masks_unpack_alike_on_the_host_and_on_the_device():
    """The CPU backend unpacks with numpy, a GPU with MLX: same bits."""
    from workers.grammar import _unpack_on_device, _unpack_on_host

    bitmask = _random_bitmask(4, 7, 1)
    assert mx.array_equal(_unpack_on_host(bitmask), _unpack_on_device(bitmask)).item()


def test_free_rows_are_left_bit_for_bit_and_dtype_kept():
    logits = mx.random.normal((2, 300), key=mx.random.key(0)).astype(mx.bfloat16)
    bitmask = fill_masks([], 2, 300)  # no constrained row: all ones
    out = apply_masks(logits, bitmask)
    assert out.dtype == mx.bfloat16
    assert mx.array_equal(out, logits).item()


def test_a_grammar_compiles_once_and_each_request_gets_its_own_matcher(grammars, person_grammar):
    _, grammar = person_grammar
    a = grammars.matcher(grammar)
    compiled = grammars._compiled[grammar]
    b = grammars.matcher(grammar)
    assert grammars._compiled[grammar] is compiled and a is not b and a is not compiled
    assert a.consume_token(grammars.tokenizer.encode("{", add_special_tokens=False)[0])
    # b (and the compiled one) did not move: "{" is still what they must start with
    assert b.consume_token(grammars.tokenizer.encode("{", add_special_tokens=False)[0])


def test_the_compile_cache_is_bounded(smollm_tokenizer, grammars):
    small = Grammars(smollm_tokenizer, grammars.n_vocab, capacity=2)
    texts = [llguidance.LLMatcher.grammar_from_regex(r) for r in ("a+", "b+", "c+")]
    for t in texts:
        small.matcher(t)
    small.matcher(texts[1])  # used last: kept
    small.matcher(texts[0])  # compiled again, evicting texts[2]
    assert list(small._compiled) == [texts[1], texts[0]]


def test_bad_grammars_and_workers_without_a_tokenizer_are_grammar_errors(grammars):
    with pytest.raises(GrammarError, match="invalid grammar") as err:
        grammars.matcher(llguidance.LLMatcher.grammar_from_lark("start: (("))
    assert "\n" not in str(err.value)
    assert matcher_for(None, SamplingParams()) is None  # free output needs none
    with pytest.raises(GrammarError, match="no tokenizer"):
        matcher_for(None, SamplingParams(grammar=llguidance.LLMatcher.grammar_from_regex("a+")))


def test_constrained_rows_fail_a_refused_token_alone(grammars, smollm_tokenizer, person_grammar):
    _, grammar = person_grammar
    brace = smollm_tokenizer.encode("{", add_special_tokens=False)[0]
    word = smollm_tokenizer.encode("hello", add_special_tokens=False)[0]
    rows = ConstrainedRows()
    rows.add(10, grammars.matcher(grammar))
    rows.add(12, grammars.matcher(grammar))
    width = grammars.n_vocab
    # uid 11 is free; 12 is fed a token its grammar refuses
    bitmask = rows.masks([10, 11, 12], [brace, word, word], width)
    assert set(rows.failed) == {12} and f"token {word} does not follow the grammar" in rows.failed[12]
    assert (bitmask[1] == -1).all() and (bitmask[2] == -1).all()  # free, and failed: unconstrained
    allowed = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little").nonzero()[0]
    assert 0 < len(allowed) < width
    assert all(smollm_tokenizer.decode([int(t)]).startswith('"') for t in allowed)  # a key comes next
    assert set(rows.take_failed()) == {12} and not rows.failed
    assert rows.rows([10, 11, 12]) == [(0, 10, rows.matchers[10])]  # 12's matcher is gone
    rows.keep([11])
    assert not rows
