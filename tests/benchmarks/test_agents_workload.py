"""`tandem bench --workload agents` against a scripted server (no model): the
tool loops it drives, the calls it counts as parsed and valid, the prompt
tokens it adds up, its table and ratios; and the messages it sends back
accepted by Tandem's own router (tests/support/fake_engine.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from benchmarks.bench import bench_cmd
from benchmarks.bench.reporting import report
from benchmarks.bench.workloads import agents as aw
from benchmarks.bench.workloads.core import Target, WorkloadConfig
from environment.settings import Settings
from tests.support.fake_engine import FakeEngine, build_tokenizer
from tests.support.router_server import ServerThread, serve_app

VALID = {"search_docs": {"query": "double charge", "section": "faq"},
         "get_weather": {"city": "Lisbon", "unit": "celsius", "days": 2},
         "create_ticket": {"title": "Invoices charged twice", "priority": "high", "labels": ["billing"],
                           "assignee": {"team": "billing"}},
         "schedule_meeting": {"topic": "Review", "attendees": ["ana"], "start": "2026-01-05T10:00"}}
# What a "mixed" server answers at each "required" step: the kinds of calls a peer returns.
MIXED = ("valid", "bad-enum", "not-json", "unknown-tool", "text")


def _cfg(**kw) -> WorkloadConfig:
    return WorkloadConfig(**{"agents": 3, "turns": 4, "system_prompt_words": 40, "max_tokens": 16,
                             "timeout_s": 10.0, **kw})


class ScriptedAgents:
    """Answers each step of a tool loop by a script (the mode: the first path
    segment). Step = assistant messages so far; agent = the task's number.
    Usage: prompt tokens are words (the tools' JSON once), cached tokens the
    longest word prefix shared with an earlier prompt, as a prefix cache."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.prompts: list[list[str]] = []
        self.seen_429: set[int] = set()
        self.prompt_total = self.cached_total = 0

    async def chat(self, request: Request) -> Response:
        mode, body = request.path_params["mode"], await request.json()
        agent = int(body["messages"][1]["content"].split()[1].rstrip("."))
        if mode == "busy" and agent not in self.seen_429:
            self.seen_429.add(agent)
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429, headers={"Retry-After": "0"})
        self.bodies.append(body)
        step = sum(m["role"] == "assistant" for m in body["messages"])
        message = self._answer(mode, step, body["tool_choice"])
        units = json.dumps(body["tools"]).split()
        for m in body["messages"]:
            units += [f"<{m['role']}>", *(m.get("content") or "").split(), *json.dumps(m.get("tool_calls")).split()]
        cached = max((_common(units, p) for p in self.prompts), default=0)
        self.prompts.append(units)
        self.prompt_total += len(units)
        self.cached_total += cached
        return JSONResponse({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if "tool_calls" in message else "stop"}],
            "usage": {"prompt_tokens": len(units), "completion_tokens": 5, "total_tokens": len(units) + 5,
                      "prompt_tokens_details": {"cached_tokens": cached}}})

    @staticmethod
    def _answer(mode: str, step: int, choice: str) -> dict:
        kind = "text" if choice == "auto" else MIXED[step % len(MIXED)] if mode == "mixed" else "valid"
        if kind == "text":
            return {"role": "assistant", "content": "Done: all booked."}
        name = list(VALID)[step % len(VALID)]
        args = json.dumps(VALID[name])
        if kind == "bad-enum":
            name, args = "get_weather", json.dumps({"city": "Oslo", "unit": "kelvin"})
        elif kind == "not-json":
            args = "{city: Oslo"
        elif kind == "unknown-tool":
            name = "send_email"
        return {"role": "assistant", "content": None,
                "tool_calls": [{"id": f"call_{step}", "type": "function", "function": {"name": name, "arguments": args}}]}

    async def metrics(self, request: Request) -> Response:
        return Response(f"tandem_prompt_tokens_total {self.prompt_total}\n"
                        f"tandem_prefix_cache_hit_tokens_total {self.cached_total}\n", media_type="text/plain")


