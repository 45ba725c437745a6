"""Prefill -> KV handoff -> decode on a tiny random llama, checked against mlx-lm.

The reference is mlx_lm.generate_step (what mlx_lm.generate / stream_generate
run underneath; those need a tokenizer, the tiny model has none) on the same
model and token ids. Greedy output through the split pipeline must be
token-identical to it.
"""

from __future__ import annotations

import math
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from protos.messages import DecodeRequest, KVHandoff, SamplingParams
from tests.support.pipeline import drive, reference
from tests.support.tiny_models import VOCAB, greedy, load_tiny_model, make_tiny_llama, prompt_of
from workers.decode.engine import DecodeEngine
from workers.kernels import mlx_hooks
from workers.kv import arena_io, cache_state
from workers.kv.handoff import kv_dtype_name, kv_nbytes, read_kv, write_kv
from workers.prefill.engine import PrefillEngine
from workers.sampling import make_sampler


# --------------------------------------------------------------------- tests
def test_tiny_model_is_not_degenerate(model):
    ref = reference(model, prompt_of(8, 1), 40)
    assert len(set(ref.tokens)) > 15, ref.tokens


@pytest.mark.parametrize("transport", ["bytearray", "shm", "arena", "local"])
def test_greedy_short_prompt(model, transport):
    prompt = prompt_of(6, 2)
    ref = reference(model, prompt, 24)
    out = drive(model, [("a", 0, prompt, greedy(24))], transport=transport)["a"]
    assert out.tokens == ref.tokens
    assert out.reason == "length" and len(out.tokens) == 24


@pytest.mark.parametrize("transport", ["bytearray", "shm"])
def test_greedy_prompt_longer_than_a_chunk(model, transport):
    prompt = prompt_of(50, 3)
    ref = reference(model, prompt, 20)
    out = drive(model, [("a", 0, prompt, greedy(20))], chunk=16, transport=transport)
    assert out["a"].tokens == ref.tokens


def test_incremental_prefill_matches_run(model):
    prompt = prompt_of(50, 3)
    engine = PrefillEngine(model, chunk_size=16)
    whole = engine.run(prompt, greedy(24))
    job = engine.start(prompt, greedy(24))
    calls, result = 0, None
    while result is None:
        result = job.step()
        calls += 1
        if result is None:
            assert 0 < job.processed < job.total
    assert calls == math.ceil(50 / 16)  # the last token rides in the final chunk
    assert result.first_token == whole.first_token
    assert result.num_tokens == result.rope_offset == 50 and result.prefill_ms > 0
    for a, b in zip(result.cache, whole.cache):
        assert a.offset == b.offset == 50
        assert mx.array_equal(a.keys[..., :50, :], b.keys[..., :50, :])
    assert engine.run([7], greedy(24)).num_tokens == 1  # one-token prompt: no chunks


@pytest.mark.parametrize("tied", [False, True])
def test_a_pass_computes_the_head_over_the_wanted_positions_only(tmp_path, monkeypatch, tied):
    """mlx_hooks.logits_at, which gives a prompt its first token's logits from
    its final chunk: each row's logits at its own position equal the full
    pass's there, while the head (lm_head, or the tied embedding) ran over
    one position a row; the model's parameters and its other calls are as
    they were."""
    m = load_tiny_model(make_tiny_llama(tmp_path, seed=1, tie_word_embeddings=tied))
    names = [k for k, _ in tree_flatten(m.parameters())]
    inputs = mx.array([prompt_of(9, 1), prompt_of(9, 2)])
    full = m(inputs, cache=make_prompt_cache(m))
    heads = []
    if tied:
        embed = m["model"]["embed_tokens"]
        as_linear = embed.as_linear
        monkeypatch.setattr(embed, "as_linear", lambda x: heads.append(x.shape[1]) or as_linear(x))
    else:
        head = m["lm_head"]
        monkeypatch.setitem(m, "lm_head", lambda x: heads.append(x.shape[1]) or head(x))
    got = mlx_hooks.logits_at(m, inputs, make_prompt_cache(m), last=[4, 8])
    assert heads == [1] and got.shape == (2, VOCAB)
    assert mx.allclose(got[0], full[0, 4], atol=1e-5) and mx.allclose(got[1], full[1, 8], atol=1e-5)
    # The wrapper is out of the way of every other call, and of the weights.
    assert m(inputs, cache=make_prompt_cache(m)).shape == full.shape and heads == [1, 9]
    monkeypatch.undo()  # the counting head
    assert [k for k, _ in tree_flatten(m.parameters())] == names


