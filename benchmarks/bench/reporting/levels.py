"""The report of the closed-loop level workloads (sweep, copy, chat): a table
each, their ratios per level, and the speculative tokens accepted per level
where the server counted them (benchmarks/bench/workloads.closed_loop_levels)."""

from __future__ import annotations

from benchmarks.bench.reporting.text_table import num, table, times

# (result key, the table's title)
LEVEL_WORKLOADS = (("sweep", "Sweep (closed loop"),
                   ("copy", "Copy: edit a text, extract fields to JSON, echo a tool call's arguments (closed loop"),
                   ("chat", "Chat: short natural questions (closed loop"))
RATIO_KEYS = ("output_tok_s", "ttft_p99_s", "itl_p99_s", "goodput")


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def level_ratios(tr: dict, pr: dict) -> dict:
    """{workload: {clients: {measure: first / second}}} for the level workloads both ran."""
    out = {}
    for key, _ in LEVEL_WORKLOADS:
        if key in tr and key in pr:
            other = {lv["concurrency"]: lv for lv in pr[key]}
            out[key] = {str(lv["concurrency"]): {k: ratio(lv[k], other[lv["concurrency"]][k]) for k in RATIO_KEYS}
                        for lv in tr[key] if lv["concurrency"] in other}
    return out


def level_ratio_rows(row: dict) -> list[list[str]]:
    """A ratio row's level workloads as rows of the ratios table."""
    pair = f"{row['tandem']} / {row['peer']}"
    return [[pair, f"{key} c={c}", times(m["output_tok_s"]), times(m["ttft_p99_s"]), times(m["itl_p99_s"])]
            for key, _ in LEVEL_WORKLOADS for c, m in (row.get(key) or {}).items()]


def acceptance(spec: dict | None) -> str:
    """'accepted/proposed (rate)' of a level's speculative tokens, '-' where not counted."""
    if not spec:
        return "-"
    rate = spec.get("acceptance_rate")
    share = f" ({rate * 100:.0f}%)" if rate is not None else ""
    return f"{spec['accepted_tokens']:.0f}/{spec['proposed_tokens']:.0f}{share}"


def level_tables(systems: list[dict]) -> list[str]:
    parts = []
    for key, title in LEVEL_WORKLOADS:
        parts += _levels_table(systems, key, title)
    return parts


def _levels_table(systems: list[dict], key: str, title: str) -> list[str]:
    levels = [(s["name"], lv) for s in systems for lv in s.get("results", {}).get(key, [])]
    if not levels:
        return []
    # Joules per output token next to tok/s, where a meter measured them (machine-wide).
    energy = any(lv.get("energy") for _, lv in levels)
    spec = any(lv.get("spec") for _, lv in levels)
    rows = []
    for name, lv in levels:
        j_tok = [num((lv.get("energy") or {}).get("joules_per_output_token"), "{:.4f}")] if energy else []
        rows.append([name, lv["concurrency"], lv["requests"], lv["ok"], lv["error_count"], lv["rejected_429"],
                     num(lv["output_tok_s"], "{:.1f}"), *j_tok, num(lv["requests_s"], "{:.2f}"), num(lv["ttft_p50_s"]),
                     num(lv["ttft_p99_s"]), num(lv["itl_p50_s"]), num(lv["itl_p99_s"]), num(lv.get("tpot_p50_s")),
                     f"{lv['goodput'] * 100:.0f}%",
                     *([acceptance(lv.get("spec"))] if spec else [])])
    header = ["system", "clients", "reqs", "ok", "errors", "429", "tok/s", *(["J/tok"] if energy else []), "req/s",
              "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50", "goodput", *(["spec accepted"] if spec else [])]
    notes = "; seconds; TPOT: a request's time per output token after the first" + \
        ("; J/tok: joules per output token, machine-wide" if energy else "") + \
        ("; spec accepted: draft tokens accepted/proposed (/metrics)" if spec else "")
    parts = [f"{title}{notes})\n" + table(header, rows)]
    errs = [f"  {name} c={lv['concurrency']}: {lv['errors']} first: {lv['first_error']}"
            for name, lv in levels if lv["error_count"]]
    if errs:
        parts.append(f"Errors by status ({key})\n" + "\n".join(errs))
    return parts
