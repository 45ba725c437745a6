"""`tandem bench --workload soak` in small: its slope and memory helpers, and
its whole code path for two seconds with two clients against the router's
app over the scripted engine (no model: a real `tandem serve` takes too long
to start for the suite; the real soak is run by hand, see BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import os

import pytest

from benchmarks.bench.workloads import soak
from benchmarks.bench.workloads.core import Target
from tests.support.fake_engine import FakeEngine, build_tokenizer
from tests.support.router_server import serve_app

MB = soak.MB


def test_the_slope_is_least_squares_per_minute():
    assert soak.slope_per_min([(0, 10.0), (60, 11.0), (120, 12.0)]) == pytest.approx(1.0)
    assert soak.slope_per_min([(0, 5.0), (30, 9.0), (60, 5.0), (90, 9.0)]) == pytest.approx(1.6)  # noise, no trend
    assert soak.slope_per_min([(0, 1.0)]) is None and soak.slope_per_min([(5, 1.0), (5, 2.0)]) is None


def test_memory_figures_leave_out_the_warm_up_and_name_restarts():
    samples = soak.MemorySamples()
    samples.series = {10: [(t, (100 + (50 if t < 20 else 0) + t / 60) * MB, 40 * MB) for t in range(0, 100, 5)],
                      11: [(t, 30 * MB, None) for t in range(50, 100, 5)]}  # started mid-run: a restart
    samples.names = {10: "supervisor", 11: "spawned child"}
    figures = {p["pid"]: p for p in soak.process_figures(samples, 20.0, {11: "decode-0"})}
    first = figures[10]
    assert first["samples"] == 16 and first["rss_slope_mb_min"] == pytest.approx(1.0, abs=1e-3)
    assert first["rss_change_mb"] == pytest.approx(1.2, abs=0.1)  # the warm-up's 50 MB step left out
    assert first["anon_slope_mb_min"] == 0 and first["anon_change_mb"] == 0
    second = figures[11]
    assert second["name"] == "decode-0" and second["appeared_s"] == 50
    assert second["anon_start_mb"] is None and second["anon_slope_mb_min"] is None


def test_requests_mix_streamed_and_not_greedy_and_sampled():
    bodies = [soak.request_body("m", soak.SoakConfig(), 0, i) for i in range(6)]
    assert [b["stream"] for b in bodies] == [True, False] * 3
    assert [b["temperature"] for b in bodies] == [0.0, 0.0, 0.8] * 2
    assert len({b["messages"][0]["content"] for b in bodies}) == 6
    assert all(8 <= b["max_tokens"] <= 48 for b in bodies)


def test_a_short_soak_runs_end_to_end(tmp_path, capsys):
    tokenizer = build_tokenizer(tmp_path)
    engine = FakeEngine(tokenizer)
    engine.say("Hello world.")
    run = soak.SoakRun(soak.SoakConfig(clients=2, duration_s=2.0, sample_s=0.25, timeout_s=10.0),
                       root_pid=os.getpid(), roles=lambda: {os.getpid(): "pytest"})
    with serve_app(engine, tokenizer, request_timeout_s=30) as server:
        out = asyncio.run(soak.soak(Target("fake", server.url, "tandem-test"), run))
    assert out["errors"] == 0 and out["requests"] == out["ok"] > 4
    assert 0 < out["streamed"] < out["requests"] and out["output_tokens"] > 0
    me = next(p for p in out["processes"] if p["pid"] == os.getpid())
    assert me["name"] == "pytest" and me["samples"] >= 3 and me["rss_slope_mb_min"] is not None
    assert "soak: 2 clients" in capsys.readouterr().out
