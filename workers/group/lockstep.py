"""Rank 0's loop, recorded for the other ranks of a tensor-parallel group to replay.

Every rank of a group must issue the same MLX collectives in the same
order, or the group hangs: so the followers do exactly what rank 0's loop
did. Rank 0 (`Recorder`) sends each follower a stream of records over its
own ZeroMQ PUSH socket (ipc, in the run dir; tcp with CURVE to a rank on
another host, deploy/group_plan.py); a record is a list of ops:

- ("m", n): a message rank 0 handled, in its n protos/codec.py frames
  (after the op list, in order);
- ("u", name, wait[, costs]): a unit of MLX work (workers/role.py `Unit`,
  by its name), a decode step with rank 0's speculative step costs, a
  prefill step with its turns' times (workers/prefill/turns.py);
- ("ready",): rank 0 has loaded; ("stop",): rank 0 stops.

Messages wait in the recorder until the next unit (or beat) sends them
with it, so a record goes out *before* rank 0 runs its unit: rank 0 enters
the unit's collectives only once its followers can. An empty record is the
heartbeat, sent when nothing else was for `beat_s`: by the loop between
units, and by a thread of its own (`start_beats`) while the loop is inside
one or anywhere else, so that a long step (a batch of handoffs read in, a
kernel compiled, a slow prefill) is no silence. The thread beats only while
the loop showed life within the unit deadline (`alive`): a loop stuck
longer goes silent, and its followers give up on it.

Decisions that hang on time or on other processes are rank 0's alone and
reach the followers as what they chose: the units it ran (the power
policy's pace, which units had work), what its decode steps cost
(speculation's choice of how many tokens a row drafts follows it), and, in
the messages, a sampling seed for every request that had none
(`pin_seed`), so every rank draws the same tokens.

A follower (`RecordStream`) that hears nothing for `silence_s` (rank 0 is
gone, or its loop stuck past the unit deadline) exits non-zero; the
supervisor restarts the whole group.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time

import msgpack
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from protos import codec, transport
from protos.messages import DecodeRequest, PrefillRequest

log = logging.getLogger(__name__)

# A record rank 0 cannot hand to a follower's socket within this means the
# follower is gone or stuck (it takes one within a unit): the group is broken.
SEND_DEADLINE_S = 30.0
# A follower on another host whose tcp connection to rank 0 has not passed
# CURVE's handshake by then cannot reach it (an address or a port not
# reachable, or keys rank 0 does not take): it stops, saying which.
CONNECT_DEADLINE_S = 30.0
ZAP_DOMAIN = "tandem-group"


class GroupBroken(RuntimeError):
    """A rank of the group is gone: this rank must stop (the supervisor
    restarts the group) rather than go on alone."""


def pin_seed(msg):
    """`msg` with a sampling seed rank 0 chose, if it samples and has none:
    an unseeded sampler draws its seed from the OS, and each rank would
    draw another (and the ranks' tokens, then their KV, would differ)."""
    if not isinstance(msg, (PrefillRequest, DecodeRequest)):
        return msg
    sampling = msg.sampling
    if sampling.temperature == 0 or sampling.seed is not None:
        return msg
    return dataclasses.replace(msg, sampling=dataclasses.replace(sampling, seed=secrets.randbits(63)))


def encode_record(ops: list, frames: list) -> list:
    return [msgpack.packb(ops, use_bin_type=True), *frames]


def decode_record(frames: list) -> list:
    """[("m", message) | ("u", unit, wait[, costs]) | ("ready",) | ("stop",)]: the
    messages decoded. Raises codec.ProtocolError on anything malformed (a
    follower cannot follow a record it cannot read)."""
    try:
        ops = msgpack.unpackb(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0], raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise codec.ProtocolError(f"unreadable record: {exc}") from exc
    out, at = [], 1
    for op in ops:
        if op[0] == "m":
            out.append(("m", codec.decode(list(frames[at:at + op[1]]))))
            at += op[1]
        else:
            out.append(tuple(op))
    return out


class RankKeyCheck:
    """ZAP's verdict on a CURVE client of rank 0's tcp lockstep: its public
    key is one of the allowed ones (--group-keys); a refusal is logged."""

    def __init__(self, allowed: dict[bytes, str]):
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        log.warning("refused a lockstep connection: public key %s is not in --group-keys", key.decode())
        return False


class Recorder:
    """Rank 0's side: binds one PUSH socket per follower (its address: ipc,
    or tcp for a follower on another host, a CURVE server with `keys`, from
    transport.router_keys) and sends them the records."""

    def __init__(self, ctx: zmq.Context, addresses: list[str], beat_s: float, keys: tuple | None = None):
        self.beat_s = beat_s
        self.socks, self.monitors = [], []
        self.auth = None
        if any(a.startswith("tcp://") for a in addresses):
            if keys is None:  # records carry prompts: never in the clear, never to just anyone
                raise ValueError("a follower on another host needs CURVE keys (--group-keys)")
            self.auth = ThreadAuthenticator(ctx)
            self.auth.start()  # before the bind: no handshake may find no handler
            self.auth.configure_curve_callback(ZAP_DOMAIN, RankKeyCheck(keys[2]))
        for address in addresses:
            sock = transport.make_socket(ctx, zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, int(SEND_DEADLINE_S * 1000))
            if address.startswith("tcp://"):
                transport.curve_server(sock, keys[0], keys[1], ZAP_DOMAIN)
                log.info("lockstep records to %s over tcp with CURVE", address)
            self.monitors.append(sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED))
            sock.bind(address)
            self.socks.append(sock)
        self.ops: list = []
        self.frames: list = []
        self.last_sent = time.monotonic()
        self.lost = False  # a follower's connection went away
        # The sockets are the loop's and the beat thread's: one sends at a time.
        self.send_lock = threading.Lock()
        self.alive_at = time.monotonic()  # the loop's last sign of life (`alive`)
        self.closed = threading.Event()
        self.beats: threading.Thread | None = None

    def message(self, msg) -> None:
        frames = codec.encode(msg)
        self.ops.append(("m", len(frames)))
        self.frames += frames

    def unit(self, unit: str, wait: bool = False, costs: list | None = None) -> None:
        """Send what waits, with `unit`: called before rank 0 runs it.
        `costs`: rank 0's speculative step costs, for a decode step
        (StepCosts.state: the followers draft as rank 0 does)."""
        self.ops.append(("u", unit, wait) if costs is None else ("u", unit, wait, costs))
        self.alive()
        self.flush()

    def beat(self) -> None:
        """Between units: what waits, or a heartbeat, once `beat_s` passed."""
        self.alive()
        if time.monotonic() - self.last_sent >= self.beat_s:
            self.flush()

    def alive(self) -> None:
        """The loop lives (it starts or ends a unit, or waits for messages)."""
        self.alive_at = time.monotonic()

    def start_beats(self, alive_s: float) -> None:
        """Beat from a thread from now on while the loop showed life within
        `alive_s` (the unit deadline; <= 0: always): rank 0 is loaded, so
        its followers now count silence by `silence_s`."""
        self.alive()
        self.beats = threading.Thread(target=self._beat, args=(alive_s,), daemon=True, name="lockstep-beat")
        self.beats.start()

    def _beat(self, alive_s: float) -> None:
        empty = encode_record([], [])
        while not self.closed.wait(self.beat_s / 2):
            now = time.monotonic()
            if now - self.last_sent < self.beat_s or (alive_s > 0 and now - self.alive_at > alive_s):
                continue
            if not self.send_lock.acquire(blocking=False):
                continue  # the loop is sending: that is a record
            try:
                for sock in self.socks:
                    try:  # never waits: a follower with records queued has no need of a beat
                        sock.send_multipart(empty, flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                self.last_sent = now
            finally:
                self.send_lock.release()

    def send_op(self, *op, wait: bool = True) -> None:
        """Send `op` (with what waits); `wait=False`: at once or never (a stop)."""
        self.ops.append(op)
        self.flush(wait)

    def flush(self, wait: bool = True) -> None:
        frames = encode_record(self.ops, self.frames)
        self.ops, self.frames = [], []
        with self.send_lock:
            for sock in self.socks:
                try:
                    sock.send_multipart(frames, copy=False, flags=0 if wait else zmq.NOBLOCK)
                except zmq.Again:
                    if wait:
                        raise GroupBroken(f"a follower took no record within {SEND_DEADLINE_S:.0f} s") from None
            self.last_sent = time.monotonic()

    def follower_lost(self, wait_s: float) -> bool:
        """Whether a follower's connection went away (its process died), waiting
        up to `wait_s` for news: a collective that failed may be the first to know."""
        poller = zmq.Poller()
        for mon in self.monitors:
            poller.register(mon, zmq.POLLIN)
        deadline = time.monotonic() + wait_s
        while not self.lost:
            left = deadline - time.monotonic()
            events = dict(poller.poll(max(0, int(left * 1000)))) if left > 0 else {}
            if not events:
                break
            for mon in events:
                if recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED:
                    self.lost = True
        return self.lost

    def close(self) -> None:
        self.closed.set()
        if self.beats is not None:
            self.beats.join(timeout=self.beat_s + 1)
        for sock in self.socks:
            sock.disable_monitor()
            sock.close()
        for mon in self.monitors:
            mon.close()
        if self.auth is not None:
            self.auth.stop()


class RecordStream:
    """A follower's side: the records from rank 0, each within a deadline.
    Over tcp (a follower on another host) a CURVE client with `keys`
    (transport.worker_keys), whose handshake must pass within
    CONNECT_DEADLINE_S."""

    def __init__(self, ctx: zmq.Context, address: str, keys: tuple | None = None):
        self.address = address
        self.sock = transport.make_socket(ctx, zmq.PULL)
        self.monitor, self.connected, self.last_event = None, True, ""
        if address.startswith("tcp://"):
            if keys is None:
                raise ValueError("following rank 0 over tcp needs this rank's CURVE keys (--rank-keys)")
            transport.curve_client(self.sock, *keys)
            self.monitor = self.sock.get_monitor_socket()
            self.connected, self.since = False, time.monotonic()
        self.sock.connect(address)

    def next(self, deadline_s: float, stopping=lambda: False, slice_s: float = 0.25) -> list | None:
        """The next record's ops; None when `stopping()` turned true first.
        Raises GroupBroken when none came within `deadline_s`, or rank 0
        could not be reached over tcp within CONNECT_DEADLINE_S."""
        deadline = time.monotonic() + deadline_s
        while not stopping():
            left = deadline - time.monotonic()
            if left <= 0:
                raise GroupBroken(f"no record from rank 0 for {deadline_s:.1f} s")
            if not self.connected:
                self._watch_handshake()
            if self.sock.poll(int(min(left, slice_s) * 1000) or 1):
                if not self.connected:  # a record came: the handshake passed, whatever the monitor says yet
                    self._connected()
                return decode_record(self.sock.recv_multipart(copy=False))
        return None

    def _connected(self) -> None:
        self.connected = True
        log.info("following rank 0 over %s (CURVE handshake done)", self.address)

    def _watch_handshake(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected()
                return
            self.last_event = {zmq.EVENT_CONNECT_RETRIED: "connection refused, retrying",
                               zmq.EVENT_HANDSHAKE_FAILED_AUTH: "rank 0 refused this rank's key (--rank-keys)",
                               zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed (rank 0's public key?)",
                               zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
                               }.get(event, self.last_event)
        if time.monotonic() - self.since > CONNECT_DEADLINE_S:
            raise GroupBroken(f"cannot reach rank 0's lockstep at {self.address} within {CONNECT_DEADLINE_S:.0f} s"
                              f" ({self.last_event or 'no answer'})")

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close()
        self.sock.close()
