"""Where the supervisor's listening socket comes from (deploy/service/listen_socket.py):
bound here, systemd's LISTEN_FDS (the real handoff through
systemd-socket-activate: tests/deploy/test_supervisor_socket.py), launchd's
launch_activate_socket through ctypes.

launch_activate_socket exists only in macOS's libSystem: here it is a double,
a C-callable ctypes function with its prototype that hands out a malloc'd
array of descriptors as launchd does, so everything up to the platform call
(argument passing, reading the array, freeing it, the sockets made of it) runs
for real. Off macOS the real path says clearly that it needs macOS."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys

import pytest

from deploy.service import listen_socket
from deploy.service.listen_socket import LAUNCHD_SOCKET_ENV, ListenError, launchd_sockets, open_listeners

LIBC = ctypes.CDLL(None)
LIBC.malloc.restype = ctypes.c_void_p
LIBC.malloc.argtypes = [ctypes.c_size_t]
LIBC.free.argtypes = [ctypes.c_void_p]
ACTIVATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)),
                            ctypes.POINTER(ctypes.c_size_t))
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class FakeLaunchd:
    """libSystem's launch_activate_socket and free, as C functions."""

    def __init__(self, fds: list, error: int = 0):
        self.names, self.allocated, self.freed = [], [], []

        @ACTIVATE
        def activate(name, fds_out, count_out):
            self.names.append(name)
            if error:
                return error
            array = ctypes.cast(LIBC.malloc(ctypes.sizeof(ctypes.c_int) * max(1, len(fds))),
                                ctypes.POINTER(ctypes.c_int))
            for i, fd in enumerate(fds):
                array[i] = fd
            fds_out[0] = array
            count_out[0] = len(fds)
            self.allocated.append(ctypes.cast(array, ctypes.c_void_p).value)
            return 0

        @FREE
        def free(pointer):
            self.freed.append(pointer)
            LIBC.free(pointer)

        self.launch_activate_socket, self.free = activate, free


@pytest.fixture
def listening():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_launchd_sockets_come_out_of_the_array_it_hands_over_and_the_array_is_freed(listening):
    fake = FakeLaunchd([os.dup(listening.fileno()), os.dup(listening.fileno())])
    sockets = launchd_sockets("Listeners", lib=fake)
    try:
        assert fake.names == [b"Listeners"]
        assert fake.freed == fake.allocated and len(fake.freed) == 1
        assert [s.getsockname() for s in sockets] == [listening.getsockname()] * 2
        assert all(s.type == socket.SOCK_STREAM and not s.get_inheritable() for s in sockets)
    finally:
        for s in sockets:
            s.close()


@pytest.mark.parametrize("error, said", [(errno.ENOENT, "No such file"), (errno.ESRCH, "No such process")])
def test_launchd_refusing_says_why(error, said):
    fake = FakeLaunchd([], error=error)
    with pytest.raises(ListenError, match=f"launchd gave no socket 'Listeners': {said}.*Sockets"):
        launchd_sockets("Listeners", lib=fake)
    assert fake.freed == []


def test_an_empty_launchd_entry_is_an_error_not_a_server_without_a_port():
    fake = FakeLaunchd([])
    with pytest.raises(ListenError, match="holds no socket"):
        launchd_sockets("Listeners", lib=fake)
    assert fake.freed == fake.allocated


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the error off macOS")
def test_off_macos_the_launchd_socket_asked_for_is_a_clear_error():
    with pytest.raises(ListenError, match="needs macOS"):
        open_listeners("127.0.0.1", 0, environ={LAUNCHD_SOCKET_ENV: "Listeners"})


def test_without_activation_the_port_is_bound_here_and_a_taken_one_says_so(listening):
    mine = open_listeners("127.0.0.1", 0, environ={})
    try:
        assert mine.origin == "bound" and mine.port() > 0
        assert mine.addresses() == f"127.0.0.1:{mine.port()}"
    finally:
        mine.close()
    with pytest.raises(ListenError, match="already in use.*--port"):
        open_listeners("127.0.0.1", listening.getsockname()[1], environ={})


def test_systemd_variables_meant_for_another_process_are_left_alone():
    environ = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1"}
    assert listen_socket.systemd_sockets(environ) is None
    assert environ == {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1"}


def test_systemd_descriptors_that_are_no_sockets_fail_clearly(tmp_path):
    """fd 3 here is whatever the test runner has open there (a file, or
    nothing): never a socket systemd passed."""
    path = tmp_path / "not-a-socket"
    path.write_text("x")
    fd = os.open(path, os.O_RDONLY)
    saved = os.dup(3) if _is_open(3) else None
    os.dup2(fd, 3)
    try:
        environ = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x"}
        with pytest.raises(ListenError, match="descriptor 3 is not a socket"):
            listen_socket.systemd_sockets(environ)
        assert environ == {}  # taken: never handed on to a child
    finally:
        if saved is not None:
            os.dup2(saved, 3)
            os.close(saved)
        else:
            os.close(3)
        os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
