"""http(s) media fetched so that a client cannot turn the server against its own network (SSRF).

The client picks the URL, and the server fetches it from inside: without care, a chat request
could make it read 127.0.0.1, the cloud metadata service at 169.254.169.254 or the LAN, and tell
open ports from closed ones by the answer. So, for the URL and every redirect it leads to:

- the host is resolved here (in a small thread pool of its own, under the fetch's deadline:
  a slow name server cannot take the threads decoding needs), and EVERY address it resolves to
  must be public (`is_public`), unless `--allow-media-hosts` names the host or a network holding
  the address (`HostPolicy`);
- the connection goes to an address that was checked (the URL's host replaced by it), never
  to a second resolution a rebinding name server could answer differently; the Host header,
  TLS SNI and the certificate check still use the URL's host name;
- redirects are followed here, each hop checked the same way, at most `max_redirects`, and
  only to http(s);
- numeric hosts in the forms inet_aton takes (`2130706433`, `0x7f.1`, `127.1`) go through the
  resolver like any name, so what is checked is the address they really mean.

Every refusal of this module is one exception, `Unfetchable`, whose reason is only for the
server's log: router/media/parts.py answers all of them with one text, so blocked addresses,
closed ports, unknown hosts, timeouts and HTTP errors look alike to the client. `TooLarge`
(the size limit) is told apart: only an allowed host that answered can cause it.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from router.media.budget import NoRoom, PixelBudget

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

REDIRECTS = (301, 302, 303, 307, 308)
# Addresses of one host tried in turn when a connection fails (all of them checked first).
MAX_ADDRESSES = 4
# The well-known NAT64 prefix (RFC 6052): its addresses stand for the IPv4 address in their
# last 32 bits, so that IPv4 address is the one to judge.
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# Resolving names blocks a thread; these threads do nothing else.
_RESOLVERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tandem-media-dns")


class Unfetchable(Exception):
    """The media cannot be fetched; the message is the real reason, for the server's log only."""


class TooLarge(Exception):
    """The body is larger than the limit (declared, or counted as it arrived)."""


# --------------------------------------------------------------------------- #
# Which addresses
# --------------------------------------------------------------------------- #


def is_public(address: Address) -> bool:
    """Whether `address` is a public unicast address of the internet: not loopback, private,
    link-local (169.254.169.254, fe80::/10), shared (CGNAT 100.64/10), multicast, reserved,
    unspecified, documentation or benchmarking, IPv6 ULA or site-local, and, for IPv6 forms that
    carry an IPv4 address (mapped, NAT64, 6to4, Teredo), not one of those either."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:  # ::ffff:a.b.c.d reaches a.b.c.d itself
            return is_public(address.ipv4_mapped)
        if address in NAT64:
            return is_public(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        embedded = [address.sixtofour] if address.sixtofour else []
        embedded += list(address.teredo or ())
        if address.is_site_local or not all(is_public(v4) for v4 in embedded):
            return False
    return (address.is_global and not address.is_multicast and not address.is_private
            and not address.is_reserved and not address.is_loopback and not address.is_link_local
            and not address.is_unspecified)


def _host_name(name: str) -> str:
    """A host name as compared: lower case, IDNA (punycode), no trailing dot."""
    try:
        raw = httpx.URL(f"http://{name}/").raw_host.decode("ascii")
    except (httpx.InvalidURL, UnicodeError) as exc:
        raise ValueError(f"--allow-media-hosts: {name!r} is not a host name") from exc
    if not raw or "%" in raw:
        raise ValueError(f"--allow-media-hosts: {name!r} is not a host name")
    return raw.rstrip(".")


@dataclass(frozen=True)
class HostPolicy:
    """Which hosts http(s) media may come from: public addresses, plus `--allow-media-hosts`:
    exact host names (case-insensitive; the name as the URL spells it, whatever it resolves
    to) and networks (CIDR, or one address)."""

    names: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, entries) -> HostPolicy:
        """From the option's entries, e.g. ("images.internal", "10.1.0.0/16", "::1");
        ValueError naming a bad one."""
        names, networks = set(), []
        for entry in entries:
            entry = str(entry).strip()
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if "*" in entry:
                raise ValueError(f"--allow-media-hosts: {entry!r}: no wildcards; name hosts exactly, or give "
                                 "networks (0.0.0.0/0,::/0 opens every address)")
            if not entry or "/" in entry or ":" in entry or "@" in entry:
                raise ValueError(f"--allow-media-hosts: {entry!r} is neither a host name nor a network (CIDR)")
            names.add(_host_name(entry))
        return cls(frozenset(names), tuple(networks))

    def allows(self, host: str, address: Address) -> bool:
        """Whether `host` (as compared: `_host_name`), resolved to `address`, may be fetched."""
        if host in self.names:
            return True
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # an allowed IPv4 network covers its mapped form
        return any(address in net for net in self.networks) or is_public(address)


async def resolve(host: str, port: int) -> list[Address]:
    """The addresses `host` names, in the resolver's order: an IP literal itself, anything else
    (numeric forms like 2130706433 included) as the system resolver (getaddrinfo) reads it."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.run_in_executor(_RESOLVERS, functools.partial(
            socket.getaddrinfo, host, port, type=socket.SOCK_STREAM))
    except (OSError, UnicodeError) as exc:
        raise Unfetchable(f"{host} does not resolve: {exc}") from None
    addresses: list[Address] = []
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if address not in addresses:
            addresses.append(address)
    return addresses