def test_eight_requests_join_at_different_steps(model):
    lengths = [3, 50, 1, 17, 33, 8, 64, 21]
    joins = [0, 0, 1, 2, 4, 7, 11, 12]
    jobs = [(f"r{i}", j, prompt_of(n, 10 + i), greedy(16 + i))
            for i, (n, j) in enumerate(zip(lengths, joins))]
    seen = {"waiting": 0, "running": 0}

    def observe(step, decode):
        seen["waiting"] = max(seen["waiting"], decode.waiting)
        seen["running"] = max(seen["running"], decode.running)
        assert decode.running <= 5

    outs = drive(model, jobs, max_batch=5, transport="shm", observe=observe)
    assert seen["running"] == 5 and seen["waiting"] > 0  # the queue was exercised
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens, rid


@pytest.mark.parametrize("ragged", [True, False])
def test_a_request_joins_the_next_step_without_a_forward_pass_of_its_own(model, monkeypatch, ragged):
    """mlx-lm's BatchGenerator runs newcomers through the model alone before
    merging them; here their first token rides in the batch's next step."""
    forwards = []
    call = type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, *a, **kw: forwards.append(a[0].shape) or call(self, *a, **kw))
    prefill, decode = PrefillEngine(model, chunk_size=64), DecodeEngine(model, 4, ragged=ragged)
    jobs = {rid: (prompt_of(n, 40 + i), greedy(12)) for i, (rid, n) in enumerate([("a", 9), ("b", 30), ("c", 5)])}
    outs = {rid: [] for rid in jobs}

    def add(rid):
        prompt, sp = jobs[rid]
        res = prefill.run(prompt, sp)
        outs[rid].append(res.first_token)
        decode.add(DecodeRequest(rid, prompt, res.first_token, KVHandoff(rid, res.num_tokens, res.rope_offset), sp),
                   res.cache)

    def step():
        forwards.clear()
        for u in decode.step():
            outs[u.request_id].append(u.token)
        return list(forwards)

    add("a")
    # A batch of newcomers alone: fed, then stepped again for their first decode token.
    assert step() == [(1, 1), (1, 1)] and len(outs["a"]) == 2
    add("b"), add("c")
    # Two join a running row: one forward of all three, no pass of their own.
    assert step() == [(3, 1)]
    assert len(outs["a"]) == 3 and len(outs["b"]) == len(outs["c"]) == 1  # theirs was fed
    assert step() == [(3, 1)] and len(outs["b"]) == len(outs["c"]) == 2
    while decode.has_work:
        step()
    for rid, (prompt, sp) in jobs.items():
        assert outs[rid] == reference(model, prompt, 12).tokens, rid


def seeded(seed, **kw):
    return SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=100,
                          seed=seed, **kw)


def test_seeded_sampling_is_batch_independent(model):
    prompt = prompt_of(12, 4)
    alone = drive(model, [("s", 0, prompt, seeded(1234))])["s"].tokens
    busy_jobs = [("s", 3, prompt, seeded(1234))]
    busy_jobs += [(f"g{i}", i, prompt_of(5 + 7 * i, 40 + i), greedy(20)) for i in range(4)]
    busy_jobs += [(f"x{i}", i, prompt_of(9, 50 + i), seeded(i)) for i in range(3)]
    busy = drive(model, busy_jobs)
    assert busy["s"].tokens == alone
    other = drive(model, [("s", 0, prompt, seeded(4321))])["s"].tokens
    assert other != alone
    # Prefill drew once, decode continued the same stream: one unbroken
    # generate_step run with the same sampler gives the same tokens.
    ref = reference(model, prompt, 20, sampler=make_sampler(seeded(1234)))
    assert ref.tokens == alone


