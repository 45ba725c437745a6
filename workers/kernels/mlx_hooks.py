"""Where Tandem reaches into mlx-lm's and mlx-vlm's code.

workers/kernels/ is the one package that touches their private state: this
module patches their functions, mlx_cache.py names the private cache
attributes the rest of the code reads, slot_batch_cache.py rewrites
BatchKVCache from the inside.

mlx-lm's model modules import `scaled_dot_product_attention` (from
`mlx_lm.models.base`) and `swiglu` (from `mlx_lm.models.activations`) by name,
and `mlx_lm.generate`'s BatchGenerator calls `mx.logsumexp` over the
vocabulary on every decode step. `install(model)` replaces, for the whole
process:
  * `scaled_dot_product_attention`, in the model's modules, with `_attention`,
    which sends
      - a RaggedKVCache (decode batches on the CPU: workers/decode/ragged_kv.py) to
        its row-by-row attention;
      - on the CPU backend, plain and causal masks to workers/kernels/cpu_attention.py;
      - on MLX's CUDA backend, a prefill's short queries to
        workers/kernels/cuda_attention.py (no cuDNN graph per shape), and a padded
        decode batch's one query per row (mlx-lm's BatchKVCache and ours)
        to workers/kernels/cuda_decode_attention.py (no mask, so no fallback to
        separate ops);
      - a left-padded BatchKVCache's mask (a batch of prompts,
        workers/prefill/batch.py) as "causal" plus each row's start;
      - everything else (Metal, quantized KV, sinks, array masks) to mlx-lm's
        own function, untouched;
  * on the CPU backend only (MLX's exp is scalar there: workers/kernels/cpu_math.py),
    `swiglu` in the model's modules with `cpu_math.silu_mul`, and
    `mlx_lm.generate`'s `mx` with mlx.core seen through `_CoreForGenerate`,
    whose `logsumexp` is `cpu_math.logsumexp`.
`head_at(model, positions)` makes a prompt pass's head (the vocabulary
projection) compute only the positions whose logits are wanted, by wrapping
the model's body (`model.model`, which nearly every mlx-lm model and mlx-vlm
language model has) so that its hidden states are cut to those positions
before the head; `logits_at` is a pass of an mlx-lm model with it.
`install_vlm(language_model)` does the same for mlx-vlm's language model
(attention and swiglu), over the mlx-lm caches Tandem's VLM prefill gives it.
TANDEM_MLX_EXP=1 keeps MLX's own attention, swiglu and logsumexp on the CPU,
TANDEM_CUDNN_PREFILL=1 MLX's own prefill attention on CUDA, and
TANDEM_MLX_DECODE_ATTENTION=1 its masked decode attention (to compare).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations as mlx_lm_activations
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import BatchKVCache

from environment.backend import on_cpu, on_cuda
from workers.decode.ragged_kv import RaggedKVCache
from workers.kernels import cpu_attention, cpu_math, cuda_attention, cuda_decode_attention
from workers.kernels.mlx_cache import BaseCache

# The module, not the `generate` function mlx_lm's package exports under the same name.
mlx_lm_generate = importlib.import_module("mlx_lm.generate")
_ORIGINAL = mlx_lm_base.scaled_dot_product_attention
_ORIGINAL_SWIGLU = mlx_lm_activations.swiglu
_CPU = {"on": False}
_CUDA = {"on": False, "decode": False}


def _set_backend() -> None:
    _CPU["on"] = on_cpu() and not os.environ.get("TANDEM_MLX_EXP")
    cuda = on_cuda()
    _CUDA["on"] = cuda and not os.environ.get("TANDEM_CUDNN_PREFILL")
    _CUDA["decode"] = cuda and not os.environ.get("TANDEM_MLX_DECODE_ATTENTION")


def _ours(queries, keys, values, cache, scale, mask, sinks):
    """This backend's attention of ours, or None where MLX's serves."""
    if sinks is not None or hasattr(cache, "bits"):  # quantized KV
        return None
    starts = None
    if isinstance(cache, BatchKVCache) and mask is not None:
        # mlx-lm's mask over its padded batch says no more than "causal, and
        # each row from its left padding on" (a window comes with rotating
        # caches, BatchRotatingKVCache, not here): a decode batch's one query
        # a row, or a batch of prompts (workers/prefill/batch.py).
        if _CUDA["decode"] and cuda_decode_attention.supported(queries, keys, values):
            return cuda_decode_attention.attention(queries, keys, values, scale, cache.left_padding)
        mask, starts = "causal", cache.left_padding
    if _CPU["on"]:
        return cpu_attention.attention(queries, keys, values, scale, mask, starts)
    if _CUDA["on"]:
        return cuda_attention.attention(queries, keys, values, scale, mask, starts)
    return None


def _attention(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, RaggedKVCache):
        return cache.attend(queries, scale, sinks)
    out = _ours(queries, keys, values, cache, scale, mask, sinks)
    if out is not None:
        return out
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _vlm_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-vlm's attention, but ours over an mlx-lm cache (Tandem's VLM
    prefill writes the text model's cache); mlx-vlm's own caches (its
    generate) keep mlx-vlm's attention."""
    from mlx_vlm.models.base import scaled_dot_product_attention  # mlx-vlm: loaded only for a VLM

    if isinstance(cache, BaseCache):
        out = _ours(queries, keys, values, cache, scale, mask, sinks)
        if out is not None:
            return out
    return scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


