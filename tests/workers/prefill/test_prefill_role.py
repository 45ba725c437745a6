"""Prompts prefilled together over cached prefixes (workers/prefill/batch.py)
and the prefill role's scheduling (workers/prefill/role.py) over the fake
cache service, with no sockets."""

from __future__ import annotations

import threading

import pytest

from protos.messages import DecodeRequest, KVHandoff, SamplingParams
from tests.support.cache_fakes import FakeCacheService
from tests.support.prefix import prefix_for, run_request
from tests.support.tiny_models import Counting, greedy, prompt_of, reference
from workers.decode.engine import DecodeEngine
from workers.prefill.engine import PrefillEngine

BS = 8  # small blocks: short prompts span several


@pytest.fixture(params=["ours", "mlx-lm's"])
def attention(request, monkeypatch):
    """This backend's attention of ours (workers/kernels/mlx_hooks.py), or mlx-lm's
    own with its mask (what a Mac's GPU runs)."""
    from workers.kernels import mlx_hooks

    if request.param != "ours":
        monkeypatch.setenv("TANDEM_MLX_EXP", "1")
        monkeypatch.setenv("TANDEM_CUDNN_PREFILL", "1")
        monkeypatch.setenv("TANDEM_MLX_DECODE_ATTENTION", "1")
    mlx_hooks._set_backend()
    yield request.param
    monkeypatch.undo()
    mlx_hooks._set_backend()


def test_a_batch_of_prompts_over_cached_prefixes_matches_mlx_lm(model, tiny_dir, attention):
    """A burst of prompts prefilled in one pass (workers/prefill/batch.py):
    cached prefixes of different lengths, new tails of different lengths
    (one of none but its last token, one with no cached prefix at all), each
    row's first token and whole greedy generation equal mlx-lm's alone, and
    the passes run over the batch's padded new tokens only; with our
    attention and with mlx-lm's."""
    from workers.prefill.batch import batchable, fits, run_batch

    fake = FakeCacheService()
    counted = Counting(model)
    prefix = prefix_for(counted, tiny_dir, fake)
    system = prompt_of(40, 7)
    engine = PrefillEngine(counted, chunk_size=128, prefix=prefix)
    engine.run(system + prompt_of(8, 8), greedy(), owner="warm")  # 6 blocks stored
    prompts = [system + prompt_of(n, 10 + n) for n in (1, 5, 13, 20)]
    prompts.append(system + prompt_of(8, 8) + [5])  # all but its last token cached
    prompts.append(prompt_of(11, 99))  # nothing cached
    expect = [reference(model, p, 10) for p in prompts]

    jobs = [engine.start(p, greedy(10), owner=f"r{i}") for i, p in enumerate(prompts)]
    for j in jobs:
        j.load()
        assert batchable(j)
    assert [j.cached_tokens for j in jobs] == [40, 40, 40, 40, 48, 0]
    for i in range(1, len(jobs)):
        assert fits(jobs[:i], jobs[i])
    counted.tokens = 0
    results = run_batch(jobs)
    longest = max(len(p) - j.cached_tokens - 1 for p, j in zip(prompts, jobs))
    assert counted.tokens == len(jobs) * longest + len(jobs)  # one padded pass, then one token a row
    assert [r.first_token for r in results] == [e[0] for e in expect]
    assert [r.cached_tokens for r in results] == [40, 40, 40, 40, 48, 0]
    # Each row's cache is the prompt's whole KV: decoding from it gives mlx-lm's answer.
    for i, (p, res) in enumerate(zip(prompts, results)):
        assert res.num_tokens == len(p) and all(c.offset == len(p) for c in res.cache)
        decode = DecodeEngine(model, max_batch=4)
        decode.add(DecodeRequest(f"r{i}", p, res.first_token, KVHandoff(f"r{i}", len(p), len(p)), greedy(10)),
                   res.cache)
        tokens = [res.first_token]
        while decode.has_work:
            tokens += [u.token for u in decode.step()]
        assert tokens == expect[i], i
    # Their new blocks store as a lone prompt's do, and serve the next one.
    stored = sum(j.save_prefix() for j in jobs)
    assert stored > 0 and prefix.stats.failures == 0
    tokens, res = run_request(model, prefix, prompts[3], greedy(10), rid="again")
    assert res.cached_tokens == 56 and tokens == expect[3]


