"""The split pipeline end to end: a real `tandem serve` (router, prefill worker,
decode worker and cache service as separate processes) on the embedded model,
driven through the `openai` client and checked against `mlx_lm.generate`."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import io
import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from mlx_lm.generate import stream_generate

from tests.support.embedded_chat import LONG_SYSTEM, reference, references
from tests.support.server import metric, module_server

CONVERSATIONS = {
    "short": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    # Longer than several prefill chunks (the server runs with --prefill-chunk 32).
    "long": [{"role": "system", "content": LONG_SYSTEM},
             {"role": "user", "content": "Name a river in Germany and the city it flows through."}],
    "multi_turn": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
        {"role": "user", "content": "And what is that number times three?"},
    ],
}


@pytest.fixture(scope="module", params=["split", "colocate"])
def server(request, tmp_path_factory, embedded_model_dir):
    # The machine's power readings come from this file (a double for macOS's
    # and a laptop's readings: this box has no battery); on AC power, as the box is.
    power_file = tmp_path_factory.mktemp("power") / "power.json"
    power_file.write_text('{"source": "ac"}')
    pressure_file = power_file.with_name("pressure")  # likewise for PSI / macOS memory pressure
    pressure_file.write_text("normal")
    flags = ["--prefill-chunk", "32", "--log-level", "debug", "--power-state-file", str(power_file),
             "--power-poll", "0.2", "--memory-pressure-file", str(pressure_file)]
    # Split: two decode workers, so concurrent requests spread over both.
    flags += ["--colocate"] if request.param == "colocate" else ["--decode-workers", "2"]
    srv = module_server(request, tmp_path_factory, *flags)
    srv.power_file, srv.pressure_file = power_file, pressure_file
    srv.decoders = 1 if request.param == "colocate" else 2
    return srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def router_level(server) -> None:
    """Skip the colocated layout's run of a test of what the router alone
    does (its endpoints, streams, stop strings; a seed's sampler is the one
    decode engine either way): the layouts differ in the workers, which the
    other tests run in both; one layout keeps the suite within its 15 minutes."""
    if server.decoders == 1:
        pytest.skip("split layout only: a router-level behaviour, the same over either layout's workers")


_COPY = [{"role": "user", "content": (
    "Repeat the following text exactly, replacing the word 'river' with 'lake':\n\n"
    "The quick brown fox jumps over the lazy dog. Alice wrote a letter to Bob about the garden, the river "
    "and the mountain village where they spent the summer. The letter said that the apple trees were in "
    "flower and the bridge over the river had been painted green.")}]


def _spec_tokens(server) -> tuple:
    """(drafted, accepted) tokens of every decode worker, from /metrics."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return tuple(sum(float(v) for v in re.findall(rf"^tandem_spec_{kind}_tokens_total\{{[^}}]*\}} (\S+)$", text, re.M))
                 for kind in ("proposed", "accepted"))


def test_prompt_lookup_speculation_is_exact_and_counted(server, client, embedded_model):
    """The server speculates by default (prompt lookup): an answer that
    copies its prompt is drafted from it, token-identical to mlx-lm's."""
    ref_tokens, ref_text, _ = reference(embedded_model, _COPY, 32)  # copying from the first tokens on
    before = _spec_tokens(server)
    resp = client.chat.completions.create(model="default", messages=_COPY, max_tokens=32, temperature=0)
    assert resp.choices[0].message.content == ref_text
    assert resp.usage.completion_tokens == len(ref_tokens)
    # The counts reach /metrics with the decode worker's next heartbeat (0.5 s).
    deadline = time.monotonic() + 5
    while True:
        drafted, accepted = (a - b for a, b in zip(_spec_tokens(server), before))
        if accepted >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # Drafted and kept, and counted. How many follows the step times the
    # server learns as it runs (StepCosts: 15-24 kept on a quiet box, 8 with
    # another test run beside it), so no count above one is asserted here;
    # tests/workers/decode/test_speculation.py counts with fixed costs.
    assert accepted >= 1 and drafted >= accepted, (drafted, accepted)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_greedy_output_matches_mlx_lm(client, embedded_model, name):
    messages = CONVERSATIONS[name]
    ref_tokens, ref_text, n_prompt = reference(embedded_model, messages, 40)
    resp = client.chat.completions.create(model="default", messages=messages, max_tokens=40, temperature=0)
    assert resp.choices[0].message.content == ref_text
    assert resp.usage.completion_tokens == len(ref_tokens)
    assert resp.usage.prompt_tokens == n_prompt
    assert resp.choices[0].finish_reason == ("stop" if ref_tokens[-1] in embedded_model[1].eos_token_ids else "length")
    if name == "short":
        assert "Paris" in resp.choices[0].message.content


