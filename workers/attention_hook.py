"""The one place Tandem reaches into mlx-lm's attention.

Every mlx-lm model module imports `scaled_dot_product_attention` from
`mlx_lm.models.base` and calls it with the layer's cache. `install(model)`
replaces that name in the model's modules with `_attention`, which sends
  * a RaggedKVCache (decode batches on the CPU: workers/ragged_kv.py) to its
    row-by-row attention;
  * on the CPU backend, plain and causal masks to workers/cpu_attention.py
    (MLX's CPU exp is the bottleneck of attention there);
  * everything else (a GPU, quantized KV, sinks, array masks) to mlx-lm's own
    function, untouched.
TANDEM_MLX_ATTENTION=1 keeps mlx-lm's own attention on the CPU too (to compare).
"""

from __future__ import annotations

import os
import sys

from mlx_lm.models import base as mlx_lm_base

from workers import cpu_attention
from workers.loading import on_cpu
from workers.ragged_kv import RaggedKVCache

_ORIGINAL = mlx_lm_base.scaled_dot_product_attention
_CPU = {"on": False}


def _attention(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, RaggedKVCache):
        return cache.attend(queries, scale, sinks)
    if _CPU["on"] and sinks is None and not hasattr(cache, "bits"):
        out = cpu_attention.attention(queries, keys, values, scale, mask)
        if out is not None:
            return out
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model) -> bool:
    """Route `model`'s attention through `_attention` (idempotent, for the
    whole process). Returns False, changing nothing, when the model's code
    does not call mlx-lm's attention function (then RaggedKVCache cannot be
    used with it)."""
    _CPU["on"] = on_cpu() and not os.environ.get("TANDEM_MLX_ATTENTION")
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    patched = False
    for name in names:
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is _ORIGINAL:
            module.scaled_dot_product_attention = _attention
            patched = True
        elif current is _attention:
            patched = True
    return patched
