"""`tandem bench` and `tandem random-model`: statistics against a scripted server, report, random models.

The scripted server streams a fixed answer with known delays (first token
after FIRST_S, then one every GAP_S), so the load generator's numbers can be
checked against what they must be; other routes answer 429, 500, or never.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.bench import bench_cmd
from benchmarks.bench.measures import bandwidth
from benchmarks.bench.measures.memory import ProcessTreeMemory
from benchmarks.bench.reporting import report
from benchmarks.bench.servers import systems
from benchmarks.bench.servers.peer_weights import needs_float32_copy
from benchmarks.bench.workloads import core as workloads
from benchmarks.bench.workloads import loadgen, stream_gaps
from benchmarks.bench.workloads import vision as vw
from benchmarks.bench.workloads.loadgen import RequestResult, percentile, summarize
from benchmarks.random_models import text as random_model
from tests.support.server import free_port
from tests.support.tiny_vlms import tiny_vlm

FIRST_S, GAP_S = 0.20, 0.05
TOKENS = ["Hello", ",", " world", "!"]
USAGE = {"prompt_tokens": 10, "completion_tokens": len(TOKENS), "total_tokens": 14,
         "prompt_tokens_details": {"cached_tokens": 3}}


def _chunk(delta: dict, usage: dict | None = None) -> str:
    body = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}] if delta else []}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


async def _answer():
    yield _chunk({"role": "assistant", "content": ""})
    for i, tok in enumerate(TOKENS):
        await asyncio.sleep(FIRST_S if i == 0 else GAP_S)
        yield _chunk({"content": tok})
    yield _chunk({}, USAGE)
    yield "data: [DONE]\n\n"


async def _first_then_hang():
    yield _chunk({"content": "one"})
    await asyncio.sleep(30)
    yield "data: [DONE]\n\n"


class Scripted:
    def __init__(self):
        self.calls = 0
        self.prompts: list[str] = []  # the prefill mode's, in arrival order

    async def chat(self, request: Request) -> Response:
        mode = request.path_params["mode"]
        body = await request.json()
        self.calls += 1
        if mode == "prefill":  # a first token after time in proportion to the prompt's length
            self.prompts.append(body["messages"][-1]["content"])
            await asyncio.sleep(len(self.prompts[-1]) / 20_000)
        if mode == "busy" or (mode == "mixed" and self.calls % 3 == 0):
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429, headers={"Retry-After": "0"})
        if mode == "fail" or (mode == "mixed" and self.calls % 3 == 1):
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if mode == "hang":
            await asyncio.sleep(30)
        if mode == "trickle":
            return StreamingResponse(_first_then_hang(), media_type="text/event-stream")
        return StreamingResponse(_answer(), media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "scripted-model", "object": "model"}]})

    async def metrics(self, request: Request) -> Response:
        return Response(f"# TYPE tandem_prompt_tokens_total counter\ntandem_prompt_tokens_total {self.calls * 10}.0\n"
                        f"tandem_prefix_cache_hit_tokens_total {self.calls * 3}.0\n", media_type="text/plain")


def _serve(app, state):
    """Run `app` on a free port in a thread; yields (base URL, state) while it serves."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def scripted():
    """Base URL of the scripted server; a mode is the first path segment."""
    s = Scripted()
    app = Starlette(routes=[Route("/{mode}/v1/chat/completions", s.chat, methods=["POST"]),
                            Route("/{mode}/v1/models", s.models), Route("/{mode}/metrics", s.metrics)])
    yield from _serve(app, s)


def _one(base: str, timeout: float = 5.0) -> RequestResult:
    async def go():
        async with httpx.AsyncClient() as c:
            return await loadgen.stream_chat(c, base, loadgen.chat_body("m", [{"role": "user", "content": "hi"}], 8),
                                             timeout)
    return asyncio.run(go())


# ------------------------------------------------------------ one request

def test_stream_timings_and_usage(scripted):
    base, _ = scripted
    r = _one(base + "/ok")
    assert r.ok and r.status == 200
    assert r.text == "".join(TOKENS)
    assert FIRST_S * 0.9 <= r.ttft < FIRST_S + 0.3
    assert len(r.itls) == len(TOKENS) - 1
    assert all(GAP_S * 0.8 <= g < GAP_S + 0.1 for g in r.itls)
    assert (r.output_tokens, r.prompt_tokens, r.cached_tokens) == (4, 10, 3)


def test_errors_keep_status(scripted):
    base, _ = scripted
    busy = _one(base + "/busy")
    assert (busy.ok, busy.status, busy.retry_after) == (False, 429, 0.0)
    fail = _one(base + "/fail")
    assert (fail.ok, fail.status) == (False, 500) and "boom" in fail.error


