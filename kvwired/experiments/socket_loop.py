"""A plain socket loop: the TCP transport's baseline (``baseline = socket``).

The loop any hand-written TCP transfer starts from, run between the same two
hosts as the daemons' data path: one stream with default socket options, the
sender ``sendall``s the payload in chunks of the size under test, the
receiver ``recv_into``s it into one buffer allocated up front and answers one
byte when the last byte is in. The sender's clock runs from its first
``sendall`` to that byte, so a round is "the whole payload known to be at the
receiver", as a kvwire push ends with ``delivered``.

No framing, no checksum, no notification: whatever kvwire's TCP transport
costs beyond this is its own overhead. Both halves block in a thread of
their own, so the daemon's event loop is not held while they run.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from ..errors import ExperimentFailed

ACK = b"\x01"
# How long either half waits on the other before it gives up.
IDLE_LIMIT = 60.0


@dataclass(frozen=True)
class LoopSpec:
    """One measurement: ``chunks`` sends of ``size`` bytes, ``rounds`` times."""

    size: int
    chunks: int
    rounds: int

    @property
    def total(self) -> int:
        return self.size * self.chunks


def listen(host: str) -> socket.socket:
    """The receiver's listening socket, on the address the sender reached it at."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = socket.socket(family, socket.SOCK_STREAM)
    try:
        server.bind((host, 0))
        server.listen(1)
        server.settimeout(IDLE_LIMIT)
    except OSError:
        server.close()
        raise
    return server


def serve(server: socket.socket, total: int) -> int:
    """Receive rounds of ``total`` bytes until the sender closes; rounds received.

    Runs in a thread; closes ``server``.
    """
    buffer = memoryview(bytearray(total))
    rounds = 0
    with server:
        connection, _ = server.accept()
    with connection:
        connection.settimeout(IDLE_LIMIT)
        while True:
            got = 0
            while got < total:
                n = connection.recv_into(buffer[got:])
                if n == 0:
                    return rounds  # the sender is done
                got += n
            connection.sendall(ACK)
            rounds += 1


def send(host: str, port: int, spec: LoopSpec) -> list[float]:
    """Send ``spec.rounds`` rounds to a serving receiver; seconds per round.

    Runs in a thread.
    """
    payload = memoryview(bytearray(spec.total))
    chunks = [payload[i * spec.size : (i + 1) * spec.size] for i in range(spec.chunks)]
    ack = bytearray(1)
    seconds = []
    try:
        with socket.create_connection((host, port), timeout=IDLE_LIMIT) as connection:
            for _ in range(spec.rounds):
                started = time.perf_counter()
                for chunk in chunks:
                    connection.sendall(chunk)
                if connection.recv_into(ack) != 1:
                    raise ExperimentFailed("the socket-loop receiver closed mid-round")
                seconds.append(time.perf_counter() - started)
    except OSError as exc:
        raise ExperimentFailed(f"socket loop to {host}:{port} failed: {exc}",
                               hint="the data path's hosts must reach each other over TCP "
                                    "on an ephemeral port") from exc
    return seconds
