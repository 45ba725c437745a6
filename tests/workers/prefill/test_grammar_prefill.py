"""The first token under a grammar (workers/prefill/engine.py sample_firsts,
workers/prefill/batch.py, workers/prefill/role.py) on a tiny random llama over
the embedded tokenizer's vocabulary: alone and in a batch of prompts, free
rows as without constrained ones, a refused token failing its row alone."""

from __future__ import annotations

import math

import pytest

from environment.settings import Settings
from protos.messages import PrefillDone, PrefillRequest, RequestFailed, SamplingParams
from tests.support.tiny_models import prompt_of
from workers.grammar import GrammarError
from workers.loop_clock import LoopClock
from workers.prefill.batch import batchable, run_batch
from workers.prefill.engine import PrefillEngine
from workers.prefill.role import PrefillRole


def _starts(smollm_tokenizer, token: int) -> str:
    return smollm_tokenizer.decode([token])


def test_the_first_token_follows_the_grammar(vocab_model, grammars, person_grammar, smollm_tokenizer):
    """Sampled at temperature 1 over several seeds: free first tokens are
    anything, constrained ones open the object."""
    _, grammar = person_grammar
    engine = PrefillEngine(vocab_model, 32, grammars=grammars)
    prompt = prompt_of(11, 4)
    free = [engine.run(prompt, SamplingParams(temperature=1.0, seed=s)).first_token for s in range(6)]
    constrained = [engine.run(prompt, SamplingParams(temperature=1.0, seed=s, grammar=grammar)).first_token
                   for s in range(6)]
    assert not all(_starts(smollm_tokenizer, t).startswith("{") for t in free)
    assert all(_starts(smollm_tokenizer, t).startswith("{") for t in constrained)


def test_the_first_tokens_logprobs_are_the_masked_distributions(vocab_model, grammars, person_grammar):
    _, grammar = person_grammar
    engine = PrefillEngine(vocab_model, 32, grammars=grammars)
    sp = SamplingParams(temperature=1.0, seed=1, grammar=grammar, logprobs=True, top_logprobs=5)
    res = engine.run(prompt_of(11, 4), sp)
    assert res.logprob.token == res.first_token
    assert 0 < len(res.logprob.top) < 5 and all(math.isfinite(v) for _, v in res.logprob.top)
    assert sum(math.exp(v) for _, v in res.logprob.top) == pytest.approx(1.0, abs=1e-4)


def _jobs(engine, grammar):
    specs = [("f0", prompt_of(9, 1), SamplingParams(temperature=0.0)),
             ("c0", prompt_of(13, 2), SamplingParams(temperature=0.0, grammar=grammar)),
             ("f1", prompt_of(5, 3), SamplingParams(temperature=0.0)),
             ("c1", prompt_of(7, 4), SamplingParams(temperature=1.0, seed=2, grammar=grammar))]
    jobs = [engine.start(p, sp, owner=rid) for rid, p, sp in specs]
    for j in jobs:
        j.load()
        assert batchable(j)
    return specs, jobs


def test_a_batch_of_prompts_samples_each_under_its_own_grammar(vocab_model, grammars, person_grammar,
                                                               smollm_tokenizer):
    _, grammar = person_grammar
    engine = PrefillEngine(vocab_model, 128, grammars=grammars)
    specs, jobs = _jobs(engine, grammar)
    results = run_batch(jobs)
    for (rid, prompt, sp), res in zip(specs, results):
        assert res.first_token == engine.run(prompt, sp).first_token, rid  # as alone
        assert _starts(smollm_tokenizer, res.first_token).startswith("{") == rid.startswith("c")


def test_a_refused_first_token_fails_its_row_alone(vocab_model, grammars, person_grammar, smollm_tokenizer):
    """A matcher already in error (it refuses whatever comes) stands for a
    refused first token: that row's result is its GrammarError, the others
    are as alone; the role fails that request and finishes the others."""
    _, grammar = person_grammar
    engine = PrefillEngine(vocab_model, 128, grammars=grammars)
    specs, jobs = _jobs(engine, grammar)
    word = smollm_tokenizer.encode("hello", add_special_tokens=False)[0]
    assert not jobs[1].matcher.consume_token(word)
    results = run_batch(jobs)
    assert isinstance(results[1], GrammarError) and "first token" in str(results[1])
    assert [r.first_token for i, r in enumerate(results) if i != 1] == [
        engine.run(p, sp).first_token for i, (_, p, sp) in enumerate(specs) if i != 1]

    _, jobs = _jobs(engine, grammar)
    assert not jobs[1].matcher.consume_token(word)
    sent = []
    outbox = type("Outbox", (), {"send": lambda self, msg, **kw: sent.append(msg)})()
    hello = type("Hello", (), {"batched_prompts": 0})()
    role = PrefillRole(Settings(), engine, worker_id="w", prefix=None, cache=None, arena_buf=None, outbox=outbox,
                       clock=LoopClock("test"), hello=hello, local_kv={}, colocated=True)
    role.run_rows([(PrefillRequest(rid, p, sp, decode_worker="w"), j) for (rid, p, sp), j in zip(specs, jobs)])
    assert [(m.request_id, m.status) for m in sent if isinstance(m, RequestFailed)] == [("c0", 500)]
    assert sorted(m.request_id for m in sent if isinstance(m, PrefillDone)) == ["c1", "f0", "f1"]


def test_a_grammar_that_does_not_compile_fails_when_its_prompt_starts(vocab_model, grammars):
    import llguidance

    bad = SamplingParams(grammar=llguidance.LLMatcher.grammar_from_lark("start: (("))
    with pytest.raises(GrammarError, match="invalid grammar"):
        PrefillEngine(vocab_model, 32, grammars=grammars).start([1, 2, 3], bad)
    with pytest.raises(GrammarError, match="no tokenizer"):
        PrefillEngine(vocab_model, 32).start([1, 2, 3], bad)
