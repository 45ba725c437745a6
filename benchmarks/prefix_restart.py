"""One conversation's prefix reuse in Tandem, including across a restart.

Measures, on one `tandem serve` with its own disk tier: the time to first token
of a chat with an ~850-word system prompt cold, then warm (the same system
prompt, a new question), then a prompt made of only that new question (what the
warm request really has to compute), then the same warm request again after
`tandem serve` was stopped and started on the same --cache-dir (served from the
disk tier). Reports cached_tokens for each.

    python benchmarks/prefix_restart.py [--model M] [--system-words 850] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.loadgen import chat_body, stream_once  # noqa: E402
from benchmarks.workloads import system_prompt  # noqa: E402
from tests.server_harness import TandemServer  # noqa: E402


def ttft(base_url: str, messages: list) -> tuple[float, int, int]:
    """(time to first token, prompt tokens, cached tokens) of one streamed chat."""
    r = stream_once(base_url, chat_body("default", messages, max_tokens=2), timeout=300)
    if not r.ok:
        raise RuntimeError(f"request failed: {r.status} {r.error}")
    return r.ttft, r.prompt_tokens or 0, r.cached_tokens or 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--system-words", type=int, default=850)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    system = {"role": "system", "content": system_prompt(0, "prefix-restart", args.system_words)}
    question = lambda i: {"role": "user", "content": f"Question {i}: which river flows through the city you know best?"}
    cache_dir = tempfile.mkdtemp(prefix="tandem-kv-bench-")
    flags = ["--cache-dir", cache_dir, *(["--model", args.model] if args.model else [])]
    rows = {}
    srv = TandemServer(*flags).start(timeout=300)
    try:
        rows["cold"] = ttft(srv.base_url, [system, question(0)])
        rows["warm"] = [ttft(srv.base_url, [system, question(i)]) for i in range(1, 1 + args.repeats)]
        rows["suffix alone"] = [ttft(srv.base_url, [question(i)]) for i in range(100, 100 + args.repeats)]
    finally:
        srv.stop()
    srv = TandemServer(*flags).start(timeout=300)
    try:
        rows["after restart"] = ttft(srv.base_url, [system, question(50)])
        rows["after restart, again"] = ttft(srv.base_url, [system, question(51)])
    finally:
        srv.stop()
    print(f"{'request':24} {'TTFT s':>8} {'prompt':>7} {'cached':>7}")
    summary = {}
    for name, r in rows.items():
        runs = r if isinstance(r, list) else [r]
        t = statistics.median(x[0] for x in runs)
        summary[name] = {"ttft_s": t, "prompt_tokens": runs[0][1], "cached_tokens": runs[0][2]}
        print(f"{name:24} {t:>8.3f} {runs[0][1]:>7} {runs[0][2]:>7}")
    s = summary
    print(f"cold/warm {s['cold']['ttft_s'] / s['warm']['ttft_s']:.1f}x; warm / suffix alone "
          f"{s['warm']['ttft_s'] / s['suffix alone']['ttft_s']:.2f}x; after restart / warm "
          f"{s['after restart']['ttft_s'] / s['warm']['ttft_s']:.2f}x")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
