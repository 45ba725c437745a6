"""`tandem bench`: the same workload against Tandem and its peers, side by side.

    # start each system in turn on the same model, run the sweep, compare
    tandem bench --systems tandem,tandem-colocate,mlx_lm,vllm-mlx --concurrency 1,4,16,64 \\
        --max-tokens 64 --json bench.json --plot bench.png
    # an already-running server
    tandem bench --url http://127.0.0.1:8000 --name mine --workload sweep,prefix
    # what disaggregation is for
    tandem bench --systems tandem,mlx_lm --interference
    # a VLM: multi-turn about one picture, videos cold vs cached (vllm-mlx starts with --mllm)
    tandem bench --systems tandem,mlx_vlm,vllm-mlx --workload vision --model DIR --image-size 1024
    # agents in tool loops over one system prompt and tool set: turns/s, calls that validate
    tandem bench --systems tandem,mlx_lm --workload agents --agents 8 --turns 4
    # Tandem once per power policy, side by side: tok/s and joules per output token
    tandem bench --systems tandem,mlx_lm --tandem-power-policies performance,saver
    # speculative decoding: Tandem with and without, and mlx_lm.server with the same draft
    tandem bench --systems tandem,mlx_lm --workload copy,chat --concurrency 1,4,16 \
        --tandem-speculative off,prompt-lookup,draft --draft-model DRAFT

Workloads (--workload, comma-separated, or `all` for the text ones): sweep,
interference, prefix, swarm (see benchmarks/bench/workloads/core.py), copy (edit a
text, extract fields to JSON, echo a tool call's arguments: copy-heavy answers,
see benchmarks/bench/workloads/copy_heavy.py), chat (short natural questions, see
benchmarks/bench/workloads/chat.py), fairness (short prompts' time to first token
beside a long prompt's prefill, see benchmarks/bench/workloads/fairness.py), vision (a
VLM only, see benchmarks/bench/workloads/vision.py), agents (tool calls, see
benchmarks/bench/workloads/agents.py), soak (many clients for minutes, every
process's memory over time, see benchmarks/bench/workloads/soak.py), chaos
(greedy streams while workers are killed, see benchmarks/bench/workloads/chaos.py;
`--chaos`), two-models (agents alternating between two models: Tandem's one endpoint,
mlx_lm.server, a Tandem server per model; its own systems, see
benchmarks/bench/workloads/two_models.py); copy, chat, fairness, soak, chaos and
two-models are not in `all`. Output: a progress line
on stderr while it runs, tables on stdout at the end, --json for machines
(fields in benchmarks/bench/reporting/report.py), --plot for a PNG. Energy: where the
machine exposes it (RAPL, nvidia-smi, powermetrics as root; see
benchmarks/bench/measures/energy.py), every system's joules per output token,
machine-wide, with the machine's idle draw measured before each start.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.bench.measures import bandwidth
from benchmarks.bench.measures import energy as energy_mod
from benchmarks.bench.measures.energy_run import EnergyRun
from benchmarks.bench.measures.memory import ProcessTreeMemory
from benchmarks.bench.reporting import report as report_mod
from benchmarks.bench.servers.peer_weights import needs_float32_copy, peer_model_folder
from benchmarks.bench.servers.systems import (DRAFT_PEER, POWER_POLICIES, SPECULATIVE, SYSTEMS, ManagedServer,
                                              Options, expand_rows, file_label, pick_port, server_spec, split_row)
from benchmarks.bench.workloads import agents as agents_workload
from benchmarks.bench.workloads import chaos as chaos_workload
from benchmarks.bench.workloads import chat as chat_workload
from benchmarks.bench.workloads import copy_heavy as copy_workload
from benchmarks.bench.workloads import fairness as fairness_workload
from benchmarks.bench.workloads import core as wl
from benchmarks.bench.workloads import soak as soak_workload
from benchmarks.bench.workloads import two_models as two_models_workload
from benchmarks.bench.workloads import vision as vision_workload
from environment.model_folder import is_vlm
from workers.models.store import models_dir, resolve_model

TEXT_WORKLOADS = ("sweep", "interference", "prefix", "swarm")
WORKLOADS = (*TEXT_WORKLOADS, "copy", "chat", "fairness", "vision", "agents", "soak", "chaos", "two-models")
PEERS = ("mlx_lm", "mlx_vlm", "vllm-mlx")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated integers, e.g. 1,4,16,64") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected positive integers")
    return values


def _frame_list(text: str) -> tuple[int, ...]:
    return () if text.strip().lower() in ("none", "0", "") else _int_list(text)


def _name_list(known: tuple[str, ...], all_names: tuple[str, ...] | None = None):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(v.strip() for v in text.split(",") if v.strip())
        if names == ("all",):
            return all_names or known
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(known)}")
        return names
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = wl.WorkloadConfig()
    s = p.add_argument_group("systems")
    s.add_argument("--systems", type=_name_list(SYSTEMS), default=None,
                   help=f"start each in turn on --model and run the same workload: {','.join(SYSTEMS)} "
                        "(default: tandem, unless --url is given)")
    s.add_argument("--url", action="append", default=[], help="base URL of an already-running server (repeatable)")
    s.add_argument("--name", action="append", default=[], help="report name for each --url, in order")
    s.add_argument("--pid", action="append", type=int, default=[],
                   help="process id of each --url server, in order, to report its memory")
    s.add_argument("--served-model", default=None,
                   help="the 'model' field for --url servers (default: the first id in its /v1/models)")
    s.add_argument("--api-key", default=None, help="bearer token for --url servers")
    s.add_argument("--model", default=None, help="model for the started systems, as `tandem serve --model` takes it")
    s.add_argument("--port-base", type=int, default=18100, help="first port of the range the started systems use")
    s.add_argument("--start-timeout", type=float, default=600.0, help="seconds a system gets to load and answer")
    s.add_argument("--peer-weights", choices=("auto", "as-is", "float32"), default="auto",
                   help="auto: on MLX's CPU backend the peers load a float32 copy, as Tandem computes")
    s.add_argument("--tandem-args", default="", help='extra `tandem serve` flags, e.g. "--max-batch 64"')
    _add_variant_arguments(s)
    s.add_argument("--mlx-lm-args", default="", help="extra mlx_lm.server flags")
    s.add_argument("--mlx-vlm-args", default="", help="extra mlx_vlm.server flags")
    s.add_argument("--vllm-mlx-args", default="", help="extra `vllm-mlx serve` flags")
    s.add_argument("--vllm-mlx-bin", default=None,
                   help="vllm-mlx executable (default: the venv benchmarks/bench/peers/setup_vllm_mlx.sh creates)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", type=_name_list(WORKLOADS, TEXT_WORKLOADS), default=("sweep",),
                   help=f"comma-separated from {','.join(WORKLOADS)}, or all: the text ones (default: sweep)")
    w.add_argument("--interference", action="store_true", help="shorthand for --workload interference")
    w.add_argument("--chaos", action="store_true", help="shorthand for --workload chaos (Tandem only)")
    w.add_argument("--concurrency", type=_int_list, default=d.concurrency, help="sweep levels (default: 1,4,16,64)")
    w.add_argument("--requests-per-level", type=int, default=None, help="default: 2 x clients, at least 8")
    w.add_argument("--duration", type=float, default=None, help="seconds per level instead of a request count")
    w.add_argument("--max-tokens", type=int, default=d.max_tokens, help="answer length (greedy)")
    w.add_argument("--prompt-words", type=int, default=d.prompt_words, help="words in each user prompt (~tokens)")
    w.add_argument("--timeout", type=float, default=d.timeout_s, help="deadline of one request, seconds")
    w.add_argument("--ttft-budget", type=float, default=d.ttft_budget_s, help="goodput: time to first token, s")
    w.add_argument("--itl-budget", type=float, default=d.itl_budget_s, help="goodput: mean inter-token time, s")
    w.add_argument("--warmup", type=int, default=d.warmup_rounds, help="warm-up rounds before measuring")
    w.add_argument("--seed", type=int, default=d.seed, help="prompts are a function of the seed")
    w.add_argument("--streams", type=int, default=d.streams, help="interference: decode streams")
    w.add_argument("--stream-tokens", type=int, default=d.stream_tokens, help="interference: tokens per stream")
    w.add_argument("--long-prompt-words", type=int, default=d.long_prompt_words, help="interference: long prompt size")
    w.add_argument("--long-prompts", type=int, default=d.long_prompts, help="interference: at most this many")
    w.add_argument("--system-prompt-words", type=int, default=d.system_prompt_words,
                   help="prefix, swarm and agents: shared system prompt size")
    w.add_argument("--prefix-repeats", type=int, default=d.prefix_repeats)
    w.add_argument("--agents", type=int, default=d.agents, help="swarm and agents: concurrent agents")
    w.add_argument("--turns", type=int, default=d.turns,
                   help="swarm and agents: turns per agent (agents: the last one answers, the others call a tool)")
    w.add_argument("--image-size", type=int, default=d.image_size, help="vision: the picture's side, pixels")
    w.add_argument("--video-frames", type=_frame_list, default=d.video_frames,
                   help="vision: frame counts of the videos (1 fps), or none (default: 4,8,16,32)")
    w.add_argument("--video-size", type=int, default=d.video_size, help="vision: the video frames' side, pixels")
    w.add_argument("--vision-repeats", type=int, default=d.vision_repeats,
                   help="vision: conversations (and videos per frame count), each with new media")
    w.add_argument("--vision-max-tokens", type=int, default=d.vision_max_tokens, help="vision: answer length")
    soak_workload.add_arguments(p)
    chaos_workload.add_arguments(p)
    two_models_workload.add_arguments(p)
    e = p.add_argument_group("energy")
    e.add_argument("--energy", choices=("auto", "off"), default="auto",
                   help="auto: measure with every meter the machine has (RAPL, nvidia-smi, powermetrics as root)")
    e.add_argument("--energy-idle", type=float, default=3.0,
                   help="seconds of the machine's idle draw measured before each system starts (0: none)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, help="write the results as JSON to this path")
    o.add_argument("--plot", default=None, help="write a PNG of throughput and p99 latency vs clients")
    o.add_argument("--log-dir", default=None, help="server logs (default: a new temporary folder)")


def _add_variant_arguments(s) -> None:
    """The flags that run a system more than once, a row per variant (s: the systems argument group)."""
    s.add_argument("--tandem-power-policies", type=_name_list(POWER_POLICIES), default=(),
                   help="run each Tandem system once per `--power-policy`, as rows named e.g. tandem[saver]: "
                        f"comma-separated from {','.join(POWER_POLICIES)}")
    s.add_argument("--tandem-speculative", type=_name_list(SPECULATIVE), default=(),
                   help="run each Tandem system once per `--speculative` mode, as rows named e.g. "
                        f"tandem[spec=prompt-lookup]: comma-separated from {','.join(SPECULATIVE)}; with "
                        "--tandem-power-policies too, a row per pair (tandem[saver,spec=off]). The report compares "
                        "each with its spec=off row")
    s.add_argument("--draft-model", default=None,
                   help="draft model (as `tandem serve --draft-model` takes it) for the spec=draft and spec=auto "
                        f"rows; with mlx_lm in --systems, also a row {DRAFT_PEER}: mlx_lm.server --draft-model "
                        "(a float32 copy on MLX's CPU backend, as for --model)")
    s.add_argument("--spec-tokens", type=int, default=None,
                   help="draft tokens per step: Tandem's --spec-tokens (rows with speculation on) and "
                        f"{DRAFT_PEER}'s --num-draft-tokens (default: each server's own)")


def workload_config(args: argparse.Namespace) -> wl.WorkloadConfig:
    return wl.WorkloadConfig(
        seed=args.seed, timeout_s=args.timeout, max_tokens=args.max_tokens, prompt_words=args.prompt_words,
        concurrency=args.concurrency, requests_per_level=args.requests_per_level, duration_s=args.duration,
        ttft_budget_s=args.ttft_budget, itl_budget_s=args.itl_budget, warmup_rounds=args.warmup,
        streams=args.streams, stream_tokens=args.stream_tokens, long_prompt_words=args.long_prompt_words,
        long_prompts=args.long_prompts, system_prompt_words=args.system_prompt_words,
        prefix_repeats=args.prefix_repeats, agents=args.agents, turns=args.turns, image_size=args.image_size,
        video_frames=args.video_frames, video_size=args.video_size, vision_repeats=args.vision_repeats,
        vision_max_tokens=args.vision_max_tokens)


def run(args: argparse.Namespace) -> int:
    workloads = ("interference",) if args.interference else ("chaos",) if args.chaos else args.workload
    if args.name and len(args.name) != len(args.url):
        print("tandem bench: give one --name per --url", file=sys.stderr)
        return 2
    if "draft" in args.tandem_speculative and not args.draft_model:
        print("tandem bench: --tandem-speculative draft needs --draft-model", file=sys.stderr)
        return 2
    systems = expand_rows(args.systems or (() if args.url else ("tandem",)), args.tandem_power_policies,
                          args.tandem_speculative, draft_peer=bool(args.draft_model))
    cfg = workload_config(args)
    run_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-bench-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if "two-models" in workloads:  # its own systems and servers (benchmarks/bench/workloads/two_models.py)
        return two_models_workload.run(args, cfg, run_dir)
    print(f"tandem bench: {', '.join([*systems, *(args.name or args.url)])}; workloads {', '.join(workloads)}; "
          f"logs in {run_dir}", file=sys.stderr)
    if (args.tandem_power_policies or args.tandem_speculative) and not any(s.startswith("tandem") for s in systems):
        print("tandem bench: --tandem-power-policies and --tandem-speculative apply to the Tandem systems started, "
              "and none is", file=sys.stderr)
    recorder, no_energy = _energy_recorder(args)
    results: list[dict] = []
    try:
        if systems:
            opts = _options(args, systems, run_dir, workloads)
            taken: set[int] = set()
            for name in systems:
                results.append(_bench_started(name, opts, pick_port(args.port_base, taken), cfg, workloads, args,
                                              recorder))
        for i, url in enumerate(args.url):
            name = args.name[i] if args.name else f"server{i + 1}"
            pid = args.pid[i] if i < len(args.pid) else None
            results.append(_bench_url(name, url, pid, cfg, workloads, args, recorder))
    except KeyboardInterrupt:
        print("\ntandem bench: interrupted; servers stopped", file=sys.stderr)
        return 130
    except Exception as e:  # model resolution and the like: one line
        print(f"tandem bench: {e}", file=sys.stderr)
        return 2
    finally:
        if recorder:
            recorder.stop()
    _add_single_stream(results, args)
    config = {**dataclasses.asdict(cfg), "workloads": list(workloads), "model": args.model,
              "peer_weights": args.peer_weights, "tandem_power_policies": list(args.tandem_power_policies),
              "tandem_speculative": list(args.tandem_speculative), "draft_model": args.draft_model,
              "spec_tokens": args.spec_tokens,
              "energy": {"meters": recorder.describe() if recorder else [], "unavailable": no_energy,
                         "idle_seconds": args.energy_idle, "scope": energy_mod.SCOPE}}
    rep = report_mod.build_report(results, config, shlex.join(["tandem", "bench", *sys.argv[2:]])
                                  if len(sys.argv) > 1 and sys.argv[1] == "bench" else shlex.join(sys.argv))
    print(report_mod.render(rep))
    if args.json:
        report_mod.write_json(rep, args.json)
        print(f"\nJSON: {args.json}")
    if args.plot:
        problem = report_mod.plot(rep, args.plot)
        print(f"plot: {problem}" if problem else f"plot: {args.plot}")
    return 1 if any(r.get("error") for r in results) else 0


def _energy_recorder(args: argparse.Namespace):
    """(the started recorder, or None; {meter: why it is not used})."""
    if args.energy == "off":
        return None, {"all": "--energy off"}
    recorder, missing = energy_mod.EnergyRecorder.open()
    if recorder is None:
        print("tandem bench: energy: none on this machine (" + "; ".join(f"{k}: {v}" for k, v in missing.items())
              + ")", file=sys.stderr)
        return None, missing
    print(f"tandem bench: energy: {', '.join(recorder.domains)} (machine-wide)", file=sys.stderr)
    return recorder.start(), missing


def _options(args: argparse.Namespace, systems: tuple[str, ...], run_dir: Path,
             workloads: tuple[str, ...] = ()) -> Options:
    model_dir = resolve_model(args.model)
    peer_dir = model_dir
    peers = {split_row(s)[0] for s in systems} & set(PEERS)
    if is_vlm(model_dir) and peers:
        # The float32 copy is made with the text loader: it would drop the vision tower.
        if needs_float32_copy(model_dir) and args.peer_weights != "as-is":
            print(f"tandem bench: peers load the VLM folder {model_dir} as it is (no float32 copy of a VLM; "
                  "on the CPU backend make it with `tandem random-model ... --dtype float32`)", file=sys.stderr)
    elif peers:
        print("tandem bench: preparing the peers' model folder ...", file=sys.stderr)
        peer_dir = peer_model_folder(model_dir, args.peer_weights, models_dir() / "peer-float32")
        if peer_dir != model_dir:
            print(f"tandem bench: peers load {peer_dir} (float32, as Tandem computes on this backend)",
                  file=sys.stderr)
    draft_dir = None
    if DRAFT_PEER in systems:  # the draft in the same form as the target, so the peer's step is comparable
        draft_dir = peer_model_folder(resolve_model(args.draft_model), args.peer_weights, models_dir() / "peer-float32")
    return Options(model_spec=args.model, model_dir=model_dir, peer_model_dir=peer_dir, run_dir=run_dir,
                   tandem_args=shlex.split(args.tandem_args), mlx_lm_args=shlex.split(args.mlx_lm_args),
                   mlx_vlm_args=shlex.split(args.mlx_vlm_args), vllm_mlx_args=shlex.split(args.vllm_mlx_args),
                   vllm_mlx_bin=args.vllm_mlx_bin, vllm_mlx_mllm="vision" in workloads,
                   draft_model=args.draft_model, peer_draft_model_dir=draft_dir, spec_tokens=args.spec_tokens)


def _bench_started(name: str, opts: Options, port: int, cfg: wl.WorkloadConfig, workloads, args,
                   recorder: energy_mod.EnergyRecorder | None = None) -> dict:
    entry: dict = {"name": name, "url": None, "command": None, "model_dir": None, "log": None, "error": None,
                   "memory": None, "energy": None, "results": {}}
    try:
        spec = server_spec(name, port, opts)
    except (RuntimeError, ValueError) as e:
        entry["error"] = str(e)
        print(f"tandem bench: {name}: {e}", file=sys.stderr)
        return entry
    server = ManagedServer(spec, opts.run_dir / f"{file_label(name)}.log")
    entry.update(url=spec.base_url, command=server.command, log=str(server.log_path),
                 model_dir=str(opts.model_dir if name.startswith("tandem") else opts.peer_model_dir))
    energy = EnergyRun(recorder) if recorder else None
    if energy:
        energy.measure_idle(args.energy_idle)  # before the start: the machine without this system
    print(f"tandem bench: starting {name}: {server.command}", file=sys.stderr)
    try:
        t0 = time.monotonic()
        server.start(args.start_timeout)
        target = wl.Target(name, spec.base_url, spec.request_model)
        metrics_url = spec.base_url + spec.metrics_path if spec.metrics_path else None
        entry["results"], entry["warmup_failed"] = asyncio.run(
            _measure(target, cfg, workloads, t0 + args.start_timeout, metrics_url, soak_workload.SoakRun(
                soak_workload.config(args), server.proc.pid, lambda: _roles(server.log_tail(1 << 20))),
                (chaos_workload.config(args), server.proc.pid), energy))
        if not server.alive():
            entry["error"] = f"{name} exited during the run; log {server.log_path}"
    except Exception as e:  # recorded: the other systems still run
        entry["error"] = str(e) if isinstance(e, (RuntimeError, TimeoutError)) else f"{type(e).__name__}: {e}"
        print(f"tandem bench: {name}: {entry['error']}", file=sys.stderr)
    finally:
        server.stop()
        if server.memory:
            entry["memory"] = _labelled(server.memory.report(), server.log_tail(1 << 20), server.proc.pid)
        entry["energy"] = energy.report() if energy else None
    return entry


def _bench_url(name: str, url: str, pid: int | None, cfg: wl.WorkloadConfig, workloads, args,
               recorder: energy_mod.EnergyRecorder | None = None) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    entry: dict = {"name": name, "url": url, "command": None, "model_dir": None, "log": None, "error": None,
                   "memory": None, "energy": None, "results": {}}
    energy = EnergyRun(recorder) if recorder else None
    if energy:
        energy.measure_idle(args.energy_idle)  # the machine with the server running, idle
    memory = ProcessTreeMemory(pid) if pid else None
    if memory:
        memory.start()
    try:
        model = args.served_model or _first_model(url, headers) or "default"
        target = wl.Target(name, url, model, headers)
        metrics_url = url.rstrip("/") + "/metrics"
        entry["results"], entry["warmup_failed"] = asyncio.run(
            _measure(target, cfg, workloads, time.monotonic() + 60, metrics_url,
                     soak_workload.SoakRun(soak_workload.config(args), pid), (chaos_workload.config(args), pid),
                     energy))
    except Exception as e:  # recorded: the other systems still run
        entry["error"] = str(e) if isinstance(e, (RuntimeError, TimeoutError)) else f"{type(e).__name__}: {e}"
        print(f"tandem bench: {name}: {entry['error']}", file=sys.stderr)
    finally:
        if memory:
            memory.stop()
            entry["memory"] = memory.report()
        entry["energy"] = energy.report() if energy else None
    return entry


async def _measure(target: wl.Target, cfg: wl.WorkloadConfig, workloads, ready_deadline: float,
                   metrics_url: str | None, soak: soak_workload.SoakRun | None = None,
                   chaos: tuple | None = None, energy: EnergyRun | None = None) -> tuple[dict, int]:
    """Warm up, then each workload in turn; with `energy`, each workload's window (after the warm-up)."""
    warmup_failed = await wl.warm_up(target, cfg, ready_deadline)
    out: dict = {}
    for name in workloads:
        start = energy.mark() if energy else None
        await _workload(name, out, target, cfg, metrics_url, soak, chaos, energy)
        if energy:
            energy.workload(name, start, out.get(name))
    return out, warmup_failed


