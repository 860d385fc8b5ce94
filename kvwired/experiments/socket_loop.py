"""A plain socket loop: the TCP transport's baseline (``baseline = socket``).

The loop any hand-written TCP transfer starts from, run between the same two
hosts as the daemons' data path (``kvwired.experiments.baseline`` arranges
the run): one stream with default socket options, the
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

import contextlib
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


class LoopServer:
    """The receiving half: listens on the address the sender reached this
    receiver at; ``run`` (in a thread) serves one sender, ``stop`` ends it."""

    def __init__(self, host: str, total: int) -> None:
        self._total = total
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._connection: socket.socket | None = None
        try:
            self._listener.bind((host, 0))
            self._listener.listen(1)
            self._listener.settimeout(IDLE_LIMIT)
        except OSError:
            self._listener.close()
            raise

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def connected(self) -> bool:
        return self._connection is not None

    def run(self) -> int:
        """Receive rounds of ``total`` bytes until the sender closes; rounds received."""
        buffer = memoryview(bytearray(self._total))
        rounds = 0
        with self._listener:
            connection, _ = self._listener.accept()
        self._connection = connection
        with connection:
            connection.settimeout(IDLE_LIMIT)
            while True:
                got = 0
                while got < self._total:
                    n = connection.recv_into(buffer[got:])
                    if n == 0:
                        return rounds  # the sender is done
                    got += n
                connection.sendall(ACK)
                rounds += 1

    def stop(self) -> None:
        """Wake and end ``run`` wherever it blocks (from another thread)."""
        for sock in (self._listener, self._connection):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


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
