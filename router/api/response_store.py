"""The store of recent responses (OpenAI's Responses API): what
`previous_response_id` continues, and what GET / DELETE
/v1/responses/{id} read and drop.

A stored response keeps its whole conversation as chat messages, the
answer's assistant message (calls included) last, so the next turn's prompt
begins with the earlier prompt and answer, whose KV the prefix cache holds.
Apart from the request's translation (responses_request.py) because it
outlives every request: one per router, bounded, per tenant.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from router.api.errors import ApiError

# The store's bounds: responses kept, and their conversations' tokens
# (conversations share their messages, so this overcounts the memory held).
MAX_STORED_RESPONSES = 4096
MAX_STORED_TOKENS = 16_000_000


@dataclass
class StoredResponse:
    response: dict  # the response object as sent (GET /v1/responses/{id})
    conversation: list[dict]  # chat messages, the answer last; instructions not among them
    tokens: int  # the conversation's length in tokens, prompt and answer


class ResponseStore:
    """Recent responses by id, least recently used dropped first, bounded by
    count and by their conversations' tokens. In memory: a restart forgets.
    Each response belongs to the API key's tenant that made it (`tenant`,
    router/guards/http_guard.py): another key's caller cannot read, delete or
    continue it, and is told it does not exist."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_tokens: int = MAX_STORED_TOKENS):
        self.max_responses = max_responses
        self.max_tokens = max_tokens
        self._by_id: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._tokens = 0

    def of(self, tenant: str) -> "TenantResponses":
        """The responses of one tenant ("": no API keys configured)."""
        return TenantResponses(self, tenant)

    def put(self, stored: StoredResponse, tenant: str = "") -> None:
        self.delete(stored.response["id"], tenant)
        self._by_id[tenant, stored.response["id"]] = stored
        self._tokens += stored.tokens
        while self._by_id and (len(self._by_id) > self.max_responses or self._tokens > self.max_tokens):
            _, dropped = self._by_id.popitem(last=False)
            self._tokens -= dropped.tokens

    def get(self, response_id: str, param: str | None = None, tenant: str = "") -> StoredResponse:
        stored = self._by_id.get((tenant, response_id))
        if stored is None:
            raise ApiError(404, f"Response with id '{response_id}' not found. Tandem keeps recent responses in "
                           "memory only (not after a restart, nor with store=false).", param=param,
                           code="response_not_found")
        try:
            self._by_id.move_to_end((tenant, response_id))
        except KeyError:  # dropped meanwhile by the event loop (responses_turn runs in a thread)
            pass
        return stored

    def delete(self, response_id: str, tenant: str = "") -> bool:
        dropped = self._by_id.pop((tenant, response_id), None)
        if dropped is not None:
            self._tokens -= dropped.tokens
        return dropped is not None

    def __len__(self) -> int:
        return len(self._by_id)


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
