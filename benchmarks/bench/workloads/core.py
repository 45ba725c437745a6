"""What `tandem bench` sends: seeded prompts and the workloads.

- sweep: closed-loop clients at each concurrency level (prompts that invite a long story).
- copy: the same levels, copy-heavy requests in rotation: edit a given text, extract
  fields to JSON, echo a tool call's arguments; what speculative prompt lookup speeds
  up (benchmarks/bench/workloads/copy_heavy.py).
- chat: the same levels, short natural-language questions (benchmarks/bench/workloads/chat.py).
  Each level of these three also gets the draft tokens the server proposed and
  accepted, where its /metrics counts them (Tandem's speculative decoding).
- interference: decode streams' inter-token latency, quiet vs while long prompts arrive;
  also once every stream decodes (after its first decode token: the starts left out).
- prefix: one long system prompt, cold then warm time to first token.
- swarm: agents sharing a system prompt, each with its own growing history.
- agents: tool loops over one shared system prompt and tool set
  (benchmarks/bench/workloads/agents.py).
- vision: a conversation about one picture, and videos cold vs cached
  (benchmarks/bench/workloads/vision.py; needs a VLM).

Every prompt is a pure function of (seed, salt): the same for every system in a
run and across runs, and distinct per client, request, level and workload, so
no workload warms another's cache by accident.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from benchmarks.bench.workloads.loadgen import (Progress, RequestResult, chat_body, closed_loop, percentile,
                                                stream_chat, summarize)
from benchmarks.bench.workloads.stream_gaps import (arrivals, gaps_after_first_tokens, gaps_after_join, gaps_during,
                                                    last_first_token, last_join)

# Common English words: most are one token in BPE vocabularies, so N words ~ N tokens.
_WORDS = """time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point home water
room mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute idea kid
body information back parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river mountain garden window letter music
bridge market table forest island village ocean road train light field stone paper dream voice summer winter
morning evening spring autumn cloud storm fire wind rain snow star moon sun tree flower bird horse fish apple bread
""".split()


@dataclass
class Target:
    """A running OpenAI-compatible server."""

    name: str
    base_url: str
    model: str  # the "model" field requests carry
    headers: dict | None = None


@dataclass
class WorkloadConfig:
    seed: int = 0
    timeout_s: float = 120.0
    max_tokens: int = 64
    prompt_words: int = 100
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    requests_per_level: int | None = None  # default: 2 x concurrency, at least 8
    duration_s: float | None = None  # per level; overrides requests_per_level
    ttft_budget_s: float = 2.0
    itl_budget_s: float = 0.5
    warmup_rounds: int = 2
    # interference
    streams: int = 4
    stream_tokens: int = 128
    long_prompt_words: int = 2000
    long_prompts: int = 3
    # prefix
    system_prompt_words: int = 850
    prefix_repeats: int = 3
    # swarm
    agents: int = 32
    turns: int = 6
    # vision (benchmarks/bench/workloads/vision.py)
    image_size: int = 1024
    video_frames: tuple[int, ...] = (4, 8, 16, 32)
    video_size: int = 448
    vision_repeats: int = 3
    vision_max_tokens: int = 16


def words(n: int, seed: int, salt: str) -> str:
    rng = random.Random(f"{seed}:{salt}")
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def user_prompt(seed: int, salt: str, n_words: int) -> str:
    """A request that invites a long answer; the salt leads, so two prompts share no prefix."""
    return (f"[{salt}] Continue this list of words with a long story that uses all of them: "
            f"{words(n_words, seed, salt)}")


def system_prompt(seed: int, salt: str, n_words: int) -> str:
    return (f"You are agent system {salt}. Follow these house notes in every answer. "
            f"{words(n_words, seed, 'system:' + salt)}")


def _messages(prompt: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _client(concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    return httpx.AsyncClient(limits=limits, timeout=None)


async def send(client: httpx.AsyncClient, target: Target, cfg: WorkloadConfig, messages: list[dict],
               max_tokens: int) -> RequestResult:
    return await stream_chat(client, target.base_url, chat_body(target.model, messages, max_tokens),
                             cfg.timeout_s, target.headers)


# ---------------------------------------------------------------- warm-up

async def warm_up(target: Target, cfg: WorkloadConfig, ready_deadline: float) -> int:
    """The same warm-up for every system: one request retried until it
    succeeds (a server can answer /health before it can generate) or the
    deadline passes, then `warmup_rounds` rounds of min(4, max concurrency)
    concurrent short requests. Returns how many warm-up requests failed."""
    async with _client(8) as client:
        while True:
            r = await send(client, target, cfg, _messages(user_prompt(cfg.seed, "warmup-first", 20)), 8)
            if r.ok:
                break
            if time.monotonic() > ready_deadline:
                raise RuntimeError(f"{target.name}: warm-up request failed until the start deadline: "
                                   f"{r.status} {r.error}")
            await asyncio.sleep(1.0)
        width = min(4, max(cfg.concurrency))
        failed = 0
        for rnd in range(cfg.warmup_rounds):
            rs = await asyncio.gather(*(send(client, target, cfg, _messages(
                user_prompt(cfg.seed, f"warmup-{rnd}-{i}", 20)), 8) for i in range(width)))
            failed += sum(not r.ok for r in rs)
        return failed


# ---------------------------------------------------------------- sweep

def level_requests(cfg: WorkloadConfig, concurrency: int) -> int:
    return cfg.requests_per_level or max(8, 2 * concurrency)


MessagesFn = Callable[[int, int, int], list[dict]]  # (clients at the level, client, request) -> messages


async def sweep(target: Target, cfg: WorkloadConfig, energy=None, metrics_url: str | None = None) -> list[dict]:
    """Word-salad prompts that invite a long answer, at each concurrency level."""
    def messages(c: int, client_i: int, i: int) -> list[dict]:
        return _messages(user_prompt(cfg.seed, f"sweep-c{c}-client{client_i}-req{i}", cfg.prompt_words))

    return await closed_loop_levels(target, cfg, "sweep", messages, energy, metrics_url)


async def closed_loop_levels(target: Target, cfg: WorkloadConfig, label: str, messages: MessagesFn,
                             energy=None, metrics_url: str | None = None) -> list[dict]:
    """Each concurrency level in turn, closed loop, greedy answers of cfg.max_tokens (the sweep,
    copy and chat workloads). With `energy` (benchmarks/bench/energy_run.EnergyRun) each level
    also gets its joules and joules per output token; with `metrics_url`, the speculative
    tokens the server proposed and accepted during the level, where it counts them."""
    levels = []
    async with _client(max(cfg.concurrency)) as client:
        for c in cfg.concurrency:
            start = energy.mark() if energy else None
            spec_before = await scrape_spec_counters(metrics_url)
            n = None if cfg.duration_s else level_requests(cfg, c)
            progress = Progress(f"{target.name} {label} c={c}", n, cfg.duration_s)

            def one(client_i: int, i: int, c=c):
                return send(client, target, cfg, messages(c, client_i, i), cfg.max_tokens)

            results, wall = await closed_loop(one, c, requests=n, duration=cfg.duration_s, progress=progress)
            progress.close()
            levels.append({"concurrency": c, **summarize(results, wall, ttft_budget=cfg.ttft_budget_s,
                                                           itl_budget=cfg.itl_budget_s)})
            if spec_before:  # Tandem's workers report their counters with each heartbeat: let the last one in
                await asyncio.sleep(SPEC_SETTLE_S)
            spec = spec_acceptance(spec_before, await scrape_spec_counters(metrics_url))
            if spec:
                levels[-1]["spec"] = spec
            if energy:
                levels[-1]["energy"] = energy.level(start, levels[-1]["output_tokens"])
    return levels


# ---------------------------------------------------------------- interference

async def interference(target: Target, cfg: WorkloadConfig) -> dict:
    """`streams` decode streams alone, then the same number again while long
    prompts (one at a time, each new) arrive once every stream has its first
    token; inter-token latency p99 of the streams, quiet vs loud."""
    async with _client(cfg.streams + 2) as client:
        quiet = await _stream_run(client, target, cfg, "quiet", inject=False)
        loud = await _stream_run(client, target, cfg, "loud", inject=True)
    out = {"streams": cfg.streams, "stream_tokens": cfg.stream_tokens, "quiet": quiet, "loud": loud}
    # The streams arrive together. A server that starts each as soon as its own prompt is
    # prefilled (Tandem) gives first tokens sooner, and its streams' first gaps take the
    # later prompts' prefills and hand-offs: "after join" is the steady state that follows.
    q, noisy = quiet["itl_p99_s"], loud["itl_p99_s"]
    out["itl_p99_ratio"] = noisy / q if q and noisy else None
    d = loud.get("itl_p99_during_long_s")
    out["itl_p99_during_long_ratio"] = d / q if q and d else None
    return out


async def _stream_run(client, target: Target, cfg: WorkloadConfig, salt: str, inject: bool) -> dict:
    progress = Progress(f"{target.name} interference {salt}", cfg.streams + (cfg.long_prompts if inject else 0))
    t0 = time.perf_counter()
    started = [asyncio.Event() for _ in range(cfg.streams)]
    streams = []
    for i in range(cfg.streams):
        prompt = user_prompt(cfg.seed, f"interference-{salt}-stream{i}", cfg.prompt_words)
        body = chat_body(target.model, _messages(prompt), cfg.stream_tokens)
        streams.append(asyncio.create_task(
            stream_chat(client, target.base_url, body, cfg.timeout_s, target.headers, first_token=started[i])))
    longs = await _inject_long_prompts(client, target, cfg, streams, started, progress) if inject else []
    results = list(await asyncio.gather(*streams))
    for r in results:
        progress.update(r)
    progress.close()
    s = summarize(results, time.perf_counter() - t0, ttft_budget=cfg.ttft_budget_s, itl_budget=cfg.itl_budget_s)
    run = {k: s[k] for k in ("ok", "error_count", "errors", "output_tokens", "itl_p50_s", "itl_p99_s", "itl_max_s",
                              "ttft_p50_s", "wall_s", "first_error")}
    after = gaps_after_join(results)
    run["itl_p50_after_join_s"] = percentile(after, 50)
    run["itl_p99_after_join_s"] = percentile(after, 99)
    run["gaps_after_join"] = len(after)
    run["last_join_s"] = last_join(results, t0)
    run["itl_p99_after_first_tokens_s"] = percentile(gaps_after_first_tokens(results), 99)
    run["last_first_token_s"] = last_first_token(results, t0)
    # Each stream's text arrivals, seconds from the run's start: which gaps the tail is
    # made of (a stream's first or last, a join, a long prompt) can be read back.
    run["arrivals_s"] = arrivals(results, t0)
    run["started_unix"] = time.time() - (time.perf_counter() - t0)  # the start, to line up with server logs
    if inject:
        ok_longs = [r for r in longs if r.ok]
        during = gaps_during(results, longs)
        # The stalls long prompts cause are a few gaps per stream: pooled with
        # every other gap they can fall under p99, so also count those gaps alone.
        run["itl_p99_during_long_s"] = percentile(during, 99)
        run["gaps_during_long"] = len(during)
        run["long_prompts_sent"] = len(longs)
        run["long_prompts_ok"] = len(ok_longs)
        run["long_prompt_tokens"] = percentile([r.prompt_tokens for r in ok_longs if r.prompt_tokens], 50)
        run["long_prompt_ttft_p50_s"] = percentile([r.ttft for r in ok_longs if r.ttft is not None], 50)
    return run


async def _inject_long_prompts(client, target: Target, cfg: WorkloadConfig, streams: list[asyncio.Task],
                               started: list[asyncio.Event], progress: Progress) -> list[RequestResult]:
    """Once every stream decodes (first token seen, or already ended), send
    long prompts back to back, each new, while any stream is still running."""
    deadline = time.perf_counter() + cfg.timeout_s
    while time.perf_counter() < deadline and not all(e.is_set() or t.done() for e, t in zip(started, streams)):
        await asyncio.sleep(0.02)
    longs = []
    for j in range(cfg.long_prompts):
        if all(t.done() for t in streams):
            break
        prompt = user_prompt(cfg.seed, f"interference-long{j}", cfg.long_prompt_words)
        r = await send(client, target, cfg, _messages(prompt), 1)
        progress.update(r)
        longs.append(r)
    return longs


# ---------------------------------------------------------------- prefix

async def prefix(target: Target, cfg: WorkloadConfig) -> dict:
    """One conversation per repeat, each with its own ~850-token system prompt:
    cold (nothing cached), warm (same system prompt, new question), next turn
    (the warm exchange plus a new question: prompt + answer reusable), and the
    new question alone (what the warm request would cost with a perfect cache)."""
    runs = []
    progress = Progress(f"{target.name} prefix", cfg.prefix_repeats * 4)
    async with _client(2) as client:
        for rep in range(cfg.prefix_repeats):
            system = system_prompt(cfg.seed, f"prefix-{rep}", cfg.system_prompt_words)
            q = [user_prompt(cfg.seed, f"prefix-{rep}-q{k}", 20) for k in range(4)]
            cold = await send(client, target, cfg, _messages(q[0], system), 8)
            warm = await send(client, target, cfg, _messages(q[1], system), 8)
            turn = _messages(q[1], system) + [{"role": "assistant", "content": warm.text},
                                               {"role": "user", "content": q[2]}]
            next_turn = await send(client, target, cfg, turn, 8)
            alone = await send(client, target, cfg, _messages(q[3]), 8)
            for r in (cold, warm, next_turn, alone):
                progress.update(r)
            runs.append({"cold": _point(cold), "warm": _point(warm), "next_turn": _point(next_turn),
                         "suffix_alone": _point(alone)})
    progress.close()
    out = {"repeats": runs}
    for key in ("cold", "warm", "next_turn", "suffix_alone"):
        ttfts = [r[key]["ttft_s"] for r in runs if r[key]["ttft_s"] is not None]
        out[f"{key}_ttft_s"] = percentile(ttfts, 50)
        out[f"{key}_prompt_tokens"] = runs[0][key]["prompt_tokens"] if runs else None
        out[f"{key}_cached_tokens"] = runs[0][key]["cached_tokens"] if runs else None
    out["errors"] = sum(1 for r in runs for p in r.values() if not p["ok"])
    c, w = out["cold_ttft_s"], out["warm_ttft_s"]
    out["warm_speedup"] = c / w if c and w else None
    return out


def _point(r: RequestResult) -> dict:
    return {"ok": r.ok, "status": r.status, "ttft_s": r.ttft, "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "error": r.error or None}


# ---------------------------------------------------------------- swarm

async def swarm(target: Target, cfg: WorkloadConfig, metrics_url: str | None = None) -> dict:
    """`agents` concurrent agents, `turns` turns each: the shared system prompt,
    the agent's own history (its previous answers) and a new question. A 429
    is retried after Retry-After (at most 5 times); another failure ends the agent."""
    system = system_prompt(cfg.seed, "swarm", cfg.system_prompt_words)
    before = await scrape_prompt_counters(metrics_url)
    progress = Progress(f"{target.name} swarm", cfg.agents * cfg.turns)
    results: list[RequestResult] = []
    per_turn: list[dict] = []  # (agent, turn) rows, to see which turns computed what
    rejected = 0

    async def agent(k: int, client) -> None:
        nonlocal rejected
        history = [{"role": "system", "content": system}]
        for t in range(cfg.turns):
            history.append({"role": "user", "content": user_prompt(cfg.seed, f"swarm-agent{k}-turn{t}", 30)})
            for _ in range(6):
                r = await send(client, target, cfg, history, cfg.max_tokens)
                if r.status != 429:
                    break
                rejected += 1
                await asyncio.sleep(min(5.0, r.retry_after or 0.5))
            results.append(r)
            per_turn.append({"agent": k, "turn": t, "status": r.status, "prompt_tokens": r.prompt_tokens,
                             "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens,
                             "ttft_s": r.ttft, "latency_s": r.latency,
                             "sent_s": r.sent_at - t0})
            progress.update(r)
            if not r.ok:
                return
            history.append({"role": "assistant", "content": r.text})

    t0 = time.perf_counter()
    async with _client(cfg.agents) as client:
        await asyncio.gather(*(agent(k, client) for k in range(cfg.agents)))
    wall = time.perf_counter() - t0
    progress.close()
    after = await scrape_prompt_counters(metrics_url)
    ok = [r for r in results if r.ok]
    return {
        "agents": cfg.agents, "turns": cfg.turns, "wall_s": wall,
        "turns_ok": len(ok), "turns_failed": len(results) - len(ok), "rejected_429": rejected,
        "first_error": next((f"{r.status}: {r.error}" for r in results if not r.ok), None),
        "output_tokens": sum(r.output_tokens for r in ok),
        "ttft_p50_s": percentile([r.ttft for r in ok if r.ttft is not None], 50),
        "ttft_p99_s": percentile([r.ttft for r in ok if r.ttft is not None], 99),
        **prompt_token_counts(ok, before, after),
        "per_turn": sorted(per_turn, key=lambda row: (row["agent"], row["turn"])),
    }


def prompt_token_counts(ok: list[RequestResult], before: tuple[float, float] | None,
                        after: tuple[float, float] | None) -> dict:
    """Prompt, cached and computed prompt tokens of the successful requests
    (from usage: prompt tokens minus those the server says it reused), and
    the server's own count from two /metrics scrapes where it has them."""
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    out = {
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens for r in reported) if reported else None,
        "computed_prompt_tokens": prompt_tokens - sum(r.cached_tokens for r in reported) if reported else None,
        "computed_source": "usage.cached_tokens" if reported else "not reported",
    }
    if before and after:
        # The server's own count, which also sees requests that failed midway.
        out["metrics_computed_prompt_tokens"] = (after[0] - before[0]) - (after[1] - before[1])
        if out["computed_prompt_tokens"] is None:
            out["computed_prompt_tokens"] = out["metrics_computed_prompt_tokens"]
            out["computed_source"] = "/metrics"
    return out


