"""Which inter-token gaps of the interference workload's streams count where
(benchmarks/bench/workloads/core.py): while long prompts were in flight, once
every stream decodes, after every stream's first token. Pure functions of the
streams' RequestResults, so they are tested without a server.
"""

from __future__ import annotations

from typing import Callable

from benchmarks.bench.workloads.loadgen import RequestResult


def gaps_during(streams: list[RequestResult], longs: list[RequestResult]) -> list[float]:
    """Inter-token gaps of the streams that overlap the time any long prompt was in flight."""
    if not longs:
        return []
    start = min(r.sent_at for r in longs)
    end = max(r.sent_at + r.latency for r in longs)
    return _gaps(streams, lambda a, b: b >= start and a <= end)


def last_first_token(streams: list[RequestResult], t0: float = 0.0) -> float | None:
    """When the last successful stream's first text arrived (seconds from t0), or None."""
    firsts = [r.sent_at + r.ttft for r in streams if r.ok and r.ttft is not None]
    return max(firsts) - t0 if firsts else None


def last_join(streams: list[RequestResult], t0: float = 0.0) -> float | None:
    """When the last successful stream's second text arrived (seconds from t0): its
    first decode step's, from when on every stream decodes; None when none got
    that far. A server whose prefill sends the first token (Tandem) adds the
    stream to its decode batch after it, so the first text is not the join."""
    seconds = [r.sent_at + r.chunk_times[1] for r in streams if r.ok and len(r.chunk_times) > 1]
    return max(seconds) - t0 if seconds else None


def gaps_after_join(streams: list[RequestResult]) -> list[float]:
    """Inter-token gaps of the successful streams that begin once every stream
    decodes (last_join): the stalls of the streams' starts are left out, the
    steps where streams finish are in."""
    joined = last_join(streams)
    return [] if joined is None else _gaps(streams, lambda a, b: a >= joined)


def gaps_after_first_tokens(streams: list[RequestResult]) -> list[float]:
    """Inter-token gaps whose text arrived after the last stream's first text; on a
    server that starts decoding a stream after its first token, its first decode gap
    (the hand-off, the join) is among them."""
    first = last_first_token(streams)
    return [] if first is None else _gaps(streams, lambda a, b: b > first)


def _gaps(streams: list[RequestResult], keep: Callable[[float, float], bool]) -> list[float]:
    """The gaps (b - a between consecutive texts) of the successful streams for which keep(a, b)."""
    out = []
    for r in streams:
        if r.ok:
            times = [r.sent_at + t for t in r.chunk_times]
            out += [b - a for a, b in zip(times, times[1:]) if keep(a, b)]
    return out


def arrivals(streams: list[RequestResult], t0: float) -> list[list[float]]:
    """Each stream's text arrival times, seconds from t0 to 0.1 ms ([] for a failed one)."""
    return [[round(r.sent_at + t - t0, 4) for t in r.chunk_times] if r.ok else [] for r in streams]
