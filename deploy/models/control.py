"""The supervisor's control socket for the router (protos/model_messages.py):
a ZeroMQ ROUTER at ipc_address(run_dir, "models"), served by a thread of
its own. A request is LoadModel, UnloadModel or ListModels; the answer is
ModelsState (every slot, after the request took effect) or ModelRefused.

The thread never touches a child: it resolves a name to load (a GGUF may be
converted, which takes a while) and hands the command to the supervisor's
loop through a queue, waking it with a byte on a socket pair that the loop's
mp.connection.wait includes, then waits for the loop's answer (bounded).
Requests are answered one at a time, in order; an unload is answered once
its workers have exited (at most the stop grace and the kill wait).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from dataclasses import dataclass, field

import zmq

from protos import transport
from protos.model_messages import CONTROL_SOCKET, ListModels, LoadModel, ModelRefused, UnloadModel

log = logging.getLogger(__name__)

ANSWER_S = 30.0  # the loop's answer to one command, at most (an unload: grace + kill wait)
POLL_MS = 200  # how often the thread looks at its stop flag
START_S = 5.0


@dataclass
class Command:
    """One request for the supervisor's loop; `answer` is called there, once."""

    msg: object
    resolved: object = None  # deploy/models/slots.py Resolved, for a LoadModel not loaded
    answers: queue.Queue = field(default_factory=lambda: queue.Queue(1))

    def answer(self, reply) -> None:
        try:
            self.answers.put_nowait(reply)
        except queue.Full:  # answered already
            pass


class ModelControl:
    def __init__(self, run_dir: str, slots):
        self.address = transport.ipc_address(run_dir, CONTROL_SOCKET)
        self.slots = slots  # deploy/models/slots.py Slots: only `known` and `resolve` from this thread
        self._commands: queue.Queue[Command] = queue.Queue()
        self.wakeup, self._wake = socket.socketpair()  # the loop waits on `wakeup`
        self.wakeup.setblocking(False)
        self._wake.setblocking(False)
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="models-control")

    def start(self) -> None:
        self._thread.start()
        if not self._bound.wait(START_S):
            log.error("the models control socket %s did not open", self.address)

    def take(self) -> list[Command]:
        """The commands waiting (the loop's side)."""
        try:
            while self.wakeup.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        out = []
        while True:
            try:
                out.append(self._commands.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=POLL_MS / 1000 * 5)
        self.wakeup.close()
        self._wake.close()

    # -------------------------------------------------------- the thread --
    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = transport.make_socket(ctx, zmq.ROUTER)
        try:
            sock.bind(self.address)
            self._bound.set()
            while not self._stop.is_set():
                if not sock.poll(POLL_MS):
                    continue
                peer, msg = transport.recv(sock, routed=True)
                if peer is None:  # no identity to answer (logged by recv)
                    continue
                reply = self._handle(msg)
                try:
                    transport.send(sock, reply, to=peer, flags=zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # the asker is gone (ROUTER_MANDATORY says so)
                    log.warning("models control: the answer to %s was not delivered: %s", type(msg).__name__, exc)
        except Exception:  # noqa: BLE001 - logged; the server goes on without on-demand models
            log.exception("the models control socket stopped")
        finally:
            sock.close()
            ctx.term()

    def _handle(self, msg):
        name = getattr(msg, "name", "")
        if not isinstance(msg, (LoadModel, UnloadModel, ListModels)) or not isinstance(name, str):
            return ModelRefused(name if isinstance(name, str) else "", 400,
                                "expected LoadModel, UnloadModel or ListModels with a model name")
        cmd = Command(msg)
        if isinstance(msg, LoadModel) and not self.slots.known(name):
            try:
                cmd.resolved = self.slots.resolve(name)
            except Exception as exc:  # noqa: BLE001 - the socket must keep answering
                log.exception("resolving model %r", name)
                return ModelRefused(name, 500, f"model '{name}' could not be resolved: {exc}")
            if isinstance(cmd.resolved, ModelRefused):
                return cmd.resolved
        self._commands.put(cmd)
        try:
            self._wake.send(b"\0")
        except (BlockingIOError, OSError):  # a wake-up is pending already
            pass
        return self._wait(cmd, name)

    def _wait(self, cmd: Command, name: str):
        for _ in range(int(ANSWER_S * 1000 / POLL_MS)):
            try:
                return cmd.answers.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                if self._stop.is_set():
                    return ModelRefused(name, 503, "the server is stopping")
        log.error("models control: no answer to %s within %.0fs", type(cmd.msg).__name__, ANSWER_S)
        return ModelRefused(name, 503, f"the supervisor did not carry out {type(cmd.msg).__name__} "
                                       f"within {ANSWER_S:.0f}s")
