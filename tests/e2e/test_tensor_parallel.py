"""`tandem serve --colocate --tensor-parallel 2` (and `--pipeline-parallel 2`):
one worker's model split over two ranks (MLX's ring backend on 127.0.0.1,
workers/group/) against the same weights in one process; the split layout's
prefill and decode groups, handing KV off rank by rank; sixteen streams
through a slow rank 0 (a test fault); a rank killed, alone or under load;
models that cannot split.

Float32 random models (benchmarks/random_models/text.py, with the embedded
model's tokenizer): sharding moves no weight value, only which rank sums
which part of each product (or, in a pipeline, which rank runs which layer),
so greedy tokens must be the same."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.groups import (
    LOAD_PROMPTS, LOAD_TOKENS, MAX_TOKENS, PROMPTS, ask, ask_all_at_once, one_process, random_model, slow_rank0_step,
    stream, stream_all_at_once,
)
from tests.support.server import metric, module_server, pid_alive

UNIT_TIMEOUT_S = 6  # the llama group's: a unit of a tiny model takes milliseconds


@pytest.fixture(scope="module")
def random_models(tmp_path_factory, embedded_model_dir):
    """like -> the session's float32 random model folder (tests/support/groups.py)."""
    return lambda like: random_model(tmp_path_factory, like, embedded_model_dir)


@pytest.fixture(scope="module")
def slow_steps(tmp_path_factory):
    """The folder of the module's servers' slow-step test fault (Settings.slow_step_dir)."""
    return tmp_path_factory.mktemp("slow-steps")


def group_server(request, tmp_path_factory, slow_steps, *args: str, warm_up: bool = False):
    """A module's group server, its ranks 0 open to the slow-step test fault."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TANDEM_TEST_SLOW_STEP_DIR", str(slow_steps))
        return module_server(request, tmp_path_factory, *args, warm_up=warm_up)


def follower_pids(srv) -> list[int]:
    """The pids the supervisor logged for worker-0.r1, oldest first."""
    return follower_pids_of(srv, "worker-0")


def follower_pids_of(srv, group: str) -> list[int]:
    """The pids the supervisor logged for `group`'s rank 1, oldest first."""
    return [int(p) for p in re.findall(rf"started {re.escape(group)}\.r1 \(pid (\d+)\)", srv.log_path.read_text())]


@pytest.fixture(scope="module")
def llama_group(request, tmp_path_factory, random_models, slow_steps):
    """A group serving tiny-llama, shared by the llama comparison and the kill test (which ends it).
    It drafts with the model itself (--draft-model: whole on each rank), so every draft is right
    and every step that drafts is a speculative step of several tokens, on both ranks alike."""
    model = str(random_models("tiny-llama"))
    return group_server(request, tmp_path_factory, slow_steps, "--model", model, "--colocate", "--draft-model", model,
                        "--no-disk-cache", "--tensor-parallel", "2", "--tensor-parallel-timeout", str(UNIT_TIMEOUT_S))


def spec_tokens(srv) -> tuple[float, float]:
    """(drafted, accepted) tokens, once the decode worker's heartbeats (0.5 s)
    have brought them all: the same counts two heartbeats apart."""
    last = None
    for _ in range(40):
        text = httpx.get(srv.base_url + "/metrics", timeout=10).text
        counts = tuple(sum(float(v) for v in re.findall(rf"^tandem_spec_{k}_tokens_total\{{[^}}]*\}} (\S+)$", text, re.M))
                       for k in ("proposed", "accepted"))
        if counts[0] and counts == last:
            return counts
        last = counts
        time.sleep(1.1)
    return last


def test_two_ranks_give_one_process_greedy_tokens(llama_group, random_models):
    """Speculating (the group's draft model is the target: always right): each
    decode step carries rank 0's step costs, so both ranks draft as many
    tokens per row and run the same verify passes; had they drafted apart,
    their collectives would have hung until the unit deadline restarted the group."""
    expected = one_process(str(random_models("tiny-llama")))
    two = llama_group
    assert len(follower_pids(two)) == 1 and pid_alive(follower_pids(two)[0])
    assert len(two.health()[1]["workers"]) == 1  # the router sees rank 0 only
    assert ask_all_at_once(two) == expected
    assert [n for _, n in expected] == MAX_TOKENS  # every row ran to its length: rows ended at different steps
    # How many tokens a row drafts follows the step costs rank 0 learns
    # (8 to 20 here, by the box's load); that every rank drafted the same is
    # what the identical tokens and the absent restart show.
    drafted, accepted = spec_tokens(two)
    assert drafted >= 1 and accepted == drafted
    assert "restarting group" not in two.log_path.read_text()


