"""The soak workload: many clients for a long time against one server, to show
it can be left running: no failed request, and every process's resident
memory flat once warm. Not part of `all`.

    tandem bench --workload soak --soak-clients 64 --soak-duration 600 --json soak.json

`clients` closed-loop clients send short chats for `duration_s`, mixed: every
other one streamed, every third one sampled (temperature 0.8) rather than
greedy, prompts of 10-60 words, answers of 8-48 tokens. Every `sample_s` each
process of the server's tree has its memory read (Linux: /proc/PID/status
VmRSS and RssAnon; elsewhere `ps` RSS, benchmarks/bench/measures/memory.py). Per
process, over the samples after warm-up (the first `warmup_fraction` of the
run left out): the RSS at the start and end of that span, its least-squares
slope in MB/min and its total change. VmRSS counts the shared-memory arena's
pages as a process touches them (they are the KV cache, not a leak), so the
private part, RssAnon, is reported beside it: a leak shows in both.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from benchmarks.bench.measures.memory import process_name, rss_bytes, tree_pids
from benchmarks.bench.workloads.agents import post_chat
from benchmarks.bench.workloads.core import Target, user_prompt
from benchmarks.bench.workloads.loadgen import Progress, RequestResult, chat_body, closed_loop, stream_chat, summarize

MB = 1 << 20


@dataclass
class SoakConfig:
    clients: int = 64
    duration_s: float = 600.0
    sample_s: float = 5.0  # between memory samples
    warmup_fraction: float = 0.2  # of the run, left out of the memory figures
    timeout_s: float = 120.0  # one request's deadline
    seed: int = 0


@dataclass
class SoakRun:
    """The soak's knobs and the server it measures."""

    config: SoakConfig
    root_pid: int | None = None  # the server's root process; None: no memory figures
    roles: Callable[[], dict[int, str]] = dict  # pid -> role ("router", "decode-0", ...), e.g. from its log


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    g = p.add_argument_group("soak (--workload soak)")
    g.add_argument("--soak-clients", type=int, default=d.clients, help="concurrent clients")
    g.add_argument("--soak-duration", type=float, default=d.duration_s, help="seconds of load")
    g.add_argument("--soak-sample", type=float, default=d.sample_s, help="seconds between memory samples")


def config(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(clients=args.soak_clients, duration_s=args.soak_duration, sample_s=args.soak_sample,
                      timeout_s=args.timeout, seed=args.seed)


# ---------------------------------------------------------------- requests

def request_body(model: str, cfg: SoakConfig, client: int, index: int) -> dict:
    """The `index`-th request of the run: a short chat, a pure function of the seed."""
    salt = f"soak-{client}-{index}"
    body = chat_body(model, [{"role": "user", "content": user_prompt(cfg.seed, salt, 10 + index * 7 % 51)}],
                     8 + index * 13 % 41)
    body["stream"] = index % 2 == 0
    if not body["stream"]:
        del body["stream_options"]
    if index % 3 == 2:
        body.update(temperature=0.8, seed=index)
    return body


async def _send(client: httpx.AsyncClient, target: Target, body: dict, timeout_s: float) -> RequestResult:
    if body["stream"]:
        return await stream_chat(client, target.base_url, body, timeout_s, target.headers)
    return (await post_chat(client, target, body, timeout_s))[0]


# ---------------------------------------------------------------- memory

@dataclass
class MemorySamples:
    """Each process's memory over time: pid -> [(seconds from start, VmRSS bytes, RssAnon bytes or None)]."""

    t0: float = field(default_factory=time.monotonic)
    series: dict[int, list[tuple[float, int, int | None]]] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)

    def sample(self, root_pid: int) -> None:
        now = time.monotonic() - self.t0
        for pid in tree_pids(root_pid):
            rss, anon = memory_of(pid)
            if rss is None:
                continue
            self.series.setdefault(pid, []).append((now, rss, anon))
            if pid not in self.names:
                self.names[pid] = "supervisor" if pid == root_pid else process_name(pid)


