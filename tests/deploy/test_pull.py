"""`tandem pull`, `list`, `rm` and `serve --model REPO` against a stand-in
Hub on loopback (tests/support/hub_standin.py), through huggingface_hub
itself: only the files a model needs, a cut connection resumed, and bad input
(an unknown repo, a revision that does not exist, a disk too small, a
corrupted file) refused in one line, leaving nothing that later looks whole.

huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, at its
import: the tests in this process set its constants (`hub_env`); one test
runs `tandem pull` in a process of its own with the variables alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from deploy.cli import build_parser
from environment.hub_cache import cached, parse_ref
from environment.model_folder import ModelError
from tests.support.gguf_fixtures import T, write_tiny_llama
from tests.support.hub_standin import HubStandIn
from tests.support.tiny_models import TINY_LLAMA_CONFIG, make_tiny_llama
from workers.models.store import resolve_model

REPO = Path(__file__).resolve().parents[2]
TAKEN = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory, embedded_model_dir) -> dict[str, bytes]:
    """A tiny random llama with the embedded model's tokenizer, and files a pull leaves behind."""
    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny-model"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(embedded_model_dir / name, folder / name)
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert sorted(files) == TAKEN
    return {**files, "README.md": b"# tiny\n", "pytorch_model.bin": b"\0" * 512,
            "original/consolidated.safetensors": b"\0" * 512}


@pytest.fixture
def hub(model_files):
    with HubStandIn() as stand_in:
        stand_in.add_repo("tests/tiny", model_files)
        yield stand_in


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch):
    """huggingface_hub pointed at the stand-in, its cache (and Tandem's) in tmp_path."""
    from huggingface_hub import constants, file_download
    from huggingface_hub.utils import _cache_manager

    cache = tmp_path / "hf" / "hub"
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(_cache_manager, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda s: None))  # its 1 s before a resume
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "tandem"))
    return cache


def tandem(*argv: str) -> int:
    args = build_parser().parse_args(list(argv))
    return args.run(args)


def snapshot(cache: Path, repo: str = "tests/tiny") -> list[str]:
    """The files of the repo's snapshots, as `folder/path`."""
    root = cache / f"models--{repo.replace('/', '--')}" / "snapshots"
    return sorted(str(p.relative_to(root / p.relative_to(root).parts[0])) for p in root.rglob("*")
                  if p.is_file()) if root.is_dir() else []


def downloads(hub: HubStandIn, name: str) -> list[str | None]:
    """The Range header (None: the whole file) of each GET of `name`."""
    return [h.get("range") for m, p, h in hub.requests if m == "GET" and p.endswith(f"/resolve/{_commit(hub)}/{name}")]


def _commit(hub: HubStandIn) -> str:
    return hub.refs["tests/tiny"]["main"]


def test_pull_takes_what_a_model_needs_then_list_and_rm(hub, hub_env, model_files, capsys):
    assert tandem("pull", "tests/tiny") == 0
    out, err = capsys.readouterr()
    assert snapshot(hub_env) == TAKEN  # not the README, the PyTorch weights or original/
    assert "100%" in err  # huggingface_hub's progress bars
    folder = cached(parse_ref("tests/tiny"))
    assert (folder / "model.safetensors").read_bytes() == model_files["model.safetensors"]
    assert out.startswith("tests/tiny: chat model") and str(folder) in out

    assert tandem("list") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", "KIND", "SIZE", "FORMAT"]
    assert lines[1].split()[:2] == ["tests/tiny", "chat"] and lines[1].split()[-1] == "mlx"

    assert tandem("rm", "tests/tiny") == 0
    assert "tests/tiny: deleted" in capsys.readouterr().out
    assert not (hub_env / "models--tests--tiny").exists()
    assert tandem("list") == 0 and capsys.readouterr().out.startswith("no models")
    assert tandem("rm", "tests/tiny") == 2 and "not downloaded" in capsys.readouterr().err


