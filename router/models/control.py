"""The router's side of the supervisor's model control socket
(protos/model_messages.py; the supervisor's side is deploy/models/control.py).

Calls are rare (a load, an unload, a listing) and each gets a socket of its
own, so a reply that comes after its deadline can never answer a later call.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from environment.settings import Settings
from protos import transport
from protos.model_messages import (CONTROL_SOCKET, ListModels, LoadModel, ModelRefused, ModelSlot, ModelsState,
                                   UnloadModel)

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # a GGUF repo is converted before the supervisor answers a load


class ModelControlError(Exception):
    """The supervisor refused (status: the HTTP status it means) or did not answer (503)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class ModelControl:
    def __init__(self, settings: Settings, timeout_s: float = CALL_TIMEOUT_S):
        self.address = transport.ipc_address(settings.run_dir, CONTROL_SOCKET)
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context.instance()

    async def load(self, name: str) -> list[ModelSlot]:
        return await self._call(LoadModel(name))

    async def unload(self, name: str) -> list[ModelSlot]:
        return await self._call(UnloadModel(name))

    async def slots(self, timeout_s: float | None = None) -> list[ModelSlot]:
        return await self._call(ListModels(), timeout_s)

    async def _call(self, msg, timeout_s: float | None = None) -> list[ModelSlot]:
        sock = transport.make_socket(self._ctx, zmq.DEALER)
        try:
            sock.connect(self.address)
            await transport.asend(sock, msg)
            reply = await asyncio.wait_for(transport.arecv(sock), timeout_s or self.timeout_s)
        except (asyncio.TimeoutError, zmq.ZMQError) as exc:
            log.warning("the supervisor did not answer %s: %s", type(msg).__name__, exc or "no reply in time")
            raise ModelControlError(503, "the server's supervisor did not answer; try again") from None
        finally:
            sock.close(linger=0)
        if isinstance(reply, ModelRefused):
            raise ModelControlError(reply.status, reply.message)
        if not isinstance(reply, ModelsState):
            raise ModelControlError(503, f"the supervisor answered {type(reply).__name__}")
        return reply.slots
