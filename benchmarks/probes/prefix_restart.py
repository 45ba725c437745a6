"""One conversation's prefix reuse in Tandem, including across a restart.

Measures, on one `tandem serve` with its own disk tier: the time to first token
of a chat with an ~850-word system prompt cold, then warm (the same system
prompt, a new question), then a prompt made of only that new question (what the
warm request really has to compute), then the same warm request again after
`tandem serve` was stopped and started on the same --cache-dir (served from the
disk tier). Reports cached_tokens for each.

"Suffix alone" is exactly what a warm request computes: the warm prompt's
tokens after its cached ones, sent on their own as a token-id prompt to
/v1/completions (each with a different question, so none is cached).

    python benchmarks/probes/prefix_restart.py [--model M] [--system-words 850] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from mlx_lm.utils import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.bench.loadgen import chat_body, completion_body, stream_once  # noqa: E402
from benchmarks.bench.workloads import system_prompt  # noqa: E402
from tests.support.server import TandemServer  # noqa: E402
from workers.models.store import resolve_model  # noqa: E402


def ttft(base_url: str, messages: list | None = None, tokens: list[int] | None = None) -> tuple[float, int, int]:
    """(time to first token, prompt tokens, cached tokens) of one streamed chat
    (or completion of a token-id prompt)."""
    body = chat_body("default", messages, 2) if tokens is None else completion_body("default", tokens, 2)
    r = stream_once(base_url, body, timeout=300)
    if not r.ok:
        raise RuntimeError(f"request failed: {r.status} {r.error}")
    return r.ttft, r.prompt_tokens or 0, r.cached_tokens or 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--system-words", type=int, default=850)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve-args", default="", help='extra `tandem serve` flags, e.g. "--log-level debug"')
    ap.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs here")
    args = ap.parse_args()
    system = {"role": "system", "content": system_prompt(0, "prefix-restart", args.system_words)}
    question = lambda i: {"role": "user", "content": f"Question {i}: which river flows through the city you know best?"}
    tokenizer = load_tokenizer(resolve_model(args.model))
    template = lambda messages: list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    cache_dir = tempfile.mkdtemp(prefix="tandem-kv-bench-")
    flags = ["--cache-dir", cache_dir, *(["--model", args.model] if args.model else []), *shlex.split(args.serve_args)]
    rows = {}
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    log = lambda i: args.log_dir / f"tandem-{i}.log" if args.log_dir else None
    srv = TandemServer(*flags, log_path=log(1)).start(timeout=300)
    try:
        rows["cold"] = ttft(srv.base_url, [system, question(0)])
        rows["warm"] = [ttft(srv.base_url, [system, question(i)]) for i in range(1, 1 + args.repeats)]
        cached = rows["warm"][0][2]
        rows["suffix alone"] = [ttft(srv.base_url, tokens=template([system, question(i)])[cached:])
                                for i in range(100, 100 + args.repeats)]
    finally:
        srv.stop()
    srv = TandemServer(*flags, log_path=log(2)).start(timeout=300)
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
        summary[name] = {"ttft_s": t, "prompt_tokens": runs[0][1], "cached_tokens": max(x[2] for x in runs)}
        print(f"{name:24} {t:>8.3f} {runs[0][1]:>7} {summary[name]['cached_tokens']:>7}")
    s = summary
    print(f"cold/warm {s['cold']['ttft_s'] / s['warm']['ttft_s']:.1f}x; warm / suffix alone "
          f"{s['warm']['ttft_s'] / s['suffix alone']['ttft_s']:.2f}x; after restart / warm "
          f"{s['after restart']['ttft_s'] / s['warm']['ttft_s']:.2f}x")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
