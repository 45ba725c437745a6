"""The shared prefix cache end to end on the embedded model: KV blocks reused
across requests, conversation turns, workers and a server restart, with greedy
output identical to mlx_lm's and the reuse visible in usage and /metrics."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import time

import httpx
import openai
import pytest

from tests.support.embedded_chat import LONG_SYSTEM, reference
from tests.support.groups import random_model
from tests.support.server import metric

BLOCK = 16


def client_for(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def worker_metric(srv, name: str, role: str, at_least: float = 1, wait_s: float = 5.0) -> float:
    """A per-worker metric of the worker with `role`; workers report in
    heartbeats, so wait (up to `wait_s`) for it to reach `at_least`."""
    deadline = time.monotonic() + wait_s
    while True:
        text = httpx.get(srv.base_url + "/metrics", timeout=10).text
        m = re.search(rf'^{re.escape(name)}{{pid="\d+",role="{re.escape(role)}"}} ([0-9.e+]+)$', text, re.M)
        assert m, f"{name} of the {role} worker not in /metrics"
        if float(m.group(1)) >= at_least or time.monotonic() > deadline:
            return float(m.group(1))
        time.sleep(0.2)


ANSWER = 16  # tokens an answer here takes (each costs ~0.1 s on a CPU, in mlx-lm's reference and the server)
# turn1's answer of 16 fills the block after its prompt's last full one, so turn2 reuses a block decode committed
# (99 prompt tokens + 16 = 115); answers nothing builds on are shorter: their length asserts nothing.
SHORT = 6


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory, embedded_model_dir):
    """A float32 random tiny llama with the embedded model's tokenizer and
    chat template: (folder, (model, tokenizer)). For the tests of the cache's
    machinery (eviction, batched prefill over cached blocks), whose answers
    need no sense: every token costs ~1 ms instead of ~0.1 s, and its KV is
    ~512 bytes a token (the embedded model's ~46 KB), so an arena 90x smaller
    is as tight."""
    from workers.models.loading import load_model

    folder = random_model(tmp_path_factory, "tiny-llama", embedded_model_dir)
    return folder, load_model(str(folder))


def answer_text(model, messages) -> str:
    """mlx-lm's greedy answer of SHORT tokens as the server sends it: a
    random model's first token may start with a space, which a chat answer
    leaves out (mlx-lm's detokenizer drops it too, as mlx_lm.server)."""
    return reference(model, messages, SHORT)[1].lstrip()


def ask(client, messages, max_tokens=ANSWER):
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def test_reuse_across_requests_turns_and_restart(server_factory, embedded_model, tmp_path):
    cache_dir = str(tmp_path / "kv")
    flags = ("--block-size", str(BLOCK), "--prefill-chunk", "64", "--cache-dir", cache_dir)
    srv = server_factory(*flags)
    client = client_for(srv)
    system = {"role": "system", "content": LONG_SYSTEM}
    turn1 = [system, {"role": "user", "content": "Name a river in France."}]
    gen1, ref1, n1 = reference(embedded_model, turn1, ANSWER)
    # The asks of turn1 after the first compare SHORT tokens (greedy: the answer's first ones): their cache
    # hits, not their length, are under test (each token ~0.1 s of CPU).
    assert not set(gen1[:SHORT]) & set(embedded_model[1].eos_token_ids)
    ref1_short = embedded_model[1].decode(gen1[:SHORT])

    # Cold: nothing cached.
    text, usage = ask(client, turn1)
    assert text == ref1 and usage.prompt_tokens_details.cached_tokens == 0
    usages = [usage]

    # Full hit: the same prompt again reuses every full block but the last token's.
    text, usage = ask(client, turn1, SHORT)
    assert text == ref1_short
    assert usage.prompt_tokens_details.cached_tokens == (n1 - 1) // BLOCK * BLOCK
    usages.append(usage)

    # Partial hit: same system prompt, another question.
    other = [system, {"role": "user", "content": "Name a mountain in Italy."}]
    _, ref_other, n_other = reference(embedded_model, other, SHORT)
    text, usage = ask(client, other, SHORT)
    assert text == ref_other
    usages.append(usage)
    shared = len(embedded_model[1].apply_chat_template([system], add_generation_prompt=False)) // BLOCK * BLOCK
    assert shared <= usage.prompt_tokens_details.cached_tokens < n_other - BLOCK

    # Next turn: the answer's blocks (committed by the decode worker) are
    # reused too, to its very last token (the tail block after its last full
    # one): only the new message is computed, as in mlx_lm.server.
    turn2 = turn1 + [{"role": "assistant", "content": ref1}, {"role": "user", "content": "And one in Spain?"}]
    _, ref2, n2 = reference(embedded_model, turn2, SHORT)
    ids1 = embedded_model[1].apply_chat_template(turn1, add_generation_prompt=True) + gen1
    ids2 = embedded_model[1].apply_chat_template(turn2, add_generation_prompt=True)
    assert ids2[:len(ids1)] == ids1 and len(ids1) % BLOCK  # the template repeats turn one's tokens exactly
    text, usage = ask(client, turn2, SHORT)
    assert text == ref2
    usages.append(usage)
    assert usage.prompt_tokens_details.cached_tokens == len(ids1)
    assert metric(srv, "tandem_prefix_cache_hit_tokens_total") >= usage.prompt_tokens_details.cached_tokens
    assert metric(srv, "tandem_prefix_cache_queries_total") == 4
    assert metric(srv, "tandem_cache_bytes", '{tier="memory"}') > 0
    # Each handoff referred to the blocks its prompt found cached instead of
    # copying them (its new blocks are stored after the handoff, so they go
    # in its tail, as do the tokens it read from a tail block); decode took
    # the repeated ones from its own memory.
    referenced = metric(srv, "tandem_kv_handoff_tokens_total", '{path="referenced"}')
    copied = metric(srv, "tandem_kv_handoff_tokens_total", '{path="copied"}')
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert referenced + copied == sum(u.prompt_tokens for u in usages)
    assert cached - BLOCK < referenced < cached + 4 * BLOCK
    assert worker_metric(srv, "tandem_worker_hot_kv_hit_blocks_total", "decode", n1 // BLOCK) >= n1 // BLOCK
    assert worker_metric(srv, "tandem_worker_hot_kv_bytes", "decode") > 0

    # Restart: the disk tier brings the warm prefix back. Colocated this time (half the processes to
    # start): the disk tier is the cache service's, whichever workers read it.
    srv.stop()
    srv2 = server_factory(*flags, "--colocate")
    assert metric(srv2, "tandem_cache_bytes", '{tier="disk"}') > 0
    text, usage = ask(client_for(srv2), turn1, SHORT)
    assert text == ref1_short
    assert usage.prompt_tokens_details.cached_tokens == (n1 - 1) // BLOCK * BLOCK

    # Another tenant (a cache_salt) finds none of it, then its own.
    for expected_hit in (0, (n1 - 1) // BLOCK * BLOCK):
        r = client_for(srv2).chat.completions.create(model="default", messages=turn1, max_tokens=SHORT, temperature=0,
                                                     extra_body={"cache_salt": "tenant-b"})
        assert r.choices[0].message.content == ref1_short
        assert r.usage.prompt_tokens_details.cached_tokens == expected_hit
    # The KV on disk (prompts can be read back from it) is the user's alone.
    modes = {os.path.join(d, n): os.stat(os.path.join(d, n)).st_mode & 0o777
             for d, dirs, files in os.walk(cache_dir) for n in dirs + files}
    assert modes and set(modes.values()) <= {0o600, 0o700}, modes
    assert os.stat(cache_dir).st_mode & 0o777 == 0o700


def test_tiny_cache_evicts_without_failing_or_changing_output(server_factory, tiny_chat):
    # An arena of ~30 blocks of the tiny model (its handoff of a prompt ~100 KiB) and 8 prompts of
    # ~7 blocks each force evictions. With prefill batches (a GPU's default), whose handoffs must fit
    # together in an eighth of it.
    folder, model = tiny_chat
    srv = server_factory("--model", str(folder), "--block-size", str(BLOCK), "--cache-memory", "272K",
                         "--no-disk-cache", "--prefill-batch", "8")
    client = client_for(srv)
    convs = [[{"role": "system", "content": f"Persona {i}: {LONG_SYSTEM}"},
              {"role": "user", "content": f"Give me fact number {i} about rivers."}] for i in range(8)]
    with cf.ThreadPoolExecutor(6) as pool:
        first = list(pool.map(lambda c: ask(client, c, SHORT)[0], convs))
        again = list(pool.map(lambda c: ask(client, c, SHORT)[0], convs))
    # mlx-lm's own answers for three of them (each costs seconds on a CPU); the
    # second round, after the evictions, must give every first answer again.
    assert [first[i] for i in (0, 3, 7)] == [answer_text(model, convs[i]) for i in (0, 3, 7)]
    assert again == first and len(set(first)) > 1
    assert metric(srv, "tandem_cache_evictions_total", '{tier="memory"}') > 0
    assert metric(srv, "tandem_requests_total", '{status="ok"}') == 16


@pytest.mark.parametrize("role", ["prefill+decode"])  # split's batched handoffs: test_tiny_cache_evicts_... (--prefill-batch 8)
def test_a_burst_of_agents_is_prefilled_in_batches_with_mlx_lm_output(server_factory, tiny_chat, role):
    """A swarm's turns arrive together: the prefill worker takes the queued
    prompts over the cached system prompt in shared passes
    (workers/prefill/batch.py), and every answer is still mlx-lm's own,
    whether the rows' KV is handed off or decoded where it was made (--colocate)."""
    # Batching is a GPU's default (environment/settings.py default_prefill_batch); asked for here.
    folder, model = tiny_chat
    srv = server_factory("--model", str(folder), "--block-size", str(BLOCK), "--prefill-batch", "8",
                         *(["--colocate"] if "+" in role else []))
    client = client_for(srv)
    system = {"role": "system", "content": LONG_SYSTEM}
    ask(client, [system, {"role": "user", "content": "Hello."}], 4)  # the system prompt, cached
    convs = [[system, {"role": "user", "content": f"Agent {i}: name {i + 2} rivers in Europe."}] for i in range(8)]
    refs = [(*reference(model, c, SHORT)[::2], answer_text(model, c)) for c in convs]
    with cf.ThreadPoolExecutor(len(convs)) as pool:
        answers = list(pool.map(lambda c: ask(client, c, SHORT), convs))
    assert [text for text, _ in answers] == [text for _, _, text in refs] and len({t for _, _, t in refs}) > 1
    for (_, usage), (_, n_prompt, _) in zip(answers, refs):
        assert usage.prompt_tokens == n_prompt
        assert usage.prompt_tokens_details.cached_tokens >= len(LONG_SYSTEM) // 8  # the system prompt's blocks
    # The first prompt of the burst runs alone while the others queue behind it.
    assert worker_metric(srv, "tandem_worker_batched_prompts_total", role, 2) >= 2
    assert metric(srv, "tandem_requests_total", '{status="ok"}') == 9
