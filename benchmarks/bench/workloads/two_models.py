"""The two-models workload: agents that alternate between two models (issue 41).

    tandem bench --workload two-models --agents 4 --turns 6 --max-tokens 32 \\
        --two-models-like tiny-llama --two-models-systems tandem,mlx_lm,tandem-pair

Each agent runs `turns` chat requests with its whole history; turn t of agent
k names model (k + t) % 2, so both models are asked for at every moment (a
swarm that mixes models). Three ways to serve that, each started in turn:

- tandem: one `tandem serve --model A --max-loaded-models 2`; a request's
  `model` names either repo and B is loaded on demand;
- mlx_lm: one mlx_lm.server started without a model: it loads whichever model
  a request names (a folder path), one at a time, so it reloads on every switch;
- tandem-pair: two `tandem serve`, one per model; the client sends each turn
  to the server of its model.

For each: turns/s; peak memory (the peaks of the summed RSS and PSS of every
process of the system, sampled, and GPU memory where nvidia-smi reports it);
the cold first request per model (load included); memory at rest with no
model loaded against memory after an idle unload.
Tandem can't start without a model: its rest ("idle baseline") is the
supervisor, router and cache after the startup model was unloaded with a
request's keep_alive 0. The turns carry no keep_alive (the servers' defaults:
5 minutes for a model loaded on demand, the --model one stays), so no model
goes while the other loads on a slow machine; after the last turn one short
closing request per model carries keep_alive = --two-models-keep-alive (as
Ollama's clients set it), and the bench waits until /health lists no loaded
model: the idle unload is the servers' own expiry. mlx_lm.server has no idle
unload: its "baseline" is the process before any request, its "after idle"
the process the same keep-alive after its closing requests.

The models are Hugging Face repo ids in an HF cache (HF_HOME, offline): two
given with --two-models, or two random ones (--two-models-like, seeds 1 and 2,
the embedded model's tokenizer) written into a temporary HF_HOME as
huggingface_hub lays out a pull. Plain chat, no tools: constrained tool calls
would time each server's grammar, not the model switching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.bench.measures.memory import process_name, pss_bytes, rss_bytes, tree_pids
from benchmarks.bench.reporting.text_table import mib, num, table
from benchmarks.bench.servers.systems import ManagedServer, ServerSpec, openblas_env, pick_port
from benchmarks.bench.workloads.agents import post_chat
from benchmarks.bench.workloads.core import Target, WorkloadConfig, metric_sum, system_prompt, words
from benchmarks.bench.workloads.loadgen import Progress, RequestResult, percentile

SYSTEMS = ("tandem", "mlx_lm", "tandem-pair")
RANDOM_REPOS = ("bench/two-models-a", "bench/two-models-b")
COMMIT = "b" * 40  # the snapshot's name in the temporary HF cache
COLD_TOKENS = 8
SETTLE_S = 3.0  # at least, after the last unload: exiting workers give their memory back
SETTLE_MAX_S = 60.0


@dataclass
class TwoModelsConfig:
    models: tuple[str, str] | None = None  # repo ids in HF_HOME; None: two random ones
    like: str = "tiny-llama"  # the random models' shape (benchmarks/random_models/text.py)
    dtype: str = "float32"
    systems: tuple[str, ...] = SYSTEMS
    keep_alive_s: float = 5.0
    tokenizer_dir: str | None = None  # the random models' tokenizer (None: the embedded model's)
    system_prompt_words: int = 120
    turn_words: int = 40


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("two-models workload (benchmarks/bench/workloads/two_models.py)")
    g.add_argument("--two-models", default=None, metavar="REPO_A,REPO_B",
                   help="two repo ids downloaded in HF_HOME (default: two random models in a temporary HF_HOME)")
    g.add_argument("--two-models-like", default="tiny-llama", help="shape of the random models (`--like` names)")
    g.add_argument("--two-models-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--two-models-tokenizer", default=None, metavar="DIR",
                   help="folder the random models borrow their tokenizer from (default: the embedded model's)")
    g.add_argument("--two-models-systems", default=",".join(SYSTEMS),
                   help=f"comma-separated from {','.join(SYSTEMS)}")
    g.add_argument("--two-models-keep-alive", type=float, default=5.0,
                   help="seconds: the keep_alive of the closing request per model, after the agents' last turn; "
                        "the memory after idle is read once it expired")


def config(args: argparse.Namespace) -> TwoModelsConfig:
    systems = tuple(s.strip() for s in args.two_models_systems.split(",") if s.strip())
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ValueError(f"--two-models-systems: unknown {', '.join(bad) or '(empty)'}; from {','.join(SYSTEMS)}")
    models = None
    if args.two_models:
        models = tuple(m.strip() for m in args.two_models.split(","))
        if len(models) != 2 or not all(models):
            raise ValueError("--two-models takes two repo ids: REPO_A,REPO_B")
    return TwoModelsConfig(models, args.two_models_like, args.two_models_dtype, systems, args.two_models_keep_alive,
                           tokenizer_dir=args.two_models_tokenizer)


# ---------------------------------------------------------------- the models

def write_hub(home: Path, like: str, dtype: str, repos: tuple[str, str] = RANDOM_REPOS,
              tokenizer_dir: str | None = None) -> dict[str, Path]:
    """Two random models in `home` laid out as huggingface_hub caches a pull:
    hub/models--owner--name/refs/main and snapshots/<commit>/. {repo: snapshot}."""
    from benchmarks.random_models.text import write_random_model

    out = {}
    for seed, repo in enumerate(repos, start=1):
        folder = home / "hub" / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / "main").write_text(COMMIT)
        out[repo] = folder / "snapshots" / COMMIT
        write_random_model(like, out[repo], dtype=dtype, seed=seed,
                           tokenizer_dir=Path(tokenizer_dir) if tokenizer_dir else None)
    return out


def snapshot_of(repo: str, home: Path) -> Path:
    """A downloaded repo's snapshot folder in the HF cache at `home`."""
    folder = home / "hub" / f"models--{repo.replace('/', '--')}"
    try:
        commit = (folder / "refs" / "main").read_text().strip()
    except OSError:
        raise ValueError(f"{repo} is not downloaded in {home} (tandem pull {repo})") from None
    return folder / "snapshots" / commit