@pytest.mark.parametrize("mode", ["hang", "trickle"])
def test_hung_server_ends_in_timeout(scripted, mode):
    base, _ = scripted
    t0 = time.perf_counter()
    r = _one(base + "/" + mode, timeout=1.0)
    assert time.perf_counter() - t0 < 3.0
    assert (r.ok, r.status) == (False, "timeout")


def test_connection_refused_is_an_error():
    r = _one(f"http://127.0.0.1:{free_port()}", timeout=2.0)
    assert (r.ok, r.status) == (False, "connect")


# ------------------------------------------------------------ statistics

def _fake(ttft: float, gaps: list[float], ok: bool = True, status=200, tokens: int | None = None) -> RequestResult:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(status=status, ok=ok, ttft=ttft if ok else None, chunk_times=times if ok else [],
                         output_tokens=(tokens if tokens is not None else len(times)) if ok else 0, prompt_tokens=10)


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_summarize_exact():
    results = [_fake(0.5, [0.1, 0.1, 0.1]), _fake(1.5, [0.2, 0.2, 0.2]), _fake(0.4, [0.9, 0.9, 0.9]),
               RequestResult(status=429), RequestResult(status=500), RequestResult(status="timeout")]
    s = summarize(results, wall=2.0, ttft_budget=1.0, itl_budget=0.5)
    assert (s["requests"], s["ok"], s["rejected_429"]) == (6, 3, 1)
    assert s["errors"] == {"500": 1, "timeout": 1} and s["error_count"] == 2
    assert s["output_tokens"] == 12 and s["output_tok_s"] == pytest.approx(6.0)
    assert s["requests_s"] == pytest.approx(1.5)
    assert s["ttft_p50_s"] == pytest.approx(0.5)
    assert s["itl_p50_s"] == pytest.approx(0.2)
    assert s["itl_max_s"] == pytest.approx(0.9)
    # good: only the first (the second misses TTFT, the third the mean ITL); share of all six
    assert s["goodput"] == pytest.approx(1 / 6)
    assert s["goodput_requests_s"] == pytest.approx(0.5)


def test_closed_loop_against_scripted_server(scripted):
    base, _ = scripted
    target = workloads.Target("scripted", base + "/ok", "m")
    cfg = workloads.WorkloadConfig(timeout_s=5.0)

    async def go():
        async with httpx.AsyncClient() as client:
            progress = loadgen.Progress("test", 6, stream=io.StringIO())
            res, wall = await loadgen.closed_loop(
                lambda c, i: workloads.send(client, target, cfg, [{"role": "user", "content": "x"}], 8), 2,
                requests=6, progress=progress)
            progress.close()
            return res, wall, progress.stream.getvalue()

    res, wall, text = asyncio.run(go())
    one = FIRST_S + GAP_S * (len(TOKENS) - 1)
    assert len(res) == 6 and all(r.ok for r in res)
    assert 3 * one * 0.9 <= wall < 3 * one + 1.0  # 6 requests, 2 at a time, no queueing on this server
    s = summarize(res, wall, ttft_budget=1.0, itl_budget=0.5)
    assert s["output_tok_s"] == pytest.approx(24 / wall)
    assert s["goodput"] == 1.0
    assert summarize(res, wall, ttft_budget=0.05, itl_budget=0.5)["goodput"] == 0.0
    assert "6/6 req" in text and "0 failed" in text


def test_closed_loop_counts_429_and_errors_and_is_bounded_by_duration(scripted):
    base, _ = scripted
    target = workloads.Target("scripted", base + "/mixed", "m")
    cfg = workloads.WorkloadConfig(timeout_s=5.0)

    async def go():
        async with httpx.AsyncClient() as client:
            return await loadgen.closed_loop(
                lambda c, i: workloads.send(client, target, cfg, [{"role": "user", "content": "x"}], 8), 3,
                duration=1.0)

    t0 = time.perf_counter()
    res, wall = asyncio.run(go())
    assert time.perf_counter() - t0 < 1.0 + 5.0
    s = summarize(res, wall, ttft_budget=1.0, itl_budget=0.5)
    assert s["rejected_429"] > 0 and s["errors"].get("500", 0) > 0 and s["ok"] > 0
    assert s["requests"] == s["ok"] + s["error_count"] + s["rejected_429"]


# ------------------------------------------------------------ prompts and metrics

