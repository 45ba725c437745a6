"""Where the gaps of a few streams sent together fall: each stream's first
token and every inter-token gap above a threshold, against a running server.

`tandem bench --workload interference` reports percentiles; this shows which
gaps they come from (a stream's first decode gap while the next prompt is
prefilled, or a run of slow steps). Greedy, streamed, `--rounds` rounds of
`--streams` requests each, every prompt new:

    python benchmarks/probes/stream_timeline.py --port 8000 [--streams 4] [--tokens 64] [--model default]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.bench.loadgen import RequestResult, chat_body, percentile, stream_chat  # noqa: E402
from benchmarks.bench.workloads import user_prompt  # noqa: E402


def describe(i: int, r: RequestResult, t0: float, big_s: float) -> tuple[str, list[float]]:
    times = [r.sent_at - t0 + t for t in r.chunk_times]
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not r.ok or not gaps:
        return f"  stream {i}: {r.status} {r.error[:120]}", []
    big = [f"{times[j]:.2f}s+{g * 1000:.0f}" for j, g in enumerate(gaps) if g > big_s]
    return (f"  stream {i}: TTFT {r.ttft:.3f} s, {len(times)} chunks, gap p50 {percentile(gaps, 50) * 1000:.0f} ms,"
            f" gaps over {big_s * 1000:.0f} ms at: {' '.join(big) or '-'}"), gaps


async def one_round(client: httpx.AsyncClient, args, salt: str) -> None:
    bodies = [chat_body(args.model, [{"role": "user", "content": user_prompt(7, f"{salt}-{i}", 40)}], args.tokens)
              for i in range(args.streams)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*[stream_chat(client, args.base_url, b, args.timeout) for b in bodies])
    pooled = []
    for i, r in enumerate(results):
        line, gaps = describe(i, r, t0, args.big_ms / 1000)
        print(line)
        pooled += gaps
    if pooled:
        print(f"  all gaps: p50 {percentile(pooled, 50) * 1000:.0f} ms, p99 {percentile(pooled, 99) * 1000:.0f} ms,"
              f" max {max(pooled) * 1000:.0f} ms")


async def main(args) -> None:
    async with httpx.AsyncClient() as client:
        for k in range(args.rounds):
            print(f"round {k + 1}")
            await one_round(client, args, f"timeline-{time.time_ns()}-{k}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model", default="default", help="the model name the server answers to")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--big-ms", type=float, default=160.0, help="list gaps longer than this")
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()
    a.base_url = f"http://{a.host}:{a.port}"
    asyncio.run(main(a))
