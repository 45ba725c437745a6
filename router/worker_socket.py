"""The router's socket to its model workers: one ROUTER bound on this host's
ipc path and, with --worker-listen, on a tcp:// address too, where workers on
other hosts (deploy/worker_cmd.py) join over CURVE. Only worker public keys
found in --worker-keys get in: a ZAP handler (`WorkerKeyCheck`) checks each
one and logs each refusal. Without --worker-listen there is no tcp endpoint
and no handler: the single-host router is what it always was.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from deploy.settings import Settings
from protos import transport
from protos.messages import WorkerHello

log = logging.getLogger("router.dispatcher")

ZAP_DOMAIN = "tandem-workers"
REFUSALS_EVERY_S = 60.0  # a refused worker retries; its refusal is logged once per this per key


class WorkerKeyCheck(AsyncioAuthenticator):
    """ZAP for the router's tcp endpoint: a CURVE client gets in when its
    public key is one of `allowed` (its file's name becomes its ZAP user
    id); any other is refused and logged, naming the key and its address."""

    def __init__(self, ctx, allowed: dict[bytes, str]):
        super().__init__(ctx)
        self.allowed = allowed
        self.refused = 0  # connections refused since start
        self._peer = ""
        self._logged: dict[bytes, float] = {}

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"  # the client's address
        await super().handle_zap_message(msg)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        key = z85.encode(client_key)
        if domain == ZAP_DOMAIN and key in self.allowed:
            return True, b"OK"
        self.refused += 1
        now = time.monotonic()
        if now - self._logged.get(key, float("-inf")) >= REFUSALS_EVERY_S:
            self._logged[key] = now
            log.warning("refused a remote worker from %s: its public key %s is not in --worker-keys",
                        self._peer, key.decode())
        return False, b"Unknown key"

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.allowed.get(z85.encode(client_public_key), "")

    def start(self) -> None:
        super().start()
        self.zap_socket.setsockopt(zmq.LINGER, 0)  # the context's term must never wait on it


def open_worker_socket(ctx, settings: Settings) -> tuple[zmq.Socket, WorkerKeyCheck | None]:
    """The ROUTER socket workers connect to, bound; and the key check of its
    tcp endpoint (None without one), to stop before the context ends."""
    sock = transport.make_socket(ctx, zmq.ROUTER)
    # A restarted worker reconnects under its old id; let it take the id over.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.bind(transport.ipc_address(settings.run_dir, "router"))  # before the CURVE options: stays plain
    if not settings.worker_listen:
        return sock, None
    public, secret, allowed = transport.router_keys(settings.worker_keys)
    check = WorkerKeyCheck(ctx, allowed)
    check.start()  # before the bind: no handshake may find no handler
    try:
        transport.curve_server(sock, public, secret, ZAP_DOMAIN)
        sock.bind(settings.worker_listen)
    except Exception:
        check.stop()
        sock.close()
        raise
    log.info("remote workers join on %s (CURVE; %d worker key(s): %s)", settings.worker_listen, len(allowed),
             ", ".join(sorted(allowed.values())))
    return sock, check


REMOTE_PREFIX = "remote-"  # how deploy/worker_cmd.py names every worker that joins over tcp
_spoofs_logged: dict[str, float] = {}


async def receive(sock, remote: bool) -> tuple[bytes | None, object]:
    """(peer, message) from a worker; None for the message of a worker that
    joined over tcp (an allowed key) under a name that is not a remote
    worker's, or with a hello that says its KV is on this host: it would take
    over one of this host's workers' ids and requests, or be handed KV it
    cannot read. (ipc peers are this host's processes: trusted as before.)
    Without a tcp endpoint (`remote` False) a plain receive, as always."""
    if not remote:
        return await transport.arecv(sock, routed=True)
    peer, user, msg = await transport.arecv_with_user(sock)
    if msg is None or peer is None or not user:
        return peer, msg
    if peer.startswith(REMOTE_PREFIX.encode()) and not (isinstance(msg, WorkerHello) and not msg.kv_host):
        return peer, msg
    name = peer[:64].decode(errors="replace")
    now = time.monotonic()
    if now - _spoofs_logged.get(name, float("-inf")) >= REFUSALS_EVERY_S:
        _spoofs_logged[name] = now
        log.warning("ignored worker %r (key %r): a worker that joins over tcp must be named %s... and say "
                    "which host its KV is on", name, user, REMOTE_PREFIX)
    return peer, None
