"""Many models on one endpoint under load (issue 41): one `tandem serve` whose
--model is model A and which loads model B on demand (--max-loaded-models 2),
driven by N agents at once, each agent's turns alternating between A and B
with its whole history (benchmarks/bench/workloads/two_models.py's turns),
and a worker of B killed (SIGKILL) mid-run. Rounds: 16 agents (B loads
during it), 16 with a kill, 64, 64 with a kill; each prints turns ok, errors
(the first three), turns/s, tokens/s, p50/p99 latency and the pid killed.

    python benchmarks/probes/many_models_load.py --like qwen3-0.6b --out /tmp/mml

The models are random-weight ones of --like's shape (the embedded model's
tokenizer unless --tokenizer-from), in a Hugging Face cache under --out.
"""
import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.bench.workloads.two_models import RANDOM_REPOS, turn_model, user_turn, write_hub  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--like", default="qwen3-0.6b")
p.add_argument("--out", required=True, help="folder for the models and the server's log")
p.add_argument("--tokenizer-from", default=None)
p.add_argument("--port", type=int, default=18100)
args = p.parse_args()
OUT = Path(args.out)
home = OUT / "hf"
t0 = time.monotonic()
write_hub(home, args.like, "bfloat16", tokenizer_dir=args.tokenizer_from)
print(f"models written in {time.monotonic() - t0:.0f} s", flush=True)
A, B = RANDOM_REPOS
PORT = args.port
URL = f"http://127.0.0.1:{PORT}"
env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
log = OUT / "serve.log"
srv = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--model", A, "--port", str(PORT),
                        "--max-loaded-models", "2", "--no-disk-cache"], env=env, stdout=open(log, "w"),
                       stderr=subprocess.STDOUT, start_new_session=True)
for _ in range(300):
    try:
        if httpx.get(URL + "/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
print(f"healthy after {time.monotonic() - t0:.0f} s", flush=True)


def b_pids() -> list[int]:
    return [int(p) for p in re.findall(r"started m\d+\.(?:decode|worker)-0 \(pid (\d+)\)", log.read_text())]


async def agent(client, k, turns, stats):
    messages = []
    for t in range(turns):
        model = (A, B)[turn_model(k, t)]
        messages.append({"role": "user", "content": user_turn(1, k, t, 20)})
        started = time.monotonic()
        try:
            r = await client.post(URL + "/v1/chat/completions", timeout=300, json={
                "model": model, "messages": messages, "max_tokens": 32, "temperature": 0})
        except httpx.HTTPError as exc:
            stats["errors"].append(f"{type(exc).__name__}: {exc}")
            messages.pop()
            continue
        if r.status_code != 200:
            stats["errors"].append(f"{r.status_code}: {r.text[:200]}")
            messages.pop()
            continue
        body = r.json()
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        stats["ok"] += 1
        stats["latency"].append(time.monotonic() - started)
        stats["tokens"] += body["usage"]["completion_tokens"]


async def killer(after_s, stats):
    await asyncio.sleep(after_s)
    pids = b_pids()
    if pids:
        os.kill(pids[-1], signal.SIGKILL)
        stats["killed"] = pids[-1]


async def run(n, turns, kill_after):
    stats = {"ok": 0, "errors": [], "latency": [], "tokens": 0, "killed": None}
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        started = time.monotonic()
        tasks = [agent(client, k, turns, stats) for k in range(n)]
        if kill_after:
            tasks.append(killer(kill_after, stats))
        await asyncio.gather(*tasks)
        wall = time.monotonic() - started
    lat = sorted(stats["latency"])
    print(json.dumps({"agents": n, "turns": turns, "ok": stats["ok"], "errors": len(stats["errors"]),
                      "first_errors": stats["errors"][:3], "wall_s": round(wall, 1),
                      "turns_s": round(stats["ok"] / wall, 2), "tok_s": round(stats["tokens"] / wall, 1),
                      "p50_s": round(lat[len(lat) // 2], 2) if lat else None,
                      "p99_s": round(lat[int(len(lat) * 0.99)], 2) if lat else None,
                      "killed_b_worker": stats["killed"]}), flush=True)


async def main():
    await run(16, 6, None)          # B loads on demand during this one
    await run(16, 6, 4.0)           # a worker of B killed 4 s in
    await run(64, 6, None)
    await run(64, 6, 6.0)


asyncio.run(main())
health = httpx.get(URL + "/health", timeout=5).json()
print("models loaded:", [(m["name"], m["state"], m["workers"]) for m in health.get("models", [])])
print("restarts:", len(re.findall(r"restart", log.read_text())), "| B worker pids:", b_pids())
os.killpg(srv.pid, signal.SIGTERM)
srv.wait(60)
print(f"total {time.monotonic() - t0:.0f} s")