_SIXTEEN = [[{"role": "user", "content": f"Give one fact about the number {i}."}] for i in range(16)]
SIXTEEN_TOKENS = 6  # a prefill's token and five batched decode steps each; their length asserts nothing more


@pytest.fixture(scope="module")
def sixteen_refs(embedded_model):
    """mlx_lm's answers, computed once for both layouts, in one mlx-lm batch."""
    return references(embedded_model, _SIXTEEN, SIXTEEN_TOKENS)


def test_sixteen_at_once_match_mlx_lm(client, sixteen_refs):
    convs, refs = _SIXTEEN, sixteen_refs

    def ask(c):
        return client.chat.completions.create(model="default", messages=c, max_tokens=SIXTEEN_TOKENS, temperature=0)

    with cf.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, convs))
    assert [a.choices[0].message.content for a in answers] == refs


def test_stream_with_usage_matches_non_stream(server, client):
    router_level(server)
    messages = CONVERSATIONS["short"]
    full = client.chat.completions.create(model="default", messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model="default", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]


def test_completions_endpoint(server, client, embedded_model):
    router_level(server)
    model, tokenizer = embedded_model
    prompt = "The three primary colors are"
    ref = [r.token for r in stream_generate(model, tokenizer, prompt=tokenizer.encode(prompt), max_tokens=12)]
    resp = client.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
    assert resp.choices[0].text == tokenizer.decode(ref[:resp.usage.completion_tokens])
    assert resp.usage.completion_tokens == 12


def test_seed_gives_same_output(server, client):
    router_level(server)
    kw = dict(model="default", messages=CONVERSATIONS["short"], max_tokens=8, temperature=1.0, top_p=0.95)
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    with cf.ThreadPoolExecutor(3) as pool:  # other seeds, other answers: together, as only their variety counts
        others = set(pool.map(lambda s: client.chat.completions.create(seed=s, **kw).choices[0].message.content,
                              (1, 2, 3)))
    assert a == b
    assert len(others | {a}) > 1


def test_stop_string_cuts_output(server, client, embedded_model):
    router_level(server)
    _, ref_text, _ = reference(embedded_model, CONVERSATIONS["short"], 40)
    stop = ref_text.split()[3]  # a word from the middle of the known answer
    resp = client.chat.completions.create(model="default", messages=CONVERSATIONS["short"], max_tokens=40,
                                          temperature=0, stop=[stop])
    assert resp.choices[0].message.content == ref_text[:ref_text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_models_and_health(server, client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == ["SmolLM2-135M-Instruct"]
    code, body = server.health()
    assert code == 200 and body["model"] == ids[0]
    roles = sorted(w["role"] for w in body["workers"])
    assert roles in (["decode", "decode", "prefill"], ["prefill+decode"])
    assert all(w["state"] == "ready" and w["pid"] > 0 for w in body["workers"])


# --- The README's examples, run as written (their address changed to this
# server's): each ends by itself or at the model's default length, so none can
# run for minutes, and each prints an answer. On the split server (the
# README's `tandem serve` is split too; its flags here change no answer).

README = Path(__file__).resolve().parents[2] / "README.md"
README_ADDRESS = "127.0.0.1:8000"
EMBEDDED_MAX_TOKENS = 256  # workers/models/store.py EMBEDDED_SAMPLING


def readme_blocks(language: str) -> list[str]:
    """The README's fenced code blocks in `language` that talk to the server."""
    found = re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)
    return [b for b in found if README_ADDRESS in b]


def test_the_readme_has_its_commands_and_three_examples():
    assert len(readme_blocks("sh")) == 1 and len(readme_blocks("python")) == 2
    assert "make serve" in README.read_text() and "make test" in README.read_text()


def test_the_readmes_curl_example_answers(server):
    router_level(server)
    command = readme_blocks("sh")[0].replace(README_ADDRESS, server.base_url.removeprefix("http://"))
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    choice = answer["choices"][0]
    assert choice["message"]["content"].strip() and choice["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] <= EMBEDDED_MAX_TOKENS  # the model's default, not 4,096


@pytest.mark.parametrize("which", ["openai", "anthropic"])
def test_the_readmes_python_examples_answer(server, which):
    router_level(server)
    code = next(b for b in readme_blocks("python") if f"import {which}" in b or f"from {which}" in b)
    printed, scope = io.StringIO(), {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(README_ADDRESS, server.base_url.removeprefix("http://")), f"README ({which})", "exec"),
             scope)
    assert printed.getvalue().strip()
    if which == "anthropic":
        assert scope["reply"].stop_reason in ("end_turn", "max_tokens")
        assert scope["reply"].usage.output_tokens <= EMBEDDED_MAX_TOKENS


def test_the_models_sampling_defaults_are_shown(server):
    card = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]
    assert card["generation_defaults"] == {"temperature": 0.2, "top_p": 0.9, "max_tokens": EMBEDDED_MAX_TOKENS}


