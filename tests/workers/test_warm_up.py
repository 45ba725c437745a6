"""workers/warm_up.py: a worker's short prompt and decode steps before it
says ready, which must leave no trace: no prefix-cache calls, an empty
decode batch, the engine's prefix cache back in place."""

from __future__ import annotations

import pytest

from workers import warm_up
from workers.decode.engine import DecodeEngine
from workers.prefill import batch as prefill_batch


class RecordingPrefix:
    """A block prefix cache that records every call made to it."""

    kind = "blocks"

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append(name)
            raise AssertionError(f"the warm-up called the prefix cache's {name}")

        return record


@pytest.mark.parametrize("ragged", [True, False])
def test_warm_up_prefills_and_decodes_and_leaves_nothing_behind(embedded_model, monkeypatch, ragged):
    model, _ = embedded_model
    prefix = RecordingPrefix()
    decode = DecodeEngine(model, 4, prefix=prefix, ragged=ragged)
    steps = []
    real_step = decode.step
    monkeypatch.setattr(decode, "step", lambda: steps.append(real_step()) or steps[-1])
    seconds = warm_up.warm_up(model, decode)
    assert seconds > 0
    for rid in (warm_up.REQUEST_ID, warm_up.REQUEST_ID + "-2"):  # two rows of different lengths
        tokens = [u for updates in steps for u in updates if u.request_id == rid]
        assert len(tokens) == warm_up.DECODE_TOKENS  # max_tokens less the first (prefill's) token
        assert tokens[-1].finish_reason == "length"
    # they decoded in the same steps: one padded (or ragged) batch
    assert any({u.request_id for u in updates} == {warm_up.REQUEST_ID, warm_up.REQUEST_ID + "-2"}
               for updates in steps)
    assert not decode.has_work and decode.running == 0 and decode.waiting == 0
    assert decode.prefix is prefix and prefix.calls == []


def test_a_failing_warm_up_is_logged_not_raised(embedded_model, caplog):
    model, _ = embedded_model

    class Broken:
        eos_token_ids = []
        prefix = speculation = None

        def add(self, *a):
            raise RuntimeError("no room")

        def cancel(self, *a, **k):
            return False

    assert warm_up.warm_up(model, Broken()) > 0
    assert "warm-up failed (RuntimeError: no room)" in caplog.text


def test_a_batching_prefill_worker_warms_up_a_batch_of_two_follow_ups(embedded_model, monkeypatch):
    """Its two rows have cached prefixes and new tails of different lengths,
    so the batch's padded pass and its one token a row both run."""
    model, _ = embedded_model
    batches = []
    real = prefill_batch.run_batch

    def recording(jobs):
        batches.append([(j.cached_tokens, j.total) for j in jobs])
        results = real(jobs)
        assert all(r.num_tokens == j.total and r.cache[0].offset == j.total for r, j in zip(results, jobs))
        return results

    monkeypatch.setattr(prefill_batch, "run_batch", recording)
    assert warm_up.warm_up(model, None, batch=False) > 0 and batches == []
    assert warm_up.warm_up(model, None, batch=True) > 0
    assert len(batches) == 1
    (c1, t1), (c2, t2) = batches[0]
    assert c1 != c2 and t1 - c1 != t2 - c2 and min(c1, c2) > 0


class CountingDrafter:
    """A drafter that counts the steps that asked it for drafts (and offers none)."""

    method = "counting"

    def __init__(self):
        self.asked = 0

    def propose(self, batch, asking, inputs):
        self.asked += 1
        return [[] for _ in asking]

    def leave(self, uid):
        pass


def test_a_groups_warm_up_decodes_without_drafts(embedded_model):
    """A group's ranks time their steps apart, and the warm-up's steps carry
    no costs from rank 0 (workers/group/members.py): a rank's warm-up
    (`fatal`) decodes without asking for drafts, its speculation back after;
    a worker alone drafts in its warm-up (its verify step compiles there)."""
    from workers.decode.speculation import Speculation

    model, _ = embedded_model
    for fatal, asks in ((True, False), (False, True)):
        drafter = CountingDrafter()
        spec = Speculation(drafter, max_tokens=4, max_rows=8)
        decode = DecodeEngine(model, 4, speculation=spec)
        warm_up.warm_up(model, decode, fatal=fatal)
        assert decode.speculation is spec and (drafter.asked > 0) == asks
