"""Frames between ``kvctl lab`` and a node's agent: 4-byte length + msgpack map."""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

_LENGTH = struct.Struct(">I")
MAX_FRAME = 16 << 20


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = msgpack.packb(msg, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv(sock: socket.socket) -> dict[str, Any] | None:
    """The next frame, or None at end of stream."""
    header = _read_exactly(sock, _LENGTH.size)
    if header is None:
        return None
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME:
        raise ConnectionError(f"lab agent frame of {length} B exceeds {MAX_FRAME} B")
    body = _read_exactly(sock, length)
    if body is None:
        raise ConnectionError("lab agent connection ended inside a frame")
    msg = msgpack.unpackb(body, raw=False)
    if not isinstance(msg, dict):
        raise ConnectionError("lab agent sent a frame that is not a map")
    return msg


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            if data:
                raise ConnectionError("lab agent connection ended inside a frame")
            return None
        data += chunk
    return bytes(data)
