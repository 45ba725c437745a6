"""A stand-in for the Hugging Face Hub on loopback, so that tests pull models
through huggingface_hub itself (pointed here by HF_ENDPOINT) without the
internet.

It answers the four calls a `snapshot_download` makes (huggingface_hub 2.4):
the repo's info at a revision (`GET /api/models/{repo}[/revision/{rev}]`:
its commit `sha` and `siblings`), its file tree (`GET /api/models/{repo}/tree
/{rev}`: sizes, git blob ids, LFS sha256), and each file (`HEAD`/`GET
/{repo}/resolve/{rev}/{path}`: `ETag` or `X-Linked-Etag`, `X-Linked-Size`,
`X-Repo-Commit`, `Range` for resumes). What does not exist is a 404 with the
Hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound).

Faults on demand: `corrupt(repo, path)` serves other bytes (of the same size)
than the listed sha256, and `cut_once(path, after)` closes the connection
once after `after` bytes of that file. `requests` records (method, path,
headers with lower-case names) of every call.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubStandIn:
    def __init__(self):
        self.refs: dict[str, dict[str, str]] = {}      # repo -> revision name -> commit
        self.commits: dict[str, dict[str, bytes]] = {}  # commit -> path -> bytes
        self.served: dict[tuple[str, str], bytes] = {}  # (repo, path) -> bytes sent instead (corrupt)
        self.cuts: dict[str, int] = {}                  # path -> bytes sent before the one cut
        self.listed_sizes: dict[tuple[str, str], int] = {}  # (repo, path) -> size the tree claims
        self.requests: list[tuple[str, str, dict]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "HubStandIn":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_repo(self, repo: str, files: dict[str, bytes], revision: str = "main") -> str:
        """Publish `files` as `repo` at `revision`; returns the commit id."""
        h = hashlib.sha1(repo.encode())
        for path in sorted(files):
            h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        commit = h.hexdigest()
        self.commits[commit] = dict(files)
        self.refs.setdefault(repo, {})[revision] = commit
        return commit

    def corrupt(self, repo: str, path: str) -> None:
        good = self.commits[self.refs[repo]["main"]][path]
        self.served[(repo, path)] = bytes(b ^ 0xFF for b in good[:64]) + good[64:]

    def claim_size(self, repo: str, path: str, size: int) -> None:
        """The tree lists `path` at `size` bytes (a model too large for the disk)."""
        self.listed_sizes[(repo, path)] = size

    def cut_once(self, path: str, after: int) -> None:
        self.cuts[path] = after

    # what the handler asks

    def commit_of(self, repo: str, revision: str) -> tuple[str | None, str | None]:
        """(commit, None) or (None, the X-Error-Code)."""
        if repo not in self.refs:
            return None, "RepoNotFound"
        if revision in self.commits and revision in self.refs[repo].values():
            return revision, None
        commit = self.refs[repo].get(revision)
        return (commit, None) if commit else (None, "RevisionNotFound")

    def tree(self, repo: str, commit: str) -> list[dict]:
        out = []
        for path, data in sorted(self.commits[commit].items()):
            size = self.listed_sizes.get((repo, path), len(data))
            entry = {"type": "file", "path": path, "size": size, "oid": git_blob_id(data)}
            if path.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": size, "pointerSize": 134}
            out.append(entry)
        return out


def _handler(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            with hub.lock:
                hub.requests.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(f"{parts[2]}/{parts[3]}", parts[4:])
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), body)
            else:
                self._error(404, "RepoNotFound", f"no route {path}")

        def _api(self, repo: str, rest: list[str]) -> None:
            kind, revision = (rest[0], "/".join(rest[1:])) if rest else ("revision", "main")
            commit, error = hub.commit_of(repo, revision or "main")
            if error:
                return self._error(404, error, f"{repo}@{revision}: {error}")
            tree = hub.tree(repo, commit)
            if kind == "tree":
                return self._json(tree)
            self._json({"id": repo, "modelId": repo, "sha": commit, "private": False,
                        "siblings": [{"rfilename": e["path"]} for e in tree]})

        def _file(self, repo: str, revision: str, path: str, body: bool) -> None:
            commit, error = hub.commit_of(repo, revision)
            if error:
                return self._error(404, error, f"{repo}@{revision}: {error}")
            files = hub.commits[commit]
            if path not in files:
                return self._error(404, "EntryNotFound", f"{path} not in {repo}")
            data = hub.served.get((repo, path), files[path])
            entry = next(e for e in hub.tree(repo, commit) if e["path"] == path)
            start = 0
            if rng := self.headers.get("Range"):
                start = int(rng.removeprefix("bytes=").split("-")[0])
            self.send_response(206 if start else 200)
            if "lfs" in entry:
                self.send_header("X-Linked-Etag", f'"{entry["lfs"]["oid"]}"')
                self.send_header("X-Linked-Size", str(entry["size"]))
            self.send_header("ETag", f'"{entry["oid"]}"')
            self.send_header("X-Repo-Commit", commit)
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if not body:
                return
            with hub.lock:
                cut = hub.cuts.pop(path, None)
            if cut is not None and cut > start:
                self.wfile.write(data[start:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)  # mid-file: the client sees a body cut short
                return
            self.wfile.write(data[start:])

        def _json(self, obj) -> None:
            raw = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _error(self, status: int, code: str, message: str) -> None:
            raw = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)

    return Handler
