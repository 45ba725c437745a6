"""Load a model folder for inference on whatever device MLX runs on.

On MLX's CPU backend quantized matmuls are far slower than float32 matmuls
through BLAS, so quantized layers are expanded to float32 at load; on a GPU
(Metal or CUDA) they stay quantized, which is both smaller and faster there.
How many freed buffers MLX keeps per process is sized here too (`size_buffer_cache`),
and whether a process records CUDA graphs (`set_cuda_graphs`).
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from environment.backend import on_cpu
from environment.model_folder import ModelError


# MLX's CPU allocator keeps only 32 MB of freed buffers by default: a 512-token
# prefill chunk's attention scores (9 MB per layer for the embedded model) and
# MLP activations then come from fresh pages every layer, and the page faults
# cost more than the arithmetic (prefill of 512 tokens ~2.1 s -> ~1.4 s with
# 128 MB; BENCHMARKS.md).
CPU_BUFFER_CACHE = 128 << 20


def device_memory(device: dict) -> int | None:
    """The bytes MLX may use on its device: on a Mac, Metal's recommended
    working set (about two thirds to three quarters of RAM); on CUDA, the
    card's memory."""
    total = device.get("max_recommended_working_set_size") or device.get("total_memory") or device.get("memory_size")
    return int(total) if total else None


def unified_memory(device: dict) -> bool:
    """Whether the GPU's memory IS the machine's memory (Apple silicon):
    then every byte a worker keeps on the device is RAM the system lacks.
    Only Metal reports a recommended working set; CUDA may report memory_size."""
    return "max_recommended_working_set_size" in device


# What MLX keeps of freed buffers on a GPU, per process, at least. What a
# step frees and the next allocates again (a prefill chunk's activations, a
# decode step's logits, a joining row's copy of the batch) is far less than
# the device, and mlx_lm.server empties its cache after every prompt, so a
# larger cache is memory only Tandem holds. On unified memory that memory is
# RAM, hence the smaller floor there.
DISCRETE_BUFFER_CACHE_MIN = 1 << 30
UNIFIED_BUFFER_CACHE_MIN = 256 << 20


