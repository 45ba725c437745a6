"""`tandem cache clear`: deletes the disk tier's KV block files (prompts can
be read back from them), and nothing else: a folder holding anything the
tier would not have written (a mistyped --cache-dir: the home folder, the
model store) is refused whole, before a single file goes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache_service.block_file import HEADER
from cache_service.disk_tier import DiskTier
from deploy.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
B = 1024


def _tier(root: Path, blocks: int = 3) -> list[str]:
    disk = DiskTier(str(root), 1 << 20)
    hashes = [hashlib.sha256(b"block %d" % i).digest() for i in range(blocks)]
    for h in hashes:
        assert disk.write(h, os.urandom(B))
    disk.close()
    return [disk.path(h) for h in hashes]


def clear(*argv: str) -> int:
    args = build_parser().parse_args(["cache", "clear", *argv])
    return args.run(args)


def _files(root: Path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def test_clear_deletes_the_block_files_and_says_so(tmp_path):
    """As a user runs it: the `tandem` command line, in its own process."""
    root = tmp_path / "kv"
    paths = _tier(root)
    tmp = paths[0] + ".123.456.tmp"  # a writer's leftover
    Path(tmp).write_bytes(b"partial")
    run = subprocess.run([sys.executable, "-m", "deploy.cli", "cache", "clear", "--cache-dir", str(root)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "deleted 4 KV block files" in run.stdout and str(root) in run.stdout
    assert root.is_dir() and os.listdir(root) == []  # the folder stays, emptied
    assert clear("--cache-dir", str(root)) == 0  # again: nothing left, not an error


def test_clear_uses_the_default_cache_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "home-cache"))
    paths = _tier(tmp_path / "home-cache" / "kv", blocks=2)
    assert clear() == 0
    assert not any(os.path.exists(p) for p in paths)
    assert f"deleted 2 KV block files ({2 * (HEADER.size + B) / 1024:.1f} KiB)" in capsys.readouterr().out


@pytest.mark.parametrize("foreign", ["notes.txt", "models/", "ab/readme.md", "ab/ab" + "0" * 62 + ".kvb", "zz/"])
def test_a_folder_that_is_not_only_a_kv_cache_is_refused_whole(tmp_path, capsys, foreign):
    """Foreign: a file or folder at the top, a file of another name, a link
    under a block's name (it may point anywhere), a folder not named by a
    hex byte."""
    root = tmp_path / "kv"
    paths = _tier(root)
    sub = Path(paths[0]).parent.name
    target = root / foreign.replace("ab", sub)
    if foreign.endswith("/"):
        target.mkdir()
    elif foreign.endswith(".kvb"):
        target.symlink_to(tmp_path / "elsewhere")
    else:
        target.write_text("precious")
    before = _files(root)
    assert clear("--cache-dir", str(root)) == 1
    err = capsys.readouterr().err
    assert "nothing deleted" in err and "does not look like a Tandem KV cache folder" in err
    assert _files(root) == before  # not one file gone


def test_the_parent_of_the_kv_folder_is_refused(tmp_path, capsys):
    paths = _tier(tmp_path / "tandem" / "kv")
    assert clear("--cache-dir", str(tmp_path / "tandem")) == 1
    assert "it holds 'kv'" in capsys.readouterr().err
    assert all(os.path.exists(p) for p in paths)


def test_a_missing_folder_or_a_file_is_not_cleared(tmp_path, capsys):
    assert clear("--cache-dir", str(tmp_path / "absent")) == 0
    assert "no KV block files" in capsys.readouterr().out
    (tmp_path / "file").write_text("x")
    assert clear("--cache-dir", str(tmp_path / "file")) == 1
    assert "is not a folder" in capsys.readouterr().err
