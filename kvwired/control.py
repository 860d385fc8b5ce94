"""One control connection between a sender and a receiver daemon.

Frames in and out, pings to notice a peer that vanished without closing its
socket (a dead host sends no FIN), and an error frame before closing on a
protocol violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable

import structlog

from .errors import AuthenticationFailed, KvwireError, PeerLost
from .protocol import CONTROL, Message, error_message
from .protocol.control import Ping, Pong
from .stream import MessageStream
from .tasks import TaskSet
from .trust import peer_name

log = structlog.get_logger("kvwired.control")

MISSED_PINGS = 4


class ControlConnection:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        heartbeat: float,
        label: str,
    ) -> None:
        self.writer = writer
        self.stream = MessageStream(reader, writer, CONTROL)
        self.heartbeat = heartbeat
        self.label = label
        # Its reader (``serve``) and its pinger: they end with the connection.
        self.tasks = TaskSet(f"control connection to {label}")
        self._pinger: asyncio.Task[None] | None = None
        self.closed = False

        # Read once: a closed TLS transport cannot answer get_extra_info.
        self.local_host = str(writer.get_extra_info("sockname")[0])
        peer = writer.get_extra_info("peername")
        self.peer_address = f"{peer[0]}:{peer[1]}" if peer else "?"
        # The verified name in the peer's certificate ("" without TLS).
        self.certified_name = peer_name(writer.get_extra_info("peercert"))

    def send(self, msg: Message) -> None:
        if not self.closed:
            self.stream.send(msg)

    async def recv(self, timeout: float | None = None) -> Message:
        """The next message that is not a ping/pong; PeerLost at end of stream."""
        limit = timeout if timeout is not None else self.heartbeat * MISSED_PINGS
        while True:
            try:
                msg = await self._receive_within(limit)
            except ssl.SSLError as exc:
                # TLS 1.3: a peer that refuses our certificate says so on the
                # first read after the handshake, not in it.
                raise AuthenticationFailed(
                    f"{self.label} ended the TLS session: {exc.reason or exc}") from exc
            except (ConnectionError, OSError) as exc:
                raise PeerLost(f"connection to {self.label} broke: {exc}") from exc
            if msg is None:
                raise PeerLost(f"{self.label} closed the control connection")
            if isinstance(msg, Ping):
                self.send(Pong())
                continue
            if isinstance(msg, Pong):
                continue
            return msg

    async def _receive_within(self, limit: float) -> Message | None:
        """The next frame, unless the peer is silent for ``limit`` seconds.

        Silence is measured on our clock, and our clock runs on while this
        process cannot: stopped (SIGSTOP), or starved of CPU. On waking, the
        deadline has passed and the peer's frames sent meanwhile sit unread in
        the socket; the event loop may run the timeout first (uvloop does,
        after an epoll_wait interrupted by the stop). A deadline overshot by
        more than a heartbeat means we were not running: look once more before
        blaming the peer. (Found by the fault campaign: a sender stopped past
        the heartbeat failed a push its receiver had delivered meanwhile.)
        """
        # Frames that arrived together need no deadline; asyncio.timeout,
        # unlike wait_for, runs no task per frame.
        if (msg := self.stream.buffered()) is not None:
            return msg
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            async with asyncio.timeout(limit):
                return await self.stream.receive()
        except TimeoutError:
            stalled = loop.time() - began - limit > self.heartbeat
        if stalled:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat):
                    return await self.stream.receive()
        raise PeerLost(f"{self.label} sent nothing for {limit:g} s",
                       hint="the peer or the network between the nodes is down")

    async def messages(self) -> AsyncIterator[Message]:
        while True:
            yield await self.recv()

    def serve(self, dispatch: Callable[[Message], object],
              ended: Callable[[ControlConnection, KvwireError], None], name: str) -> None:
        """Read messages into ``dispatch`` in the background until the connection
        ends; then ``ended`` hears why. A ``KvwireError`` raised by ``dispatch``
        (a message the protocol forbids) ends it too, after an error frame."""
        self.tasks.spawn(self.run(dispatch, ended), name)

    async def run(self, dispatch: Callable[[Message], object],
                  ended: Callable[[ControlConnection, KvwireError], None]) -> None:
        try:
            async for msg in self.messages():
                dispatch(msg)
        except KvwireError as exc:
            self.fail(exc)
            ended(self, exc)
        finally:
            self.close()

    def start_pinging(self) -> None:
        self._pinger = self.tasks.spawn(self._ping_forever(), f"ping-{self.label}")

    async def _ping_forever(self) -> None:
        while not self.closed:
            await asyncio.sleep(self.heartbeat)
            self.send(Ping())

    def fail(self, error: KvwireError) -> None:
        """Tell the peer why (best effort), then close."""
        if not isinstance(error, PeerLost):
            with contextlib.suppress(Exception):
                self.send(error_message(error))
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._pinger is not None:
            self._pinger.cancel()
        # The reader is not cancelled: it sees the stream end and says why
        # (``ended``), as it does when the peer closes.
        self.stream.close()
