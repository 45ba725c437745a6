"""The first requests after `tandem serve` starts, with and without the workers' warm-up.

Starts the server `--rounds` times each way (alternating), and per start
times how long it takes to answer /health as ready, then sends `--requests`
short chats one after another (each a different question, so none is a
prefix hit) and records each one's time to first token and total time. A
process's first calls compile kernels and set up BLAS/cuDNN state
(workers/warm_up.py); this shows what the first client of a restarted
service pays for that.

    python benchmarks/probes/first_request.py [--model M] [--rounds 2] [--requests 4] [--serve-args "..."]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.bench.loadgen import chat_body, stream_once  # noqa: E402
from tests.support.server import TandemServer  # noqa: E402


def one_start(flags: list[str], requests: int, salt: int) -> dict:
    t0 = time.perf_counter()
    srv = TandemServer(*flags).start(timeout=600)
    ready_s = time.perf_counter() - t0
    try:
        rows = []
        for i in range(requests):
            content = f"Question {salt}-{i}: name a river in a city you like, and say why you like it."
            r = stream_once(srv.base_url, chat_body("default", [{"role": "user", "content": content}], 8), timeout=300)
            if not r.ok:
                raise RuntimeError(f"request failed: {r.status} {r.error}")
            rows.append(r.ttft)
    finally:
        srv.stop()
    return {"ready_s": ready_s, "ttft_s": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--serve-args", default="", help="extra `tandem serve` flags")
    args = ap.parse_args()
    base = [*(["--model", args.model] if args.model else []), "--no-disk-cache", *shlex.split(args.serve_args)]
    runs: dict[str, list[dict]] = {"warm-up": [], "no warm-up": []}
    for rnd in range(args.rounds):
        for name, extra in (("warm-up", []), ("no warm-up", ["--no-warm-up"])):
            runs[name].append(one_start(base + extra, args.requests, rnd))
    print(f"{'start':12} {'ready s':>8} " + " ".join(f"{'TTFT ' + str(i + 1):>8}" for i in range(args.requests)))
    summary = {}
    for name, rs in runs.items():
        ready = statistics.median(r["ready_s"] for r in rs)
        ttft = [statistics.median(r["ttft_s"][i] for r in rs) for i in range(args.requests)]
        summary[name] = {"ready_s": ready, "ttft_s": ttft, "runs": rs}
        print(f"{name:12} {ready:>8.2f} " + " ".join(f"{t:>8.3f}" for t in ttft))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
