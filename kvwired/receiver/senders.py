"""Sender daemons connecting to the receiver: admission, handshake, and the end.

A sender's control connection arrives through the gate (TLS done). Nothing
is leased, and no key disclosed, until its ``hello`` names a sender this
receiver accepts (the certificate's own name when TLS is on) and its first
data channel is up. When the connection ends, however it ends, the session
is dropped once: its responders close, and what it had not delivered is
aborted (kvwired.receiver.leases).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import structlog

from ..config import ReceiverConfig
from ..control import ControlConnection
from ..errors import (
    AccessDenied,
    AuthenticationFailed,
    KvwireError,
    PeerLost,
    ProtocolError,
)
from ..gate import Gate
from ..metrics import Metrics
from ..protocol import Message
from ..protocol import control as ctl
from ..trust import Trust
from .channels import DataChannels
from .leases import LeaseBook
from .session import SenderSession

log = structlog.get_logger("kvwired.receiver")

MAX_PEER_LABELS = 32

# A message of a sender's session, after the handshake.
Dispatch = Callable[[SenderSession, Message], None]
SessionClosed = Callable[[SenderSession], None]


class Senders:
    """The connected senders' sessions."""

    def __init__(self, config: ReceiverConfig, metrics: Metrics, trust: Trust | None,
                 gate: Gate, transport_name: str, channels: DataChannels, book: LeaseBook,
                 dispatch: Dispatch, closed: Iterable[SessionClosed]) -> None:
        self.config = config
        self.metrics = metrics
        self.trust = trust
        self.gate = gate
        self.transport_name = transport_name
        self.channels = channels
        self.book = book
        self.dispatch = dispatch
        self.closed = list(closed)  # the services', told of every session's end
        self.sessions: set[SenderSession] = set()
        self._labels: set[str] = set()  # uncertified sender names given a label

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A sender's control connection, TLS done (``gate.serve``)."""
        conn = ControlConnection(reader, writer, self.config.heartbeat, "sender")
        address = conn.peer_address
        session = SenderSession(conn)
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.gate.timeout):
                await self._handshake(session, address)
        except TimeoutError:
            # Which step it stalled in tells a slow node from a mute peer.
            self.gate.refuse(address, "timeout",
                             f"handshake not done within {self.gate.timeout:g} s: still "
                             f"{session.handshake_step}")
            conn.close()
            return
        except PeerLost as exc:
            self.gate.refuse(address, "incomplete", exc.message)
            conn.close()
            return
        except KvwireError as exc:
            if isinstance(exc, ProtocolError):
                self.metrics.protocol_errors.labels("control").inc()
            if not isinstance(exc, AuthenticationFailed | AccessDenied):
                log.warning("sender handshake failed", peer=address, error=str(exc))
            conn.fail(exc)
            return

        def ended(conn: ControlConnection, exc: KvwireError) -> None:
            if isinstance(exc, ProtocolError):
                self.metrics.protocol_errors.labels("control").inc()
            log.warning("sender connection ended", sender=session.name,
                        peer=conn.peer_address, error=str(exc))
            self.drop(session, exc if isinstance(exc, PeerLost) else
                      PeerLost(f"sender {session.name} dropped: {exc}"))

        log.info("sender connected", sender=session.name, peer=address,
                 authenticated=self.trust is not None,
                 seconds=round(time.monotonic() - started, 3))
        self.metrics.peer_seen(session.label)
        self.sessions.add(session)
        self.metrics.peers.set(len(self.sessions))
        conn.start_pinging()
        await conn.run(lambda msg: self.dispatch(session, msg), ended)

    async def _handshake(self, session: SenderSession, address: str) -> None:
        conn = session.conn
        hello = await conn.recv(self.gate.timeout)
        if not isinstance(hello, ctl.Hello):
            raise ProtocolError(f"expected a sender's hello, got {hello.kind!r}")
        if hello.role != "sender":
            raise ProtocolError(
                f"a {hello.role!r} connected to receiver {self.config.name}'s control "
                "port, which takes sender daemons only",
                hint="decode engines connect to the receiver's unix socket (ReceiverClient, "
                     "kvctl consume); prefill engines to their own sender daemon's")
        self._authorize(conn, hello.name, address)
        session.name = hello.name
        session.label = self._peer_label(session.name)
        conn.label = f"sender {session.name}"
        if self.transport_name not in hello.transports:
            raise ProtocolError(
                f"sender {session.name} offers transports {hello.transports}, "
                f"this receiver runs {self.transport_name}",
                hint="configure the same transport on both daemons",
            )
        conn.send(ctl.Welcome(name=self.config.name, transport=self.transport_name,
                              credits=self.config.credits))
        session.handshake_step = "waiting for its connect (welcome sent)"
        connect = await conn.recv(self.gate.timeout)
        if not isinstance(connect, ctl.Connect):
            raise ProtocolError(f"expected connect, got {connect.kind!r}")
        session.handshake_step = "opening its first data channel"
        await self.channels.add(session, connect)

    def _authorize(self, conn: ControlConnection, name: str, address: str) -> None:
        """The hello's name must be the certificate's, and one this receiver accepts."""
        if self.trust is not None:
            certified = conn.certified_name
            if certified != name:
                self.gate.refuse(address, "wrong_name",
                                 f"certificate of {certified!r}, hello says {name!r}")
                raise AuthenticationFailed(
                    f"this connection's certificate is for {certified!r}, but its hello "
                    f"says {name!r}", hint="a sender's `name` must be the name it was "
                    "issued credentials for (kvctl keys show)")
        if self.config.senders and name not in self.config.senders:
            self.gate.refuse(address, "not_allowed", f"sender {name!r} is not in `senders`")
            raise AccessDenied(f"receiver {self.config.name} does not accept sender {name!r}")

    def _peer_label(self, name: str) -> str:
        """The peer label for a sender's metrics. Names are bounded when they
        are certified or listed; a receiver that takes any name (auth = none
        and no `senders`) labels at most MAX_PEER_LABELS of them, the rest
        as "other", so made-up names cannot grow the metrics page."""
        if self.trust is not None or self.config.senders or name in self._labels:
            return name
        if len(self._labels) >= MAX_PEER_LABELS:
            return "other"
        self._labels.add(name)
        return name

    def drop(self, session: SenderSession, error: KvwireError) -> None:
        """The session ends (once): no write of it can land any more."""
        if not session.alive:
            return
        session.alive = False
        for timer in session.broken.values():
            timer.cancel()
        session.broken.clear()
        self.sessions.discard(session)
        self.metrics.peers.set(len(self.sessions))
        for responder in session.responders:
            responder.close()
        for closed in self.closed:
            closed(session)
        self.book.session_lost(session, error)
        # Last: the services have stopped what they run for it (perftest
        # servers, echo channels), and its leases have their outcomes.
        session.tasks.cancel()

    def cut_off_unlisted(self) -> None:
        """After a reload: senders no longer listed lose their sessions now."""
        for session in list(self.sessions):
            if self.config.senders and session.name not in self.config.senders:
                refusal = AccessDenied(
                    f"receiver {self.config.name} no longer accepts sender {session.name}")
                log.warning("sender no longer accepted: disconnected", sender=session.name)
                session.conn.fail(refusal)
                self.drop(session, PeerLost(refusal.message))

    def say_goodbye(self, reason: str) -> None:
        for session in list(self.sessions):
            if session.alive:
                session.conn.send(ctl.Bye(reason=reason))
            self.drop(session, PeerLost(reason))
