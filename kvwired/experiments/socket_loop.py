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

import asyncio
import contextlib
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

import structlog

from .. import analysis
from ..config import parse_address
from ..errors import ConfigError, ExperimentFailed, UsageError
from ..protocol import message
from ..units import format_size, parse_size
from .host import PeerHandle, Report, SenderHost

log = structlog.get_logger("kvwired.experiments.socket_loop")

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


# ----------------------------------------------------- run by the sender


async def measure(link: PeerHandle, req: str, spec: LoopSpec) -> list[float]:
    """One socket-loop measurement against ``link``'s receiver: seconds per round."""
    await link.ensure()
    ready = await link.request(
        message("baseline", req=req, tool="socket", size=spec.size, iters=spec.chunks),
        undo=lambda answer: message("baseline_stop", req=answer["req"]))
    host = parse_address(link.address, 7471)[0]
    try:
        return await asyncio.to_thread(send, host, int(ready["port"]), spec)
    finally:
        link.send(message("baseline_stop", req=req))


@dataclass(frozen=True)
class LoopParams:
    """What ``kvctl`` asks of the ``socket-loop`` experiment."""

    peer: str
    sizes: tuple[int, ...]
    total: int = 48 << 20
    rounds: int = 3

    @classmethod
    def from_wire(cls, params: dict[str, Any]) -> LoopParams:
        try:
            built = cls(peer=str(params.get("peer") or ""),
                        sizes=tuple(parse_size(s) for s in params["sizes"]),
                        total=parse_size(params.get("bytes", 48 << 20)),
                        rounds=int(params.get("rounds", 3)))
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise UsageError(f"bad socket-loop parameters: {exc}") from exc
        if not built.sizes or any(s < 1 or built.total % s for s in built.sizes):
            raise UsageError("socket-loop sizes must be positive and divide the payload",
                             hint=f"the payload is {format_size(built.total)}")
        if not 1 <= built.rounds <= 100:
            raise UsageError("socket-loop rounds must be 1 to 100")
        return built


async def run(daemon: SenderHost, req: str, params: dict[str, Any],
              report: Report) -> dict[str, Any]:
    """``socket-loop``: the plain loop at each size, ``rounds`` times, against a receiver."""
    loop = LoopParams.from_wire(params)
    link = daemon.link(loop.peer)
    rows = []
    for size in loop.sizes:
        spec = LoopSpec(size, loop.total // size, loop.rounds)
        seconds = await measure(link, f"{req}-{size}", spec)
        median = statistics.median(seconds)
        row = {"size": size, "bytes": spec.total, "seconds": seconds,
               "median_seconds": median, "gbps": analysis.gbps(spec.total, median)}
        rows.append(row)
        report(message("row", req=req, row=row))
        log.info("socket loop measured", peer=link.name, size=size,
                 median_ms=round(median * 1e3, 2))
    return {"peer": link.name, "sender": daemon.config.name, "bytes": loop.total,
            "rounds": loop.rounds, "rows": rows}