async def checked_addresses(url: httpx.URL, policy: HostPolicy) -> list[Address]:
    """The addresses of `url`'s host, all of them allowed, or Unfetchable."""
    if url.scheme not in ("http", "https"):
        raise Unfetchable(f"a redirect to a {url.scheme!r} URL")
    host = _url_host(url)
    addresses = await resolve(host, url.port or (443 if url.scheme == "https" else 80))
    refused = [str(a) for a in addresses if not policy.allows(host, a)]
    if refused or not addresses:
        raise Unfetchable(f"{host} resolves to {', '.join(refused) or 'nothing'}: not public, and not in "
                          "--allow-media-hosts")
    return addresses


def _url_host(url: httpx.URL) -> str:
    host = url.raw_host.decode("ascii").rstrip(".")
    if not host or "%" in host:  # no host, or escapes (a zone id, a space) no real host has
        raise Unfetchable(f"not a usable host: {host!r}")
    return host


# --------------------------------------------------------------------------- #
# Fetching
# --------------------------------------------------------------------------- #


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # One context for all fetches: building one loads the CA bundle (milliseconds each time).
    return httpx.create_ssl_context()


async def fetch_http(url: str, policy: HostPolicy, max_bytes: int, timeout_s: float, max_redirects: int,
                     budget: PixelBudget | None = None, where: str = "") -> bytes:
    """The body `url` answers with (HTTP 200), at most `max_bytes`, within `timeout_s` for the
    whole fetch (redirects, connecting, reading: not per read). With `budget` (the request's),
    its bytes are taken from the server's media memory as they arrive; a wait for room there has
    its own deadline and does not count against the fetch's.
    Unfetchable, TooLarge, or the budget's own errors."""
    try:
        async with (
            asyncio.timeout(timeout_s) as deadline,
            httpx.AsyncClient(follow_redirects=False, trust_env=False, verify=_tls_context(),
                              timeout=timeout_s) as client,
        ):
            target = httpx.URL(url)
            for _ in range(max_redirects + 1):
                response = await _send_pinned(client, target, policy)
                try:
                    if response.status_code not in REDIRECTS:
                        if response.status_code != 200:
                            raise Unfetchable(f"HTTP {response.status_code} from {target.host}")
                        return await _read_body(response, max_bytes, budget, where, deadline)
                    location = response.headers.get("location")
                    if not location:
                        raise Unfetchable(f"HTTP {response.status_code} from {target.host} with no Location")
                    target = target.join(location)
                finally:
                    await response.aclose()
            raise Unfetchable(f"more than {max_redirects} redirects")
    except TimeoutError:
        raise Unfetchable(f"no answer within {timeout_s:g} s") from None
    except (httpx.HTTPError, httpx.InvalidURL, OSError, UnicodeError, ValueError) as exc:
        # refused, reset, TLS (ssl.SSLError is an OSError), malformed answers or Location headers
        raise Unfetchable(f"{type(exc).__name__}: {exc}") from None


async def _send_pinned(client: httpx.AsyncClient, url: httpx.URL, policy: HostPolicy) -> httpx.Response:
    """GET `url` from one of its checked addresses: the URL's host replaced by the address, the
    Host header and (https) SNI and certificate check on the host name."""
    addresses = await checked_addresses(url, policy)
    host = _url_host(url)
    headers = {"Host": url.netloc.decode("ascii"), "Accept": "image/*, video/*;q=0.9, */*;q=0.5"}
    extensions = {"sni_hostname": host} if url.scheme == "https" else {}
    failed: Exception | None = None
    client.cookies.clear()  # kept by the address it came from: never to another host on that address
    for address in addresses[:MAX_ADDRESSES]:
        request = client.build_request("GET", url.copy_with(host=str(address)), headers=headers,
                                       extensions=extensions)
        try:
            return await client.send(request, stream=True)
        except httpx.ConnectError as exc:  # refused or unreachable: the next address
            failed = exc
    raise Unfetchable(f"could not connect to {host} ({', '.join(map(str, addresses))}): {failed}")


async def _read_body(response: httpx.Response, max_bytes: int, budget: PixelBudget | None, where: str,
                     deadline: asyncio.Timeout) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise TooLarge(f"Content-Length {declared}")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():  # decompressed: counts gzip bombs too
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"more than {max_bytes} bytes sent")
        if budget is not None:
            await _take_bytes(budget, len(chunk), where, deadline)
        chunks.append(chunk)
    return b"".join(chunks)


async def _take_bytes(budget: PixelBudget, nbytes: int, where: str, deadline: asyncio.Timeout) -> None:
    """`nbytes` from the media memory; a wait for them pauses the fetch's own deadline."""
    try:
        budget.take_bytes(nbytes, where)
        return
    except NoRoom as short:
        missing = short.nbytes
    loop = asyncio.get_running_loop()
    when, started = deadline.when(), loop.time()
    deadline.reschedule(None)
    try:
        await budget.wait_for_room(missing, where)
    finally:
        deadline.reschedule(None if when is None else when + loop.time() - started)
    budget.take_bytes(nbytes, where)