async def scrape_counters(metrics_url: str | None, total: str, hits: str) -> tuple[float, float] | None:
    """(counter `total`, counter `hits`) from a Prometheus /metrics page, or
    None when there is no page (a peer) or no `total` counter on it."""
    if not metrics_url:
        return None
    try:
        async with httpx.AsyncClient(timeout=10.0) as c:
            r = await c.get(metrics_url)
        if r.status_code != 200:
            return None
    except httpx.HTTPError:
        return None
    return counters(r.text, total, hits)


def counters(text: str, total: str, hits: str) -> tuple[float, float] | None:
    """scrape_counters' pair from a /metrics page's text."""
    t = metric_sum(text, total)
    return (t, metric_sum(text, hits) or 0.0) if t is not None else None


async def scrape_prompt_counters(metrics_url: str | None) -> tuple[float, float] | None:
    """(tandem_prompt_tokens_total, tandem_prefix_cache_hit_tokens_total), or None."""
    return await scrape_counters(metrics_url, "tandem_prompt_tokens_total", "tandem_prefix_cache_hit_tokens_total")


SPEC_PROPOSED = "tandem_spec_proposed_tokens_total"
SPEC_SETTLE_S = 1.0  # two of Tandem's default heartbeats (environment/settings.py heartbeat_interval_s)
SPEC_ACCEPTED = "tandem_spec_accepted_tokens_total"


async def scrape_spec_counters(metrics_url: str | None) -> tuple[float, float] | None:
    """(draft tokens proposed, draft tokens accepted), every method summed, or None
    where the server counts none (a peer, or Tandem before speculation)."""
    return await scrape_counters(metrics_url, SPEC_PROPOSED, SPEC_ACCEPTED)


def spec_counters(text: str) -> tuple[float, float] | None:
    """scrape_spec_counters' pair from a /metrics page's text."""
    return counters(text, SPEC_PROPOSED, SPEC_ACCEPTED)


def spec_acceptance(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict | None:
    """Draft tokens proposed and accepted between two scrapes, and the share accepted
    (None when none was proposed); None when either scrape had no counters."""
    if not before or not after:
        return None
    proposed, accepted = after[0] - before[0], after[1] - before[1]
    return {"proposed_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed > 0 else None}


def metric_sum(text: str, name: str) -> float | None:
    """Sum of every sample of `name` (any labels) in Prometheus text format."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name):len(name) + 1] in (" ", "{")):
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                pass
    return total if seen else None
