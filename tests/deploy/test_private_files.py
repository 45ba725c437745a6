"""Private files are 0600 whatever the umask (issue 42, finding 6): the
service files `tandem service install` writes (they hold --api-key values and
Environment= entries such as HF_TOKEN), written whole and 0600 from their
first byte, and the key files of `tandem keys`, in 0700 folders. The service
manager is a recording double (no launchctl or systemctl runs)."""

from __future__ import annotations

import os
import stat
import subprocess
from contextlib import contextmanager

import pytest

from deploy import cli
from deploy.service import service_cmd
from deploy.service.manager import Manager

UMASKS = [0o000, 0o022, 0o077]


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return tmp_path


def install(*argv: str) -> list:
    """`tandem service install ...` with every launchctl/systemctl call answered 0; the files it wrote."""
    args, extra = cli.build_parser().parse_known_args(["service", "install", *argv])
    args.extra = extra
    manager = Manager(runner=lambda a, **kw: subprocess.CompletedProcess(a, 0, "", ""),
                      which=lambda tool: f"/usr/bin/{tool}", echo=lambda s: None)
    assert service_cmd.run(args, manager=manager) == 0
    service = service_cmd.make_service(service_cmd.platform_kind(args.kind), None, manager, os.environ["HOME"])
    return service.installed()


@pytest.mark.parametrize("mask", UMASKS, ids=oct)
@pytest.mark.parametrize("kind", [["--launchd"], ["--systemd", "--socket-activation"]], ids=["launchd", "systemd"])
def test_service_files_are_0600_whatever_the_umask(home, kind, mask):
    secret = ["--api-key", "sk-secret", "--env", "HF_TOKEN=hf_secret"]
    with umask(mask):
        written = install(*kind, *secret[2:], "--", *secret[:2])
    assert len(written) == (1 if kind == ["--launchd"] else 2)
    for path in written:
        assert mode(path) == 0o600, (path, oct(mode(path)))
        assert not [p for p in os.listdir(os.path.dirname(path)) if p.startswith(".")]  # no half-written copy left
    text = b"".join(open(p, "rb").read() for p in written)
    assert b"sk-secret" in text and b"hf_secret" in text


def test_a_reinstall_makes_an_older_world_readable_file_private(home):
    with umask(0o022):
        (path,) = install("--launchd")
        os.chmod(path, 0o644)  # as an older install left it
        install("--launchd", "--port", "8131")
    assert mode(path) == 0o600 and b"8131" in open(path, "rb").read()


@pytest.mark.parametrize("mask", [0o000, 0o077], ids=oct)
def test_key_files_are_0600_in_0700_folders_whatever_the_umask(tmp_path, capsys, mask):
    out = tmp_path / "keys"
    with umask(mask):
        for names in (["a"], ["b"]):  # the second run keeps the router's pair, adds a worker
            args = cli.build_parser().parse_args(["keys", "--out", str(out), *sum((["--name", n] for n in names), [])])
            assert args.run(args) == 0
    capsys.readouterr()
    folders = [out] + [out / d for d in os.listdir(out)]
    assert sorted(os.listdir(out)) == ["a", "b", "router"]
    assert {oct(mode(f)) for f in folders} == {oct(0o700)}
    files = [f / name for f in folders[1:] for name in os.listdir(f)]
    assert len(files) == 8 and {oct(mode(f)) for f in files} == {oct(0o600)}, [(str(f), oct(mode(f))) for f in files]
