"""Run a saved chunk package with Core ML (macOS 15+ only), per the contract.

`CoreMLChunkRunner(path, bucket)` loads the bucket's function of the package
with CPU_AND_NE (the Neural Engine, the CPU for what it cannot run).
`runner(x, pos, k_cache, v_cache)` returns (k_new, v_new, h). For a stateful
package the caches, when given, are first written into the runner's own
MLState (a prefix-cache hit loaded into the program's state); passing None
for both continues from the state the previous chunk left (the chunk's KV
already sits in it at [pos, pos+Q)).

Everything up to Core ML itself (reading the package, checking inputs) runs
anywhere; loading and predicting raise CoreMLUnavailable off macOS.
"""

from __future__ import annotations

import platform
import sys

import coremltools as ct
import numpy as np

from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.coreml_inspect import FunctionSummary, default_function, package_functions


class CoreMLUnavailable(RuntimeError):
    """Core ML cannot execute here (not macOS, or a macOS without states)."""


def _macos_version() -> tuple:
    release = platform.mac_ver()[0]
    return tuple(int(p) for p in release.split(".") if p.isdigit()) if release else ()


def require_core_ml(stateful: bool = True) -> None:
    """Raise CoreMLUnavailable unless Core ML can run a chunk package here."""
    if sys.platform != "darwin":
        raise CoreMLUnavailable(
            f"Core ML predict runs on macOS only (this is {sys.platform}): coremltools builds and saves "
            "the chunk package here, but executing it needs Apple's Core ML framework")
    if stateful and _macos_version() < (15,):
        raise CoreMLUnavailable(f"stateful Core ML programs need macOS 15 or later (this is {platform.mac_ver()[0]})")


def _function_for(path, bucket: Bucket) -> tuple[str, FunctionSummary]:
    functions = package_functions(path)
    if bucket.name in functions:
        return bucket.name, functions[bucket.name]
    only = default_function(path)
    if len(functions) == 1 and only in functions:
        return only, functions[only]
    raise ValueError(f"{path}: no function for bucket {bucket.name} (has {sorted(functions)})")


class CoreMLChunkRunner:
    def __init__(self, path, bucket: Bucket, compute_units=ct.ComputeUnit.CPU_AND_NE):
        self.path, self.bucket = str(path), bucket
        self.function_name, self.summary = _function_for(path, bucket)
        self.stateful = bool(self.summary.states)
        self.keeps_state = self.stateful  # the bridge passes no cache while the state holds it (bridge.py)
        self.cache_shape = (self.summary.states or self.summary.inputs)["k_cache"][0]
        self.compute_units = compute_units
        self._model = None
        self._state = None

    def load(self):
        """Load (and on first use compile) the function with Core ML."""
        require_core_ml(self.stateful)
        if self._model is None:
            multifunction = self.function_name != "main"
            self._model = ct.models.MLModel(self.path, compute_units=self.compute_units,
                                            function_name=self.function_name if multifunction else None)
            if self.stateful:
                self._state = self._model.make_state()
        return self._model

    def feed(self, x, pos, k_cache, v_cache) -> dict:
        """The predict inputs, checked against the package's shapes."""
        q, hidden = self.summary.inputs["x"][0][1:]
        x = np.asarray(x, np.float16)
        if x.shape != (1, q, hidden):
            raise ValueError(f"x has shape {x.shape}, the program takes (1, {q}, {hidden})")
        pos = int(np.asarray(pos).reshape(-1)[0])
        limit = self.bucket.cache - q if self.stateful else self.bucket.cache
        if not 0 <= pos <= limit:
            raise ValueError(f"pos {pos} outside [0, {limit}] for bucket {self.bucket.name}")
        out = {"x": x, "pos": np.array([pos], np.int32)}
        if (k_cache is None) != (v_cache is None):
            raise ValueError("give both caches or neither")
        if k_cache is None:
            if not self.stateful:
                raise ValueError("the stateless program needs k_cache and v_cache")
            return out
        caches = {"k_cache": np.asarray(k_cache, np.float16), "v_cache": np.asarray(v_cache, np.float16)}
        for name, value in caches.items():
            if value.shape != self.cache_shape:
                raise ValueError(f"{name} has shape {value.shape}, the program's is {self.cache_shape}")
        return {**out, **caches}

    def __call__(self, x, pos, k_cache=None, v_cache=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        inputs = self.feed(x, pos, k_cache, v_cache)
        model = self.load()
        if self.stateful:
            for name in ("k_cache", "v_cache"):
                if name in inputs:
                    self._state.write_state(name, inputs.pop(name))
            result = model.predict(inputs, state=self._state)
        else:
            result = model.predict(inputs)
        return tuple(np.asarray(result[n], np.float16) for n in ("k_new", "v_new", "h"))

    def read_cache(self) -> tuple[np.ndarray, np.ndarray]:
        """The stateful program's whole caches (L, KV, S, Dh) after the last chunk."""
        if not self.stateful:
            raise ValueError("a stateless program keeps no cache")
        self.load()
        return (np.asarray(self._state.read_state("k_cache")), np.asarray(self._state.read_state("v_cache")))
