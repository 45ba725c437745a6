"""The store of recent responses (OpenAI's Responses API): what
`previous_response_id` continues, and what GET / DELETE
/v1/responses/{id} read and drop.

A stored response keeps its whole conversation as chat messages, the
answer's assistant message (calls included) last, so the next turn's prompt
begins with the earlier prompt and answer, whose KV the prefix cache holds.
Apart from the request's translation (responses_request.py) because it
outlives every request: one per router, bounded in bytes in all and per
tenant (API key), each tenant evicting its own.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass

from router.api.errors import ApiError

log = logging.getLogger("tandem.router")

# The store's bounds: responses kept, their conversations' tokens, and the
# bytes they hold, in all and per tenant (settings.stored_responses_bytes and
# stored_responses_key_bytes give the byte bounds; these defaults are theirs).
# Conversations share their messages, so tokens and bytes overcount the
# memory held: a bound, never an undercount.
MAX_STORED_RESPONSES = 4096
MAX_STORED_TOKENS = 16_000_000
MAX_STORED_BYTES = 512 << 20
MAX_KEY_BYTES = 256 << 20


@dataclass
class StoredResponse:
    response: dict  # the response object as sent (GET /v1/responses/{id})
    conversation: list[dict]  # chat messages, the answer last; instructions not among them
    tokens: int  # the conversation's length in tokens, prompt and answer
    size: int = 0  # bytes the response and the conversation hold, counted when stored


def held_bytes(stored: StoredResponse) -> int:
    """Memory the response and its conversation hold: input and output items,
    metadata, everything echoed. Each object's own size (sys.getsizeof: a
    string's is its characters' bytes), walked without recursion: the cost is
    in objects, not bytes, so an 8 MiB conversation is measured on the event
    loop without stalling it. An object referred to twice counts twice."""
    total, todo = 0, [stored.response, stored.conversation]
    while todo:
        item = todo.pop()
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            todo += item.keys()
            todo += item.values()
        elif isinstance(item, (list, tuple)):
            todo += item
    return total


class _Shelf:
    """One tenant's responses, least recently used first, and their totals."""

    def __init__(self):
        self.by_id: OrderedDict[str, StoredResponse] = OrderedDict()
        self.tokens = 0
        self.size = 0


class ResponseStore:
    """Recent responses by id, bounded by count, tokens and bytes in all and
    by bytes per tenant. In memory: a restart forgets. Each response belongs
    to the API key's tenant that made it (`tenant`,
    router/guards/http_guard.py): another key's caller cannot read, delete or
    continue it, and is told it does not exist.

    Eviction is per tenant: a tenant past its own byte share drops its own
    least recently used responses; past a bound on all, the tenant holding
    the most of what is over (responses, tokens or bytes) drops its least
    recently used. So no tenant's puts evict a tenant that holds less than
    it: one key cannot push another's conversations out."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_tokens: int = MAX_STORED_TOKENS,
                 max_bytes: int = MAX_STORED_BYTES, max_key_bytes: int = MAX_KEY_BYTES):
        self.max_responses = max_responses
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.max_key_bytes = min(max_key_bytes, max_bytes)
        self._shelves: dict[str, _Shelf] = {}
        self.count = 0
        self.tokens = 0
        self.size = 0
        self.refused = 0  # responses larger than a tenant's share alone: not kept

    @classmethod
    def from_settings(cls, settings) -> "ResponseStore":
        return cls(max_bytes=settings.stored_responses_bytes, max_key_bytes=settings.stored_responses_key_bytes)

    def of(self, tenant: str) -> "TenantResponses":
        """The responses of one tenant ("": no API keys configured)."""
        return TenantResponses(self, tenant)

    def put(self, stored: StoredResponse, tenant: str = "") -> None:
        response_id = stored.response["id"]
        self.delete(response_id, tenant)
        stored.size = held_bytes(stored)
        if stored.size > self.max_key_bytes or stored.tokens > self.max_tokens:
            self.refused += 1
            log.info("response %s not stored: %d bytes, %d tokens, past what one key may keep (%d bytes)",
                     response_id, stored.size, stored.tokens, self.max_key_bytes)
            return
        shelf = self._shelves.setdefault(tenant, _Shelf())
        shelf.by_id[response_id] = stored
        self._count(shelf, stored, 1)
        while shelf.size > self.max_key_bytes:  # the tenant's own share: its own oldest go
            self._drop_oldest(tenant)
        while self.count > 1 and (self.count > self.max_responses or self.tokens > self.max_tokens
                                  or self.size > self.max_bytes):
            self._drop_oldest(self._largest())

    def get(self, response_id: str, param: str | None = None, tenant: str = "") -> StoredResponse:
        shelf = self._shelves.get(tenant)
        stored = shelf.by_id.get(response_id) if shelf is not None else None
        if stored is None:
            raise ApiError(404, f"Response with id '{response_id}' not found. Tandem keeps recent responses in "
                           "memory only (not after a restart, nor with store=false).", param=param,
                           code="response_not_found")
        try:
            shelf.by_id.move_to_end(response_id)
        except KeyError:  # dropped meanwhile by the event loop (responses_turn runs in a thread)
            pass
        return stored

    def delete(self, response_id: str, tenant: str = "") -> bool:
        shelf = self._shelves.get(tenant)
        dropped = shelf.by_id.pop(response_id, None) if shelf is not None else None
        if dropped is None:
            return False
        self._count(shelf, dropped, -1)
        if not shelf.by_id:
            del self._shelves[tenant]
        return True

    def held(self, tenant: str) -> int:
        """Bytes a tenant's responses hold."""
        shelf = self._shelves.get(tenant)
        return shelf.size if shelf is not None else 0

    def __len__(self) -> int:
        return self.count

    def _count(self, shelf: _Shelf, stored: StoredResponse, sign: int) -> None:
        shelf.tokens += sign * stored.tokens
        shelf.size += sign * stored.size
        self.count += sign
        self.tokens += sign * stored.tokens
        self.size += sign * stored.size

    def _largest(self) -> str:
        """The tenant holding the most of what is over the bounds on all."""
        if self.size > self.max_bytes:
            return max(self._shelves, key=lambda t: self._shelves[t].size)
        if self.tokens > self.max_tokens:
            return max(self._shelves, key=lambda t: self._shelves[t].tokens)
        return max(self._shelves, key=lambda t: len(self._shelves[t].by_id))

    def _drop_oldest(self, tenant: str) -> None:
        shelf = self._shelves[tenant]
        _, dropped = shelf.by_id.popitem(last=False)  # one call: a thread's get may move an item meanwhile
        self._count(shelf, dropped, -1)
        if not shelf.by_id:
            del self._shelves[tenant]


@dataclass
class TenantResponses:
    """ResponseStore's put / get / delete for one tenant."""

    store: ResponseStore
    tenant: str

    def put(self, stored: StoredResponse) -> None:
        self.store.put(stored, self.tenant)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        return self.store.get(response_id, param, self.tenant)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id, self.tenant)
