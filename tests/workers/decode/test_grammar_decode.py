"""Constrained decoding in the decode batch (workers/decode/engine.py,
workers/kernels/generation_batch.py, workers/grammar.py) on a tiny random llama
over the embedded tokenizer's vocabulary: its free output is no JSON, its
constrained output (sampled at temperature 1) parses and validates; free
rows beside constrained ones decode exactly as without them; a token its
grammar refuses fails that request alone."""

from __future__ import annotations

import math

import jsonschema
import pytest

from protos.messages import DecodeRequest, KVHandoff, RequestFailed, SamplingParams, TokenBatch
from tests.support.tiny_models import prompt_of
from workers.decode.engine import DecodeEngine
from workers.decode.role import DecodeRole
from workers.grammar import GrammarError
from workers.kernels.generation_batch import DecodeBatch
from workers.loop_clock import LoopClock
from workers.prefill.engine import PrefillEngine, first_token_finishes


def _request(rid, prompt, first, sp, n=None):
    n = len(prompt) if n is None else n
    return DecodeRequest(rid, prompt, first, KVHandoff(rid, n, n), sp)


def run(model, grammars, jobs, max_batch=8, ragged=None, first=None):
    """jobs: [(rid, join step, prompt, SamplingParams)] -> (rid -> [tokens],
    rid -> finish reason, rid -> [TokenLogprob], [(rid, why) failed]).
    `first`: rid -> a first token to hand decode instead of prefill's."""
    prefill = PrefillEngine(model, 32, grammars=grammars)
    decode = DecodeEngine(model, max_batch, ragged=ragged, grammars=grammars)
    tokens, reasons, logprobs, failed = {}, {}, {}, []
    pending, step = sorted(jobs, key=lambda j: j[1]), 0
    while pending or decode.has_work:
        while pending and pending[0][1] <= step:
            rid, _, prompt, sp = pending.pop(0)
            res = prefill.run(prompt, sp)
            tok = (first or {}).get(rid, res.first_token)
            tokens[rid], logprobs[rid] = [tok], [res.logprob]
            reasons[rid] = first_token_finishes(tok, sp, grammars.eos_ids if sp.grammar else ())
            if reasons[rid] is None:
                decode.add(_request(rid, prompt, tok, sp), res.cache)
        for u in decode.step():
            assert reasons[u.request_id] is None, "token after finish"
            tokens[u.request_id].append(u.token)
            logprobs[u.request_id].append(u.logprob)
            reasons[u.request_id] = u.finish_reason
        failed += decode.take_failures()
        step += 1
        assert step < 400
    return tokens, reasons, logprobs, failed


def test_free_sampling_of_the_random_model_is_no_json(vocab_model, grammars, json_of):
    prompt = prompt_of(12, 1)
    jobs = [(f"s{seed}", 0, prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=seed)) for seed in range(3)]
    tokens, *_ = run(vocab_model, grammars, jobs)
    for rid in tokens:
        with pytest.raises(ValueError):
            json_of(tokens[rid])


@pytest.mark.parametrize("seed", range(4))
def test_constrained_sampling_gives_schema_valid_json(vocab_model, grammars, person_grammar, json_of, seed):
    schema, grammar = person_grammar
    sp = SamplingParams(max_tokens=150, temperature=1.0, seed=seed, grammar=grammar)
    tokens, reasons, _, _ = run(vocab_model, grammars, [("c", 0, prompt_of(12, 1), sp)])
    assert reasons["c"] == "stop" and tokens["c"][-1] in grammars.eos_ids  # the grammar's end ends it
    jsonschema.validate(json_of(tokens["c"]), schema)


@pytest.fixture(params=["auto", "forward first", "tokens first"])
def step_order(request, monkeypatch):
    """A constrained step's order (workers/kernels/generation_batch.py
    _MaskedForward), chosen from the last step's wait, or forced either way."""
    if request.param != "auto":
        forced = request.param == "tokens first"
        monkeypatch.setattr(DecodeBatch, "tokens_first", property(lambda self: forced, lambda self, value: None))
    return request.param


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
def test_free_rows_decode_as_without_constrained_rows_beside_them(vocab_model, grammars, person_grammar,
                                                                   json_of, ragged, step_order):
    """Constrained rows join a batch of free greedy rows (at the start and
    midway): the free rows' tokens are the same as the free rows' alone,
    and the constrained ones validate."""
    schema, grammar = person_grammar
    free = [(f"f{i}", 0, prompt_of(9 + 5 * i, 20 + i), SamplingParams(max_tokens=30, temperature=0.0))
            for i in range(3)]
    constrained = [
        ("c0", 0, prompt_of(14, 30), SamplingParams(max_tokens=150, temperature=0.0, grammar=grammar)),
        ("c1", 4, prompt_of(7, 31), SamplingParams(max_tokens=150, temperature=1.0, seed=5, grammar=grammar)),
    ]
    alone, *_ = run(vocab_model, grammars, free, ragged=ragged)
    mixed, reasons, _, _ = run(vocab_model, grammars, free + constrained, ragged=ragged)
    for rid, *_ in free:
        assert mixed[rid] == alone[rid], rid
    for rid, *_ in constrained:
        assert reasons[rid] == "stop"
        jsonschema.validate(json_of(mixed[rid]), schema)


