"""GGUF → MLX folder: numerical fidelity, file validation, atomicity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx_lm.models import llama

from tests.support.gguf_fixtures import write_minimal_gguf, write_tiny_llama
from workers.models import gguf_convert
from workers.models.gguf_convert import convert_gguf
from workers.models.gguf_header import read_header
from workers.models.loading import load_model
from environment.model_folder import ModelError
from workers.models.store import embedded_gguf

REPO = Path(__file__).resolve().parents[3]

# Every weight kind the converter takes, in one file: 4-bit attention (Q4_0)
# and MLP (Q4_1), an 8-bit embedding (Q8_0) and a float16 untied lm_head.
MIXED = {
    **{f"blk.{n}.{k}.weight": T.Q4_0 for n in range(2) for k in ("attn_q", "attn_k", "attn_v", "attn_output")},
    **{f"blk.{n}.{k}.weight": T.Q4_1 for n in range(2) for k in ("ffn_gate", "ffn_up", "ffn_down")},
    "token_embd.weight": T.Q8_0,
    "output.weight": T.F16,
}
TOKENS = mx.array([[5, 17, 40, 99, 3, 200, 250, 7, 8, 9, 120, 33]])


def reference_logits(cfg: dict, weights: dict) -> mx.array:
    """The same weights in Hugging Face layout, run with rotate-half rope:
    the model the GGUF was made from. Matching it shows the converter's
    rope_traditional choice undoes llama.cpp's Q/K permutation."""
    model = llama.Model(llama.ModelArgs(model_type="llama", rope_traditional=False, **cfg))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model(TOKENS)


@pytest.mark.parametrize(
    "variant, kwargs",
    [("f32-tied", {}), ("f16", {"default_type": T.F16}), ("mixed-quant-untied", {"types": MIXED, "tied": False})],
)
def test_tiny_model_matches_reference(tmp_path, variant, kwargs):
    cfg, weights = write_tiny_llama(tmp_path / "tiny.gguf", **kwargs)
    folder = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    want = reference_logits(cfg, weights)

    model, _ = load_model(folder, dequantize=True)  # what the CPU backend runs
    assert model(TOKENS).dtype == mx.float32
    np.testing.assert_allclose(np.array(model(TOKENS)), np.array(want), atol=1e-4, rtol=1e-4)

    # Kept quantized (the GPU path), activations run in float16: close, not equal.
    model, _ = load_model(folder, dequantize=False)
    got = model(TOKENS).astype(mx.float32)
    assert float(mx.abs(got - want).max()) < 0.02 * float(mx.abs(want).max()) + 0.05


def test_permutation_is_what_makes_it_match(tmp_path):
    """Guard against a vacuous comparison: the HF-layout weights under
    traditional rope are a different model."""
    cfg, weights = write_tiny_llama(tmp_path / "tiny.gguf")
    wrong = llama.Model(llama.ModelArgs(model_type="llama", rope_traditional=True, **cfg))
    wrong.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    assert float(mx.abs(wrong(TOKENS) - reference_logits(cfg, weights)).max()) > 0.1


