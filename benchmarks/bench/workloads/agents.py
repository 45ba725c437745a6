"""The agents workload: `agents` tool loops at once over one shared system
prompt and one set of tools, as a swarm of agents drives an endpoint.

Each agent runs `turns` steps, one chat request each with its whole history
and the same `tools`. Every step but the last asks for a call (tool_choice
"required": Tandem constrains decoding to a call whose arguments validate;
a peer may ignore it), the last lets the model answer ("auto", which keeps
the tools in the prompt, so the shared prefix stays shared). After a call
the agent appends the assistant message as the API returned it and a `tool`
message with a deterministic result; after a step with no usable call (text
from a peer, arguments that are not JSON) it appends the text and a short
nudge, so every system serves the same number of steps.

Requests are not streamed: an agent needs the whole message before its next
step, the non-streamed message is exactly what an agent framework appends
back (calls with their ids), servers stream calls differently (mlx_lm.server
sends them as one block at the end), and usage always comes in the body.
Time to first token is not what this workload measures: turns per second,
computed prompt tokens and the share of calls that parse and validate are.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from benchmarks.bench.workloads.core import (Target, WorkloadConfig, prompt_token_counts, scrape_prompt_counters,
                                             system_prompt, words)
from benchmarks.bench.workloads.loadgen import Progress, RequestResult, percentile

# A call must fit: the longest the schemas below allow is about 150 tokens
# (each string at its maxLength, one token a character), typical ones 30-60.
CALL_MAX_TOKENS = 192
NUDGE = "That was not a tool call. Call exactly one of the tools now."
RETRIES_429 = 5


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


# Real schemas: required properties, types, enums, bounds, a pattern, a
# nested object and arrays. Strings are bounded so that a call fits in
# CALL_MAX_TOKENS whatever the model writes.
TOOLS = [
    _fn("search_docs", "Search the product documentation and return the best matching passages.", {
        "query": {"type": "string", "minLength": 1, "maxLength": 40},
        "section": {"type": "string", "enum": ["api", "guides", "faq", "changelog"]},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
    }, ["query", "section"]),
    _fn("get_weather", "The weather forecast for a city.", {
        "city": {"type": "string", "minLength": 1, "maxLength": 32},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    }, ["city", "unit"]),
    _fn("create_ticket", "Open a support ticket and assign it to a team.", {
        "title": {"type": "string", "minLength": 1, "maxLength": 48},
        "priority": {"type": "string", "enum": ["low", "medium", "high", "urgent"]},
        "labels": {"type": "array", "items": {"type": "string", "enum": ["bug", "feature", "docs", "billing"]},
                   "maxItems": 3},
        "assignee": {"type": "object", "properties": {
            "team": {"type": "string", "enum": ["support", "platform", "billing"]},
            "user": {"type": "string", "maxLength": 24}},
            "required": ["team"], "additionalProperties": False},
    }, ["title", "priority", "assignee"]),
    _fn("schedule_meeting", "Put a meeting in the shared calendar.", {
        "topic": {"type": "string", "minLength": 1, "maxLength": 40},
        "attendees": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 16},
                      "minItems": 1, "maxItems": 3},
        "start": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}$"},
        "duration_minutes": {"type": "integer", "minimum": 15, "maximum": 120},
    }, ["topic", "attendees", "start"]),
]

TASKS = (
    "A customer in Lisbon reports that invoices are charged twice. Find what the docs say about billing, "
    "check the weather for the on-site visit, open a ticket for the billing team and book a review meeting.",
    "Plan a release review: search the changelog, book a meeting with the platform team, open a ticket for "
    "the missing docs and check the weather in Oslo for the offsite.",
    "A user cannot log in through the API. Search the api docs, open an urgent ticket for support, check the "
    "weather in Austin where the user is, and schedule a call with them.",
    "Prepare the support rota: search the faq for escalation rules, schedule a meeting with support, check "
    "the weather in Dublin for the week and open a low priority ticket to update the rota page.",
)


def agent_task(seed: int, agent: int) -> str:
    return (f"Agent {agent}. {TASKS[agent % len(TASKS)]} Work one tool call at a time, then give a short "
            f"final answer. Case notes: {words(30, seed, f'agents-task{agent}')}")


def tool_result(seed: int, agent: int, step: int, name: str, valid: bool) -> str:
    """What the tool answers: a pure function of the step, the same for every system."""
    if not valid:
        return json.dumps({"error": f"the arguments do not match the schema of {name}"})
    return json.dumps({"tool": name, "status": "ok", "result": words(16, seed, f"agents-result{agent}-{step}-{name}")})


# ---------------------------------------------------------------- checking calls

class CallChecker:
    """Checks returned calls against TOOLS: the name is a tool, the
    arguments are a JSON object, and they validate against its schema."""

    def __init__(self, tools: list[dict] = TOOLS):
        try:
            from jsonschema import Draft202012Validator
        except ImportError:
            raise RuntimeError("the agents workload validates calls with jsonschema: "
                               "pip install 'tandem[bench]' (or jsonschema)") from None
        self.validators = {t["function"]["name"]: Draft202012Validator(t["function"]["parameters"]) for t in tools}

    def problem(self, call: dict) -> tuple[bool, str | None]:
        """(parsed, problem): parsed when the arguments are a JSON object
        (an agent can run it); problem None when the call is valid."""
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return False, "no function"
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            return False, f"arguments are not JSON: {str(fn.get('arguments'))[:60]!r}"
        if not isinstance(args, dict):
            return False, "arguments are not a JSON object"
        name = fn.get("name")
        validator = self.validators.get(name) if isinstance(name, str) else None
        if validator is None:
            return True, f"unknown tool {name!r}"
        error = next(iter(validator.iter_errors(args)), None)
        return True, None if error is None else f"{name}: {error.message[:100]}"


@dataclass
class StepVerdict:
    calls: int = 0  # calls the message carries
    parsed: bool = False  # at least one call, and every call's arguments a JSON object
    valid: bool = False  # parsed, and every call names a tool and validates
    problems: tuple[str, ...] = ()


def judge(message: dict | None, checker: CallChecker) -> StepVerdict:
    calls = (message or {}).get("tool_calls") or []
    if not calls:
        return StepVerdict()
    checked = [checker.problem(c) for c in calls]
    parsed = all(p for p, _ in checked)
    problems = tuple(why for _, why in checked if why)
    return StepVerdict(len(calls), parsed, parsed and not problems, problems)


# ---------------------------------------------------------------- one request

async def post_chat(client: httpx.AsyncClient, target: Target, body: dict,
                    timeout: float) -> tuple[RequestResult, dict | None]:
    """POST a non-streamed /v1/chat/completions: (the result with usage, the message)."""
    t0 = time.perf_counter()
    res, message = RequestResult(status=0, sent_at=t0), None
    try:
        async with asyncio.timeout(timeout):
            r = await client.post(target.base_url.rstrip("/") + "/v1/chat/completions", json=body,
                                  headers=target.headers, timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)))
        res.status = r.status_code
        if r.status_code != 200:
            res.error = r.text[:300]
            res.retry_after = _seconds(r.headers.get("retry-after"))
        else:
            message = _read_answer(r, res)
    except TimeoutError:
        res.status, res.error = "timeout", f"no answer within {timeout:g}s"
    except httpx.ConnectError as e:
        res.status, res.error = "connect", str(e) or "connection refused"
    except httpx.HTTPError as e:
        res.status, res.error = "stream-error", f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - t0
    res.ok = res.status == 200 and not res.error
    return res, message


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _read_answer(r: httpx.Response, res: RequestResult) -> dict | None:
    try:
        data = r.json()
        message = data["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        res.status, res.error = "protocol", f"not a chat completion: {r.text[:80]!r}"
        return None
    usage = data.get("usage") or {}
    res.output_tokens = int(usage.get("completion_tokens") or 0)
    res.prompt_tokens = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    res.cached_tokens = int(cached) if cached is not None else None
    res.text = message.get("content") or ""
    return message


def request_body(model: str, history: list[dict], final: bool, cfg: WorkloadConfig) -> dict:
    return {"model": model, "messages": history, "tools": TOOLS, "tool_choice": "auto" if final else "required",
            "parallel_tool_calls": False, "temperature": 0.0,
            "max_tokens": cfg.max_tokens if final else max(cfg.max_tokens, CALL_MAX_TOKENS)}


# ---------------------------------------------------------------- the workload

@dataclass
class Tally:
    rejected_429: int = 0
    calls_expected: int = 0  # steps that asked for a call ("required") and were answered
    calls_parsed: int = 0
    calls_valid: int = 0
    calls_returned: int = 0  # calls in those answers (more than one where a server ignores parallel_tool_calls)
    final_answers: int = 0  # last steps answered with text
    final_calls: int = 0  # last steps answered with a call instead


async def agents(target: Target, cfg: WorkloadConfig, metrics_url: str | None = None) -> dict:
    """`agents` concurrent tool loops of `turns` steps each (see the module
    docstring). A 429 is retried after Retry-After (at most 5 times);
    another failure ends that agent, as in the swarm workload."""
    checker = CallChecker()
    system = system_prompt(cfg.seed, "agents", cfg.system_prompt_words)
    before = await scrape_prompt_counters(metrics_url)
    progress = Progress(f"{target.name} agents", cfg.agents * cfg.turns)
    results: list[RequestResult] = []
    per_turn: list[dict] = []
    problems: list[str] = []
    tally = Tally()

    async def agent(k: int, client: httpx.AsyncClient) -> None:
        history = [{"role": "system", "content": system}, {"role": "user", "content": agent_task(cfg.seed, k)}]
        for t in range(cfg.turns):
            final = t == cfg.turns - 1
            r, message = await _send_retrying(client, target, request_body(target.model, history, final, cfg),
                                              cfg.timeout_s, tally)
            results.append(r)
            progress.update(r)
            verdict = judge(message, checker) if r.ok else StepVerdict()
            _count(tally, verdict, r.ok, final)
            problems.extend(f"agent {k} step {t}: {p}" for p in verdict.problems)
            per_turn.append({"agent": k, "turn": t, "status": r.status, "tool_choice": "auto" if final else "required",
                             "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                             "output_tokens": r.output_tokens, "latency_s": r.latency, "sent_s": r.sent_at - t0,
                             "calls": verdict.calls, "parsed": verdict.parsed, "valid": verdict.valid})
            if not r.ok:
                return
            if not final:
                history += _next_messages(cfg.seed, k, t, message, verdict, checker)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=cfg.agents + 8), timeout=None) as client:
        await asyncio.gather(*(agent(k, client) for k in range(cfg.agents)))
    wall = time.perf_counter() - t0
    progress.close()
    after = await scrape_prompt_counters(metrics_url)
    return _summary(cfg, results, wall, tally, problems, per_turn, before, after)


async def _send_retrying(client, target: Target, body: dict, timeout: float,
                         tally: Tally) -> tuple[RequestResult, dict | None]:
    r, message = await post_chat(client, target, body, timeout)
    for _ in range(RETRIES_429):
        if r.status != 429:
            break
        tally.rejected_429 += 1
        await asyncio.sleep(min(5.0, r.retry_after if r.retry_after is not None else 0.5))
        r, message = await post_chat(client, target, body, timeout)
    return r, message


def _count(tally: Tally, verdict: StepVerdict, ok: bool, final: bool) -> None:
    if not ok:
        return
    if final:
        tally.final_calls += verdict.calls > 0
        tally.final_answers += verdict.calls == 0
        return
    tally.calls_expected += 1
    tally.calls_parsed += verdict.parsed
    tally.calls_valid += verdict.valid
    tally.calls_returned += verdict.calls


def _next_messages(seed: int, agent: int, step: int, message: dict, verdict: StepVerdict,
                   checker: CallChecker) -> list[dict]:
    """What the agent appends after a step: the calls as returned and each
    one's result, or (no usable call) the text and a nudge."""
    if not verdict.parsed:
        return [{"role": "assistant", "content": message.get("content") or ""}, {"role": "user", "content": NUDGE}]
    calls = message["tool_calls"]
    out = [{"role": "assistant", "content": message.get("content"), "tool_calls": calls}]
    for i, call in enumerate(calls):
        call.setdefault("id", f"call_{agent}_{step}_{i}")  # a server that gives none: the result still points at it
        out.append({"role": "tool", "tool_call_id": call["id"],
                    "content": tool_result(seed, agent, step, call["function"]["name"], not checker.problem(call)[1])})
    return out