def test_what_a_batch_of_prompts_takes(model, tiny_dir):
    """Only text prompts with their new tokens within one chunk, padded
    together, join a batch."""
    from workers.prefill.batch import batchable, fits

    engine = PrefillEngine(model, chunk_size=32)
    short, longer, too_long = (engine.start(prompt_of(n, n), greedy()) for n in (9, 16, 33))
    for j in (short, longer, too_long):
        j.load()
    assert batchable(short) and batchable(longer) and not batchable(too_long)  # 33 new tokens > 32
    assert fits([short], longer)  # 2 rows x 16 <= 32
    assert not fits([short, longer], engine.start(prompt_of(9, 1), greedy()))  # 3 x 16 > 32
    short.step()
    assert not batchable(short)  # already computed
    # What the worker weighs a batch's handoffs by.
    assert engine.token_nbytes() * 9 == sum(c.keys[..., :9, :].nbytes + c.values[..., :9, :].nbytes
                                            for c in short.cache)


def test_a_batchs_rows_sample_with_their_own_requests_settings(model, tiny_dir):
    """Each row of a batch samples its first token as it would alone: its
    logprobs, its seeded sampler, its penalties over its own prompt."""
    from workers.prefill.batch import run_batch

    engine = PrefillEngine(model, chunk_size=128)
    base = prompt_of(24, 5)
    prompts = [base + prompt_of(n, 40 + n) for n in (3, 9, 6)]
    settings = [SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=3),
                SamplingParams(max_tokens=4, temperature=0.9, top_p=0.9, seed=7),
                SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.5,
                               logit_bias={int(t): -100.0 for t in prompts[2][-3:]})]
    alone = [engine.run(p, sp) for p, sp in zip(prompts, settings)]
    jobs = []
    for p, sp in zip(prompts, settings):  # the first 20 tokens cached, as a prefix cache would load them
        head = PrefillEngine(model, chunk_size=128).run(base[:20], greedy()).cache
        job = engine.start(p, sp)
        job.load(cached=(head, 20))
        jobs.append(job)
    batched = run_batch(jobs)
    for a, b in zip(alone, batched):
        assert b.first_token == a.first_token
    lp_a, lp_b = alone[0].logprob, batched[0].logprob
    assert lp_b.token == lp_a.token and lp_b.logprob == pytest.approx(lp_a.logprob, abs=1e-4)
    assert [t for t, _ in lp_b.top] == [t for t, _ in lp_a.top]
    assert batched[1].logprob is None and batched[2].first_token not in prompts[2][-3:]


class _Outbox:
    def __init__(self):
        self.sent = []

    def send(self, msg, wait_s=None):
        self.sent.append(msg)


def _prefill_worker(engine, fake, settings, colocated=False, stores=None):
    """A prefill worker's prefill role (workers/prefill/role.py PrefillRole)
    over `engine` and the fake cache service, with no sockets: what it sends
    is recorded."""
    from protos.messages import CacheAllocReply, WorkerHello
    from workers.loop_clock import LoopClock
    from workers.prefill.role import PrefillRole

    allocations = iter(range(1000))
    fake.alloc = lambda nbytes, owner, ttl_s: CacheAllocReply(0, True, allocation=next(allocations),
                                                              offset=1 << 24, nbytes=nbytes, arena=fake.arena)
    return PrefillRole(settings, engine, worker_id="prefill-0", prefix=engine.prefix, cache=fake,
                       arena_buf=fake.buffer, outbox=_Outbox(), clock=LoopClock("test"),
                       hello=WorkerHello("prefill-0", ["prefill"], 1, "ready"), local_kv={}, colocated=colocated,
                       stores=stores)