def test_penalties_and_logit_bias_match_mlx_lm(model):
    prompt = prompt_of(20, 5)
    bias = {3: 4.0, 77: 2.5, 300: -100.0}
    sp = greedy(24, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3,
                logit_bias={str(k): v for k, v in bias.items()})
    procs = make_logits_processors(logit_bias=bias, repetition_penalty=1.5,
                                   presence_penalty=0.5, frequency_penalty=0.3)
    ref = reference(model, prompt, 24, processors=procs)
    plain = reference(model, prompt, 24)
    assert ref.tokens != plain.tokens  # the processors matter for this prompt
    jobs = [("p", 1, prompt, sp), ("g", 0, prompt_of(30, 6), greedy(30))]
    outs = drive(model, jobs)
    assert outs["p"].tokens == ref.tokens


def test_max_tokens_and_stop_ids(model):
    prompt = prompt_of(10, 7)
    ref = reference(model, prompt, 30)
    stop = ref.tokens[5]
    first = ref.tokens.index(stop)  # stop may occur earlier than index 5
    jobs = [("len", 0, prompt, greedy(4)),
            ("stop", 0, prompt, greedy(30, stop_token_ids=[stop, VOCAB + 1])),
            ("one", 0, prompt, greedy(1)),
            ("first", 0, prompt, greedy(30, stop_token_ids=[ref.tokens[0]]))]
    outs = drive(model, jobs)
    assert outs["len"].tokens == ref.tokens[:4] and outs["len"].reason == "length"
    assert outs["stop"].tokens == ref.tokens[: first + 1]
    assert outs["stop"].reason == "stop"
    assert outs["one"].tokens == ref.tokens[:1] and outs["one"].reason == "length"
    assert outs["first"].tokens == ref.tokens[:1] and outs["first"].reason == "stop"


def test_decode_rejects_requests_that_prefill_finished(model):
    prompt = prompt_of(5, 8)
    res = PrefillEngine(model, 16).run(prompt, greedy(24))
    decode = DecodeEngine(model, 4, eos_token_ids=[res.first_token])
    hand = KVHandoff("x", res.num_tokens, res.rope_offset)
    with pytest.raises(ValueError, match="stop token"):
        decode.add(DecodeRequest("x", prompt, res.first_token, hand, greedy(24)), res.cache)
    decode = DecodeEngine(model, 4)
    with pytest.raises(ValueError, match="max_tokens"):
        decode.add(DecodeRequest("x", prompt, res.first_token, hand, greedy(1)), res.cache)
    assert not decode.has_work


def test_cancel_mid_generation(model):
    jobs = [(f"c{i}", 0, prompt_of(6 + 9 * i, 60 + i), greedy(20)) for i in range(3)]
    kv = {}

    def observe(step, decode):
        kv[step] = (decode.running, decode.kv_bytes)

    outs = drive(model, jobs, cancel_at={6: "c1"}, observe=observe)
    assert outs["c1"].reason is None and 2 <= len(outs["c1"].tokens) < 20
    for rid in ("c0", "c2"):
        _, _, prompt, sp = next(j for j in jobs if j[0] == rid)
        assert outs[rid].tokens == reference(model, prompt, 20).tokens
    assert kv[6][0] == kv[5][0] - 1  # its row left the batch at once (its pool slot is free)
    assert kv[max(kv)] == (0, 0)  # everyone finished: nothing held
    assert DecodeEngine(model, 2).cancel("nobody") is False