def test_unknown_model_and_too_long_prompt(server, client):
    router_level(server)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=CONVERSATIONS["short"], max_tokens=4)
    assert "SmolLM2-135M-Instruct" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi " * 9000}],
                                       max_tokens=4)
    assert "context" in e.value.message


def test_client_disconnect_stops_generation_and_frees_kv(server, embedded_model):
    """Read a few chunks of a long stream, hang up, and watch the work stop."""
    # logit_bias bans the end-of-turn token: this answer would run for 2000 tokens.
    body = {"model": "default", "messages": CONVERSATIONS["short"], "max_tokens": 2000, "temperature": 0.7,
            "stream": True, "logit_bias": {str(i): -100 for i in embedded_model[1].eos_token_ids}}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.health()[1]["requests_in_flight"] == 1

        def decoding():
            # Only decode: right after the handoff the router may still hold prefill's
            # last heartbeat (running 1) and then its next (0) before decode's (1).
            workers = server.health()[1]["workers"]
            return sum(w["running"] for w in workers if "decode" in w["role"]), workers

        deadline = time.monotonic() + 5  # worker load arrives with its next heartbeat
        running, workers = decoding()
        while running == 0 and time.monotonic() < deadline:
            next(lines)
            running, workers = decoding()
        assert running >= 1, [(w["id"], w["running"], w["waiting"]) for w in workers]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, h = server.health()
        if sum(w["running"] + w["waiting"] for w in h["workers"]) == 0 and h["requests_in_flight"] == 0:
            break
        time.sleep(0.05)
    assert sum(w["running"] + w["waiting"] for w in h["workers"]) == 0, \
        [(w["id"], w["running"], w["waiting"]) for w in h["workers"]]
    assert h["requests_in_flight"] == 0
    # The handoff's arena space is back; what stays is the prefix cache's blocks.
    assert h["cache_service"]["handoff_bytes"] == 0, h["cache_service"]


@pytest.fixture(scope="module")
def logprobs_ref(embedded_model):
    """mlx_lm's logprob of each token it picks for the short conversation, once for both layouts."""
    model, tokenizer = embedded_model
    prompt = tokenizer.apply_chat_template(CONVERSATIONS["short"], add_generation_prompt=True)
    return [r.logprobs[r.token].item() for r in stream_generate(model, tokenizer, prompt=prompt, max_tokens=6)]


def test_logprobs_match_mlx_lm(client, logprobs_ref):
    messages = CONVERSATIONS["short"]
    resp = client.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for got, want in zip(content, logprobs_ref):
        assert got.logprob == pytest.approx(want, abs=1e-3)
        assert got.top_logprobs[0].logprob == pytest.approx(got.logprob, abs=1e-6)  # greedy picks the top one
        assert len(got.top_logprobs) == 3


def _set_power(server, **state) -> None:
    tmp = server.power_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, server.power_file)  # the reader never sees half a file


