"""Run a saved Core AI chunk program (coreai_program.py) through coreai-core's
runtime: on Linux (and macOS below 27) the wheel's own CPU runtime, on
macOS 27 the system's Core AI framework, which may place it on the Neural
Engine (unverified until a Mac runs it).

`CoreAIChunkRunner(weights, bucket, path, compute="fp16")` builds and saves
the program at `path` unless a valid asset is there (so `path` should name
the model, bucket and compute; `rebuild=True` replaces it), loads it once,
and is called like the NumPy reference: `runner(x, pos, k_cache, v_cache) ->
(k_new, v_new, h)`, NumPy float16 arrays per contract.py. The runtime is asynchronous; the runner
owns an event loop of its own so that callers stay synchronous (do not call
it from inside a running event loop).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.coreai_program import FUNCTION, INPUTS, OUTPUTS, io_shapes, save_program
from workers.prefill.ane.weights import BodyConfig, BodyWeights


class CoreAIChunkRunner:
    def __init__(self, weights: BodyWeights, bucket: Bucket, path: Path | str, compute: str = "fp16",
                 rebuild: bool = False):
        from coreai.authoring import AIModelAsset

        path = Path(path)
        if rebuild or not AIModelAsset.is_valid(path):
            asset = save_program(weights, bucket, path, compute)
        else:
            asset = AIModelAsset.load(path)
        self._open(asset, weights.config, bucket, path, weights.rope_cos.shape[0])

    @classmethod
    def from_asset(cls, path, config: BodyConfig, bucket: Bucket, positions: int) -> "CoreAIChunkRunner":
        """A runner over a program `tandem convert-ane` saved: no weights needed (serving)."""
        from coreai.authoring import AIModelAsset

        runner = cls.__new__(cls)
        runner._open(AIModelAsset.load(Path(path)), config, bucket, Path(path), positions)
        return runner

    def _open(self, asset, config: BodyConfig, bucket: Bucket, path: Path, positions: int) -> None:
        self.bucket, self.path, self.asset = bucket, path, asset
        self.shapes = io_shapes(config, bucket)
        self.positions = min(positions, bucket.cache + bucket.chunk)
        self._loop = asyncio.new_event_loop()
        # On Linux, entering executable() lowers the asset and compiles it for
        # the CPU runtime (seconds for a large model): once, kept open.
        self._executable = self.asset.executable()
        model = self._loop.run_until_complete(self._executable.__aenter__())
        self._function = model.load_function(FUNCTION)

    def signature(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every input's and output's (shape, dtype name) as the loaded program
        declares them to the runtime."""
        desc = self._function.desc
        out = {}
        for names, describe in ((desc.input_names, desc.input_descriptor), (desc.output_names, desc.output_descriptor)):
            for name in names:
                d = describe(name)
                out[name] = (tuple(d.shape), str(d.dtype))
        return out

    def inputs(self, x, pos, k_cache, v_cache) -> dict[str, np.ndarray]:
        """The call's inputs checked against the program's shapes, in its dtypes."""
        given = {"x": x, "pos": np.asarray(pos).reshape(-1), "k_cache": k_cache, "v_cache": v_cache}
        out = {}
        for name in INPUTS:
            shape, dtype = self.shapes[name]
            array = np.ascontiguousarray(np.asarray(given[name]), dtype=dtype)
            if array.shape != shape:
                raise ValueError(f"{name}: shape {array.shape}, bucket {self.bucket.name} takes {shape}")
            out[name] = array
        pos = int(out["pos"][0])
        if not 0 <= pos or pos + self.bucket.chunk > self.positions:
            raise ValueError(f"pos {pos}: the program's rope rows cover positions < {self.positions}")
        return out

    def __call__(self, x, pos, k_cache, v_cache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        from coreai.runtime import NDArray

        arrays = self.inputs(x, pos, k_cache, v_cache)
        results = self._loop.run_until_complete(self._function({k: NDArray(v) for k, v in arrays.items()}))
        return tuple(results[name].numpy() for name in OUTPUTS)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self._executable.__aexit__(None, None, None))
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
