"""The fairness workload: short prompts' time to first token while a long
prompt is being prefilled, against the same short prompts alone, and the long
prompt's own, alone and with the short ones beside it (issue 42: a short
prompt should wait for about one chunk of a long prompt's prefill, not for
all of it, and the long prompt should lose little).

    tandem bench --systems tandem,tandem-colocate --workload fairness --long-prompt-words 2000

In order, each prompt new (nothing cached):
0. a warm-up: a long prompt and a short one, not counted. MLX's CUDA backend
   prepares its kernels for each new shape (~1 s for a long prompt's chunks
   the first time), so without it "alone" was cold as often as not. Before
   each long prompt the server is left quiet for about a long prompt's time
   (its predecessor's KV is still being stored);
1. `SHORTS` short prompts alone, one after the other;
2. a long prompt (`--long-prompt-words`) alone;
3. another long prompt and, once it has been in flight for a tenth of the
   long one's time alone (its prefill under way), one short prompt: issue
   42's case (the short within 2x of alone, the long within 1.2x);
4. another long prompt and, after the same delay, short prompts one after
   the other until its first token (a client's closed loop: each short costs
   the worker about its own time alone, so a stream of them is charged to the
   long prompt within its budget and waits past it). Those sent before the
   long prompt's first token count as "beside".
Every answer is one token long: time to first token is all that is measured.
"""

from __future__ import annotations

import asyncio

from benchmarks.bench.reporting.text_table import num, table, times
from benchmarks.bench.workloads.core import Target, WorkloadConfig, _client, _messages, send, user_prompt
from benchmarks.bench.workloads.loadgen import Progress, RequestResult, percentile

SHORTS = 3  # short prompts alone; beside the long one, as many as its prefill leaves time for (at most SHORTS_BESIDE)
SHORTS_BESIDE = 12
SHORT_WORDS = 8
SETTLE_MIN_S, SETTLE_MAX_S = 0.2, 5.0
MIN_DELAY_S = 0.05  # else a tenth of the long prompt's time alone (a warm 6k tokens: ~0.5 s on an H200)


async def fairness(target: Target, cfg: WorkloadConfig) -> dict:
    progress = Progress(f"{target.name} fairness", None)
    async with _client(4) as client:
        async def one(salt: str, n_words: int) -> RequestResult:
            r = await send(client, target, cfg, _messages(user_prompt(cfg.seed, f"fairness-{salt}", n_words)), 1)
            progress.update(r)
            return r

        warm = [await one("long-warm", cfg.long_prompt_words), await one("short-warm", SHORT_WORDS)]
        settle = _settle(warm[0])
        await asyncio.sleep(settle)
        alone = [await one(f"short-alone{i}", SHORT_WORDS) for i in range(SHORTS)]
        long_alone = await one("long-alone", cfg.long_prompt_words)
        delay, settle = max(MIN_DELAY_S, 0.1 * (long_alone.ttft or 0.0)), _settle(long_alone)
        await asyncio.sleep(settle)
        long_task = asyncio.create_task(one("long-one", cfg.long_prompt_words))
        await asyncio.sleep(delay)
        one_short = await one("short-one", SHORT_WORDS)
        long_one = await long_task
        await asyncio.sleep(settle)
        long_task = asyncio.create_task(one("long-beside", cfg.long_prompt_words))
        await asyncio.sleep(delay)
        beside = []
        while not long_task.done() and len(beside) < SHORTS_BESIDE:
            beside.append(await one(f"short-beside{len(beside)}", SHORT_WORDS))
        long_beside = await long_task
    progress.close()
    answered_at = long_beside.sent_at + (long_beside.ttft or long_beside.latency)
    during = [r for r in beside if r.ok and r.ttft is not None and r.sent_at + r.ttft < answered_at]
    short_alone = percentile([r.ttft for r in alone if r.ok and r.ttft is not None], 50)
    short_beside = [r.ttft for r in during]
    out = {
        "long_prompt_tokens": long_alone.prompt_tokens,
        "one_short_ttft_s": one_short.ttft,
        "one_short_ratio": _ratio(one_short.ttft, short_alone),
        "long_one_ttft_s": long_one.ttft,
        "long_one_ratio": _ratio(long_one.ttft, long_alone.ttft),
        "long_alone_ttft_s": long_alone.ttft,
        "long_beside_ttft_s": long_beside.ttft,
        "long_ratio": _ratio(long_beside.ttft, long_alone.ttft),
        "short_prompt_tokens": alone[0].prompt_tokens if alone else None,
        "short_alone_ttft_s": short_alone,
        "shorts_beside": len(during),
        "short_beside_ttft_s": short_beside,
        "short_beside_first_ttft_s": short_beside[0] if short_beside else None,
        "short_beside_max_ttft_s": max(short_beside) if short_beside else None,
        "short_ratio": _ratio(max(short_beside) if short_beside else None, short_alone),
        "delay_s": delay,
        "errors": sum(not r.ok for r in [*warm, *alone, long_alone, one_short, long_one, long_beside, *beside]),
    }
    if not during and beside and beside[0].ok:  # the first short one waited for the whole long prefill
        out["short_beside_first_ttft_s"] = beside[0].ttft
        out["short_ratio"] = _ratio(beside[0].ttft, short_alone)
    return out


def _settle(long: RequestResult) -> float:
    """How long to leave the server quiet before the next long prompt: after
    its answer, a long prompt's KV is still being stored (~100 ms for 6k tokens
    of an 8B model on an H200), which slowed the next long prompt's prefill
    (measured beside its shorts, never alone) by about as much."""
    return min(SETTLE_MAX_S, max(SETTLE_MIN_S, long.ttft or long.latency or 0.0))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fairness_table(systems: list[dict]) -> list[str]:
    """The report's table (benchmarks/bench/reporting/report.py render)."""
    rows = []
    for s in systems:
        f = s.get("results", {}).get("fairness")
        if f:
            rows.append([s["name"], num(f["long_prompt_tokens"], "{:.0f}"), num(f["long_alone_ttft_s"]),
                         num(f["short_alone_ttft_s"]), times(f.get("one_short_ratio")), times(f.get("long_one_ratio")),
                         num(f["long_beside_ttft_s"]), times(f["long_ratio"]),
                         num(f["short_beside_first_ttft_s"]), num(f["short_beside_max_ttft_s"]),
                         times(f["short_ratio"]), f["shorts_beside"], f["errors"]])
    if not rows:
        return []
    return ["Fairness: time to first token (s), one short prompt, then a stream of them, beside a long prompt's prefill\n" + table(
        ["system", "long prompt", "long alone", "short alone", "1 short: short/alone", "long/alone",
         "shorts: long beside", "beside/alone", "short beside 1st", "short beside max", "max/alone", "shorts beside", "errors"], rows)]