def _summary(cfg: WorkloadConfig, results: list[RequestResult], wall: float, tally: Tally, problems: list[str],
             per_turn: list[dict], before, after) -> dict:
    ok = [r for r in results if r.ok]
    expected = tally.calls_expected
    return {
        "agents": cfg.agents, "turns": cfg.turns, "tools": len(TOOLS), "wall_s": wall,
        "turns_ok": len(ok), "turns_failed": len(results) - len(ok),
        "turns_not_sent": cfg.agents * cfg.turns - len(results), "rejected_429": tally.rejected_429,
        "turns_s": len(ok) / wall if wall > 0 else 0.0,
        "first_error": next((f"{r.status}: {r.error}" for r in results if not r.ok), None),
        "output_tokens": sum(r.output_tokens for r in ok),
        "latency_p50_s": percentile([r.latency for r in ok], 50),
        "latency_p99_s": percentile([r.latency for r in ok], 99),
        **prompt_token_counts(ok, before, after),
        "calls_expected": expected, "calls_parsed": tally.calls_parsed, "calls_valid": tally.calls_valid,
        "calls_returned": tally.calls_returned,
        "parsed_share": tally.calls_parsed / expected if expected else None,
        "valid_share": tally.calls_valid / expected if expected else None,
        "final_answers": tally.final_answers, "final_calls": tally.final_calls,
        "call_problems": problems[:20],
        "per_turn": sorted(per_turn, key=lambda row: (row["agent"], row["turn"])),
    }
