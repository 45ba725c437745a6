"""The cache service process: binds a ROUTER at ipc_address(run_dir,
"cache") that clients' DEALERs connect to, and answers every message with
service.CacheService.

Started by the supervisor with multiprocessing's spawn context:
`ctx.Process(target=run, args=(settings,))`. One thread, one socket, no
blocking call without a timeout: the loop wakes at least every `_TICK_S` to
expire reservations and notice SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Optional

import zmq

from cache_service.arena import Arena, new_arena_name
from cache_service.disk_tier import DiskTier
from cache_service.service import CacheService, error_reply
from environment.logs import setup_logging
from environment.memory_pressure import UNLOAD_FIRST_S, PressurePoll, PressureReader
from environment.power.policy import decide
from environment.power.readers import read_power
from environment.settings import Settings
from protos.codec import ProtocolError
from protos.transport import ipc_address, make_socket, recv, rejects, send

log = logging.getLogger(__name__)

_BURST = 1000  # most messages served between two expiry passes


def _open_disk_tier(settings: Settings) -> Optional[DiskTier]:
    """The disk tier of settings.cache_dir; None when off or unusable (the
    service then runs memory-only rather than not at all)."""
    if not settings.cache_dir:
        return None
    try:
        return DiskTier(settings.cache_dir, settings.cache_disk_bytes, ttl_s=settings.cache_disk_ttl_s)
    except OSError as exc:
        log.error("KV disk tier off: cannot use %s: %s", settings.cache_dir, exc)
        return None


def _follow_power(settings: Settings, service: CacheService, stop: list) -> None:
    """The power policy defers disk-tier writes in saver (environment/power/policy.py).
    Read here, off the service's thread (pmset is a subprocess); the service
    applies it at its next tick. The router decides the same from the same reading."""
    while not stop:
        try:
            service.defer_disk_writes = decide(read_power(settings), settings).defer_disk_writes
        except Exception:  # noqa: BLE001 - a reader bug must not stop the thread
            log.exception("power state: reading failed")
        time.sleep(settings.power_poll_s)


def run(settings: Settings, ready=None) -> None:
    """Process main. `ready` (a multiprocessing Event, optional) is set once
    the socket is bound. Returns (exit 0) after SIGTERM/SIGINT."""
    setup_logging(settings.log_level, "cache")
    stop = []
    if threading.current_thread() is threading.main_thread():  # only there can Python take signals
        handler = lambda signum, frame: stop.append(signum)
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    name = settings.arena_name
    if not name:
        name = new_arena_name()
        log.warning("no arena_name set; using %s (nobody else can clean it up after a kill)", name)
    arena = Arena.create(name, settings.cache_memory_bytes)
    ctx = zmq.Context()
    sock = service = None
    try:
        pressure = PressurePoll(PressureReader(settings.memory_pressure_file), settings.memory_poll_s, time.monotonic,
                                grace_s=UNLOAD_FIRST_S)
        service = CacheService(arena, settings.cache_memory_bytes, _open_disk_tier(settings), pressure)
        os.makedirs(settings.run_dir, exist_ok=True)
        sock = make_socket(ctx, zmq.ROUTER)
        address = ipc_address(settings.run_dir, "cache")
        sock.bind(address)
        log.info("serving arena %s (%d bytes of memory) at %s", arena.name, arena.size, address)
        disk = service.blocks.disk
        if disk is None:
            log.info("KV disk tier off")
        else:
            st = disk.stats()
            log.info("KV disk tier %s: %d bytes at most; found %d blocks (%d bytes)",
                     disk.root, disk.capacity_bytes, st["disk_blocks"], st["disk_bytes"])
        if service.blocks.disk is not None:
            threading.Thread(target=_follow_power, args=(settings, service, stop), name="power", daemon=True).start()
        if ready is not None:
            ready.set()
        _serve(sock, service, stop)
        log.info("stopping on signal %s", stop[0])
    finally:
        if sock is not None:
            sock.close(linger=0)
        ctx.term()
        if service is not None:
            service.close()  # queued disk writes still read the arena
        arena.close()
        arena.unlink()


def _serve(sock: zmq.Socket, service: CacheService, stop: list) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop:
        service.tick()
        # pyzmq retries the poll after a signal handler ran, so a stop can take
        # up to one wait to be seen; the wait is at most service.py's _TICK_S.
        if not poller.poll(service.wait_s() * 1000):
            continue
        # Serve a burst in one go, but bounded so a flood cannot starve expiry.
        for _ in range(_BURST):
            if stop:
                break
            try:
                peer, msg = recv(sock, routed=True, flags=zmq.NOBLOCK)  # never raises for a bad message
            except zmq.Again:
                break
            # Any other error (a broken socket) ends the process, exit code 1:
            # the supervisor restarts it.
            if msg is None:
                continue  # undecodable; transport.recv logged it
            _answer(sock, service, peer, msg)


def _answer(sock: zmq.Socket, service: CacheService, peer: bytes, msg: Any) -> None:
    try:
        reply = service.handle(msg)
    except Exception:  # a handler bug must cost one call, not the service
        log.exception("handler failed on %s", type(msg).__name__)
        reply = error_reply(msg, "internal error in cache service")
    if reply is None:  # a valid message, but no request: dropped (rate-limited log, as undecodable ones)
        rejects(peer, ProtocolError(f"{type(msg).__name__} is not a cache service request"))
        return
    try:
        send(sock, reply, to=peer, flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue full
        log.warning("could not reply to %r: %s", peer[:64], exc)
    except Exception:  # a reply that cannot be encoded (a bug) costs that call, not the service
        log.exception("could not send %s to %r", type(reply).__name__, peer[:64])
