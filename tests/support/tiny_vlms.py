"""Tiny random-weight VLMs for tests (no downloads; each folder is built once per session).

`make_tiny_vlm(path, like)` writes a folder (benchmarks/random_models/vlm.py) that
mlx-vlm's `load` and mlx-lm's `load` both read offline: the weights, a
tokenizer (the embedded model's, plus the architecture's special tokens), the
chat template and the image processor's settings. `tiny_vlm(tmp_path_factory,
like)` builds it once per pytest session and returns the cached folder on later
calls, so module fixtures can share it:

    @pytest.fixture(scope="module")
    def qwen_dir(tmp_path_factory):
        return tiny_vlm(tmp_path_factory, "tiny-qwen2.5-vl")

`synthetic_image` draws a small deterministic RGB picture (gradients plus
seeded noise), so two seeds give clearly different images.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY_QWEN_VL = "tiny-qwen2.5-vl"
TINY_GEMMA3 = "tiny-gemma3"
TINY_VLMS = (TINY_QWEN_VL, TINY_GEMMA3)
# Tested on its own (tests/workers/vision/test_vision_qwen3vl.py): the tests over TINY_VLMS
# assume 14 px patches.
TINY_QWEN3_VL = "tiny-qwen3-vl"

_built: dict = {}


def make_tiny_vlm(path, like: str = TINY_QWEN_VL, seed: int = 0) -> Path:
    """Write the random `like` VLM (a name in benchmarks.random_models.vlm.SHAPES) to `path`."""
    from benchmarks.random_models.vlm import make_random_vlm

    make_random_vlm(like, Path(path), seed)
    return Path(path)


def tiny_vlm(tmp_path_factory, like: str = TINY_QWEN_VL, seed: int = 0) -> Path:
    """The session's folder for (`like`, `seed`), built on first use."""
    key = (like, seed, str(tmp_path_factory.getbasetemp()))
    if key not in _built:
        _built[key] = make_tiny_vlm(tmp_path_factory.mktemp(f"{like}-{seed}"), like, seed)
    return _built[key]


def synthetic_image(height: int, width: int, seed: int = 0):
    """A deterministic HxW RGB PIL image."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, ((x + y) * 3) % 256], -1)
    noise = np.random.default_rng(seed).integers(0, 128, (height, width, 3))
    return Image.fromarray((base // 2 + noise).astype(np.uint8), "RGB")
