"""``PeerLink``: the sender's control connection and data channels to one receiver.

A link holds its connection up between requests (so ``kvwire_peer_up`` says
whether a receiver is reachable before a request needs it), matches the
receiver's answers to the requests that asked for them, counts the
receiver's credits (per data channel: ``qps_per_peer`` of them, see
kvwired.stripes), and routes aborts to whoever holds the lease named.
A link knows nothing of what holds a lease (a push, an experiment's echo):
holders register themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from ..addresses import control_address
from ..config import SenderConfig
from ..control import MISSED_PINGS, ControlConnection
from ..errors import (
    AuthenticationFailed,
    ChannelStalled,
    DuplicateRequest,
    FailureStatus,
    KvwireError,
    PeerLost,
    ProtocolError,
    RailFailed,
    RequestAborted,
    TransportError,
    from_wire,
)
from ..layout import RequestShape
from ..lifecycle.link import LinkAction, LinkEvent, LinkMachine, LinkState
from ..metrics import Metrics
from ..ports import LeaseHolder
from ..protocol import Error, Handlers, Message
from ..protocol import control as ctl
from ..rails import RailHealth
from ..tasks import TaskSet
from ..transport.base import DataChannel, Transport, Write
from ..trust import Trust
from .ledger import PostLedger

log = structlog.get_logger("kvwired.sender")

# What to send the receiver when an answer arrives that nobody waits for any
# more (a deadline fired, the engine left): the undo of what it granted.
# What to send back for an answer nobody waits for any more (a lease: its abort).
Undo = Callable[[Any], Message | None]
A = TypeVar("A", bound=Message)


def _req_of(msg: Message) -> str:
    """The request a message is about: every request and answer names one."""
    req = getattr(msg, "req", None)
    assert isinstance(req, str), f"{msg.kind!r} names no request"
    return req

RECONNECT_MAX = 30.0  # seconds between reconnection attempts, at most


def rail_label(rail: str) -> str:
    """A rail as metrics name it: its device, or "default" for the control path's."""
    return rail or "default"


