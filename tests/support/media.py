"""Media for tests: files with real encoded bytes, and the real web servers and the resolver
double the SSRF tests point URLs at."""

from __future__ import annotations

import functools
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest


def make_video(path: Path, frames: int, fps: float = 10.0, size: tuple[int, int] = (64, 48)) -> bytes:
    """An MPEG-4 Part 2 video (the encoder every opencv-python wheel has): frame i is gray level
    (4 * i) % 256 with a white square moving one pixel per frame."""
    cv2 = pytest.importorskip("cv2", reason="video needs opencv-python")
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    if not writer.isOpened():
        pytest.skip("this OpenCV build has no mp4v encoder")
    width, height = size
    for i in range(frames):
        frame = np.full((height, width, 3), (4 * i) % 256, np.uint8)
        frame[8:16, i % (width - 8): i % (width - 8) + 8] = 255
        writer.write(frame)
    writer.release()
    return path.read_bytes()


# --------------------------------------------------------------------------- #
# Hosts and names for the SSRF tests (tests/router/test_media_ssrf.py)
# --------------------------------------------------------------------------- #


class MediaHost:
    """A real HTTP server on `address` (a thread) that records every request it gets, as
    (path, Host header), and answers:
    - a path in `files`: 200 with its bytes;
    - /redirect?to=URL: 302 to URL;
    - /slow: 200 after 3 s;
    - /held: `held_body` in full but its last byte, which waits for `release` (set it);
    - anything else: 404.
    With `tls` (a server-side SSLContext) it speaks https, and records the SNI names clients send."""

    def __init__(self, address: str = "127.0.0.1", port: int = 0, files: dict[str, bytes] | None = None,
                 tls: ssl.SSLContext | None = None):
        self.requests: list[tuple[str, str]] = []
        self.sni: list[str | None] = []
        self.files = dict(files or {})
        self.held_body = b""
        self.release = threading.Event()
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        server_class = type("Server", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True,
                                                                 "handle_error": lambda *a: None})
        self.server = server_class((address, port), functools.partial(_MediaHostHandler, self))
        self.address, self.port = address, self.server.server_address[1]
        self.scheme = "https" if tls else "http"
        if tls:
            tls.sni_callback = lambda _socket, name, _context: self.sni.append(name)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def url(self, path: str, host: str | None = None) -> str:
        host = host or (f"[{self.address}]" if ":" in self.address else self.address)
        return f"{self.scheme}://{host}:{self.port}{path}"

    def __enter__(self) -> MediaHost:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class _MediaHostHandler(BaseHTTPRequestHandler):
    def __init__(self, host: MediaHost, *args, **kwargs):
        self.host = host
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:
        self.host.requests.append((self.path, self.headers.get("Host", "")))
        path, _, query = self.path.partition("?")
        if path in self.host.files:
            return self._send(200, self.host.files[path])
        if path == "/redirect":
            self.send_response(302)
            self.send_header("Location", unquote(query.removeprefix("to=")))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if path == "/slow":
            time.sleep(3)
            return self._send(200, b"late")
        if path == "/held":
            body = self.host.held_body
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:-1])
            self.wfile.flush()
            self.host.release.wait(30)
            self.wfile.write(body[-1:])
            return None
        return self._send(404, b"not found")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class FakeDNS:
    """A double for the system resolver (install over `socket.getaddrinfo`): each name in
    `answers` resolves to its addresses, a list, or a list of lists given one per lookup (the
    last one repeats): a rebinding name server. A name mapped to None does not exist. Other
    names (IP literals, localhost) go to the real resolver. `lookups` counts lookups per name."""

    def __init__(self, answers: dict[str, list | None]):
        self.answers = answers
        self.lookups: dict[str, int] = {}
        self.real = socket.getaddrinfo

    def __call__(self, host, port, family=0, type=0, proto=0, flags=0):
        name = host.decode() if isinstance(host, bytes) else host
        if name not in self.answers:
            return self.real(host, port, family, type, proto, flags)
        count = self.lookups[name] = self.lookups.get(name, 0) + 1
        answer = self.answers[name]
        if answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if answer and isinstance(answer[0], list):
            answer = answer[min(count, len(answer)) - 1]
        out = []
        for address in answer:
            v6 = ":" in address
            out.append((socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                        (address, int(port or 0), 0, 0) if v6 else (address, int(port or 0))))
        return out


def tls_certificate(folder: Path, host_name: str) -> tuple[Path, Path, Path]:
    """A test CA and a certificate for `host_name` it signed: (CA file, certificate file, key
    file), PEM, in `folder`."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False,
                decipher_only=False), critical=True)
        else:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("Tandem test CA", ca_key, "Tandem test CA", ca_key, ca=True)
    leaf = certificate(host_name, key, "Tandem test CA", ca_key, ca=False)
    files = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    files[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    files[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return files