def test_fairness_warms_up_then_sends_one_short_then_a_stream_beside_long_prompts(scripted):
    """The fairness workload's order and bookkeeping against a scripted server
    whose first token comes after a time in proportion to the prompt: a
    warm-up long and short (not counted), shorts alone, a long alone, a long
    with one short beside it (issue 42's case), a long with a stream of
    shorts; every prompt new. (Its figures are the server's: the scripted one
    has no prefill to be fair with, so no ratio is asserted.)"""
    from benchmarks.bench.workloads import fairness as fw

    base, state = scripted
    start = len(state.prompts)
    target = workloads.Target("scripted", base + "/prefill", "m")
    out = asyncio.run(fw.fairness(target, workloads.WorkloadConfig(timeout_s=10.0, long_prompt_words=300)))
    sent = state.prompts[start:]
    # Warm-up long and short, three shorts alone, a long alone, a long and one short, a long and the stream.
    assert [len(p.split()) > 100 for p in sent[:9]] == [True, False, False, False, False, True, True, False, True]
    assert not any(len(p.split()) > 100 for p in sent[9:]) and len(set(sent)) == len(sent)
    assert out["errors"] == 0 and out["long_prompt_tokens"] == 10  # the scripted usage
    assert out["one_short_ttft_s"] > 0 and out["long_one_ttft_s"] > out["one_short_ttft_s"]
    assert out["one_short_ratio"] > 0 and out["long_one_ratio"] > 0
    table = "\n".join(fw.fairness_table([{"name": "scripted", "results": {"fairness": out}}]))
    assert "1 short: short/alone" in table and "scripted" in table


def test_prompts_are_seeded_and_distinct():
    a = workloads.user_prompt(0, "client0", 50)
    assert a == workloads.user_prompt(0, "client0", 50)
    assert a != workloads.user_prompt(0, "client1", 50) and a != workloads.user_prompt(1, "client0", 50)
    assert len(workloads.words(850, 0, "s").split()) == 850


def test_gaps_during_long_prompts():
    stream = _fake(0.1, [0.1, 2.0, 0.1])  # chunks at 0.1, 0.2, 2.2, 2.3 s
    stream.sent_at = 100.0
    long = RequestResult(status=200, ok=True, sent_at=100.5, latency=1.0)  # in flight 100.5 .. 101.5
    assert stream_gaps.gaps_during([stream], [long]) == [pytest.approx(2.0)]
    assert stream_gaps.gaps_during([stream], []) == []


def test_gaps_after_the_last_stream_joined():
    # Two streams sent together. b's first text comes at 1.0 s, from its prefill; b joins
    # the decode batch after it, and its second text (its first decode step's) comes at
    # 1.09 s: every stream decodes from then on. a stalls 0.5 s while b's prompt is
    # prefilled and 0.3 s in the step b joins; both begin before the join and are left
    # out, as is b's own first gap. A failed stream neither joins nor counts.
    a = _fake(0.1, [0.1, 0.5, 0.1, 0.3, 0.1, 0.1, 0.2])  # 0.1 0.2 0.7 0.8 1.1 1.2 1.3 1.5
    b = _fake(1.0, [0.09, 0.1, 0.1])  # 1.0 1.09 1.19 1.29
    failed = _fake(9.0, [], ok=False)
    a.sent_at = b.sent_at = failed.sent_at = 10.0
    streams = [a, b, failed]
    assert stream_gaps.last_join(streams, 10.0) == pytest.approx(1.09)
    assert stream_gaps.last_first_token(streams, 10.0) == pytest.approx(1.0)
    assert sorted(stream_gaps.gaps_after_join(streams)) == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.2])
    # After the first texts alone: a's stall in the join step and b's first decode gap are in.
    assert sorted(stream_gaps.gaps_after_first_tokens(streams)) == pytest.approx([0.09, 0.1, 0.1, 0.1, 0.1, 0.2, 0.3])
    assert stream_gaps.arrivals([a, failed], 10.0) == [pytest.approx([0.1, 0.2, 0.7, 0.8, 1.1, 1.2, 1.3, 1.5]), []]
    # One stream alone: every gap from its second text on.
    assert stream_gaps.gaps_after_join([a]) == pytest.approx([0.5, 0.1, 0.3, 0.1, 0.1, 0.2])
    # A stream that ended at its first text never decodes: the others' join counts.
    one = _fake(0.3, [])
    one.sent_at = 10.0
    assert stream_gaps.last_join([a, one], 10.0) == pytest.approx(0.2)
    assert stream_gaps.gaps_after_join([failed]) == [] and stream_gaps.last_join([]) is None