async def _workload(name: str, out: dict, target: wl.Target, cfg: wl.WorkloadConfig, metrics_url: str | None,
                    soak: soak_workload.SoakRun | None, chaos: tuple | None, energy: EnergyRun | None) -> None:
    if name == "sweep":
        out["sweep"] = await wl.sweep(target, cfg, energy, metrics_url)
    elif name == "copy":
        out["copy"] = await copy_workload.copy(target, cfg, energy, metrics_url)
    elif name == "chat":
        out["chat"] = await chat_workload.chat(target, cfg, energy, metrics_url)
    elif name == "interference":
        out["interference"] = await wl.interference(target, cfg)
    elif name == "prefix":
        out["prefix"] = await wl.prefix(target, cfg)
    elif name == "fairness":
        out["fairness"] = await fairness_workload.fairness(target, cfg)
    elif name == "swarm":
        out["swarm"] = await wl.swarm(target, cfg, metrics_url)
    elif name == "vision":
        out["vision"] = await vision_workload.vision(target, cfg, metrics_url)
    elif name == "agents":
        out["agents"] = await agents_workload.agents(target, cfg, metrics_url)
    elif name == "chaos":
        out["chaos"] = await chaos_workload.chaos(target, *(chaos or (chaos_workload.ChaosConfig(), None)))
    elif name == "soak":
        out["soak"] = await soak_workload.soak(target, soak or soak_workload.SoakRun(soak_workload.SoakConfig()))


