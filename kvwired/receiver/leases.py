"""Leases: which request holds which slot of the pool, and how each ends.

``LeaseBook`` opens a lease for a sender's ``open`` (quota, pool room, keys),
feeds each lease's machine (kvwired.lifecycle.lease) its events and carries
out the actions it returns, keeps every outcome for senders that ask later
(kvwired.verdicts), and gives the slot back once. What decode engines are
told goes through the ``LeaseWatchers`` handed in at wiring time
(kvwired.receiver.engines); the book never sees an engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from .. import immediate, stripes, verdicts
from ..config import ReceiverConfig
from ..errors import (
    DuplicateRequest,
    KvwireError,
    ProtocolError,
    RequestAborted,
    RequestRefused,
    RequestTooLarge,
)
from ..layout import RequestShape
from ..lifecycle.claim import ClaimMachine
from ..lifecycle.lease import LeaseAction, LeaseEvent, LeaseMachine, LeaseState, Outcome
from ..metrics import Metrics
from ..pool import Pool, Slot
from ..protocol import Message
from ..protocol import control as ctl
from ..protocol import receiver_local as local
from ..quota import SenderQuotas
from ..transport.base import Responder
from ..verdicts import Verdict, VerdictBook
from .keys import LeaseKeys, grant_keys, revoke_keys
from .session import SenderSession

log = structlog.get_logger("kvwired.receiver")


class Holder(Protocol):
    """A decode engine holding a lease (kvwired.receiver.engines.Consumer)."""

    def send(self, msg: Message) -> None: ...


@dataclass(eq=False)
class Lease:
    """One request's slot of the pool, from ``lease`` until it is freed.

    ``machine`` decides every move; the book feeds it events and carries out
    the actions it returns.
    """

    id: int
    req: str
    shape: RequestShape
    slot: Slot
    session: SenderSession
    machine: LeaseMachine
    keys: LeaseKeys
    # Which layers have landed, from the immediates of each data channel
    # the lease was granted on (kvwired.stripes).
    fence: stripes.LandingFence
    # Each landed layer's digest, hashed as its immediate arrives (kvwired.checksum).
    digests: list[asyncio.Future[int]] = field(default_factory=list)
    checksum: int = 0
    opened_at: float = 0.0
    discard: bool = False  # an experiment's request: freed once delivered
    note: dict[str, Any] | None = None  # the prefill engine's, for the decode engines
    # Decode engines subscribed to it now; who holds it, and whether anyone
    # will release it (kvwired.lifecycle.claim).
    holders: set[Holder] = field(default_factory=set)
    # Engines that read it (a parallel decode engine's ranks share a push),
    # and how many have released it: freed at the last release.
    readers: int = 1
    releases: int = 0
    claim: ClaimMachine = field(init=False)
    error: KvwireError | None = None  # why it was aborted, for subscribers
    # Senders asking how it ended (``ask``), woken once it is decided.
    deciding: list[asyncio.Future[None]] = field(default_factory=list)
    # Reclaims it if nobody subscribes within unclaimed_ttl (claim's START_TTL).
    unclaimed_timer: asyncio.TimerHandle | None = None

    def __post_init__(self) -> None:
        self.claim = ClaimMachine(self.req)

    @property
    def state(self) -> LeaseState:
        return self.machine.state

    @property
    def landed(self) -> int:
        """Layers landed on every channel, in order: the engines were told of these."""
        return self.fence.landed

    def abort_reason(self) -> KvwireError:
        return self.error or RequestAborted(f"request {self.req} was aborted")

    def layer_message(self, n: int) -> local.Layer:
        return local.Layer(req=self.req, layer=n, offset=self.slot.offset,
                           length=self.shape.total_bytes)

    def complete_message(self) -> local.Complete:
        return local.Complete(req=self.req, offset=self.slot.offset,
                              length=self.shape.total_bytes, layers=self.shape.layers,
                              checksum=self.checksum)


class LeaseWatchers(Protocol):
    """What the decode engines hear of leases (kvwired.receiver.engines)."""

    def notify(self, req: str, msg: Message) -> None:
        """Tell the engines subscribed to ``req``."""

    def fail(self, req: str, error: KvwireError) -> None:
        """The subscriptions to ``req`` end with ``error``."""

    def refused(self, req: str, error: KvwireError) -> None:
        """``req`` will not come: tell those waiting, and those who ask later."""

    def opened(self, lease: Lease) -> None:
        """A lease for a request some engines may have subscribed to already."""

    def decided(self, lease: Lease, error: KvwireError | None) -> None:
        """Its outcome is committed (``error`` None: delivered)."""

    def delivered(self, lease: Lease) -> None:
        """It is held for decode: whoever claims it has until unclaimed_ttl."""

    def ended(self, lease: Lease) -> None:
        """Its slot is going back (released, aborted, reclaimed)."""


class LeaseBook:
    """Every lease of the request path, by id and by request."""

    def __init__(self, config: ReceiverConfig, metrics: Metrics, pool: Callable[[], Pool],
                 quotas: SenderQuotas, watchers: LeaseWatchers,
                 accepting: Callable[[], bool], settled: Callable[[], None]) -> None:
        self.config = config
        self.metrics = metrics
        self._pool = pool
        self.quotas = quotas
        self.watchers = watchers
        self._accepting = accepting
        self._settled = settled  # a lease stopped arriving (a drain waits for that)
        self.leases: dict[int, Lease] = {}
        self.by_req: dict[str, Lease] = {}
        self._lease_ids: set[int] = set()  # the request path's and the services'
        self._next_lease = 1
        # How leases ended, for senders that lost the answer (kvwired.verdicts).
        self.verdicts = VerdictBook()

    @property
    def pool(self) -> Pool:
        return self._pool()

    @property
    def arriving(self) -> int:
        """Requests leased whose bytes are still landing or being checked."""
        return sum(lease.machine.arriving for lease in self.leases.values())

    # ------------------------------------------------------------ opening

    async def open(self, session: SenderSession, msg: ctl.Open) -> None:
        req = msg.req
        try:
            if not self._accepting():
                raise RequestRefused(
                    f"the receiver is shutting down; request {req} was not accepted",
                    hint="send it to another receiver, or once this one is back")
            shape = RequestShape.from_wire(msg.shape)
            if shape.layers > immediate.MAX_LAYERS:
                raise RequestTooLarge(
                    f"request {req} has {shape.layers} layers; at most "
                    f"{immediate.MAX_LAYERS} are supported"
                )
            if req in self.by_req:
                raise DuplicateRequest(
                    f"request {req} is already held by this receiver",
                    hint="request ids must be unique until the decode engine releases them",
                )
            slot = await self._reserve(session.name, shape.total_bytes)
        except (KvwireError, KeyError, TypeError, ValueError) as exc:
            error = exc if isinstance(exc, KvwireError) else ProtocolError(f"bad shape: {exc}")
            log.info("request refused", req=req, sender=session.name, reason=str(error))
            self.metrics.requests.labels(session.label, "refused").inc()
            session.conn.send(ctl.Refused(req=req, error=error.to_wire()))
            if not isinstance(error, DuplicateRequest):  # theirs is the request we hold
                self.watchers.refused(req, error)
            return
        try:
            keys = await grant_keys(session, slot.offset, shape.total_bytes)
        except asyncio.CancelledError:
            # The session ended meanwhile (its responders are closed): the
            # slot was never disclosed.
            self.give_back(session.name, slot, shape.total_bytes)
            raise
        except KvwireError as exc:
            self.give_back(session.name, slot, shape.total_bytes)
            if session.alive:
                session.conn.send(ctl.Refused(req=req, error=exc.to_wire()))
            self.watchers.refused(req, exc)
            return
        if not session.alive or req in self.by_req:
            revoke_keys(session.responders, keys, lambda: self.give_back(
                session.name, slot, shape.total_bytes))
            if session.alive:
                session.conn.send(ctl.Refused(req=req, error=DuplicateRequest(
                    f"request {req} is already held by this receiver").to_wire()))
            return
        lease = Lease(self.allocate_lease_id(), req, shape, slot, session, LeaseMachine(req),
                      LeaseKeys(req, session, keys),
                      stripes.LandingFence(len(keys), shape.layers),
                      opened_at=asyncio.get_running_loop().time(),
                      discard=bool(msg.discard), note=msg.note)
        self.leases[lease.id] = lease
        self.by_req[req] = lease
        self.watchers.opened(lease)
        session.leases.add(lease.id)
        self.update_pool_metrics()
        session.conn.send(ctl.Lease(req=req, lease=lease.id, offset=slot.offset, keys=keys))

    async def _reserve(self, sender: str, length: int) -> Slot:
        """Room under the sender's quota, then in the pool, within one lease_wait."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.lease_wait
        await self.quotas.take(sender, length, self.config.lease_wait)
        try:
            return await self.pool.reserve(length, max(0.0, deadline - loop.time()))
        except BaseException:
            self.quotas.give_back(sender, length)
            raise

    def allocate_lease_id(self) -> int:
        """A lease id no live lease (the request path's or a service's) holds."""
        while True:
            lease_id = self._next_lease
            self._next_lease = self._next_lease % (immediate.LEASE_SPACE - 1) + 1
            if lease_id not in self._lease_ids:
                self._lease_ids.add(lease_id)
                return lease_id

    def free_lease_id(self, lease_id: int) -> None:
        self._lease_ids.discard(lease_id)

    async def regrant(self, session: SenderSession, channel: int,
                      responder: Responder) -> list[list[int]]:
        """Keys on a replaced channel's new responder for the session's leases
        that still take writes, as [lease, key] pairs. A lease whose keys are
        being revoked meanwhile gets none: its new key, never disclosed, is
        revoked at once."""
        live = [self.leases[i] for i in sorted(session.leases)
                if self.leases[i].keys.takes_writes]
        granted: list[list[int]] = []
        for lease in live:
            try:
                key = await responder.grant(lease.slot.offset, lease.shape.total_bytes)
            except KvwireError:
                continue  # the new responder failed too: the sender hears so from it
            if (lease.keys.takes_writes and self.leases.get(lease.id) is lease
                    and session.responders[channel] is responder):
                lease.keys.keys[channel] = key
                granted.append([lease.id, key])
            else:
                responder.revoke(key, lambda: None)
        return granted

    # ------------------------------------------------------------- moving

    def event(self, lease: Lease, event: LeaseEvent) -> None:
        """Move ``lease``'s machine and carry out what it says."""
        before = lease.state
        arriving = lease.machine.arriving
        undecided = lease.machine.outcome is Outcome.PENDING
        for action in lease.machine.apply(event):
            self._carry_out(lease, action)
        if arriving and not lease.machine.arriving:
            self._settled()
        if undecided and lease.machine.outcome is not Outcome.PENDING:
            self._decided(lease)
        if lease.state is LeaseState.FREED and before is not LeaseState.FREED:
            outcome = lease.machine.outcome
            if outcome is Outcome.ABORTED and before is not LeaseState.ABORTING:
                self.metrics.requests.labels(lease.session.label, "failed").inc()

    def _decided(self, lease: Lease) -> None:
        """The lease's outcome is committed: kept for a sender that asks later."""
        delivered = lease.machine.outcome is Outcome.DELIVERED
        error = None if delivered else lease.abort_reason()
        now = asyncio.get_running_loop().time()
        self.verdicts.record((lease.session.name, lease.req),
                             Verdict(lease.id, delivered, lease.checksum, error), now)
        self.watchers.decided(lease, error)
        waiting, lease.deciding = lease.deciding, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    def _carry_out(self, lease: Lease, action: LeaseAction) -> None:
        session = lease.session
        if action is LeaseAction.SEND_DELIVERED:
            if session.alive:
                session.conn.send(ctl.Delivered(req=lease.req, lease=lease.id,
                                                checksum=lease.checksum))
        elif action is LeaseAction.SEND_ABORT:
            self.metrics.requests.labels(session.label, "aborted").inc()
            if session.alive:
                session.conn.send(ctl.Abort(req=lease.req, lease=lease.id,
                                            error=lease.abort_reason().to_wire()))
        elif action is LeaseAction.SEND_ABORT_ACK:
            if session.alive:
                session.conn.send(ctl.AbortAck(req=lease.req, lease=lease.id))
        elif action is LeaseAction.NOTIFY_COMPLETE:
            self.watchers.notify(lease.req, lease.complete_message())
        elif action is LeaseAction.NOTIFY_FAILED:
            self.watchers.fail(lease.req, lease.abort_reason())
        elif action is LeaseAction.REVOKE_KEY:
            lease.keys.revoke()
        elif action is LeaseAction.FREE:
            self._free(lease)

    def _free(self, lease: Lease) -> None:
        session = lease.session
        self.watchers.ended(lease)
        del self.leases[lease.id]
        self.free_lease_id(lease.id)
        if self.by_req.get(lease.req) is lease:
            del self.by_req[lease.req]
        session.leases.discard(lease.id)
        # The slot goes back once no write under its key can land in it.
        lease.keys.revoke(lambda: self.give_back(
            session.name, lease.slot, lease.shape.total_bytes))

    def give_back(self, sender: str, slot: Slot, length: int) -> None:
        self.pool.release(slot)
        self.quotas.give_back(sender, length)
        self.update_pool_metrics()

    def update_pool_metrics(self) -> None:
        self.metrics.set_pool("receive", self.pool.size, self.pool.used_bytes)

    # ------------------------------------------------ what senders say

    def _held_by(self, session: SenderSession, lease_id: int) -> Lease | None:
        """The sender's lease; None for one we already freed (our message about
        it crossed theirs)."""
        lease = self.leases.get(lease_id)
        return lease if lease is not None and lease.session is session else None

    def sender_abort(self, session: SenderSession, msg: ctl.Abort) -> None:
        lease = self._held_by(session, msg.lease)
        if lease is None:
            if session.alive:
                # Long gone (delivered and released, or freed with a lost
                # connection): whatever we said about it went out first.
                session.conn.send(ctl.AbortAck(req=msg.req, lease=msg.lease))
            return
        reason = msg.error.get("message")
        log.info("sender aborted request", req=lease.req, state=lease.state.name,
                 reason=reason)
        lease.error = lease.error or RequestAborted(
            f"the sender aborted request {lease.req}: {reason}",
            hint="the prefill side gave up on it (deadline, abort, or it left)")
        self.event(lease, LeaseEvent.SENDER_ABORT)

    def sender_ack(self, session: SenderSession, msg: ctl.AbortAck) -> None:
        if (lease := self._held_by(session, msg.lease)) is not None:
            self.event(lease, LeaseEvent.SENDER_ACK)

    async def answer_ask(self, session: SenderSession, req: str, lease_id: int) -> None:
        """Tell a sender how its lease ended; one still being decided (its old
        connection not yet seen gone, its checksum still being computed) is
        answered once it is (the sender bounds its own wait)."""
        loop = asyncio.get_running_loop()
        lease = self.leases.get(lease_id)
        if (lease is not None and lease.req == req and lease.session.name == session.name
                and lease.machine.outcome is Outcome.PENDING):
            decided = loop.create_future()
            lease.deciding.append(decided)
            await decided
        verdict = self.verdicts.lookup_lease(session.name, req, lease_id, loop.time())
        log.info("sender asked how a request ended", req=req, sender=session.name,
                 verdict=verdicts.outcome(verdict))
        if session.alive:
            session.conn.send(verdicts.to_message(req, lease_id, verdict))

    def withdrawn(self, session: SenderSession, req: str, error: KvwireError) -> None:
        """A request the sender gave up before leasing it: its engines hear why."""
        if req in self.by_req:
            return  # a request of that id is held here: not the one withdrawn
        log.info("sender withdrew a request before leasing it", req=req,
                 sender=session.name, reason=error.message)
        self.watchers.refused(req, error)

    def session_lost(self, session: SenderSession, error: KvwireError) -> None:
        """The connection is gone, so no write of it can land any more: what
        was not delivered is aborted; what was stays for its decode engine."""
        for lease_id in list(session.leases):
            lease = self.leases[lease_id]
            lease.error = lease.error or error
            self.event(lease, LeaseEvent.SESSION_LOST)
