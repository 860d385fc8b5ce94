"""The options every data connection's socket gets, at both ends."""

from __future__ import annotations

import socket


def tune(sock: socket.socket) -> None:
    """No Nagle delay for small frames; keepalive for a peer that vanishes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
