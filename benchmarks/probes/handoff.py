"""What the prefill -> decode handoff costs: split layout vs --colocate, one run.

Starts `tandem serve` twice on the same model (split, then --colocate), sends the
same ~1k-token prompts to each (a different first word per repeat, so no run
reuses another's work), and reports time to first token, time to second token
(the first token decode produced: it includes reading the KV back), and the
handoff bytes and milliseconds the workers logged.

    python benchmarks/probes/handoff.py [--model M] [--prompt-tokens 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.bench.loadgen import chat_body, stream_once  # noqa: E402
from tests.support.server import TandemServer  # noqa: E402

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def prompt_of(n_words: int, salt: int) -> str:
    body = " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(n_words))
    return f"Run {salt}. Count the words in this list: {body}"


def timed_stream(base_url: str, content: str) -> tuple[float, float, int]:
    """(time to first token, time to second token, prompt tokens) of one streamed chat."""
    body = chat_body("default", [{"role": "user", "content": content}], max_tokens=3)
    r = stream_once(base_url, body, timeout=300)
    if not r.ok:
        raise RuntimeError(f"request failed: {r.status} {r.error}")
    second = r.chunk_times[1] if len(r.chunk_times) > 1 else float("nan")
    return r.ttft, second, r.prompt_tokens or 0


def handoff_log(log: str) -> tuple[list[int], list[float], list[float]]:
    wrote = [(int(b), float(ms)) for b, ms in re.findall(r"wrote (\d+) bytes in ([\d.]+) ms", log)]
    read = [float(ms) for ms in re.findall(r"read \d+ bytes in ([\d.]+) ms", log)]
    return [b for b, _ in wrote], [ms for _, ms in wrote], read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-words", type=int, default=480, help="list words (~2 tokens each)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    results = {}
    for layout, flags in (("split", []), ("colocate", ["--colocate"])):
        log_path = Path(tempfile.mkdtemp()) / "server.log"
        srv = TandemServer(*flags, "--log-level", "debug", *(["--model", args.model] if args.model else []),
                           log_path=log_path)
        srv.start(timeout=300)
        try:
            timed_stream(srv.base_url, prompt_of(args.prompt_words, 999))  # warm-up
            runs = [timed_stream(srv.base_url, prompt_of(args.prompt_words, i)) for i in range(args.repeats)]
        finally:
            srv.stop()
        nbytes, write_ms, read_ms = handoff_log(log_path.read_text(errors="replace"))
        results[layout] = {
            "prompt_tokens": runs[0][2],
            "ttft_s": statistics.median(r[0] for r in runs),
            "second_token_s": statistics.median(r[1] for r in runs),
            "handoff_bytes": statistics.median(nbytes) if nbytes else 0,
            "handoff_write_ms": statistics.median(write_ms) if write_ms else 0.0,
            "handoff_read_ms": statistics.median(read_ms) if read_ms else 0.0,
        }
    s, c = results["split"], results["colocate"]
    print(f"{'layout':10} {'prompt':>7} {'TTFT s':>8} {'2nd tok s':>10} {'handoff MB':>11} {'write ms':>9} {'read ms':>8}")
    for name, r in results.items():
        print(f"{name:10} {r['prompt_tokens']:>7} {r['ttft_s']:>8.3f} {r['second_token_s']:>10.3f} "
              f"{r['handoff_bytes'] / 1e6:>11.1f} {r['handoff_write_ms']:>9.2f} {r['handoff_read_ms']:>8.2f}")
    print(f"split / colocate: TTFT {s['ttft_s'] / c['ttft_s']:.3f}x, "
          f"second token {s['second_token_s'] / c['second_token_s']:.3f}x; "
          f"handoff write+read = {(s['handoff_write_ms'] + s['handoff_read_ms']) / 1000 / s['ttft_s'] * 100:.1f}% of split TTFT")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