def test_logprobs_of_constrained_rows_are_the_masked_distributions(vocab_model, grammars, person_grammar):
    """OpenAI reports logprobs after the constraints: the allowed tokens'
    probabilities sum to one, the others are no alternatives."""
    _, grammar = person_grammar
    sp = SamplingParams(max_tokens=150, temperature=1.0, seed=3, grammar=grammar, logprobs=True, top_logprobs=5)
    tokens, _, logprobs, _ = run(vocab_model, grammars, [("c", 0, prompt_of(12, 1), sp)])
    few = 0
    for tok, lp in zip(tokens["c"], logprobs["c"]):
        assert lp.token == tok and all(math.isfinite(v) for _, v in lp.top)
        if len(lp.top) < 5:  # every allowed token is listed: they sum to one
            few += 1
            assert sum(math.exp(v) for _, v in lp.top) == pytest.approx(1.0, abs=1e-4)
    assert few >= 3  # '{', the first key, the closing braces leave few choices


def test_a_token_the_grammar_refuses_fails_that_request_alone(vocab_model, grammars, person_grammar,
                                                              smollm_tokenizer):
    """A request handed a first token its grammar does not allow (a stand-in
    for any refused token) fails with a clear error, its token unreported,
    and the free row beside it decodes as alone."""
    _, grammar = person_grammar
    word = smollm_tokenizer.encode("hello", add_special_tokens=False)[0]
    free = ("f", 0, prompt_of(10, 2), SamplingParams(max_tokens=12, temperature=0.0))
    bad = ("bad", 0, prompt_of(8, 3), SamplingParams(max_tokens=12, temperature=0.0, grammar=grammar))
    alone, *_ = run(vocab_model, grammars, [free])
    tokens, reasons, _, failed = run(vocab_model, grammars, [free, bad], first={"bad": word})
    assert tokens["f"] == alone["f"]
    assert tokens["bad"] == [word] and reasons["bad"] is None  # nothing decoded for it
    assert [rid for rid, _ in failed] == ["bad"]  # once, from the step that dropped it
    assert isinstance(failed[0][1], GrammarError) and f"token {word} does not follow" in str(failed[0][1])


def test_the_decode_role_reports_a_refused_token_as_that_requests_failure(vocab_model, grammars, person_grammar,
                                                                          smollm_tokenizer):
    _, grammar = person_grammar
    word = smollm_tokenizer.encode("hello", add_special_tokens=False)[0]
    prefill = PrefillEngine(vocab_model, 32, grammars=grammars)
    engine = DecodeEngine(vocab_model, 4, grammars=grammars)
    sent, local_kv = [], {}
    outbox = type("Outbox", (), {"send": lambda self, msg, **kw: sent.append(msg)})()
    role = DecodeRole(engine, worker_id="w", prefix=None, cache=None, arena_buf=None, outbox=outbox,
                      clock=LoopClock("test"), local_kv=local_kv)
    for rid, sp, first in (("ok", SamplingParams(max_tokens=6, temperature=0.0), None),
                           ("bad", SamplingParams(max_tokens=6, temperature=0.0, grammar=grammar), word)):
        prompt = prompt_of(9, len(rid))
        res = prefill.run(prompt, sp)
        local_kv[rid] = res.cache
        req = _request(rid, prompt, first if first is not None else res.first_token, sp)
        req.handoff.local = True
        role.handle(req)
    while engine.has_work:
        role.step()
    failed = [m for m in sent if isinstance(m, RequestFailed)]
    assert [(m.request_id, m.status) for m in failed] == [("bad", 500)]
    assert "GrammarError" in failed[0].message and f"token {word}" in failed[0].message
    updates = [u for m in sent if isinstance(m, TokenBatch) for u in m.updates]
    assert {u.request_id for u in updates} == {"ok"} and updates[-1].finish_reason == "length"


def test_a_grammar_that_does_not_compile_fails_at_add(vocab_model, grammars):
    import llguidance

    bad = SamplingParams(grammar=llguidance.LLMatcher.grammar_from_lark("start: (("))
    with pytest.raises(GrammarError, match="invalid grammar"):
        DecodeEngine(vocab_model, 2, grammars=grammars).add(_request("x", [1, 2], 3, bad), [])
    with pytest.raises(GrammarError, match="no tokenizer"):
        DecodeEngine(vocab_model, 2).add(_request("x", [1, 2], 3, bad), [])