def memory_of(pid: int) -> tuple[int | None, int | None]:
    """(VmRSS, RssAnon) in bytes; RssAnon None where unknown, both None when the process is gone."""
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            rss = int(fields["VmRSS"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):  # gone, or a zombie (no VmRSS)
            return None, None
        anon = fields.get("RssAnon")
        return rss, int(anon.split()[0]) * 1024 if anon else None
    return rss_bytes(pid)[0], None


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, in value per minute; None under two points."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def process_figures(samples: MemorySamples, warm_from_s: float, roles: dict[int, str]) -> list[dict]:
    """Per process: its memory over the samples from `warm_from_s` on."""
    out = []
    for pid, series in sorted(samples.series.items()):
        warm = [s for s in series if s[0] >= warm_from_s]
        entry = {"pid": pid, "name": roles.get(pid) or samples.names.get(pid, "?"), "samples": len(warm),
                 "appeared_s": round(series[0][0], 1), "last_seen_s": round(series[-1][0], 1)}
        for key, index in (("rss", 1), ("anon", 2)):
            points = [(s[0], s[index] / MB) for s in warm if s[index] is not None]
            slope = slope_per_min(points)
            entry.update({f"{key}_start_mb": round(points[0][1], 1) if points else None,
                          f"{key}_end_mb": round(points[-1][1], 1) if points else None,
                          f"{key}_change_mb": round(points[-1][1] - points[0][1], 1) if points else None,
                          f"{key}_slope_mb_min": round(slope, 3) if slope is not None else None})
        # Every sample, warm-up included, for a closer look (a plateau, a step): [s, RSS MB, anon MB].
        entry["series"] = [[round(t, 1), round(rss / MB, 1), round(anon / MB, 1) if anon is not None else None]
                           for t, rss, anon in series]
        out.append(entry)
    return out


async def _sample_every(samples: MemorySamples, root_pid: int, every_s: float, stop: asyncio.Event) -> None:
    while True:
        await asyncio.to_thread(samples.sample, root_pid)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except TimeoutError:
            continue


# ---------------------------------------------------------------- the workload

async def soak(target: Target, run: SoakRun) -> dict:
    cfg = run.config
    samples, stop = MemorySamples(), asyncio.Event()
    sampler = asyncio.create_task(_sample_every(samples, run.root_pid, cfg.sample_s, stop)) if run.root_pid else None
    counters: dict[int, int] = {}  # client -> its last request's index
    streamed = 0
    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients + 8)
    progress = Progress(f"soak x{cfg.clients}", None, cfg.duration_s)
    try:
        async with httpx.AsyncClient(limits=limits, timeout=None) as client:
            async def send(c: int, _i: int) -> RequestResult:
                nonlocal streamed
                index = counters[c] = counters.get(c, -1) + 1
                body = request_body(target.model, cfg, c, index)
                streamed += body["stream"]
                return await _send(client, target, body, cfg.timeout_s)

            results, wall = await closed_loop(send, cfg.clients, duration=cfg.duration_s, progress=progress)
    finally:
        progress.close()
        stop.set()
        if sampler is not None:
            await sampler
    stats = summarize(results, wall, ttft_budget=2.0, itl_budget=0.5)
    failed = [r for r in results if not r.ok]
    out = {"clients": cfg.clients, "duration_s": cfg.duration_s, "wall_s": round(wall, 1),
           "requests": len(results), "ok": stats["ok"], "errors": len(failed),
           "errors_by_status": _by_status(failed), "first_error": stats["first_error"],
           "streamed": streamed,
           "output_tokens": stats["output_tokens"], "output_tok_s": round(stats["output_tok_s"], 1),
           "requests_s": round(stats["requests_s"], 2), "ttft_p50_s": stats["ttft_p50_s"],
           "ttft_p99_s": stats["ttft_p99_s"], "latency_p50_s": stats["latency_p50_s"],
           "warm_from_s": cfg.warmup_fraction * cfg.duration_s, "sample_s": cfg.sample_s,
           "processes": process_figures(samples, cfg.warmup_fraction * cfg.duration_s, run.roles())}
    print(render(out))
    return out


def _by_status(failed: list[RequestResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in failed:
        out[str(r.status)] = out.get(str(r.status), 0) + 1
    return out


def render(out: dict) -> str:
    lines = [f"soak: {out['clients']} clients for {out['wall_s']:.0f} s: {out['requests']} requests, "
             f"{out['errors']} failed{' ' + str(out['errors_by_status']) if out['errors'] else ''}, "
             f"{out['output_tok_s']:.1f} tok/s, {out['requests_s']:.2f} req/s",
             f"memory after warm-up (from {out['warm_from_s']:.0f} s, a sample every {out['sample_s']:g} s):",
             f"  {'process':<14}{'pid':>8}{'RSS MB':>16}{'slope MB/min':>14}{'change MB':>11}"
             f"{'anon MB':>16}{'slope MB/min':>14}{'change MB':>11}"]
    for p in out["processes"]:
        lines.append(f"  {p['name'][:14]:<14}{p['pid']:>8}" + "".join(
            f"{_span(p, key):>16}{_num(p[key + '_slope_mb_min'], '+.3f'):>14}{_num(p[key + '_change_mb'], '+.1f'):>11}"
            for key in ("rss", "anon")))
    return "\n".join(lines)


def _span(p: dict, key: str) -> str:
    start, end = p[key + "_start_mb"], p[key + "_end_mb"]
    return "-" if start is None else f"{start:.0f} -> {end:.0f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)
