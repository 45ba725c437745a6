"""One request's bad sampling fails that request alone, never the batch it
shares: a prefill pass over several prompts (workers/prefill/role.py, batch.py,
engine.py sample_firsts) and a decode batch (workers/decode/engine.py, role.py),
colocated roles over the tiny random llama with a recording outbox. The
others' tokens are those they get alone.

The poisons: sampling a worker cannot take (checked when the request starts,
workers/sampling.py check_sampling: the router refuses them first, a worker
checks again), and a sampler or logits processor that raises inside a decode
step (workers/sampling.py RowFaults)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from environment.settings import Settings
from protos.messages import (DecodeRequest, KVHandoff, PrefillDone, PrefillRequest, RequestFailed, SamplingParams,
                             TokenBatch)
from tests.support.tiny_models import VOCAB, prompt_of
from workers import sampling
from workers.decode.engine import DecodeEngine
from workers.decode.role import DecodeRole
from workers.loop_clock import LoopClock
from workers.prefill.batch import run_batch
from workers.prefill.engine import PrefillEngine
from workers.prefill.role import PrefillRole

TOKENS = 8
CLEAN = {"greedy": SamplingParams(max_tokens=TOKENS, temperature=0.0),
         "sampled": SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=7, presence_penalty=0.5)}
PROMPTS = {"greedy": prompt_of(9, 1), "sampled": prompt_of(13, 2), "poisoned": prompt_of(7, 3)}
# Sampling a worker cannot take: each fails its request where it starts.
BAD_SAMPLING = {
    "negative seed": dict(temperature=1.0, seed=-1),  # mx.random.key's TypeError, in the batch's sampling
    "superscript bias key": dict(logit_bias={"²": 5.0}),  # str.isdigit, then int()'s ValueError
    "bias past the vocabulary": dict(logit_bias={str(VOCAB + 10): 5.0}),  # an index out of the logits
}


class Outbox:
    def __init__(self):
        self.sent = []

    def send(self, msg, **kw):
        self.sent.append(msg)


def _roles(model):
    outbox, kv = Outbox(), {}
    hello = type("Hello", (), {"batched_prompts": 0})()
    prefill = PrefillRole(Settings(prefill_batch=4), PrefillEngine(model, 128), worker_id="w", prefix=None, cache=None,
                          arena_buf=None, outbox=outbox, clock=LoopClock("test"), hello=hello, local_kv=kv,
                          colocated=True)
    decode = DecodeRole(DecodeEngine(model, max_batch=8), worker_id="w", prefix=None, cache=None, arena_buf=None,
                        outbox=outbox, clock=LoopClock("test"), local_kv=kv)
    return outbox, prefill, decode


def serve(model, requests: dict, decode_sampling: dict | None = None) -> tuple[dict, set, int]:
    """Each request's tokens (rid -> [first, ...]), the ids that failed and
    the prompts prefilled in a shared pass: prefilled together, then decoded
    together, each with its own sampling (`decode_sampling`: another for
    decode, by id)."""
    outbox, prefill, decode = _roles(model)
    for rid, sp in requests.items():
        prefill.handle(PrefillRequest(rid, PROMPTS[rid], sp, decode_worker="w"))
    while prefill.has_work():
        prefill.step()
    tokens = {m.request_id: [m.first_token] for m in outbox.sent if isinstance(m, PrefillDone)}
    for rid, first in tokens.items():
        n = len(PROMPTS[rid])
        sp = (decode_sampling or {}).get(rid, requests[rid])
        decode.handle(DecodeRequest(rid, PROMPTS[rid], first[0], KVHandoff(rid, n, n, local=True), sp))
    while decode.has_work():
        decode.step()
    for m in outbox.sent:
        if isinstance(m, TokenBatch):
            for u in m.updates:
                tokens[u.request_id].append(u.token)
    failed = {m.request_id for m in outbox.sent if isinstance(m, RequestFailed)}
    return {rid: t for rid, t in tokens.items() if rid not in failed}, failed, prefill.hello.batched_prompts


@pytest.fixture(scope="module")
def alone(model):
    """Each clean request's tokens served alone."""
    return {rid: serve(model, {rid: sp})[0][rid] for rid, sp in CLEAN.items()}