def buffer_cache_bytes(cpu: bool, device: dict, processes: int = 1) -> int | None:
    """How many bytes of freed buffers one of `processes` model processes on
    this machine should let MLX keep for reuse (None: leave MLX's default).
    On a GPU MLX's default is its whole memory limit, in every process: workers
    sharing one GPU (or a Mac's unified memory) each hoarded freed buffers up
    to it until another's allocation failed (a 32-agent swarm on an H100 grew
    the decode worker to 78 GB in seconds; both workers then failed with out
    of memory). Half the device per process stopped the failures but still let
    two workers on a 16 GB Mac keep 5 GB of RAM in freed buffers. Now each
    keeps, of the device's memory, a sixteenth (at least 1 GiB) on a discrete
    GPU, a thirty-second (at least 256 MiB) on unified memory, and never more
    than 1/(2 x processes)."""
    if cpu:
        return CPU_BUFFER_CACHE
    total = device_memory(device)
    if not total:
        return None
    share = max(1, processes)
    if unified_memory(device):
        want = max(UNIFIED_BUFFER_CACHE_MIN, total // (32 * share))
    else:
        want = max(DISCRETE_BUFFER_CACHE_MIN, total // (16 * share))
    return min(total // (2 * share), want)


# A CPU worker's hot KV blocks: there an arena read is only a memcpy (a warm
# request measured the same with and without the tier), so it is kept small:
# a system prompt's worth, not to add to the memory a small machine lacks.
CPU_HOT_KV = 64 << 20


def hot_kv_bytes(cpu: bool, device: dict, processes: int = 1) -> int:
    """Bytes of prefix-cache blocks one of `processes` model processes keeps
    as MLX arrays (workers/kv/hot_blocks.py), copies of arena blocks.
    - A discrete GPU: an eighth of its memory per process. Every block taken
      from the host arena crosses PCIe from pageable memory (~3.5 GB/s
      measured on an H100; a 32-agent swarm 60.1 -> 34.0 s with the tier),
      and the copies sit in the card's memory, not the host's.
    - Unified memory (a Mac): a thirty-second of the device's memory per
      process. There the device's memory is RAM, so "an eighth per worker"
      was a quarter of the working set for two workers on top of the arena
      holding the same blocks; and a block taken from the arena costs two
      memcpys at memory bandwidth, not a PCIe crossing.
    - The CPU: 64 MiB (above)."""
    if cpu:
        return CPU_HOT_KV
    total = device_memory(device)
    if not total:
        return CPU_HOT_KV
    return total // ((32 if unified_memory(device) else 8) * max(1, processes))


def set_cuda_graphs(environ=os.environ) -> None:
    """Turn MLX's CUDA graphs off for this process, unless
    MLX_USE_CUDA_GRAPHS is set already (the operator's choice stands). MLX
    reads the variable at the first GPU work, so a worker calls this before
    any; other backends ignore it.

    MLX's CUDA backend records kernels into CUDA graphs (30 at a time on an
    H100) and replays a recorded one where the next 30 have the same
    topology. Measured on an H100 with Qwen3-0.6B's shape (docs/benchmarks-log.md,
    session 15), graphs cost more than they save here:
      * a decode step of the DecodeEngine, 24 rows: 14.8 ms with graphs,
        11.6 ms without (1 row: 11.8 against 9.2 ms). The step is bound by
        MLX's host-side work per kernel, not by the GPU (a plain mlx-lm
        pass waits 0.4 ms for the GPU after 10 ms of encoding);
      * a prefill meets a new shape on nearly every follow-up turn (its new
        tokens over its cached ones), and a graph for a new shape is
        recorded and instantiated: 25-85 ms the first time
        (benchmarks/probes/first_pass.py; session 12)."""
    environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")


def size_buffer_cache(processes: int = 1) -> None:
    """Apply buffer_cache_bytes to this process (idempotent)."""
    limit = buffer_cache_bytes(on_cpu(), mx.device_info(), processes)
    if limit is not None:
        mx.set_cache_limit(limit)


def load_model(folder: str | os.PathLike, dequantize: bool | None = None, lazy: bool = False):
    """(model, tokenizer) for an MLX model folder, as mlx_lm.load gives them
    (the tokenizer mlx-lm's TokenizerWrapper): `load_weights`, then mlx-lm's
    tokenizer, for the command line and the tests' references. A worker
    needs only the weights (workers/parts.py)."""
    from mlx_lm.utils import load_tokenizer

    model, config = _load(Path(folder), dequantize, lazy)
    return model, load_tokenizer(Path(folder), eos_token_ids=config.get("eos_token_id"))


def load_weights(folder: str | os.PathLike, dequantize: bool | None = None, lazy: bool = False):
    """The model of an MLX model folder, through mlx-lm's `load_model`.
    `dequantize` defaults to "only on the CPU backend". `lazy`: the weights
    stay unread until evaluated (a tensor-parallel rank cuts its shard first,
    so it never holds the whole model: workers/models/sharding.py)."""
    return _load(Path(folder), dequantize, lazy)[0]


def _load(folder: Path, dequantize: bool | None, lazy: bool):
    """(model, its config as mlx-lm read it: generation_config.json's eos ids merged)."""
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load_model as mlx_lm_load_model

    try:
        model, config = mlx_lm_load_model(folder, lazy=lazy)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ModelError(f"{folder}: cannot load model ({_one_line(e)})") from None
    if on_cpu() if dequantize is None else dequantize:
        if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
            # Scales first, so the expansion itself runs in float32 and the
            # weights are not rounded through float16 on the way.
            model.set_dtype(mx.float32)
            model = dequantize_model(model)
        model.set_dtype(mx.float32)  # float16 checkpoints too: no fast fp16 BLAS
        if not lazy:
            mx.eval(model.parameters())
    return model, config


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
