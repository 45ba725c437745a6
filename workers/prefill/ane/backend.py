"""The prefill worker's Neural Engine backend (--prefill-backend ane|auto):
the converted Core ML package for this model (made ahead by `tandem
convert-ane`, under the cache folder), a runner per bucket, the bridge.

Off macOS there is no Core ML predict: `ane` is refused by `tandem serve`
before anything starts, `auto` prefills with MLX (said once in the log). A
model with no converted package prefills with MLX too, and the log says how
to convert it: converting and the first compile take minutes to an hour of
full power, so they never happen inside a serving worker.
"""

from __future__ import annotations

import logging
import sys

from deploy.settings import Settings, default_cache_dir
from workers.prefill.ane.bridge import AneBody
from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.packages import PackageStore

log = logging.getLogger(__name__)

COREML_PACKAGE = "chunks.mlpackage"  # one package, a function per bucket (tandem convert-ane)


def make_ane_body(model, settings: Settings) -> AneBody | None:
    """The bridge over this model's converted package, or None (prefill in MLX)."""
    if settings.prefill_backend == "mlx":
        return None
    if sys.platform != "darwin":
        log.info("--prefill-backend %s: the Neural Engine runs on macOS only; prefill stays on MLX",
                 settings.prefill_backend)
        return None
    store = PackageStore(default_cache_dir(), settings.model_dir)
    buckets = store.buckets("coreml")
    if not buckets:
        log.warning("--prefill-backend %s: no Neural Engine program for this model yet; prefill stays on MLX. "
                    "Convert it (on AC power; the first compile takes minutes): tandem convert-ane --model %s",
                    settings.prefill_backend, settings.model or settings.model_dir)
        return None
    from workers.prefill.ane.coreml_runner import CoreMLChunkRunner  # coremltools: loaded only here

    path, runners = store.path("coreml", COREML_PACKAGE), {}

    def runner_for(bucket: Bucket):
        if bucket not in runners:
            runners[bucket] = CoreMLChunkRunner(path, bucket)
        return runners[bucket]

    attn = model.model.layers[0].self_attn
    head_dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads  # output rows, quantized or not
    log.info("prefill on the Neural Engine (%s) in buckets %s", settings.prefill_backend,
             ", ".join(b.name for b in buckets))
    return AneBody(model, runner_for, buckets, attn.n_kv_heads, head_dim)
