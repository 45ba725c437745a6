"""Single-stream decode as a share of the memory-bandwidth limit.

Decoding one stream reads every weight once per token, so tokens/s can be at
most (memory bandwidth / weight bytes). The share = weight bytes x measured
decode tokens/s / copy bandwidth says how close a server gets; far below 1
means per-token overhead (Python, scheduling, IPC, small kernels) dominates.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.bench.servers.peer_weights import safetensors_bytes
from environment.backend import on_cpu
from benchmarks.random_models.text import build_model, count_parameters


def copy_bandwidth(size_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second moved by a large array copy (read + write counted, as
    STREAM's copy does), best of `repeats`. One thread: a lower bound on the
    machine's bandwidth, like the one a decode step's matrix-vector work sees."""
    import numpy as np

    src = np.ones(size_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def computed_weight_bytes(model_dir: Path) -> int:
    """Bytes of weights a decode step reads as Tandem runs the folder: on MLX's
    CPU backend everything is float32 (parameters x 4); on a GPU the folder's
    tensors as stored (quantized ones stay quantized)."""
    if not on_cpu():
        return safetensors_bytes(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    return 4 * count_parameters(build_model(config))  # lazy: builds shapes, allocates nothing


def single_stream(sweep: list[dict], weight_bytes: int | None, bandwidth: float | None) -> dict | None:
    """From the sweep's one-client level: decode tokens/s (1 / median
    inter-token gap, so prefill does not count) and its share of the limit."""
    level = next((lv for lv in sweep if lv["concurrency"] == 1), None)
    if not level or not level.get("itl_p50_s"):
        return None
    tok_s = 1.0 / level["itl_p50_s"]
    share = weight_bytes * tok_s / bandwidth if weight_bytes and bandwidth else None
    return {"decode_tok_s": tok_s, "weight_bytes": weight_bytes, "copy_bandwidth_bytes_s": bandwidth,
            "limit_tok_s": bandwidth / weight_bytes if weight_bytes and bandwidth else None,
            "bandwidth_share": share}
