"""A request's cache salt: which prefix cache it reads and fills.

The prefix cache is shared by default, and it answers exactly: a caller who
sees `cached_tokens` (or a faster first token) learns that someone sent the
same prompt before. Callers who must not learn that from each other get
different salts: the KV of a salted request is keyed under its salt
(workers/kv/block_hash.py chain_seed), so it is found only by requests of the
same salt.

Two things make the salt:
- the tenant: with several API keys, one per key (the API-key middleware puts
  it in the ASGI scope's state as "cache_tenant"; "" without keys), so callers
  with different keys never share cached KV;
- the request's `cache_salt` field (as vLLM has it), so callers of one key can
  keep apart too, or share on purpose by sending the same string.

With neither, the salt is "" and the cache is the shared one, its keys those
of before salts existed.
"""

from __future__ import annotations

import hashlib

from router.api.errors import invalid

MAX_CACHE_SALT_CHARS = 256
_TAG = b"tandem cache salt v1"


def effective_salt(tenant: str, field: str) -> str:
    """One opaque string for the tenant and the field ("" when both are "").
    Length-prefixed parts: no tenant and field pair can pass for another."""
    if not tenant and not field:
        return ""
    h = hashlib.sha256(_TAG)
    for part in (tenant, field):
        raw = part.encode("utf-8", "surrogatepass")
        h.update(len(raw).to_bytes(4, "little") + raw)
    return h.hexdigest()


def tenant_of(request) -> str:
    """The request's cache tenant, as the API-key middleware left it."""
    tenant = request.scope.get("state", {}).get("cache_tenant", "")
    return tenant if isinstance(tenant, str) else ""


def request_salt(request, field: str) -> str:
    """The salt a request's generation runs under: its tenant's and its field's."""
    return effective_salt(tenant_of(request), field)


def check_cache_salt(value: str) -> str:
    """A `cache_salt` field's value (already known to be a string): at most
    MAX_CACHE_SALT_CHARS characters, else a 400 naming the field."""
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise invalid("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters, but got {len(value)}")
    return value
