"""Where converted prefill programs live: under the cache folder, one folder
per model fingerprint (workers/kv/block_hash.py: the weights, not the
folder's path, name it), one program per format and bucket, and a manifest
that says what was converted, by which tool versions, from which buckets.

    <cache>/ane/<fingerprint[:32]>/manifest.json
    <cache>/ane/<fingerprint[:32]>/coreml/chunks.mlpackage   (a function per bucket, one copy of the weights)
    <cache>/ane/<fingerprint[:32]>/coreai/q64_s512.aimodel   (a program per bucket)

A program is written to a temporary name and renamed into place, so a
converter killed half-way leaves nothing a worker would load.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from workers.kv.block_hash import model_fingerprint
from workers.prefill.ane.contract import Bucket

FORMATS = ("coreml", "coreai")
MANIFEST = "manifest.json"


class PackageStore:
    def __init__(self, root: str | os.PathLike, model_dir: str | os.PathLike):
        self.model_dir = str(model_dir)
        self.folder = Path(root) / "ane" / model_fingerprint(model_dir).hex()[:32]

    def path(self, fmt: str, name: str) -> Path:
        """A program's path: `name` with its suffix ("chunks.mlpackage", "q64_s512.aimodel")."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown program format {fmt!r}; one of {', '.join(FORMATS)}")
        return self.folder / fmt / name

    def buckets(self, fmt: str) -> list[Bucket]:
        """The buckets the manifest lists as converted for `fmt` whose programs are present."""
        try:
            entry = json.loads((self.folder / MANIFEST).read_text())["formats"][fmt]
            found = [(Bucket(int(q), int(s)), str(name)) for q, s, name in entry["buckets"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return [b for b, name in found if self.path(fmt, name).exists()]

    def put(self, fmt: str, name: str, write) -> Path:
        """`write(path)` writes the program to a temporary path; renamed into place."""
        final = self.path(fmt, name)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".tmp-{os.getpid()}-{final.name}")  # the suffix kept: writers check it
        _remove(tmp)
        write(tmp)
        _remove(final)
        os.replace(tmp, final)
        return final

    def record(self, fmt: str, programs: list[tuple[Bucket, str]], versions: dict) -> None:
        """The manifest entry for `fmt`: (bucket, program name) each (other formats' entries kept)."""
        path = self.folder / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):
            manifest = {}
        manifest.setdefault("formats", {})[fmt] = {
            "buckets": [[b.chunk, b.cache, name] for b, name in programs], "versions": versions}
        manifest["model_dir"] = self.model_dir
        tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