# Longer than a follower's old patience for rank 0's silence (heartbeat_timeout_s, 3 s) in one stretch.
SLOW_STEP_S = 4.0


def streams_through_a_slow_rank_0(srv, group: str, slow_steps, folder) -> None:
    """Sixteen short streams at once while `group`'s rank 0 spends SLOW_STEP_S
    after one unit (the test fault): every stream ends as one process's
    greedy text, and the group never restarts."""
    expected = [text for text, _ in one_process(folder, LOAD_PROMPTS, LOAD_TOKENS)]
    follower, restarts = follower_pids_of(srv, group)[-1], srv.log_path.read_text().count(f"restarting group {group}")
    slow_rank0_step(slow_steps, group, SLOW_STEP_S)
    assert stream_all_at_once(srv, LOAD_PROMPTS, LOAD_TOKENS) == expected
    log = srv.log_path.read_text()
    assert f"test fault: this unit of {group} takes {SLOW_STEP_S:.1f} s longer" in log
    assert log.count(f"restarting group {group}") == restarts
    assert follower_pids_of(srv, group)[-1] == follower and pid_alive(follower)


def test_sixteen_streams_wait_out_a_slow_rank_0_step(llama_group, random_models, slow_steps):
    """Issue 40: a follower gave up on a rank 0 busy for longer than 3 s, and
    the group went down with its requests. Rank 0 now beats from a thread
    while its loop lives (workers/group/lockstep.py), so its follower waits."""
    streams_through_a_slow_rank_0(llama_group, "worker-0", slow_steps, random_models("tiny-llama"))


def test_a_pipeline_of_two_ranks_gives_one_process_greedy_tokens(server_factory, random_models):
    """tiny-qwen2's 3 layers over two ranks (mlx-lm's `pipeline`): rank 1 runs
    the first and sends its hidden states to rank 0, which runs the last two;
    both all_gather rank 0's last hidden state, so both sample the same token.
    In the split layout: each prefill rank hands the KV of its own layers to
    the same decode rank (a rank of uneven layers: the ranks count a batch's
    handoff bytes alike). Warm-up on: every rank's first passes in step, as
    a real start has them. (Colocated, a pipeline group keeps its KV in its
    process, as the tensor-parallel llama group above does.)"""
    model = str(random_models("tiny-qwen2"))
    expected = one_process(model)
    two = server_factory("--model", model, "--no-disk-cache", "--pipeline-parallel", "2", warm_up=True)
    assert all(len(follower_pids_of(two, g)) == 1 for g in ("prefill-0", "decode-0"))
    assert sorted(w["id"] for w in two.health()[1]["workers"]) == ["decode-0", "prefill-0"]
    assert ask_all_at_once(two) == expected
    assert metric(two, "tandem_kv_handoff_tokens_total", '{path="copied"}') >= len(PROMPTS) * 5
    log = two.log_path.read_text()
    assert "pipeline rank 0 of 2 keeps layers 1-2 of 3" in log and "pipeline rank 1 of 2 keeps layers 0-0 of 3" in log


# Long enough for many KV blocks (4 tokens each on a CPU) past any other test's prompt.
LONG_PROMPT = "The lighthouse keeper wrote down every ship that passed the rocks that night. " * 10


