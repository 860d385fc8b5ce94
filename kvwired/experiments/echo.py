"""Echo mode: the ping-pong a chunk sweep measures latency with.

The sender's experiment asks its receiver for an echo lease (``echo_open``
with the sizes it will use). The receiver leases a slot like for a request
and opens a second data channel, back to the sender: it is the initiator
this time, so the offer travels receiver -> sender (``echo_offer``), the
sender's responder answers (``echo_answer``) and the receiver completes
(``echo_ready``). A WRITE_WITH_IMM naming the echo lease is then answered by
a write of the same size with the same immediate; its layer bits index the
size list. Streaming writes carry no immediate and are not answered.

Both ends keep the credit rules of the data path: the sender spends one of
the receiver's credits per ping, and the receiver answers at most one write
per immediate, so the sender's receive queue cannot run dry. The answer is
the credit coming back (the receiver re-posts the receive before it
answers), so pings cost no ``credits`` message. ``echo_close`` says how many
answers the sender saw; the receiver returns by message the credits of any
ping it took but whose answer the sender never saw.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from .. import immediate
from ..errors import ExperimentFailed, KvwireError, ProtocolError, TransportError
from ..pool import Slot
from ..ports import Connection, ReceiverHost, SessionHandle
from ..protocol import Handlers, Message
from ..protocol import control as ctl
from ..transport.base import DataChannel, Initiator, Responder, Transport, Write

log = structlog.get_logger("kvwired.experiments.echo")

MAX_SIZES = immediate.MAX_LAYERS


def check_sizes(sizes: list[Any], region: int) -> list[int]:
    if not sizes or len(sizes) > MAX_SIZES:
        raise ProtocolError(f"an echo takes 1 to {MAX_SIZES} sizes, got {len(sizes)}")
    checked = []
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= region:
            raise ProtocolError(f"echo size {size!r} is not within 1..{region} B")
        checked.append(size)
    return checked


# ------------------------------------------------------------- receiver side


@dataclass(eq=False)
class EchoLease:
    """The receiver's end: a leased slot and the channel back to the sender."""

    id: int
    req: str
    slot: Slot
    sizes: list[int]
    conn: Connection
    initiator: Initiator | None = None
    channel: DataChannel | None = None
    reply_offset: int = 0
    answered: int = 0  # answers written: each returns a credit once the sender sees it
    released: bool = False  # channel closed, slot given back (a failed echo awaits echo_close)
    key: int = 0  # the sender's key for the echo slot's bytes

    async def offer(self, transport: Transport) -> ctl.EchoOffer:
        self.initiator = transport.initiator(self.conn.local_host)
        params = await self.initiator.offer()
        return ctl.EchoOffer(req=self.req, lease=self.id, offset=self.slot.offset,
                             key=self.key, params=params)

    async def complete(self, msg: ctl.EchoAnswer) -> ctl.EchoReady:
        if self.initiator is None or self.channel is not None:
            raise ProtocolError(f"echo_answer for lease {self.id} out of turn")
        # The channel checks every write against the sender's region.
        self.reply_offset = max(0, msg.reply_offset)
        self.channel = await self.initiator.complete(msg.params)
        return ctl.EchoReady(req=self.req, lease=self.id)

    def answer(self, index: int, on_error: Callable[[KvwireError], None]) -> bool:
        """Write the ping's size back with the same immediate; False if it cannot be."""
        channel = self.channel
        if channel is None or index >= len(self.sizes):
            return False
        size = self.sizes[index]
        posted = channel.post([Write(self.slot.offset, self.reply_offset, size)],
                              immediate.pack(self.id, index))
        self.answered += 1

        def done(future: asyncio.Future[None]) -> None:
            if not future.cancelled() and (exc := future.exception()) is not None:
                on_error(exc if isinstance(exc, KvwireError) else TransportError(str(exc)))
        posted.add_done_callback(done)
        return True

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        elif self.initiator is not None:
            self.initiator.abandon()
        self.channel = None
        self.initiator = None


