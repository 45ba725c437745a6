"""environment/hub_pull.py's progress reports (what /api/pull streams),
against the stand-in Hub on loopback through huggingface_hub itself."""

from __future__ import annotations

import hashlib
import types

import pytest

from environment.hub_cache import parse_ref
from environment.hub_pull import FileProgress, pull
from tests.support.hub_standin import HubStandIn, git_blob_id

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": bytes(range(256)) * 64,
         "tokenizer.json": b"{}", "README.md": b"# not taken\n"}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from huggingface_hub import constants, file_download
    from huggingface_hub.utils import _cache_manager

    with HubStandIn() as stand_in:
        stand_in.add_repo("tests/progress", FILES)
        cache = tmp_path / "hf" / "hub"
        monkeypatch.setattr(constants, "ENDPOINT", stand_in.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            stand_in.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        monkeypatch.setattr(_cache_manager, "HF_HUB_CACHE", str(cache))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda s: None))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield stand_in


def test_a_pull_reports_listing_each_file_landing_and_verifying(hub, capsys):
    events: list[tuple[str, list[FileProgress]]] = []
    folder = pull(parse_ref("tests/progress"), lambda stage, files: events.append((stage, files)))
    assert (folder / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    stages = [stage for stage, _ in events]
    assert stages[0] == "listing" and stages[-1] == "verifying" and "files" in stages
    last = [files for stage, files in events if stage == "files"][-1]
    assert {f.path: (f.digest, f.sha256, f.total, f.completed) for f in last} == {
        "config.json": (git_blob_id(FILES["config.json"]), False, len(FILES["config.json"]), len(FILES["config.json"])),
        "model.safetensors": (hashlib.sha256(FILES["model.safetensors"]).hexdigest(), True, 16384, 16384),
        "tokenizer.json": (git_blob_id(b"{}"), False, 2, 2),
    }
    assert "Fetching" not in capsys.readouterr().err  # huggingface_hub's bars silent under a progress callback

    again: list[str] = []
    pull(parse_ref("tests/progress"), lambda stage, files: again.append((stage, [f.completed == f.total for f in files])))
    assert ("files", [True, True, True]) in again  # already whole: reported whole at once
