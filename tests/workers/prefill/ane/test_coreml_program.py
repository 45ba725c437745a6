"""The Core ML chunk program (workers/prefill/ane/coreml_program.py): built
with coremltools' MIL Builder from tiny random llama/qwen3 models and the
embedded model, saved as .mlpackages, and inspected (functions, ops, dtypes,
fixed shapes, states, sizes); its MIL evaluated in NumPy on Linux
(coreml_evaluate.py) against MLX's prefill of the same chunk; the runner's
refusal off macOS (and, on a Mac, its predictions against the evaluator).

Tolerances: the program computes in fp16 (every op rounds to 11 significant
bits, 4.9e-4 relative), MLX in fp32. Measured on this box: KV within ~1e-3 of
the largest |value| on the tiny models, and within ~3e-3 relative on the
embedded model's 30 layers (each test prints its numbers); the bounds below
leave ~3x room and still catch a wrong rope, mask or layout (those give errors
of the order of the values themselves).
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.support.tiny_models import TINY_LLAMA_CONFIG, load_tiny_model, make_tiny_llama, make_tiny_model
from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.coreml_evaluate import evaluate_chunk
from workers.prefill.ane.coreml_inspect import default_function, package_functions
from workers.prefill.ane.coreml_program import (
    chunk_program,
    convert_program,
    package_bytes,
    save_chunk_package,
    weight_bytes,
)
from workers.prefill.ane.coreml_runner import CoreMLChunkRunner, CoreMLUnavailable
from workers.prefill.ane.weights import body_weights

BUCKETS = [Bucket(16, 64), Bucket(16, 128)]
NOT_MAC = sys.platform != "darwin"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        make_tiny_llama(folder, seed=0)
    else:
        make_tiny_model(folder, {**TINY_LLAMA_CONFIG, "model_type": "qwen3", "head_dim": 16}, seed=0)
    model = load_tiny_model(folder)
    return request.param, model, body_weights(model, max(b.cache + b.chunk for b in BUCKETS))


@pytest.fixture(scope="module")
def tiny_package(tiny, tmp_path_factory):
    name, _, weights = tiny
    return save_chunk_package(weights, BUCKETS, tmp_path_factory.mktemp("pkg") / f"{name}.mlpackage")


def _mlx_chunk(model, tokens: list, pos: int, n: int):
    """MLX's prefill of tokens[pos:pos+n] over a cache of tokens[:pos]: the
    cache's KV (L, KV, pos+n, Dh), the chunk's hidden states after the final
    norm (n, hidden), and the last position's logits."""
    cache = make_prompt_cache(model)
    if pos:
        model.model(mx.array([tokens[:pos]]), cache=cache)
    h = model.model(mx.array([tokens[pos:pos + n]]), cache=cache)
    keys = np.stack([np.array(c.keys[0, :, :pos + n].astype(mx.float32)) for c in cache])
    values = np.stack([np.array(c.values[0, :, :pos + n].astype(mx.float32)) for c in cache])
    return keys, values, np.array(h[0].astype(mx.float32)), _logits(model, h[:, -1])


def _logits(model, h) -> np.ndarray:
    h = mx.array(np.asarray(h, np.float32))
    head = model.model.embed_tokens.as_linear if model.args.tie_word_embeddings else model.lm_head
    return np.array(head(h).astype(mx.float32)).reshape(-1)


def _program_inputs(model, weights, bucket: Bucket, tokens: list, pos: int, n: int, keys, values):
    """The contract's inputs: the chunk's embeddings padded to Q, the cache's
    first pos slots from MLX, the rest zeros."""
    cfg = weights.config
    x = np.zeros((1, bucket.chunk, cfg.hidden), np.float16)
    x[0, :n] = np.array(model.model.embed_tokens(mx.array(tokens[pos:pos + n])).astype(mx.float32))
    shape = (cfg.layers, cfg.kv_heads, bucket.cache, cfg.head_dim)
    k_cache, v_cache = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
    k_cache[:, :, :pos], v_cache[:, :, :pos] = keys[:, :, :pos], values[:, :, :pos]
    return x, np.array([pos], np.int32), k_cache, v_cache


def _compare(model, weights, bucket, tokens, pos, n, stateful) -> dict:
    keys, values, hidden, logits = _mlx_chunk(model, tokens, pos, n)
    inputs = _program_inputs(model, weights, bucket, tokens, pos, n, keys, values)
    k_new, v_new, h = evaluate_chunk(weights, bucket, *inputs, stateful=stateful)
    got_logits = _logits(model, h[0, n - 1].astype(np.float32))

    def rel(got, want):
        return float(np.abs(got.astype(np.float32) - want).max() / np.abs(want).max())

    return {"k": rel(k_new[:, :, :n], keys[:, :, pos:]), "v": rel(v_new[:, :, :n], values[:, :, pos:]),
            "h": rel(h[0, :n], hidden), "logits": rel(got_logits, logits),
            "argmax_same": int(got_logits.argmax()) == int(logits.argmax())}


