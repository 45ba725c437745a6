"""The HTTP listening socket `tandem serve` keeps for its whole life.

The supervisor, not the router, owns it: bound once here, or handed over by
systemd (a .socket unit: LISTEN_FDS) or launchd (the plist's `Sockets`:
`launch_activate_socket`), and passed to every router it starts. While a
crashed router is restarted the port stays open: new connections wait in the
kernel's backlog for the next router instead of being refused. With socket
activation the service manager holds the port even across a whole restart.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys
from dataclasses import dataclass

BACKLOG = 2048  # uvicorn's default; the kernel caps it (somaxconn)
SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): systemd's first passed descriptor
SYSTEMD_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# Set by the plist written with socket activation: the name of its `Sockets`
# entry. Explicit, because launch_activate_socket is only meaningful for a
# job launchd started with that entry.
LAUNCHD_SOCKET_ENV = "TANDEM_LAUNCHD_SOCKET"
LIBSYSTEM = "/usr/lib/libSystem.B.dylib"


class ListenError(Exception):
    """No socket to serve on; the message says why and what to do."""


@dataclass
class Listeners:
    sockets: list
    origin: str  # "bound", "systemd" or "launchd"

    def addresses(self) -> str:
        names = []
        for sock in self.sockets:
            try:
                host, port = sock.getsockname()[:2]
            except OSError:
                continue
            names.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        return ", ".join(names)

    def port(self) -> int | None:
        try:
            return self.sockets[0].getsockname()[1]
        except (OSError, IndexError):
            return None

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def open_listeners(host: str, port: int, environ=os.environ) -> Listeners:
    """Systemd's sockets if it passed this process some, else launchd's when the
    plist named one, else a socket bound to host:port here."""
    passed = systemd_sockets(environ)
    if passed is not None:
        return Listeners(passed, "systemd")
    name = environ.get(LAUNCHD_SOCKET_ENV)
    if name:
        return Listeners(launchd_sockets(name), "launchd")
    return Listeners([bind(host, port)], "bound")


def bind(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """A listening TCP socket on host:port (as uvicorn would bind it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(f"port {port} on {host} is already in use (another tandem serve, or another "
                              f"server): stop it or pass another --port") from exc
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


def systemd_sockets(environ=os.environ) -> list | None:
    """The stream sockets systemd passed (sd_listen_fds(3)), or None when it
    passed none to this process. The variables are removed once taken, so no
    child process takes them for its own."""
    pid, count = environ.get("LISTEN_PID"), environ.get("LISTEN_FDS")
    if not pid or not count or pid.strip() != str(os.getpid()):
        return None
    for var in SYSTEMD_VARS:
        environ.pop(var, None)
    try:
        n = int(count)
    except ValueError:
        raise ListenError(f"systemd passed LISTEN_FDS={count!r}, not a number") from None
    if n < 1:
        return None
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n):
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise ListenError(f"systemd's descriptor {fd} is not a socket ({exc.strerror or exc}): "
                              f"check the .socket unit") from exc
        if sock.type != socket.SOCK_STREAM:
            sock.detach()
            raise ListenError(f"systemd's descriptor {fd} is not a stream socket: the .socket unit needs ListenStream=")
        sock.set_inheritable(False)  # spawned children get it only when handed it
        sockets.append(sock)
    return sockets


def launchd_sockets(name: str, lib=None) -> list:
    """The sockets of the plist's `Sockets` entry `name`, from launchd's
    `launch_activate_socket` (libSystem, through ctypes; macOS only). `lib`:
    what provides `launch_activate_socket` and `free` (tests pass a double)."""
    lib = lib if lib is not None else libsystem()
    fds = ctypes.POINTER(ctypes.c_int)()
    count = ctypes.c_size_t(0)
    err = lib.launch_activate_socket(name.encode(), ctypes.byref(fds), ctypes.byref(count))
    if err != 0:
        raise ListenError(f"launchd gave no socket {name!r}: {os.strerror(err)} (the plist's Sockets must have "
                          f"this entry, and the job must be started by launchd)")
    try:
        numbers = [fds[i] for i in range(count.value)]
    finally:
        lib.free(fds)
    if not numbers:
        raise ListenError(f"launchd's socket entry {name!r} holds no socket")
    sockets = [socket.socket(fileno=fd) for fd in numbers]
    for sock in sockets:
        sock.set_inheritable(False)
    return sockets


def libsystem():
    """libSystem with `launch_activate_socket` typed; a clear error off macOS."""
    if sys.platform != "darwin":
        raise ListenError(f"launchd socket activation ({LAUNCHD_SOCKET_ENV}) needs macOS; this is {sys.platform}")
    try:
        lib = ctypes.CDLL(LIBSYSTEM)
        activate = lib.launch_activate_socket
    except (OSError, AttributeError) as exc:
        raise ListenError(f"launch_activate_socket is not in {LIBSYSTEM} (macOS 10.10 or later): {exc}") from exc
    activate.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)),
                         ctypes.POINTER(ctypes.c_size_t)]
    activate.restype = ctypes.c_int
    lib.free.argtypes = [ctypes.c_void_p]
    lib.free.restype = None
    return lib
