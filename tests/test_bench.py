"""`tandem bench` and `tandem random-model`: statistics against a scripted server, report, random models.

The scripted server streams a fixed answer with known delays (first token
after FIRST_S, then one every GAP_S), so the load generator's numbers can be
checked against what they must be; other routes answer 429, 500, or never.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks import bench_cmd, loadgen, report, workloads
from benchmarks.loadgen import RequestResult, percentile, summarize
from tests.server_harness import free_port

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

    async def chat(self, request: Request) -> Response:
        mode = request.path_params["mode"]
        await request.json()
        self.calls += 1
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


@pytest.fixture(scope="module")
def scripted():
    """Base URL of the scripted server; a mode is the first path segment."""
    s = Scripted()
    app = Starlette(routes=[Route("/{mode}/v1/chat/completions", s.chat, methods=["POST"]),
                            Route("/{mode}/v1/models", s.models), Route("/{mode}/metrics", s.metrics)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}", s
    server.should_exit = True
    thread.join(timeout=5)


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

def test_prompts_are_seeded_and_distinct():
    a = workloads.user_prompt(0, "client0", 50)
    assert a == workloads.user_prompt(0, "client0", 50)
    assert a != workloads.user_prompt(0, "client1", 50) and a != workloads.user_prompt(1, "client0", 50)
    assert len(workloads.words(850, 0, "s").split()) == 850


def test_gaps_during_long_prompts():
    stream = _fake(0.1, [0.1, 2.0, 0.1])  # chunks at 0.1, 0.2, 2.2, 2.3 s
    stream.sent_at = 100.0
    long = RequestResult(status=200, ok=True, sent_at=100.5, latency=1.0)  # in flight 100.5 .. 101.5
    assert workloads.gaps_during([stream], [long]) == [pytest.approx(2.0)]
    assert workloads.gaps_during([stream], []) == []


def test_metric_sum():
    text = ('x_total 5\ntandem_prompt_tokens_total 100.0\ntandem_prompt_tokens_total_other 7\n'
            'foo{a="1"} 2\nfoo{a="2"} 3\n')
    assert workloads.metric_sum(text, "tandem_prompt_tokens_total") == 100.0
    assert workloads.metric_sum(text, "foo") == 5.0
    assert workloads.metric_sum(text, "missing") is None


# ------------------------------------------------------------ the command and its report

def test_bench_command_json_report(scripted, tmp_path, capsys):
    base, _ = scripted
    p = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    out = tmp_path / "r.json"
    args = p.parse_args(["--url", base + "/ok", "--name", "scripted", "--workload", "all", "--concurrency", "1,2",
                         "--requests-per-level", "4", "--warmup", "1", "--streams", "2", "--long-prompts", "1",
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
        assert lv["ok"] == 4 and lv["output_tokens"] == 16
    loud = res["interference"]["loud"]
    assert res["interference"]["quiet"]["ok"] == 2 and loud["long_prompts_sent"] == 1
    assert loud["gaps_during_long"] > 0 and loud["itl_p99_during_long_s"] < 1.0
    assert res["prefix"]["warm_cached_tokens"] == 3 and res["prefix"]["cold_ttft_s"] > 0
    assert res["swarm"]["turns_ok"] == 4 and res["swarm"]["computed_prompt_tokens"] == 4 * (10 - 3)
    assert res["swarm"]["metrics_computed_prompt_tokens"] == 4 * (10 - 3)
    single = res["single_stream"]  # no --model: tokens/s without a bandwidth share
    assert single["decode_tok_s"] == pytest.approx(1 / GAP_S, rel=0.3) and single["bandwidth_share"] is None
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
    text = report.render(rep)
    assert "vllm-mlx: did not run: not installed" in text and "1.50x" in text
    msg = report.plot(rep, "/nonexistent-dir-for-test/x.png") if not _has_matplotlib() else None
    assert msg is None or "matplotlib" in msg


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------ random models

def test_every_shape_has_its_table_parameter_count(embedded_model_dir):
    from benchmarks import random_model

    for like in random_model.SHAPES:
        config = random_model.build_config(like, "bfloat16", embedded_model_dir, 0)
        model = random_model.build_model(config)  # MLX arrays are lazy: nothing is allocated here
        assert random_model.count_parameters(model) == random_model.SHAPES[like]["params"], like


def test_random_model_loads_and_generates_varied_tokens(tmp_path, embedded_model_dir):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from benchmarks import random_model
    from benchmarks.peer_weights import needs_float32_copy

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
