"""keep_alive and ttl as Ollama and LM Studio clients send them."""

import pytest

from router.models.keep_alive import FOREVER, KeepAliveError, parse_keep_alive, parse_ttl


@pytest.mark.parametrize("value, seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("90s", 90.0), ("250ms", 0.25), ("1.5h", 5400.0), ("10", 10.0),
    (0, 0.0), ("0", 0.0), ("0s", 0.0), (3.5, 3.5), (-1, FOREVER), ("-1", FOREVER), ("-5m", FOREVER),
    (10 ** 12, FOREVER), (None, None),
])
def test_keep_alive_reads_as_ollama_reads_it(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["abc", "5x", "", "m5", "5 m", True, [1], {"s": 1}, float("nan"), "1h-5m"])
def test_a_keep_alive_that_is_no_duration_is_refused_with_its_reason(value):
    with pytest.raises(KeepAliveError, match="keep_alive"):
        parse_keep_alive(value)


def test_ttl_is_positive_seconds():
    assert parse_ttl(60) == 60.0 and parse_ttl(None) is None
    for bad in (0, -3, "60", True):
        with pytest.raises(KeepAliveError, match="ttl"):
            parse_ttl(bad)
