"""Pull a model from the Hugging Face Hub into huggingface_hub's cache.

huggingface_hub does the transfer (`snapshot_download`, its progress bars,
its retries) and reads its own settings from the environment: HF_ENDPOINT,
HF_TOKEN, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE. Nothing here passes an
endpoint, a token or a cache folder. Only the files a model needs are taken
(environment/hub_cache.py, select_files).

Nothing half-written may later look whole:
- huggingface_hub writes each file under a temporary name and links it into
  the snapshot only once complete; a connection cut mid-file resumes there
  (a Range request), and a pull run again fetches only the files missing;
- the free disk space is checked against the listed sizes before any byte
  is fetched;
- each file fetched is checked against the Hub's listing (the LFS sha256, or
  a small file's git blob id): huggingface_hub checks sizes only. One that
  differs is deleted, so the snapshot lacks it and is never taken as whole
  (hub_cache.cached).

Progress: `pull(ref, progress)` reports each file's bytes as they land in
the cache (for /api/pull's stream, router/ollama/pull.py); the terminal's
bars stay huggingface_hub's own.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from environment.hub_cache import HubRef, cached, repo_folder, select_files, size_text
from environment.model_folder import ModelError


PROGRESS_EVERY_S = 0.25  # how often a watched pull reports its files' bytes


@dataclass(frozen=True)
class FileProgress:
    """One file of a pull: `digest` names its blob in the cache (the LFS
    sha256, or a small file's git blob id), `sha256` says which it is."""

    path: str
    digest: str
    sha256: bool
    total: int
    completed: int


# progress(stage, files): stage "listing" (asking the Hub), "files" (bytes
# landed so far, every PROGRESS_EVERY_S while they change), "verifying"
# (checksums); files empty but for "files".
Progress = Callable[[str, list[FileProgress]], None]


def pull(ref: HubRef, progress: Progress | None = None) -> Path:
    """Download what `ref` lacks; returns its snapshot folder, or its .gguf
    file. Raises ModelError with one line saying what went wrong. With
    `progress`, huggingface_hub's bars are silent and `progress` is told
    (from this thread and a watcher's) what has landed."""
    from huggingface_hub import HfApi, is_offline_mode, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    if is_offline_mode():  # nothing to ask the Hub: what the cache holds, if whole
        local = cached(ref)
        if local is None:
            raise ModelError(f"{ref}: not downloaded (or not all of it), and HF_HUB_OFFLINE is set (unset it to pull)")
        return local
    api = HfApi()
    report = progress or (lambda stage, files: None)
    try:
        report("listing", [])
        revision = api.resolve_revision(ref.repo, revision=ref.revision)
        listing = [f for f in api.list_repo_tree(ref.repo, revision=revision.resolved, recursive=True)
                   if isinstance(f, RepoFile)]
        wanted = select_files([f.path for f in listing], ref)
        files = [f for f in listing if f.path in wanted]
        blobs = repo_folder(ref.repo) / "blobs"
        _check_space(ref, files, blobs)
        before = set(os.listdir(blobs)) if blobs.is_dir() else set()
        with _Watcher(files, blobs, progress):
            folder = Path(snapshot_download(ref.repo, revision=revision, allow_patterns=[glob.escape(p) for p in wanted],
                                            tqdm_class=_silent_tqdm() if progress else None))
    except ModelError:
        raise
    except Exception as exc:  # huggingface_hub's errors and the network's, said in one line
        raise hub_error(exc, ref) from None
    report("verifying", [])
    _verify(ref, folder, files, before)
    return folder / wanted[0] if wanted[0].lower().endswith(".gguf") else folder


def _blob_name(f) -> str:
    """huggingface_hub names a blob by its ETag: the sha256 of an LFS file, the git blob id of another."""
    return f.lfs.sha256 if f.lfs else f.blob_id


class _Watcher:
    """Reports each file's bytes in the cache while a download runs:
    huggingface_hub writes a blob as `<name>.incomplete` and renames it once
    whole. A thread of its own, stopped (and joined, with a deadline) when
    the download ends, with one last report."""

    def __init__(self, files: list, blobs: Path, progress: Progress | None):
        self.files, self.blobs, self.progress = files, blobs, progress
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pull-progress", daemon=True)
        self.last: list[FileProgress] | None = None

    def __enter__(self) -> "_Watcher":
        if self.progress is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.done.set()
            self.thread.join(5.0)
            if exc[0] is None:
                self._report()

    def _run(self) -> None:
        while not self.done.wait(PROGRESS_EVERY_S):
            self._report()

    def _report(self) -> None:
        now = [FileProgress(f.path, _blob_name(f), f.lfs is not None, f.size, self._landed(f)) for f in self.files]
        if now != self.last:
            self.last = now
            self.progress("files", now)

    def _landed(self, f) -> int:
        blob = self.blobs / _blob_name(f)
        try:
            return blob.stat().st_size if blob.exists() else (self.blobs / (blob.name + ".incomplete")).stat().st_size
        except OSError:
            return 0


def _silent_tqdm():
    """huggingface_hub's bars, drawn nowhere (a server's log is no terminal)."""
    from huggingface_hub.utils import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _check_space(ref: HubRef, files: list, blobs: Path) -> None:
    need = sum(f.size for f in files if not (blobs / _blob_name(f)).exists())
    where = next(p for p in (blobs, *blobs.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if need > free:
        raise ModelError(f"{ref}: needs {size_text(need)} of disk and {where} has {size_text(free)} free; "
                         "nothing was downloaded (free some space, or point HF_HOME elsewhere)")


def _verify(ref: HubRef, folder: Path, files: list, before: set[str]) -> None:
    """Check each file this pull fetched against the Hub's listing; delete
    those that differ (the snapshot's link and the blob) and raise."""
    bad = []
    for f in files:
        link = folder / f.path
        blob = Path(os.path.realpath(link))
        if blob.name in before:  # in the cache before: checked when fetched, or another tool's
            continue
        if not _matches(blob, f):
            bad.append(f.path)
            link.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
    if bad:
        raise ModelError(f"{ref}: {', '.join(bad)} did not match the checksum the Hub lists and "
                         f"{'was' if len(bad) == 1 else 'were'} deleted (a corrupted transfer or mirror); pull again")


def _matches(blob: Path, f) -> bool:
    if f.lfs:
        h, want = hashlib.sha256(), f.lfs.sha256
    else:  # git's blob id: sha1 over "blob <size>\0" and the bytes
        h, want = hashlib.sha1(b"blob %d\0" % blob.stat().st_size), f.blob_id
    with open(blob, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest() == want


def hub_error(exc: Exception, ref: HubRef) -> ModelError:
    """One line for the user, naming the repo and what went wrong."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError, RevisionResolutionError)

    hub = constants.ENDPOINT
    if isinstance(exc, GatedRepoError):
        return ModelError(f"{ref.repo}: a gated model: accept its conditions on {hub}, then set HF_TOKEN")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelError(f"{ref.repo}: no such model on {hub} (or a private one: set HF_TOKEN)")
    if isinstance(exc, RevisionNotFoundError):
        return ModelError(f"{ref.repo}: no revision {ref.revision!r} on {hub}")
    if isinstance(exc, OfflineModeIsEnabled):
        return ModelError(f"{ref}: not downloaded (or not all of it), and HF_HUB_OFFLINE is set (unset it to pull)")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ModelError(f"{ref}: the disk filled while downloading; the unfinished file was deleted and "
                          "the finished ones kept: free some space and pull again")
    if isinstance(exc, RevisionResolutionError) and exc.__cause__ is not None:
        exc = exc.__cause__  # the Hub unreachable, and nothing cached to fall back on
    first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    if type(exc).__module__.split(".")[0] in ("httpx", "httpx2"):  # huggingface_hub's transport: no answer at all
        return ModelError(f"{ref}: cannot reach {hub} ({type(exc).__name__}: {first})")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, HfHubHTTPError) and status:
        return ModelError(f"{ref}: {hub} answered {status}: {first}")
    return ModelError(f"{ref}: could not download from {hub} ({type(exc).__name__}: {first})")

