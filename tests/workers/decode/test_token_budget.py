"""Every part asks the request's token budget (protos/budget.py): prefill's
first token, decode's rows (mlx-lm's counters, workers/kernels/generation_batch.py)
and the speculative step end a request at exactly max_tokens, a resumed
request included, greedy tokens identical to one uninterrupted run."""

from __future__ import annotations

import pytest

from protos.budget import TokenBudget
from protos.messages import DecodeRequest, KVHandoff
from tests.support.tiny_models import greedy, prompt_of, reference
from workers.decode.engine import DecodeEngine
from workers.decode.speculation import Speculation, StepCosts
from workers.prefill.engine import PrefillEngine, first_token_finishes

LAYOUTS = [pytest.param(True, id="ragged"), pytest.param(False, id="padded")]


class FixedCosts(StepCosts):
    """Costs that do not follow the clock: a drafted position costs nothing,
    so a row drafts 4 tokens at the start's rate (Speculation.best_k)."""

    def __init__(self):
        super().__init__(fixed=1.0, per_draft=0.0)

    def ordinary(self, rows, seconds):
        pass

    def speculative(self, rows, width, seconds):
        pass


class Knowing:
    """A drafter that knows the answer and always drafts as much as asked;
    it records each row's budget and the k it was asked for."""

    method = "knowing"

    def __init__(self, answer: list):
        self.answer, self.asked = answer, []

    def propose(self, batch, asking, inputs):
        out = []
        for i, _, k in asking:
            self.asked.append((batch.budget(i), k))
            at = len(batch.tokens[i]) + 1  # after the step's input
            out.append(self.answer[at: at + k])
        return out

    def leave(self, uid):
        pass


def _decode_all(decode: DecodeEngine) -> tuple[list, str]:
    tokens, reason = [], None
    for _ in range(200):
        for u in decode.step():
            assert reason is None, "a token after the end"
            tokens.append(u.token)
            reason = u.finish_reason
        if not decode.has_work:
            return tokens, reason
    raise AssertionError("never ended")


def _resume(model, prompt, answer_so_far, max_tokens, ragged, speculation=None):
    """A request moved after `answer_so_far`: prefilled again over prompt +
    answer, then decoded. Returns (first token, decode tokens, reason)."""
    sp = greedy(max_tokens)
    context = prompt + answer_so_far
    job = PrefillEngine(model, 16).start(context, sp, budget=TokenBudget(max_tokens, len(answer_so_far)))
    while (res := job.step()) is None:
        pass
    finish = first_token_finishes(res.first_token, sp, budget=job.budget)
    if finish is not None:
        return res.first_token, [], finish
    decode = DecodeEngine(model, 4, ragged=ragged, speculation=speculation)
    decode.add(DecodeRequest("r~1", context, res.first_token, KVHandoff("r~1", res.num_tokens, res.rope_offset), sp,
                             generated=len(answer_so_far) + 1), res.cache)
    return (res.first_token, *_decode_all(decode))


@pytest.mark.parametrize("ragged", LAYOUTS)
@pytest.mark.parametrize("moved_after", [1, 5])
def test_a_resumed_request_produces_what_it_has_left(model, ragged, moved_after):
    prompt, n = prompt_of(20, 3), 9
    full = reference(model, prompt, n)
    first, rest, reason = _resume(model, prompt, full[:moved_after], n, ragged)
    assert [first] + rest == full[moved_after:] and reason == "length"


def test_a_budget_the_first_token_from_prefill_exhausts(model):
    prompt, n = prompt_of(20, 3), 6
    full = reference(model, prompt, n)
    first, rest, reason = _resume(model, prompt, full[:n - 1], n, ragged=True)
    assert (first, rest, reason) == (full[n - 1], [], "length")
    assert first_token_finishes(full[0], greedy(1)) == "length"  # max_tokens=1
    assert first_token_finishes(full[0], greedy(2)) is None


def test_decode_refuses_a_request_with_nothing_left(model):
    prompt = prompt_of(8, 4)
    res = PrefillEngine(model, 16).run(prompt, greedy(3))
    hand = KVHandoff("x", res.num_tokens, res.rope_offset)
    with pytest.raises(ValueError, match="max_tokens"):  # resumed with its answer's last token from prefill
        DecodeEngine(model, 4).add(DecodeRequest("x", prompt, res.first_token, hand, greedy(3), generated=3),
                                   res.cache)


@pytest.mark.parametrize("ragged", LAYOUTS)
def test_drafts_longer_than_what_is_left_are_cut_to_it(model, ragged):
    prompt, n = prompt_of(24, 5), 6
    full = reference(model, prompt, n + 8)
    drafter = Knowing(prompt + full)
    spec = Speculation(drafter, max_tokens=8, max_rows=8, costs=FixedCosts())
    first, rest, reason = _resume(model, prompt, [], n, ragged, speculation=spec)
    assert [first] + rest == full[:n] and reason == "length"
    # Its first draft: 2 tokens returned, 4 left: the step's next token and 3 drafts, not the 4 it would draft.
    assert drafter.asked[0] == (TokenBudget(n, 2), 3)
    assert all(1 + k <= budget.left for budget, k in drafter.asked)


@pytest.mark.parametrize("ragged", LAYOUTS)
def test_a_resumed_request_drafts_within_what_it_has_left(model, ragged):
    prompt, n = prompt_of(24, 6), 10
    full = reference(model, prompt, n + 8)
    drafter = Knowing(prompt + full)
    spec = Speculation(drafter, max_tokens=8, max_rows=8, costs=FixedCosts())
    first, rest, reason = _resume(model, prompt, full[:4], n, ragged, speculation=spec)
    assert [first] + rest == full[4:n] and reason == "length"
    assert drafter.asked[0] == (TokenBudget(n, 6), 3)  # 4 tokens then the first, 1 decoded; 4 left
    assert all(1 + k <= budget.left for budget, k in drafter.asked)