def test_a_colocated_prompts_blocks_are_stored_by_the_store_thread(model, tiny_dir):
    """With --colocate the prompt's KV stays in the process (no handoff
    tail in host memory): its new blocks are laid out and evaluated on the
    MLX thread, which keeps those arrays, and copied into the arena and
    committed by the store thread, which sends nothing for them."""
    from environment.settings import Settings
    from protos.messages import PrefillDone, PrefillRequest
    from workers.kv.store_thread import StoreThread

    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    engine = PrefillEngine(model, chunk_size=64, prefix=prefix)
    thread_sends = []
    fake.close = lambda: None  # the thread's client, closed with it
    stores = StoreThread(prefix, fake, thread_sends.append)
    # colocated: this worker decodes what it prefills
    w = _prefill_worker(engine, fake, Settings(prefill_batch=1), colocated=True, stores=stores)
    writes = []
    real_write = prefix.write_store
    prefix.write_store = lambda prepared, client=None: writes.append(threading.current_thread().name) or \
        real_write(prepared, client)
    prompt = prompt_of(45, 77)
    w.handle(PrefillRequest("c", prompt, greedy(4), "prefill-0"))
    w.prefill_chunk()
    w.stores.close()
    (done,) = w.outbox.sent
    assert isinstance(done, PrefillDone) and done.handoff.local and done.first_token == reference(model, prompt, 1)[0]
    assert "c" in w.local_kv and thread_sends == []
    assert writes == ["prefix-store"] and len(fake.blocks) == 45 // BS and not fake.reserved
    assert w.stores.kept  # the device copies the thread read, still the MLX thread's
    w.stores.release_done()
    assert not w.stores.kept


def test_the_prefill_worker_batches_within_an_eighth_of_the_arena_in_handoffs(model, tiny_dir):
    """PrefillRole.prefill_batch (workers/prefill/role.py) over the fake cache service:
    queued prompts join the current one while their handoffs (what the
    service lacks, their blocks held first) fit an eighth of the arena; the
    first that does not fit runs next with its hold, and counts then; a
    cancel gives its hold back. Every first token and handoff is sent."""
    from environment.settings import Settings
    from protos.messages import PrefillDone, PrefillRequest

    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    engine = PrefillEngine(model, chunk_size=64, prefix=prefix)
    system = prompt_of(40, 21)
    engine.run(system + prompt_of(9, 22), greedy(), owner="warm")  # the system prompt's 5 blocks, stored
    prompts = [system + prompt_of(10, 30 + i) for i in range(5)]  # 40 cached + 10 new: 10 tokens handed off
    expect = [reference(model, p, 1)[0] for p in prompts]
    handoff = 10 * engine.token_nbytes()

    w = _prefill_worker(engine, fake, Settings(prefill_batch=8, prefill_chunk=64,
                                               cache_memory_bytes=8 * (2 * handoff + handoff // 2)))
    for i, p in enumerate(prompts):
        w.handle(PrefillRequest(f"r{i}", p, greedy(4), ""))

    def done():
        return {m.request_id: m.first_token for m in w.outbox.sent if isinstance(m, PrefillDone)}

    w.prefill_chunk()  # r0 and r1 (two handoffs fit 2.5); r2 does not, and holds its blocks
    assert done() == {"r0": expect[0], "r1": expect[1]} and w.hello.batched_prompts == 2
    assert w.current[0].request_id == "r2" and set(w.held) == {"r2"} and len(w.queue) == 2
    w.prefill_chunk()  # r2, counted though already held, and r3; r4 does not fit
    assert set(done()) == {"r0", "r1", "r2", "r3"} and w.hello.batched_prompts == 4
    assert w.current[0].request_id == "r4" and set(w.held) == {"r4"}
    assert [done()[f"r{i}"] for i in range(4)] == expect[:4]
    handoffs = [m for m in w.outbox.sent if isinstance(m, KVHandoff)]
    assert len(handoffs) == 4 and all(h.blocks.tokens == 40 and h.num_tokens == 50 for h in handoffs)
    leases = len(fake.leases)  # the four handoffs' and r4's
    w.cancel("r4")
    assert len(fake.leases) == leases - 1 and w.held == {} and w.current is None
