"""The router's sockets to its model workers: a ROUTER bound on this host's
ipc path and, with --worker-listen, a second one on a tcp:// address, where
workers on other hosts (deploy/worker_cmd.py) join over CURVE. Only worker
public keys found in --worker-keys get in: a ZAP handler (`WorkerKeyCheck`)
checks each one and logs each refusal. Without --worker-listen there is no
tcp socket and no handler: the single-host router is what it always was.
"""

from __future__ import annotations

import logging
import time

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from environment.settings import Settings
from protos import transport
from protos.messages import WorkerHello

log = logging.getLogger("router.routing.dispatcher")

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


class WorkerSockets:
    """The ROUTER sockets workers connect to, bound: this host's on ipc, and
    with --worker-listen a second one on tcp (CURVE, `WorkerKeyCheck`).

    Two sockets, not one with two endpoints: the ipc socket hands a routing
    id over to the newest peer that claims it (what lets a restarted local
    worker take its id back at once), and no peer over tcp may take a local
    worker's id, nor its pipe. On tcp the router does not trust routing ids
    at all (a peer picks its own, and ZeroMQ's own are a counter): it hands
    over none, and knows a remote worker by the name in its hello, bound to
    the key that first said it (`RemoteNames`)."""

    def __init__(self, ctx, settings: Settings):
        self.local = transport.make_socket(ctx, zmq.ROUTER)
        self.local.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.local.bind(transport.ipc_address(settings.run_dir, settings.router_socket))
        self.remote, self.key_check = None, None
        self.names = RemoteNames()
        self._ready: list = []  # sockets the last poll found readable, not yet read
        if settings.worker_listen:
            try:
                self._listen(ctx, settings)
            except Exception:
                self.close()
                raise

    def _listen(self, ctx, settings: Settings) -> None:
        public, secret, allowed = transport.router_keys(settings.worker_keys)
        self.key_check = WorkerKeyCheck(ctx, allowed)
        self.key_check.start()  # before the bind: no handshake may find no handler
        self.remote = transport.make_socket(ctx, zmq.ROUTER)
        transport.curve_server(self.remote, public, secret, ZAP_DOMAIN)
        self.remote.bind(settings.worker_listen)
        self._poller = zmq.asyncio.Poller()
        for sock in (self.local, self.remote):
            self._poller.register(sock, zmq.POLLIN)
        log.info("remote workers join on %s (CURVE; %d worker key(s): %s)", settings.worker_listen, len(allowed),
                 ", ".join(sorted(allowed.values())))

    async def send(self, worker_id: str, msg) -> None:
        """To `worker_id`: over its tcp connection when it is a remote worker's name, else over ipc."""
        rid = self.names.routing_id(worker_id)  # only names heard on the tcp socket have one
        if rid is not None:
            await transport.asend(self.remote, msg, to=rid)
        else:
            await transport.asend(self.local, msg, to=worker_id.encode())

    async def receive(self) -> tuple[bytes | None, object]:
        """(worker name, message) from a worker; message None for a bad or
        ignored one. Without a tcp socket, a plain receive as always."""
        if self.remote is None:
            return await transport.arecv(self.local, routed=True)
        if not self._ready:
            self._ready = [sock for sock, _ in await self._poller.poll()]
        if self._ready.pop() is self.local:
            peer, msg = await transport.arecv(self.local, routed=True)
            if peer is not None and peer.startswith(REMOTE_PREFIX.encode()):
                _ignore(peer.decode(errors="replace"), "over ipc",
                        "a worker of this host must not take a name that says it joined over tcp")
                return peer, None
            return peer, msg
        rid, user, msg = await transport.arecv_with_user(self.remote)
        if rid is None or msg is None:
            return rid, None
        name = self.names.name_of(rid, user, msg)
        return (name.encode(), msg) if name else (rid, None)

    def close(self) -> None:
        if self.key_check is not None:
            self.key_check.stop()
        for sock in (self.local, self.remote):
            if sock is not None:
                sock.close()


REMOTE_PREFIX = "remote-"  # how deploy/worker_cmd.py names every worker that joins over tcp
_spoofs_logged: dict[str, float] = {}


class RemoteNames:
    """Which tcp connection (routing id) is which remote worker, learnt from
    its hellos. A name is bound to the key that first said it, for the
    router's life: a connection of that key takes it over (the worker's
    restart, or its reconnect after a network fault), one of another key is
    ignored. A name must start with `remote-`, and a hello must say which
    host its KV is on: one saying this host's would be handed KV it cannot
    read."""

    def __init__(self):
        self._by_rid: dict[bytes, str] = {}
        self._by_name: dict[str, tuple[bytes, str]] = {}  # name -> (routing id, key name)

    def routing_id(self, name: str) -> bytes | None:
        held = self._by_name.get(name)
        return held[0] if held else None

    def name_of(self, rid: bytes, user: str, msg) -> str | None:
        """The worker that sent `msg` over connection `rid` with key `user`;
        None to ignore the message (logged once a minute per name)."""
        name = self._by_rid.get(rid)
        if not isinstance(msg, WorkerHello):
            return name  # a connection says who it is in a hello, before anything else
        said = msg.worker_id
        if name is not None and said != name:
            return _ignore(said, f"key {user!r}", f"its connection is worker {name!r}'s")
        if not said.startswith(REMOTE_PREFIX) or not msg.kv_host:
            return _ignore(said, f"key {user!r}", f"a worker that joins over tcp must be named {REMOTE_PREFIX}... "
                           "and say which host its KV is on")
        held = self._by_name.get(said)
        if held is not None and held[1] != user:
            return _ignore(said, f"key {user!r}", f"that name belongs to key {held[1]!r}")
        if held is not None and held[0] != rid:
            self._by_rid.pop(held[0], None)  # its old connection: the worker restarted or reconnected
        self._by_name[said] = (rid, user)
        self._by_rid[rid] = said
        return said


def _ignore(name: str, source: str, why: str) -> None:
    name = name[:64]
    now = time.monotonic()
    if now - _spoofs_logged.get(name, float("-inf")) >= REFUSALS_EVERY_S:
        _spoofs_logged[name] = now
        log.warning("ignored worker %r (%s): %s", name, source, why)
    return None
