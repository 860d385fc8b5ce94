"""``PeerLink``: the sender's link to one receiver, its parts wired.

A link holds its connection up between requests (so ``kvwire_peer_up`` says
whether a receiver is reachable before a request needs it). Its state is
its ``LinkMachine``'s (kvwired.lifecycle.link): up, down, retiring; every
change goes through ``_apply``, which carries out the machine's actions.

Each part has one job and is handed what it needs here, bottom to top:

- ``Credits`` (credits.py): immediates each data channel may still take;
- ``Requests`` (requests.py): requests matched to answers, with their undo;
- ``Holders`` (holders.py): who holds each lease, and its keys;
- ``dial.connect`` (dial.py): TCP, TLS, hello/welcome, the receiver's identity;
- ``DataChannels`` (channels.py): channels on rails, posts, stalls, replacement.

A link is lost in one place, ``lost``: the control connection ended, or
the data channels say so. Whatever holds a lease on it fails with that.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from ..config import SenderConfig
from ..control import ControlConnection
from ..errors import KvwireError, PeerLost, ProtocolError, RailFailed, RequestAborted, from_wire
from ..layout import RequestShape
from ..lifecycle.link import LinkAction, LinkEvent, LinkMachine, LinkState
from ..metrics import Metrics
from ..ports import LeaseHolder
from ..protocol import Error, Handlers, Message
from ..protocol import control as ctl
from ..tasks import TaskSet
from ..transport.base import DataChannel, Transport
from ..trust import Trust
from . import dial
from .channels import DataChannels
from .credits import Credits
from .holders import Holders
from .requests import Requests

log = structlog.get_logger("kvwired.sender")

A = TypeVar("A", bound=Message)

RECONNECT_MAX = 30.0  # seconds between reconnection attempts, at most


class PeerLink:
    """Control connection + data channels to one named receiver."""

    def __init__(self, name: str, address: str, config: SenderConfig, transport: Transport,
                 metrics: Metrics, trust: Trust | None = None) -> None:
        self.name, self.address = name, address
        self.trust = trust
        self.config, self.transport, self.metrics = config, transport, metrics
        self.conn: ControlConnection | None = None
        self.machine = LinkMachine(name)
        # Channel replacements and best-effort notices: they end with the link.
        self.tasks = TaskSet(f"link {name}")
        self.requests = Requests(name, self.send)
        self.holders = Holders(self.lost)
        self._credits = Credits()
        self.data = DataChannels(name, config, transport, metrics, self._credits,
                                 self.holders, self.tasks, self.lost, self.requests.ask,
                                 lambda: self.machine.state in (LinkState.UP,
                                                                LinkState.RETIRING))
        self._lock = asyncio.Lock()
        self._dispatch = self._handlers()
        self.ever_connected = False
        self._counted = False  # in kvwire_peers_connected
        self._ending: KvwireError = PeerLost(f"receiver {name} went away")
        self._bye_reason = "the link was retired"
        # Series that exist from the start, so rates and alerts see zeros.
        metrics.reconnects.labels(name)
        metrics.peer_seen(name)

    # What the daemon, experiments and tests read.
    @property
    def channels(self) -> list[DataChannel]:
        return self.data.channels

    @property
    def rails(self) -> list[str]:
        return self.data.rails

    @property
    def credits(self) -> list[int]:
        return self._credits.counts

    @property
    def channel(self) -> DataChannel | None:
        """The first data channel: the one experiments (echo pings, streams) use."""
        return self.data.first

    @property
    def connected(self) -> bool:
        """Up, with every data channel alive or being replaced."""
        return (self.machine.state in (LinkState.UP, LinkState.RETIRING)
                and self.conn is not None and not self.conn.closed and self.data.up)

    @property
    def retired(self) -> bool:
        """No new request may use it (removed from the peers, or stopping)."""
        return not self.machine.usable

    @property
    def local_host(self) -> str:
        """Our own address on the control connection (the data path follows it)."""
        if self.conn is None:
            raise PeerLost(f"receiver {self.name} went away")
        return self.conn.local_host

    # ------------------------------------------------------- the machine

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

    def lost(self, error: KvwireError) -> None:
        """The connection broke: fail everything in flight on it and forget it."""
        if self.machine.can(LinkEvent.LOST):
            self._apply(LinkEvent.LOST, error)

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

    def _start_reading(self) -> None:
        assert self.conn is not None
        self.conn.start_pinging()
        self.conn.serve(lambda msg: self._dispatch(None, msg), self._connection_ended,
                        f"link-{self.name}")
        self.metrics.peers.inc()
        self._counted = True

    def _close_connection(self) -> None:
        conn, self.conn = self.conn, None
        self.data.close(self._ending)
        if conn is not None:
            conn.close()
        if self._counted:
            self.metrics.peers.dec()
            self._counted = False

    def _fail_holders(self, error: KvwireError) -> None:
        # The receiver frees whatever a lost connection held.
        self.requests.fail_all(error)
        self.holders.fail_all(error)
        self._credits.wake()

    # -------------------------------------------------------- connecting

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
                    self.data.check_progress()
                self.data.take_rails_back(idle=not self.holders and not self.requests.pending)
            else:
                try:
                    await self.ensure()
                    continue
                except KvwireError as exc:
                    log.debug("receiver not reachable yet", peer=self.name, error=str(exc))
                    backoff = min(backoff * 2, RECONNECT_MAX)
            woke = loop.time() + (tick if self.connected else backoff)
            await asyncio.sleep(tick if self.connected else backoff)

    async def ensure(self) -> None:
        async with self._lock:
            if self.connected:
                return
            if not self.machine.usable:
                raise PeerLost(f"receiver {self.name} is no longer a peer of this sender",
                               hint="it was removed from [peers], or the sender is stopping")
            # Whatever still hangs on the old connection fails with what broke
            # it (a completion error, say), not with "being rebuilt".
            self.lost(self.data.failure or PeerLost(
                f"connection to receiver {self.name} is being rebuilt"))
            self.data.failure = None
            self._apply(LinkEvent.CONNECT)
            try:
                await self._connect()
            except BaseException:
                if self.machine.can(LinkEvent.CONNECT_FAILED):
                    self._apply(LinkEvent.CONNECT_FAILED)
                raise
            self._apply(LinkEvent.CONNECTED)

    async def _connect(self) -> None:
        """Connect on the rails not left out; a rail failing its probe is left
        out and the link built again on the others."""
        while True:
            usable = self.data.usable_rails()
            conn, welcome = await dial.connect(self.name, self.address, self.config,
                                               self.transport.name, self.trust)
            try:
                await self.data.open(conn, usable, welcome.credits)
            except RailFailed as exc:
                conn.close()
                if not self.data.rail_failed(exc, usable):
                    raise  # every rail was tried: none carries a channel now
                continue
            except BaseException:
                conn.close()
                raise
            break
        self.conn = conn
        if self.ever_connected:
            self.metrics.reconnects.labels(self.name).inc()
        self.ever_connected = True
        log.info("connected to receiver", peer=self.name, address=self.address,
                 transport=self.transport.name, channels=len(self.channels),
                 rails=sorted(set(self.rails) - {""}), credits=welcome.credits)

    def _connection_ended(self, conn: ControlConnection, error: KvwireError) -> None:
        if self.conn is conn:
            log.warning("receiver connection lost", peer=self.name, error=str(error))
            ending = error if isinstance(error, PeerLost) else PeerLost(
                f"receiver {self.name}: {error}")
            self.data.control_lost(ending)
            self.lost(ending)

    # ------------------------------------------------- what the receiver says

    def _handlers(self) -> Handlers[None]:
        """What a receiver may send on a live link, by type."""
        handlers = Handlers[None](f"receiver {self.name}")
        handlers.on(ctl.Credits, self._credits_returned)
        handlers.on(ctl.Delivered, lambda _, m: self.holders.delivered(m.lease, m.checksum))
        handlers.on(ctl.Abort, lambda _, m: self.holders.aborted(m.lease, from_wire(m.error)))
        handlers.on(ctl.AbortAck, lambda _, m: self.holders.abort_acked(m.lease))
        handlers.on(ctl.Bye, self._receiver_said_goodbye)
        handlers.on(Error, self._receiver_reported)
        for answer in ctl.ANSWERS:
            handlers.on(answer, lambda _, msg: self.requests.answered(msg))
        return handlers

    def _credits_returned(self, _: None, msg: ctl.Credits) -> None:
        channel = msg.channel or 0
        if channel >= len(self.credits):
            raise ProtocolError(f"receiver {self.name} returned credits of data channel "
                                f"{channel}; this link has {len(self.credits)}")
        self._credits.add(msg.n, channel)

    def _receiver_said_goodbye(self, _: None, msg: ctl.Bye) -> None:
        raise PeerLost(f"receiver {self.name} is shutting down: {msg.reason}",
                       hint="the next request reconnects once it is back")

    def _receiver_reported(self, _: None, msg: Error) -> None:
        raise PeerLost(f"receiver {self.name} reported: {msg.error.get('message')}")

    # ------------------------------------------------ what holders call

    def send(self, msg: Message) -> None:
        if self.conn is not None:
            self.conn.send(msg)

    async def request(self, msg: Message, answer: type[A],
                      undo: Callable[[A], Message | None] | None = None) -> A:
        """Send ``msg`` and wait for the receiver's answer to its ``req``, an
        ``answer`` (a ``refused`` raises its error). If the caller stops
        waiting, ``undo`` says what to send back when the answer comes, so
        the receiver frees what it granted (kvwired.sender.requests)."""
        if self.conn is None:
            raise PeerLost(f"receiver {self.name} went away")
        return await self.requests.ask(msg, answer, undo)

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
        self._credits.add(1, 0)

    async def take_credit(self, channel: int = 0) -> None:
        """One credit per immediate in flight on a channel: the receiver never
        sees more immediates there than it has receives posted for."""
        await self._credits.take(channel, lambda: self.connected,
                                 lambda: PeerLost(f"receiver {self.name} went away"))

    def attach(self, lease: int, holder: LeaseHolder, keys: list[int] | None = None) -> None:
        """``holder`` holds ``lease``; ``keys`` (one per channel, changed in place
        when a channel is replaced and the receiver grants new ones)."""
        self.holders.attach(lease, holder, keys)

    def detach(self, lease: int) -> None:
        self.holders.detach(lease)

    async def unheld(self) -> None:
        """Wait until no lease is held on this link (a retiring link's last ends)."""
        await self.holders.unheld()