def test_cancel_waiting_request(model):
    prefill, decode = PrefillEngine(model, 16), DecodeEngine(model, 1)
    for rid in ("a", "b"):
        prompt = prompt_of(4, 70)
        res = prefill.run(prompt, greedy(24))
        decode.add(DecodeRequest(rid, prompt, res.first_token,
                                 KVHandoff(rid, 4, 4), greedy(24)), res.cache)
    decode.step()
    assert (decode.running, decode.waiting) == (1, 1)
    assert decode.request_ids() == ["a", "b"]
    assert decode.cancel("b") and decode.waiting == 0
    assert {u.request_id for u in decode.step()} == {"a"}


def test_logprobs_match_reference(model):
    prompt = prompt_of(14, 9)
    ref = reference(model, prompt, 12)
    jobs = [("lp", 0, prompt, greedy(12, logprobs=True, top_logprobs=5)),
            ("lp1", 0, prompt, greedy(12, logprobs=True)),
            ("no", 0, prompt_of(7, 10), greedy(12))]
    outs = drive(model, jobs)
    assert outs["lp"].tokens == ref.tokens
    assert all(lp is None for lp in outs["no"].logprobs)
    assert all(lp.top == [] for lp in outs["lp1"].logprobs)
    for tok, ours, theirs in zip(ref.tokens, outs["lp"].logprobs, ref.logprobs):
        theirs = np.array(theirs)
        assert ours.token == tok
        assert ours.logprob == pytest.approx(float(theirs[tok]), abs=1e-4)
        top_ids = [t for t, _ in ours.top]
        assert top_ids[0] == tok and len(top_ids) == 5  # greedy: chosen is best
        assert set(top_ids) == set(np.argsort(-theirs)[:5].tolist())
        for t, v in ours.top:
            assert v == pytest.approx(float(theirs[t]), abs=1e-4)


def _filled_cache(dtype, tokens, seed):
    """A KVCache grown through update_and_fetch (buffer larger than offset)."""
    rng = np.random.default_rng(seed)
    c = KVCache()
    for n in (tokens - 3, 3):
        k = mx.array(rng.standard_normal((1, 2, n, 16)).astype(np.float32)).astype(dtype)
        v = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32)).astype(dtype)
        c.update_and_fetch(k, v)
    return c


