"""Decode engines on the receiver's unix socket: subscriptions, releases, reclaim.

An engine subscribes to a request by id, before or after it is opened, and
hears each layer as it lands, then ``complete`` or ``failed``. It releases
the request when it has read it. A delivered request nobody claims within
``unclaimed_ttl``, or whose engines all left, is reclaimed. A request read
by several engines (the ranks of a parallel decode engine sharing one push
say how many when they subscribe) is freed by the last release; the earlier
ones let go of it. An engine that
asks for a request which already ended undelivered is told at once
(``MissedFailures``), so none waits out its own deadline.
"""

from __future__ import annotations

import asyncio

import structlog

from ..config import ReceiverConfig
from ..errors import KvwireError, RequestAborted, UsageError
from ..lifecycle.claim import ClaimAction, ClaimEvent
from ..lifecycle.lease import LeaseEvent, LeaseState
from ..metrics import Metrics
from ..protocol import Failed, Handlers, Message, encode
from ..protocol import receiver_local as local
from ..verdicts import MissedFailures
from .leases import Lease, LeaseBook

log = structlog.get_logger("kvwired.receiver")


class Consumer:
    """A decode engine on the unix socket."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.subscribed: set[str] = set()

    def send(self, msg: Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(msg))


class Engines:
    """The decode engines' subscriptions, and the leases' watchers
    (kvwired.receiver.leases.LeaseWatchers)."""

    def __init__(self, config: ReceiverConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.subscribers: dict[str, set[Consumer]] = {}
        # Readers asked for by engines that subscribed before the request opened.
        self.readers: dict[str, int] = {}
        self.missed = MissedFailures()  # for decode engines that subscribe late
        self._book: LeaseBook | None = None
        handlers = self._handlers = Handlers[Consumer]("a decode engine")
        handlers.on(local.Subscribe, lambda c, m: self.subscribe(c, m.req, m.readers or 1))
        handlers.on(local.Unsubscribe, lambda c, m: self.unsubscribe(c, m.req))
        handlers.on(local.Release, lambda c, m: self.release(c, m.req))
        # Read at scrape time, on the metrics thread: a copy of the sets' sizes.
        metrics.subscriptions.set_function(
            lambda: float(sum(map(len, list(self.subscribers.values())))))

    def attach(self, book: LeaseBook) -> None:
        """The leases engines subscribe to (the book is built with us as its watchers)."""
        self._book = book

    @property
    def book(self) -> LeaseBook:
        assert self._book is not None, "Engines.attach comes at wiring time"
        return self._book

    # ----------------------------------------- what engines send us

    def handle(self, consumer: Consumer, msg: Message) -> None:
        self._handlers(consumer, msg)

    def subscribe(self, consumer: Consumer, req: str, readers: int = 1) -> None:
        lease = self.book.by_req.get(req)
        missed = self.missed.lookup(req, asyncio.get_running_loop().time())
        if lease is None and missed is not None:
            # It ended, undelivered, before this engine asked: say so now.
            consumer.send(Failed(req=req, error=missed.to_wire()))
            return
        consumer.subscribed.add(req)
        self.subscribers.setdefault(req, set()).add(consumer)
        if lease is None:
            # Not opened yet: events follow when it is.
            self.readers[req] = max(readers, self.readers.get(req, 1))
            return
        lease.readers = max(lease.readers, readers)
        lease.holders.add(consumer)
        self._claim(lease, ClaimEvent.SUBSCRIBED)
        consumer.send(local.Opened(req=req, note=lease.note))
        for n in range(lease.landed):
            consumer.send(lease.layer_message(n))
        if lease.state is LeaseState.HELD:
            consumer.send(lease.complete_message())

    def unsubscribe(self, consumer: Consumer, req: str) -> None:
        """The engine lets go without releasing: a delivered request is kept for
        another engine, and reclaimed if none subscribes within unclaimed_ttl."""
        self._let_go(consumer, req)
        consumer.send(local.Unsubscribed(req=req))

    def _let_go(self, consumer: Consumer, req: str) -> None:
        consumer.subscribed.discard(req)
        self._forget_subscriber(consumer, req)
        lease = self.book.by_req.get(req)
        if lease is not None and consumer in lease.holders:
            lease.holders.discard(consumer)
            if not lease.holders:
                self._claim(lease, ClaimEvent.LAST_LET_GO)

    def release(self, consumer: Consumer, req: str) -> None:
        lease = self.book.by_req.get(req)
        if lease is None:
            consumer.send(Failed(req=req, error=UsageError(
                f"request {req} is not held by this receiver",
                hint="release only requests you subscribed to and saw complete").to_wire()))
            return
        if not lease.machine.arriving and lease.releases + 1 < lease.readers:
            # Another engine still reads it: this one lets go, and the
            # request is kept for the others (reclaimed if none comes).
            lease.releases += 1
            self._let_go(consumer, req)
            consumer.send(local.Released(req=req))
            return
        # The releasing engine is told "released", not that its request failed.
        self.subscribers.get(req, set()).discard(consumer)
        consumer.subscribed.discard(req)
        if lease.machine.arriving:
            lease.error = RequestAborted(
                f"the decode engine released request {req} before it was delivered",
                hint="release a request once it is delivered, or let the sender finish it")
        self.book.event(lease, LeaseEvent.ENGINE_RELEASE)
        self.subscribers.pop(req, None)
        consumer.send(local.Released(req=req))


    def gone(self, consumer: Consumer) -> None:
        """A decode engine left (or died): what only it held goes back to the pool."""
        for req in consumer.subscribed:
            self._forget_subscriber(consumer, req)
            lease = self.book.by_req.get(req)
            if lease is None or consumer not in lease.holders:
                continue
            lease.holders.discard(consumer)
            if not lease.holders:
                self._claim(lease, ClaimEvent.LAST_DIED)

    def _forget_subscriber(self, consumer: Consumer, req: str) -> None:
        subs = self.subscribers.get(req)
        if subs is not None:
            subs.discard(consumer)
            if not subs:
                del self.subscribers[req]
                self.readers.pop(req, None)

    # ------------------------------------------- what leases tell us

    def notify(self, req: str, msg: Message) -> None:
        for consumer in self.subscribers.get(req, ()):
            consumer.send(msg)

    def fail(self, req: str, error: KvwireError) -> None:
        """``failed`` is a subscription's last word: an engine that wants the id
        again (a request pushed anew) subscribes anew."""
        self.notify(req, Failed(req=req, error=error.to_wire()))
        self.readers.pop(req, None)
        for consumer in self.subscribers.pop(req, ()):
            consumer.subscribed.discard(req)

    def refused(self, req: str, error: KvwireError) -> None:
        """A decode engine waiting for a request this receiver refused learns it
        now, with the sender's reason: the same outcome at both ends, and no
        engine left waiting for a request that will not come."""
        self.fail(req, error)
        self.missed.record(req, error, asyncio.get_running_loop().time())

    def opened(self, lease: Lease) -> None:
        # Engines that subscribed before it was opened hold it already.
        lease.holders = set(self.subscribers.get(lease.req, ()))
        lease.readers = self.readers.pop(lease.req, 1)
        if lease.holders:
            self._claim(lease, ClaimEvent.SUBSCRIBED)
        self.notify(lease.req, local.Opened(req=lease.req, note=lease.note))
        self.missed.forget(lease.req)

    def decided(self, lease: Lease, error: KvwireError | None) -> None:
        if error is not None:
            self.missed.record(lease.req, error, asyncio.get_running_loop().time())

    def delivered(self, lease: Lease) -> None:
        self._claim(lease, ClaimEvent.DELIVERED)

    def ended(self, lease: Lease) -> None:
        self._claim(lease, ClaimEvent.LEASE_ENDED)

    # ------------------------------------------------------- reclaim

    def _claim(self, lease: Lease, event: ClaimEvent) -> None:
        """Move the lease's claim (kvwired.lifecycle.claim) and carry out what it says."""
        ttl = self.config.unclaimed_ttl
        for action in lease.claim.apply(event):
            if action is ClaimAction.START_TTL:
                if lease.unclaimed_timer is not None:
                    lease.unclaimed_timer.cancel()
                lease.unclaimed_timer = asyncio.get_running_loop().call_later(
                    ttl, self._claim, lease, ClaimEvent.TTL_EXPIRED)
            elif action is ClaimAction.STOP_TTL:
                if lease.unclaimed_timer is not None:
                    lease.unclaimed_timer.cancel()
                    lease.unclaimed_timer = None
            elif action is ClaimAction.RECLAIM_UNCLAIMED:
                self._reclaim(lease, "unclaimed", f"no decode engine subscribed to it "
                              f"within unclaimed_ttl ({ttl:g} s)")
            elif action is ClaimAction.RECLAIM_DESERTED:
                self._reclaim(lease, "engine_gone", "its decode engines left before it was "
                              "delivered")
            elif action is ClaimAction.RECLAIM_ENGINE_GONE:
                self._reclaim(lease, "engine_gone", "its decode engine left without "
                              "releasing it")

    def _reclaim(self, lease: Lease, reason: str, why: str) -> None:
        """Free a delivered request nobody will release (logged and counted once)."""
        log.warning("delivered request reclaimed", req=lease.req, sender=lease.session.name,
                    reason=reason, why=why)
        self.metrics.reclaimed.labels(reason).inc()
        self.book.event(lease, LeaseEvent.RECLAIM)
        # An engine that asks for it later learns it is gone, and why.
        self.missed.record(lease.req, RequestAborted(
            f"request {lease.req} was delivered, then reclaimed: {why}",
            hint="a decode engine must subscribe within unclaimed_ttl and release what "
                 "it subscribed to"), asyncio.get_running_loop().time())