@pytest.mark.parametrize("poison", BAD_SAMPLING)
def test_bad_sampling_in_a_batched_prefill_fails_that_request_alone(model, alone, poison):
    requests = {"greedy": CLEAN["greedy"], "poisoned": SamplingParams(max_tokens=TOKENS, **BAD_SAMPLING[poison]),
                "sampled": CLEAN["sampled"]}
    tokens, failed, batched = serve(model, requests)
    assert failed == {"poisoned"} and batched == 2  # the other two in one pass
    assert tokens == alone and all(len(t) == TOKENS for t in tokens.values())


@pytest.mark.parametrize("poison", BAD_SAMPLING)
def test_bad_sampling_joining_a_decode_batch_fails_that_request_alone(model, alone, poison):
    requests = {"greedy": CLEAN["greedy"], "poisoned": CLEAN["greedy"], "sampled": CLEAN["sampled"]}
    bad = {"poisoned": SamplingParams(max_tokens=TOKENS, **BAD_SAMPLING[poison])}
    tokens, failed, _ = serve(model, requests, decode_sampling=bad)
    assert failed == {"poisoned"}
    assert tokens == alone


def test_a_row_whose_sampling_raises_in_the_batched_pass_fails_alone(model, alone):
    """Past the check at a job's start (its sampling swapped after): the
    batch's pass gives that row its exception and the others their tokens."""
    engine = PrefillEngine(model, 128)
    jobs = [engine.start(PROMPTS[rid], sp, owner=rid) for rid, sp in CLEAN.items()]
    poisoned = engine.start(PROMPTS["poisoned"], CLEAN["greedy"], owner="poisoned")
    poisoned.sampling = SamplingParams(max_tokens=TOKENS, **BAD_SAMPLING["negative seed"])
    jobs.insert(1, poisoned)
    for j in jobs:
        j.load()
    results = run_batch(jobs)
    assert isinstance(results[1], ValueError) and "seed" in str(results[1])
    assert [results[0].first_token, results[2].first_token] == [alone["greedy"][0], alone["sampled"][0]]


@pytest.fixture
def raising_in_decode(monkeypatch):
    """Makes the sampler (seed 13) or the logits processors (a frequency
    penalty of 0.25) of one request raise once it decodes."""
    state = {"decoding": False}
    distribution = sampling.SeededSampler.distribution

    def sampler_distribution(self, logprobs):
        if state["decoding"] and self.seed == 13:
            raise RuntimeError("a sampler broken mid-decode")
        return distribution(self, logprobs)

    make_processors = sampling.make_processors

    def processors(params):
        procs = make_processors(params)
        if params.frequency_penalty != 0.25:
            return procs

        def broken(tokens, logits):
            if state["decoding"]:
                raise RuntimeError("a processor broken mid-decode")
            return logits
        return procs + [broken]

    monkeypatch.setattr(sampling.SeededSampler, "distribution", sampler_distribution)
    monkeypatch.setattr(sampling, "make_processors", processors)
    return state


@pytest.mark.parametrize("poison", [dict(temperature=1.0, seed=13), dict(frequency_penalty=0.25)],
                         ids=["sampler", "processor"])
def test_a_row_whose_sampling_raises_in_a_decode_step_fails_alone(model, alone, raising_in_decode, poison):
    requests = {"greedy": CLEAN["greedy"], "poisoned": replace(CLEAN["greedy"], **poison),
                "sampled": CLEAN["sampled"]}
    outbox, prefill, decode = _roles(model)
    for rid, sp in requests.items():
        prefill.handle(PrefillRequest(rid, PROMPTS[rid], sp, decode_worker="w"))
    while prefill.has_work():
        prefill.step()
    raising_in_decode["decoding"] = True
    for m in outbox.sent:
        n = len(PROMPTS[m.request_id])
        decode.handle(DecodeRequest(m.request_id, PROMPTS[m.request_id], m.first_token,
                                    KVHandoff(m.request_id, n, n, local=True), requests[m.request_id]))
    while decode.has_work():
        decode.step()
    failed = [m for m in outbox.sent if isinstance(m, RequestFailed)]
    assert [m.request_id for m in failed] == ["poisoned"] and "broken mid-decode" in failed[0].message
    tokens = {rid: [m.first_token for m in outbox.sent if isinstance(m, PrefillDone) and m.request_id == rid]
              for rid in CLEAN}
    for m in outbox.sent:
        if isinstance(m, TokenBatch):
            assert all(u.request_id != "poisoned" for u in m.updates)
            for u in m.updates:
                tokens[u.request_id].append(u.token)
    assert tokens == alone