def test_a_group_finds_its_shards_of_a_repeated_prompt_in_the_prefix_cache(llama_group, random_models):
    """Each rank stores its own shard of a prompt's KV blocks (its KV heads, under
    keys of its own) in the host's cache service and finds it again; the ranks
    agree on the hit (workers/group/prefix_agreement.py), so the second ask
    computes only the prompt's end, with one process's greedy tokens."""
    from mlx_lm.generate import stream_generate

    from workers.models.loading import load_model

    model, tokenizer = load_model(str(random_models("tiny-llama")))
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt=tokenizer.encode(LONG_PROMPT), max_tokens=12)]
    expected = tokenizer.decode(tokens)

    def ask_cached() -> tuple[str, int, int]:
        r = httpx.post(llama_group.base_url + "/v1/completions", timeout=60, json={
            "model": "default", "prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return r.json()["choices"][0]["text"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    text, n, cold = ask_cached()
    assert text == expected and cold == 0 and n > 100
    text, _, cached = ask_cached()
    # A hit only if every rank found its own shard: the group takes the smallest rank's.
    assert text == expected and n // 2 < cached < n
    assert metric(llama_group, "tandem_prefix_cache_hit_tokens_total") >= cached


def test_a_killed_follower_restarts_the_group_and_requests_go_on(llama_group):
    srv = llama_group
    expected, _ = ask(srv, PROMPTS[0], 120)
    leader, follower = srv.worker_pid("prefill+decode"), follower_pids(srv)[0]
    pieces = stream(srv, PROMPTS[0], 120)
    got = [next(pieces) for _ in range(4)]
    os.kill(follower, signal.SIGKILL)  # mid-stream: rank 0 is in a decode step, or about to be
    got += list(pieces)
    # The router moved the request to the restarted group, which went on from
    # where it was: the client sees the uninterrupted run's text.
    assert "".join(got) == expected
    deadline = time.monotonic() + 90  # the stream may end before the supervisor has seen the death
    while leader in [w["pid"] for w in srv.wait_healthy(timeout=90)["workers"]]:
        assert time.monotonic() < deadline, "rank 0 did not go with its follower"  # it must, at once
        time.sleep(0.2)
    assert len(follower_pids(srv)) == 2 and not pid_alive(follower)
    assert "restarting group worker-0" in srv.log_path.read_text()
    assert ask(srv, PROMPTS[1], 9)[1] == 9  # and it serves after


def test_models_and_flags_a_group_cannot_take_are_refused_at_start(embedded_model_dir):
    cases = {  # flags -> what stderr must say
        # The embedded SmolLM2-135M: 9 attention heads and 3 KV heads do not split in two.
        ("--colocate", "--tensor-parallel", "2"): "9 attention heads, 3 KV heads do not divide by --tensor-parallel 2",
        ("--tensor-parallel", "2", "--hosts", "hosts.json"): "--hosts needs --colocate",
        # SmolLM2 is a llama: mlx-lm has no pipeline for it.
        ("--colocate", "--pipeline-parallel", "2"): "no pipeline-parallel `pipeline` method",
        ("--colocate", "--tensor-parallel", "2", "--pipeline-parallel", "2"): "2-D group, which is not built",
    }
    procs = {flags: subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--port", "1", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for flags in cases}
    for flags, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and cases[flags] in err and "Traceback" not in err, (flags, err)


def test_a_stuck_follower_ends_its_group_at_the_unit_deadline_and_requests_go_on(llama_group):
    """A rank that hangs without dying (SIGSTOP here; a stuck GPU or ranks
    whose steps went apart in life) leaves rank 0 waiting in a collective
    that no message can end: past --tensor-parallel-timeout rank 0 dies,
    the group restarts, and the stream comes as if nothing happened."""
    srv = llama_group
    expected, _ = ask(srv, PROMPTS[2], 60)
    leader, follower = srv.worker_pid("prefill+decode"), follower_pids(srv)[-1]
    restarts = srv.log_path.read_text().count("restarting group worker-0")
    # Stopped before the request comes, so rank 0 surely waits in the first
    # collective of its units, however fast the box (a tiny model's answer
    # read mid-stream may be done on the server already).
    os.kill(follower, signal.SIGSTOP)
    try:
        got = list(stream(srv, PROMPTS[2], 60))
    finally:
        if pid_alive(follower):
            os.kill(follower, signal.SIGCONT)
    assert "".join(got) == expected
    srv.wait_healthy(timeout=90)
    log = srv.log_path.read_text()
    assert log.count("restarting group worker-0") == restarts + 1
    assert "exited with code -14" in log  # rank 0, by SIGALRM: the unit's deadline
    assert not pid_alive(leader) and not pid_alive(follower)


@pytest.fixture(scope="module")
def split_groups(request, tmp_path_factory, random_models, slow_steps):
    """tiny-qwen3 in the split layout: a prefill group and a decode group of
    two ranks each. Warm-up on: every rank of both groups in step, as a real
    start has them."""
    return group_server(request, tmp_path_factory, slow_steps, "--model", str(random_models("tiny-qwen3")),
                        "--no-disk-cache", "--tensor-parallel", "2", "--tensor-parallel-timeout", str(UNIT_TIMEOUT_S),
                        warm_up=True)


def test_split_groups_hand_kv_off_rank_by_rank_with_one_process_greedy_tokens(split_groups, random_models):
    """Each prefill rank writes its own KV heads into the arena and the same
    decode rank reads them (workers/group/handoff_shards.py): a decode rank
    that read another's shard would attend over the wrong heads, and its
    tokens would differ from one process's."""
    srv = split_groups
    expected = one_process(str(random_models("tiny-qwen3")))
    workers = srv.health()[1]["workers"]
    assert sorted((w["id"], w["kv_shard"]) for w in workers) == [("decode-0", "tensor 2"), ("prefill-0", "tensor 2")]
    assert all(len(follower_pids_of(srv, g)) == 1 for g in ("prefill-0", "decode-0"))
    copied = metric(srv, "tandem_kv_handoff_tokens_total", '{path="copied"}')
    assert ask_all_at_once(srv) == expected
    assert metric(srv, "tandem_kv_handoff_tokens_total", '{path="copied"}') - copied >= len(PROMPTS) * 5
    assert metric(srv, "tandem_kv_handoff_tokens_total", '{path="sent"}') == 0  # never by value
    # The prefix cache across the handoff: the decode group's ranks store their
    # shards of the finished prompt; the prefill group's find them.
    first = httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
        "model": "default", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}).json()
    again = httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
        "model": "default", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}).json()
    n = again["usage"]["prompt_tokens"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert n // 2 < again["usage"]["prompt_tokens_details"]["cached_tokens"] < n


def test_sixteen_streams_wait_out_a_slow_decode_rank_0_step(split_groups, random_models, slow_steps):
    """Issue 40's case: decode-0's rank 0 busy past its follower's old patience."""
    streams_through_a_slow_rank_0(split_groups, "decode-0", slow_steps, random_models("tiny-qwen3"))


KILL_TOKENS = 40  # each stream's: long enough to be decoding when the rank dies


def test_a_decode_follower_killed_under_load_takes_its_group_down_and_every_stream_goes_on(split_groups,
                                                                                           random_models):
    """decode-0's rank 1 killed while sixteen streams decode: the supervisor
    ends rank 0 at once (not its unit deadline: -14), the router moves the
    group's requests as for any dead worker (prefilled again, handed to the
    restarted group), every stream ends as one process's greedy text, and
    the KV handoffs the dead group was sent go back to the cache service
    (not left to expire, issue 40)."""
    srv = split_groups
    expected = [text for text, _ in one_process(random_models("tiny-qwen3"), LOAD_PROMPTS, [KILL_TOKENS] * 16)]
    leader, follower = srv.worker_pid("decode"), follower_pids_of(srv, "decode-0")[-1]
    restarts = srv.log_path.read_text().count("restarting group decode-0")
    decoding = threading.Semaphore(0)

    def one(prompt: str) -> str:
        got = []
        try:
            for piece in stream(srv, prompt, KILL_TOKENS):
                got.append(piece)
                if len(got) == 2:  # the second piece comes from decode
                    decoding.release()
        finally:
            if len(got) < 2:
                decoding.release()
        return "".join(got)

    with ThreadPoolExecutor(len(LOAD_PROMPTS)) as pool:
        texts = pool.map(one, LOAD_PROMPTS)
        for _ in range(len(LOAD_PROMPTS) // 2):  # half decoding, the rest on their way
            assert decoding.acquire(timeout=120)
        os.kill(follower, signal.SIGKILL)
        assert list(texts) == expected
    srv.wait_healthy(timeout=90)
    log = srv.log_path.read_text()
    assert log.count("restarting group decode-0") == restarts + 1 and not pid_alive(leader)
    # How decode-0's rank 0 ended: by the supervisor, at once; not by its unit deadline (SIGALRM).
    assert re.findall(r"restarting group decode-0 \(decode-0: (\S+),", log)[-1] != "-14"
    deadline = time.monotonic() + 30  # far within the handoffs' TTL (120 s): given back, not expired
    while srv.health()[1]["cache_service"]["handoffs"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert srv.health()[1]["cache_service"]["handoffs"] == 0
    assert ask(srv, PROMPTS[1], 9)[1] == 9


def test_a_killed_prefill_follower_restarts_its_group_while_streams_decode_on(split_groups):
    """The prefill group's rank 1 killed mid-stream: the stream, decoding in
    the other group, goes on untouched; the prefill group restarts (rank 0
    with it) and the next prompt is prefilled by the new group."""
    srv = split_groups
    expected, _ = ask(srv, PROMPTS[2], 80)
    leader, follower = srv.worker_pid("prefill"), follower_pids_of(srv, "prefill-0")[-1]
    pieces = stream(srv, PROMPTS[2], 80)
    got = [next(pieces) for _ in range(2)]
    os.kill(follower, signal.SIGKILL)
    got += list(pieces)
    assert "".join(got) == expected
    deadline = time.monotonic() + 90  # the stream may end before the supervisor has seen the death
    while leader in [w["pid"] for w in srv.wait_healthy(timeout=90)["workers"]]:
        assert time.monotonic() < deadline, "rank 0 did not go with its follower"  # it must, at once
        time.sleep(0.2)
    assert "restarting group prefill-0" in srv.log_path.read_text()
    assert ask(srv, PROMPTS[2], 80)[0] == expected  # prefilled by the new group
