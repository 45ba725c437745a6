"""The prefill worker's Neural Engine backend (--prefill-backend ane|auto):
the converted programs for this model (made ahead by `tandem convert-ane`,
under the cache folder), a runner per bucket, the bridge. On macOS 27 with
coreai-core installed, the Core AI programs (Core AI is Core ML's successor
there); elsewhere on macOS 15+ the Core ML package.

Off macOS there is no Core ML predict: `ane` is refused by `tandem serve`
before anything starts, `auto` prefills with MLX (said once in the log). A
model with no converted package prefills with MLX too, and the log says how
to convert it: converting and the first compile take minutes to an hour of
full power, so they never happen inside a serving worker.
"""

from __future__ import annotations

import logging
import platform
import sys

from environment.settings import Settings, default_cache_dir
from workers.prefill.ane.bridge import AneBody
from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.packages import PackageStore
from workers.prefill.ane.weights import body_config

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
    core_ai = _core_ai(store)
    buckets = store.buckets("coreai") if core_ai else store.buckets("coreml")
    if not buckets:
        log.warning("--prefill-backend %s: no Neural Engine program for this model yet; prefill stays on MLX. "
                    "Convert it (on AC power; the first compile takes minutes): tandem convert-ane --model %s",
                    settings.prefill_backend, settings.model or settings.model_dir)
        return None
    config, runners = body_config(model), {}
    positions = max(b.cache for b in buckets) + max(b.chunk for b in buckets)

    def runner_for(bucket: Bucket):
        if bucket not in runners:
            if core_ai:
                from workers.prefill.ane.coreai_runner import CoreAIChunkRunner

                runners[bucket] = CoreAIChunkRunner.from_asset(store.path("coreai", f"{bucket.name}.aimodel"), config,
                                                               bucket, positions)
            else:
                from workers.prefill.ane.coreml_runner import CoreMLChunkRunner  # coremltools: loaded only here

                runners[bucket] = CoreMLChunkRunner(store.path("coreml", COREML_PACKAGE), bucket)
        return runners[bucket]

    log.info("prefill on the Neural Engine (%s, %s) in buckets %s", settings.prefill_backend,
             "Core AI" if core_ai else "Core ML", ", ".join(b.name for b in buckets))
    return AneBody(model, runner_for, buckets, config.kv_heads, config.head_dim)


def _core_ai(store: PackageStore) -> bool:
    """Core AI serves on macOS 27 and later, where coreai-core is installed and its programs were converted."""
    release = platform.mac_ver()[0]
    major = int(release.split(".")[0]) if release.split(".")[0].isdigit() else 0
    if major < 27 or not store.buckets("coreai"):
        return False
    try:
        import coreai  # noqa: F401
    except ImportError:
        return False
    return True
