"""A sender's data channels at the receiver: one responder each, replaced in place.

The first channel comes with the handshake, the others (``qps_per_peer``)
as ``connect`` messages after it; leases are granted on the channels the
session has at the time. A channel whose end failed under a live control
connection is replaced by the sender (``replace``, kvwired.sender.ledger):
the session waits the stall bound for that, the time a silent peer gets,
then is dropped. A write under a wrong key is never ridden out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from .. import stripes
from ..config import ReceiverConfig
from ..control import MISSED_PINGS
from ..errors import FailureStatus, KvwireError, ProtocolError
from ..metrics import Metrics
from ..protocol import control as ctl
from ..transport import Transport
from ..transport.base import Responder
from .leases import LeaseBook
from .session import SenderSession

log = structlog.get_logger("kvwired.receiver")

# An immediate of ``session``'s data channel ``channel``.
OnImmediate = Callable[[SenderSession, int, int], None]


class DataChannels:
    """Adds, replaces and watches the data channels of every session."""

    def __init__(self, config: ReceiverConfig, metrics: Metrics, transport: Transport,
                 book: LeaseBook, on_immediate: OnImmediate) -> None:
        self.config = config
        self.metrics = metrics
        self.transport = transport
        self.book = book
        self.on_immediate = on_immediate

    async def add(self, session: SenderSession, connect: ctl.Connect) -> None:
        """One more data channel for the session, answered with ``ready``."""
        channel = len(session.responders)
        if channel >= stripes.MAX_CHANNELS:
            raise ProtocolError(
                f"sender {session.name} asked for data channel {channel + 1}; at most "
                f"{stripes.MAX_CHANNELS} are served",
                hint=f"set qps_per_peer to at most {stripes.MAX_CHANNELS}")
        responder = self._responder(session, channel)
        session.responders.append(responder)
        session.conn.send(ctl.Ready(params=await responder.accept(connect.params)))

    async def add_more(self, session: SenderSession, msg: ctl.Connect) -> None:
        """A ``connect`` after the handshake; a refusal ends the session."""
        try:
            await self.add(session, msg)
        except KvwireError as exc:
            if isinstance(exc, ProtocolError):
                self.metrics.protocol_errors.labels("control").inc()
            log.warning("data channel refused", sender=session.name, error=str(exc))
            session.conn.fail(exc)

    def _responder(self, session: SenderSession, channel: int) -> Responder:
        """A responder reporting as data channel ``channel`` of ``session``."""
        responder: Responder | None = None

        def failed(exc: Exception) -> None:
            assert responder is not None
            self.failed(session, channel, responder, exc)
        responder = self.transport.responder(
            session.conn.local_host, lambda imm: self.on_immediate(session, channel, imm),
            failed)
        return responder

    async def replace(self, session: SenderSession, msg: ctl.Replace) -> None:
        """A new responder takes the failed channel's place, the old one is
        closed (no write under its keys can land any more), and every lease
        that still takes writes gets a key on the new one."""
        channel = msg.channel
        req = msg.req
        if channel >= len(session.responders):
            error = ProtocolError(f"sender {session.name} replaced data channel {channel}; "
                                  f"its session has {len(session.responders)}")
            session.conn.send(ctl.Refused(req=req, error=error.to_wire()))
            return
        began = asyncio.get_running_loop().time()
        responder = self._responder(session, channel)
        try:
            params = await responder.accept(msg.params)
        except asyncio.CancelledError:
            responder.close()  # the session ended first: nobody will use it
            raise
        except KvwireError as exc:
            log.warning("data channel not replaced", sender=session.name, channel=channel,
                        error=str(exc))
            if session.alive:
                session.conn.send(ctl.Refused(req=req, error=exc.to_wire()))
            return
        if not session.alive:
            responder.close()
            return
        old = session.responders[channel]
        session.responders[channel] = responder
        old.close()
        if (timer := session.broken.pop(channel, None)) is not None:
            timer.cancel()
        # Credits the old responder's receives earned are void: the sender
        # starts the new channel with a full set.
        session.credits_to_return.pop(channel, None)
        self.metrics.channel_replacements.labels(session.label, "replaced").inc()
        keys = await self.book.regrant(session, channel, responder)
        log.info("data channel replaced", sender=session.name, channel=channel,
                 leases=len(keys),
                 seconds=round(asyncio.get_running_loop().time() - began, 3))
        if session.alive:
            session.conn.send(ctl.Replaced(req=req, params=params, keys=keys))

    def failed(self, session: SenderSession, channel: int, responder: Responder,
               exc: Exception) -> None:
        """A responder failed. A write under a wrong key ends the session; any
        other failure is the wire's, which the sender rides out by replacing
        the channel: the session waits the stall bound for that."""
        if not session.alive or channel >= len(session.responders) \
                or session.responders[channel] is not responder:
            return  # replaced already, or the session is gone
        status = getattr(exc, "status", FailureStatus.TRANSPORT_ERROR)
        log.warning("data path failed", sender=session.name, channel=channel, error=str(exc))
        self.metrics.completion_errors.labels(session.label, status).inc()
        if status == FailureStatus.REMOTE_ACCESS or channel in session.broken:
            session.conn.close()  # ends the session loop, which drops the session
            return
        bound = self.config.heartbeat * MISSED_PINGS

        def not_replaced() -> None:
            session.broken.pop(channel, None)
            if session.alive and session.responders[channel] is responder:
                log.warning("failed data channel not replaced", sender=session.name,
                            channel=channel, waited=bound)
                self.metrics.channel_replacements.labels(session.label, "failed").inc()
                session.conn.close()
        session.broken[channel] = asyncio.get_running_loop().call_later(bound, not_replaced)