# -- conversion and the saved package ----------------------------------------------------------------

def test_the_package_has_a_function_per_bucket_with_fixed_fp16_io_and_states(tiny, tiny_package):
    name, _, weights = tiny
    cfg = weights.config
    functions = package_functions(tiny_package)
    assert sorted(functions) == sorted(b.name for b in BUCKETS)
    assert default_function(tiny_package) == BUCKETS[0].name
    for b in BUCKETS:
        f = functions[b.name]
        assert f.opset == "CoreML8"  # iOS18 / macOS15: states and multifunction
        assert f.inputs == {"x": ((1, b.chunk, cfg.hidden), "FLOAT16"), "pos": ((1,), "INT32")}
        cache = ((cfg.layers, cfg.kv_heads, b.cache, cfg.head_dim), "FLOAT16")
        assert f.states == {"k_cache": cache, "v_cache": cache}
        new = ((cfg.layers, cfg.kv_heads, b.chunk, cfg.head_dim), "FLOAT16")
        assert f.outputs == {"k_new": new, "v_new": new, "h": ((1, b.chunk, cfg.hidden), "FLOAT16")}
        assert "FLOAT32" not in f.value_dtypes, f.value_dtypes


def test_the_program_has_the_expected_ops(tiny, tiny_package):
    name, _, weights = tiny
    layers = weights.config.layers
    norms_per_layer = 4 if name == "qwen3" else 2  # attn, mlp (+ q, k norms)
    for f in package_functions(tiny_package).values():
        ops = f.ops
        print(name, f.name, dict(ops))
        assert ops["linear"] == 7 * layers  # q k v o gate up down
        assert ops["matmul"] == 2 * layers and ops["softmax"] == layers
        assert ops["rsqrt"] == ops["reduce_mean"] == norms_per_layer * layers + 1  # + final norm
        assert ops["gather"] == 2  # the rope cos/sin rows at pos .. pos+Q-1, shared by all layers
        assert ops["slice_update"] == 2 * layers and ops["write_state"] == 2 * layers
        assert ops["read_state"] >= 2
        assert ops["silu"] == layers  # coremltools fused our x * sigmoid(x)


def test_buckets_share_one_copy_of_the_weights(tiny, tiny_package):
    _, _, weights = tiny
    need = weight_bytes(weights)
    on_disk = package_bytes(tiny_package)
    blob = sum(p.stat().st_size for p in tiny_package.rglob("weight.bin"))
    print(f"weights {need} B, weight.bin {blob} B, package {on_disk} B for {len(BUCKETS)} buckets")
    assert need <= blob < 1.1 * need + 4096  # once, not once per bucket


def test_the_stateless_program_takes_the_contracts_inputs(model, tmp_path):
    """(`model`: the tiny llama of tests/conftest.py.)"""
    weights = body_weights(model, BUCKETS[0].cache + BUCKETS[0].chunk)
    cfg = weights.config
    b = BUCKETS[0]
    path = tmp_path / "stateless.mlpackage"
    convert_program(chunk_program(weights, b, stateful=False)).save(str(path))
    f = package_functions(path)["main"]
    cache = ((cfg.layers, cfg.kv_heads, b.cache, cfg.head_dim), "FLOAT16")
    assert f.states == {}
    assert f.inputs == {"x": ((1, b.chunk, cfg.hidden), "FLOAT16"), "pos": ((1,), "INT32"),
                        "k_cache": cache, "v_cache": cache}
    assert f.ops["concat"] >= 2 * cfg.layers and "slice_update" not in f.ops


def test_short_rope_tables_are_refused(tiny):
    _, model, _ = tiny
    with pytest.raises(ValueError, match="positions"):
        chunk_program(body_weights(model, 64), Bucket(16, 64), stateful=False)  # needs 64 + 16


# -- numerics: the MIL evaluated in NumPy against MLX ------------------------------------------------

@pytest.mark.parametrize("stateful", [False, True], ids=["stateless", "stateful"])
@pytest.mark.parametrize("pos,n", [(0, 16), (23, 11), (48, 16)])
def test_the_program_matches_mlx_prefill(tiny, stateful, pos, n):
    name, model, weights = tiny
    tokens = np.random.default_rng(pos).integers(0, TINY_LLAMA_CONFIG["vocab_size"], pos + n).tolist()
    errors = _compare(model, weights, BUCKETS[0], tokens, pos, n, stateful)
    print(name, "stateful" if stateful else "stateless", f"pos={pos} n={n}", errors)
    assert max(errors["k"], errors["v"], errors["h"], errors["logits"]) < 5e-3, errors
    assert errors["argmax_same"]


