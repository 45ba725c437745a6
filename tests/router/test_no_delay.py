"""The router's client connections send at once (router/guards/slow_clients.py
`no_delay`), whatever protocol number the listening socket was made with."""

from __future__ import annotations

import socket

from router.guards.slow_clients import no_delay


class Transport:
    def __init__(self, sock):
        self.sock = sock

    def get_extra_info(self, name):
        return self.sock if name == "socket" else None


def test_a_connection_accepted_on_a_protocol_0_socket_gets_tcp_nodelay():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # as deploy/service/listen_socket.py binds
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    try:
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # what asyncio would leave it
        no_delay(Transport(conn))
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        no_delay(Transport(None))  # no socket (a test transport): nothing to do
    finally:
        for s in (conn, client, listener):
            s.close()