def test_list_tells_vision_and_embedding_models(hub, hub_env, model_files, capsys):
    weights = {"model.safetensors": model_files["model.safetensors"], "tokenizer.json": b"{}"}
    hub.add_repo("tests/vlm", {**weights, "config.json": b'{"model_type": "qwen2_5_vl", "vision_config": {}}',
                               "preprocessor_config.json": b"{}"})
    hub.add_repo("tests/bert", {**weights, "config.json": b'{"architectures": ["BertModel"]}'})
    hub.add_repo("tests/st", {**weights, "config.json": b'{"architectures": ["Qwen3ForCausalLM"]}',
                              "modules.json": b"[]", "1_Pooling/config.json": b"{}"})
    for repo in ("tests/vlm", "tests/bert", "tests/st"):
        assert tandem("pull", repo) == 0
    assert snapshot(hub_env, "tests/vlm") == ["config.json", "model.safetensors", "preprocessor_config.json",
                                              "tokenizer.json"]
    assert "1_Pooling/config.json" in snapshot(hub_env, "tests/st")
    capsys.readouterr()
    assert tandem("list") == 0
    kinds = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert kinds == {"tests/bert": "embedding", "tests/st": "embedding", "tests/vlm": "vision"}


def test_a_cut_connection_resumes_where_it_stopped(hub, hub_env, model_files, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub writes what it read in chunks of 10 MB: smaller ones, so half the tiny file is kept
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 14)
    size = len(model_files["model.safetensors"])
    hub.cut_once("model.safetensors", size // 2)
    assert tandem("pull", "tests/tiny") == 0
    whole, resumed = downloads(hub, "model.safetensors")
    assert whole is None and 0 < int(resumed.removeprefix("bytes=").removesuffix("-")) <= size // 2
    assert (cached(parse_ref("tests/tiny")) / "model.safetensors").read_bytes() == model_files["model.safetensors"]


def test_unknown_repo_and_revision_are_refused_and_leave_nothing(hub, hub_env, model_files, capsys):
    assert tandem("pull", "tests/no-such-model") == 2
    assert capsys.readouterr().err.strip() == f"tandem pull: tests/no-such-model: no such model on {hub.url} (or a private one: set HF_TOKEN)"
    assert tandem("pull", "tests/tiny@no-such-branch") == 2
    assert capsys.readouterr().err.strip() == f"tandem pull: tests/tiny: no revision 'no-such-branch' on {hub.url}"
    assert snapshot(hub_env) == [] and not any(m == "GET" and "/resolve/" in p for m, p, _ in hub.requests)
    assert tandem("list") == 0 and capsys.readouterr().out.startswith("no models")

    hub.add_repo("tests/tiny", {**model_files, "config.json": b'{"model_type": "llama", "v": 1}'}, revision="v1")
    assert tandem("pull", "tests/tiny@v1") == 0
    assert cached(parse_ref("tests/tiny@v1")) is not None and cached(parse_ref("tests/tiny")) is None
    capsys.readouterr()
    assert tandem("list") == 0 and capsys.readouterr().out.splitlines()[1].startswith("tests/tiny@v1 ")


def test_a_corrupted_file_is_deleted_and_fetched_again(hub, hub_env, model_files, capsys):
    hub.corrupt("tests/tiny", "model.safetensors")
    assert tandem("pull", "tests/tiny") == 2
    err = capsys.readouterr().err
    assert "model.safetensors did not match the checksum the Hub lists and was deleted" in err
    assert snapshot(hub_env) == [f for f in TAKEN if f != "model.safetensors"]
    assert not any(p.stat().st_size == len(model_files["model.safetensors"])
                   for p in (hub_env / "models--tests--tiny" / "blobs").iterdir())
    assert cached(parse_ref("tests/tiny")) is None  # never taken for whole
    with pytest.raises(ModelError, match="not in the local Hugging Face cache"):
        resolve_model("tests/tiny")
    assert tandem("list") == 0
    assert "incomplete: no model.safetensors (`tandem pull tests/tiny` finishes it)" in capsys.readouterr().out

    hub.served.clear()
    hub.requests.clear()
    assert tandem("pull", "tests/tiny") == 0
    fetched = sorted(p.rsplit("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p)
    assert fetched == ["model.safetensors"]  # the files already whole are kept
    assert snapshot(hub_env) == TAKEN


def test_a_model_larger_than_the_free_disk_is_refused_before_a_byte(hub, hub_env, model_files, capsys):
    hub.add_repo("tests/huge", model_files)
    hub.claim_size("tests/huge", "model.safetensors", 1 << 60)
    assert tandem("pull", "tests/huge") == 2
    err = capsys.readouterr().err
    assert "tests/huge: needs 1048576.0 TiB of disk and" in err and "nothing was downloaded" in err
    assert snapshot(hub_env, "tests/huge") == [] and not any("/resolve/" in p for _, p, _ in hub.requests)


def test_offline_pulls_nothing_and_serves_what_is_cached(hub, hub_env, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert tandem("pull", "tests/tiny") == 2
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set"):
        resolve_model("tests/tiny", pull=True)
    assert hub.requests == []

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert tandem("pull", "tests/tiny") == 0
    hub.requests.clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("tests/tiny", pull=True) == cached(parse_ref("tests/tiny"))
    assert tandem("pull", "tests/tiny") == 0  # whole already: nothing to ask
    assert hub.requests == []


def test_serve_pulls_what_is_missing_and_the_folder_loads(hub, hub_env, monkeypatch, capsys):
    import mlx.core as mx
    from mlx_lm.models import llama

    from deploy import serve_cmd

    monkeypatch.setattr(serve_cmd, "setup_logging", lambda *a: None)  # keep pytest's log capture
    # --tensor-parallel 3 cannot split 4 heads: serve stops right after resolving its model
    assert tandem("serve", "--model", "tests/tiny", "--tensor-parallel", "3") == 2
    assert "--tensor-parallel 3 cannot split" in capsys.readouterr().err
    assert snapshot(hub_env) == TAKEN
    # mlx-lm's llama takes the pulled config and every weight (strict); the tokenizer is the embedded model's
    folder = resolve_model("tests/tiny")
    model = llama.Model(llama.ModelArgs.from_dict(json.loads((folder / "config.json").read_text())))
    model.load_weights(str(folder / "model.safetensors"), strict=True)
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, TINY_LLAMA_CONFIG["vocab_size"])


def test_a_gguf_repo_gives_the_file_asked_for_converted(hub, hub_env, tmp_path, capsys):
    for name, kind in (("tiny-F32.gguf", T.F32), ("tiny-F16.gguf", T.F16)):
        write_tiny_llama(tmp_path / name, default_type=kind)
    hub.add_repo("tests/tiny-GGUF", {p.name: p.read_bytes() for p in tmp_path.glob("*.gguf")})
    assert tandem("pull", "tests/tiny-GGUF") == 2
    assert "holds 2 GGUF files; name one: tests/tiny-GGUF:F16, tests/tiny-GGUF:F32" in capsys.readouterr().err
    assert tandem("pull", "tests/tiny-GGUF:f16") == 0
    folder = Path(capsys.readouterr().out.rsplit(" in ", 1)[1].strip())
    assert folder.parent == tmp_path / "tandem" / "models" and (folder / "config.json").is_file()
    assert snapshot(hub_env, "tests/tiny-GGUF") == ["tiny-F16.gguf"]
    assert resolve_model("tests/tiny-GGUF") == folder  # the repo's one file now
    assert tandem("list") == 0
    assert capsys.readouterr().out.splitlines()[1].split()[::4] == ["tests/tiny-GGUF", "gguf"]
    assert tandem("rm", "tests/tiny-GGUF") == 0
    assert not folder.exists()  # its conversion went with it


def test_the_cli_honours_the_environment(hub, tmp_path):
    """HF_ENDPOINT, HF_HOME and HF_TOKEN as huggingface_hub reads them, in a process of its own."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "hf_test_token",
           "TANDEM_CACHE_DIR": str(tmp_path / "tandem"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "pull", "tests/tiny"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert snapshot(tmp_path / "hf" / "hub") == TAKEN
    assert {h.get("authorization") for m, p, h in hub.requests if "/resolve/" in p} == {"Bearer hf_test_token"}
