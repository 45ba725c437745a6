"""The results of a `tandem bench` run: text tables, ratios, JSON and a PNG plot.

JSON (--json PATH), schema "tandem-bench/1":

    {
      "schema": "tandem-bench/1",
      "created": "2026-11-22T10:00:00+00:00",
      "machine": {"platform", "machine", "cpus", "python"},
      "command": "tandem bench ...",
      "config": {...the workload settings..., "tandem_power_policies": [...], "tandem_speculative": [...],
                 "draft_model", "spec_tokens",
                 "energy": {"meters": [{"meter", "method", "domains", "errors", "last_error"}],
                            "unavailable": {meter: why}, "idle_seconds", "scope"}},
      "systems": [{
          "name": "tandem", "url": "http://127.0.0.1:18100", "command": "..." | null,
          "model_dir": "..." | null, "log": "path" | null,
          "error": null | "why the system could not run",
          "warmup_failed": 0,
          "memory": null | {"processes": [{"pid", "name", "peak_rss_bytes"}],
                            "sum_of_peaks_bytes", "peak_total_rss_bytes", "peak_total_pss_bytes", "method"},
          "energy": null (no meter) | {"scope": "machine-wide: ...", "meters": [...], "domains": ["rapl:package-0",
                     "nvidia-smi:gpu0 board", ...], "idle": null | {"seconds", "watts", "joules"},
                     "joules", "seconds", "watts", "by_domain": {domain: joules}  (every workload after warm-up),
                     "output_tokens", "joules_per_output_token", "joules_per_output_token_above_idle"
                     (the workloads that count output tokens), "workloads": {name: {"joules", "seconds", "watts",
                     "by_domain", "output_tokens", "joules_per_output_token", "..._above_idle"}}}
                    (benchmarks/bench/measures/energy_run.py),
          "results": {
            "sweep": [{"concurrency", "requests", "ok", "errors": {status: n}, "error_count",
                       "rejected_429", "rejected_latency_p99_s", "wall_s", "output_tokens", "output_tok_s",
                       "requests_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s",
                       "tpot_p50_s", "tpot_p99_s",
                       "latency_p50_s", "goodput", "goodput_requests_s", "prompt_tokens",
                       "cached_tokens", "first_error", "energy" (with a meter): {"joules", "seconds", "watts",
                       "output_tokens", "joules_per_output_token", "joules_per_output_token_above_idle"},
                       "spec" (where /metrics counts speculative tokens): {"proposed_tokens",
                       "accepted_tokens", "acceptance_rate"}}],
            "copy", "chat": levels as the sweep's (benchmarks/bench/workloads/copy_heavy.py, chat_workload.py),
            "fairness": {"long_alone_ttft_s", "long_beside_ttft_s", "long_ratio", "short_alone_ttft_s",
                         "short_beside_ttft_s": [...], "short_beside_max_ttft_s", "short_ratio", ...}
                        (benchmarks/bench/workloads/fairness.py),
            "interference": {"streams", "stream_tokens",
                             "quiet": {"ok", "error_count", "errors", "output_tokens", "itl_p50_s", "itl_p99_s",
                                       "itl_max_s", "ttft_p50_s", "wall_s", "first_error",
                                       "itl_p50_after_join_s", "itl_p99_after_join_s", "gaps_after_join"
                                       (the gaps that begin once every stream decodes: after the last
                                       stream's second text), "last_join_s" (that text, seconds from
                                       the run's start), "itl_p99_after_first_tokens_s" (the gaps whose
                                       text came after the last stream's first text), "last_first_token_s",
                                       "arrivals_s": [[each stream's text arrivals, s from the start]],
                                       "started_unix" (that start, Unix time)},
                             "loud": {...as quiet, "itl_p99_during_long_s", "gaps_during_long",
                                      "long_prompts_sent", "long_prompts_ok", "long_prompt_tokens"},
                             "itl_p99_ratio", "itl_p99_during_long_ratio"},
            "prefix": {"cold_ttft_s", "warm_ttft_s", "next_turn_ttft_s", "suffix_alone_ttft_s",
                       "*_prompt_tokens", "*_cached_tokens", "warm_speedup", "errors", "repeats": [...]},
            "swarm": {"agents", "turns", "wall_s", "turns_ok", "turns_failed", "rejected_429",
                      "prompt_tokens", "cached_tokens", "computed_prompt_tokens", "computed_source",
                      "output_tokens", "ttft_p50_s", "ttft_p99_s", ...},
            "single_stream": {"decode_tok_s", "weight_bytes", "copy_bandwidth_bytes_s", "limit_tok_s",
                              "bandwidth_share"}   (with a one-client sweep level),
            "vision": {"image_size", "video_size", "max_tokens", "warmup_errors": [...], "video_transport": "data" | "http" | null,
                       "turn1_ttft_s", "turn2_ttft_s", "turn3_ttft_s", "text_ttft_s"  (medians of repeats),
                       "{turn1,turn2,turn3,text}_prompt_tokens", "..._cached_tokens",
                       "turn3_added_tokens" (turn 3's prompt less turn 2's: what the text-only request matches),
                       "turn3_computed_tokens" (prompt less cached, where reported), "template_overhead_tokens",
                       "turn1_over_turn3", "turn3_over_text", "errors", "first_error",
                       "repeats": [{"turn1", "turn2", "turn3", "text": {"ok", "status", "ttft_s",
                                    "prompt_tokens", "cached_tokens", "error"}, "turn3_added_tokens", "text_words"}],
                       "video": [{"frames", "cold_ttft_s", "cached_ttft_s", "cold_prompt_tokens",
                                  "cached_cached_tokens", "cold_over_cached", "errors", "first_error",
                                  "repeats": [{"cold", "cached"}], ...}],
                       "vision_cache": null | {"queries", "hits"}  (Tandem's /metrics, whole workload)},
            "agents": {"agents", "turns", "tools", "wall_s", "turns_ok", "turns_failed", "turns_not_sent",
                       "rejected_429", "turns_s", "prompt_tokens", "cached_tokens", "computed_prompt_tokens",
                       "computed_source", "metrics_computed_prompt_tokens" (Tandem), "calls_expected"
                       (answered "required" steps), "calls_parsed", "calls_valid", "calls_returned",
                       "parsed_share", "valid_share", "final_answers", "final_calls", "call_problems": [...],
                       "output_tokens", "latency_p50_s", "latency_p99_s", "first_error", "per_turn": [...]},
            "chaos": {"streams", "max_tokens", "reference_failed", "kills": [{"at_s", "role", "pid"}], "failed",
                      "errors", "outputs_differing", "moves", "output_tokens", "wall_s", "arena_segments"}
          }}],
      "ratios": [{"tandem": "tandem", "peer": "mlx_lm", ...metric: tandem value / peer value,
                  "sweep" | "copy" | "chat": {clients: {"output_tok_s", "ttft_p99_s", "itl_p99_s", "goodput"}}}]
      (swarm: also per served turn, when the two served different numbers of turns; a Tandem row
      with speculation also against its spec=off row: {"tandem": "tandem[spec=draft]",
      "peer": "tandem[spec=off]", ...})
    }

Ratios are always Tandem / peer: above 1 is better for throughput, below 1
is better for latencies, times, computed tokens, memory and energy. A system
named tandem[saver] is Tandem under `--power-policy saver` (--tandem-power-policies),
tandem[spec=draft] under `--speculative draft` (--tandem-speculative), both as
tandem[saver,spec=draft]; mlx_lm[draft] is mlx_lm.server --draft-model.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

from benchmarks.bench.measures.energy_run import energy_table
from benchmarks.bench.reporting.levels import level_ratio_rows, level_ratios, level_tables, ratio
from benchmarks.bench.reporting.text_table import mib, num, table, times
from benchmarks.bench.servers.systems import spec_baseline
from benchmarks.bench.workloads.fairness import fairness_table

SCHEMA = "tandem-bench/1"


def is_tandem(name: str) -> bool:
    return name.startswith("tandem")


def build_report(systems: list[dict], config: dict, command: str) -> dict:
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "command": command,
        "config": config,
        "systems": systems,
        "ratios": ratios(systems),
    }


def _per_turn(swarm: dict, key: str):
    value = swarm.get(key)
    return value / swarm["turns_ok"] if isinstance(value, (int, float)) and swarm.get("turns_ok") else None


def ratios(systems: list[dict]) -> list[dict]:
    """Every Tandem system against every peer that ran, then each Tandem row
    with speculation against its spec=off row (tandem[spec=draft] / tandem[spec=off])."""
    ran = [s for s in systems if not s.get("error")]
    tandems = [s for s in ran if is_tandem(s["name"])]
    by_name = {s["name"]: s for s in ran}
    pairs = [(t, p) for t in tandems for p in ran if not is_tandem(p["name"])]
    pairs += [(t, by_name[spec_baseline(t["name"])]) for t in tandems if spec_baseline(t["name"]) in by_name]
    return [_pair_ratios(t, p) for t, p in pairs]


def _pair_ratios(t: dict, p: dict) -> dict:
    """t's figures over p's, for what both ran."""
    tr, pr = t.get("results", {}), p.get("results", {})
    row: dict = {"tandem": t["name"], "peer": p["name"], **level_ratios(tr, pr)}
    if "interference" in tr and "interference" in pr:
        tq, pq = tr["interference"]["quiet"], pr["interference"]["quiet"]
        row["interference_quiet_itl_p99"] = ratio(tq["itl_p99_s"], pq["itl_p99_s"])
        row["interference_quiet_after_first_tokens_itl_p99"] = ratio(tq.get("itl_p99_after_first_tokens_s"),
                                                                      pq.get("itl_p99_after_first_tokens_s"))
        row["interference_quiet_after_join_itl_p99"] = ratio(tq.get("itl_p99_after_join_s"),
                                                              pq.get("itl_p99_after_join_s"))
        tl, pl = tr["interference"]["loud"], pr["interference"]["loud"]
        row["interference_loud_itl_p99"] = ratio(tl["itl_p99_s"], pl["itl_p99_s"])
        row["interference_during_long_itl_p99"] = ratio(tl.get("itl_p99_during_long_s"),
                                                         pl.get("itl_p99_during_long_s"))
    if "prefix" in tr and "prefix" in pr:
        row["prefix_cold_ttft"] = ratio(tr["prefix"]["cold_ttft_s"], pr["prefix"]["cold_ttft_s"])
        row["prefix_warm_ttft"] = ratio(tr["prefix"]["warm_ttft_s"], pr["prefix"]["warm_ttft_s"])
    if "vision" in tr and "vision" in pr:
        tv, pv = tr["vision"], pr["vision"]
        for key in ("turn1", "turn3", "text"):
            row[f"vision_{key}_ttft"] = ratio(tv[f"{key}_ttft_s"], pv[f"{key}_ttft_s"])
        peer_video = {v["frames"]: v for v in pv.get("video", [])}
        row["video"] = {str(v["frames"]): {k: ratio(v[f"{k}_ttft_s"], peer_video[v["frames"]][f"{k}_ttft_s"])
                                           for k in ("cold", "cached")}
                        for v in tv.get("video", []) if v["frames"] in peer_video}
    if "swarm" in tr and "swarm" in pr:
        ts, ps = tr["swarm"], pr["swarm"]
        row["swarm_wall"] = ratio(ts["wall_s"], ps["wall_s"])
        row["swarm_computed_prompt_tokens"] = ratio(ts["computed_prompt_tokens"], ps["computed_prompt_tokens"])
        if ts["turns_ok"] != ps["turns_ok"]:
            # A system that drops agents does less work: compare per turn it served too.
            row["swarm_wall_per_turn"] = ratio(_per_turn(ts, "wall_s"), _per_turn(ps, "wall_s"))
            row["swarm_computed_per_turn"] = ratio(_per_turn(ts, "computed_prompt_tokens"),
                                                    _per_turn(ps, "computed_prompt_tokens"))
    if "agents" in tr and "agents" in pr:
        ta, pa = tr["agents"], pr["agents"]
        row["agents_turns_s"] = ratio(ta["turns_s"], pa["turns_s"])
        row["agents_computed_prompt_tokens"] = ratio(ta["computed_prompt_tokens"],
                                                      pa["computed_prompt_tokens"])
    if t.get("memory") and p.get("memory"):
        key = "peak_total_pss_bytes" if t["memory"].get("peak_total_pss_bytes") and \
            p["memory"].get("peak_total_pss_bytes") else "peak_total_rss_bytes"
        row["memory_peak_total"] = ratio(t["memory"][key], p["memory"][key])
    if t.get("energy") and p.get("energy"):
        row["joules_per_output_token"] = ratio(t["energy"]["joules_per_output_token"],
                                                p["energy"]["joules_per_output_token"])
    return row


def write_json(report: dict, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


# ------------------------------------------------------------------ text

def render(report: dict) -> str:
    systems = report["systems"]
    parts = [f"{s['name']}: did not run: {s['error'].splitlines()[0]}" for s in systems if s.get("error")]
    parts += level_tables(systems)
    parts += _interference_table(systems)
    parts += _prefix_table(systems)
    parts += fairness_table(systems)
    parts += _swarm_table(systems)
    parts += _agents_table(systems)
    parts += _chaos_table(systems)
    parts += _vision_tables(systems)
    parts += _single_stream_table(systems)
    parts += _memory_table(systems)
    parts += energy_table(systems, report.get("config", {}).get("energy"))
    parts += _ratios_table(report["ratios"])
    return "\n\n".join(parts)


def _interference_table(systems: list[dict]) -> list[str]:
    rows = []
    for s in systems:
        it = s.get("results", {}).get("interference")
        if it:
            q, loud = it["quiet"], it["loud"]
            rows.append([s["name"], it["streams"], num(q["ttft_p50_s"]), num(q["itl_p50_s"]), num(q["itl_p99_s"]),
                         num(q.get("itl_p99_after_first_tokens_s")), num(q.get("itl_p99_after_join_s")),
                         num(loud["itl_p99_s"]),
                         times(it["itl_p99_ratio"]),
                         num(loud.get("itl_p99_during_long_s")), times(it.get("itl_p99_during_long_ratio")),
                         num(loud["itl_max_s"]), f"{loud.get('long_prompts_ok', 0)}/{loud.get('long_prompts_sent', 0)}",
                         num(loud.get("long_prompt_tokens"), "{:.0f}"), q["error_count"] + loud["error_count"]])
    if not rows:
        return []
    return ["Interference: decode streams' inter-token latency (s), quiet vs while long prompts arrive; quiet "
            "after 1st tokens: the gaps ending after every stream's first token; after join: the gaps beginning "
            "once every stream decodes (after its second token)\n"
            + table(["system", "streams", "quiet TTFT p50", "quiet p50", "quiet p99", "after 1st tokens p99",
                     "after join p99",
                     "loud p99", "loud/quiet", "during-long p99", "during/quiet", "loud max", "long ok",
                     "long tokens", "errors"], rows)]


def _prefix_table(systems: list[dict]) -> list[str]:
    rows = []
    for s in systems:
        p = s.get("results", {}).get("prefix")
        if p:
            rows.append([s["name"], num(p["cold_prompt_tokens"], "{:.0f}"), num(p["cold_ttft_s"]),
                         num(p["warm_ttft_s"]),
                         times(p["warm_speedup"]), num(p["warm_cached_tokens"], "{:.0f}", "not reported"),
                         num(p["next_turn_ttft_s"]), num(p["next_turn_cached_tokens"], "{:.0f}", "not reported"),
                         num(p["suffix_alone_ttft_s"]), p["errors"]])
    if not rows:
        return []
    return ["Prefix: long system prompt, time to first token (s), median of repeats\n" + table(
        ["system", "prompt", "cold", "warm", "cold/warm", "warm cached", "next turn", "next cached",
         "suffix alone", "errors"], rows)]


def _swarm_table(systems: list[dict]) -> list[str]:
    rows = []
    for s in systems:
        w = s.get("results", {}).get("swarm")
        if w:
            computed = w["computed_prompt_tokens"]
            rows.append([s["name"], f"{w['agents']}x{w['turns']}", num(w["wall_s"], "{:.1f}"), w["turns_ok"],
                         w["turns_failed"], w["rejected_429"], w["prompt_tokens"],
                         "not reported" if computed is None else f"{computed:.0f} ({w['computed_source']})",
                         num(w["ttft_p99_s"])])
    if not rows:
        return []
    return ["Swarm: agents x turns, shared system prompt + own history\n" + table(
        ["system", "agents", "wall s", "ok", "failed", "429", "prompt tok", "computed prompt tok",
         "TTFT p99"], rows)]


def _agents_table(systems: list[dict]) -> list[str]:
    rows, notes = [], []
    for s in systems:
        a = s.get("results", {}).get("agents")
        if not a:
            continue
        computed = a["computed_prompt_tokens"]
        share = "-" if a["valid_share"] is None else f"{a['valid_share'] * 100:.0f}%"
        rows.append([s["name"], f"{a['agents']}x{a['turns']}", num(a["turns_s"], "{:.2f}"), a["turns_ok"],
                     a["turns_failed"], a["rejected_429"], a["prompt_tokens"],
                     num(a["cached_tokens"], "{:.0f}", "not reported"),
                     "not reported" if computed is None else f"{computed:.0f} ({a['computed_source']})",
                     f"{a['calls_expected']} / {a['calls_parsed']} / {a['calls_valid']} ({share})",
                     a["final_answers"], a["output_tokens"], num(a["wall_s"], "{:.1f}")])
        if a.get("first_error"):
            notes.append(f"  {s['name']}: first error {a['first_error']}"[:300])
        notes += [f"  {s['name']}: {p}"[:200] for p in a.get("call_problems", [])[:3]]
    if not rows:
        return []
    return ["Agents: tool loops over one shared system prompt and tool set (calls: required steps answered "
            "/ with parsed calls / schema-valid)\n" + table(
                ["system", "agents", "turns/s", "ok", "failed", "429", "prompt tok", "cached tok",
                 "computed prompt tok", "calls exp / parsed / valid", "answers", "out tok", "wall s"], rows)
            + ("\n" + "\n".join(notes) if notes else "")]


def _chaos_table(systems: list[dict]) -> list[str]:
    rows = []
    for s in systems:
        c = s.get("results", {}).get("chaos")
        if not c:
            continue
        kills = ", ".join(f"{k['role']}@{k['at_s']:g}s" for k in c["kills"]) or "none"
        rows.append([s["name"], c["streams"], c["max_tokens"], kills, c["moves"], c["failed"],
                     c["outputs_differing"], c["reference_failed"], c["output_tokens"], num(c["wall_s"], "{:.1f}"),
                     "-" if c["arena_segments"] is None else len(c["arena_segments"])])
    if not rows:
        return []
    return ["Chaos: greedy streams while workers are killed with SIGKILL (failed and differing must be 0)\n"
            + table(["system", "streams", "max tok", "kills", "moves", "failed", "differing", "ref failed",
                      "out tok", "wall s", "arenas"], rows)]


def _single_stream_table(systems: list[dict]) -> list[str]:
    rows = []
    for s in systems:
        b = s.get("results", {}).get("single_stream")
        if b:
            rows.append([s["name"], num(b["decode_tok_s"], "{:.1f}"), mib(b["weight_bytes"]),
                         num(b["copy_bandwidth_bytes_s"] and b["copy_bandwidth_bytes_s"] / 1e9, "{:.1f}"),
                         num(b["limit_tok_s"], "{:.1f}"), num(b["bandwidth_share"], "{:.2f}")])
    if not rows:
        return []
    return ["Single-stream decode vs the memory-bandwidth limit (1 / median inter-token gap at 1 client)\n"
            + table(["system", "decode tok/s", "weights", "copy GB/s", "limit tok/s", "share"], rows)]


def _memory_table(systems: list[dict]) -> list[str]:
    rows = []
    for s in systems:
        m = s.get("memory")
        if m:
            procs = ", ".join(f"{p['name']} {mib(p['peak_rss_bytes'])}" for p in m["processes"])
            pss = m.get("peak_total_pss_bytes")
            rows.append([s["name"], mib(pss) if pss else "-", mib(m["peak_total_rss_bytes"]),
                         mib(m["sum_of_peaks_bytes"]), procs])
    if not rows:
        return []
    return ["Peak memory: summed PSS (shared pages counted once: what ratios compare), summed RSS "
            "(shared pages once per process), sum of per-process RSS peaks, each process's RSS peak\n"
            + table(["system", "peak PSS", "peak RSS", "sum of peaks", "processes"], rows)]


_RATIO_LABELS = (("interference_quiet_itl_p99", "interference quiet ITL p99"),
                 ("interference_quiet_after_first_tokens_itl_p99", "interference quiet ITL p99 after 1st tokens"),
                 ("interference_quiet_after_join_itl_p99", "interference quiet ITL p99 after join"),
                 ("interference_loud_itl_p99", "interference loud ITL p99"),
                 ("interference_during_long_itl_p99", "interference during-long ITL p99"),
                 ("prefix_cold_ttft", "prefix cold TTFT"), ("prefix_warm_ttft", "prefix warm TTFT"),
                 ("vision_turn1_ttft", "vision turn 1 TTFT"), ("vision_turn3_ttft", "vision turn 3 TTFT"),
                 ("vision_text_ttft", "vision text-only TTFT"),
                 ("swarm_wall", "swarm wall time"),
                 ("swarm_computed_prompt_tokens", "swarm computed prompt tokens"),
                 ("swarm_wall_per_turn", "swarm wall time per served turn"),
                 ("swarm_computed_per_turn", "swarm computed tokens per served turn"),
                 ("agents_turns_s", "agents turns/s"),
                 ("agents_computed_prompt_tokens", "agents computed prompt tokens"),
                 ("memory_peak_total", "peak memory"), ("joules_per_output_token", "joules per output token"))


def _ratios_table(ratio_rows: list[dict]) -> list[str]:
    rows = []
    for r in ratio_rows:
        rows += level_ratio_rows(r)
        for key, label in _RATIO_LABELS:
            if key in r:
                rows.append([f"{r['tandem']} / {r['peer']}", label, times(r[key]), "", ""])
        for n, m in (r.get("video") or {}).items():
            rows.append([f"{r['tandem']} / {r['peer']}", f"video {n} frames cold / cached TTFT",
                         f"{times(m['cold'])} / {times(m['cached'])}", "", ""])
    if not rows:
        return []
    return ["Ratios, Tandem / peer, and Tandem with speculation / the same without (tandem[spec=X] / "
            "tandem[spec=off]) (throughput: higher is better; times, tokens, memory, energy: lower)\n"
            + table(["pair", "measure", "value / tok/s", "TTFT p99", "ITL p99"], rows)]


def _vision_tables(systems: list[dict]) -> list[str]:
    parts, rows, errs = [], [], []
    runs = [(s["name"], s["results"]["vision"]) for s in systems if s.get("results", {}).get("vision")]
    for name, v in runs:
        rows.append([name, num(v["turn1_prompt_tokens"], "{:.0f}"), num(v["turn1_ttft_s"]), num(v["turn2_ttft_s"]),
                     num(v["turn3_ttft_s"]), (f"{num(v['turn3_prompt_tokens'], '{:.0f}')}/"
                                             f"{num(v['turn3_cached_tokens'], '{:.0f}', 'not reported')}"),
                     num(v["turn3_computed_tokens"], "{:.0f}"), num(v["text_ttft_s"]),
                     num(v["text_prompt_tokens"], "{:.0f}"), times(v["turn1_over_turn3"]), times(v["turn3_over_text"]),
                     v["errors"]])
        if v["errors"]:
            errs.append(f"  {name} image: {v['errors']} failed; first: {v['first_error']}")
        for w in v.get("warmup_errors") or []:
            errs.append(f"  {name} warm-up {w}"[:300])
    if rows:
        v0 = runs[0][1]
        parts.append(f"Vision: one {v0['image_size']}x{v0['image_size']} picture, 3 turns (each resends the whole "
                     f"conversation), then text-only with as many new tokens as turn 3 adds; time to first token "
                     f"(s), median of {len(v0['repeats'])} repeats\n" + table(
                         ["system", "turn1 tok", "turn 1", "turn 2", "turn 3", "t3 prompt/cached", "t3 computed",
                          "text-only", "text tok", "turn1/turn3", "turn3/text", "errors"], rows))
    rows = []
    for name, v in runs:
        for row in v.get("video") or []:
            rows.append([name, v.get("video_transport") or "-", row["frames"], num(row["cold_prompt_tokens"], "{:.0f}"),
                         num(row["cold_ttft_s"]),
                         num(row["cached_ttft_s"]), num(row["cached_cached_tokens"], "{:.0f}", "not reported"),
                         times(row["cold_over_cached"]), row["errors"]])
            if row["errors"]:
                errs.append(f"  {name} video {row['frames']} frames: {row['errors']} failed; "
                            f"first: {row['first_error']}")
    if rows:
        v0 = runs[0][1]
        parts.append(f"Video: {v0['video_size']}x{v0['video_size']} frames at 1 fps, cold then the same video with "
                     "a new question; time to first token (s), median of repeats\n" + table(
                         ["system", "sent as", "frames", "prompt tok", "cold", "cached", "cached tok", "cold/cached",
                          "errors"],
                         rows))
    cache = [[name, f"{v['vision_cache']['hits']:.0f}/{v['vision_cache']['queries']:.0f}"]
             for name, v in runs if v.get("vision_cache")]
    if cache:
        parts.append("Vision embedding cache (Tandem's /metrics over the workload, warm-up included)\n"
                     + table(["system", "hits/queries"], cache))
    if errs:
        parts.append("Vision errors\n" + "\n".join(errs))
    return parts


# ------------------------------------------------------------------ plot

def plot(report: dict, path: str | os.PathLike) -> str | None:
    """Write a PNG of the sweep: output tok/s, TTFT p99 and ITL p99 against
    concurrency, one line per system. Returns a message when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    series = [(s["name"], s["results"]["sweep"]) for s in report["systems"] if s.get("results", {}).get("sweep")]
    if not series:
        return "no sweep results to plot"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("output_tok_s", "output tokens/s"), ("ttft_p99_s", "time to first token p99 (s)"),
              ("itl_p99_s", "inter-token latency p99 (s)"))
    for ax, (key, label) in zip(axes, panels):
        for name, levels in series:
            pts = [(lv["concurrency"], lv[key]) for lv in levels if lv[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        levels_seen = sorted({lv["concurrency"] for _, levels in series for lv in levels})
        ax.set_xticks(levels_seen, [str(c) for c in levels_seen])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"tandem bench ({report['machine']['machine']}, {report['machine']['cpus']} CPUs, "
                 f"{report['config'].get('max_tokens')}-token answers)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


if __name__ == "__main__":  # re-render a saved JSON: python -m benchmarks.bench.reporting.report result.json
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
