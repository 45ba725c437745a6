"""workers/warm_up.py: a worker's short prompt and decode steps before it
says ready, which must leave no trace: no prefix-cache calls, an empty
decode batch, the engine's prefix cache back in place."""

from __future__ import annotations

import pytest

from workers import warm_up
from workers.decode import DecodeEngine


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
        prefix = None

        def add(self, *a):
            raise RuntimeError("no room")

        def cancel(self, *a, **k):
            return False

    assert warm_up.warm_up(model, Broken()) > 0
    assert "warm-up failed (RuntimeError: no room)" in caplog.text
