"""Which prefix-cache block size: load cost, hashing cost, tokens recomputed.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/probes/block_size.py [--model M] [--prefix-tokens 850] [--repeats 15]

On the embedded model (float32 on the CPU backend, as the workers run it),
for each block size:
  * load ms: read the full blocks of a ~850-token cached prefix from a
    shared-memory arena into a fresh KV cache (workers.kv.blocks.read_blocks,
    blocks scattered in the arena as the cache service hands them out);
    store ms: write those blocks (write_blocks), for reference;
  * hash us/block: the chained SHA-256 keys (workers.kv.block_hash);
  * service ms: one lookup + release of the prefix's blocks against a real
    cache service process (its per-block bookkeeping and message size);
  * recomputed: prompt tokens computed again only because a cached prefix
    ends inside a block, averaged over a realistic prompt mix: 16 agents x 4
    turns of chat-templated conversations sharing an ~850-token system
    prompt (turn 1 reuses the system prompt, later turns the previous turn's
    prompt and answer, as the decode worker commits them); the cost of those
    tokens is the measured prefill time per token on top of that prefix.
Prints a table and a recommendation.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from cache_service import main as cache_main  # noqa: E402
from cache_service.arena import Arena, new_arena_name, unlink_arena  # noqa: E402
from cache_service.client import CacheClient  # noqa: E402
from environment.settings import Settings  # noqa: E402
from protos.messages import SamplingParams  # noqa: E402
from workers.kv.block_hash import BlockHasher, block_extra, model_fingerprint  # noqa: E402
from workers.kv.blocks import probe_kv_layout, read_blocks, write_blocks  # noqa: E402
from workers.models.loading import load_model  # noqa: E402
from workers.models.store import resolve_model  # noqa: E402
from workers.prefill.engine import PrefillEngine  # noqa: E402

BLOCK_SIZES = (4, 8, 16, 32, 64)
WORDS = ("agent tool call result plan step check file read write search query answer user system model "
         "token cache block memory test build deploy error retry value list item state graph node edge "
         "time cost speed batch worker router request reply stream").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(tokenizer, target: int) -> str:
    rng = random.Random(0)
    text = "You are one agent of a swarm. Follow the rules below exactly.\n"
    while len(tokenizer.encode(text)) < target:
        text += f"Rule: {words(rng, 12)}.\n"
    return text


def conversation_mix(tokenizer, system: str, agents: int = 16, turns: int = 4):
    """[(prompt tokens, tokens already in the cache that prompt could reuse)]

    The reusable run is the longest common prefix of the prompt with what the
    cache holds: for turn 1 the system prompt (another agent's turn 1
    stored it), for later turns the previous turn's prompt + answer tokens +
    the end-of-turn token (what the decode worker's KV held and committed).
    """
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    sys_tokens = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=True)
    for a in range(agents):
        rng = random.Random(100 + a)
        messages = [{"role": "system", "content": system}]
        held = sys_tokens
        for _ in range(turns):
            messages.append({"role": "user", "content": words(rng, rng.randint(10, 150))})
            prompt = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            common = 0
            for x, y in zip(prompt, held):
                if x != y:
                    break
                common += 1
            out.append((prompt, common))
            answer = words(rng, rng.randint(20, 60))
            messages.append({"role": "assistant", "content": answer})
            held = list(prompt) + tokenizer.encode(answer, add_special_tokens=False) + [end]
    return out


def recomputed(mix, bs: int) -> tuple[float, float]:
    """(mean tokens recomputed per request, mean tokens reused) at block size bs."""
    lost, reused = [], []
    for prompt, common in mix:
        usable = min(common, len(prompt) - 1)  # the last prompt token always runs
        hit = usable // bs * bs
        lost.append(usable - hit)
        reused.append(hit)
    return statistics.mean(lost), statistics.mean(reused)


class Service:
    """A real cache service process for the round-trip timings."""

    def __init__(self):
        self.settings = Settings(run_dir=tempfile.mkdtemp(prefix="tbench-"), cache_dir=None,
                                 arena_name=new_arena_name("tbench"), cache_memory_bytes=256 << 20)
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self.proc = ctx.Process(target=cache_main.run, args=(self.settings, ready), daemon=True)
        self.proc.start()
        if not ready.wait(60):
            raise RuntimeError("cache service did not start")
        self.client = CacheClient(self.settings)

    def lookup_ms(self, hashes, nbytes: int, repeats: int) -> float:
        reply = self.client.reserve(hashes, nbytes, "bench")
        self.client.commit([r.hash for r in reply.blocks], owner="bench")  # no data: only the index matters here

        def once():
            r = self.client.lookup(hashes, "bench")
            assert len(r.blocks) == len(hashes), "blocks evicted during the benchmark"
            self.client.release(r.lease)
        return timed(once, repeats)

    def close(self):
        self.client.close()
        self.proc.terminate()
        self.proc.join(10)
        unlink_arena(self.settings.arena_name)


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder, .gguf or repo id (default: embedded)")
    ap.add_argument("--prefix-tokens", type=int, default=850)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    model_dir = resolve_model(args.model)
    model, tokenizer = load_model(str(model_dir))
    fingerprint = model_fingerprint(model_dir)
    system = system_prompt(tokenizer, args.prefix_tokens)
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Go."}],
        tokenize=True, add_generation_prompt=True)
    mix = conversation_mix(tokenizer, system)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)

    t0 = time.perf_counter()
    cold = PrefillEngine(model, chunk_size=512).run(prompt, greedy)
    cold_ms = (time.perf_counter() - t0) * 1000
    # Prefill cost per token on top of a long cached prefix (what a
    # recomputed token costs): the last 64 tokens after the first n-64.
    tail = 64
    base = make_prompt_cache(model)
    model(mx.array(prompt[: -tail])[None], cache=base)
    mx.eval([c.state for c in base])

    def run_tail():
        cache = make_prompt_cache(model)
        for c, b in zip(cache, base):
            c.state = (b.keys, b.values, b.offset)
        model(mx.array(prompt[-tail:])[None], cache=cache)
        mx.eval([c.state for c in cache])

    per_token_ms = timed(run_tail, 3) / tail

    print(f"model {model_dir.name[:12]}..., prompt {len(prompt)} tokens, cold prefill {cold_ms:.0f} ms, "
          f"prefill after the prefix {per_token_ms:.2f} ms/token; mix: {len(mix)} requests, "
          f"mean prompt {statistics.mean(len(p) for p, _ in mix):.0f} tokens")
    header = (f"{'block':>5} {'bytes/block':>11} {'blocks':>6} {'load ms':>8} {'store ms':>8} "
              f"{'hash us/blk':>11} {'hash us/prompt':>14} {'service ms':>10} {'recomputed':>10} "
              f"{'recompute ms':>12} {'reused':>7}")
    print(header)
    rows = []
    service = Service()
    for bs in BLOCK_SIZES:
        layout = probe_kv_layout(model, bs)
        n_blocks = (len(prompt) - 1) // bs
        nbytes = layout.block_nbytes
        slot = (nbytes + 63) // 64 * 64
        arena = Arena.create(new_arena_name("tbench"), slot * (n_blocks + 1) * 2)
        try:
            # Scattered, out of order: what a used arena hands out.
            offsets = [slot * i for i in random.Random(bs).sample(range(2 * n_blocks + 1), n_blocks)]
            store_ms = timed(lambda: write_blocks(arena.buf, offsets, cold.cache, 0, layout), args.repeats)
            load_ms = timed(lambda: read_blocks(arena.buf, offsets, layout), args.repeats)
            back = read_blocks(arena.buf, offsets, layout)
            assert all(mx.array_equal(a.keys[..., : n_blocks * bs, :], b.keys) for a, b in zip(cold.cache, back))
            del back
        finally:
            arena.close()
            arena.unlink()
        hasher = BlockHasher(block_extra(fingerprint, layout.dtype, bs), bs)
        hash_ms = timed(lambda: hasher.hashes(prompt), args.repeats * 10)
        service_ms = service.lookup_ms(hasher.hashes(prompt, n_blocks), nbytes, args.repeats)
        lost, reused = recomputed(mix, bs)
        row = dict(bs=bs, nbytes=nbytes, blocks=n_blocks, load=load_ms, store=store_ms,
                   hash_blk=hash_ms * 1000 / max(len(prompt) // bs, 1), hash_prompt=hash_ms * 1000,
                   service=service_ms, lost=lost, lost_ms=lost * per_token_ms, reused=reused)
        row["total"] = load_ms + service_ms + hash_ms + row["lost_ms"]
        rows.append(row)
        print(f"{bs:>5} {nbytes:>11} {n_blocks:>6} {load_ms:>8.2f} {store_ms:>8.2f} {row['hash_blk']:>11.1f} "
              f"{row['hash_prompt']:>14.0f} {service_ms:>10.2f} {lost:>10.1f} {row['lost_ms']:>12.1f} "
              f"{reused:>7.0f}")
    service.close()
    best = min(rows, key=lambda r: r["total"])
    print(f"\nper reused request, hash + lookup + load + recompute is lowest at block size {best['bs']}: "
          + ", ".join(f"{r['bs']}: {r['total']:.1f} ms" for r in rows))


if __name__ == "__main__":
    main()
