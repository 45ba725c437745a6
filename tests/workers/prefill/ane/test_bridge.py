"""The KV bridge at the prefill engine: a prompt prefilled through a
converted program (here the NumPy reference of the contract, the stand-in for
Core ML's predict, which runs on macOS only) leaves the same first token and
the same KV in the job's mlx-lm caches as MLX's own prefill, so the prefix
cache, the handoff and decode need no change; and which prompts go there."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from protos.messages import SamplingParams
from tests.support.tiny_models import prompt_of
from workers.prefill.ane.bridge import AneBody
from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.reference import run_chunk
from workers.prefill.ane.weights import body_weights
from workers.prefill.engine import PrefillEngine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUCKETS = [Bucket(32, 128), Bucket(32, 256)]

def _body(model, calls=None):
    weights = body_weights(model, 256)

    def runner_for(bucket):
        def run(x, pos, k_cache, v_cache):
            assert x.shape == (1, bucket.chunk, weights.config.hidden) and k_cache.shape[2] == bucket.cache
            if calls is not None:
                calls.append((bucket.name, int(pos[0])))
            return run_chunk(weights, x, pos, k_cache, v_cache)
        return run

    cfg = weights.config
    return AneBody(model, runner_for, BUCKETS, cfg.kv_heads, cfg.head_dim)

def _kv(cache):
    return [np.array(c.keys[0, :, :c.offset]) for c in cache], [np.array(c.values[0, :, :c.offset]) for c in cache]

@pytest.mark.parametrize("length", [5, 70, 150])
def test_a_prompt_through_the_bridge_matches_mlx(model, length):
    """Chunks of 32 over caches of 128 then 256: the first token is MLX's
    and every layer's KV agrees within float32 rounding of the same math."""
    prompt = prompt_of(length, seed=length)
    mlx_result = PrefillEngine(model, chunk_size=64).run(prompt, GREEDY)
    calls = []
    engine = PrefillEngine(model, chunk_size=64)
    engine.ane, engine.ane_mode = _body(model, calls), "ane"
    ane_result = engine.run(prompt, GREEDY)
    assert ane_result.first_token == mlx_result.first_token
    assert ane_result.num_tokens == length and ane_result.cache[0].offset == length
    assert len(calls) == -(-length // 32) and calls[0] == ("q32_s128", 0)
    if length > 96:  # past 128 - 32 cached: the larger cache
        assert calls[-1][0] == "q32_s256"
    for ours, theirs in zip(_kv(ane_result.cache), _kv(mlx_result.cache)):
        # The program's weights, input and cache are fp16 (MLX's here fp32):
        # each rounds at 2^-11 relative, so a few 1e-3 of the largest value.
        worst = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(ours, theirs))
        assert worst < 5e-3, worst

def test_a_cached_prefix_is_the_programs_cache_input(model):
    """A prefix already in the caches (a prefix-cache hit) goes in as k_cache /
    v_cache; the continuation's logits are MLX's."""
    prompt = mx.array(prompt_of(90, seed=3), dtype=mx.int32)[None]
    body = _body(model)
    from mlx_lm.models.cache import make_prompt_cache
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    model(prompt[:, :40], cache=ours)  # the "hit", computed by MLX
    model(prompt[:, :40], cache=theirs)
    logits = body.last_logits(prompt[:, 40:], ours)
    expected = model(prompt[:, 40:], cache=theirs)[:, -1, :]
    assert ours[0].offset == theirs[0].offset == 90
    assert int(mx.argmax(logits)) == int(mx.argmax(expected))
    assert float(mx.max(mx.abs(logits - expected))) < 1e-2

def test_which_prompts_go_to_the_neural_engine(model):
    engine = PrefillEngine(model, chunk_size=64)
    body = engine.ane = _body(model)
    assert engine.ane_for(0, 500) is None  # mode mlx: never
    engine.ane_mode = "ane"
    assert engine.ane_for(0, 10) is body and engine.ane_for(0, 256) is body
    assert engine.ane_for(0, 257) is None  # no bucket holds it: MLX
    assert engine.ane_for(200, 40) is None  # 200 cached + two padded chunks > 256
    engine.ane_mode, engine.ane_min_tokens = "auto", 100
    assert engine.ane_for(0, 99) is None and engine.ane_for(0, 100) is body
    engine.ane_all = True  # the power policy's saver: short prompts too
    assert engine.ane_for(0, 5) is body


class _StatefulRunner:
    """A stand-in for the stateful Core ML package (its predict runs on macOS
    only): the NumPy reference over a cache it keeps itself, taking a given
    cache into its state first, as CoreMLChunkRunner does."""

    keeps_state = True

    def __init__(self, weights, bucket):
        self.weights, self.calls = weights, []
        shape = (weights.config.layers, weights.config.kv_heads, bucket.cache, weights.config.head_dim)
        self.k, self.v = np.zeros(shape, np.float16), np.zeros(shape, np.float16)

    def __call__(self, x, pos, k_cache=None, v_cache=None):
        self.calls.append(k_cache is not None)
        if k_cache is not None:
            self.k[...], self.v[...] = k_cache, v_cache
        k_new, v_new, h = run_chunk(self.weights, x, pos, self.k, self.v)
        p, q = int(pos[0]), x.shape[1]
        self.k[:, :, p:p + q], self.v[:, :, p:p + q] = k_new, v_new
        return k_new, v_new, h


def test_a_stateful_program_gets_the_cache_only_when_its_state_lacks_it(model):
    """Consecutive chunks of one prompt in one bucket: the cache goes in once;
    another prompt's caches (a new tag) go in again; the output stays MLX's."""
    weights = body_weights(model, 256)
    runner = _StatefulRunner(weights, Bucket(32, 256))
    body = AneBody(model, lambda b: runner, [Bucket(32, 256)], weights.config.kv_heads, weights.config.head_dim)
    from mlx_lm.models.cache import make_prompt_cache
    for seed in (1, 2):
        prompt = mx.array(prompt_of(100, seed=seed), dtype=mx.int32)[None]
        ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
        logits = body.last_logits(prompt, ours)
        expected = model(prompt, cache=theirs)[:, -1, :]
        assert int(mx.argmax(logits)) == int(mx.argmax(expected))
    assert runner.calls == [True, False, False, False] * 2  # 4 chunks a prompt; its cache handed over once


def test_off_macos_the_backend_says_so_and_stays_on_mlx(model, caplog):
    import logging
    import sys

    from environment.settings import Settings
    from workers.prefill.ane.backend import make_ane_body

    assert make_ane_body(model, Settings(prefill_backend="mlx")) is None
    if sys.platform == "darwin":
        pytest.skip("on macOS the backend opens the converted programs")
    with caplog.at_level(logging.INFO, logger="workers.prefill.ane.backend"):
        assert make_ane_body(model, Settings(prefill_backend="auto")) is None
    assert "macOS only" in caplog.text
