"""Many models on one endpoint (issue 41), on a real server: a Hugging Face
cache of three tiny random llamas (the embedded model's tokenizer, float32:
each token ~1 ms), `tandem serve --model tests/tiny-a --max-loaded-models 2`.
A request naming another downloaded model loads it (its own worker, its own
socket); its greedy answer is mlx-lm's on its weights; the least recently
used idle model makes room; keep_alive 0 and a ttl unload; a model not
downloaded, or a path, is a 404."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.embedded_chat import reference
from tests.support.server import TandemServer, metric, pid_alive

COMMIT = "a" * 40
REPOS = {"tests/tiny-a": 3, "tests/tiny-b": 4, "tests/tiny-c": 5}  # name: weights' seed
ANSWER = 6
QUESTIONS = ["Name a colour.", "What is 2 + 2?"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, embedded_model_dir):
    """HF_HOME with the three models as huggingface_hub lays out a pull."""
    from benchmarks.random_models.text import write_random_model

    home = tmp_path_factory.mktemp("hf")
    for repo, seed in REPOS.items():
        folder = home / "hub" / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(COMMIT)
        write_random_model("tiny-llama", folder / "snapshots" / COMMIT, dtype="float32", seed=seed,
                           tokenizer_dir=embedded_model_dir)
    return home


@pytest.fixture(scope="module")
def server(tmp_path_factory, hub):
    srv = TandemServer("--model", "tests/tiny-a", "--colocate", "--no-disk-cache", "--max-loaded-models", "2",
                       log_path=tmp_path_factory.mktemp("srv") / "server.log",
                       env={"HF_HOME": str(hub), "HF_HUB_OFFLINE": "1"})
    yield srv.start()
    srv.stop()


@pytest.fixture(scope="module")
def models(hub):
    from workers.models.loading import load_model

    return {repo: load_model(str(hub / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / COMMIT))
            for repo in REPOS}


def chat(srv, model: str, question: str, **extra) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": question}], "max_tokens": ANSWER,
        "temperature": 0, **extra})


def loaded(srv) -> dict:
    return {m["name"]: m for m in srv.health()[1]["models"] if m["state"] == "ready"}


def wait_for(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_two_models_answer_side_by_side_as_each_alone(server, models):
    asks = [(repo, q) for repo in ("tests/tiny-a", "tests/tiny-b") for q in QUESTIONS]
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda rq: chat(server, *rq), asks))
    for (repo, question), r in zip(asks, answers):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == repo
        expected = reference(models[repo], [{"role": "user", "content": question}], ANSWER)[1].lstrip()
        assert body["choices"][0]["message"]["content"] == expected, (repo, question)
    assert set(loaded(server)) == {"tests/tiny-a", "tests/tiny-b"}
    assert loaded(server)["tests/tiny-b"]["workers"] == ["m1.worker-0"]
    # /metrics: the server's own model's series as before, the one loaded on demand's labelled with it,
    # each family once (as Prometheus requires).
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    types = re.findall(r"^# TYPE (\S+)", text, re.M)
    assert len(types) == len(set(types))
    made = {repo: sum(r.json()["usage"]["completion_tokens"] for (rr, _), r in zip(asks, answers) if rr == repo)
            for repo in ("tests/tiny-a", "tests/tiny-b")}
    assert metric(server, "tandem_generation_tokens_total") == made["tests/tiny-a"]
    assert metric(server, "tandem_generation_tokens_total", '{model="tests/tiny-b"}') == made["tests/tiny-b"]


def test_models_lists_every_downloaded_model_and_which_are_loaded(server):
    r = httpx.get(server.base_url + "/v1/models", timeout=10)
    cards = {c["id"]: c for c in r.json()["data"]}
    assert set(cards) == set(REPOS)
    assert cards["tests/tiny-a"]["loaded"] and cards["tests/tiny-b"]["loaded"] and not cards["tests/tiny-c"]["loaded"]
    assert httpx.get(server.base_url + "/v1/models/tests/tiny-c", timeout=10).json()["id"] == "tests/tiny-c"


def test_a_third_model_unloads_the_least_recently_used_idle_one_and_goes_after_its_ttl(server, models):
    assert chat(server, "tests/tiny-a", QUESTIONS[0]).status_code == 200  # b is now the least recently used
    # Ollama's tag; LM Studio's ttl, in seconds (3: still loaded when asked next, on a loaded box too)
    r = chat(server, "tests/tiny-c:latest", QUESTIONS[1], ttl=3)
    assert r.status_code == 200, r.text
    expected = reference(models["tests/tiny-c"], [{"role": "user", "content": QUESTIONS[1]}], ANSWER)[1].lstrip()
    assert r.json()["choices"][0]["message"]["content"] == expected
    assert set(loaded(server)) == {"tests/tiny-a", "tests/tiny-c"}
    wait_for(lambda: "tests/tiny-c" not in loaded(server), "tiny-c still loaded 15 s past its 3 s ttl", 18)
    assert "tests/tiny-a" in loaded(server)  # the server's own model stays


def test_keep_alive_zero_unloads_the_servers_own_model_and_the_next_request_loads_it_again(server, models):
    old = {w["id"]: w["pid"] for w in server.health()[1]["workers"]}
    r = chat(server, "default", QUESTIONS[0], keep_alive=0)
    assert r.status_code == 200, r.text
    wait_for(lambda: not loaded(server), "tiny-a still loaded after keep_alive 0", 10)
    assert server.health()[0] == 200  # idle, not down: it loads on the next request
    wait_for(lambda: not any(pid_alive(pid) for pid in old.values()), "its worker still runs", 10)
    r = chat(server, "default", QUESTIONS[1])
    assert r.status_code == 200, r.text
    expected = reference(models["tests/tiny-a"], [{"role": "user", "content": QUESTIONS[1]}], ANSWER)[1].lstrip()
    assert r.json()["choices"][0]["message"]["content"] == expected
    new = {w["id"]: w["pid"] for w in server.health()[1]["workers"]}
    assert set(new) == set(old) and not set(new.values()) & set(old.values())  # the same names, new processes


@pytest.mark.parametrize("name", ["tests/not-pulled", "/etc", "../tests/tiny-a", "tests/tiny-a@nope"])
def test_a_model_not_downloaded_or_a_path_is_a_404_that_says_pull(server, name):
    r = chat(server, name, QUESTIONS[0])
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found" and "pull" in r.json()["error"]["message"]


def test_a_keep_alive_that_is_no_duration_is_a_400(server):
    r = chat(server, "tests/tiny-a", QUESTIONS[0], keep_alive="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
