"""The power policy: which one a state calls for, and that no policy ever
allows more than the settings do."""

from __future__ import annotations

import pytest

from environment.power.policy import SAVER_PACE_TOKENS_PER_S, choose, decide
from environment.power.state import PowerState
from environment.settings import Settings

AC = PowerState(source="ac", reader="test")
BATTERY = PowerState(source="battery", percent=64, reader="test")


@pytest.mark.parametrize("state, name, refuse", [
    (AC, "performance", False),
    (PowerState(reader="none"), "performance", False),  # unknown source: as on AC (a desktop)
    (PowerState(source="ac", thermal="fair"), "performance", False),
    (BATTERY, "balanced", False),
    (PowerState(source="battery", percent=None), "balanced", False),
    (PowerState(source="battery", percent=19), "saver", False),
    (PowerState(source="battery", percent=20), "balanced", False),
    (PowerState(source="ac", low_power=True), "saver", False),
    (PowerState(source="ac", thermal="serious"), "saver", False),
    (PowerState(source="ac", thermal="critical"), "saver", True),
    (PowerState(source="battery", percent=90, thermal="critical"), "saver", True),
])
def test_auto_follows_the_state(state, name, refuse):
    got, reason, refusing = choose(state, "auto")
    assert (got, refusing) == (name, refuse)
    assert reason  # every policy says why, for the log and /health


@pytest.mark.parametrize("pinned", ["performance", "balanced", "saver"])
def test_a_pinned_policy_ignores_the_state(pinned):
    for state in (AC, BATTERY, PowerState(source="ac", thermal="critical")):
        name, reason, refuse = choose(state, pinned)
        assert (name, refuse) == (pinned, False) and "pinned" in reason


def test_limits_shrink_with_the_policy_and_never_exceed_the_settings():
    settings = Settings(max_batch=32, prefill_batch=16, max_queue=256)
    perf = decide(AC, settings)
    balanced = decide(BATTERY, settings)
    saver = decide(PowerState(source="battery", percent=5), settings)
    assert (perf.max_batch, perf.prefill_batch, perf.max_admitted, perf.pace_tokens_per_s) == (32, 16, None, 0.0)
    assert balanced.max_batch < perf.max_batch and balanced.prefill_batch < perf.prefill_batch
    assert saver.max_batch < balanced.max_batch and saver.prefill_batch == 1
    assert saver.max_admitted == saver.max_batch * 1 + 8  # one decode worker's rows plus a short queue
    assert saver.pace_tokens_per_s == SAVER_PACE_TOKENS_PER_S
    assert saver.defer_disk_writes and saver.defer_warm_up and not perf.defer_disk_writes
    assert saver.prefill_on_ane and not balanced.prefill_on_ane and not perf.prefill_on_ane
    small = Settings(max_batch=2, prefill_batch=1, max_queue=3)
    for state in (AC, BATTERY, PowerState(source="ac", low_power=True)):
        p = decide(state, small)
        assert p.max_batch <= 2 and p.prefill_batch <= 1 and (p.max_admitted or 0) <= 2 + 3


def test_saver_admission_counts_every_decode_worker():
    p = decide(PowerState(source="ac", low_power=True), Settings(decode_workers=3, max_batch=32))
    assert p.max_admitted == p.max_batch * 3 + 8