def _common(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def scripted():
    s = ScriptedAgents()
    app = Starlette(routes=[Route("/{mode}/v1/chat/completions", s.chat, methods=["POST"]),
                            Route("/{mode}/metrics", s.metrics)])
    with ServerThread(app, Settings()) as server:
        yield server.url, s


def _run(base: str, mode: str, cfg: WorkloadConfig, metrics: bool = False) -> dict:
    target = Target(mode, f"{base}/{mode}", "m")
    return asyncio.run(aw.agents(target, cfg, f"{base}/{mode}/metrics" if metrics else None))


def _bodies_of(server: ScriptedAgents, agent: int) -> list[dict]:
    return [b for b in server.bodies if b["messages"][1]["content"].startswith(f"Agent {agent}.")]


def test_tool_loops_with_valid_calls(scripted):
    base, server = scripted
    server.bodies.clear()
    out = _run(base, "constrained", _cfg(), metrics=True)
    assert (out["turns_ok"], out["turns_failed"], out["turns_not_sent"], out["rejected_429"]) == (12, 0, 0, 0)
    assert (out["calls_expected"], out["calls_parsed"], out["calls_valid"], out["calls_returned"]) == (9, 9, 9, 9)
    assert out["valid_share"] == 1.0 and (out["final_answers"], out["final_calls"]) == (3, 0)
    assert out["call_problems"] == [] and out["turns_s"] == pytest.approx(12 / out["wall_s"])
    # One shared system prompt and the same tools on every request; "required" until the last step.
    assert len({b["messages"][0]["content"] for b in server.bodies}) == 1
    assert all(b["tools"] == aw.TOOLS and b["parallel_tool_calls"] is False for b in server.bodies)
    bodies = _bodies_of(server, 1)
    assert [b["tool_choice"] for b in bodies] == ["required"] * 3 + ["auto"]
    assert [b["max_tokens"] for b in bodies] == [aw.CALL_MAX_TOKENS] * 3 + [16]
    # The history: each call as returned, then its result under the call's id.
    last = bodies[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user"] + ["assistant", "tool"] * 3
    for step in range(3):
        call, result = last[2 + 2 * step], last[3 + 2 * step]
        name = list(VALID)[step % len(VALID)]
        assert call["tool_calls"][0]["id"] == result["tool_call_id"] == f"call_{step}"
        assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == VALID[name]
        assert result["content"] == aw.tool_result(0, 1, step, name, True)
    # Tokens: prompt less cached from usage, and the server's own count agrees.
    assert out["prompt_tokens"] == server.prompt_total and out["cached_tokens"] == server.cached_total > 0
    assert out["computed_prompt_tokens"] == out["prompt_tokens"] - out["cached_tokens"]
    assert out["metrics_computed_prompt_tokens"] == out["computed_prompt_tokens"]
    assert len(out["per_turn"]) == 12 and out["per_turn"][3]["tool_choice"] == "auto"


def test_calls_that_do_not_parse_or_validate_are_counted_and_the_loop_goes_on(scripted):
    base, server = scripted
    server.bodies.clear()
    out = _run(base, "mixed", _cfg(agents=2, turns=6))
    assert out["turns_ok"] == 12 and out["turns_failed"] == 0
    # Per agent, the five "required" steps answer: valid, bad enum, not JSON, unknown tool, text.
    assert out["calls_expected"] == 10 and out["calls_returned"] == 8
    assert out["calls_parsed"] == 6  # arguments that are a JSON object: valid, bad enum, unknown tool
    assert out["calls_valid"] == 2 and out["valid_share"] == pytest.approx(0.2)
    problems = " ".join(out["call_problems"])
    assert "'kelvin' is not one of" in problems and "not JSON" in problems and "send_email" in problems
    last = _bodies_of(server, 0)[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                         "assistant", "user", "assistant", "tool", "assistant", "user"]
    assert "error" in json.loads(last[5]["content"])  # the bad-enum call's result says so
    assert last[6] == {"role": "assistant", "content": ""} and last[7]["content"] == aw.NUDGE  # not JSON
    assert last[10]["content"] == "Done: all booked."  # text: kept as content, then the nudge


def test_429_is_retried(scripted):
    base, _ = scripted
    out = _run(base, "busy", _cfg(agents=2, turns=2))
    assert out["rejected_429"] == 2 and out["turns_ok"] == 4 and out["calls_valid"] == 2


def test_table_ratios_and_options(scripted):
    base, _ = scripted
    tandem, peer = _run(base, "constrained", _cfg()), _run(base, "mixed", _cfg(turns=6))
    rep = report.build_report([{"name": "tandem", "error": None, "results": {"agents": tandem}},
                               {"name": "mlx_lm", "error": None, "results": {"agents": peer}}], {}, "tandem bench")
    (r,) = rep["ratios"]
    assert r["agents_turns_s"] == pytest.approx(tandem["turns_s"] / peer["turns_s"])
    assert r["agents_computed_prompt_tokens"] == pytest.approx(
        tandem["computed_prompt_tokens"] / peer["computed_prompt_tokens"])
    text = report.render(rep)
    assert "Agents: tool loops" in text and "9 / 9 / 9 (100%)" in text and "15 / 9 / 3 (20%)" in text
    assert "agents turns/s" in text and "'kelvin' is not one of" in text
    json.dumps(rep)

    p = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    assert p.parse_args(["--workload", "agents", "--agents", "8", "--turns", "4"]).workload == ("agents",)
    assert "agents" not in p.parse_args(["--workload", "all"]).workload


def test_the_loop_goes_through_tandems_router(tmp_path):
    """The bodies the workload sends, calls and results included, are ones
    Tandem's router takes (it refuses any field it does not honour)."""
    tokenizer = build_tokenizer(Path(tmp_path))
    engine = FakeEngine(tokenizer, max_context=16384)
    call = {"name": "get_weather", "arguments": VALID["get_weather"]}
    engine.say(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    with serve_app(engine, tokenizer, request_timeout_s=30) as server:
        out = asyncio.run(aw.agents(Target("tandem", server.url, engine.model_id), _cfg(agents=2, turns=3)))
    assert out["turns_ok"] == 6, out["first_error"]
    assert (out["calls_expected"], out["calls_valid"]) == (4, 4)
    assert out["final_answers"] == 2  # the last step's 16 tokens cut the call short: text
    prompts = [tokenizer.decode(r.prompt_tokens) for r in engine.requests]
    for agent in range(2):  # the last step's prompt holds both calls and their results
        last = next(p for p in reversed(prompts) if f"Agent {agent}." in p)
        assert last.count('"Lisbon"') == 2 and aw.tool_result(0, agent, 1, "get_weather", True) in last
    assert all(r.sampling.grammar for r in engine.requests if r.sampling.max_tokens == aw.CALL_MAX_TOKENS)
