"""One system's energy in `tandem bench`: its idle baseline, each workload's window, joules per token.

The machine's draw is first measured for a few seconds before the system
starts (nothing of the bench running: `idle`), then each workload after the
warm-up is a window between two marks, and each level of sweep, copy and chat
one too. Joules per output token divide a window's joules by the output
tokens the workload counted; workloads that count none (prefix, vision) add
to `joules` but not to the per-token figure. `*_above_idle` subtracts the
idle draw over the window first: what serving cost on top of a machine that
was on anyway (noise can make it small or negative on a short window).
"""

from __future__ import annotations

import time

from benchmarks.bench.measures.energy import SCOPE, EnergyRecorder, Mark
from benchmarks.bench.reporting.text_table import num, table


def output_tokens(workload: str, result) -> int | None:
    """Output tokens a workload's result counts, None where it counts none."""
    if not result:
        return None
    if isinstance(result, list):  # the levels of sweep, copy and chat
        return sum(lv["output_tokens"] for lv in result)
    if workload == "interference":
        return result["quiet"]["output_tokens"] + result["loud"]["output_tokens"]
    value = result.get("output_tokens") if isinstance(result, dict) else None
    return value if isinstance(value, int) else None


def per_token(window: dict, tokens: int | None, idle_watts: float | None) -> dict:
    """A window's figures with its output tokens and joules per output token."""
    out = {**window, "output_tokens": tokens,
           "joules_per_output_token": window["joules"] / tokens if tokens else None,
           "joules_per_output_token_above_idle": None}
    if tokens and idle_watts is not None:
        out["joules_per_output_token_above_idle"] = (window["joules"] - idle_watts * window["seconds"]) / tokens
    return out


class EnergyRun:
    """Marks and windows for one system, on a recorder shared by the whole bench."""

    def __init__(self, recorder: EnergyRecorder):
        self.recorder = recorder
        self.idle: dict | None = None
        self.workloads: dict[str, dict] = {}

    def measure_idle(self, seconds: float) -> None:
        """The machine's draw over `seconds` before the system starts (0: skipped)."""
        if seconds <= 0:
            return
        start = self.recorder.mark()
        time.sleep(seconds)
        w = self.recorder.window(start, self.recorder.mark())
        self.idle = {"seconds": w["seconds"], "watts": w["watts"], "joules": w["joules"]}

    @property
    def idle_watts(self) -> float | None:
        return self.idle["watts"] if self.idle else None

    def mark(self) -> Mark:
        return self.recorder.mark()

    def level(self, start: Mark, tokens: int | None) -> dict:
        """One sweep level's window, from `start` to now."""
        w = per_token(self.recorder.window(start, self.recorder.mark()), tokens, self.idle_watts)
        w.pop("by_domain")
        return w

    def workload(self, name: str, start: Mark, result) -> None:
        """Record workload `name`'s window, from `start` to now."""
        window = self.recorder.window(start, self.recorder.mark())
        self.workloads[name] = per_token(window, output_tokens(name, result), self.idle_watts)

    def report(self) -> dict:
        """The system's `energy` entry (schema in benchmarks/bench/reporting/report.py)."""
        ws = list(self.workloads.values())
        counted = [w for w in ws if w["output_tokens"]]
        joules = sum(w["joules"] for w in ws)
        seconds = sum(w["seconds"] for w in ws)
        tokens = sum(w["output_tokens"] for w in counted)
        by_domain: dict[str, float] = {}
        for w in ws:
            for d, j in w["by_domain"].items():
                by_domain[d] = by_domain.get(d, 0.0) + j
        total = per_token({"joules": sum(w["joules"] for w in counted),
                           "seconds": sum(w["seconds"] for w in counted)}, tokens, self.idle_watts)
        return {
            "scope": SCOPE, "meters": self.recorder.describe(), "domains": self.recorder.domains,
            "idle": self.idle, "joules": joules, "seconds": seconds,
            "watts": joules / seconds if seconds > 0 else None, "by_domain": by_domain,
            "output_tokens": tokens or None, "joules_per_output_token": total["joules_per_output_token"],
            "joules_per_output_token_above_idle": total["joules_per_output_token_above_idle"],
            "workloads": self.workloads,
        }


def energy_table(systems: list[dict], run: dict | None) -> list[str]:
    """The report's energy table, a row per workload (and "all" where several ran);
    `run` is the report's config["energy"], which says why there is none."""
    rows = []
    for s in systems:
        e = s.get("energy")
        if not e:
            continue
        idle = num((e.get("idle") or {}).get("watts"), "{:.1f}")
        named = list(e["workloads"].items()) + ([("all", e)] if len(e["workloads"]) > 1 else [])
        for workload, w in named:
            rows.append([s["name"], workload, num(w["joules"], "{:.1f}"), num(w["seconds"], "{:.1f}"),
                         num(w["watts"], "{:.1f}"), idle, num(w["output_tokens"], "{:.0f}"),
                         num(w["joules_per_output_token"], "{:.4f}"), num(w["joules_per_output_token_above_idle"],
                                                                          "{:.4f}")])
    if not rows:
        why = "; ".join(f"{k}: {v}" for k, v in ((run or {}).get("unavailable") or {}).items())
        ran = any(not s.get("error") for s in systems)
        return [f"Energy: none on this machine{f' ({why})' if why else ''}"] if ran else []
    domains = next(s["energy"]["domains"] for s in systems if s.get("energy"))
    return [f"Energy, machine-wide ({', '.join(domains)}), after the warm-up; J/tok: joules per output token "
            "(prefix and vision count none); above idle: less the idle draw measured before the start\n"
            + table(["system", "workload", "joules", "seconds", "avg W", "idle W", "out tok", "J/tok",
                     "J/tok above idle"], rows)]
