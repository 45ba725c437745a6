"""The one place Tandem reaches into mlx-lm's code.

mlx-lm's model modules import `scaled_dot_product_attention` (from
`mlx_lm.models.base`) and `swiglu` (from `mlx_lm.models.activations`) by name,
and `mlx_lm.generate`'s BatchGenerator calls `mx.logsumexp` over the
vocabulary on every decode step. `install(model)` replaces, for the whole
process:
  * `scaled_dot_product_attention`, in the model's modules, with `_attention`,
    which sends
      - a RaggedKVCache (decode batches on the CPU: workers/ragged_kv.py) to
        its row-by-row attention;
      - on the CPU backend, plain and causal masks to workers/cpu_attention.py;
      - everything else (a GPU, quantized KV, sinks, array masks) to mlx-lm's
        own function, untouched;
  * on the CPU backend only (MLX's exp is scalar there: workers/cpu_math.py),
    `swiglu` in the model's modules with `cpu_math.silu_mul`, and
    `mlx_lm.generate`'s `mx` with mlx.core seen through `_CoreForGenerate`,
    whose `logsumexp` is `cpu_math.logsumexp`.
TANDEM_MLX_EXP=1 keeps MLX's own attention, swiglu and logsumexp on the CPU too
(to compare).
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import mlx.core as mx
from mlx_lm.models import activations as mlx_lm_activations
from mlx_lm.models import base as mlx_lm_base

from workers import cpu_attention, cpu_math
from workers.loading import on_cpu
from workers.ragged_kv import RaggedKVCache

# The module, not the `generate` function mlx_lm's package exports under the same name.
mlx_lm_generate = importlib.import_module("mlx_lm.generate")
_ORIGINAL = mlx_lm_base.scaled_dot_product_attention
_ORIGINAL_SWIGLU = mlx_lm_activations.swiglu
_CPU = {"on": False}


def _attention(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, RaggedKVCache):
        return cache.attend(queries, scale, sinks)
    if _CPU["on"] and sinks is None and not hasattr(cache, "bits"):
        out = cpu_attention.attention(queries, keys, values, scale, mask)
        if out is not None:
            return out
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


class _CoreForGenerate(types.ModuleType):
    """mlx.core, but for `logsumexp` (BatchGenerator's normalisation of every
    step's logits), which is cpu_math's."""

    logsumexp = staticmethod(cpu_math.logsumexp)

    def __getattr__(self, name):
        return getattr(mx, name)


def install(model) -> bool:
    """Route `model`'s attention through `_attention`, and on the CPU its
    swiglu and BatchGenerator's logsumexp through cpu_math (idempotent).
    Returns False when the model's code does not call mlx-lm's attention
    function (then RaggedKVCache cannot be used with it)."""
    _CPU["on"] = on_cpu() and not os.environ.get("TANDEM_MLX_EXP")
    if _CPU["on"] and mlx_lm_generate.mx is mx:
        mlx_lm_generate.mx = _CoreForGenerate("mlx.core")
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    patched = False
    for name in names:
        module = sys.modules.get(name)
        if _CPU["on"] and getattr(module, "swiglu", None) is _ORIGINAL_SWIGLU:
            module.swiglu = cpu_math.silu_mul
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is _ORIGINAL:
            module.scaled_dot_product_attention = _attention
            patched = True
        elif current is _attention:
            patched = True
    return patched