def test_cache_slots_past_pos_do_not_matter(model):
    """Stale slots may hold anything finite; a NaN key is masked out too (select,
    not an additive mask). A NaN *value* would still poison (0 * NaN): caches
    must be finite past pos (zeros)."""
    b = BUCKETS[0]
    weights = body_weights(model, b.cache + b.chunk)
    x, pos, k_cache, v_cache = _chunk_inputs(weights, b)
    want = evaluate_chunk(weights, b, x, pos, k_cache, v_cache)
    k_stale, v_stale = k_cache.copy(), v_cache.copy()
    k_stale[:, :, pos[0]:] = np.nan
    v_stale[:, :, pos[0]:] = 1000.0
    for stateful in (False, True):
        got = evaluate_chunk(weights, b, x, pos, k_stale, v_stale, stateful=stateful)
        for g, w in zip(got, want):
            assert np.array_equal(g, w)


EMBEDDED_LAYERS_CONVERTED = 4  # all 30 convert too (48 s here, 213.2 MB for 212.5 MB of weights): too slow for CI


def test_the_embedded_model_converts(embedded_model, tmp_path):
    """The embedded model's real shapes and weights, its first layers, as one
    stateful bucket: ops, states, size against the weights."""
    model, _ = embedded_model
    b = Bucket(64, 512)
    weights = body_weights(model, b.cache)
    assert (weights.config.layers, weights.config.hidden, weights.config.rope_traditional) == (30, 576, True)
    weights.layers = weights.layers[:EMBEDDED_LAYERS_CONVERTED]
    weights.config.layers = layers = EMBEDDED_LAYERS_CONVERTED
    path = tmp_path / "smollm2.mlpackage"
    convert_program(chunk_program(weights, b)).save(str(path))
    f = package_functions(path)["main"]
    cfg = weights.config
    assert f.states["k_cache"] == ((layers, cfg.kv_heads, 512, cfg.head_dim), "FLOAT16")
    assert f.inputs["x"] == ((1, 64, 576), "FLOAT16")
    assert f.ops["linear"] == 7 * layers and f.ops["softmax"] == layers
    assert "FLOAT32" not in f.value_dtypes
    need, on_disk = weight_bytes(weights), package_bytes(path)
    print(f"embedded model, {layers} layers: weights {need / 1e6:.2f} MB, package {on_disk / 1e6:.2f} MB")
    assert need <= on_disk < 1.02 * need + 500_000


# -- the runner --------------------------------------------------------------------------------------

def _chunk_inputs(weights, bucket: Bucket):
    cfg = weights.config
    shape = (cfg.layers, cfg.kv_heads, bucket.cache, cfg.head_dim)
    x = np.random.default_rng(0).standard_normal((1, bucket.chunk, cfg.hidden)).astype(np.float16)
    return x, np.array([5], np.int32), np.zeros(shape, np.float16), np.zeros(shape, np.float16)


@pytest.mark.skipif(not NOT_MAC, reason="checks the refusal off macOS; on a Mac predict runs")
def test_the_runner_refuses_off_macos_after_checking_its_inputs(tiny, tiny_package):
    _, _, weights = tiny
    b = BUCKETS[1]
    runner = CoreMLChunkRunner(tiny_package, b)  # reading the package works anywhere
    assert runner.stateful and runner.function_name == b.name
    x, pos, k_cache, v_cache = _chunk_inputs(weights, b)
    with pytest.raises(ValueError, match="shape"):
        runner(x[:, :3], pos, k_cache, v_cache)
    with pytest.raises(ValueError, match="pos"):
        runner(x, np.array([b.cache - 1]), k_cache, v_cache)  # a whole chunk must fit after pos
    with pytest.raises(CoreMLUnavailable, match="Core ML predict runs on macOS only"):
        runner(x, pos, k_cache, v_cache)
    with pytest.raises(ValueError, match="no function"):
        CoreMLChunkRunner(tiny_package, Bucket(16, 256))


@pytest.mark.skipif(NOT_MAC, reason="Core ML predict runs on macOS only")
def test_the_runner_matches_the_evaluator_on_macos(tiny, tiny_package):
    _, _, weights = tiny
    b = BUCKETS[1]
    inputs = _chunk_inputs(weights, b)
    got = CoreMLChunkRunner(tiny_package, b)(*inputs)
    want = evaluate_chunk(weights, b, *inputs, stateful=True)
    for g, w in zip(got, want):
        err = float(np.abs(g.astype(np.float32) - w).max() / np.abs(w).max())
        print("Core ML vs NumPy evaluation", err)
        assert err < 1e-2
