"""A request in flight as the router keeps it: which workers hold it, its
phase, the answer so far, and how often it moved after a worker died.

Apart from the dispatcher (dispatcher.py), which drives it through the
worker protocol, and from moving it (request_moves.py), because both read
and change the same record.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

from protos.budget import TokenBudget
from protos.messages import KVHandoff
from router.routing.engine_api import GenerationRequest

VISION_LOST = object()  # event: the vision worker died; prefill encodes the images


@dataclass
class RequestState:
    req: GenerationRequest
    events: asyncio.Queue
    prefill_worker: str
    decode_worker: str = ""
    phase: str = "prefill"  # vision -> prefill -> decode -> done
    vision: object = None  # the VisionDone of its images, if a vision worker stored them
    vision_worker: str = ""
    first_token: Optional[int] = None  # from PrefillDone; decode continues after it
    started: float = field(default_factory=time.monotonic)
    # The id the workers know it by: the request id, then "<id>~<n>" after its
    # n-th move, so nothing a replaced worker still sends about it is taken.
    wire_id: str = ""
    answer: list = field(default_factory=list)  # tokens received so far, in order
    moves: int = 0  # times it moved to another worker after one died
    strikes: int = 0  # workers that died running it, no token gained between (max_migrations)
    struck_at: int = -1  # len(answer) at the last strike
    resumed: int = 0  # answer tokens at the end of the prompt it was last prefilled with
    # The KV handoff its decode worker was sent: given back if that worker dies
    # before reading it (a group's ranks each free their own part once read, so
    # freeing it again is harmless; the arena's reservations would wait for their TTL).
    handoff: Optional[KVHandoff] = None

    def prompt(self) -> list:
        """The prompt its current prefill runs: a moved request's ends with its answer so far."""
        return list(self.req.prompt_tokens) + self.answer[:self.resumed]

    def budget(self) -> TokenBudget:
        """Its token budget as its current prefill starts: the answer its
        prompt ends with is produced already."""
        return TokenBudget(self.req.sampling.max_tokens, self.resumed)