def test_interference_after_join_in_ratios_and_table():
    def system(name, after):
        quiet = {"ok": 4, "error_count": 0, "ttft_p50_s": 0.1, "itl_p50_s": 0.01, "itl_p99_s": 0.05,
                 "itl_p99_after_first_tokens_s": 0.05, "itl_p99_after_join_s": after}
        loud = {**quiet, "itl_p99_s": 0.08, "itl_max_s": 0.2, "itl_p99_during_long_s": 0.1}
        return {"name": name, "error": None, "memory": None,
                "results": {"interference": {"streams": 4, "stream_tokens": 8, "quiet": quiet, "loud": loud,
                                             "itl_p99_ratio": 1.6, "itl_p99_during_long_ratio": 2.0}}}

    rep = report.build_report([system("tandem", 0.033), system("mlx_lm", 0.030)], {}, "tandem bench")
    (r,) = rep["ratios"]
    assert r["interference_quiet_after_join_itl_p99"] == pytest.approx(1.1)
    assert r["interference_quiet_itl_p99"] == pytest.approx(1.0)
    assert r["interference_quiet_after_first_tokens_itl_p99"] == pytest.approx(1.0)
    text = report.render(rep)
    assert "after join p99" in text and "after 1st tokens p99" in text and "0.033" in text
    assert "interference quiet ITL p99 after join" in text and "1.10x" in text


def test_metric_sum():
    text = ('x_total 5\ntandem_prompt_tokens_total 100.0\ntandem_prompt_tokens_total_other 7\n'
            'foo{a="1"} 2\nfoo{a="2"} 3\n')
    assert workloads.metric_sum(text, "tandem_prompt_tokens_total") == 100.0
    assert workloads.metric_sum(text, "foo") == 5.0
    assert workloads.metric_sum(text, "missing") is None


# ------------------------------------------------------------ the command and its report

