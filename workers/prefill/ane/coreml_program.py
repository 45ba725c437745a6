"""The contract's chunk program (contract.py) as a Core ML mlprogram, built with
coremltools' MIL Builder from a BodyWeights (no torch), float16 compute and
I/O, weights as constants, for macOS 15 / iOS 18 (states).

Two shapes of it:
- stateless (`stateful=False`): exactly the contract: x, pos, k_cache, v_cache
  in; k_new, v_new, h out. Attention runs over the cache followed by the chunk
  (S + Q keys).
- stateful (the Neural Engine recipes' shape): x, pos in; the KV cache lives in
  two Core ML states `k_cache`, `v_cache` (L, KV, S, Dh) fp16; every layer
  writes its chunk's keys/values at [pos, pos+Q) (`slice_update`,
  `coreml_update_state`) and attends over the S slots; k_new, v_new, h out
  as well, so the host gets the chunk's KV without reading the whole state.

Several buckets share one copy of the weights in a multifunction package
(`save_multifunction` deduplicates equal constants): one function per bucket,
named by `Bucket.name`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import coremltools as ct
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.coreml_layers import attention, const, layer_out, layer_qkv, rms_norm, rope_rows
from workers.prefill.ane.weights import BodyWeights

TARGET = ct.target.iOS18  # the first with states and multifunction packages (macOS 15)


def rope_positions_needed(bucket: Bucket, stateful: bool) -> int:
    """Rows the rope tables must have: the stateless program accepts pos <= S,
    so positions up to S+Q-1; the stateful one writes at most up to S."""
    return bucket.cache if stateful else bucket.cache + bucket.chunk


class ConcatCache:
    """Stateless attention: the cache given as inputs, followed by the chunk.
    Visible: slot j < pos of the cache, chunk row j <= i."""

    def __init__(self, k_cache, v_cache, pos, bucket: Bucket):
        self.k_cache, self.v_cache = k_cache, v_cache
        q, s = bucket.chunk, bucket.cache
        slots = mb.const(val=np.arange(s, dtype=np.int32).reshape(1, s), name="cache_slots")
        cached = mb.tile(x=mb.less(x=slots, y=pos), reps=[q, 1])
        causal = mb.const(val=np.tril(np.ones((q, q), dtype=bool)), name="chunk_causal")
        self.visible = mb.concat(values=[cached, causal], axis=1, name="visible")

    def keys_values(self, layer: int, k, v):
        return (self._cat(self.k_cache, layer, k), self._cat(self.v_cache, layer, v), self.visible)

    @staticmethod
    def _cat(cache, layer: int, new):
        _, kv, s, dh = cache.shape
        past = mb.slice_by_index(x=cache, begin=[layer, 0, 0, 0], end=[layer + 1, kv, s, dh],
                                 squeeze_mask=[True, False, False, False])
        return mb.concat(values=[past, new], axis=1)


class WrittenCache:
    """Stateful attention: each layer writes its chunk at [pos, pos+Q) into the
    whole cache, then attends over the S slots. Visible: slot j <= pos + i.
    `store` holds the caches: MIL states (StateStore) or, to evaluate the same
    math on Linux, plain tensors (TensorStore)."""

    def __init__(self, store, pos, bucket: Bucket):
        self.store, self.pos = store, pos
        q, s = bucket.chunk, bucket.cache
        slots = mb.const(val=np.arange(s, dtype=np.int32).reshape(1, s), name="cache_slots")
        rows = mb.const(val=np.arange(q, dtype=np.int32).reshape(q, 1), name="chunk_rows")
        self.visible = mb.less_equal(x=slots, y=mb.add(x=rows, y=pos), name="visible")

    def keys_values(self, layer: int, k, v):
        return (self._write("k", layer, k), self._write("v", layer, v), self.visible)

    def _write(self, which: str, layer: int, new):
        whole = self.store.read(which)
        _, kv, s, dh = whole.shape
        q = new.shape[1]
        here = mb.const(val=np.array([layer], np.int32))
        begin = mb.concat(values=[here, np.zeros(1, np.int32), self.pos, np.zeros(1, np.int32)], axis=0)
        end = mb.concat(values=[np.array([layer + 1, kv], np.int32), mb.add(x=self.pos, y=np.int32(q)),
                                np.array([dh], np.int32)], axis=0)
        whole = mb.slice_update(x=whole, update=mb.expand_dims(x=new, axes=[0]), begin=begin, end=end)
        self.store.write(which, whole)
        return mb.slice_by_index(x=whole, begin=[layer, 0, 0, 0], end=[layer + 1, kv, s, dh],
                                 squeeze_mask=[True, False, False, False])


class StateStore:
    """The caches as Core ML states."""

    def __init__(self, k_state, v_state):
        self.states = {"k": k_state, "v": v_state}

    def read(self, which: str):
        return mb.read_state(input=self.states[which])

    def write(self, which: str, value):
        mb.coreml_update_state(state=self.states[which], value=value)


class TensorStore:
    """The caches as plain tensors that each write replaces (Linux evaluation)."""

    def __init__(self, k_cache, v_cache):
        self.current = {"k": k_cache, "v": v_cache}

    def read(self, which: str):
        return self.current[which]

    def write(self, which: str, value):
        self.current[which] = value


def chunk_body(weights: BodyWeights, bucket: Bucket, x, pos, cache):
    """The contract's math on MIL vars: returns (k_new, v_new, h) vars.
    `cache` is a ConcatCache or a WrittenCache."""
    cfg = weights.config
    cos_table = const(weights.rope_cos, "rope_cos")
    sin_table = const(weights.rope_sin, "rope_sin")
    cos = rope_rows(cos_table, pos, bucket.chunk, "cos")
    sin = rope_rows(sin_table, pos, bucket.chunk, "sin")
    h, ks, vs = x, [], []
    for i, w in enumerate(weights.layers):
        prefix = f"layer{i}"
        q, k, v = layer_qkv(h, w, cfg, cos, sin, prefix)
        ks.append(k)
        vs.append(v)
        keys, values, visible = cache.keys_values(i, k, v)
        attn = attention(q, keys, values, visible, name=f"{prefix}_attn")
        h = layer_out(h, attn, w, cfg, prefix)
    h = rms_norm(h, const(weights.final_norm, "final_norm"), cfg.rms_eps, name="h")
    return mb.stack(values=ks, axis=0, name="k_new"), mb.stack(values=vs, axis=0, name="v_new"), h


def check_rope_tables(weights: BodyWeights, bucket: Bucket, stateful: bool) -> None:
    need = rope_positions_needed(bucket, stateful)
    have = 0 if weights.rope_cos is None else weights.rope_cos.shape[0]
    if have < need:
        raise ValueError(f"bucket {bucket.name}: rope tables have {have} positions, the program needs {need} "
                         f"(call body_weights(model, positions={need}) or more)")


def cache_shape(weights: BodyWeights, bucket: Bucket) -> tuple:
    cfg = weights.config
    return (cfg.layers, cfg.kv_heads, bucket.cache, cfg.head_dim)


def chunk_program(weights: BodyWeights, bucket: Bucket, stateful: bool = True):
    """The MIL program (coremltools Program) of one bucket."""
    check_rope_tables(weights, bucket, stateful)
    cfg = weights.config
    x_spec = mb.TensorSpec((1, bucket.chunk, cfg.hidden), dtype=types.fp16)
    pos_spec = mb.TensorSpec((1,), dtype=types.int32)
    shape = cache_shape(weights, bucket)
    if stateful:
        specs = [x_spec, pos_spec, mb.StateTensorSpec(shape, dtype=types.fp16), mb.StateTensorSpec(shape, dtype=types.fp16)]

        @mb.program(input_specs=specs, opset_version=TARGET)
        def stateful_chunk(x, pos, k_cache, v_cache):
            return chunk_body(weights, bucket, x, pos, WrittenCache(StateStore(k_cache, v_cache), pos, bucket))

        return stateful_chunk
    specs = [x_spec, pos_spec, mb.TensorSpec(shape, dtype=types.fp16), mb.TensorSpec(shape, dtype=types.fp16)]

    @mb.program(input_specs=specs, opset_version=TARGET)
    def stateless_chunk(x, pos, k_cache, v_cache):
        return chunk_body(weights, bucket, x, pos, ConcatCache(k_cache, v_cache, pos, bucket))

    return stateless_chunk


def convert_program(prog) -> ct.models.MLModel:
    """A MIL program -> an mlprogram MLModel (loaded by Core ML only on macOS)."""
    return ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=TARGET,
                      compute_precision=ct.precision.FLOAT16, compute_units=ct.ComputeUnit.CPU_AND_NE,
                      skip_model_load=sys.platform != "darwin")


def save_chunk_package(weights: BodyWeights, buckets: list[Bucket], path, stateful: bool = True) -> Path:
    """One .mlpackage holding a function per bucket (named `bucket.name`, the
    first the default), the weights stored once."""
    path = Path(path)
    if not buckets:
        raise ValueError("no buckets")
    with tempfile.TemporaryDirectory(prefix="coreml_chunk_") as tmp:
        desc = ct.utils.MultiFunctionDescriptor()
        for b in buckets:
            single = Path(tmp) / f"{b.name}.mlpackage"
            convert_program(chunk_program(weights, b, stateful)).save(str(single))
            desc.add_function(str(single), src_function_name="main", target_function_name=b.name)
        desc.default_function_name = buckets[0].name
        if path.exists():
            shutil.rmtree(path)
        ct.utils.save_multifunction(desc, str(path))
    return path


def weight_bytes(weights: BodyWeights) -> int:
    """The bytes of the program's constants as fp16 (weights and rope tables)."""
    total = sum(a.nbytes for layer in weights.layers for a in layer.values())
    total += weights.final_norm.nbytes
    return total + 2 * (weights.rope_cos.size + weights.rope_sin.size)


def package_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