def turn_model(agent: int, turn: int) -> int:
    """Which of the two models an agent's turn names: they alternate, and half
    the agents start on each, so both are asked for at every moment."""
    return (agent + turn) % 2


def user_turn(seed: int, agent: int, turn: int, n_words: int) -> str:
    return f"Agent {agent}, step {turn}: go on with the plan, notes: {words(n_words, seed, f'two-{agent}-{turn}')}"


# ---------------------------------------------------------------- memory

def gpu_bytes(pids: set[int]) -> int | None:
    """GPU memory nvidia-smi reports for these processes (None: no nvidia-smi).
    In a container it may list no process ids of ours: then every GPU's
    memory in use, device-wide (a lent machine runs nothing else)."""
    total = {"pids": 0.0, "all": 0.0}
    for query, key in (("--query-compute-apps=pid,used_memory", "pids"), ("--query-gpu=memory.used", "all")):
        try:
            out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=5).stdout if shutil.which("nvidia-smi") else None
        except (OSError, subprocess.SubprocessError):
            out = None
        if out is None:
            return None
        rows = [[p.strip() for p in line.split(",")] for line in out.splitlines()]
        total[key] = sum(float(r[-1]) for r in rows if r[-1].replace(".", "").isdigit()
                         and (key == "all" or r[0].isdigit() and int(r[0]) in pids))
    return int((total["pids"] or total["all"]) * 2**20)