def _batch_limits(server) -> list[float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return [float(v) for v in re.findall(r"^tandem_worker_decode_batch_limit\{[^}]*\} (\S+)$", text, re.M)]


def _wait_policy(server, name: str, batch_limit: int, timeout: float = 20.0) -> dict:
    """Until /health says `name` is in force and every decode worker applies its batch limit."""
    deadline = time.monotonic() + timeout
    while True:
        power = server.health()[1].get("power", {})
        limits = _batch_limits(server)
        if power.get("policy") == name and len(limits) == server.decoders and set(limits) == {batch_limit}:
            return power
        assert time.monotonic() < deadline, (name, power, limits)
        time.sleep(0.1)


def test_power_policy_follows_the_machine_live(server, client):
    """AC -> battery -> Low Power Mode -> critical heat -> AC, read from the
    state file while streams decode: each policy's limits reach every worker,
    saver defers the disk tier's writes, critical heat refuses new requests
    with 429 and Retry-After, and the streams admitted before all finish with
    the answers the same server gave undisturbed (itself mlx-lm's, above)."""
    if server.decoders == 1:
        pytest.skip("split layout only: a colocated worker applies the same WorkerLimits (Worker.apply_limits, "
                    "tests/router/test_power_watch.py); one layout keeps the suite within its 15 minutes")
    convs = _SIXTEEN[:2]

    def ask(c):
        return client.chat.completions.create(model="default", messages=c, max_tokens=24,
                                              temperature=0).choices[0].message.content

    _set_power(server, source="ac")
    _wait_policy(server, "performance", 32)
    with cf.ThreadPoolExecutor(2) as pool:
        expected = list(pool.map(ask, convs))
        answers = [pool.submit(ask, c) for c in convs]
        _set_power(server, source="battery", percent=55)
        assert "on battery at 55%" in _wait_policy(server, "balanced", 8)["reason"]
        _set_power(server, source="battery", percent=55, low_power=True)
        power = _wait_policy(server, "saver", 4)
        assert power["pace_tokens_per_s"] > 0 and power["admitted_limit"] == 4 * server.decoders + 8
        assert metric(server, "tandem_requests_admitted_limit") == 4 * server.decoders + 8
        assert metric(server, "tandem_power_low_power_mode") == 1
        # Saver defers the KV disk tier's writes: a new prompt's blocks wait in memory.
        client.chat.completions.create(model="default", messages=CONVERSATIONS["long"], max_tokens=2, temperature=0)
        deadline = time.monotonic() + 20
        while metric(server, "tandem_cache_disk_writes_deferred") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        _set_power(server, source="battery", percent=55, low_power=True, thermal="critical")
        deadline = time.monotonic() + 20
        while metric(server, "tandem_power_refusing_new_requests") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="default", messages=CONVERSATIONS["short"], max_tokens=4)
        assert refused.value.response.headers["retry-after"] == "30"
        assert refused.value.code == "power_policy" and "critical" in refused.value.message
        assert [a.result(timeout=120) for a in answers] == expected
    _set_power(server, source="ac")
    _wait_policy(server, "performance", 32)
    assert metric(server, "tandem_power_policy", '{policy="performance"}') == 1
    deadline = time.monotonic() + 20
    while metric(server, "tandem_cache_disk_writes_deferred") != 0:  # written once allowed
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert metric(server, "tandem_power_policy_changes_total") >= 4
    assert ask(convs[0]) == expected[0]


def test_memory_pressure_shrinks_the_caches_and_metrics_say_so(server, client):
    """Critical memory pressure (from the level file): the cache service drops
    its unleased blocks and every model worker its hot tier, and /metrics says so;
    the server still answers, and the caches refill once it is normal again."""
    if server.decoders == 1:
        pytest.skip("split layout only: a colocated worker runs the same relief (workers/memory_relief.py); "
                    "one layout keeps the suite within its 15 minutes")
    client.chat.completions.create(model="default", messages=CONVERSATIONS["long"], max_tokens=4, temperature=0)
    assert metric(server, "tandem_cache_bytes", '{tier="memory"}') > 0
    server.pressure_file.write_text("critical")
    try:
        deadline = time.monotonic() + 20
        while not (metric(server, "tandem_memory_pressure", '{process="cache"}') == 2
                   and metric(server, "tandem_cache_bytes", '{tier="memory"}') == 0):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert metric(server, "tandem_memory_pressure_freed_bytes_total", '{process="cache"}') > 0
        worker = "worker-0" if server.decoders == 1 else "decode-0"
        while metric(server, "tandem_memory_pressure", f'{{process="{worker}"}}') != 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        answer = client.chat.completions.create(model="default", messages=CONVERSATIONS["short"], max_tokens=8,
                                                temperature=0)
        assert answer.choices[0].message.content
    finally:
        server.pressure_file.write_text("normal")
    deadline = time.monotonic() + 20
    while metric(server, "tandem_memory_pressure", '{process="cache"}') != 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
