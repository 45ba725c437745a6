"""The split pipeline in one process, and mlx-lm's run to compare it with.

`drive` runs prefill, the KV handoff through a buffer (as two processes would
move it) and the decode batch, requests joining at given steps; `reference`
is mlx_lm.generate_step (what mlx_lm.generate / stream_generate run
underneath; those need a tokenizer, the tiny models have none) with
stream_generate's stop and length rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Dict, List, Optional

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from protos.messages import DecodeRequest, KVHandoff
from workers.decode.engine import DecodeEngine
from workers.kv.handoff import kv_nbytes, read_kv, write_kv
from workers.prefill.engine import PrefillEngine, first_token_finishes


@dataclass
class Out:
    tokens: List[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # reference: mx arrays; ours: TokenLogprob
    reason: Optional[str] = None


def reference(model, prompt, max_tokens, sampler=None, processors=None, stop_ids=()) -> Out:
    """mlx-lm's own generation with stream_generate's stop/length rules."""
    out = Out()
    for tok, lp in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                 sampler=sampler, logits_processors=processors):
        out.tokens.append(tok)
        out.logprobs.append(lp)
        if tok in stop_ids:
            out.reason = "stop"
            break
        if len(out.tokens) == max_tokens:
            out.reason = "length"
            break
    return out


def handoff(cache, transport: str):
    """Move a prefill cache through a buffer the way two processes would."""
    if transport == "local":
        return cache
    nbytes = kv_nbytes(cache)
    if transport == "bytearray":
        buf = bytearray(nbytes + 128)
        layers = write_kv(buf, 64, cache)  # non-zero base offset on purpose
        return read_kv(bytes(buf), layers)  # reader sees a copy: nothing shared
    if transport == "arena":  # the cache service's real arena, when present
        arena_mod = pytest.importorskip("cache_service.arena")
        owner = arena_mod.Arena.create(arena_mod.new_arena_name("tandem-test"), nbytes + 4096)
        try:
            layers = write_kv(owner.buf, 4096, cache)
            reader = arena_mod.Arena.attach(owner.name)
            try:
                return read_kv(reader.buf, layers)
            finally:
                reader.close()
        finally:
            owner.close()
            owner.unlink()
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        layers = write_kv(shm.buf, 0, cache)
        reader = shared_memory.SharedMemory(name=shm.name)
        try:
            return read_kv(reader.buf, layers)
        finally:
            reader.close()  # must not fail with "exported pointers exist"
    finally:
        shm.close()
        shm.unlink()


def drive(model, jobs, *, chunk=16, max_batch=8, transport="bytearray",
          cancel_at=None, observe=None, ragged=None, speculation=None) -> Dict[str, Out]:
    """jobs: [(rid, join_step, prompt, SamplingParams)]. Runs prefill, handoff
    and decode, adding each request at its join step. Returns rid -> Out.
    ragged=False: the padded batch a GPU uses, on any backend. speculation:
    a workers.decode.speculation.Speculation for the decode engine."""
    prefill = PrefillEngine(model, chunk_size=chunk)
    decode = DecodeEngine(model, max_batch=max_batch, ragged=ragged, speculation=speculation)
    outs: Dict[str, Out] = {}
    cancel_at = cancel_at or {}
    step = 0
    pending = sorted(jobs, key=lambda j: j[1])
    while pending or decode.has_work:
        while pending and pending[0][1] <= step:
            rid, _, prompt, sp = pending.pop(0)
            res = prefill.run(prompt, sp)
            out = outs[rid] = Out([res.first_token], [res.logprob])
            reason = first_token_finishes(res.first_token, sp)
            if reason is not None:
                out.reason = reason
                continue
            req = DecodeRequest(rid, prompt, res.first_token,
                                KVHandoff(rid, res.num_tokens, res.rope_offset), sp)
            decode.add(req, handoff(res.cache, transport))
        if step in cancel_at:
            assert decode.cancel(cancel_at[step])
        for u in decode.step():
            out = outs[u.request_id]
            assert out.reason is None, "token after finish"
            out.tokens.append(u.token)
            out.logprobs.append(u.logprob)
            out.reason = u.finish_reason
        if observe:
            observe(step, decode)
        step += 1
        assert step < 1000
    return outs