class EchoService:
    """The receiver's side of echo leases (a ``ReceiverService``)."""

    messages: tuple[type[Message], ...] = (ctl.EchoOpen, ctl.EchoAnswer, ctl.EchoClose)

    def __init__(self) -> None:
        self._host: ReceiverHost | None = None
        self.echoes: dict[int, EchoLease] = {}
        self._owners: dict[int, SessionHandle] = {}
        handlers = self._handlers = Handlers[SessionHandle]("a sender")
        handlers.on(ctl.EchoOpen, lambda session, msg: session.tasks.spawn(
            self._open(session, msg), f"echo-{msg.req}"))
        handlers.on(ctl.EchoAnswer, lambda session, msg: session.tasks.spawn(
            self._answer(session, msg), f"echo-answer-{msg.req}"))
        handlers.on(ctl.EchoClose, self._closed_by_sender)

    @property
    def host(self) -> ReceiverHost:
        assert self._host is not None, "service not bound to a receiver"
        return self._host

    def bind(self, receiver: ReceiverHost) -> None:
        self._host = receiver

    def handle(self, session: SessionHandle, msg: Message) -> None:
        self._handlers(session, msg)

    def _closed_by_sender(self, session: SessionHandle, msg: ctl.EchoClose) -> None:
        echo = self.echoes.get(msg.lease)
        if echo is not None and self._owners.get(echo.id) is session:
            # Answers the sender never saw (lost with a failed channel)
            # did not bring their credits back: the message does.
            session.return_credits(echo.answered - msg.answers)
            self._close(echo)

    def on_immediate(self, session: SessionHandle, lease_id: int,
                     layer: int) -> immediate.Taken:
        echo = self.echoes.get(lease_id)
        if echo is None or self._owners.get(lease_id) is not session:
            return immediate.Taken.NOT_OURS
        if echo.answer(layer, lambda exc: self._failed(session, echo, exc)):
            return immediate.Taken.ANSWERED
        return immediate.Taken.TAKEN

    def session_closed(self, session: SessionHandle) -> None:
        for echo_id, owner in list(self._owners.items()):
            if owner is session:
                self._close(self.echoes[echo_id])

    async def _open(self, session: SessionHandle, msg: ctl.EchoOpen) -> None:
        req, host = msg.req, self.host
        try:
            sizes = check_sizes(msg.sizes, msg.bytes)
            slot = await host.pool.reserve(msg.bytes, host.config.lease_wait)
        except KvwireError as exc:
            session.conn.send(ctl.Refused(req=req, error=exc.to_wire()))
            return
        if not session.alive:
            host.pool.release(slot)
            return
        echo = EchoLease(host.allocate_lease_id(), req, slot, sizes, session.conn)
        self.echoes[echo.id] = echo
        self._owners[echo.id] = session
        host.update_pool_metrics()
        try:
            assert session.responder is not None, "a session has its responder"
            echo.key = await session.responder.grant(slot.offset, slot.length)
            offer = await echo.offer(host.transport)
        except KvwireError as exc:
            self._close(echo)
            session.conn.send(ctl.Refused(req=req, error=exc.to_wire()))
            return
        log.info("echo lease opened", req=req, sender=session.name, bytes=msg.bytes)
        session.conn.send(offer)

    async def _answer(self, session: SessionHandle, msg: ctl.EchoAnswer) -> None:
        echo = self.echoes.get(msg.lease)
        try:
            if echo is None or self._owners.get(echo.id) is not session:
                raise ProtocolError(f"echo_answer for unknown echo lease {msg.lease}")
            session.conn.send(await echo.complete(msg))
        except KvwireError as exc:
            if echo is not None:
                self._close(echo)
            session.conn.send(ctl.Refused(req=msg.req, error=exc.to_wire()))

    def _failed(self, session: SessionHandle, echo: EchoLease, error: KvwireError) -> None:
        if self.echoes.get(echo.id) is not echo or echo.released:
            return
        log.warning("echo channel failed", req=echo.req, sender=session.name, error=str(error))
        # The slot goes back now; the lease id stays taken until the sender's
        # echo_close says how many answers it saw, so its credits balance.
        self._release(echo, session)
        if session.alive:
            session.conn.send(ctl.Abort(req=echo.req, lease=echo.id, error=error.to_wire()))
        else:
            self._close(echo)

    def _close(self, echo: EchoLease) -> None:
        if self.echoes.pop(echo.id, None) is None:
            return
        session = self._owners.pop(echo.id)
        self.host.free_lease_id(echo.id)
        if not echo.released:
            self._release(echo, session)
        log.info("echo lease closed", req=echo.req, sender=session.name, answered=echo.answered)

    def _release(self, echo: EchoLease, session: SessionHandle) -> None:
        """Close the echo's channel and give its slot back (after its key is revoked)."""
        echo.released = True
        echo.close()
        host = self.host

        def give_back() -> None:
            host.pool.release(echo.slot)
            host.update_pool_metrics()
        if echo.key and session.responder is not None:
            session.responder.revoke(echo.key, give_back)  # no ping can land after
        else:
            give_back()


