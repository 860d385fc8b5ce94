"""A link's data channels: opened on its rails, probed, watched, replaced in place.

Mirrors ``kvwired.receiver.channels``, the other end of the same channels.
A link has ``qps_per_peer`` of them, all up or none, spread over the rails
not left out (``rails``); a rail's first channel proves its path with a
zero-length write before the link counts as up. Posts go through the
``PostLedger``, so that a channel that fails under a live control
connection is replaced (``replace``, answered by the receiver's
``replaced`` with new keys) and its lost posts go again on the new one.

This is the one place that decides the data path has failed the link: a
channel that failed and cannot be replaced, or that stalled, is reported
through the ``lost`` callable the link hands in. The pushes on it fail
with that; they never decide it themselves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import structlog

from ..config import SenderConfig
from ..control import MISSED_PINGS, ControlConnection
from ..errors import (
    ChannelStalled,
    FailureStatus,
    KvwireError,
    PeerLost,
    RailFailed,
    TransportError,
)
from ..metrics import Metrics
from ..protocol import Message
from ..protocol import control as ctl
from ..tasks import TaskSet
from ..transport.base import DataChannel, Transport, Write
from .credits import Credits
from .dial import expect
from .holders import Holders
from .ledger import PostLedger
from .rails import RailHealth, replacement_rail

log = structlog.get_logger("kvwired.sender")

A = TypeVar("A", bound=Message)


class Ask(Protocol):
    """Send a request to the receiver and wait for its answer (``Requests.ask``)."""

    def __call__(self, msg: Message, answer: type[A], /) -> Awaitable[A]: ...


def rail_label(rail: str) -> str:
    """A rail as metrics name it: its device, or "default" for the control path's."""
    return rail or "default"


