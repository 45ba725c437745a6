"""`tandem convert-ane` end to end on a tiny random llama that carries the
embedded model's tokenizer: both formats converted into the cache folder
under the model's fingerprint, the manifest naming what is there, and
`--check` running the converted prefill (the NumPy reference and Core AI's
Linux runtime) against MLX with the same greedy tokens after it. Core ML's
predict is macOS only: its package is built and listed here, not run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from deploy.cli import build_parser
from tests.support.tiny_models import make_tiny_llama
from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.packages import PackageStore


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, embedded_model_dir):
    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny-chat"), seed=1, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def converted(tiny_chat_model, tmp_path_factory):
    """The cache folder after one `tandem convert-ane --check` of the tiny model, and what it printed."""
    pytest.importorskip("coreai", reason="coreai-core has wheels for Linux x86-64 and macOS 26+ only")
    import contextlib
    import io
    import os

    root, out = tmp_path_factory.mktemp("ane-cache"), io.StringIO()
    before = os.environ.get("TANDEM_CACHE_DIR")
    os.environ["TANDEM_CACHE_DIR"] = str(root)
    try:
        args = build_parser().parse_args(["convert-ane", "--model", str(tiny_chat_model), "--chunk", "16",
                                          "--caches", "64,32", "--check", "--check-tokens", "4"])
        with contextlib.redirect_stdout(out):
            assert args.run(args) == 0
    finally:
        if before is None:
            os.environ.pop("TANDEM_CACHE_DIR", None)
        else:
            os.environ["TANDEM_CACHE_DIR"] = before
    return root, out.getvalue()


def test_converts_both_formats_and_checks_them(tiny_chat_model, converted):
    tmp_path, out = converted
    store = PackageStore(tmp_path, tiny_chat_model)
    manifest = json.loads((store.folder / "manifest.json").read_text())
    assert set(manifest["formats"]) == {"coreml", "coreai"}
    assert store.buckets("coreml") == store.buckets("coreai") == [Bucket(16, 32), Bucket(16, 64)]
    assert (store.folder / "coreml" / "chunks.mlpackage").is_dir()
    rows = [line for line in out.splitlines() if line.startswith(("reference, ", "Core AI runtime"))]
    assert len(rows) == 2 and all(line.endswith("same") for line in rows), out


def test_battery_and_bad_arguments_are_refused(tiny_chat_model, tmp_path, monkeypatch, capsys):
    from deploy import convert_ane_cmd
    from environment.power.state import PowerState

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    # A laptop on battery (a double for the machine's reading: this box has none).
    monkeypatch.setattr(convert_ane_cmd, "read_power", lambda settings: PowerState(source="battery", percent=80))
    parse = build_parser().parse_args
    args = parse(["convert-ane", "--model", str(tiny_chat_model), "--caches", "64", "--chunk", "16"])
    assert args.run(args) == 3 and "--on-battery" in capsys.readouterr().err
    assert not (tmp_path / "ane").exists()
    args = parse(["convert-ane", "--model", str(tiny_chat_model), "--caches", "32", "--chunk", "64"])
    assert args.run(args) == 2
    with pytest.raises(SystemExit):
        parse(["convert-ane", "--caches", "many"])


def test_serve_refuses_the_neural_engine_off_macos():
    if sys.platform == "darwin":
        pytest.skip("on macOS --prefill-backend ane is served")
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--prefill-backend", "ane"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "needs macOS" in done.stderr


def test_a_served_worker_runs_the_saved_program_without_the_weights(tiny_chat_model, converted):
    """The serving side (workers/prefill/ane/backend.py): a Core AI program as
    convert-ane saved it, opened from the architecture's numbers alone, runs a
    chunk as the NumPy reference does; the numbers read from a quantized model
    (as a Mac's GPU keeps it) are those of its expanded weights."""
    import mlx_lm
    import numpy as np

    from workers.models.loading import load_model
    from workers.models.store import resolve_model
    from workers.prefill.ane.coreai_runner import CoreAIChunkRunner
    from workers.prefill.ane.reference import run_chunk
    from workers.prefill.ane.weights import body_config, body_weights

    tmp_path, _ = converted
    model, _ = load_model(str(tiny_chat_model))
    weights = body_weights(model, 80)
    bucket = Bucket(16, 32)
    runner = CoreAIChunkRunner.from_asset(PackageStore(tmp_path, tiny_chat_model).path("coreai", "q16_s32.aimodel"),
                                          body_config(model), bucket, 80)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, weights.config.hidden)).astype(np.float16)
    cache = rng.standard_normal((weights.config.layers, weights.config.kv_heads, 32, weights.config.head_dim))
    k_cache, v_cache = cache.astype(np.float16), (cache * 0.5).astype(np.float16)
    pos = np.array([9], np.int32)
    got, want = runner(x, pos, k_cache, v_cache), run_chunk(weights, x, pos, k_cache, v_cache, precision="fp16acc")
    for a, b in zip(got, want):  # the fp16 build against the reference's fp16 accumulation: a few 1e-3
        assert np.abs(a.astype(np.float32) - b.astype(np.float32)).max() <= 2e-2 * np.abs(b).max()
    quantized, _ = mlx_lm.load(str(resolve_model(None)))
    expanded, _ = load_model(str(resolve_model(None)))
    assert body_config(quantized) == body_config(expanded)
