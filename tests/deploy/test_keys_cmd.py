"""`tandem keys` (deploy/keys_cmd.py) and the remote-worker flags of
`tandem serve` and `tandem worker`: what is written where, with which
modes, what is refused, and every bad flag an exit 2 with a clear message
before anything starts."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from deploy.cli import build_parser
from protos import transport


def tandem(capsys, *argv: str) -> tuple[int, str, str]:
    """Run a `tandem` subcommand in this process (the failures tested here
    return before starting anything): (exit code, stdout, stderr)."""
    args = build_parser().parse_args(list(argv))
    code = args.run(args)
    out, err = capsys.readouterr()
    return code, out, err


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def made(tmp_path, capsys):
    out = tmp_path / "keys"
    code, text, _ = tandem(capsys, "keys", "--out", str(out))
    assert code == 0
    return out, text


def test_keys_make_the_router_and_worker_folders_with_private_secrets(made):
    out, text = made
    router, worker = out / "router", out / "worker"
    assert sorted(os.listdir(router)) == ["server.key", "server.key_secret", "worker.key"]
    assert sorted(os.listdir(worker)) == ["server.key", "worker.key_secret"]
    for secret in (router / "server.key_secret", worker / "worker.key_secret"):
        assert mode(secret) == 0o600
    assert mode(router) == mode(worker) == 0o700
    server_public, _, allowed = transport.router_keys(str(router))
    public, _, router_public = transport.worker_keys(str(worker))
    assert allowed == {public: "worker"} and router_public == server_public
    assert f"--worker-keys {router}" in text and f"--keys {worker}" in text  # what to copy where, and run


def test_keys_refuse_to_overwrite_without_force_and_keep_the_router_pair(made, capsys):
    out, _ = made
    before = (out / "worker" / "worker.key_secret").read_bytes()
    router_secret = (out / "router" / "server.key_secret").read_bytes()
    code, _, err = tandem(capsys, "keys", "--out", str(out))
    assert code == 2 and "--force" in err and str(out / "worker") in err
    assert (out / "worker" / "worker.key_secret").read_bytes() == before
    code, _, _ = tandem(capsys, "keys", "--out", str(out), "--force")
    assert code == 0 and (out / "worker" / "worker.key_secret").read_bytes() != before
    assert (out / "router" / "server.key_secret").read_bytes() == router_secret
    code, text, _ = tandem(capsys, "keys", "--out", str(out), "--name", "mac2")  # one more worker
    assert code == 0 and "kept the router's key pair" in text
    assert sorted(transport.router_keys(str(out / "router"))[2].values()) == ["mac2", "worker"]
    assert transport.worker_keys(str(out / "mac2"))[2] == transport.router_keys(str(out / "router"))[0]


@pytest.mark.parametrize("name", ["router", "server", "../x", "a b", ""])
def test_keys_refuse_bad_names(tmp_path, capsys, name):
    code, _, err = tandem(capsys, "keys", "--out", str(tmp_path / "k"), "--name", name)
    assert code == 2 and "--name" in err and not (tmp_path / "k").exists()


def test_serve_refuses_bad_remote_worker_flags(made, tmp_path, capsys):
    out, _ = made
    router = str(out / "router")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--worker-listen", "tcp://127.0.0.1:5555"], "--worker-listen needs --worker-keys"),
        (["--worker-keys", router], "--worker-keys needs --worker-listen"),
        (["--worker-listen", "ipc:///tmp/x.sock", "--worker-keys", router], "expected tcp://HOST:PORT"),
        (["--worker-listen", "tcp://127.0.0.1:99999", "--worker-keys", router], "expected tcp://HOST:PORT"),
        (["--worker-listen", "tcp://127.0.0.1:5555", "--worker-keys", str(empty)], "server.key_secret"),
        (["--worker-listen", "tcp://127.0.0.1:5555", "--worker-keys", str(out / "worker")], "server.key_secret"),
    ]
    for flags, message in cases:
        code, _, err = tandem(capsys, "serve", *flags)
        assert code == 2 and message in err, (flags, err)
    os.remove(out / "router" / "worker.key")
    code, _, err = tandem(capsys, "serve", "--worker-listen", "tcp://127.0.0.1:5555", "--worker-keys", router)
    assert code == 2 and "no worker public key" in err


def test_worker_refuses_bad_flags(made, capsys):
    out, _ = made
    code, _, err = tandem(capsys, "worker", "--connect", "127.0.0.1:5555", "--keys", str(out / "worker"))
    assert code == 2 and "--connect" in err and "tcp://HOST:PORT" in err
    code, _, err = tandem(capsys, "worker", "--connect", "tcp://127.0.0.1:5555", "--keys", str(out / "router"))
    assert code == 2 and "the router's folder" in err
    code, _, err = tandem(capsys, "worker", "--connect", "tcp://127.0.0.1:5555", "--keys", str(out / "nowhere"))
    assert code == 2 and "--keys" in err


def test_the_tandem_command_exits_2_on_a_bad_remote_worker_flag(made):
    """Through the real command line: the exit code reaches the shell."""
    out, _ = made
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "worker", "--connect", "tcp://127.0.0.1:5555",
                           "--keys", str(out / "worker"), "--index", "-1"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--index" in proc.stderr, proc.stderr
