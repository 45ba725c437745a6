"""Where a worker's main loop spends its time, by phase, logged while it works.

A decode step's own time is one phase among several: taking in handoffs
(reading KV from the arena), committing finished requests' KV to the prefix
cache, sending tokens, prefill chunks. When streams are slower than the model
step explains, this line says which phase holds the rest, on any machine,
without a profiler. Phases are wall time on the MLX thread; MLX work that one
phase only queued is paid for by the phase that waits on it (a decode step
waits on its own tokens), so the split is exact per phase boundary.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from contextlib import contextmanager

log = logging.getLogger(__name__)


class LoopClock:
    """Sums wall time per named phase; every `interval_s` in which anything
    but waiting happened, logs one line and starts over."""

    def __init__(self, name: str, interval_s: float = 10.0, clock=time.perf_counter):
        self.name = name
        self.interval_s = interval_s
        self._clock = clock
        self._start = clock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.parts: dict[str, float] = defaultdict(float)  # inside phases: see part()

    @contextmanager
    def phase(self, name: str):
        t0 = self._clock()
        try:
            yield
        finally:
            self.seconds[name] += self._clock() - t0
            self.counts[name] += 1

    @contextmanager
    def part(self, name: str):
        """Time a part of the phase in progress (a decode step's wait for the
        step in flight, its commits): reported after the phases, not added
        to them."""
        t0 = self._clock()
        try:
            yield
        finally:
            self.parts[name] += self._clock() - t0
            self.counts[name] += 1

    def count(self, name: str, n: int = 1) -> None:
        """Count something that is not a phase (tokens, requests)."""
        self.counts[name] += n

    def summary(self) -> str:
        elapsed = self._clock() - self._start
        busy = {k: v for k, v in self.seconds.items() if k != "wait"}
        parts = [f"{k} {v:.2f} s/{self.counts[k]}" for k, v in sorted(busy.items(), key=lambda kv: -kv[1])]
        other = max(elapsed - sum(self.seconds.values()), 0.0)
        extra = [f"{k} {v}" for k, v in sorted(self.counts.items()) if k not in self.seconds and k not in self.parts]
        extra += [f"{k} {v:.2f} s/{self.counts[k]}" for k, v in sorted(self.parts.items(), key=lambda kv: -kv[1])]
        return (f"{self.name} loop, last {elapsed:.1f} s: " + ", ".join(parts)
                + f", wait {self.seconds.get('wait', 0.0):.2f} s, other {other:.2f} s"
                + (f" ({', '.join(extra)})" if extra else ""))

    def maybe_report(self) -> str | None:
        """Log (INFO) and reset when the interval is over and there was work."""
        if self._clock() - self._start < self.interval_s:
            return None
        line = None
        if any(k != "wait" for k in self.seconds):
            line = self.summary()
            log.info("%s", line)
        self._start = self._clock()
        self.seconds.clear()
        self.counts.clear()
        self.parts.clear()
        return line


@contextmanager
def part(clock: LoopClock | None, name: str, tally: dict | None = None):
    """`clock.part(name)` (nothing when no clock is set: engines outside a
    worker); with `tally`, the seconds are also added to tally[name]: one
    request's own parts, for its debug line."""
    t0 = time.perf_counter()
    with clock.part(name) if clock is not None else contextlib.nullcontext():
        try:
            yield
        finally:
            if tally is not None:
                tally[name] = tally.get(name, 0.0) + time.perf_counter() - t0


def tally_line(tally: dict) -> str:
    """'load prefix 0.6 ms, chunk 212.0 ms, ...': a request's parts."""
    return ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in tally.items())
