"""`tandem bench --workload two-models` without a model: which model each
agent's turn names, where each system sends it (one Tandem endpoint, a Tandem
server per model, mlx_lm.server by folder), the keep_alive only Tandem gets,
and the agents' loops against a scripted pair of servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from benchmarks.bench import bench_cmd
from benchmarks.bench.workloads import two_models as tm
from benchmarks.bench.workloads.core import WorkloadConfig
from environment.settings import Settings
from tests.support.router_server import ServerThread

REPOS = ("org/small", "org/large")
SNAPSHOTS = {r: Path(f"/hf/hub/models--{r.replace('/', '--')}/snapshots/{'b' * 40}") for r in REPOS}


def _args(*extra: str):
    p = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    return p.parse_args(["--workload", "two-models", *extra])


def _system(name: str, tmp_path: Path) -> tm.System:
    return tm.System(name, REPOS, SNAPSHOTS, Path("/hf"), tmp_path, 18900, set(), tm.TwoModelsConfig(),
                     ["--colocate"], [])


def test_agents_alternate_and_both_models_are_asked_for_at_every_turn():
    for k in range(4):
        assert [tm.turn_model(k, t) for t in range(4)] == ([0, 1, 0, 1] if k % 2 == 0 else [1, 0, 1, 0])
    for t in range(6):
        assert {tm.turn_model(k, t) for k in range(4)} == {0, 1}


def test_each_system_sends_each_model_where_it_is_served(tmp_path):
    one = _system("tandem", tmp_path)
    assert len(one.servers) == 1 and [e.model for e in one.endpoints] == list(REPOS)
    assert one.endpoints[0].url == one.endpoints[1].url and [e.model for e in one.startup_models()] == ["org/small"]
    argv = one.servers[0].spec.argv
    assert argv[argv.index("--model") + 1] == "org/small" and "--max-loaded-models" in argv and "--colocate" in argv
    assert one.servers[0].spec.env["HF_HOME"] == "/hf" and one.servers[0].spec.env["HF_HUB_OFFLINE"] == "1"
    pair = _system("tandem-pair", tmp_path)
    assert [s.spec.argv[s.spec.argv.index("--model") + 1] for s in pair.servers] == list(REPOS)
    assert [e.url for e in pair.endpoints] == [s.spec.base_url for s in pair.servers]
    assert [e.model for e in pair.startup_models()] == list(REPOS)
    assert "--max-loaded-models" not in pair.servers[0].spec.argv
    peer = _system("mlx_lm", tmp_path)
    assert "--model" not in peer.servers[0].spec.argv and not peer.tandem and peer.startup_models() == []
    assert [e.model for e in peer.endpoints] == [str(SNAPSHOTS[r]) for r in REPOS]  # a folder: it loads that one


def test_options_and_a_bad_system_is_refused():
    cfg = tm.config(_args("--two-models", "a/x,b/y", "--two-models-systems", "mlx_lm,tandem",
                          "--two-models-keep-alive", "7"))
    assert (cfg.models, cfg.systems, cfg.keep_alive_s) == (("a/x", "b/y"), ("mlx_lm", "tandem"), 7.0)
    for bad in (["--two-models-systems", "ollama"], ["--two-models", "a/x"]):
        try:
            tm.config(_args(*bad))
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


def test_agent_loops_go_to_their_models_server_with_their_history(tmp_path):
    seen: list[tuple[str, dict]] = []

    async def chat(request: Request):
        body = await request.json()
        seen.append((request.path_params["server"], body))
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        return JSONResponse({"choices": [{"message": {"role": "assistant", "content": f"answer {turn}"}}],
                             "usage": {"prompt_tokens": 10, "completion_tokens": 3}})

    app = Starlette(routes=[Route("/{server}/v1/chat/completions", chat, methods=["POST"])])
    pair = _system("tandem-pair", tmp_path)
    with ServerThread(app, Settings()) as server:
        pair.endpoints = [tm.Endpoint(f"{server.url}/{i}", repo, True) for i, repo in enumerate(REPOS)]
        cfg = tm.TwoModelsConfig(keep_alive_s=7)
        wl = WorkloadConfig(agents=2, turns=3, max_tokens=5, timeout_s=10.0)

        async def go():
            import httpx
            async with httpx.AsyncClient() as client:
                return await tm.agents(pair, cfg, wl, client)

        out = asyncio.run(go())
    assert (out["turns_ok"], out["turns_failed"], out["output_tokens"]) == (6, 0, 18)
    for where, body in seen:
        agent = int(body["messages"][1]["content"].split()[1].rstrip(","))
        turn = sum(m["role"] == "user" for m in body["messages"]) - 1
        assert where == str(tm.turn_model(agent, turn)) and body["model"] == REPOS[int(where)]
        assert "keep_alive" not in body and body["temperature"] == 0.0 and body["max_tokens"] == 5
        assert [m["content"] for m in body["messages"] if m["role"] == "assistant"] == \
            [f"answer {t}" for t in range(turn)]  # the other model's answers are in the history too
    # The closing request's keep_alive goes to Tandem only (mlx_lm.server has none).
    assert tm.chat_request("m", [], 1, 7)["keep_alive"] == "7s"
    assert "keep_alive" not in tm.chat_request("m", [], 1, None)


def test_the_table_has_a_row_per_system_and_says_why_one_failed():
    entries = [{"name": "tandem", "error": None, "start_s": 3.0, "cold_s": [1.0, 2.0], "unloaded_after_s": 5.5,
                "agents": {"turns_s": 1.5, "turns_ok": 24, "turns_failed": 0, "latency_p50_s": 0.8, "model_loads": 0},
                "peak": {"rss_bytes": 2**30, "pss_bytes": 2**29, "gpu_bytes": None},
                "idle_baseline": {"pss_bytes": 2**28}, "after_idle": {"pss_bytes": 2**28}},
               {"name": "mlx_lm", "error": "mlx_lm exited"}]
    text = tm.render(entries)
    assert "1.50" in text and "24/0" in text and "1.00 / 2.00" in text and "512 MiB" in text
    assert text.splitlines()[-1] == "mlx_lm: mlx_lm exited" and "GPU" not in text
