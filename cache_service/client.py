"""Clients of the cache service: `CacheClient` (sync, for worker threads) and
`AsyncCacheClient` (for the router's event loop).

Both speak through one DEALER socket and share `_Call`: call ids, the request
message, the deadline, reply matching and the result. Only the waiting
differs. Every call ends by its deadline (settings.cache_call_timeout_s): on
timeout the socket is closed and a fresh one connects on the next call, so a
late reply can never be taken for the answer to a later call, and
`CacheUnavailable` is raised. Replies whose call_id is not the one awaited
(from a call abandoned by cancellation) are dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from typing import Any, Callable, Optional

import zmq
import zmq.asyncio

from environment.settings import Settings
from protos.messages import (CacheAlloc, CacheAllocReply, CacheFree, CacheReply, CacheStats, KVCommit, KVLookup,
                             KVLookupReply, KVRelease, KVReserve, KVReserveReply)
from protos.transport import ipc_address, make_socket, recv, send

log = logging.getLogger(__name__)


class CacheUnavailable(ConnectionError):
    """The cache service did not answer within the call's deadline."""


class CacheError(RuntimeError):
    """The cache service answered, but refused the call."""


class _Call:
    """One request in flight: what was sent, what answers it, by when."""

    def __init__(self, request: Any, reply_type: type, timeout_s: float,
                 finish: Callable[[Any], Any] = lambda reply: reply):
        self.request = request
        self.reply_type = reply_type
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.finish = finish  # reply -> what the public method returns

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def remaining_ms(self) -> int:
        """Milliseconds left, rounded up so a poll never ends just short; 0 when past."""
        left = self.remaining_s()
        return max(0, math.ceil(left * 1000)) if left > 0 else 0

    def matches(self, msg: Any) -> bool:
        if isinstance(msg, self.reply_type) and msg.call_id == self.request.call_id:
            return True
        if msg is not None:  # None: undecodable, transport.recv already logged it
            log.debug("dropped stale cache reply %s (call %s), awaiting call %d",
                      type(msg).__name__, getattr(msg, "call_id", "?"), self.request.call_id)
        return False

    def timed_out(self, why: str = "no reply") -> CacheUnavailable:
        return CacheUnavailable(f"cache service: {why} to {type(self.request).__name__} "
                                f"within {self.timeout_s:.3g} s")


class _CallFactory:
    """The calls both clients offer, built once here."""

    def __init__(self, settings: Settings, timeout_s: Optional[float]):
        self.address = ipc_address(settings.run_dir, "cache")
        self.timeout_s = settings.cache_call_timeout_s if timeout_s is None else timeout_s
        # Ids never repeat within a client, across socket resets too.
        self._ids = itertools.count(1)

    def alloc(self, nbytes: int, owner: str, ttl_s: float) -> _Call:
        req = CacheAlloc(call_id=next(self._ids), nbytes=nbytes, owner=owner, ttl_s=float(ttl_s))
        return _Call(req, CacheAllocReply, self.timeout_s)

    def free(self, allocations, owner, arena) -> _Call:
        req = CacheFree(call_id=next(self._ids), allocations=list(allocations or []),
                        owner=owner or "", arena=arena or "")
        return _Call(req, CacheReply, self.timeout_s)

    def stats(self) -> _Call:
        return _Call(CacheStats(call_id=next(self._ids)), CacheReply, self.timeout_s, finish=_stats_or_raise)

    def lookup(self, hashes, owner: str, lease_s: float, first: bool = False) -> _Call:
        req = KVLookup(call_id=next(self._ids), hashes=_hash_list(hashes), owner=owner, lease_s=float(lease_s),
                       first=bool(first))
        return _Call(req, KVLookupReply, self.timeout_s)

    def release(self, lease: int) -> _Call:
        return _Call(KVRelease(call_id=next(self._ids), lease=int(lease)), CacheReply, self.timeout_s,
                     finish=_none_or_raise)

    def reserve(self, hashes, nbytes: int, owner: str, ttl_s: float) -> _Call:
        req = KVReserve(call_id=next(self._ids), hashes=_hash_list(hashes), nbytes=int(nbytes), owner=owner,
                        ttl_s=float(ttl_s))
        return _Call(req, KVReserveReply, self.timeout_s)

    def commit(self, hashes, owner: str) -> _Call:
        req = KVCommit(call_id=next(self._ids), hashes=_hash_list(hashes), owner=owner or "")
        return _Call(req, CacheReply, self.timeout_s)


