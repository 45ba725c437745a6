"""`tandem bench` for issue 30 (no model): the copy and chat workloads'
prompts, their levels through Tandem's own router (tests/support/fake_engine.py),
the speculative tokens accepted per level from /metrics, the rows
--tandem-speculative and --draft-model start with their serve flags, and the
report comparing each tandem[spec=X] row with tandem[spec=off]."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks.bench import bench_cmd
from benchmarks.bench.measures.energy_run import output_tokens
from benchmarks.bench.reporting import report
from benchmarks.bench.servers import systems
from benchmarks.bench.workloads import chat as chat_workload
from benchmarks.bench.workloads import copy_heavy as copy_workload
from benchmarks.bench.workloads import core as workloads
from benchmarks.bench.workloads.core import Target, WorkloadConfig
from benchmarks.bench.workloads.loadgen import RequestResult, summarize
from tests.support.bench_runs import run_bench_cmd
from tests.support.fake_engine import FakeEngine, build_tokenizer
from tests.support.router_server import serve_app

LEVEL_KEYS = {"concurrency", "requests", "ok", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
              "goodput", "error_count", "first_error"}


# ------------------------------------------------------------ prompts

def _copy(seed: int, c: int, i: int, n_words: int = 60) -> list[dict]:
    return copy_workload.copy_messages(seed, f"copy-c{c}-req{i}", copy_workload.copy_kind(i), n_words)


def test_copy_prompts_are_seeded_distinct_and_rotate_the_three_kinds():
    sent = [json.dumps(_copy(0, c, i)) for c in (1, 4) for i in range(9)]
    assert len(set(sent)) == len(sent)
    assert sent == [json.dumps(_copy(0, c, i)) for c in (1, 4) for i in range(9)]  # a pure function
    assert json.dumps(_copy(1, 1, 0)) != sent[0]
    assert [copy_workload.copy_kind(i) for i in range(6)] == ["edit", "extract", "tool"] * 2
    assert _copy(0, 1, 0)[0]["content"].startswith("[copy-c1-req0] Return the text")
    assert _copy(0, 1, 1)[0]["content"].startswith("[copy-c1-req1] Extract the order")
    assert _copy(0, 1, 2)[-2]["role"] == "tool"
    with pytest.raises(ValueError):
        copy_workload.copy_messages(0, "x", "poem", 10)


def test_edit_and_extract_prompts_hold_what_they_ask_to_copy():
    prompt = copy_workload.edit_prompt(0, "s", 80)
    passage = prompt.split("<<<\n")[1].split("\n>>>")[0].split()
    old, new = prompt.split('every "')[1].split('"')[0], prompt.split('becomes "')[1].split('"')[0]
    assert len(passage) == 80 and old in passage and new not in passage
    record = copy_workload.order_record(0, "s", 80)
    text = copy_workload.extract_prompt(0, "s", 80)
    assert set(record) == set(copy_workload.EXTRACT_KEYS)
    assert all(str(v) in text for v in record.values())
    assert all(f"{k}: " in text for k in ("product", "quantity", "unit_price", "status", "notes"))
    assert 70 <= len(text.split("\n\n", 1)[1].split()) <= 90  # the record: ~80 words to copy


def test_tool_loop_messages_are_valid_openai_chat_messages():
    msgs = copy_workload.tool_loop_messages(0, "s", 50)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    (call,) = msgs[2]["tool_calls"]
    assert msgs[2]["content"] is None and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "write_file" and isinstance(call["function"]["arguments"], str)
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"path", "content"} and len(arguments["content"].split()) == 50
    assert msgs[3]["tool_call_id"] == call["id"]
    assert json.loads(msgs[3]["content"])["arguments"] == arguments  # the result echoes the call
    assert all(isinstance(m["content"], str) for m in msgs if m["role"] != "assistant")
    assert "verbatim" in msgs[-1]["content"]


def test_chat_questions_are_natural_seeded_and_distinct():
    qs = [chat_workload.chat_question(0, f"chat-c{c}-req{i}") for c in (1, 4, 16) for i in range(32)]
    assert len(set(qs)) == len(qs)
    assert qs[0] == chat_workload.chat_question(0, "chat-c1-req0") != chat_workload.chat_question(1, "chat-c1-req0")
    assert all(any(w.strip("?,.") in chat_workload.THINGS for w in q.split()) for q in qs)
    assert " a orchard" not in " ".join(qs) and any(" an " in q for q in qs)
    assert all(len(q.split()) < 30 and "[" not in q for q in qs)


# ------------------------------------------------------------ through Tandem's router, with /metrics

class SpecCountingEngine(FakeEngine):
    """A scripted engine whose /metrics counts 10 draft tokens proposed and 7
    accepted per request, split over two methods, as Tandem labels them."""

    async def metrics_text(self) -> str:
        n = len(self.requests)
        counters = (("tandem_spec_proposed_tokens_total", 10), ("tandem_spec_accepted_tokens_total", 7))
        return "".join(f'{name}{{method="{m}"}} {share * n:.1f}\n'
                       for name, per in counters for m, share in (("prompt_lookup", per - 2), ("draft", 2)))


def _run(folder: Path, engine_class, workload) -> tuple[list[dict], FakeEngine, object]:
    tokenizer = build_tokenizer(folder)
    engine = engine_class(tokenizer, max_context=16384)
    engine.say("the quick brown fox jumps over the lazy dog")
    cfg = WorkloadConfig(concurrency=(1, 2), requests_per_level=3, max_tokens=6, prompt_words=30, timeout_s=20)
    with serve_app(engine, tokenizer, request_timeout_s=30) as server:
        levels = asyncio.run(workload(Target("tandem", server.url, engine.model_id), cfg,
                                      metrics_url=server.url + "/metrics"))
    return levels, engine, tokenizer


def test_copy_levels_through_tandems_router_count_accepted_draft_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(workloads, "SPEC_SETTLE_S", 0.0)  # the fake counts at once: no heartbeat to wait for
    levels, engine, tokenizer = _run(tmp_path, SpecCountingEngine, copy_workload.copy)
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        assert LEVEL_KEYS <= lv.keys() and lv["ok"] == 3, lv["first_error"]
        assert lv["output_tokens"] == 3 * 6
        assert lv["spec"] == {"proposed_tokens": 30.0, "accepted_tokens": 21.0, "acceptance_rate": pytest.approx(0.7)}
    assert len(engine.requests) == 6 and all(r.sampling.temperature == 0 for r in engine.requests)
    prompts = [tokenizer.decode(r.prompt_tokens) for r in engine.requests]
    for kind, marker in (("edit", "Return the text"), ("extract", "Extract the order"), ("tool", "write_file")):
        assert sum(marker in p for p in prompts) == 2, kind  # each kind once per 3-request level
    tool = next(p for p in prompts if "It did not save" in p)
    assert tool.count('"content": ') == 2  # the call's arguments and the result's echo


def test_chat_levels_have_no_spec_figures_where_metrics_count_none(tmp_path):
    levels, engine, tokenizer = _run(tmp_path, FakeEngine, chat_workload.chat)
    assert all(lv["ok"] == 3 and "spec" not in lv for lv in levels)
    prompts = [tokenizer.decode(r.prompt_tokens) for r in engine.requests]
    assert any(chat_workload.chat_question(0, "chat-c2-req1") in p for p in prompts)
    assert output_tokens("chat", levels) == 6 * 6  # energy's per-token figure counts these levels too


def test_acceptance_from_metric_text():
    text = ('# TYPE tandem_spec_proposed_tokens_total counter\n'
            'tandem_spec_proposed_tokens_total{method="prompt_lookup"} 90\n'
            'tandem_spec_proposed_tokens_total{method="draft"} 10\n'
            'tandem_spec_accepted_tokens_total{method="prompt_lookup"} 60\n'
            'tandem_spec_accepted_tokens_total{method="draft"} 5\n')
    assert workloads.spec_counters(text) == (100.0, 65.0)
    assert workloads.spec_counters("tandem_prompt_tokens_total 5\n") is None
    assert workloads.spec_acceptance((100.0, 65.0), (300.0, 215.0)) == {
        "proposed_tokens": 200.0, "accepted_tokens": 150.0, "acceptance_rate": 0.75}
    assert workloads.spec_acceptance((5.0, 1.0), (5.0, 1.0))["acceptance_rate"] is None  # spec=off: none proposed
    assert workloads.spec_acceptance(None, (1.0, 1.0)) is None and workloads.spec_acceptance((1.0, 1.0), None) is None


def test_time_per_output_token_counts_tokens_not_chunks():
    # Speculation: 7 tokens in 3 chunks; the chunk gaps say 0.15 s, each token took 0.05 s.
    burst = RequestResult(200, ok=True, ttft=0.1, chunk_times=[0.1, 0.25, 0.4], output_tokens=7)
    plain = RequestResult(200, ok=True, ttft=0.1, chunk_times=[0.1, 0.2, 0.3], output_tokens=3)
    s = summarize([burst, plain, RequestResult(200, ok=True, ttft=0.1, chunk_times=[0.1], output_tokens=1)],
                  1.0, ttft_budget=1.0, itl_budget=1.0)
    assert s["tpot_p50_s"] == pytest.approx((0.05 + 0.1) / 2) and s["itl_p50_s"] == pytest.approx(0.125)


# ------------------------------------------------------------ rows and their flags

def _opts(tmp_path, **kw) -> systems.Options:
    return systems.Options(model_spec=None, model_dir=tmp_path, peer_model_dir=tmp_path / "peer", run_dir=tmp_path,
                           **kw)


def test_speculation_rows_names_and_serve_flags(tmp_path):
    rows = systems.expand_rows(("tandem", "mlx_lm"), (), ("off", "prompt-lookup", "draft"), draft_peer=True)
    assert rows == ("tandem[spec=off]", "tandem[spec=prompt-lookup]", "tandem[spec=draft]", "mlx_lm", "mlx_lm[draft]")
    assert systems.expand_rows(("tandem-colocate", "vllm-mlx"), ("saver",), ("off", "auto")) == (
        "tandem-colocate[saver,spec=off]", "tandem-colocate[saver,spec=auto]", "vllm-mlx")
    opts = _opts(tmp_path, tandem_args=["--speculative", "auto"], draft_model="tiny-draft",
                 peer_draft_model_dir=tmp_path / "draft32", spec_tokens=4)
    argv = {r: systems.server_spec(r, 18100, opts).argv for r in rows}
    assert argv["tandem[spec=off]"][-2:] == ["--speculative", "off"]  # after --tandem-args: the name is what ran
    assert argv["tandem[spec=prompt-lookup]"][-4:] == ["--speculative", "prompt-lookup", "--spec-tokens", "4"]
    assert argv["tandem[spec=draft]"][-6:] == ["--speculative", "draft", "--draft-model", "tiny-draft",
                                               "--spec-tokens", "4"]
    assert "--draft-model" not in argv["tandem[spec=off]"] + argv["tandem[spec=prompt-lookup]"] + argv["mlx_lm"]
    assert argv["mlx_lm[draft]"][-4:] == ["--draft-model", str(tmp_path / "draft32"), "--num-draft-tokens", "4"]
    auto = systems.server_spec("tandem-colocate[saver,spec=auto]", 18100, opts).argv
    assert auto[-8:] == ["--power-policy", "saver", "--speculative", "auto", "--draft-model", "tiny-draft",
                         "--spec-tokens", "4"] and "--colocate" in auto
    assert str(tmp_path / "tandem-colocate-saver-spec-auto-kv") in auto
    assert systems.file_label("tandem[spec=prompt-lookup]") == "tandem-spec-prompt-lookup"
    assert systems.split_row("tandem[saver,spec=off]") == ("tandem", systems.Variant("saver", "off"))
    assert [systems.spec_baseline(r) for r in ("tandem[saver,spec=draft]", "tandem[spec=off]", "tandem", "mlx_lm")] \
        == ["tandem[saver,spec=off]", None, None, None]
    for bad in ("tandem[spec=fast]", "tandem[draft]", "mlx_lm[spec=off]"):
        with pytest.raises(ValueError):
            systems.server_spec(bad, 18100, opts)
    for needs_draft in ("tandem[spec=draft]", "mlx_lm[draft]"):
        with pytest.raises(ValueError, match="--draft-model"):
            systems.server_spec(needs_draft, 18100, _opts(tmp_path))


def test_bench_flags_start_a_row_per_mode_and_the_draft_peer_only_with_a_draft(tmp_path, monkeypatch):
    rc, started, config = run_bench_cmd(tmp_path, monkeypatch, "--systems", "tandem,mlx_lm", "--workload", "copy,chat",
                                 "--tandem-speculative", "off,draft", "--draft-model", "d", "--spec-tokens", "3")
    assert rc == 0 and started == ["tandem[spec=off]", "tandem[spec=draft]", "mlx_lm", "mlx_lm[draft]"]
    assert (config["tandem_speculative"], config["draft_model"], config["spec_tokens"]) == (["off", "draft"], "d", 3)
    assert config["workloads"] == ["copy", "chat"]
    rc, started, _ = run_bench_cmd(tmp_path, monkeypatch, "--systems", "tandem,mlx_lm", "--tandem-speculative",
                            "off,prompt-lookup")
    assert rc == 0 and started == ["tandem[spec=off]", "tandem[spec=prompt-lookup]", "mlx_lm"]
    rc, started, _ = run_bench_cmd(tmp_path, monkeypatch, "--systems", "tandem", "--tandem-speculative", "draft")
    assert rc == 2 and started == []  # spec=draft without a draft model: refused before anything starts
    p = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--tandem-speculative", "off,medusa"])
    assert "copy" not in p.parse_args(["--workload", "all"]).workload


def test_options_give_the_draft_peer_its_folder(tmp_path):
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"model_type": "qwen3"}')
    p = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    args = p.parse_args(["--model", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"),
                         "--peer-weights", "as-is", "--spec-tokens", "5"])
    opts = bench_cmd._options(args, ("tandem[spec=draft]", "mlx_lm", "mlx_lm[draft]"), tmp_path)
    assert opts.draft_model == str(tmp_path / "draft") and opts.peer_draft_model_dir == tmp_path / "draft"
    assert opts.spec_tokens == 5
    assert bench_cmd._options(args, ("tandem[spec=draft]",), tmp_path).peer_draft_model_dir is None


# ------------------------------------------------------------ the report

def _system(name: str, tok_s: float, itl: float, spec: dict | None = None) -> dict:
    lv = {"concurrency": 1, "requests": 3, "ok": 3, "errors": {}, "error_count": 0, "rejected_429": 0,
          "output_tok_s": tok_s, "requests_s": 1.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "itl_p50_s": itl,
          "itl_p99_s": itl, "goodput": 1.0, "first_error": None, **({"spec": spec} if spec else {})}
    return {"name": name, "error": None, "memory": None, "results": {"copy": [lv], "chat": [dict(lv)]}}


def test_report_compares_each_spec_row_with_spec_off_and_shows_acceptance():
    spec = {"proposed_tokens": 100.0, "accepted_tokens": 70.0, "acceptance_rate": 0.7}
    rep = report.build_report([_system("tandem[spec=off]", 10.0, 0.1), _system("tandem[spec=prompt-lookup]", 20.0,
                                                                                0.05, spec),
                               _system("mlx_lm", 12.5, 0.08)], {"max_tokens": 8}, "tandem bench")
    pairs = [(r["tandem"], r["peer"]) for r in rep["ratios"]]
    assert pairs == [("tandem[spec=off]", "mlx_lm"), ("tandem[spec=prompt-lookup]", "mlx_lm"),
                     ("tandem[spec=prompt-lookup]", "tandem[spec=off]")]
    spec_vs_off = rep["ratios"][-1]
    assert spec_vs_off["copy"]["1"]["output_tok_s"] == pytest.approx(2.0)
    assert spec_vs_off["chat"]["1"]["itl_p99_s"] == pytest.approx(0.5)
    assert rep["ratios"][0]["copy"]["1"]["output_tok_s"] == pytest.approx(0.8)
    text = report.render(rep)
    assert "Copy: edit a text" in text and "Chat: short natural questions" in text
    assert "spec accepted" in text and "70/100 (70%)" in text
    assert "tandem[spec=prompt-lookup] / tandem[spec=off]" in text and "copy c=1" in text and "2.00x" in text
    plain = report.render(report.build_report([_system("tandem", 10.0, 0.1)], {}, "tandem bench"))
    assert "Copy: edit a text" in plain and "spec accepted" not in plain
