"""Speculative decoding inside the decode batch (workers/decode/speculation.py,
workers/kernels/verify_step.py): greedy output token-identical to mlx-lm's
generate_step whatever the drafts, in the ragged (CPU) and padded (GPU)
batches; drafts that are counted as accepted really skip steps."""

from __future__ import annotations

import shutil

import pytest

from tests.support.pipeline import drive, reference
from tests.support.tiny_models import VOCAB, greedy, load_tiny_model, make_tiny_llama, prompt_of
from protos.messages import SamplingParams
from workers.decode.draft_model import DraftModel
from workers.decode.prompt_lookup import NgramIndex, PromptLookup
from workers.decode.speculation import Speculation as _Speculation
from workers.decode.speculation import StepCosts

LAYOUTS = [pytest.param(True, id="ragged"), pytest.param(False, id="padded")]


class FixedCosts(StepCosts):
    """Step costs that do not follow the clock: what a test drafts must not
    depend on how loaded the machine is."""

    def ordinary(self, rows, seconds):
        pass

    def speculative(self, rows, width, seconds):
        pass


def Speculation(drafter, **kw):  # noqa: N802 - the class, with fixed costs
    return _Speculation(drafter, costs=FixedCosts(), **kw)


class Oracle:
    """A drafter that knows each request's greedy answer and gets every
    `wrong_every`-th position wrong: long runs kept, then a rejection."""

    method = "oracle"

    def __init__(self, answers: list, wrong_every: int = 5):
        self.answers, self.wrong_every = answers, wrong_every
        self.asked = 0

    def propose(self, batch, asking, inputs):
        out = []
        for i, _, k in asking:
            tokens = batch.tokens[i]
            full = next(a for a in self.answers if a[: len(tokens)] == tokens)
            at = len(tokens) + 1
            out.append([(t + 1) % VOCAB if (at + j) % self.wrong_every == 3 else t
                        for j, t in enumerate(full[at : at + k])])
            self.asked += 1
        return out

    def leave(self, uid):
        pass


def answers_for(model, jobs) -> dict:
    return {rid: reference(model, prompt, sp.max_tokens) for rid, _, prompt, sp in jobs}


@pytest.mark.parametrize("ragged", LAYOUTS)
def test_drafts_right_and_wrong_give_mlx_lm_tokens(model, ragged):
    jobs = [(f"r{i}", i, prompt_of(40 + 7 * i, i), greedy(30)) for i in range(4)]
    refs = answers_for(model, jobs)
    spec = Speculation(Oracle([p + refs[r].tokens for r, _, p, _ in jobs]), max_tokens=6, max_rows=8)
    outs = drive(model, jobs, ragged=ragged, speculation=spec)
    for rid, *_ in jobs:
        assert outs[rid].tokens == refs[rid].tokens, rid
        assert outs[rid].reason == "length"
    # Most drafts were right, some wrong: both paths ran.
    assert 0 < spec.accepted < spec.proposed
    assert spec.accepted >= spec.proposed // 2


@pytest.mark.parametrize("ragged", LAYOUTS)
def test_a_stop_token_inside_the_kept_drafts_ends_the_answer_there(model, ragged):
    prompt = prompt_of(50, 7)
    full_answer = reference(model, prompt, 24).tokens
    stop = full_answer[9]  # the 10th token: inside a kept run of drafts
    sp = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop])
    want = reference(model, prompt, 24).tokens
    want = want[: want.index(stop) + 1]
    spec = Speculation(Oracle([prompt + full_answer], wrong_every=1000), max_tokens=8, max_rows=8)
    outs = drive(model, [("a", 0, prompt, sp)], ragged=ragged, speculation=spec)
    assert outs["a"].tokens == want
    assert outs["a"].reason == "stop"
    assert spec.accepted > 0