@pytest.mark.parametrize("on_cpu", [True, False], ids=["host-copies", "device-packed"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_kv_roundtrip_is_exact(dtype, on_cpu, monkeypatch):
    """Both ways write_kv copies: array by array (MLX's CPU backend) and
    packed into one device array first (a GPU)."""
    monkeypatch.setattr(arena_io, "rearrange_on_host", lambda: on_cpu)
    cache = [_filled_cache(dtype, 37, s) for s in range(3)]
    assert cache[0].keys.shape[2] == 256  # the live part is a strided view
    nbytes = kv_nbytes(cache)
    assert nbytes >= sum(c.keys[..., :37, :].nbytes * 1.5 for c in cache)
    buf = bytearray(nbytes + 64)
    layers = write_kv(memoryview(buf), 64, cache)
    assert layers[0][0].offset == 64 and all(s.offset % 64 == 0 for p in layers for s in p)
    assert layers[0][0].dtype == kv_dtype_name(cache) == str(dtype).split(".")[-1]
    back = read_kv(buf, layers)
    for a, b in zip(cache, back):
        assert b.offset == 37 and b.keys.dtype == dtype and b.values.dtype == dtype
        assert mx.array_equal(a.keys[..., :37, :], b.keys)
        assert mx.array_equal(a.values[..., :37, :], b.values)
    buf[:] = bytes(len(buf))  # the rebuilt cache owns its memory
    assert mx.array_equal(cache[0].keys[..., :37, :], back[0].keys)


def test_both_kv_write_paths_write_the_same_bytes(monkeypatch):
    cache = [_filled_cache(mx.bfloat16, 21, s) for s in range(2)]
    written = {}
    for on_cpu in (True, False):
        monkeypatch.setattr(arena_io, "rearrange_on_host", lambda on_cpu=on_cpu: on_cpu)
        buf = bytearray(kv_nbytes(cache) + 128)
        written[on_cpu] = (write_kv(buf, 128, cache), bytes(buf))
    assert any(s.nbytes % 64 for p in written[True][0] for s in p)  # alignment padding in between
    assert written[True] == written[False]


def test_a_staged_kv_write_copies_the_same_bytes_on_another_thread(monkeypatch):
    """A prefill worker lays a handoff out on its MLX thread and leaves the
    copy into the arena to its store thread (arena_io.stage_arrays):
    nothing is written before copy() runs, and it writes what write_kv does,
    in both layouts."""
    cache = [_filled_cache(mx.bfloat16, 21, s) for s in range(2)]
    for on_cpu in (True, False):
        monkeypatch.setattr(arena_io, "rearrange_on_host", lambda on_cpu=on_cpu: on_cpu)
        expect = bytearray(kv_nbytes(cache) + 128)
        layers = write_kv(expect, 128, cache)
        buf = bytearray(len(expect))
        staged_layers, copy, held = arena_io.stage_arrays(buf, 128, cache_state.encode_cache(cache).arrays)
        assert staged_layers == layers and held and not any(buf)
        worker = threading.Thread(target=copy)
        worker.start()
        worker.join(10)
        assert bytes(buf) == bytes(expect), on_cpu
    with pytest.raises(ValueError, match="buffer too small"):
        arena_io.stage_arrays(bytearray(64), 0, cache_state.encode_cache(cache).arrays)


def test_kv_transfer_errors():
    cache = [_filled_cache(mx.float32, 10, 0)]
    with pytest.raises(ValueError, match="too small"):
        write_kv(bytearray(kv_nbytes(cache) - 1), 0, cache)
    with pytest.raises(TypeError, match="RotatingKVCache"):
        kv_nbytes([RotatingKVCache(max_size=8)])
    with pytest.raises(TypeError, match="RotatingKVCache"):
        write_kv(bytearray(1024), 0, [RotatingKVCache(max_size=8)])


def test_colocated_interleaves_prefill_chunks_with_decode(model):
    """A colocated worker: decode keeps stepping while a long prompt prefills."""
    prefill, decode = PrefillEngine(model, chunk_size=16), DecodeEngine(model, 4)
    pa, pb = prompt_of(9, 80), prompt_of(70, 81)
    res = prefill.run(pa, greedy(30))
    decode.add(DecodeRequest("a", pa, res.first_token, KVHandoff("a", 9, 9), greedy(30)),
               res.cache)
    toks = {"a": [res.first_token], "b": []}
    job = prefill.start(pb, greedy(12))
    while decode.has_work or not job.done:
        if not job.done and (b := job.step()) is not None:  # one chunk, then decode
            toks["b"].append(b.first_token)
            decode.add(DecodeRequest("b", pb, b.first_token, KVHandoff("b", 70, 70),
                                     greedy(12)), b.cache)  # local: no copy
        for u in decode.step():
            toks[u.request_id].append(u.token)
    assert toks["a"] == reference(model, pa, 30).tokens
    assert toks["b"] == reference(model, pb, 12).tokens


def test_bfloat16_model_through_shared_memory(tmp_path):
    bf16 = load_tiny_model(make_tiny_llama(tmp_path, seed=3, torch_dtype="bfloat16"))
    prompt = prompt_of(21, 90)
    res = PrefillEngine(bf16, 8).run(prompt, greedy(24))
    assert res.cache[0].keys.dtype == mx.bfloat16
    ref = reference(bf16, prompt, 16)
    out = drive(bf16, [("a", 0, prompt, greedy(16))], chunk=8, transport="shm")
    assert out["a"].tokens == ref.tokens
