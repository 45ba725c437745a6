"""The chaos workload: greedy streams while worker processes are killed.

`streams` greedy chat streams run twice with the same prompts: once
undisturbed (the reference), then while a decode worker and a prefill worker
(alternately) are killed with SIGKILL every `interval_s` seconds, up to
`kills` times, as long as streams are running. The server's supervisor
restarts each; the router resumes the dead worker's requests elsewhere
(router/routing/dispatcher.py). What counts: failed requests (must be 0), outputs
that differ from the reference (must be 0: greedy, no token lost or
repeated), the moves the router counted, and the shared-memory segments the
server holds (one arena). Only a server whose /health lists worker pids
(Tandem) can be run; the killing happens on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import signal
import sys
import time
from dataclasses import dataclass

import httpx

from benchmarks.bench.workloads.core import Target, metric_sum, user_prompt
from benchmarks.bench.workloads.loadgen import RequestResult, chat_body, stream_chat

ROLES = ("decode", "prefill")  # killed in turn; "prefill+decode" with --colocate


@dataclass
class ChaosConfig:
    streams: int = 32
    max_tokens: int = 96
    interval_s: float = 4.0
    kills: int = 6
    timeout_s: float = 300.0  # a stream's whole deadline: it waits through restarts


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chaos workload (--workload chaos)")
    d = ChaosConfig()
    g.add_argument("--chaos-streams", type=int, default=d.streams, help="greedy streams run at once")
    g.add_argument("--chaos-tokens", type=int, default=d.max_tokens, help="max_tokens of each stream")
    g.add_argument("--chaos-interval", type=float, default=d.interval_s, help="seconds between kills")
    g.add_argument("--chaos-kills", type=int, default=d.kills, help="kills at most")


def config(args: argparse.Namespace) -> ChaosConfig:
    return ChaosConfig(streams=args.chaos_streams, max_tokens=args.chaos_tokens, interval_s=args.chaos_interval,
                       kills=args.chaos_kills)


async def _streams(target: Target, cfg: ChaosConfig) -> list[RequestResult]:
    limits = httpx.Limits(max_connections=cfg.streams + 4, max_keepalive_connections=cfg.streams + 4)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        return await asyncio.gather(*(
            stream_chat(client, target.base_url, chat_body(target.model, [
                {"role": "user", "content": user_prompt(i, "chaos", 60) + " Tell me a long story about it."}],
                cfg.max_tokens), cfg.timeout_s, target.headers)
            for i in range(cfg.streams)))


async def _worker_pids(client: httpx.AsyncClient, target: Target) -> dict[str, int]:
    """Role -> pid of a ready worker, from /health."""
    try:
        body = (await client.get(target.base_url + "/health", timeout=5)).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {w["role"]: w["pid"] for w in body.get("workers", []) if w.get("state") == "ready"}


async def _kill_loop(target: Target, cfg: ChaosConfig, running: asyncio.Future) -> list[dict]:
    """Kill a worker every interval while the streams run: decode, prefill, decode..."""
    kills: list[dict] = []
    t0 = time.monotonic()
    async with httpx.AsyncClient() as client:
        while len(kills) < cfg.kills and not running.done():
            await asyncio.sleep(cfg.interval_s)
            if running.done():
                break
            pids = await _worker_pids(client, target)
            role = ROLES[len(kills) % len(ROLES)]
            pid = pids.get(role) or pids.get("prefill+decode")
            if pid is None:  # still restarting from the last kill: try the next interval
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills.append({"at_s": round(time.monotonic() - t0, 1), "role": role, "pid": pid})
            print(f"  chaos: killed {role} worker pid {pid} at {kills[-1]['at_s']} s", file=sys.stderr)
    return kills


def arena_segments(supervisor_pid: int | None) -> list[str] | None:
    """The server's shared-memory segments (Linux: /dev/shm), or None where they cannot be listed."""
    if supervisor_pid is None or not os.path.isdir("/dev/shm"):
        return None
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/tandem-{supervisor_pid}-*"))


async def chaos(target: Target, cfg: ChaosConfig, supervisor_pid: int | None = None) -> dict:
    print(f"  chaos: {cfg.streams} greedy streams, undisturbed (the reference)", file=sys.stderr)
    reference = await _streams(target, cfg)
    async with httpx.AsyncClient() as client:
        before = metric_sum((await client.get(target.base_url + "/metrics", timeout=5)).text,
                            "tandem_request_moves_total")
    print(f"  chaos: the same streams, a worker killed every {cfg.interval_s:g} s", file=sys.stderr)
    t0 = time.monotonic()
    run = asyncio.ensure_future(_streams(target, cfg))
    kills = await _kill_loop(target, cfg, run)
    results = await run
    wall = time.monotonic() - t0
    async with httpx.AsyncClient() as client:
        after = metric_sum((await client.get(target.base_url + "/metrics", timeout=5)).text,
                           "tandem_request_moves_total")
    failed = [r for r in results if not r.ok]
    differ = [i for i, (a, b) in enumerate(zip(reference, results)) if a.ok and b.ok and a.text != b.text]
    return {
        "streams": cfg.streams,
        "max_tokens": cfg.max_tokens,
        "reference_failed": sum(1 for r in reference if not r.ok),
        "kills": kills,
        "failed": len(failed),
        "errors": sorted({f"{r.status}: {r.error[:120]}" for r in failed}),
        "outputs_differing": len(differ),
        "moves": None if before is None or after is None else int(after - before),
        "output_tokens": sum(r.output_tokens for r in results),
        "wall_s": round(wall, 1),
        "arena_segments": arena_segments(supervisor_pid),
    }