def _add_single_stream(results: list[dict], args: argparse.Namespace) -> None:
    """Single-stream decode against the memory-bandwidth limit, for systems
    whose sweep has a one-client level. Measured after the servers stopped,
    so the copy does not compete with them."""
    with_c1 = [r for r in results if any(lv["concurrency"] == 1 for lv in r.get("results", {}).get("sweep", []))]
    if not with_c1:
        return
    weight_bytes = None
    if args.model or args.systems:
        try:
            weight_bytes = bandwidth.computed_weight_bytes(resolve_model(args.model))
        except Exception as e:  # an unknown architecture: report tokens/s without the share
            print(f"tandem bench: weight bytes unknown ({e})", file=sys.stderr)
    bw = bandwidth.copy_bandwidth()
    for r in with_c1:
        r["results"]["single_stream"] = bandwidth.single_stream(r["results"]["sweep"], weight_bytes, bw)


def _first_model(url: str, headers: dict | None) -> str | None:
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, AttributeError):
        return None


def _labelled(memory: dict, log: str, root_pid: int) -> dict:
    """Name Tandem's processes by role from the supervisor's 'started X (pid N)' lines."""
    roles: dict[int, str | None] = dict(_roles(log))
    roles.setdefault(root_pid, None)
    for p in memory["processes"]:
        if p["pid"] in roles and roles[p["pid"]]:
            p["name"] = roles[p["pid"]]
        elif p["pid"] == root_pid and "deploy.cli" in p["name"]:
            p["name"] = "supervisor"
    return memory


def _roles(log: str) -> dict[int, str]:
    """pid -> role, from the supervisor's 'started X (pid N)' lines (restarts included)."""
    return {int(pid): role for role, pid in re.findall(r"started (\S+) \(pid (\d+)\)", log)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