def test_config_quantization_block(tmp_path):
    write_tiny_llama(tmp_path / "tiny.gguf", types=MIXED, tied=False)
    cfg = json.loads((convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out") / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["rope_traditional"] is True
    assert cfg["tie_word_embeddings"] is False
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["max_position_embeddings"]) == (1, 2, 256)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_embedded_header_reads_fast():
    # CPU time of this thread, not wall time, so a loaded box does not count:
    # ~0.07 s here, against ~3.6 s for the gguf package's reader, which
    # builds every array (49152 token strings).
    t = time.thread_time()
    h = read_header(embedded_gguf())
    assert time.thread_time() - t < 1.0
    assert h.metadata["general.architecture"] == "llama"
    assert h.metadata["tokenizer.ggml.tokens"] == 49152  # arrays are kept as their length
    assert {t.type_name for t in h.tensors} == {"Q4_1", "Q8_0", "F32"}


# ------------------------------------------------------------------ errors


def assert_model_error(path: Path, *words: str):
    with pytest.raises(ModelError) as e:
        convert_gguf(path, path.parent / "out")
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    assert not (path.parent / "out").exists()
    return msg


def test_truncated_file(tmp_path):
    write_tiny_llama(tmp_path / "full.gguf")
    data = (tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    assert_model_error(tmp_path / "cut.gguf", "truncated")
    (tmp_path / "cut_header.gguf").write_bytes(data[:300])
    assert_model_error(tmp_path / "cut_header.gguf", "truncated or corrupt")


def test_garbage_file(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "junk.gguf").write_bytes(rng.bytes(4096))
    assert_model_error(tmp_path / "junk.gguf", "not a GGUF file")
    # Right magic and version, garbage after: the header parser must not crash.
    (tmp_path / "junk2.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + rng.bytes(4096))
    assert_model_error(tmp_path / "junk2.gguf", "corrupt")
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert_model_error(tmp_path / "empty.gguf", "not a GGUF file")


def test_unsupported_architecture(tmp_path):
    write_tiny_llama(tmp_path / "q.gguf", arch="qwen2")
    assert_model_error(tmp_path / "q.gguf", "unsupported architecture 'qwen2'")


def test_unsupported_tensor_type(tmp_path):
    rng = np.random.default_rng(2)
    k_quant = np.frombuffer(rng.bytes(8 * 210), dtype=np.uint8).reshape(8, 210)  # 8 rows of 256 Q6_K values
    write_minimal_gguf(tmp_path / "k.gguf", tensors={"token_embd.weight": (k_quant, T.Q6_K)})
    assert_model_error(tmp_path / "k.gguf", "unsupported tensor type Q6_K", "Q4_0")


def test_sentencepiece_tokenizer_rejected(tmp_path):
    write_tiny_llama(tmp_path / "spm.gguf", tokenizer_model="llama")
    assert_model_error(tmp_path / "spm.gguf", "SentencePiece")


def test_unknown_pre_tokenizer_rejected(tmp_path):
    write_tiny_llama(tmp_path / "pre.gguf", pre="deepseek-coder")
    assert_model_error(tmp_path / "pre.gguf", "pre-tokenizer 'deepseek-coder'")


def test_missing_tensor(tmp_path):
    write_tiny_llama(tmp_path / "m.gguf", drop=("blk.1.ffn_down.weight",))
    assert_model_error(tmp_path / "m.gguf", "missing tensors blk.1.ffn_down.weight")


def test_missing_file(tmp_path):
    assert_model_error(tmp_path / "absent.gguf", "no such file")


# ------------------------------------------------------------------ atomicity


def _convert_in_subprocess(src: Path, dst: Path) -> subprocess.Popen:
    code = "import sys; from workers.models.gguf_convert import convert_gguf; convert_gguf(sys.argv[1], sys.argv[2])"
    return subprocess.Popen([sys.executable, "-c", code, str(src), str(dst)], cwd=REPO)


def test_two_processes_converting_at_once_leave_one_good_folder(tmp_path):
    dst = tmp_path / "models" / "smollm"
    procs = [_convert_in_subprocess(embedded_gguf(), dst) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert os.listdir(dst.parent) == ["smollm"]  # no temporary folder left behind
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization"]["model.embed_tokens"]["bits"] == 8
    assert set(os.listdir(dst)) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert mx.load(str(dst / "model.safetensors"))["model.embed_tokens.weight"].shape == (49152, 144)


def test_losing_the_race_keeps_the_winner(tmp_path, monkeypatch):
    """Deterministic version of the race: while our conversion writes its
    temporary folder, another conversion finishes into the destination."""
    write_tiny_llama(tmp_path / "tiny.gguf")
    dst = tmp_path / "out"
    real_write = gguf_convert._write_folder
    winner = {}

    def write_then_lose(header, folder):
        real_write(header, folder)
        monkeypatch.setattr(gguf_convert, "_write_folder", real_write)
        convert_gguf(header.path, dst)  # the other process, finishing first
        winner["inode"] = (dst / "config.json").stat().st_ino

    monkeypatch.setattr(gguf_convert, "_write_folder", write_then_lose)
    assert convert_gguf(tmp_path / "tiny.gguf", dst) == dst
    assert (dst / "config.json").stat().st_ino == winner["inode"]
    assert sorted(os.listdir(tmp_path)) == ["out", "tiny.gguf"]


def test_killed_conversion_leaves_no_destination(tmp_path):
    dst = tmp_path / "models" / "smollm"
    proc = _convert_in_subprocess(embedded_gguf(), dst)
    deadline = time.monotonic() + 60
    partial = []
    while not partial and proc.poll() is None and time.monotonic() < deadline:
        partial = list(dst.parent.glob(".smollm.partial-*")) if dst.parent.exists() else []
        time.sleep(0.005)
    assert partial, "the conversion finished before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not dst.exists()
    # The next conversion cleans up the dead process's leftovers and succeeds.
    convert_gguf(embedded_gguf(), dst)
    assert os.listdir(dst.parent) == ["smollm"]
    assert (dst / "config.json").is_file()