class DataChannels:
    """The data channels of one link, and the rails they run on."""

    def __init__(self, peer: str, config: SenderConfig, transport: Transport,
                 metrics: Metrics, credits: Credits, holders: Holders, tasks: TaskSet,
                 lost: Callable[[KvwireError], None], ask: Ask,
                 link_up: Callable[[], bool]) -> None:
        self.peer = peer
        self.config, self.transport, self.metrics = config, transport, metrics
        self.credits, self.holders, self.tasks = credits, holders, tasks
        self._lost, self._ask, self._link_up = lost, ask, link_up
        self.channels: list[DataChannel] = []
        self.rails: list[str] = []  # per channel: its RDMA device ("": the control path's)
        self.rail_health = RailHealth()
        # Posts not yet placed, per channel: a replaced channel posts them again.
        self.ledger = PostLedger()
        self._replacements: dict[int, asyncio.Task[None]] = {}
        self._conn: ControlConnection | None = None  # the one they were opened under
        self._control_lost = False  # it ended: nothing to replace on
        self._welcome_credits = 0  # each new channel's receives
        self.failure: KvwireError | None = None  # what broke the last channel
        for status in (FailureStatus.CONNECTION_LOST, FailureStatus.RETRY_EXCEEDED,
                       FailureStatus.RNR_RETRY_EXCEEDED, FailureStatus.REMOTE_ACCESS,
                       FailureStatus.STALLED):
            metrics.completion_errors.labels(peer, status)
        for result in ("replaced", "failed"):
            metrics.channel_replacements.labels(peer, result)

    @property
    def up(self) -> bool:
        """Every channel alive or being replaced."""
        return bool(self.channels) and all(c.alive or n in self._replacements
                                           for n, c in enumerate(self.channels))

    @property
    def first(self) -> DataChannel | None:
        return self.channels[0] if self.channels else None

    @property
    def pending_writes(self) -> int:
        return sum(c.pending_writes for c in self.channels)

    @property
    def stall_bound(self) -> float:
        """How long a channel may hold pending writes with none completing:
        the bound the control connection gives a silent peer (its missed pings)."""
        return self.config.heartbeat * MISSED_PINGS

    # ------------------------------------------------------------ opening

    def rail_devices(self) -> list[str]:
        return self.config.rail_devices() if self.transport.name == "verbs" else []

    def usable_rails(self) -> list[str]:
        return self.rail_health.usable(self.rail_devices(), time.monotonic())

    def rail_failed(self, exc: RailFailed, tried: list[str]) -> bool:
        """``exc.rail`` failed while the link was built on ``tried``: it is left
        out. Whether another build is worth it (some rail was not tried)."""
        now = time.monotonic()
        self.rail_health.failed(exc.rail, now)
        self.metrics.rail_errors.labels(self.peer, exc.rail, exc.status).inc()
        log.warning("rail left out", peer=self.peer, rail=exc.rail, error=str(exc),
                    retry_in=round(self.rail_health.left_out(now).get(exc.rail, 0), 1))
        return not set(self.usable_rails()) >= set(tried)

    async def open(self, conn: ControlConnection, usable_rails: list[str], credits: int
                   ) -> None:
        """``qps_per_peer`` channels under ``conn``, spread over ``usable_rails``,
        each with ``credits`` (the welcome's receives); all or none."""
        rails = [usable_rails[n % len(usable_rails)] if usable_rails else ""
                 for n in range(self.config.qps_per_peer)]
        channels: list[DataChannel] = []
        try:
            for number, rail in enumerate(rails):
                # A rail's first channel proves the rail before the link is up.
                channels.append(await self._open_one(
                    conn, rail, probe=bool(rail) and rail not in rails[:number]))
        except BaseException:
            for channel in channels:
                channel.close()
            raise
        self._conn, self.channels, self.rails = conn, channels, rails
        self._welcome_credits = credits
        self.credits.reset(len(channels), credits)
        self.ledger.reset(len(channels))
        self._control_lost = False
        for number, channel in enumerate(channels):
            self._watch(number, channel)

    async def _open_one(self, conn: ControlConnection, rail: str,
                        probe: bool = False) -> DataChannel:
        """One data channel (on ``rail``, if any): offer, the receiver's ``ready``,
        complete; with ``probe``, one zero-length write must complete on it (no
        key is checked for zero bytes, and no receive is consumed)."""
        initiator = self.transport.initiator(conn.local_host, rail)
        try:
            conn.send(ctl.Connect(params=await initiator.offer()))
            ready = await expect(conn, ctl.Ready, self.peer, self.config.connect_timeout)
            channel = await initiator.complete(ready.params)
        except BaseException as exc:
            initiator.abandon()
            if (rail and isinstance(exc, TransportError)
                    and not isinstance(exc, (RailFailed, PeerLost))):
                # Connecting a queue pair resolves the peer's address over its
                # rail (INIT->RTR), on both ends: a dead rail can fail here,
                # before any probe, once its backoff has let it be tried again.
                raise RailFailed(f"rail {rail} to receiver {self.peer} failed: {exc.message}",
                                 rail=rail) from exc
            raise
        if probe:
            try:
                await asyncio.wait_for(channel.post([Write(0, 0, 0)]),
                                       self.config.connect_timeout)
            except (TransportError, TimeoutError) as exc:
                channel.close()
                raise RailFailed(f"rail {rail} to receiver {self.peer} failed its probe: "
                                 f"{exc or 'no completion'}", rail=rail) from exc
            self.rail_health.proven(rail)
        for status in (FailureStatus.CONNECTION_LOST, FailureStatus.RETRY_EXCEEDED,
                       FailureStatus.REMOTE_ACCESS):
            self.metrics.rail_errors.labels(self.peer, rail_label(rail), status)
        return channel

    # ------------------------------------------------------------ posting

    def post(self, number: int, writes: Sequence[Write], imm: int | None, lease: int
             ) -> asyncio.Future[None]:
        """Post ``writes`` on channel ``number`` under ``lease``'s key there. The
        future ends when they are placed, on this channel or on the one that
        replaces it (kvwired.sender.ledger), or fails when the link does."""
        keys = self.holders.keys(lease)
        if keys is None:
            raise PeerLost(f"lease {lease} is not held on the link to receiver {self.peer}")
        return self.ledger.post(number, self.channels[number], writes, imm, lease,
                                keys[number])

    # ----------------------------------------------------------- watching

    def check_progress(self, bound: float | None = None) -> None:
        """Fail a channel that has stalled (``bound``: ``stall_bound``).

        A stream whose packets are dropped without a reset (a firewall, a
        wedged path) raises nothing: TCP retransmits for many minutes, and
        the control connection beside it stays healthy, so neither the
        heartbeat nor a deadline (whose drain waits for the posted writes)
        would ever end the push. A channel with writes pending and none
        completing for ``stall_bound`` is declared stalled; it fails, which
        loses the link (``_failed``): the receiver frees the link's
        undelivered leases, and every push on it ends with that error (or
        its deadline's). With a smaller ``bound`` (a push draining after its
        deadline) the channel is replaced instead, as any other failed one.
        """
        now = time.monotonic()
        bound = self.stall_bound if bound is None else bound
        for number, channel in enumerate(self.channels):
            stalled = channel.stalled_for(now)
            if stalled <= bound:
                continue
            log.warning("data channel stalled", peer=self.peer, channel=number,
                        seconds=round(stalled, 1), pending=channel.pending_writes)
            channel.fail(ChannelStalled(
                f"data channel {number} to receiver {self.peer} placed nothing for "
                f"{stalled:.1f} s with {channel.pending_writes} writes pending"))
            return

    def take_rails_back(self, idle: bool) -> None:
        """An ``idle`` link missing a rail whose backoff has passed is rebuilt
        with it (its probe decides whether it stays); a busy one waits."""
        if not self.rail_health.left_out_any:
            return  # the common case, every second: no sysfs read for rails = auto
        due = self.rail_health.worth_retrying(self.rail_devices(), self.rails,
                                              time.monotonic())
        if due and idle:
            log.info("rebuilding the link to take rails back", peer=self.peer, rails=due)
            self._lost(PeerLost(f"connection to receiver {self.peer} rebuilt to take rails "
                                f"{', '.join(due)} back"))

    def control_lost(self, ending: PeerLost) -> None:
        """The control connection ended: its channels fail with it (counted as
        failed, connection_lost, whichever socket's end the loop saw first),
        and none is replaced."""
        self._control_lost = True
        for channel in self.channels:
            channel.fail(ending)

    def close(self, error: KvwireError) -> None:
        """The link is down: every post outstanding fails with ``error``."""
        channels, self.channels, self.rails, self._conn = self.channels, [], [], None
        replacements, self._replacements = self._replacements, {}
        for task in replacements.values():
            if task is not asyncio.current_task():
                task.cancel()
        self.credits.clear()
        self.ledger.fail_all(error)
        for channel in channels:
            channel.close()

    # ------------------------------------------------ failure and replacement

    def _watch(self, number: int, channel: DataChannel) -> None:
        channel.on_failure = lambda error: self._failed(number, channel, error)

    def _failed(self, number: int, channel: DataChannel, error: Exception) -> None:
        """Channel ``number`` failed: counted; replaced under a live control
        connection if its failure is one a new channel can ride out
        (``replace``); otherwise the link is lost, with this failure."""
        rail = self.rails[number] if number < len(self.rails) else ""
        self._count_failure(error, rail)
        if number in self._replacements:
            return
        if self.replaceable(number, channel, error):
            self.ledger.replacing.add(number)
            self.credits.freeze(number)
            # The rail is chosen now: a task started after a slow sibling's
            # offer could find the dead rail's backoff over, and go back to it.
            self._replacements[number] = self.tasks.spawn(
                self._replace(number, channel, error, self._replacement_rail(number)),
                f"replace-{self.peer}-{number}")
        elif channel in self.channels and not self._control_lost:
            self._lost(self._loss(error))

    def _loss(self, error: Exception) -> PeerLost:
        """The link's end for a channel's failure: named after its receiver,
        with the failure's status, hint and whether a retry may help."""
        if not isinstance(error, KvwireError):
            return PeerLost(f"the data channel to receiver {self.peer} failed: {error}")
        loss = PeerLost(f"receiver {self.peer}: {error.message}", hint=error.hint,
                        status=error.status)
        loss.retriable = error.retriable
        return loss

    def replaceable(self, number: int, channel: DataChannel, error: Exception) -> bool:
        """A channel is replaced while the peer is known to be there (the control
        connection is up) and the failure is the wire's (``replaceable``). A path
        that placed nothing for the stall bound, across the channels that
        replaced each other on it, is given up as a silent peer is, unless
        another rail is usable: then the replacement moves there."""
        status = FailureStatus.of(error)
        if (self._control_lost or self._conn is None or self._conn.closed
                or not self._link_up()
                or status is None or not status.replaceable or channel not in self.channels):
            return False
        return (channel.silent_for(time.monotonic()) <= self.stall_bound
                or self._replacement_rail(number) != self.rails[number])

    async def _replace(self, number: int, failed: DataChannel, error: Exception,
                       rail: str) -> None:
        """A new channel in place of ``failed``, under the same control connection:
        offer, the receiver's ``replaced`` (its new responder, and new keys for
        every lease that still takes writes, the old ones revoked with the old
        responder), complete; then the lost posts go again, in order."""
        conn, failed_rail = self._conn, self.rails[number]
        assert conn is not None
        cause = error.message if isinstance(error, KvwireError) else str(error)
        began = time.monotonic()
        log.warning("replacing a data channel", peer=self.peer, channel=number,
                    rail=rail_label(rail), error=cause)
        initiator = self.transport.initiator(conn.local_host, rail)
        try:
            async with asyncio.timeout(self.config.connect_timeout):
                params = await initiator.offer()
                answer = await self._ask(ctl.Replace(
                    req=f"replace-{number}-{time.monotonic_ns()}", channel=number,
                    params=params), ctl.Replaced)
                channel = await initiator.complete(answer.params)
        except (KvwireError, TimeoutError) as exc:
            initiator.abandon()
            self.metrics.channel_replacements.labels(self.peer, "failed").inc()
            if self._conn is conn:
                del self._replacements[number]
                self._lost(PeerLost(
                    f"data channel {number} to receiver {self.peer} failed ({cause}) and "
                    f"could not be replaced: {exc or 'no answer in time'}",
                    hint=getattr(error, "hint", ""),
                    status=getattr(error, "status", FailureStatus.CONNECTION_LOST)))
            return
        except asyncio.CancelledError:
            initiator.abandon()
            raise
        if self._conn is not conn:
            channel.close()  # the link went down meanwhile
            return
        self.channels[number], self.rails[number] = channel, rail
        self._watch(number, channel)
        keys = {int(lease): int(key) for lease, key in answer.keys}
        self.holders.rekey(number, keys)
        immediates = self.ledger.repost(number, channel, keys, dropped=error,
                                        wanted=self.holders.takes_writes)
        if rail == failed_rail:
            channel.inherit_silence(failed)  # the same path: its silence goes on
        del self._replacements[number]
        self.credits.thaw(number, self._welcome_credits - immediates)
        self.failure = None
        self.metrics.channel_replacements.labels(self.peer, "replaced").inc()
        log.info("data channel replaced", peer=self.peer, channel=number,
                 rail=rail_label(rail), reposted=immediates, leases=len(keys),
                 seconds=round(time.monotonic() - began, 3))

    def _replacement_rail(self, number: int) -> str:
        return replacement_rail(self.rails[number], self.usable_rails(), number)

    def _count_failure(self, error: Exception, rail: str) -> None:
        status = error.status if isinstance(error, KvwireError) else FailureStatus.TRANSPORT_ERROR
        known = FailureStatus.of(error)
        self.metrics.completion_errors.labels(self.peer, status).inc()
        self.metrics.rail_errors.labels(self.peer, rail_label(rail), status).inc()
        if rail and known is not None and known.rail_unanswered:
            # The peer did not acknowledge on this rail: rebuilt without it,
            # and its other channels move off it now, not at their next stall.
            self.rail_health.failed(rail, time.monotonic())
            # A snapshot: failing one may lose the link, which empties the lists.
            on_rail = [(n, c) for n, c in enumerate(self.channels) if self.rails[n] == rail]
            for number, channel in on_rail:
                if channel.alive:
                    channel.fail(TransportError(
                        f"data channel {number} to receiver {self.peer} moved off rail "
                        f"{rail}, which was left out", status=FailureStatus.RAIL_LEFT_OUT))
        if isinstance(error, TransportError):
            # Named after the receiver: "outgoing data connection closed" alone
            # does not say which of several peers went away.
            self.failure = error.renamed(f"receiver {self.peer}: {error.message}")

