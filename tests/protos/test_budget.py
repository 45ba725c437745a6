"""A request's token budget (protos/budget.py) at its edges, and as the
messages hand it out; the messages split by the processes they travel
between are still one list for the codec."""

from __future__ import annotations

import dataclasses

import pytest

from protos import cache_messages, kv_handoff, model_messages, worker_messages
from protos.budget import TokenBudget
from protos.messages import ALL_MESSAGES, DecodeRequest, KVHandoff, PrefillRequest, SamplingParams


def test_a_new_request_may_produce_all_it_is_allowed():
    budget = TokenBudget(5)
    assert (budget.left, budget.exhausted) == (5, False)
    assert budget.after(1) == TokenBudget(5, 1) and budget.after(5).exhausted
    assert budget.after(7).left == 0  # never below nothing


def test_max_tokens_1_ends_at_the_first_token():
    assert TokenBudget(1).after(1).exhausted
    assert not TokenBudget(2).after(1).exhausted


def test_a_resumed_request_counts_its_answer_so_far():
    sp = SamplingParams(max_tokens=4)
    prefill = PrefillRequest("r~1", [1, 2, 3, 7, 8, 9], sp, "", generated=3)
    assert prefill.budget == TokenBudget(4, 3) and prefill.budget.left == 1
    assert prefill.budget.after(1).exhausted  # the first token from prefill is its last
    decode = DecodeRequest("r~1", [1, 2, 3, 7, 8], 9, KVHandoff("r~1", 5, 5), SamplingParams(max_tokens=6),
                           generated=3)
    assert decode.budget == TokenBudget(6, 3) and decode.budget.left == 3
    assert decode.answer == [7, 8]  # first_token (9) is not in the prompt


def test_a_decode_request_starts_after_its_first_token():
    fresh = DecodeRequest("r", [1, 2, 3], 9, KVHandoff("r", 3, 3), SamplingParams(max_tokens=1))
    assert fresh.budget == TokenBudget(1, 1) and fresh.budget.exhausted and fresh.answer == []
    assert PrefillRequest("r", [1, 2, 3], SamplingParams(max_tokens=1), "").budget == TokenBudget(1, 0)


@pytest.mark.parametrize("produced, k, fits", [
    (0, 8, 8),   # plenty left: the whole draft
    (7, 8, 2),   # 3 left: the step's next token, then 2 drafts
    (9, 8, 0),   # 1 left: the next token alone, no draft
    (10, 8, 0),  # none left
    (7, 0, 0),
])
def test_a_draft_longer_than_what_is_left_is_cut(produced, k, fits):
    assert TokenBudget(10, produced).fit_draft(k) == fits


def test_a_budget_counts_from_zero():
    with pytest.raises(ValueError):
        TokenBudget(-1)
    with pytest.raises(ValueError):
        TokenBudget(4, -1)


def test_every_message_of_every_pair_is_on_the_list_once():
    defined = [obj for module in (worker_messages, kv_handoff, cache_messages, model_messages) for obj in vars(module).values()
               if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__]
    assert sorted(c.__name__ for c in defined) == sorted(c.__name__ for c in ALL_MESSAGES)
    assert len({c.__name__ for c in ALL_MESSAGES}) == len(ALL_MESSAGES)  # known on the wire by name alone
    assert TokenBudget not in ALL_MESSAGES  # carried as its two numbers