def memory_now(roots: list[int], roles: dict[int, str] | None = None) -> dict:
    """Summed RSS and PSS (and GPU memory) of every process under `roots`
    now; with `roles` (pid -> name), each process's own too."""
    pids = {p for r in roots for p in tree_pids(r)}
    rss = pss = n = 0
    each = []
    for pid in sorted(pids):
        current, _ = rss_bytes(pid)
        if current is None:
            continue
        own = pss_bytes(pid) or 0
        rss, pss, n = rss + current, pss + own, n + 1
        if roles is not None:
            each.append({"pid": pid, "name": roles.get(pid) or process_name(pid), "rss_bytes": current,
                         "pss_bytes": own or None})
    out = {"processes": n, "rss_bytes": rss, "pss_bytes": pss or None, "gpu_bytes": gpu_bytes(pids)}
    return {**out, "each": each} if roles is not None else out


class PeakSampler:
    """The peak of `memory_now` over several process trees, sampled in a thread."""

    def __init__(self, roots: list[int], interval: float = 0.25):
        self.roots, self.interval = roots, interval
        self.peak = {"rss_bytes": 0, "pss_bytes": 0, "gpu_bytes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="two-models-memory", daemon=True)

    def start(self) -> "PeakSampler":
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()
        return {k: v or None for k, v in self.peak.items()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        now = memory_now(self.roots)
        for k in self.peak:
            self.peak[k] = max(self.peak[k], now[k] or 0)


# ---------------------------------------------------------------- the systems

@dataclass
class Endpoint:
    """Where a model's requests go, and how they name it."""

    url: str
    model: str
    tandem: bool


class System:
    """One system's servers, and where each of the two models is served."""

    def __init__(self, name: str, repos: tuple[str, str], snapshots: dict[str, Path], home: Path, run_dir: Path,
                 port_base: int, taken: set[int], cfg: TwoModelsConfig, tandem_args: list[str], mlx_lm_args: list[str]):
        self.name = name
        self.servers: list[ManagedServer] = []
        self.endpoints: list[Endpoint] = []
        hf = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
        if name == "mlx_lm":
            port = pick_port(port_base, taken)
            argv = [sys.executable, "-m", "mlx_lm.server", "--host", "127.0.0.1", "--port", str(port), *mlx_lm_args]
            self._add(ServerSpec(name, argv, {**openblas_env(), **hf}, "", port), run_dir)
            self.endpoints = [Endpoint(self.servers[0].spec.base_url, str(snapshots[r]), False) for r in repos]
            return
        for i, repo in enumerate(repos if name == "tandem-pair" else repos[:1]):
            port = pick_port(port_base, taken)
            label = f"{name}-{i}" if name == "tandem-pair" else name
            argv = [sys.executable, "-m", "deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                    "--cache-dir", str(run_dir / f"{label}-kv"), "--model", repo]
            argv += (["--max-loaded-models", "2"] if name == "tandem" else []) + tandem_args
            self._add(ServerSpec(label, argv, {**os.environ, **hf}, repo, port), run_dir)
        urls = [s.spec.base_url for s in self.servers]
        self.endpoints = [Endpoint(urls[i if name == "tandem-pair" else 0], repo, True) for i, repo in enumerate(repos)]

    def _add(self, spec: ServerSpec, run_dir: Path) -> None:
        self.servers.append(ManagedServer(spec, run_dir / f"two-models-{spec.name}.log"))

    @property
    def tandem(self) -> bool:
        return self.name != "mlx_lm"

    def startup_models(self) -> list[Endpoint]:
        """Each Tandem server's --model (the first model served at each URL)."""
        return list({e.url: e for e in reversed(self.endpoints) if e.tandem}.values())[::-1]

    @property
    def roots(self) -> list[int]:
        return [s.proc.pid for s in self.servers if s.proc is not None]

    def start(self, timeout: float) -> None:
        for s in self.servers:
            print(f"tandem bench: two-models: starting {s.spec.name}: {s.command}", file=sys.stderr)
            s.start(timeout)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def roles(self) -> dict[int, str]:
        """pid -> role, from Tandem's 'started X (pid N)' log lines; each server's root is its supervisor."""
        out: dict[int, str] = {}
        for s in self.servers:
            prefix = f"{s.spec.name}:" if len(self.servers) > 1 else ""
            out.update({int(pid): prefix + role for role, pid in re.findall(r"started (\S+) \(pid (\d+)\)",
                                                                             s.log_tail(1 << 20))})
            if s.proc is not None:
                out[s.proc.pid] = prefix + ("supervisor" if self.tandem else s.spec.name)
        return out


async def loaded_models(client: httpx.AsyncClient, url: str) -> list[str]:
    models = (await client.get(url + "/health", timeout=10.0)).json().get("models") or []
    return [m["name"] for m in models if m.get("state") in ("ready", "loading")]


async def model_loads(client: httpx.AsyncClient, system: System) -> int | None:
    """Models Tandem's servers loaded since they started (/metrics; None for mlx_lm)."""
    if not system.tandem:
        return None
    total = 0
    for url in {e.url for e in system.endpoints}:
        text = (await client.get(url + "/metrics", timeout=10.0)).text
        total += int(metric_sum(text, "tandem_model_loads_total") or 0)
    return total


async def settled(system: "System") -> dict:
    """Memory once the process count has held for 2 s (workers told to stop
    may take seconds to exit on a busy machine), at least SETTLE_S on."""
    t0 = time.monotonic()
    counts: list[int] = []
    while True:
        now = memory_now(system.roots, system.roles())
        counts = (counts + [now["processes"]])[-5:]
        waited = time.monotonic() - t0
        if waited >= SETTLE_MAX_S or waited >= SETTLE_S and len(counts) == 5 and len(set(counts)) == 1:
            return {**now, "settle_s": waited}
        await asyncio.sleep(0.5)


async def wait_unloaded(client: httpx.AsyncClient, system: System, deadline_s: float) -> float:
    """Seconds until no Tandem server of the system lists a loaded model."""
    t0 = time.monotonic()
    urls = sorted({e.url for e in system.endpoints if e.tandem})
    if not urls:
        return 0.0
    while True:
        if not any([await loaded_models(client, u) for u in urls]):
            return time.monotonic() - t0
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(f"{system.name}: models still loaded {deadline_s:g} s later")
        await asyncio.sleep(0.25)


def chat_request(model: str, messages: list[dict], max_tokens: int, keep_alive: float | None) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    if keep_alive is not None:
        body["keep_alive"] = f"{keep_alive:g}s"
    return body


async def ask(client: httpx.AsyncClient, end: Endpoint, messages: list[dict], max_tokens: int, timeout: float,
              keep_alive: float | None) -> tuple[RequestResult, dict | None]:
    body = chat_request(end.model, messages, max_tokens, keep_alive if end.tandem else None)
    return await post_chat(client, Target("two-models", end.url, end.model), body, timeout)


# ---------------------------------------------------------------- one system

async def measure(system: System, cfg: TwoModelsConfig, wl: WorkloadConfig, start_s: float) -> dict:
    out: dict = {"start_s": start_s}
    sampler = PeakSampler(system.roots).start()
    try:
        async with httpx.AsyncClient(timeout=None) as client:
            for end in system.startup_models():  # the model(s) the servers started with go: nothing loaded
                r, _ = await ask(client, end, [{"role": "user", "content": "hi"}], 1, wl.timeout_s, 0)
                if not r.ok:
                    raise RuntimeError(f"{system.name}: keep_alive 0 request failed: {r.status} {r.error}")
            await wait_unloaded(client, system, 60.0)
            out["idle_baseline"] = await settled(system)
            out["cold_s"] = []
            for i, end in enumerate(system.endpoints):  # each model's first request, its load included
                r, _ = await ask(client, end, [{"role": "user", "content": user_turn(wl.seed, -1, i, 20)}],
                                 COLD_TOKENS, wl.timeout_s, None)
                if not r.ok:
                    raise RuntimeError(f"{system.name}: cold request to {end.model} failed: {r.status} {r.error}")
                out["cold_s"].append(r.latency)
            before = await model_loads(client, system)
            out["agents"] = await agents(system, cfg, wl, client)
            after = await model_loads(client, system)
            out["agents"]["model_loads"] = after - before if None not in (before, after) else None
            for i, end in enumerate(system.endpoints):  # closing: each model idles out after keep_alive
                r, _ = await ask(client, end, [{"role": "user", "content": user_turn(wl.seed, -2, i, 20)}], 1,
                                 wl.timeout_s, cfg.keep_alive_s)
                if not r.ok:
                    raise RuntimeError(f"{system.name}: closing request to {end.model} failed: {r.status} {r.error}")
            t_last = time.monotonic()
            if system.tandem:
                out["unloaded_after_s"] = await wait_unloaded(client, system, cfg.keep_alive_s + 60.0)
            else:  # no idle unload: the same wait
                await asyncio.sleep(max(0.0, cfg.keep_alive_s + 1.0 - (time.monotonic() - t_last)))
                out["unloaded_after_s"] = None
            out["after_idle"] = await settled(system)
    finally:
        out["peak"] = sampler.stop()
    return out


async def agents(system: System, cfg: TwoModelsConfig, wl: WorkloadConfig, client: httpx.AsyncClient) -> dict:
    """`agents` chat loops of `turns` turns each, alternating models (turn_model)."""
    system_text = system_prompt(wl.seed, "two-models", cfg.system_prompt_words)
    progress = Progress(f"{system.name} two-models", wl.agents * wl.turns)
    results: list[tuple[int, RequestResult]] = []

    async def agent(k: int) -> None:
        history = [{"role": "system", "content": system_text}]
        for t in range(wl.turns):
            history.append({"role": "user", "content": user_turn(wl.seed, k, t, cfg.turn_words)})
            which = turn_model(k, t)
            r, message = await ask(client, system.endpoints[which], history, wl.max_tokens, wl.timeout_s, None)
            results.append((which, r))
            progress.update(r)
            if not r.ok:
                return
            history.append({"role": "assistant", "content": (message or {}).get("content") or ""})

    t0 = time.perf_counter()
    await asyncio.gather(*(agent(k) for k in range(wl.agents)))
    wall = time.perf_counter() - t0
    progress.close()
    ok = [r for _, r in results if r.ok]
    return {"agents": wl.agents, "turns": wl.turns, "wall_s": wall, "turns_ok": len(ok),
            "turns_failed": len(results) - len(ok), "turns_not_sent": wl.agents * wl.turns - len(results),
            "turns_s": len(ok) / wall if wall > 0 else 0.0, "output_tokens": sum(r.output_tokens for r in ok),
            "latency_p50_s": percentile([r.latency for r in ok], 50),
            "latency_p99_s": percentile([r.latency for r in ok], 99),
            "first_error": next((f"{r.status}: {r.error}" for _, r in results if not r.ok), None)}


def bench_system(name: str, repos, snapshots, home: Path, run_dir: Path, taken: set[int], cfg: TwoModelsConfig,
                 wl: WorkloadConfig, args: argparse.Namespace) -> dict:
    entry: dict = {"name": name, "error": None}
    system = System(name, repos, snapshots, home, run_dir, args.port_base, taken, cfg,
                    shlex.split(args.tandem_args), shlex.split(args.mlx_lm_args))
    entry["commands"] = [s.command for s in system.servers]
    entry["logs"] = [str(s.log_path) for s in system.servers]
    try:
        t0 = time.monotonic()
        system.start(args.start_timeout)
        entry.update(asyncio.run(measure(system, cfg, wl, time.monotonic() - t0)))
    except Exception as e:  # recorded: the other systems still run
        entry["error"] = str(e) if isinstance(e, (RuntimeError, TimeoutError)) else f"{type(e).__name__}: {e}"
        print(f"tandem bench: two-models: {name}: {entry['error']}", file=sys.stderr)
    finally:
        system.stop()
    return entry


# ---------------------------------------------------------------- report

def render(entries: list[dict]) -> str:
    rows = []
    for e in entries:
        a = e.get("agents") or {}
        base, after, peak = e.get("idle_baseline") or {}, e.get("after_idle") or {}, e.get("peak") or {}
        gpu = any(x.get("gpu_bytes") for x in (base, after, peak))
        rows.append([e["name"], num(a.get("turns_s"), "{:.2f}"), f"{a.get('turns_ok', 0)}/{a.get('turns_failed', 0)}",
                     num(a.get("latency_p50_s"), "{:.2f}"), num(a.get("model_loads"), "{:d}"),
                     num(e.get("start_s"), "{:.1f}"),
                     " / ".join(num(c, "{:.2f}") for c in e.get("cold_s") or []) or "-",
                     mib(peak.get("rss_bytes")), mib(peak.get("pss_bytes")), mib(base.get("pss_bytes")),
                     mib(after.get("pss_bytes")), num(e.get("unloaded_after_s"), "{:.1f}")]
                    + ([mib(peak.get("gpu_bytes")), mib(base.get("gpu_bytes")), mib(after.get("gpu_bytes"))]
                       if gpu else []))
    gpu = any(len(r) > 12 for r in rows)
    header = ["system", "turns/s", "ok/failed", "p50 s", "loads in run", "start s", "cold A / B s", "peak RSS",
              "peak PSS", "idle baseline PSS", "after idle PSS", "unloaded after s"]
    header += ["peak GPU", "baseline GPU", "after idle GPU"] if gpu else []
    rows = [r + ["-"] * (len(header) - len(r)) for r in rows]
    lines = ["Two models: agents alternating between two models, every process of each system together\n"
             + table(header, rows)]
    lines += [f"{e['name']}: {e['error']}" for e in entries if e.get("error")]
    return "\n\n".join(lines)


def run(args: argparse.Namespace, wl: WorkloadConfig, run_dir: Path) -> int:
    """Every system of --two-models-systems in turn: print the table, write --json."""
    try:
        cfg = config(args)
    except ValueError as e:
        print(f"tandem bench: {e}", file=sys.stderr)
        return 2
    run_dir = run_dir.resolve()
    if cfg.models:
        home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
        repos = cfg.models
        snapshots = {r: snapshot_of(r, home) for r in repos}
    else:
        home = run_dir / "hf"
        repos = RANDOM_REPOS
        print(f"tandem bench: two-models: writing two random {cfg.like} ({cfg.dtype}) into {home}", file=sys.stderr)
        snapshots = write_hub(home, cfg.like, cfg.dtype, tokenizer_dir=cfg.tokenizer_dir)
    print(f"tandem bench: two-models: {', '.join(cfg.systems)}; {', '.join(repos)}; logs in {run_dir}", file=sys.stderr)
    taken: set[int] = set()
    entries: list[dict] = []
    for name in cfg.systems:
        entries.append(bench_system(name, repos, snapshots, home, run_dir, taken, cfg, wl, args))
        if args.json:  # after each system: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps({
                "workload": "two-models", "models": list(repos), "like": cfg.like, "dtype": cfg.dtype,
                "keep_alive_s": cfg.keep_alive_s, "agents": wl.agents, "turns": wl.turns,
                "max_tokens": wl.max_tokens, "command": " ".join(sys.argv), "systems": entries}, indent=2))
    print(render(entries))
    if args.json:
        print(f"\nJSON: {args.json}")
    return 1 if any(e.get("error") for e in entries) else 0
