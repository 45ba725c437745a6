"""SSRF, written as the attack: a chat request's image URL aimed at the server's own machine
or network, directly, through numeric and IPv6 spellings, through a redirect from a host the
server may fetch from, and through a name server that answers differently the second time.
A real HTTP server on 127.0.0.1 (`target`) stands for what must stay unreachable: it must see
no request at all. Doubles, named as such: `FakeDNS` (tests/support/media.py) stands in for
the system resolver, and a server on 127.0.0.1 reached as "public.test" (allowed by name with
--allow-media-hosts) stands in for a public host, since the tests have no internet."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import socket
from dataclasses import replace
from urllib.parse import quote

import numpy as np
import pytest
from PIL import Image

from environment.settings import Settings
from router.media.decode import MediaError, MediaLimits, image_content_hash
from router.media.fetch import HostPolicy, is_public
from router.media.parts import FETCH_FAILED, load_media_parts
from tests.support.media import FakeDNS, MediaHost

PICTURE = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
LIMITS = MediaLimits(fetch_timeout_s=2.0)


def png(pixels: np.ndarray = PICTURE) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def load(url: str, limits: MediaLimits = LIMITS) -> list:
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    return asyncio.run(load_media_parts(messages, limits))


def refusal(url: str, limits: MediaLimits = LIMITS) -> tuple:
    """What a client learns from a refused URL: status, message, code, param."""
    with pytest.raises(MediaError) as caught:
        load(url, limits)
    error = caught.value
    return error.status, error.message, error.code, error.param


SAME_REFUSAL = (400, f"messages[0].content[1].image_url: {FETCH_FAILED}", "media_fetch_failed",
                "messages[0].content[1].image_url")


@pytest.fixture
def target():
    """What must stay unreachable: a real server on 127.0.0.1 with the picture."""
    with MediaHost("127.0.0.1", files={"/pic.png": png()}) as host:
        yield host


@pytest.fixture
def dns(monkeypatch):
    fake = FakeDNS({"missing.test": None})
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return fake


def bindable(address: str) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- #
# Addresses
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("::ffff:8.8.8.8", True), ("64:ff9b::808:808", True),
    ("127.0.0.1", False), ("127.255.0.7", False), ("0.0.0.0", False), ("10.1.2.3", False), ("172.16.0.1", False),
    ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False), ("100.127.255.254", False),
    ("224.0.0.1", False), ("239.255.255.250", False), ("240.0.0.1", False), ("255.255.255.255", False),
    ("192.0.2.1", False), ("198.18.0.1", False),
    ("::1", False), ("::", False), ("fe80::1", False), ("fc00::1", False), ("fd12:3456::1", False),
    ("fec0::1", False), ("ff02::1", False), ("ff0e::1", False), ("2001:db8::1", False), ("100::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:169.254.169.254", False), ("::ffff:10.0.0.1", False),
    ("::127.0.0.1", False),  # IPv4-compatible (deprecated)
    ("64:ff9b::7f00:1", False), ("64:ff9b::a9fe:a9fe", False),  # NAT64 of 127.0.0.1, 169.254.169.254
    ("2002:7f00:1::1", False), ("2002:a9fe:a9fe::1", False),  # 6to4 of 127.0.0.1, 169.254.169.254
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", False),  # Teredo (client 127.0.0.1)
])
def test_only_public_unicast_addresses_are_public(address, public):
    assert is_public(ipaddress.ip_address(address)) is public


# --------------------------------------------------------------------------- #
# Direct
# --------------------------------------------------------------------------- #


def test_private_urls_never_reach_the_server_in_any_spelling(target, dns):
    port = target.port
    urls = [
        f"http://127.0.0.1:{port}/pic.png", f"http://localhost:{port}/pic.png", f"http://LocalHost.:{port}/pic.png",
        f"http://2130706433:{port}/pic.png", f"http://0x7f.1:{port}/pic.png", f"http://0x7f000001:{port}/pic.png",
        f"http://0177.1:{port}/pic.png", f"http://127.1:{port}/pic.png", f"http://0:{port}/pic.png",
        f"http://[::ffff:127.0.0.1]:{port}/pic.png", f"http://[::ffff:7f00:1]:{port}/pic.png",
        f"http://user:secret@127.0.0.1:{port}/pic.png", f"https://127.0.0.1:{port}/pic.png",
        "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/pic.png", "http://[fd00::1]/pic.png",
    ]
    for url in urls:
        assert refusal(url) == SAME_REFUSAL, url
    # Dotted quads with leading zeros (octal to inet_aton) the URL parser refuses outright.
    status, message, _, _ = refusal(f"http://0177.0.0.1:{port}/pic.png")
    assert status == 400 and message.endswith("is not a valid URL")
    assert target.requests == []

    # The control: opened to loopback, the same spellings do reach it (the test can fail).
    loopback = replace(LIMITS, allowed_hosts=HostPolicy.parse(["127.0.0.0/8"]))
    for url in urls[3:7]:
        (image,) = load(url, loopback)
        assert image.content_hash == image_content_hash(PICTURE), url
    assert len(target.requests) == 4


@pytest.mark.skipif(not bindable("::1"), reason="no IPv6 loopback here")
def test_ipv6_loopback_is_never_reached():
    with MediaHost("::1", files={"/pic.png": png()}) as target6:
        assert refusal(target6.url("/pic.png")) == SAME_REFUSAL
        assert target6.requests == []
        (image,) = load(target6.url("/pic.png"), replace(LIMITS, allowed_hosts=HostPolicy.parse(["::1"])))
        assert image.content_hash == image_content_hash(PICTURE) and len(target6.requests) == 1


# --------------------------------------------------------------------------- #
# Redirects
# --------------------------------------------------------------------------- #


def test_a_redirect_from_an_allowed_host_to_a_private_one_is_not_followed(target, dns):
    dns.answers["public.test"] = ["127.0.0.1"]
    limits = replace(LIMITS, allowed_hosts=HostPolicy.parse(["public.test"]))
    with MediaHost("127.0.0.1", files={"/pic.png": png()}) as public:
        def via(to: str) -> str:
            return public.url(f"/redirect?to={quote(to, safe='')}", host="public.test")

        port = target.port
        for to in (f"http://127.0.0.1:{port}/pic.png", f"http://localhost:{port}/pic.png",
                   f"http://2130706433:{port}/pic.png", f"http://[::ffff:127.0.0.1]:{port}/pic.png",
                   "http://169.254.169.254/latest/meta-data/", f"file://{__file__}", "ftp://127.0.0.1/pic.png",
                   "data:image/png;base64,iVBORw0KGgo=", via(f"http://127.0.0.1:{port}/pic.png")):
            assert refusal(via(to), limits) == SAME_REFUSAL, to
        assert target.requests == []
        assert len(public.requests) == 10  # every hop from the allowed host was made, none past it

        # The control: a redirect within the allowed host is followed, the Host header its name.
        (image,) = load(via(public.url("/pic.png", host="public.test")), limits)
        assert image.content_hash == image_content_hash(PICTURE)
        assert public.requests[-1] == ("/pic.png", f"public.test:{public.port}")
        # Hops are bounded: 4 redirects where 3 are allowed.
        chain = public.url("/pic.png", host="public.test")
        for _ in range(4):
            chain = via(chain)
        assert refusal(chain, limits) == SAME_REFUSAL


# --------------------------------------------------------------------------- #
# DNS rebinding: the address checked is the address connected to
# --------------------------------------------------------------------------- #


@pytest.mark.skipif(not bindable("127.0.0.2"), reason="127.0.0.2 is not a loopback address here")
def test_a_name_that_rebinds_after_the_check_is_fetched_from_the_checked_address(dns):
    # The "public" host is 127.0.0.2, allowed as a network; the target, 127.0.0.1, is not.
    with MediaHost("127.0.0.2", files={"/pic.png": png()}) as public:
        with MediaHost("127.0.0.1", public.port, files={"/pic.png": png(255 - PICTURE)}) as target:
            limits = replace(LIMITS, allowed_hosts=HostPolicy.parse(["127.0.0.2"]))
            # First lookup: the allowed address; every later one: the private target.
            dns.answers["rebind.test"] = [["127.0.0.2"], ["127.0.0.1"]]
            (image,) = load(public.url("/pic.png", host="rebind.test"), limits)
            assert image.content_hash == image_content_hash(PICTURE)  # the public host's picture
            assert target.requests == []
            assert public.requests == [("/pic.png", f"rebind.test:{public.port}")]
            assert dns.lookups["rebind.test"] == 1

            # One answer holding an allowed and a private address: refused, nobody asked.
            dns.answers["mixed.test"] = ["127.0.0.2", "127.0.0.1"]
            assert refusal(public.url("/pic.png", host="mixed.test"), limits) == SAME_REFUSAL
            assert target.requests == [] and len(public.requests) == 1


# --------------------------------------------------------------------------- #
# One answer for every failure
# --------------------------------------------------------------------------- #


def test_every_failure_gives_the_same_answer(target, dns):
    """Blocked, closed, unknown, slow, missing, not an image, badly redirected: a client
    learns nothing from the answer about which (the server's log says)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once it is closed
    target.files["/text"] = b"<html>an admin page</html>"
    dns.answers["open.test"] = ["127.0.0.1"]
    limits = replace(LIMITS, fetch_timeout_s=0.5, allowed_hosts=HostPolicy.parse(["open.test"]))
    urls = {
        "blocked address": f"http://127.0.0.1:{target.port}/pic.png",
        "closed port": f"http://open.test:{closed}/pic.png",
        "unknown host": "http://missing.test/pic.png",
        "timeout": target.url("/slow", host="open.test"),
        "HTTP 404": target.url("/missing", host="open.test"),
        "not an image": target.url("/text", host="open.test"),
        "redirect to file://": target.url(f"/redirect?to={quote('file:///etc/passwd', safe='')}", host="open.test"),
    }
    answers = {why: refusal(url, limits) for why, url in urls.items()}
    assert answers == {why: SAME_REFUSAL for why in urls}
    assert [path for path, _ in target.requests] == [
        "/slow", "/missing", "/text", "/redirect?to=file%3A%2F%2F%2Fetc%2Fpasswd"]  # none for the blocked one


# --------------------------------------------------------------------------- #
# --allow-media-hosts
# --------------------------------------------------------------------------- #


def test_allow_media_hosts_opens_named_hosts_and_networks(target, dns):
    dns.answers["images.internal"] = ["127.0.0.1"]
    for entries, host in [(["127.0.0.1"], "127.0.0.1"), (["127.0.0.0/8"], "127.0.0.1"),
                          (["IMAGES.Internal"], "images.internal"), (["images.internal."], "Images.Internal")]:
        limits = MediaLimits.from_settings(Settings(allow_media_hosts=tuple(entries)))
        (image,) = load(target.url("/pic.png", host=host), limits)
        assert image.content_hash == image_content_hash(PICTURE) and image.source == "http", entries
    assert len(target.requests) == 4
    # A name opens only that name, a network only its addresses.
    assert refusal(target.url("/pic.png", host="localhost"), replace(LIMITS, allowed_hosts=HostPolicy.parse(
        ["images.internal", "10.0.0.0/8"]))) == SAME_REFUSAL
    assert len(target.requests) == 4

    policy = HostPolicy.parse(["Images.Internal", "10.1.0.0/16", "::1", " 192.168.1.7 "])
    assert policy.names == {"images.internal"}
    assert [str(n) for n in policy.networks] == ["10.1.0.0/16", "::1/128", "192.168.1.7/32"]
    for bad in ("10.0.0.0/33", "images.internal:8080", "user@host", "a b", "", "*", "*.example.com"):
        with pytest.raises(ValueError, match="--allow-media-hosts"):
            HostPolicy.parse([bad])


# --------------------------------------------------------------------------- #
# https: pinned to the checked address, verified against the URL's host name
# --------------------------------------------------------------------------- #


def test_https_is_pinned_yet_verified_against_the_host_name(dns, tmp_path, monkeypatch):
    import ssl

    import router.media.fetch as media_fetch
    from tests.support.media import tls_certificate

    ca, cert, key = tls_certificate(tmp_path, "images.test")
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(ca))  # a double for the system's CA bundle
    monkeypatch.setattr(media_fetch, "_tls_context", lambda: trusting)
    dns.answers.update({"images.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    limits = replace(LIMITS, allowed_hosts=HostPolicy.parse(["images.test", "other.test"]))
    with MediaHost("127.0.0.1", files={"/pic.png": png()}, tls=server_tls) as host:
        (image,) = load(host.url("/pic.png", host="images.test"), limits)
        assert image.content_hash == image_content_hash(PICTURE)
        assert host.sni == ["images.test"]  # connected to 127.0.0.1, introduced as the URL's host
        assert host.requests == [("/pic.png", f"images.test:{host.port}")]
        # The certificate is for images.test: the same address under another name is refused.
        assert refusal(host.url("/pic.png", host="other.test"), limits) == SAME_REFUSAL
        assert host.sni == ["images.test", "other.test"] and len(host.requests) == 1