class PeerLink:
    """Control connection + data channel to one named receiver."""

    def __init__(self, name: str, address: str, config: SenderConfig, transport: Transport,
                 metrics: Metrics, trust: Trust | None = None) -> None:
        self.name, self.address = name, address
        self.trust = trust
        self.config, self.transport, self.metrics = config, transport, metrics
        self.conn: ControlConnection | None = None
        # Data channels, all up or none; a push stripes over every one.
        self.channels: list[DataChannel] = []
        self.credits: list[int] = []  # per channel: immediates it may still post
        self.rails: list[str] = []  # per channel: its RDMA device ("": the control path's)
        self.rail_health = RailHealth()
        # Posts not yet placed, per channel: a replaced channel posts them again.
        self.ledger = PostLedger()
        self._replacements: dict[int, asyncio.Task[None]] = {}
        self._keys: dict[int, list[int]] = {}  # by lease: its keys, one per channel
        self._welcome_credits = 0  # each new channel's receives
        self._control_lost = False  # the control connection ended: nothing to replace on
        self._credit_freed = asyncio.Event()
        self._lock = asyncio.Lock()
        # Requests to the receiver awaiting their answer, by request id.
        self._waiting: dict[str, tuple[asyncio.Future[Message], Undo | None]] = {}
        self._abandoned: dict[str, Undo] = {}
        self._dispatch = self._handlers()
        # Channel replacements and best-effort notices: they end with the link.
        self.tasks = TaskSet(f"link {name}")
        self._unheld = asyncio.Event()  # set while no lease is held on the link
        self._unheld.set()
        self.holders: dict[int, LeaseHolder] = {}
        self.ever_connected = False
        self.machine = LinkMachine(name)
        self._counted = False  # in kvwire_peers_connected
        self._ending: KvwireError = PeerLost(f"receiver {name} went away")
        self._bye_reason = "the link was retired"
        self.failure: KvwireError | None = None  # what broke the last data channel
        # Series that exist from the start, so rates and alerts see zeros.
        metrics.reconnects.labels(name)
        metrics.peer_seen(name)
        for status in (FailureStatus.CONNECTION_LOST, FailureStatus.RETRY_EXCEEDED,
                       FailureStatus.RNR_RETRY_EXCEEDED, FailureStatus.REMOTE_ACCESS,
                       FailureStatus.STALLED):
            metrics.completion_errors.labels(name, status)
        for result in ("replaced", "failed"):
            metrics.channel_replacements.labels(name, result)

    @property
    def channel(self) -> DataChannel | None:
        """The first data channel: the one experiments (echo pings, streams) use."""
        return self.channels[0] if self.channels else None

    @property
    def connected(self) -> bool:
        """Up, with every data channel alive or being replaced."""
        return (self.machine.state in (LinkState.UP, LinkState.RETIRING)
                and self.conn is not None and not self.conn.closed
                and bool(self.channels)
                and all(c.alive or n in self._replacements
                        for n, c in enumerate(self.channels)))

    @property
    def retired(self) -> bool:
        """No new request may use it (removed from the peers, or stopping)."""
        return not self.machine.usable

    def _apply(self, event: LinkEvent, error: KvwireError | None = None) -> None:
        if error is not None:
            self._ending = error
        for action in self.machine.apply(event):
            if action is LinkAction.START_READING:
                self._start_reading()
            elif action is LinkAction.CLOSE_CONNECTION:
                self._close_connection()
            elif action is LinkAction.FAIL_HOLDERS:
                self._fail_holders(self._ending)
            elif action is LinkAction.SEND_BYE:
                self.send(ctl.Bye(reason=self._bye_reason))
            # OPEN_CONNECTION: ``ensure`` opens it, holding the lock.

    @property
    def local_host(self) -> str:
        """Our own address on the control connection (the data path follows it)."""
        if self.conn is None:
            raise PeerLost(f"receiver {self.name} went away")
        return self.conn.local_host

    async def keep_connected(self) -> None:
        """Hold the connection up between requests (retries back off to 30 s),
        and watch its data channels for progress while it is up."""
        backoff = 1.0
        tick = min(1.0, self.config.heartbeat)
        loop = asyncio.get_running_loop()
        woke = loop.time()
        while self.machine.usable:
            if self.connected:
                backoff = 1.0
                # A tick late by more than a heartbeat means this process was
                # stopped or starved: completions that arrived meanwhile are
                # still unread, so judge the channels on the next tick, not now.
                if loop.time() - woke <= tick + self.config.heartbeat:
                    self.check_progress()
                self._take_rails_back()
            else:
                try:
                    await self.ensure()
                    continue
                except KvwireError as exc:
                    log.debug("receiver not reachable yet", peer=self.name, error=str(exc))
                    backoff = min(backoff * 2, RECONNECT_MAX)
            woke = loop.time() + (tick if self.connected else backoff)
            await asyncio.sleep(tick if self.connected else backoff)

    @property
    def stall_bound(self) -> float:
        """How long a data channel may hold pending writes with none completing:
        the bound the control connection gives a silent peer (its missed pings)."""
        return self.config.heartbeat * MISSED_PINGS

    def check_progress(self, bound: float | None = None) -> None:
        """Fail a data channel that has stalled (``bound``: ``stall_bound``), and
        the link with it.

        A stream whose packets are dropped without a reset (a firewall, a
        wedged path) raises nothing: TCP retransmits for many minutes, and
        the control connection beside it stays healthy, so neither the
        heartbeat nor a deadline (whose drain waits for the posted writes)
        would ever end the push. A channel with writes pending and none
        completing for ``stall_bound`` is declared stalled; its posts fail,
        the link drops, the receiver frees the link's undelivered leases, and
        every push on it ends with that error (or its deadline's). With a
        smaller ``bound`` (a push draining after its deadline) the channel is
        replaced instead, as any other failed channel (``_channel_failed``).
        """
        now = time.monotonic()
        bound = self.stall_bound if bound is None else bound
        for number, channel in enumerate(self.channels):
            stalled = channel.stalled_for(now)
            if stalled <= bound:
                continue
            error = ChannelStalled(
                f"data channel {number} to receiver {self.name} placed nothing for "
                f"{stalled:.1f} s with {channel.pending_writes} writes pending")
            log.warning("data channel stalled", peer=self.name, channel=number,
                        seconds=round(stalled, 1), pending=channel.pending_writes)
            channel.fail(error)
            if number not in self._replacements:
                self.lost(PeerLost(f"receiver {self.name}: {error.message}", hint=error.hint,
                                   status=error.status))
            return

    async def ensure(self) -> None:
        async with self._lock:
            if self.connected:
                return
            if not self.machine.usable:
                raise PeerLost(f"receiver {self.name} is no longer a peer of this sender",
                               hint="it was removed from [peers], or the sender is stopping")
            # Whatever still hangs on the old connection fails with what broke
            # it (a completion error, say), not with "being rebuilt".
            self.lost(self.failure or PeerLost(
                f"connection to receiver {self.name} is being rebuilt"))
            self.failure = None
            self._apply(LinkEvent.CONNECT)
            try:
                await self._connect()
            except BaseException:
                if self.machine.can(LinkEvent.CONNECT_FAILED):
                    self._apply(LinkEvent.CONNECT_FAILED)
                raise
            self._apply(LinkEvent.CONNECTED)

    def _take_rails_back(self) -> None:
        """An idle link missing a rail whose backoff has passed is rebuilt with it
        (its probe decides whether it stays); a busy one waits until idle."""
        if not self.rail_health.left_out_any:
            return  # the common case, every second: no sysfs read for rails = auto
        devices = self._rail_devices()
        due = self.rail_health.worth_retrying(devices, self.rails, time.monotonic())
        if due and not self.holders and not self._waiting:
            log.info("rebuilding the link to take rails back", peer=self.name, rails=due)
            self.lost(PeerLost(f"connection to receiver {self.name} rebuilt to take rails "
                               f"{', '.join(due)} back"))

    def _rail_devices(self) -> list[str]:
        return self.config.rail_devices() if self.transport.name == "verbs" else []

    async def _connect(self) -> None:
        """Connect on the rails not left out; a rail failing its probe is left
        out and the link built again on the others."""
        while True:
            devices = self._rail_devices()
            usable = self.rail_health.usable(devices, time.monotonic())
            try:
                await self._connect_on(usable)
                return
            except RailFailed as exc:
                self.rail_health.failed(exc.rail, time.monotonic())
                self.metrics.rail_errors.labels(self.name, exc.rail, exc.status).inc()
                log.warning("rail left out", peer=self.name, rail=exc.rail, error=str(exc),
                            retry_in=round(self.rail_health.left_out(time.monotonic()).get(
                                exc.rail, 0), 1))
                if set(self.rail_health.usable(devices, time.monotonic())) >= set(usable):
                    raise  # every rail was tried: none carries a channel now

    async def _connect_on(self, usable_rails: list[str]) -> None:
        cfg = self.config
        host, port = control_address(self.address)
        reader, writer = await self._dial(host, port)
        conn = ControlConnection(reader, writer, cfg.heartbeat, f"receiver {self.name}")
        channels: list[DataChannel] = []
        try:
            conn.send(ctl.Hello(role="sender", name=cfg.name,
                                transports=[self.transport.name]))
            welcome = await self._expect(conn, ctl.Welcome)
            self._check_identity(conn, welcome.name)
            rails = [usable_rails[n % len(usable_rails)] if usable_rails else ""
                     for n in range(cfg.qps_per_peer)]
            for number, rail in enumerate(rails):
                # A rail's first channel proves the rail before the link is up.
                channels.append(await self._open_channel(
                    conn, rail, probe=bool(rail) and rail not in rails[:number]))
        except BaseException:
            for channel in channels:
                channel.close()
            conn.close()
            raise
        self.conn = conn
        self.channels, self.rails = channels, rails
        self._welcome_credits = welcome.credits
        self.credits = [self._welcome_credits] * len(channels)
        self.ledger.reset(len(channels))
        self._control_lost = False
        for number, channel in enumerate(channels):
            self._watch(number, channel)
        if self.ever_connected:
            self.metrics.reconnects.labels(self.name).inc()
        self.ever_connected = True
        log.info("connected to receiver", peer=self.name, address=self.address,
                 transport=self.transport.name, channels=len(channels),
                 rails=sorted(set(rails) - {""}), credits=self.credits[0])

    async def _dial(self, host: str, port: int
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The control connection's TCP connection, then its TLS handshake: two
        steps, so that a port that takes connections and never answers TLS is
        told apart from one that cannot be reached, each within connect_timeout."""
        timeout = self.config.connect_timeout
        where = f"receiver {self.name} at {host}:{port}"
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                    timeout)
        except (OSError, TimeoutError) as exc:
            raise PeerLost(
                f"cannot reach {where}: "
                f"{getattr(exc, 'strerror', None) or f'no answer within {timeout:g} s'}",
                hint="is kvwired receiver running there, and is the port reachable?",
            ) from exc
        if self.trust is None:
            return reader, writer
        try:
            await asyncio.wait_for(writer.start_tls(self.trust.client, server_hostname=host),
                                   timeout)
        except ssl.SSLError as exc:
            writer.close()
            verify = str(getattr(exc, "verify_message", "") or "")
            raise AuthenticationFailed(
                f"{where} failed the TLS handshake: {verify or exc.reason or exc}",
                hint=("a certificate in the handshake has expired: reissue it with `kvctl "
                      "keys issue` and send SIGHUP to the daemon that holds it"
                      if "expired" in verify else
                      "its certificate must come from this cluster's CA and be a receiver's; "
                      "a receiver with auth = \"none\" fails this way too")) from exc
        except TimeoutError as exc:
            writer.close()
            raise PeerLost(
                f"{where} took the connection but completed no TLS handshake within "
                f"{timeout:g} s",
                hint="is a kvwire receiver with auth = \"tls\" on that port? Another service "
                     "there, or an overloaded receiver, answers this way") from exc
        except OSError as exc:
            writer.close()
            raise PeerLost(f"{where} closed the connection during the TLS handshake: "
                           f"{exc.strerror or exc}",
                           hint="its log says why (kvwire_auth_failures_total counts it)"
                           ) from exc
        return reader, writer

    async def _open_channel(self, conn: ControlConnection, rail: str,
                            probe: bool = False) -> DataChannel:
        """One data channel (on ``rail``, if any): offer, the receiver's ``ready``,
        complete; with ``probe``, one zero-length write must complete on it (no
        key is checked for zero bytes, and no receive is consumed)."""
        initiator = self.transport.initiator(conn.local_host, rail)
        try:
            conn.send(ctl.Connect(params=await initiator.offer()))
            ready = await self._expect(conn, ctl.Ready)
            channel = await initiator.complete(ready.params)
        except BaseException as exc:
            initiator.abandon()
            if (rail and isinstance(exc, TransportError)
                    and not isinstance(exc, (RailFailed, PeerLost))):
                # Connecting a queue pair resolves the peer's address over its
                # rail (INIT->RTR), on both ends: a dead rail can fail here,
                # before any probe, once its backoff has let it be tried again.
                raise RailFailed(f"rail {rail} to receiver {self.name} failed: {exc.message}",
                                 rail=rail) from exc
            raise
        if probe:
            try:
                await asyncio.wait_for(channel.post([Write(0, 0, 0)]),
                                       self.config.connect_timeout)
            except (TransportError, TimeoutError) as exc:
                channel.close()
                raise RailFailed(f"rail {rail} to receiver {self.name} failed its probe: "
                                 f"{exc or 'no completion'}", rail=rail) from exc
            self.rail_health.proven(rail)
        for status in (FailureStatus.CONNECTION_LOST, FailureStatus.RETRY_EXCEEDED,
                       FailureStatus.REMOTE_ACCESS):
            self.metrics.rail_errors.labels(self.name, rail_label(rail), status)
        return channel

    def _check_identity(self, conn: ControlConnection, claimed: str) -> None:
        """The receiver at the address must be the one configured under this name:
        a mis-wired address must not receive another receiver's KV cache."""
        if self.trust is None:
            return
        certified = conn.certified_name
        if certified != self.name or claimed != certified:
            raise AuthenticationFailed(
                f"the receiver at {self.address} is {certified!r} by its certificate "
                f"(it says {claimed!r}), not {self.name!r}",
                hint="name each peer in [peers] as its receiver's certificate does, and "
                     "check the address")

    def _start_reading(self) -> None:
        assert self.conn is not None
        self.conn.start_pinging()
        self.conn.serve(lambda msg: self._dispatch(None, msg), self._connection_ended,
                        f"link-{self.name}")
        self.metrics.peers.inc()
        self._counted = True

    # ------------------------------------------------ posts and replacement

    def post(self, number: int, writes: list[Write], imm: int | None, lease: int
             ) -> asyncio.Future[None]:
        """Post ``writes`` on data channel ``number`` under ``lease``'s key there.
        The future ends when they are placed, on this channel or on the one
        that replaces it if it fails (kvwired.sender.ledger), or fails when
        the link does."""
        keys = self._keys.get(lease)
        if keys is None:
            raise PeerLost(f"lease {lease} is not held on the link to receiver {self.name}")
        return self.ledger.post(number, self.channels[number], writes, imm, lease,
                                keys[number])

    def _watch(self, number: int, channel: DataChannel) -> None:
        channel.on_failure = lambda error: self._channel_failed(number, channel, error)

    def _channel_failed(self, number: int, channel: DataChannel, error: Exception) -> None:
        """Data channel ``number`` failed: counted; replaced under a live control
        connection if its failure is one a new channel can ride out
        (``_replace``); otherwise its posts fail and the link goes down."""
        rail = self.rails[number] if number < len(self.rails) else ""
        self._count_failure(error, rail)
        if self._replaceable(number, channel, error) and number not in self._replacements:
            self.ledger.replacing.add(number)
            self.credits[number] = 0
            self._replacements[number] = self.tasks.spawn(
                self._replace(number, channel, error), f"replace-{self.name}-{number}")

    def _replaceable(self, number: int, channel: DataChannel, error: Exception) -> bool:
        """A channel is replaced while the peer is known to be there (the control
        connection is up) and the failure is the wire's (``replaceable``). A path
        that placed nothing for the stall bound, across the channels that
        replaced each other on it, is given up as a silent peer is, unless
        another rail is usable: then the replacement moves there."""
        status = FailureStatus.of(error)
        if (self._control_lost or self.conn is None or self.conn.closed
                or self.machine.state not in (LinkState.UP, LinkState.RETIRING)
                or status is None or not status.replaceable or channel not in self.channels):
            return False
        return (channel.silent_for(time.monotonic()) <= self.stall_bound
                or self._replacement_rail(number) != self.rails[number])

    async def _replace(self, number: int, failed: DataChannel, error: Exception) -> None:
        """A new channel in place of ``failed``, under the same control connection:
        offer, the receiver's ``replaced`` (its new responder, and new keys for
        every lease that still takes writes, the old ones revoked with the old
        responder), complete; then the lost posts go again, in order."""
        conn, failed_rail = self.conn, self.rails[number]
        rail = self._replacement_rail(number)
        assert conn is not None
        cause = error.message if isinstance(error, KvwireError) else str(error)
        began = time.monotonic()
        log.warning("replacing a data channel", peer=self.name, channel=number,
                    rail=rail_label(rail), error=cause)
        initiator = self.transport.initiator(conn.local_host, rail)
        try:
            async with asyncio.timeout(self.config.connect_timeout):
                params = await initiator.offer()
                answer = await self.request(ctl.Replace(
                    req=f"replace-{number}-{time.monotonic_ns()}", channel=number,
                    params=params), ctl.Replaced)
                channel = await initiator.complete(answer.params)
        except (KvwireError, TimeoutError) as exc:
            initiator.abandon()
            self.metrics.channel_replacements.labels(self.name, "failed").inc()
            if self.conn is conn:
                del self._replacements[number]
                self.lost(PeerLost(
                    f"data channel {number} to receiver {self.name} failed ({cause}) and "
                    f"could not be replaced: {exc or 'no answer in time'}",
                    hint=getattr(error, "hint", ""),
                    status=getattr(error, "status", "connection_lost")))
            return
        except asyncio.CancelledError:
            initiator.abandon()
            raise
        if self.conn is not conn:
            channel.close()  # the link went down meanwhile
            return
        self.channels[number], self.rails[number] = channel, rail
        self._watch(number, channel)
        keys = {int(lease): int(key) for lease, key in answer.keys}
        for lease, key in keys.items():
            if (held := self._keys.get(lease)) is not None:
                held[number] = key
        immediates = self.ledger.repost(
            number, channel, keys, dropped=error,
            wanted=lambda lease: (holder := self.holders.get(lease)) is not None
            and holder.takes_writes)
        if rail == failed_rail:
            channel.inherit_silence(failed)  # the same path: its silence goes on
        del self._replacements[number]
        self.credits[number] = max(0, self._welcome_credits - immediates)
        self._credit_freed.set()
        self.failure = None
        self.metrics.channel_replacements.labels(self.name, "replaced").inc()
        log.info("data channel replaced", peer=self.name, channel=number,
                 rail=rail_label(rail), reposted=immediates, leases=len(keys),
                 seconds=round(time.monotonic() - began, 3))

    def _replacement_rail(self, number: int) -> str:
        """Channel ``number``'s rail, unless that rail has just been left out
        (its writes were not acknowledged) and another is usable: then the
        replacement moves to one of those."""
        rail = self.rails[number]
        if not rail:
            return rail
        usable = self.rail_health.usable(self._rail_devices(), time.monotonic())
        if rail in usable or not usable:
            return rail
        return usable[number % len(usable)]

    def _count_failure(self, error: Exception, rail: str) -> None:
        status = error.status if isinstance(error, KvwireError) else FailureStatus.TRANSPORT_ERROR
        known = FailureStatus.of(error)
        self.metrics.completion_errors.labels(self.name, status).inc()
        self.metrics.rail_errors.labels(self.name, rail_label(rail), status).inc()
        if rail and known is not None and known.rail_unanswered:
            # The peer did not acknowledge on this rail: rebuilt without it,
            # and its other channels move off it now, not at their next stall.
            self.rail_health.failed(rail, time.monotonic())
            for number, channel in enumerate(self.channels):
                if self.rails[number] == rail and channel.alive:
                    channel.fail(TransportError(
                        f"data channel {number} to receiver {self.name} moved off rail "
                        f"{rail}, which was left out", status=FailureStatus.RAIL_LEFT_OUT))
        if isinstance(error, TransportError):
            # Named after the receiver: "outgoing data connection closed" alone
            # does not say which of several peers went away.
            self.failure = error.renamed(f"receiver {self.name}: {error.message}")

    async def _expect(self, conn: ControlConnection, kind: type[A]) -> A:
        msg = await conn.recv(self.config.connect_timeout)
        if isinstance(msg, Error):
            raise from_wire(msg.error)
        if not isinstance(msg, kind):
            raise ProtocolError(
                f"receiver {self.name} sent {msg.kind!r}, expected {kind.kind!r}")
        return msg

    def _connection_ended(self, conn: ControlConnection, error: KvwireError) -> None:
        if self.conn is conn:
            self._control_lost = True  # its channels fail with it: none is replaced
            log.warning("receiver connection lost", peer=self.name, error=str(error))
            ending = error if isinstance(error, PeerLost) else PeerLost(
                f"receiver {self.name}: {error}")
            # The data channels go with it, and count as failed (connection_lost)
            # whichever socket's end the loop happened to see first: a receiver
            # that crashed is a data-path failure either way.
            for channel in self.channels:
                channel.fail(ending)
            self.lost(ending)

    def _handlers(self) -> Handlers[None]:
        """What a receiver may send on a live link, by type."""
        handlers = Handlers[None](f"receiver {self.name}")
        handlers.on(ctl.Credits, self._credits_returned)
        handlers.on(ctl.Delivered, self._delivered)
        handlers.on(ctl.Abort, self._aborted_by_receiver)
        handlers.on(ctl.AbortAck, self._abort_acked)
        handlers.on(ctl.Bye, self._receiver_said_goodbye)
        handlers.on(Error, self._receiver_reported)
        for answer in ctl.ANSWERS:
            handlers.on(answer, lambda _, msg: self._answer(msg))
        return handlers

    # A lease no holder has any more has already ended on our side.
    def _delivered(self, _: None, msg: ctl.Delivered) -> None:
        if (holder := self.holders.get(msg.lease)) is not None:
            holder.delivered(msg.checksum)

    def _aborted_by_receiver(self, _: None, msg: ctl.Abort) -> None:
        if (holder := self.holders.get(msg.lease)) is not None:
            holder.fail(from_wire(msg.error), by_receiver=True)

    def _abort_acked(self, _: None, msg: ctl.AbortAck) -> None:
        if (holder := self.holders.get(msg.lease)) is not None:
            holder.abort_acked()

    def _credits_returned(self, _: None, msg: ctl.Credits) -> None:
        channel = msg.channel or 0
        if channel >= len(self.credits):
            raise ProtocolError(f"receiver {self.name} returned credits of data channel "
                                f"{channel}; this link has {len(self.credits)}")
        self._add_credits(msg.n, channel)

    def _receiver_said_goodbye(self, _: None, msg: ctl.Bye) -> None:
        raise PeerLost(f"receiver {self.name} is shutting down: {msg.reason}",
                       hint="the next request reconnects once it is back")

    def _receiver_reported(self, _: None, msg: Error) -> None:
        raise PeerLost(f"receiver {self.name} reported: {msg.error.get('message')}")

    def _answer(self, msg: Message) -> None:
        req = _req_of(msg)
        refused = msg if isinstance(msg, ctl.Refused) else None
        waiting = self._waiting.pop(req, None)
        if waiting is not None:
            future, undo = waiting
            if not future.done():
                if refused is not None:
                    future.set_exception(from_wire(refused.error))
                else:
                    future.set_result(msg)
                return
            # Its waiter was cancelled in this very loop turn and will never
            # take the answer.
        else:
            undo = self._abandoned.pop(req, None)
        if undo is not None and refused is None:
            self._undo(undo, msg)

    def _undo(self, undo: Undo, answer: Message) -> None:
        # Nobody waits for this answer any more: give back at once what it
        # holds. No write of ours can reach it.
        reply = undo(answer)
        if reply is not None:
            self.send(reply)

    async def request(self, msg: Message, answer: type[A],
                      undo: Callable[[A], Message | None] | None = None) -> A:
        """Send ``msg`` and wait for the receiver's answer to its ``req``, an
        ``answer`` (a ``refused`` raises its error).

        If the caller stops waiting (deadline, cancellation) the answer is
        still taken when it comes, and ``undo`` says what to send back so
        the receiver frees what it granted: no grant is ever orphaned.
        """
        if self.conn is None:
            raise PeerLost(f"receiver {self.name} went away")
        req = _req_of(msg)
        if req in self._waiting:
            raise DuplicateRequest(f"request {req} is already being opened")
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[req] = (future, undo)
        self.conn.send(msg)
        try:
            result = await future
        except asyncio.CancelledError:
            # Three ways to be cancelled: before the answer (it will be undone
            # when it comes), after ``_answer`` took an answer for a waiter
            # already cancelled (undone there), or with the answer in hand in
            # the turn of the cancellation (undone here).
            if undo is not None:
                if self._waiting.get(req, (None,))[0] is future:
                    self._abandoned[req] = undo
                elif future.done() and not future.cancelled() and future.exception() is None:
                    self._undo(undo, future.result())
            raise
        finally:
            if self._waiting.get(req, (None,))[0] is future:
                del self._waiting[req]
        if not isinstance(result, answer):
            raise ProtocolError(f"receiver {self.name} answered {req} with {result.kind!r}, "
                                f"expected {answer.kind!r}")
        return result

    async def open(self, req: str, shape: RequestShape, discard: bool = False,
                   note: dict[str, Any] | None = None) -> ctl.Lease:
        """Lease a slot for ``req``: the receiver's ``lease`` answer."""
        return await self.request(
            ctl.Open(req=req, shape=shape.to_wire(), discard=1 if discard else None,
                     note=note or None),
            ctl.Lease,
            undo=lambda lease: ctl.Abort(req=lease.req, lease=lease.lease,
                                         error=RequestAborted(
                                             f"the sender stopped waiting for request "
                                             f"{lease.req}").to_wire()))

    async def verdict(self, req: str, lease: int, within: float) -> ctl.Verdict | None:
        """How the receiver says lease ``lease`` of ``req`` ended (its ``verdict``),
        reconnecting as needed, within ``within`` seconds; None if it could not
        be asked (out of reach, or this link retired meanwhile)."""
        try:
            async with asyncio.timeout(within):
                while True:
                    try:
                        await self.ensure()
                        return await self.request(ctl.Ask(req=req, lease=lease),
                                                  ctl.Verdict)
                    except KvwireError as exc:
                        if not self.machine.usable:
                            raise  # retired: removed, or the sender is stopping
                        if isinstance(exc.__cause__, ConnectionRefusedError):
                            # No receiver process listens there: it died, and one
                            # started again keeps no verdicts. Nothing to wait for.
                            raise
                        log.debug("verdict not had yet", req=req, peer=self.name,
                                  error=str(exc))
                        # Reconnection backoff, as keep_connected's.
                        await asyncio.sleep(min(1.0, self.config.heartbeat))
        except (TimeoutError, KvwireError) as exc:
            log.warning("no verdict from the receiver", req=req, peer=self.name,
                        error=str(exc) or "timed out", waited=within)
            return None

    def withdraw(self, req: str, error: KvwireError) -> None:
        """Tell the receiver ``req`` will not come (refused here before its lease
        was asked for), so that a decode engine waiting for it fails now with
        ``error``. Best effort: a receiver out of reach has nobody to tell."""
        notice = ctl.Withdrawn(req=req, error=error.to_wire())
        if self.connected:
            self.send(notice)
            return

        async def when_connected() -> None:
            with contextlib.suppress(KvwireError, TimeoutError):
                await asyncio.wait_for(self.ensure(), self.config.connect_timeout)
                self.send(notice)
        self.tasks.spawn(when_connected(), f"withdraw-{req}")

    def credit_back(self) -> None:
        """An echo's answer: a credit of the first channel, which pings use."""
        self._add_credits(1, 0)

    def _add_credits(self, n: int, channel: int) -> None:
        # Credits of a channel being replaced are its old receives': the new
        # channel starts with receives of its own (``_replace``).
        if channel < len(self.credits) and channel not in self._replacements:
            self.credits[channel] += n
        self._credit_freed.set()

    async def take_credit(self, channel: int = 0) -> None:
        # One credit per immediate in flight on a channel: the receiver never
        # sees more immediates there than it has receives posted for.
        while not self.connected or self.credits[channel] <= 0:
            if not self.connected:
                raise PeerLost(f"receiver {self.name} went away")
            event = self._credit_freed
            await event.wait()
            if event is self._credit_freed:
                self._credit_freed = asyncio.Event()
        self.credits[channel] -= 1

    def attach(self, lease: int, holder: LeaseHolder, keys: list[int] | None = None) -> None:
        """``holder`` holds ``lease``; ``keys`` (one per channel, changed in place
        when a channel is replaced and the receiver grants new ones)."""
        self.holders[lease] = holder
        self._unheld.clear()
        if keys is not None:
            self._keys[lease] = keys

    def detach(self, lease: int) -> None:
        self.holders.pop(lease, None)
        self._keys.pop(lease, None)
        if not self.holders:
            self._unheld.set()

    async def unheld(self) -> None:
        """Wait until no lease is held on this link (a retiring link's last ends)."""
        await self._unheld.wait()

    def lost(self, error: KvwireError) -> None:
        """The connection broke: fail everything in flight on it and forget it."""
        if self.machine.can(LinkEvent.LOST):
            self._apply(LinkEvent.LOST, error)

    def _close_connection(self) -> None:
        conn, channels = self.conn, self.channels
        self.conn, self.channels, self.credits, self.rails = None, [], [], []
        replacements, self._replacements = self._replacements, {}
        for task in replacements.values():
            if task is not asyncio.current_task():
                task.cancel()
        self.ledger.fail_all(self._ending)
        if conn is not None:
            conn.close()
        for channel in channels:
            channel.close()
        if self._counted:
            self.metrics.peers.dec()
            self._counted = False

    def _fail_holders(self, error: KvwireError) -> None:
        for future, _ in self._waiting.values():
            if not future.done():
                future.set_exception(error)
        self._waiting.clear()
        # The receiver frees whatever a lost connection held.
        self._abandoned.clear()
        for holder in list(self.holders.values()):
            holder.fail(error)
        self._credit_freed.set()

    def send(self, msg: Message) -> None:
        if self.conn is not None:
            self.conn.send(msg)

    def retire(self, reason: str) -> None:
        """No new requests; those holding leases finish (``finish_retiring`` ends it)."""
        if self.machine.can(LinkEvent.RETIRE):
            self._bye_reason = reason
            self._apply(LinkEvent.RETIRE,
                        PeerLost(f"connection to receiver {self.name} closed: {reason}"))

    def finish_retiring(self) -> None:
        """The last lease on a retiring link ended: say bye and drop the connection."""
        if self.machine.can(LinkEvent.LAST_HOLDER_DONE):
            self._apply(LinkEvent.LAST_HOLDER_DONE)
            self.tasks.cancel()

    def say_goodbye(self, reason: str) -> None:
        """Tell the receiver this connection ends on purpose, then drop it now."""
        self.retire(reason)
        self.finish_retiring()