@pytest.mark.parametrize("ragged", LAYOUTS)
def test_logprobs_of_kept_drafts_are_the_models(model, ragged):
    prompt = prompt_of(30, 3)
    sp = greedy(16, logprobs=True, top_logprobs=2)
    plain = drive(model, [("a", 0, prompt, sp)], ragged=ragged)["a"]
    spec = Speculation(Oracle([prompt + plain.tokens], wrong_every=1000), max_tokens=8, max_rows=8)
    fast = drive(model, [("a", 0, prompt, sp)], ragged=ragged, speculation=spec)["a"]
    assert fast.tokens == plain.tokens and spec.accepted > 8
    for a, b in zip(fast.logprobs, plain.logprobs):
        assert a.token == b.token
        # A pass over several tokens rounds differently from one over one
        # (on CUDA, TF32 matmuls: ~1e-3); on the CPU they agree to ~1e-6.
        assert a.logprob == pytest.approx(b.logprob, abs=5e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 2


def test_rows_with_penalties_ride_along_undrafted(model):
    jobs = [("plain", 0, prompt_of(40, 1), greedy(20)),
            ("penalised", 0, prompt_of(44, 2), greedy(20, repetition_penalty=1.3))]
    plain_ref = reference(model, jobs[0][2], 20)
    oracle = Oracle([jobs[0][2] + plain_ref.tokens])
    spec = Speculation(oracle, max_tokens=6, max_rows=8)
    without = drive(model, jobs)
    outs = drive(model, jobs, speculation=spec)
    assert outs["plain"].tokens == plain_ref.tokens
    assert outs["penalised"].tokens == without["penalised"].tokens
    assert spec.accepted > 0


def test_prompt_lookup_drafts_repeated_text_exactly(model):
    # This prompt's greedy answer (the tiny random model's) repeats runs of
    # its own earlier text, which prompt lookup then drafts.
    prompt = prompt_of(54, 7)
    sp = greedy(40)
    spec = Speculation(PromptLookup(), max_tokens=8, max_rows=8)
    outs = drive(model, [("a", 0, prompt, sp)], speculation=spec)
    assert outs["a"].tokens == reference(model, prompt, 40).tokens
    assert spec.accepted >= 8


def test_no_speculation_above_max_rows(model):
    jobs = [(f"r{i}", 0, prompt_of(30, i), greedy(8)) for i in range(3)]
    refs = answers_for(model, jobs)
    oracle = Oracle([p + refs[r].tokens for r, _, p, _ in jobs])
    spec = Speculation(oracle, max_tokens=4, max_rows=2)
    drive(model, jobs, speculation=spec)
    assert oracle.asked == 0 and spec.proposed == 0


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return load_tiny_model(make_tiny_llama(tmp_path_factory.mktemp("draft") / "m", seed=5))


@pytest.mark.parametrize("ragged", LAYOUTS)
def test_the_target_as_its_own_draft_is_always_right(model, ragged):
    jobs = [(f"r{i}", i, prompt_of(60 + 5 * i, 10 + i), greedy(20)) for i in range(3)]
    spec = Speculation(DraftModel(model), max_tokens=4, max_rows=8)
    outs = drive(model, jobs, ragged=ragged, speculation=spec)
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens, rid
    assert spec.proposed > 20 and spec.accepted == spec.proposed


def test_a_random_draft_is_mostly_wrong_and_changes_nothing(model, random_draft):
    jobs = [(f"r{i}", i, prompt_of(60 + 5 * i, 20 + i), greedy(20)) for i in range(3)]
    spec = Speculation(DraftModel(random_draft), max_tokens=4, max_rows=8)
    outs = drive(model, jobs, speculation=spec)
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens, rid
    assert spec.proposed > 0 and spec.accepted < spec.proposed / 2


def test_a_wrong_row_rests():
    from workers.kernels.verify_step import Verified

    spec = Speculation(PromptLookup(), max_tokens=8, max_rows=8)
    row = spec._row(1)
    for _ in range(2):
        spec.record([1], Verified([], [4], [0]))
    assert row.wait == 0
    spec.record([1], Verified([], [4], [0]))
    assert row.wait > 0  # rests after three rejections from a neutral start
    assert spec.proposed == 12 and spec.accepted == 0


def test_k_is_what_pays_on_this_machine():
    """The drafts a row gets follow its acceptance and the measured cost of
    a position: many where a position is cheap (a GPU bound by the host),
    few where it costs much of a step (a CPU), none where no draft pays."""
    spec = _Speculation(PromptLookup(), max_tokens=8, max_rows=8)
    costs = spec.costs
    costs.ordinary(1, 0.010)
    for width, seconds in ((9, 0.0142), (3, 0.0138), (9, 0.0142), (5, 0.0140)):  # a GPU bound by the host:
        costs.speculative(1, width, seconds)  # waiting costs 37%, a draft 0.5%
    fixed, per_draft = costs.model(1)
    assert fixed == pytest.approx(1.37, abs=0.02) and per_draft == pytest.approx(0.005, abs=0.002)
    costs.ordinary(4, 0.100)
    costs.speculative(4, 5, 0.300)  # a CPU: 4 more positions, x3
    assert spec.best_k(0.9, 1) == 8
    assert spec.best_k(0.2, 1) == 0  # 1.2 tokens for 1.37 steps' time: no
    assert 2 <= spec.best_k(0.6, 1) <= 8
    assert spec.best_k(0.9, 4) <= 2 and spec.best_k(0.5, 4) == 0
    assert spec.best_k(0.9, 2) > spec.best_k(0.9, 4)  # unmeasured: the default cost
    for _ in range(300):  # a dear step fades back toward the default: tried again
        costs.ordinary(4, 0.100)
    assert spec.best_k(0.9, 4) >= 3


def test_ngram_index_finds_the_longest_latest_match():
    index = NgramIndex([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2], n_min=2, n_max=3)
    assert index.propose(3, tail=[3]) == [4, 5, 1]  # "1 2 3": its latest earlier occurrence
    assert index.propose(2) == [3, 4]  # "1 2" -> "3 4"
    assert index.propose(4, tail=[7]) == []  # "2 7" never occurred
    index.extend([3])
    assert index.propose(2, tail=[4]) == [5, 1]
    loop = NgramIndex([6, 6, 6], n_min=2, n_max=4)
    assert loop.propose(5, tail=[6]) == [6, 6]  # runs into the tail, never past the text
    with pytest.raises(ValueError):
        NgramIndex([], n_min=0)


def _rank_chi2(observed: list, dists: list) -> float:
    """Pearson's chi-square of where each sample's token ranks in the
    distribution it was drawn from (dists[i]: probabilities by token; rank
    0 the likeliest): expected count of rank r = sum of the r-th largest
    probabilities."""
    ranked = [sorted(d, key=d.get, reverse=True) for d in dists]
    width = max(len(r) for r in ranked)
    expected = [sum(d[r[j]] for d, r in zip(dists, ranked) if j < len(r)) for j in range(width)]
    seen = [0] * width
    for token, r in zip(observed, ranked):
        # A token outside the recomputed top k (a near tie at the k-th place
        # that rounds the other way in this pass, on a GPU) counts as the last.
        seen[r.index(token) if token in r else width - 1] += 1
    return sum((o - e) ** 2 / e for o, e in zip(seen, expected) if e > 0)


def test_sampled_rows_keep_the_models_distribution(model):
    """Speculative sampling's rejection rule (workers/decode/spec_verify.py):
    the fourth token of 300 seeded answers (the first a speculative step
    drafts: the two steps after joining are ordinary), drafted by the model
    itself (so drafts are often, not always, kept), follows the model's own
    top-k distribution given each answer's first three tokens."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_k

    prompt = prompt_of(24, 4)
    n = 300
    # Three waves of 100 rows (a batch of 300 is more than a GPU run of this test takes).
    jobs = [(f"s{i}", (i // 100) * 8, prompt, SamplingParams(max_tokens=4, temperature=1.0, top_k=4, seed=i))
            for i in range(n)]
    spec = Speculation(DraftModel(model), max_tokens=1, max_rows=100)
    outs = drive(model, jobs, max_batch=100, speculation=spec)
    answers = [outs[f"s{i}"].tokens for i in range(n)]
    assert all(len(a) == 4 for a in answers)
    assert 0.2 * n < spec.accepted < spec.proposed == n  # kept and rejected both happened
    contexts = mx.array([prompt + a[:3] for a in answers])
    logits = model(contexts)[:, -1, :]
    probs = mx.softmax(apply_top_k(logits - mx.logsumexp(logits, axis=-1, keepdims=True), 4), axis=-1)
    dists = [{t: p for t, p in enumerate(row) if p > 0} for row in probs.tolist()]
    # Ranks 0-3 of top-k 4: 3 degrees of freedom; 16.27 is chi-square's 0.1% tail.
    assert _rank_chi2([a[3] for a in answers], dists) < 16.27
    # The check has power: always keeping the draft (the argmax), or drawing
    # a rejected row's token from p with the draft left in, fails it.
    assert _rank_chi2([max(d, key=d.get) for d in dists], dists) > 100


def test_a_grammar_row_rides_along_a_speculative_step(vocab_model, grammars, person_grammar, json_of):
    """A constrained row never drafts; in a speculative step its mask is
    built from the step's input and it samples from the first position: its
    JSON is what it is without speculation, beside a row whose drafts are kept."""
    import jsonschema

    from protos.messages import DecodeRequest, KVHandoff
    from workers.decode.engine import DecodeEngine
    from workers.prefill.engine import PrefillEngine

    schema, grammar = person_grammar
    free_prompt, json_prompt = prompt_of(30, 8), prompt_of(12, 1)
    free_answer = reference(vocab_model, free_prompt, 40).tokens

    def run(speculation):
        prefill = PrefillEngine(vocab_model, 32, grammars=grammars)
        decode = DecodeEngine(vocab_model, 4, grammars=grammars, speculation=speculation)
        out = {}
        for rid, prompt, sp in (("json", json_prompt, SamplingParams(max_tokens=120, temperature=0.0, grammar=grammar)),
                                ("free", free_prompt, greedy(40))):
            res = prefill.run(prompt, sp)
            out[rid] = [res.first_token]
            decode.add(DecodeRequest(rid, prompt, res.first_token, KVHandoff(rid, len(prompt), len(prompt)), sp),
                       res.cache)
        for _ in range(200):
            if not decode.has_work:
                break
            for u in decode.step():
                out[u.request_id].append(u.token)
        assert not decode.take_failures()
        return out

    plain = run(None)
    spec = Speculation(Oracle([free_prompt + free_answer]), max_tokens=6, max_rows=8)
    fast = run(spec)
    assert fast == plain and fast["free"] == free_answer
    jsonschema.validate(json_of(fast["json"]), schema)
    assert spec.accepted > 10


def test_settings_choose_the_drafter(model, tmp_path, embedded_model_dir):
    """--speculative and --draft-model as a worker reads them; a draft whose
    KV cannot be cut back (sliding-window layers) is refused loudly and the
    worker drafts from the text instead of failing to start."""
    from environment.settings import Settings
    from tests.support.tiny_models import make_tiny_gemma3
    from workers.decode.speculation import speculation_for

    assert speculation_for(Settings(speculative="off"), model) is None
    lookup = speculation_for(Settings(spec_tokens=5, spec_max_batch=3), model)
    assert lookup.method == "prompt-lookup" and lookup.max_tokens == 5 and lookup.max_rows == 3
    llama = make_tiny_llama(tmp_path / "draft", seed=3)
    gemma = make_tiny_gemma3(tmp_path / "gemma")
    for folder in (llama, gemma):  # a worker loads a model with its tokenizer
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(embedded_model_dir / name, folder / name)
    assert speculation_for(Settings(draft_model_dir=str(llama)), model).method == "draft"
    assert speculation_for(Settings(draft_model_dir=str(gemma)), model).method == "prompt-lookup"


def test_a_poor_record_makes_new_rows_rest_first():
    """A drafter that is never right (a draft model of another family) costs
    a few steps in all, not a few steps a request."""
    from workers.decode.speculation import MIN_RATE, REST_STEPS
    from workers.kernels.verify_step import Verified

    spec = Speculation(PromptLookup(), max_tokens=8, max_rows=8)
    for uid in range(4):
        spec._row(uid)
        for _ in range(3):
            spec.record([uid], Verified([], [2], [0]))
    assert spec.recent_rate < MIN_RATE
    late = spec._row(99)
    assert late.wait == REST_STEPS and late.k == 1
    late.wait = 0
    spec.record([99], Verified([], [1], [0]))
    assert late.wait == REST_STEPS  # rests after one rejection
    for uid in range(100, 104):  # drafting pays again: new rows start at once
        spec._row(uid)
        for _ in range(6):
            spec.record([uid], Verified([], [4], [4]))
    assert spec.recent_rate > 0.5 and spec._row(200).wait == 0


def test_a_row_no_draft_pays_for_rests_then_tries_one(model):
    """A rate at which no draft pays is tested again after a rest (else it
    would never change): the row drafts one token then."""
    spec = Speculation(PromptLookup(), max_tokens=8, max_rows=8)
    spec.costs.default = (1.5, 0.2)  # a machine where drafting costs much
    assert spec.best_k(0.5, 1) == 0
    jobs = [("a", 0, prompt_of(54, 7), greedy(40))]
    outs = drive(model, jobs, speculation=spec)
    assert outs["a"].tokens == reference(model, prompt_of(54, 7), 40).tokens
    assert spec.proposed > 0  # tried, after its rests


def test_cpu_steps_keep_the_fast_logsumexp(model):
    """On the CPU a step computes its pass when its tokens are read (no
    compute-ahead), through mlx-lm's generate module with `async_eval`
    stubbed for the step; mlx_hooks' fast logsumexp there must survive it."""
    import sys

    from environment.backend import on_cpu
    from workers.kernels import cpu_math

    if not on_cpu():
        pytest.skip("the CPU's hooks: on a GPU mlx-lm's generate module is left as it is")
    drive(model, [("a", 0, prompt_of(20, 1), greedy(5))])
    assert sys.modules["mlx_lm.generate"].mx.logsumexp is cpu_math.logsumexp
