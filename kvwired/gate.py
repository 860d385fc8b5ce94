"""The door of a listening port: what a connection may cost before it is trusted.

A connection that has not authenticated yet holds no buffer of size, is cut
off after ``HANDSHAKE_TIMEOUT``, and is one of at most ``limit`` such
connections per port; past that, new ones are closed at once. Every refusal
is counted (``kvwire_auth_failures_total{channel, reason}``, whose labels
are the port's and the reason's, never a name the peer claims) and logged
once with the address, as what it is: a refusal, not a network failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client import Counter

from .errors import AuthenticationFailed
from .protocol import encode, error_message
from .tasks import TaskSet

log = structlog.get_logger("kvwired.gate")

HANDSHAKE_TIMEOUT = 10.0
UNAUTHENTICATED_LIMIT = 64
LISTEN_BACKLOG = 512  # a burst of senders reconnecting at once

REASONS = ("timeout", "incomplete", "not_tls", "bad_certificate", "wrong_name",
           "not_allowed", "bad_token", "too_many")


class Gate:
    def __init__(self, channel: str, refusals: Counter, timeout: float = HANDSHAKE_TIMEOUT,
                 limit: int = UNAUTHENTICATED_LIMIT) -> None:
        self.channel = channel
        self.timeout = timeout
        self.limit = limit
        self.pending = 0  # connections in, not yet authenticated
        self._refusals = refusals
        for reason in REASONS:  # zeros from the start, so alerts see increases
            refusals.labels(channel, reason)

    def admit(self, address: str) -> bool:
        """Room for one more unauthenticated connection? (If not: refused, counted.)"""
        if self.pending >= self.limit:
            self.refuse(address, "too_many",
                        f"{self.limit} connections are already authenticating")
            return False
        self.pending += 1
        return True

    def settled(self) -> None:
        """The connection admitted last authenticated, or was refused."""
        self.pending -= 1

    def refuse(self, address: str, reason: str, detail: str) -> None:
        self._refusals.labels(self.channel, reason).inc()
        log.warning("connection refused", channel=self.channel, address=address,
                    reason=reason, detail=detail)


def tls_refusal(error: ssl.SSLError) -> str:
    """The reason label for a failed TLS handshake."""
    reason = str(getattr(error, "reason", "") or error)
    if "CERTIFICATE" in reason.upper():
        return "bad_certificate"
    return "not_tls"


StreamHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

TLS_HANDSHAKE_RECORD = 0x16  # the first byte of every TLS ClientHello

# What a TLS port says to a connection that speaks plaintext kvwire: a sender
# with auth = "none" would otherwise see only a closed connection, and the
# cause only in this daemon's log.
PLAINTEXT_REFUSAL = encode(error_message(AuthenticationFailed(
    "this kvwire port takes mutual TLS (auth = \"tls\"), and the connection spoke "
    "plaintext (a daemon with auth = \"none\"?)",
    hint="give the sender auth = \"tls\" and tls_dir with credentials from `kvctl keys "
         "issue`, or run both ends with auth = \"none\"")))


async def first_byte(conn: socket.socket, timeout: float) -> int | None:
    """The first byte the peer sent, left unread (MSG_PEEK); None if it closed
    or sent nothing within ``timeout`` (TimeoutError)."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()

    def ready() -> None:
        if not readable.done():
            readable.set_result(None)
    loop.add_reader(conn.fileno(), ready)
    try:
        await asyncio.wait_for(readable, timeout)
    finally:
        loop.remove_reader(conn.fileno())
    data = conn.recv(1, socket.MSG_PEEK)
    return data[0] if data else None


class Listener:
    """A listening TCP port whose connections pass a ``Gate`` (and TLS) first.

    Connections are accepted here and handed to ``connect_accepted_socket``
    with the TLS context, which raises what went wrong with a handshake, so
    every refusal is counted with its reason (a server started with
    ``ssl=`` would swallow them, and ``StreamWriter.start_tls`` loses the
    peer's first flight if a reader buffered it).
    """

    def __init__(self, sock: socket.socket, handler: StreamHandler, gate: Gate,
                 context: ssl.SSLContext | None) -> None:
        self.sock = sock
        self._handler, self._gate, self._context = handler, gate, context
        # The accept loop and each connection's task (its handshake, then its
        # handler): a drain closes the port, and the connections go on.
        self.tasks = TaskSet(f"{gate.channel} listener")
        self._task = self.tasks.spawn(self._accept_forever(), f"accept-{gate.channel}")

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def close(self) -> None:
        self._task.cancel()
        self.sock.close()

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(self.sock)
            except OSError as exc:
                # Out of descriptors, say: the listener stays, and says so.
                log.warning("accept failed", channel=self._gate.channel, error=str(exc))
                await asyncio.sleep(0.1)
                continue
            self.tasks.spawn(self._admit(conn, f"{peer[0]}:{peer[1]}"), "handshake")

    async def _admit(self, conn: socket.socket, address: str) -> None:
        gate = self._gate
        if not gate.admit(address):
            conn.close()
            return
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        try:
            if self._context is not None and self._plaintext(
                    conn, await first_byte(conn, gate.timeout)):
                gate.refuse(address, "not_tls", "the connection spoke plaintext, not TLS")
                gate.settled()
                conn.close()
                return
            transport, protocol = await loop.connect_accepted_socket(
                lambda: asyncio.StreamReaderProtocol(reader), conn, ssl=self._context,
                ssl_handshake_timeout=gate.timeout if self._context is not None else None)
        except ssl.SSLError as exc:
            gate.refuse(address, tls_refusal(exc), str(exc.reason or exc))
        except (TimeoutError, ConnectionAbortedError) as exc:
            gate.refuse(address, "timeout", str(exc) or "the TLS handshake timed out")
        except OSError as exc:
            gate.refuse(address, "incomplete", f"left during the TLS handshake: {exc}")
        else:
            gate.settled()
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            await self._handler(reader, writer)
            return
        gate.settled()
        conn.close()


    @staticmethod
    def _plaintext(conn: socket.socket, first: int | None) -> bool:
        """Not a TLS handshake; one that looks like a kvwire frame (a length's
        high byte: 0) is told why before it is closed."""
        if first is None or first == TLS_HANDSHAKE_RECORD:
            return False
        if first == 0:
            with contextlib.suppress(OSError):
                conn.send(PLAINTEXT_REFUSAL)
        return True


async def serve(host: str, port: int, handler: StreamHandler, gate: Gate,
                context: ssl.SSLContext | None) -> Listener:
    """Listen on ``host:port``: each connection is admitted by ``gate`` and,
    with ``context``, completes a TLS handshake within the gate's timeout
    before ``handler`` sees it as streams."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return Listener(sock, handler, gate, context)