def test_bench_command_json_report(scripted, tmp_path, capsys, monkeypatch):
    base, _ = scripted
    # The single-stream table's copy measured on 8 MiB, not 256 MiB five times (~2 CPU-s).
    real_copy = bandwidth.copy_bandwidth
    monkeypatch.setattr(bandwidth, "copy_bandwidth", lambda: real_copy(8 << 20, 2))
    p = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    out = tmp_path / "r.json"
    args = p.parse_args(["--url", base + "/ok", "--name", "scripted", "--workload", "all", "--concurrency", "1,2",
                         "--requests-per-level", "2", "--warmup", "1", "--streams", "2", "--long-prompts", "1",
                         "--prefix-repeats", "1", "--agents", "2", "--turns", "2", "--timeout", "5",
                         "--json", str(out), "--log-dir", str(tmp_path / "logs")])
    assert bench_cmd.run(args) == 0
    rep = json.loads(out.read_text())
    assert rep["schema"] == report.SCHEMA
    assert {"created", "machine", "command", "config", "systems", "ratios"} <= rep.keys()
    (system,) = rep["systems"]
    assert system["name"] == "scripted" and system["error"] is None
    res = system["results"]
    levels = res["sweep"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        assert {"requests", "ok", "errors", "rejected_429", "output_tok_s", "requests_s", "ttft_p50_s", "ttft_p99_s",
                "itl_p50_s", "itl_p99_s", "goodput"} <= lv.keys()
        assert lv["ok"] == 2 and lv["output_tokens"] == 8
    loud = res["interference"]["loud"]
    assert res["interference"]["quiet"]["ok"] == 2 and loud["long_prompts_sent"] == 1
    assert loud["gaps_during_long"] > 0 and loud["itl_p99_during_long_s"] < 1.0
    quiet = res["interference"]["quiet"]
    assert quiet["gaps_after_join"] > 0 and quiet["itl_p99_after_join_s"] > 0
    assert [len(a) for a in quiet["arrivals_s"]] == [4, 4]
    assert quiet["last_join_s"] > quiet["last_first_token_s"] > 0 and quiet["itl_p99_after_first_tokens_s"] > 0
    assert res["prefix"]["warm_cached_tokens"] == 3 and res["prefix"]["cold_ttft_s"] > 0
    assert res["swarm"]["turns_ok"] == 4 and res["swarm"]["computed_prompt_tokens"] == 4 * (10 - 3)
    assert res["swarm"]["metrics_computed_prompt_tokens"] == 4 * (10 - 3)
    single = res["single_stream"]  # no --model: tokens/s without a bandwidth share
    assert single["decode_tok_s"] == pytest.approx(1 / GAP_S, rel=0.3) and single["bandwidth_share"] is None
    assert single["copy_bandwidth_bytes_s"] > 0
    printed = capsys.readouterr().out
    assert "Sweep" in printed and "scripted" in printed and "Swarm" in printed


def test_ratios_and_render():
    def system(name, tok_s, itl):
        lv = {"concurrency": 4, "requests": 8, "ok": 8, "errors": {}, "error_count": 0, "rejected_429": 0,
              "output_tok_s": tok_s, "requests_s": 1.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "itl_p50_s": itl,
              "itl_p99_s": itl, "goodput": 1.0, "first_error": None}
        return {"name": name, "error": None, "results": {"sweep": [lv]},
                "memory": {"processes": [{"pid": 1, "name": "x", "peak_rss_bytes": 2 << 20}],
                           "sum_of_peaks_bytes": 2 << 20, "peak_total_rss_bytes": 2 << 20, "method": "t"}}

    rep = report.build_report([system("tandem", 30.0, 0.05), system("mlx_lm", 20.0, 0.1),
                               {"name": "vllm-mlx", "error": "not installed", "results": {}, "memory": None}],
                              {"max_tokens": 8}, "tandem bench")
    (r,) = rep["ratios"]
    assert (r["tandem"], r["peer"]) == ("tandem", "mlx_lm")
    assert r["sweep"]["4"]["output_tok_s"] == pytest.approx(1.5) and r["sweep"]["4"]["itl_p99_s"] == pytest.approx(0.5)
    assert r["memory_peak_total"] == pytest.approx(1.0)
    tandem, peer = system("tandem", 30.0, 0.05), system("mlx_lm", 20.0, 0.1)
    tandem["memory"]["peak_total_pss_bytes"], peer["memory"]["peak_total_pss_bytes"] = 1 << 20, 2 << 20
    (with_pss,) = report.build_report([tandem, peer], {"max_tokens": 8}, "tandem bench")["ratios"]
    assert with_pss["memory_peak_total"] == pytest.approx(0.5)  # PSS, when both have it, not RSS
    text = report.render(rep)
    assert "vllm-mlx: did not run: not installed" in text and "1.50x" in text
    msg = report.plot(rep, "/nonexistent-dir-for-test/x.png") if not _has_matplotlib() else None
    assert msg is None or "matplotlib" in msg


def test_swarm_ratios_per_served_turn_when_a_system_dropped_agents():
    def system(name, wall, computed, ok):
        return {"name": name, "error": None, "memory": None,
                "results": {"swarm": {"wall_s": wall, "computed_prompt_tokens": computed, "turns_ok": ok}}}

    (r,) = report.ratios([system("tandem", 250.0, 14_000, 192), system("mlx_lm", 360.0, 16_800, 78)])
    assert r["swarm_wall"] == pytest.approx(250 / 360)
    assert r["swarm_wall_per_turn"] == pytest.approx((250 / 192) / (360 / 78))
    assert r["swarm_computed_per_turn"] == pytest.approx((14_000 / 192) / (16_800 / 78))
    (same,) = report.ratios([system("tandem", 250.0, 14_000, 192), system("mlx_lm", 500.0, 40_000, 192)])
    assert "swarm_wall_per_turn" not in same  # equal work: the plain ratios say it all
    (none,) = report.ratios([system("tandem", 250.0, 14_000, 192), system("mlx_lm", 5.0, None, 0)])
    assert none["swarm_wall_per_turn"] is None and none["swarm_computed_per_turn"] is None


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------ the vision workload

class FakeVLM:
    """A VLM server in miniature: prompt tokens counted from the messages (5 for the template,
    a word each, 100 per picture, 25 per video frame), cached tokens the longest prefix shared
    with an earlier prompt, and a first token after 1 ms per computed token. Modes: "vlm" takes
    videos as data or http URLs (fetching them), "nodata" only as http URLs, "novideo" refuses
    videos, "text" refuses all media."""

    def __init__(self):
        self.prompts: list[list[str]] = []
        self.fetched: list[int] = []

    async def chat(self, request: Request) -> Response:
        mode = request.path_params["mode"]
        body = await request.json()
        units = ["<tpl>"] * 5
        for m in body["messages"]:
            units.append("<" + m["role"] + ">")
            parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            for part in parts:
                if part["type"] == "text":
                    units += part["text"].split()
                    continue
                if mode == "text" or (mode == "novideo" and part["type"] == "video_url"):
                    return JSONResponse({"error": {"message": f"{part['type']} not supported"}}, status_code=400)
                spec = part[part["type"]]
                if part["type"] == "image_url":
                    units += [hashlib.sha256(spec["url"].encode()).hexdigest()] * 100
                    continue
                if spec["url"].startswith("data:") and mode == "nodata":
                    return JSONResponse({"error": {"message": "cannot read video data URLs"}}, status_code=400)
                if spec["url"].startswith("http"):
                    async with httpx.AsyncClient() as c:
                        data = (await c.get(spec["url"])).content
                    assert data[4:8] == b"ftyp"
                    self.fetched.append(len(data))
                units += [hashlib.sha256(spec["url"].encode()).hexdigest()] * (25 * spec["max_frames"])
        cached = max((_common(units, p) for p in self.prompts), default=0)
        self.prompts.append(units)
        usage = {"prompt_tokens": len(units), "completion_tokens": 2, "total_tokens": len(units) + 2,
                 "prompt_tokens_details": {"cached_tokens": cached}}

        async def answer():
            await asyncio.sleep(0.005 + 0.001 * (len(units) - cached))
            yield _chunk({"content": "seen"})
            yield _chunk({"content": " it"})
            yield _chunk({}, usage)
            yield "data: [DONE]\n\n"
        return StreamingResponse(answer(), media_type="text/event-stream")


def _common(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def fake_vlm():
    s = FakeVLM()
    app = Starlette(routes=[Route("/{mode}/v1/chat/completions", s.chat, methods=["POST"])])
    yield from _serve(app, s)


def _vision_cfg(**kw) -> workloads.WorkloadConfig:
    base = {"image_size": 64, "video_size": 32, "video_frames": (4, 8), "vision_repeats": 2,
            "vision_max_tokens": 4, "timeout_s": 10.0}
    return workloads.WorkloadConfig(**{**base, **kw})


def test_bench_pictures_are_seeded_and_distinct():
    from PIL import Image

    a = vw.bench_picture(96, 0, "x")
    assert a.shape == (96, 96, 3) and a.dtype == np.uint8
    assert np.array_equal(a, vw.bench_picture(96, 0, "x"))
    assert not np.array_equal(a, vw.bench_picture(96, 0, "y")) and not np.array_equal(a, vw.bench_picture(96, 1, "x"))
    assert not np.array_equal(a, vw.bench_picture(96, 0, "x", step=1))  # a video frame moves its shapes
    assert len(np.unique(a.reshape(-1, 3), axis=0)) > 50  # a gradient, not a flat colour
    url = vw.png_data_url(a)
    assert url.startswith("data:image/png;base64,")
    back = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
    assert np.array_equal(back, a)  # PNG: the server sees exactly these pixels


def test_bench_video_decodes_as_tandem_samples_it(tmp_path):
    from router.media.decode import MediaLimits
    from router.media.video import decode_video_bytes

    path = vw.write_video(tmp_path / "v.mp4", 6, 64, 0, "v")
    data = path.read_bytes()
    video = decode_video_bytes(data, MediaLimits(), "v", fps=vw.VIDEO_FPS, max_frames=32)
    assert len(video.frames) == 6 and (video.frames[0].width, video.frames[0].height) == (64, 64)
    assert len({f.content_hash for f in video.frames}) == 6
    with vw.MediaServer(tmp_path) as media:
        assert httpx.get(media.url("v.mp4")).content == data
        part = httpx.get(media.url("v.mp4"), headers={"Range": "bytes=8-15"})  # FFmpeg seeks by ranges
        assert part.status_code == 206 and part.content == data[8:16]
        assert part.headers["content-range"] == f"bytes 8-15/{len(data)}"
        assert httpx.get(media.url("v.mp4"), headers={"Range": "bytes=-4"}).content == data[-4:]
        assert httpx.get(media.url("missing.mp4")).status_code == 404
        assert vw.video_url(path, "http", media) == media.url("v.mp4")
        assert base64.b64decode(vw.video_url(path, "data", media).split(",", 1)[1]) == data


def test_text_words_match_the_turns_new_tokens():
    assert vw.text_words_for(57, 20, 99) == 37
    assert vw.text_words_for(10, 20, 99) == 1
    assert vw.text_words_for(None, 20, 99) == 99
    assert vw.text_words_for(30, None, 99) == 30


def test_vision_workload_turns_ratios_and_video(fake_vlm):
    base, _ = fake_vlm
    out = asyncio.run(vw.vision(workloads.Target("fake", base + "/vlm", "m"), _vision_cfg()))
    assert out["warmup_errors"] == [] and out["video_transport"] == "data" and out["errors"] == 0
    assert out["image_size"] == 64 and len(out["repeats"]) == 2
    assert out["template_overhead_tokens"] == 6  # the template and the role marker
    r0 = out["repeats"][0]
    # turns 2 and 3 resend the picture and the history: the fake finds them as a prefix
    assert r0["turn1"]["cached_tokens"] <= 6  # the template and role marker at most: a new picture
    assert r0["turn2"]["cached_tokens"] >= r0["turn1"]["prompt_tokens"] - 1
    assert r0["turn3"]["cached_tokens"] >= r0["turn2"]["prompt_tokens"] - 1
    added = r0["turn3"]["prompt_tokens"] - r0["turn2"]["prompt_tokens"]
    assert r0["turn3_added_tokens"] == added > 0
    assert r0["text"]["prompt_tokens"] == added  # the text-only request matches what turn 3 adds
    assert out["turn3_computed_tokens"] == out["turn3_prompt_tokens"] - out["turn3_cached_tokens"]
    # 1 ms per computed token: turn 1 computes the picture, turn 3 only its new tokens
    # Timings are reported, never asserted (a loaded box inverts them): the skip is in the token counts above.
    assert out["turn1_over_turn3"] > 0 and out["turn1_over_turn3"] == pytest.approx(
        out["turn1_ttft_s"] / out["turn3_ttft_s"])
    assert out["turn3_over_text"] == pytest.approx(out["turn3_ttft_s"] / out["text_ttft_s"])
    assert [v["frames"] for v in out["video"]] == [4, 8]
    for v in out["video"]:
        assert v["errors"] == 0 and len(v["repeats"]) == 2
        assert v["cold_prompt_tokens"] > 25 * v["frames"] and v["cold_cached_tokens"] <= 6
        assert v["cached_cached_tokens"] > 25 * v["frames"]  # same video, new question
        assert v["cold_over_cached"] == pytest.approx(v["cold_ttft_s"] / v["cached_ttft_s"])


def test_vision_workload_falls_back_to_http_and_records_refusals(fake_vlm):
    base, fake = fake_vlm
    cfg = _vision_cfg(video_frames=(4,), vision_repeats=1)
    fetched = len(fake.fetched)
    http_only = asyncio.run(vw.vision(workloads.Target("nodata", base + "/nodata", "m"), cfg))
    assert http_only["video_transport"] == "http" and len(fake.fetched) - fetched == 3  # warm-up, cold, cached
    assert len(http_only["warmup_errors"]) == 1 and "data URL" in http_only["warmup_errors"][0]
    assert http_only["video"][0]["errors"] == 0
    no_video = asyncio.run(vw.vision(workloads.Target("novideo", base + "/novideo", "m"), cfg))
    assert no_video["video_transport"] is None and no_video["errors"] == 0 and no_video["turn1_ttft_s"] > 0
    row = no_video["video"][0]
    assert row["errors"] == 2 and row["cold_ttft_s"] is None and "400" in row["first_error"]
    text = asyncio.run(vw.vision(workloads.Target("text", base + "/text", "m"), cfg))
    assert text["errors"] == 1 and text["turn1_ttft_s"] is None and text["turn3_ttft_s"] is None
    assert text["text_ttft_s"] is not None  # the text-only request still ran (sized by the fallback)
    assert "400" in text["first_error"] and "image_url not supported" in text["first_error"]

    rep = report.build_report([{"name": "tandem", "error": None, "results": {"vision": http_only}},
                               {"name": "mlx_vlm", "error": None, "results": {"vision": no_video}}],
                              {}, "tandem bench --workload vision")
    (r,) = rep["ratios"]
    assert r["vision_turn1_ttft"] == pytest.approx(http_only["turn1_ttft_s"] / no_video["turn1_ttft_s"])
    assert r["video"]["4"] == {"cold": None, "cached": None}
    rendered = report.render(rep)
    assert "Vision: one 64x64 picture" in rendered and "turn1/turn3" in rendered
    assert "Video: 32x32 frames" in rendered and "http" in rendered
    assert "mlx_vlm video 4 frames: 2 failed" in rendered and "vision turn 3 TTFT" in rendered
    json.dumps(rep)  # the JSON output


def test_vision_options_and_system_specs(tmp_path):
    import sys

    p = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    args = p.parse_args(["--workload", "all", "--video-frames", "none", "--image-size", "512"])
    assert "vision" not in args.workload and "vision" in bench_cmd.WORKLOADS
    cfg = bench_cmd.workload_config(args)
    assert (cfg.video_frames, cfg.image_size) == ((), 512)
    assert p.parse_args(["--workload", "vision", "--video-frames", "4,8"]).video_frames == (4, 8)

    opts = systems.Options(model_spec=str(tmp_path), model_dir=tmp_path, peer_model_dir=tmp_path / "peer",
                           run_dir=tmp_path / "run", vllm_mlx_bin=sys.executable, vllm_mlx_mllm=True)
    vlm = systems.server_spec("mlx_vlm", 18000, opts)
    assert "mlx_vlm.server" in vlm.argv and vlm.request_model == str(tmp_path / "peer")
    assert vlm.env["APC_DISK_PATH"].startswith(str(tmp_path / "run")) and "APC_ENABLED" in vlm.env
    vllm = systems.server_spec("vllm-mlx", 18001, opts)
    assert "--mllm" in vllm.argv and vllm.env["HOME"].startswith(str(tmp_path / "run"))
    opts.vllm_mlx_mllm = False
    assert "--mllm" not in systems.server_spec("vllm-mlx", 18001, opts).argv


def test_bench_vision_on_a_tiny_vlm(tmp_path, tmp_path_factory, capsys):
    """The real thing, small: `tandem bench --systems tandem-colocate --workload vision` on a tiny
    Qwen2.5-VL, colocated: two processes to start, not four (the split layout's argv is
    tests/benchmarks/test_energy.py's, its serving of pictures tests/e2e/test_e2e_vision.py's)."""
    model = tiny_vlm(tmp_path_factory)
    p = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    out = tmp_path / "v.json"
    args = p.parse_args(["--systems", "tandem-colocate", "--model", str(model), "--workload", "vision", "--warmup", "0",
                         "--image-size", "256", "--video-frames", "4", "--vision-repeats", "1",
                         "--vision-max-tokens", "4", "--timeout", "60", "--start-timeout", "120",
                         "--port-base", str(free_port()), "--json", str(out), "--log-dir", str(tmp_path / "logs")])
    assert bench_cmd.run(args) == 0, capsys.readouterr()
    (system,) = json.loads(out.read_text())["systems"]
    v = system["results"]["vision"]
    assert v["errors"] == 0 and v["warmup_errors"] == [] and v["video_transport"] == "data"
    assert v["turn3_cached_tokens"] > 0 and v["turn1_ttft_s"] > 0 and v["text_ttft_s"] > 0
    assert v["video"][0]["errors"] == 0 and v["video"][0]["cached_cached_tokens"] > 0
    assert v["vision_cache"]["hits"] > 0
    assert "Vision: one 256x256 picture" in capsys.readouterr().out


# ------------------------------------------------------------ random models

def test_every_shape_has_its_table_parameter_count(embedded_model_dir):
    for like in random_model.SHAPES:
        config = random_model.build_config(like, "bfloat16", embedded_model_dir, 0)
        model = random_model.build_model(config)  # MLX arrays are lazy: nothing is allocated here
        assert random_model.count_parameters(model) == random_model.SHAPES[like]["params"], like


def test_random_model_loads_and_generates_varied_tokens(tmp_path, embedded_model_dir):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    out = tmp_path / "tiny"
    info = random_model.write_random_model("tiny-llama", out, dtype="bfloat16", seed=1,
                                           tokenizer_dir=embedded_model_dir)
    shape = random_model.SHAPES["tiny-llama"]
    assert info["params"] == shape["params"] and info["weight_bytes"] == 2 * shape["params"]
    config = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[key] == shape[key]
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    model, tokenizer = load(str(out))
    assert random_model.count_parameters(model) == shape["params"]
    assert needs_float32_copy(out)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True)
    tokens = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, sampler=lambda x: mx.argmax(x, -1)),
                                          range(24))]
    assert len(set(tokens)) >= 8, tokens
    assert max(tokens) < random_model.tokenizer_size(embedded_model_dir)



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS comes from /proc")
def test_shared_memory_counts_once_in_pss_twice_in_rss():
    """A 64 MiB shared-memory segment touched by this process and a child:
    the summed RSS counts it twice, the summed PSS once (the arena case)."""
    import multiprocessing as mp
    from multiprocessing import shared_memory

    size = 64 << 20
    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        shm.buf[:] = b"\x01" * size
        ctx = mp.get_context("spawn")
        ready, done = ctx.Event(), ctx.Event()
        child = ctx.Process(target=_touch_shared, args=(shm.name, size, ready, done))
        child.start()
        try:
            assert ready.wait(30)
            mem = ProcessTreeMemory(os.getpid())
            mem.sample()
            assert mem.peak_total_pss > size  # the segment is in there once...
            assert mem.peak_total - mem.peak_total_pss > 0.75 * size  # ...and RSS has it twice
        finally:
            done.set()
            child.join(10)
    finally:
        shm.close()
        shm.unlink()


def _touch_shared(name, size, ready, done):
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=name)
    total = sum(shm.buf[i] for i in range(0, size, 4096))  # read every page
    assert total == size // 4096
    ready.set()
    done.wait(30)
    shm.close()