def _hash_list(hashes) -> list:
    return [bytes(h) for h in hashes]


def _stats_or_raise(reply: CacheReply) -> dict:
    if not reply.ok:
        raise CacheError(reply.error)
    return reply.stats


def _none_or_raise(reply: CacheReply) -> None:
    if not reply.ok:
        raise CacheError(reply.error)


DEFAULT_TTL_S = 120.0
DEFAULT_LEASE_S = 30.0  # a prefill copies its cached blocks well within this
DEFAULT_BLOCK_TTL_S = 30.0


class CacheClient:
    """Sync client. One per thread: it owns one DEALER socket."""

    def __init__(self, settings: Settings, *, timeout_s: Optional[float] = None,
                 ctx: Optional[zmq.Context] = None):
        self._calls = _CallFactory(settings, timeout_s)
        self._ctx = ctx or zmq.Context.instance()
        self._sock: Optional[zmq.Socket] = None
        self._thread: Optional[int] = None

    def alloc(self, nbytes: int, owner: str, ttl_s: float = DEFAULT_TTL_S) -> CacheAllocReply:
        """Reserve arena bytes. Check `.ok`; `.error` says why not."""
        return self._call(self._calls.alloc(nbytes, owner, ttl_s))

    def free(self, allocations: Optional[list] = None, owner: Optional[str] = None,
             arena: Optional[str] = None, wait: bool = True) -> Optional[CacheReply]:
        """Release by ids and/or owner. Pass `arena` (from the handle) so a
        free aimed at a restarted service's old arena is refused. With
        `wait=False` the request is only sent (see `release`): None."""
        call = self._calls.free(allocations, owner, arena)
        return self._call(call) if wait else self._post(call)

    def stats(self) -> dict:
        return self._call(self._calls.stats())

    # Prefix cache. Block hashes are bytes, chained, in prompt order.

    def lookup(self, hashes, owner: str, lease_s: float = DEFAULT_LEASE_S, first: bool = False) -> KVLookupReply:
        """Lease the longest run of cached blocks from hashes[0]: `.blocks`
        covers hashes[:len(blocks)] (read them in `.arena`), then `release`
        `.lease` (-1 when nothing was found). An unreleased lease ends by itself
        after `lease_s`. With `first`: the first cached of `hashes` alone."""
        return self._call(self._calls.lookup(hashes, owner, lease_s, first))

    def release(self, lease: int) -> None:
        """Give a lookup's lease back. A lease that already expired is fine;
        -1 (nothing leased) costs no call. Only sent, never waited for: its
        reply says nothing a caller acts on, and a worker's MLX thread pays
        each round trip (a decode request releases one and frees one). The
        service takes this socket's requests in order, so the next call
        sees it done; its reply is dropped there as stale. A release that
        never arrives ends with its lease's deadline."""
        if lease < 0:
            return None
        return self._post(self._calls.release(lease))

    def reserve(self, hashes, nbytes: int, owner: str, ttl_s: float = DEFAULT_BLOCK_TTL_S) -> KVReserveReply:
        """Phase one of a put: `.blocks` are the slots to write (`nbytes` each),
        for the hashes not already cached or being written, in order; fewer
        than asked when the arena has no more room. Pass the whole chain: its
        cached head is kept while room is made for the tail."""
        return self._call(self._calls.reserve(hashes, nbytes, owner, ttl_s))

    def commit(self, hashes, owner: str = "") -> CacheReply:
        """Phase two: publish written blocks (those not committed within the
        reservation's ttl are gone). `.stats`: committed, unknown. Pass the
        reserving `owner` so a late commit cannot publish another writer's slot."""
        return self._call(self._calls.commit(hashes, owner))

    def close(self) -> None:
        self._drop(linger_ms=1000)  # requests only sent (release) still go out

    def _drop(self, linger_ms: int = 0) -> None:
        if self._sock is not None:
            self._sock.close(linger=linger_ms)
            self._sock = None

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _socket(self) -> zmq.Socket:
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        elif self._thread != me:  # zmq sockets crash when shared between threads
            raise RuntimeError("CacheClient used from two threads; make one per thread")
        if self._sock is None:
            self._sock = make_socket(self._ctx, zmq.DEALER)
            self._sock.connect(self._calls.address)
        return self._sock

    def _post(self, call: _Call) -> None:
        """Send a call whose reply nobody waits for. The replies of earlier
        posts that arrived meanwhile are dropped here (a client that only
        posts would otherwise keep every one of them queued)."""
        sock = self._socket()
        while True:
            try:
                sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
        try:
            send(sock, call.request, flags=zmq.NOBLOCK)
        except zmq.Again:  # the service is not reading; what it would free expires
            self._drop()
            log.debug("cache service: %s not sent (send queue full)", type(call.request).__name__)

    def _call(self, call: _Call) -> Any:
        try:
            send(self._socket(), call.request, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._drop()
            raise call.timed_out("send queue full") from None
        while True:
            wait_ms = call.remaining_ms()
            if wait_ms <= 0:
                self._drop()  # a late reply dies with this socket
                raise call.timed_out()
            if not self._sock.poll(wait_ms, zmq.POLLIN):
                continue
            try:
                msg = recv(self._sock, flags=zmq.NOBLOCK)
            except zmq.Again:
                continue
            if call.matches(msg):
                return call.finish(msg)


class AsyncCacheClient:
    """The same calls for an asyncio loop (zmq.asyncio). Concurrent calls from
    several tasks are served one at a time; waiting for a turn counts against
    the call's deadline."""

    def __init__(self, settings: Settings, *, timeout_s: Optional[float] = None,
                 ctx: Optional[zmq.asyncio.Context] = None):
        self._calls = _CallFactory(settings, timeout_s)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._sync: Optional[zmq.Socket] = None  # same socket, blocking API, for transport.send/recv
        self._lock: Optional[asyncio.Lock] = None

    async def alloc(self, nbytes: int, owner: str, ttl_s: float = DEFAULT_TTL_S) -> CacheAllocReply:
        return await self._call(self._calls.alloc(nbytes, owner, ttl_s))

    async def free(self, allocations: Optional[list] = None, owner: Optional[str] = None,
                   arena: Optional[str] = None) -> CacheReply:
        return await self._call(self._calls.free(allocations, owner, arena))

    async def release(self, lease: int) -> None:
        """Give a lease back (-1: nothing leased, no call)."""
        if lease < 0:
            return None
        return await self._call(self._calls.release(lease))

    async def stats(self) -> dict:
        return await self._call(self._calls.stats())

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = self._sync = None

    async def _call(self, call: _Call) -> Any:
        if self._lock is None:
            self._lock = asyncio.Lock()  # made here so it binds to the running loop
        try:
            async with asyncio.timeout(max(call.remaining_s(), 0)):  # not wait_for: it can drop a cancel
                await self._lock.acquire()
        except TimeoutError:
            raise call.timed_out("no turn on the socket") from None
        try:
            return await self._exchange(call)
        finally:
            self._lock.release()

    async def _exchange(self, call: _Call) -> Any:
        if self._sock is None:
            self._sock = make_socket(self._ctx, zmq.DEALER)
            self._sock.connect(self._calls.address)
            # The asyncio socket is only awaited for readiness; sending and
            # receiving go through the one transport helper on a blocking
            # shadow of the same socket, always with NOBLOCK.
            self._sync = zmq.Socket.shadow(self._sock.underlying)
        try:
            send(self._sync, call.request, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.close()
            raise call.timed_out("send queue full") from None
        while True:
            wait_ms = call.remaining_ms()
            if wait_ms <= 0:
                self.close()
                raise call.timed_out()
            if not await self._sock.poll(wait_ms, zmq.POLLIN):
                continue
            try:
                msg = recv(self._sync, flags=zmq.NOBLOCK)
            except zmq.Again:
                continue
            if call.matches(msg):
                return call.finish(msg)