# --------------------------------------------------------------- sender side


@dataclass(eq=False)
class EchoInitiator:
    """The sender's end: pings of a given size, and streams without echo."""

    req: str
    link_name: str
    slot: Slot  # our staging: the source of pings and where echoes land
    sizes: list[int]
    lease: int = 0
    remote_offset: int = 0
    key: int = 0  # the receiver's key for its echo slot
    responder: Responder | None = None
    error: KvwireError | None = None
    # Each answer is one of the receiver's credits back (see the module doc).
    credit_back: Callable[[], None] = lambda: None
    answers: int = 0
    _pending: asyncio.Future[int] | None = None

    def on_immediate(self, imm: int) -> None:
        lease, index = immediate.unpack(imm)
        if lease != self.lease % immediate.LEASE_SPACE:
            return
        self.answers += 1
        self.credit_back()
        pending = self._pending
        if pending is not None and not pending.done():
            pending.set_result(index)

    def delivered(self, checksum: int) -> None:
        """Echo leases are never delivered; the link's holder protocol asks."""

    def abort_acked(self) -> None:
        """Echo leases end with echo_close, never with an abort of ours."""

    @property
    def takes_writes(self) -> bool:
        """An echo's writes go on a channel of its own, never through the link's."""
        return False

    def fail(self, error: Exception, *, by_receiver: bool = False) -> None:
        if self.error is None:
            self.error = error if isinstance(error, KvwireError) else TransportError(str(error))
        if self._pending is not None and not self._pending.done():
            self._pending.set_exception(self.error)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    async def ping(self, channel: DataChannel, index: int, timeout: float,
                   take_credit: Callable[[], Any]) -> float:
        """One round trip of ``sizes[index]`` bytes each way; seconds."""
        self.check()
        await take_credit()
        loop = asyncio.get_running_loop()
        pending = self._pending = loop.create_future()
        size = self.sizes[index]
        started = time.perf_counter()
        posted = channel.post([Write(self.slot.offset, self.remote_offset, size)],
                              immediate.pack(self.lease, index), self.key)
        # A bare timer rather than asyncio.timeout: on the lab's emulated
        # CPUs the context manager's bookkeeping showed in every ping.
        timer = loop.call_later(timeout, _expire, pending)
        try:
            answered = await pending
        except TimeoutError:
            raise ExperimentFailed(
                f"receiver {self.link_name} did not echo a {size} B ping within {timeout:g} s",
                hint="the receiver's log says why; is it overloaded or stopped?") from None
        finally:
            timer.cancel()
            self._pending = None
        elapsed = time.perf_counter() - started
        await posted
        if answered != index:
            raise ProtocolError(f"echo answered size #{answered}, expected #{index}")
        return elapsed

    async def stream(self, channel: DataChannel, size: int, count: int,
                     progress: Callable[[int], None]) -> float:
        """``count`` writes of ``size`` back to back, no immediates; seconds."""
        self.check()
        region = max(self.sizes)
        slots = max(1, region // size)
        per_post = max(1, min(64, (4 << 20) // size))
        window = max(2, 1024 // per_post)  # posts in flight
        in_flight: list[asyncio.Future[None]] = []
        local = self.slot.offset
        started = time.perf_counter()
        sent = 0
        while sent < count:
            n = min(per_post, count - sent)
            writes = [Write(local + ((sent + i) % slots) * size,
                            self.remote_offset + ((sent + i) % slots) * size, size)
                      for i in range(n)]
            in_flight.append(channel.post(writes, key=self.key))
            sent += n
            if len(in_flight) >= window:
                await in_flight.pop(0)
                progress(sent)
                self.check()
        for outcome in await asyncio.gather(*in_flight, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        elapsed = time.perf_counter() - started
        progress(sent)
        return elapsed


def _expire(pending: asyncio.Future[int]) -> None:
    if not pending.done():
        pending.set_exception(TimeoutError())
