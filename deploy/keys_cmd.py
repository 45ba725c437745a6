"""`tandem keys`: the CURVE key pairs that let workers on other hosts join a
router (`tandem serve --worker-listen`, `tandem worker`), in ZeroMQ's
certificate files (pyzmq's zmq.auth writes them).

    DIR/router/server.key_secret   the router's pair          -> the router host,
    DIR/router/NAME.key            each worker's public key      `--worker-keys DIR/router`
    DIR/NAME/NAME.key_secret       worker NAME's pair         -> NAME's host,
    DIR/NAME/server.key            the router's public key       `--keys DIR/NAME`

The router's pair is made once and kept: run it again with another --name to
add a worker. Every key file is 0600 in a 0700 folder, whatever the umask
(the public keys too: only their owner copies them); nothing is overwritten
without --force (the named workers' keys only).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile

from zmq.auth.certs import create_certificates, load_certificate

from protos.transport import ROUTER_KEY, KeysError, router_keys, worker_keys

TCP_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.*-]+):(\d{1,5})$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ROUTER_FOLDER = "router"
KEY_MODE = 0o600


def tcp_address_error(flag: str, address: str) -> str | None:
    """Why `address` is not tcp://HOST:PORT (None: it is)."""
    m = TCP_RE.match(address)
    if not m or not 0 < int(m.group(2)) < 65536:
        return f"{flag} {address!r}: expected tcp://HOST:PORT (remote workers join over tcp only)"
    return None


def worker_listen_error(address: str | None, keys: str | None) -> str | None:
    """What is wrong with `tandem serve`'s --worker-listen / --worker-keys (None: nothing)."""
    if not address and not keys:
        return None
    if not keys:
        return "--worker-listen needs --worker-keys DIR (the router's pair and the workers' public keys; `tandem keys`)"
    if not address:
        return "--worker-keys needs --worker-listen tcp://HOST:PORT"
    why = tcp_address_error("--worker-listen", address)
    if why:
        return why
    try:
        router_keys(keys)
    except (KeysError, OSError) as exc:
        return f"--worker-keys: {exc}"
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the keys in (made if missing)")
    p.add_argument("--name", action="append", default=None, metavar="NAME",
                   help="a worker to make keys for (repeatable; default: worker)")
    p.add_argument("--force", action="store_true", help="replace the named workers' existing keys")
    p.set_defaults(run=run)


def _fail(message: str) -> int:
    print(f"tandem keys: {message}", file=sys.stderr)
    return 2


def _pair(folder: str, name: str) -> tuple[str, str]:
    """A new pair NAME.key / NAME.key_secret made in a 0700 folder under
    `folder` (the secret is never readable by others, not even briefly)."""
    staging = tempfile.mkdtemp(prefix=".new-", dir=folder)
    os.chmod(staging, 0o700)  # mkdtemp's 0700 less the umask: exactly 0700
    public, secret = create_certificates(staging, name)
    os.chmod(secret, KEY_MODE)
    return public, secret


def _place(src: str, dest: str) -> None:
    """A key file moved into place, whole, 0600."""
    os.chmod(src, KEY_MODE)
    os.replace(src, dest)


def _private_folder(path: str) -> None:
    """`path` made if missing, and 0700 whatever the umask."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def run(args: argparse.Namespace) -> int:
    names = list(dict.fromkeys(args.name or ["worker"]))
    for name in names:
        if not NAME_RE.match(name) or name in (ROUTER_FOLDER, ROUTER_KEY):
            return _fail(f"--name {name!r}: letters, digits, '.', '_' and '-' only (64 at most), "
                         f"and not {ROUTER_FOLDER!r} or {ROUTER_KEY!r}")
    out = os.path.abspath(args.out)
    router = os.path.join(out, ROUTER_FOLDER)
    taken = [p for n in names for p in (os.path.join(out, n), os.path.join(router, f"{n}.key")) if os.path.exists(p)]
    if taken and not args.force:
        return _fail(f"{', '.join(taken)} exist(s): pass --force to replace these workers' keys")
    server_secret = os.path.join(router, f"{ROUTER_KEY}.key_secret")
    have_router = os.path.exists(server_secret)
    if have_router:
        try:
            _server_public(router)
        except KeysError as exc:
            return _fail(f"the router's pair is unusable ({exc}): remove {router} to make a new one")
    try:
        if not os.path.isdir(out):
            _private_folder(out)
        _private_folder(router)
        if not have_router:
            public, secret = _pair(router, ROUTER_KEY)
            _place(public, os.path.join(router, f"{ROUTER_KEY}.key"))
            _place(secret, server_secret)
            shutil.rmtree(os.path.dirname(public))
        for name in names:
            _make_worker(out, router, name)
    except OSError as exc:
        return _fail(str(exc))
    _explain(out, names, made_router=not have_router)
    return 0


def _server_public(router: str) -> bytes:
    try:
        public, secret = load_certificate(os.path.join(router, f"{ROUTER_KEY}.key_secret"))
    except (OSError, ValueError) as exc:
        raise KeysError(str(exc)) from None
    if not secret:
        raise KeysError("no secret key in it")
    return public


def _make_worker(out: str, router: str, name: str) -> None:
    """Worker NAME's folder (its pair and the router's public key), and its
    public key among the router's allowed ones."""
    folder = os.path.join(out, name)
    shutil.rmtree(folder, ignore_errors=True)  # --force (checked by the caller)
    public, secret = _pair(router, name)
    staging = os.path.dirname(public)
    copy = os.path.join(staging, f"{ROUTER_KEY}.key")
    shutil.copyfile(os.path.join(router, f"{ROUTER_KEY}.key"), copy)
    os.chmod(copy, KEY_MODE)
    _place(public, os.path.join(router, f"{name}.key"))
    os.replace(staging, folder)
    worker_keys(folder)  # what `tandem worker --keys` will read: fail here, not there
    router_keys(router)


def _explain(out: str, names: list[str], made_router: bool) -> None:
    router = os.path.join(out, ROUTER_FOLDER)
    print(f"{'made' if made_router else 'kept'} the router's key pair: {router}/{ROUTER_KEY}.key_secret")
    for name in names:
        print(f"made worker {name!r}: {out}/{name}/ (its pair, and the router's public key)")
    print()
    print(f"On the router's host:   copy {router}/ (keep it private: the router's secret key) and run")
    print(f"    tandem serve --worker-listen tcp://0.0.0.0:PORT --worker-keys {router} ...")
    print("  It lets in the workers whose NAME.key is in that folder; delete one (and restart) to shut it out.")
    for name in names:
        print(f"On worker {name!r}'s host: copy {out}/{name}/ (private: that worker's secret key) and run")
        print(f"    tandem worker --connect tcp://ROUTER-HOST:PORT --keys {out}/{name} [--role colocated|prefill|decode] ...")