class _Selecting:
    """A model's body (`model.model`) that, while `positions` is set (one
    index a row), returns only those positions' hidden states, so that the
    model's head runs over them alone. Set on the model object itself, not in
    its module tree: its parameters, and every other call, stay as they were."""

    def __init__(self, body):
        self._body = body
        self.positions = None

    def __call__(self, *args, **kwargs):
        hidden = self._body(*args, **kwargs)
        if self.positions is None or not isinstance(hidden, mx.array) or hidden.ndim != 3:
            return hidden
        return mx.take_along_axis(hidden, self.positions[:, None, None], axis=1)

    def __getattr__(self, name):  # embed_tokens.as_linear for tied heads, and the rest
        return getattr(self._body, name)


@contextlib.contextmanager
def head_at(model, positions):
    """While in this block, `model`'s head computes only `positions` (one
    index a row, into the inputs of the next call) where its body
    (`model.model`) can be wrapped: its logits come out [rows, 1, vocab].
    Other models give every position's logits, unchanged."""
    body = None
    if isinstance(model, nn.Module):
        body = vars(model).get("model")
        if not isinstance(body, _Selecting) and isinstance(model.get("model"), nn.Module):
            body = _Selecting(model["model"])
            object.__setattr__(model, "model", body)  # the instance's attribute, outside the module tree
    if not isinstance(body, _Selecting):
        yield
        return
    body.positions = mx.array(list(positions), dtype=mx.int32)
    try:
        yield
    finally:
        body.positions = None


def logits_at(model, inputs: mx.array, cache, last=None) -> mx.array:
    """`model` over `inputs` [rows, n] with `cache`; the logits [rows, vocab]
    at each row's position `last[i]` (default: the last), the head computing
    those positions only (`head_at`: for a 512-token chunk of a 49k
    vocabulary that is ~15 GFLOPs not spent). So a prompt's last token runs
    in its final chunk instead of a pass of its own, which costs a read of
    all weights (~60 ms on the 2-core CPU with the embedded model, ~5 ms on
    an H100: docs/benchmarks-log.md, session 18)."""
    rows, n = inputs.shape
    last = [n - 1] * rows if last is None else list(last)
    with head_at(model, last):
        logits = model(inputs, cache=cache)
    if logits.shape[1] == 1:  # the head ran over `last` alone
        return logits[:, 0, :]
    positions = mx.array(last, dtype=mx.int32)
    return mx.take_along_axis(logits, positions[:, None, None], axis=1)[:, 0, :]


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
    _set_backend()
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


def install_vlm(language_model) -> None:
    """mlx-vlm's language model takes this backend's attention (and on the
    CPU the fast-exp SwiGLU) as install() gives mlx-lm's: on the CPU a
    follow-up turn's attention over its cached picture paid for MLX's exp
    (tiny Qwen2.5-VL, 62 tokens over 1,472 cached: ~20 -> ~14.5 ms), on
    CUDA for a cuDNN graph of its new shape. Patched by module (the
    functions are looked up there by name)."""
    from mlx_vlm.models import activations, base

    _set_backend()
    if not (_CPU["on"] or _CUDA["on"]):
        return
    for name in {type(m).__module__ for _, m in language_model.named_modules()}:
        module = sys.modules.get(name)
        if getattr(module, "scaled_dot_product_attention", None) is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = _vlm_attention
        if _CPU["on"] and getattr(module, "swiglu", None) is activations.swiglu:
            module.swiglu = cpu_math.silu_mul
