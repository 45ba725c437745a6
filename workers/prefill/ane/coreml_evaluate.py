"""Evaluate the Core ML chunk program's MIL on Linux, where Core ML cannot run.

coremltools has no MIL interpreter, but every MIL op computes its output with
NumPy at build time when all its inputs are constants (`value_inference`, what
its constant folding uses). Building the very same body (coreml_program's
`chunk_body`) with the inputs as constants therefore evaluates the program op
by op in NumPy, float16 in and out of each op. What this checks: the program's
math and layout (rope, masks, GQA, the cache writes). What it cannot check:
Core ML's own kernels (their accumulation precision, the Neural Engine's fp16
behaviour), and the graph passes `ct.convert` applies afterwards.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb

from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.coreml_program import (
    TARGET,
    ConcatCache,
    TensorStore,
    WrittenCache,
    check_rope_tables,
    chunk_body,
)
from workers.prefill.ane.weights import BodyWeights


class NotEvaluated(RuntimeError):
    """An op of the program had no NumPy value (no value_inference for it)."""


def evaluate_chunk(weights: BodyWeights, bucket: Bucket, x, pos, k_cache, v_cache,
                   stateful: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k_new, v_new, h) of the contract for these inputs, computed by the MIL
    program's own ops in NumPy. `stateful` evaluates the stateful program's
    math (write at pos, attend over S) with the states as plain tensors;
    its final caches are not returned (the contract's outputs are)."""
    check_rope_tables(weights, bucket, stateful)
    cfg = weights.config
    shape = (cfg.layers, cfg.kv_heads, bucket.cache, cfg.head_dim)
    x = np.asarray(x, np.float16).reshape(1, bucket.chunk, cfg.hidden)
    pos = np.asarray(pos, np.int32).reshape(1)
    k_cache = np.asarray(k_cache, np.float16).reshape(shape)
    v_cache = np.asarray(v_cache, np.float16).reshape(shape)
    results = {}

    # NumPy's fp16 exp overflows in sigmoid(-x) and softmax on the way to the
    # right answer (0): expected, not reported
    with np.errstate(over="ignore"):
        _evaluate_into(results, weights, bucket, (x, pos, k_cache, v_cache), stateful)
    missing = [name for name, val in results.items() if val is None]
    if missing:
        raise NotEvaluated(f"no NumPy value for {missing}: an op without value_inference")
    return tuple(np.asarray(results[n], np.float16) for n in ("k_new", "v_new", "h"))


def _evaluate_into(results: dict, weights: BodyWeights, bucket: Bucket, inputs, stateful: bool) -> None:
    x, pos, k_cache, v_cache = inputs

    # built only for the values its ops compute on the way (the program is dropped)
    @mb.program(input_specs=[], opset_version=TARGET)
    def evaluated():
        xv, pv = mb.const(val=x, name="x"), mb.const(val=pos, name="pos")
        kc, vc = mb.const(val=k_cache, name="k_cache_in"), mb.const(val=v_cache, name="v_cache_in")
        if stateful:
            cache = WrittenCache(TensorStore(kc, vc), pv, bucket)
        else:
            cache = ConcatCache(kc, vc, pv, bucket)
        outs = chunk_body(weights, bucket, xv, pv, cache)
        for var in outs:
            results[var.name] = var.val
        return outs
