"""The receiver daemon (decode node).

It owns the receive pool, leases slots of it to senders' requests, learns
from immediates which layers have landed, tells subscribed decode engines,
and takes slots back when engines release them. A lease is live from the
``lease`` message until release or abort; an immediate naming a lease that
is not live is dropped, so an aborted request is never announced as data.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from . import checksum, gate, immediate, stripes, verdicts
from .config import CommonConfig, ReceiverConfig, parse_address
from .control import MISSED_PINGS, ControlConnection
from .daemon import Daemon
from .discovery.membership import Member
from .errors import (
    AccessDenied,
    AuthenticationFailed,
    ConfigError,
    DuplicateRequest,
    KvwireError,
    PeerLost,
    ProtocolError,
    RequestAborted,
    RequestRefused,
    RequestTooLarge,
    TransportError,
    UsageError,
    from_wire,
)
from .gate import Gate
from .layout import RequestShape
from .lifecycle.lease import LeaseAction, LeaseEvent, LeaseMachine, LeaseState, Outcome
from .metrics import LiveSample
from .pool import Pool, Slot
from .protocol import PROTOCOL_VERSION, RECEIVER_LOCAL, Message, encode, message
from .quota import SenderQuotas
from .tasks import spawn
from .transport import Transport, TransportOptions, make_transport
from .transport.base import Responder
from .units import format_size
from .verdicts import MissedFailures, Verdict, VerdictBook

log = structlog.get_logger("kvwired.receiver")

HOLDING_STATES = tuple(state for state in LeaseState if state is not LeaseState.FREED)
MAX_PEER_LABELS = 32
HASH_THREADS = 2


class Consumer:
    """A decode engine on the unix socket."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.subscribed: set[str] = set()

    def send(self, msg: Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(msg))


@dataclass(eq=False)
class Lease:
    """One request's slot of the pool, from ``lease`` until it is freed.

    ``machine`` (kvwired.lifecycle.lease) decides every move; the daemon
    feeds it events and carries out the actions it returns.
    """

    id: int
    req: str
    shape: RequestShape
    slot: Slot
    session: SenderSession
    machine: LeaseMachine
    # Which layers have landed, from the immediates of each data channel
    # the lease was granted on (kvwired.stripes).
    fence: stripes.LandingFence
    # Each landed layer's digest, hashed as its immediate arrives (kvwired.checksum).
    digests: list[asyncio.Future[int]] = field(default_factory=list)
    checksum: int = 0
    opened_at: float = 0.0
    discard: bool = False  # an experiment's request: freed once delivered
    # The sender's remote keys for this slot alone, one per data channel.
    keys: list[int] = field(default_factory=list)
    key_state: str = "live"  # live, revoking (all landed, or freed), revoked
    after_revoke: list[Callable[[], None]] = field(default_factory=list)
    # Decode engines subscribed to it now, and whether any ever did.
    holders: set[Consumer] = field(default_factory=set)
    claimed: bool = False
    error: KvwireError | None = None  # why it was aborted, for subscribers
    # Senders asking how it ended (``ask``), woken once it is decided.
    deciding: list[asyncio.Future[None]] = field(default_factory=list)
    # Reclaims it if nobody subscribes within unclaimed_ttl (one at a time).
    unclaimed_timer: asyncio.TimerHandle | None = None

    @property
    def state(self) -> LeaseState:
        return self.machine.state

    @property
    def landed(self) -> int:
        """Layers landed on every channel, in order: the engines were told of these."""
        return self.fence.landed


@dataclass(eq=False)
class SenderSession:
    """One connected sender: its control connection and data-path responders,
    one per data channel (``qps_per_peer`` on the sender)."""

    conn: ControlConnection
    name: str = "?"
    label: str = "?"  # its name in metrics: bounded (see ReceiverDaemon._peer_label)
    responders: list[Responder] = field(default_factory=list)
    leases: set[int] = field(default_factory=set)
    # Credits to hand back, per channel: each channel's receives are its own.
    credits_to_return: dict[int, int] = field(default_factory=dict)
    alive: bool = True
    writes_counted: int = 0
    # Channels whose responder failed, each waiting (a timer, the stall bound)
    # for the sender to replace it before the whole session is dropped.
    broken: dict[int, asyncio.TimerHandle] = field(default_factory=dict)

    @property
    def responder(self) -> Responder | None:
        """The first channel's: the one services (echo leases) use."""
        return self.responders[0] if self.responders else None

    @property
    def writes_received(self) -> int:
        return sum(responder.writes_received for responder in self.responders)

    def return_credits(self, n: int, channel: int = 0) -> None:
        """Hand ``n`` credits of ``channel`` back: one ``credits`` message per
        channel per loop turn."""
        if n <= 0:
            return
        if not self.credits_to_return:
            asyncio.get_running_loop().call_soon(self._flush_credits)
        self.credits_to_return[channel] = self.credits_to_return.get(channel, 0) + n

    def _flush_credits(self) -> None:
        returning, self.credits_to_return = self.credits_to_return, {}
        if not self.alive:
            return
        for channel, n in returning.items():
            fields = {"channel": channel} if channel else {}
            self.conn.send(message("credits", n=n, **fields))


class ReceiverService(Protocol):
    """Control messages beyond the request path, handed in at wiring time.

    The experiments' echo leases and perftest servers are services: the
    receiver routes their message types and the immediates naming their
    lease ids to them, and tells them when a sender's session ends.
    """

    messages: frozenset[str]

    def bind(self, receiver: ReceiverDaemon) -> None: ...

    def handle(self, session: SenderSession, msg: Message) -> None: ...

    def on_immediate(self, session: SenderSession, lease_id: int,
                     layer: int) -> immediate.Taken:
        """Take an immediate naming one of this service's leases, or say it is not ours."""
        ...

    def session_closed(self, session: SenderSession) -> None: ...


class ReceiverDaemon(Daemon):
    role = "receiver"

    def __init__(self, config: ReceiverConfig,
                 services: Iterable[ReceiverService] = ()) -> None:
        super().__init__(config, config.socket)
        self.config: ReceiverConfig = config
        self._pool: Pool | None = None
        self.transport: Transport = make_transport(TransportOptions(
            name=config.transport, rdma_device=config.rdma_device,
            gid_index=config.gid_index, poll_spin_us=config.poll_spin_us,
            ack_timeout=config.ack_timeout,
            receive_depth=config.credits, listen_host=parse_address(config.listen, 7471)[0],
            data_port=config.data_port, listen_at_start=True, per_lease_keys=True,
            door=Gate("data", self.metrics.auth_failures, config.handshake_timeout)))
        self.leases: dict[int, Lease] = {}
        self.by_req: dict[str, Lease] = {}
        self.subscribers: dict[str, set[Consumer]] = {}
        self.sessions: set[SenderSession] = set()
        self._lease_ids: set[int] = set()  # the request path's and the services'
        # How leases ended, for senders that lost the answer (kvwired.verdicts).
        self.verdicts = VerdictBook()
        self.missed = MissedFailures()  # for decode engines that subscribe late
        # Read at scrape time, on the metrics thread: a copy of the sets' sizes.
        self.metrics.subscriptions.set_function(
            lambda: float(sum(map(len, list(self.subscribers.values())))))
        self._sealed: tuple[Member, Member] | None = None  # (as described, as signed)
        # Layers are hashed here as they land: XXH3 releases the GIL, so the
        # loop keeps receiving meanwhile. Two threads, so that a request
        # whose layers all land at once (one write) is hashed in half the time.
        self._hasher = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvwire-hash")
        self._next_lease = 1
        self.control_port = 0
        self._control_server: gate.Listener | None = None
        self._gate = Gate("control", self.metrics.auth_failures, config.handshake_timeout)
        self.quotas = SenderQuotas(self._quota_limit(config))
        self._labels: set[str] = set()  # uncertified sender names given a label
        self.services = list(services)
        self._routes: dict[str, ReceiverService] = {}
        for service in self.services:
            service.bind(self)
            for kind in service.messages:
                self._routes[kind] = service

    @property
    def pool(self) -> Pool:
        assert self._pool is not None, "receiver not started"
        return self._pool

    # ----------------------------------------------------------- life cycle

    async def start(self) -> None:
        cfg = self.config
        self._pool = Pool(cfg.pool_size, "receive", full_hint=(
            "decode engines must release delivered requests; or raise pool_size"))
        await self.transport.start(self.pool.memory)
        host, port = parse_address(cfg.listen, 7471)
        try:
            control = await gate.serve(host, port, self._serve_sender, self._gate,
                                       self.trust.server if self.trust is not None else None)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen for senders on {host}:{port}: {exc.strerror}",
                hint="pick a free port with --listen",
            ) from exc
        self._control_server = control
        self.add_server(control)
        self.control_port = control.port
        self.serve_metrics()
        await self.serve_local(self._serve_consumer)
        self.update_pool_metrics()
        if cfg.discovery:
            from .discovery.presence import Announcement

            self.join_registry(Announcement(cfg.discovery, self.describe))
        log.info(
            "receiver ready",
            name=cfg.name,
            control=f"{host}:{self.control_port}",
            **self.transport.describe(),
            socket=cfg.socket,
            pool_bytes=cfg.pool_size,
            metrics_port=self.metrics_port,
        )

    def describe(self) -> Member:
        """This receiver as the registry shows it to senders: sealed with its node
        key when TLS is on (kvwired.discovery.seal), re-signed only when it changes."""
        cfg = self.config
        member = Member(name=cfg.name, control=cfg.advertised_control(self.control_port),
                        transport=self.transport.name,
                        protocol=PROTOCOL_VERSION, pool_bytes=self.pool.size,
                        pool_free=self.pool.size - self.pool.used_bytes,
                        identity=self.trust.fingerprint if self.trust is not None else "",
                        certificate=self.trust.certificate_pem if self.trust is not None
                        else "")
        if self.trust is None:
            return member
        if self._sealed is None or self._sealed[0] != member:
            # ECDSA signatures differ at each signing: re-signing an unchanged
            # record would rewrite it in etcd at every refresh.
            from .discovery.seal import seal

            self._sealed = (member, seal(member, self.trust))
        return self._sealed[1]

    def live_metrics(self) -> Iterator[LiveSample]:
        posted: dict[str, int] = {}  # by label: "other" may stand for several
        for session in list(self.sessions):
            posted[session.label] = posted.get(session.label, 0) + sum(
                responder.receives_posted for responder in session.responders)
        for label, count in posted.items():
            yield ("kvwire_receives_posted", "receives posted for a sender's immediates "
                   "(verbs; 0 over tcp)", ["peer"], [label], float(count))
            yield ("kvwire_peer_up", "1 while the sender's connections are up", ["peer"],
                   [label], 1.0)
        # Every state that holds pool bytes, so used bytes always add up.
        counts: dict[LeaseState, int] = dict.fromkeys(HOLDING_STATES, 0)
        for lease in self.leases.values():
            counts[lease.state] += 1
        for state, count in counts.items():
            yield ("kvwire_leases", "requests holding pool slots, by lifecycle state "
                   "(filling, landed, held for decode, aborting)", ["state"],
                   [state.name.lower()], float(count))

    def in_flight(self) -> int:
        return self._arriving()

    def _arriving(self) -> int:
        """Requests leased whose bytes are still landing or being checked."""
        return sum(lease.machine.arriving for lease in self.leases.values())

    def status_line(self) -> str:
        filling = self._arriving()
        return (f"{'draining' if self.draining else 'ready'}: {len(self.sessions)} senders, "
                f"{filling} requests arriving, {len(self.leases) - filling} held for decode, "
                f"pool {format_size(self.pool.used_bytes)} of {format_size(self.pool.size)} used")

    def stop_accepting(self) -> None:
        # No new senders. Delivered requests stay readable until the process exits.
        if self._control_server is not None:
            self._control_server.close()
        self.leave_registry()

    def reload(self, fresh: CommonConfig) -> None:
        """SIGHUP: which senders are accepted, and their quota. Senders no longer
        listed are cut off now; their undelivered requests are aborted."""
        assert isinstance(fresh, ReceiverConfig)
        self.config.senders = list(fresh.senders)
        self.config.sender_quota = fresh.sender_quota
        self.quotas.limit = self._quota_limit(self.config)
        log.info("receiver config reloaded", senders=self.config.senders or "any",
                 sender_quota=self.config.sender_quota,
                 hint="other settings take effect on restart")
        for session in list(self.sessions):
            if self.config.senders and session.name not in self.config.senders:
                refusal = AccessDenied(
                    f"receiver {self.config.name} no longer accepts sender {session.name}")
                log.warning("sender no longer accepted: disconnected", sender=session.name)
                session.conn.fail(refusal)
                self._drop_session(session, PeerLost(refusal.message))

    async def say_goodbye(self) -> None:
        for session in list(self.sessions):
            if session.alive:
                session.conn.send(message("bye", reason="the receiver is shutting down"))
            self._drop_session(session, PeerLost("the receiver is shutting down"))
        await self.transport.stop()
        # No hash may still be reading the pool once it can be unmapped.
        await asyncio.to_thread(self._hasher.shutdown)

    # ------------------------------------------------------------- senders

    async def _serve_sender(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A sender's control connection, TLS done (``gate.serve``)."""
        conn = ControlConnection(reader, writer, self.config.heartbeat, "sender")
        address = conn.peer_address
        session = SenderSession(conn)
        try:
            # Nothing is leased, and no key disclosed, until this ends.
            async with asyncio.timeout(self._gate.timeout):
                await self._handshake(session, address)
        except TimeoutError:
            self._gate.refuse(address, "timeout",
                              f"no hello and connect within {self._gate.timeout:g} s")
            conn.close()
            return
        except PeerLost as exc:
            self._gate.refuse(address, "incomplete", exc.message)
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
            self._drop_session(session, exc if isinstance(exc, PeerLost) else
                               PeerLost(f"sender {session.name} dropped: {exc}"))

        self.metrics.peer_seen(session.label)
        self.sessions.add(session)
        self.metrics.peers.set(len(self.sessions))
        conn.start_pinging()
        await conn.run(lambda msg: self._dispatch(session, msg), ended)

    async def _handshake(self, session: SenderSession, address: str) -> None:
        conn = session.conn
        hello = await conn.recv(self._gate.timeout)
        if hello["t"] != "hello":
            raise ProtocolError(f"expected a sender's hello, got {hello['t']!r}")
        if hello["role"] != "sender":
            raise ProtocolError(
                f"a {hello['role']!r} connected to receiver {self.config.name}'s control "
                "port, which takes sender daemons only",
                hint="decode engines connect to the receiver's unix socket (ReceiverClient, "
                     "kvctl consume); prefill engines to their own sender daemon's")
        self._authorize(conn, hello["name"], address)
        session.name = hello["name"]
        session.label = self._peer_label(session.name)
        conn.label = f"sender {session.name}"
        if self.transport.name not in hello["transports"]:
            raise ProtocolError(
                f"sender {session.name} offers transports {hello['transports']}, "
                f"this receiver runs {self.transport.name}",
                hint="configure the same transport on both daemons",
            )
        conn.send(message("welcome", name=self.config.name, transport=self.transport.name,
                          credits=self.config.credits))
        connect = await conn.recv(self._gate.timeout)
        if connect["t"] != "connect":
            raise ProtocolError(f"expected connect, got {connect['t']!r}")
        await self._add_channel(session, connect)
        log.info("sender connected", sender=session.name, peer=conn.peer_address,
                 authenticated=self.trust is not None)

    async def _add_channel(self, session: SenderSession, connect: Message) -> None:
        """One more data channel for the session: the first in the handshake,
        the others (``qps_per_peer``) as ``connect`` messages after it.
        Leases are granted on the channels the session has at the time."""
        channel = len(session.responders)
        if channel >= stripes.MAX_CHANNELS:
            raise ProtocolError(
                f"sender {session.name} asked for data channel {channel + 1}; at most "
                f"{stripes.MAX_CHANNELS} are served",
                hint=f"set qps_per_peer to at most {stripes.MAX_CHANNELS}")
        responder = self._responder(session, channel)
        session.responders.append(responder)
        session.conn.send(message("ready", params=await responder.accept(connect["params"])))

    def _responder(self, session: SenderSession, channel: int) -> Responder:
        """A responder reporting as data channel ``channel`` of ``session``."""
        responder: Responder | None = None

        def failed(exc: Exception) -> None:
            assert responder is not None
            self._on_data_error(session, channel, responder, exc)
        responder = self.transport.responder(
            session.conn.local_host, lambda imm: self._on_immediate(session, channel, imm),
            failed)
        return responder

    async def _replace_channel(self, session: SenderSession, msg: Message) -> None:
        """The sender replaces data channel ``channel`` (its end failed while the
        control connection lives: kvwired.sender.ledger): a new responder takes
        its place, the old one is closed (no write under its keys can land any
        more), and every lease that still takes writes gets a key on the new
        one. A lease being revoked meanwhile gets none: its new key, never
        disclosed, is revoked at once."""
        channel = msg["channel"]
        req = msg["req"]
        if channel >= len(session.responders):
            error = ProtocolError(f"sender {session.name} replaced data channel {channel}; "
                                  f"its session has {len(session.responders)}")
            session.conn.send(message("refused", req=req, error=error.to_wire()))
            return
        began = asyncio.get_running_loop().time()
        responder = self._responder(session, channel)
        try:
            params = await responder.accept(msg["params"])
        except KvwireError as exc:
            log.warning("data channel not replaced", sender=session.name, channel=channel,
                        error=str(exc))
            if session.alive:
                session.conn.send(message("refused", req=req, error=exc.to_wire()))
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
        live = [self.leases[i] for i in sorted(session.leases)
                if self.leases[i].key_state == "live"]
        keys: list[list[int]] = []
        for lease in live:
            try:
                key = await responder.grant(lease.slot.offset, lease.shape.total_bytes)
            except KvwireError:
                continue  # the new responder failed too: the sender hears so from it
            if (lease.key_state == "live" and self.leases.get(lease.id) is lease
                    and session.responders[channel] is responder):
                lease.keys[channel] = key
                keys.append([lease.id, key])
            else:
                responder.revoke(key, lambda: None)
        log.info("data channel replaced", sender=session.name, channel=channel,
                 leases=len(keys),
                 seconds=round(asyncio.get_running_loop().time() - began, 3))
        if session.alive:
            session.conn.send(message("replaced", req=req, params=params, keys=keys))

    async def _connect_more(self, session: SenderSession, msg: Message) -> None:
        try:
            await self._add_channel(session, msg)
        except KvwireError as exc:
            if isinstance(exc, ProtocolError):
                self.metrics.protocol_errors.labels("control").inc()
            log.warning("data channel refused", sender=session.name, error=str(exc))
            session.conn.fail(exc)

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

    def _authorize(self, conn: ControlConnection, name: str, address: str) -> None:
        """The hello's name must be the certificate's, and one this receiver accepts."""
        if self.trust is not None:
            certified = conn.certified_name
            if certified != name:
                self._gate.refuse(address, "wrong_name",
                                  f"certificate of {certified!r}, hello says {name!r}")
                raise AuthenticationFailed(
                    f"this connection's certificate is for {certified!r}, but its hello "
                    f"says {name!r}", hint="a sender's `name` must be the name it was "
                    "issued credentials for (kvctl keys show)")
        if self.config.senders and name not in self.config.senders:
            self._gate.refuse(address, "not_allowed", f"sender {name!r} is not in `senders`")
            raise AccessDenied(f"receiver {self.config.name} does not accept sender {name!r}")

    def _dispatch(self, session: SenderSession, msg: Message) -> None:
        kind = msg["t"]
        if kind == "open":
            spawn(self._open(session, msg), f"open-{msg['req']}")
        elif kind == "connect":
            spawn(self._connect_more(session, msg), "connect")
        elif kind == "replace":
            spawn(self._replace_channel(session, msg), f"replace-{msg['channel']}")
        elif kind in ("abort", "abort_ack"):
            # A lease this sender no longer holds is one we already freed: the
            # message crossed ours. Anything else out of turn breaks the protocol.
            lease = self.leases.get(msg["lease"])
            if lease is None or lease.session is not session:
                if kind == "abort" and session.alive:
                    # Long gone (delivered and released, or freed with a lost
                    # connection): whatever we said about it went out first.
                    session.conn.send(message("abort_ack", req=msg["req"], lease=msg["lease"]))
                return
            if kind == "abort":
                log.info("sender aborted request", req=lease.req, state=lease.state.name,
                         reason=msg["error"].get("message"))
                lease.error = lease.error or RequestAborted(
                    f"the sender aborted request {lease.req}: {msg['error'].get('message')}",
                    hint="the prefill side gave up on it (deadline, abort, or it left)")
                self._lease_event(lease, LeaseEvent.SENDER_ABORT)
            else:
                self._lease_event(lease, LeaseEvent.SENDER_ACK)
        elif kind == "ask":
            spawn(self._answer_ask(session, msg["req"], msg["lease"]), f"ask-{msg['req']}")
        elif kind == "withdrawn":
            self._withdrawn(session, msg["req"], from_wire(msg["error"]))
        elif kind in self._routes:
            self._routes[kind].handle(session, msg)
        elif kind == "bye":
            raise PeerLost(f"sender {session.name} said goodbye: {msg['reason']}")
        elif kind == "error":
            raise PeerLost(f"sender {session.name} reported: {msg['error'].get('message')}")
        else:
            raise ProtocolError(f"a sender may not send {kind!r}")

    async def _open(self, session: SenderSession, msg: Message) -> None:
        req = msg["req"]
        try:
            if self.draining:
                raise RequestRefused(
                    f"the receiver is shutting down; request {req} was not accepted",
                    hint="send it to another receiver, or once this one is back")
            shape = RequestShape.from_wire(msg["shape"])
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
            session.conn.send(message("refused", req=req, error=error.to_wire()))
            if not isinstance(error, DuplicateRequest):  # theirs is the request we hold
                self._tell_refused(req, error)
            return
        try:
            keys = await self._grant_keys(session, slot.offset, shape.total_bytes)
        except KvwireError as exc:
            self._give_back(session.name, slot, shape.total_bytes)
            if session.alive:
                session.conn.send(message("refused", req=req, error=exc.to_wire()))
            self._tell_refused(req, exc)
            return
        if not session.alive or req in self.by_req:
            self._revoke_keys(session.responders, keys, lambda: self._give_back(
                session.name, slot, shape.total_bytes))
            if session.alive:
                session.conn.send(message("refused", req=req, error=DuplicateRequest(
                    f"request {req} is already held by this receiver").to_wire()))
            return
        lease = Lease(self.allocate_lease_id(), req, shape, slot, session, LeaseMachine(req),
                      stripes.LandingFence(len(keys), shape.layers),
                      opened_at=asyncio.get_running_loop().time(),
                      discard=bool(msg.get("discard")), keys=keys)
        # Engines that subscribed before it was opened hold it already.
        lease.holders = set(self.subscribers.get(req, ()))
        lease.claimed = bool(lease.holders)
        self.leases[lease.id] = lease
        self.by_req[req] = lease
        self.missed.forget(req)
        session.leases.add(lease.id)
        self.update_pool_metrics()
        session.conn.send(message("lease", req=req, lease=lease.id, offset=slot.offset,
                                  keys=keys))

    async def _grant_keys(self, session: SenderSession, offset: int, length: int
                          ) -> list[int]:
        """A key per data channel for ``length`` bytes at ``offset``, all from the
        session's current responders: a channel replaced while they were being
        granted leaves a dead key, so they are granted again (a few times)."""
        for _ in range(3):
            responders = list(session.responders)
            assert responders, "a session has its first responder from the handshake"
            keys: list[int] = []
            try:
                for responder in responders:
                    keys.append(await responder.grant(offset, length))
            except KvwireError:
                self._revoke_keys(responders, keys, lambda: None)
                if self._current(session, responders):
                    raise
                continue  # granted on a responder replaced meanwhile
            if self._current(session, responders):
                return keys
            self._revoke_keys(responders, keys, lambda: None)  # never disclosed
        raise TransportError(f"the data channels of sender {session.name} kept being "
                             "replaced while a lease was granted")

    @staticmethod
    def _current(session: SenderSession, responders: list[Responder]) -> bool:
        """Whether ``responders`` are still the session's, none replaced since."""
        return all(a is b for a, b in zip(responders, session.responders, strict=True))

    @staticmethod
    def _quota_limit(config: ReceiverConfig) -> int | None:
        """Bytes per sender; None when the quota is the whole pool (nothing to check)."""
        quota = config.quota_bytes()
        return quota if quota < config.pool_size else None

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

    # ---------------------------------------------------------- data path

    def _on_immediate(self, session: SenderSession, channel: int, imm: int) -> None:
        self._count_received(session)
        lease_id, layer = immediate.unpack(imm)
        lease = self.leases.get(lease_id)
        if lease is None and channel == 0:  # services (echo leases) use the first channel
            for service in self.services:
                taken = service.on_immediate(session, lease_id, layer)
                if taken is not immediate.Taken.NOT_OURS:
                    if taken is immediate.Taken.TAKEN:
                        session.return_credits(1)
                    return
        session.return_credits(1, channel)
        if (lease is None or lease.session is not session
                or lease.state is not LeaseState.FILLING
                or (landed := lease.fence.report(channel, layer)) is None):
            self.metrics.stale_immediates.inc()
            log.debug("stale immediate dropped", lease=lease_id, layer=layer, channel=channel)
            return
        if not landed:
            return  # other channels still place their part of the layer
        memory = self.pool.memory.view
        loop = asyncio.get_running_loop()
        for n in landed:
            self._notify(lease.req, self._layer_message(lease, n))
            # Hashed now, beside the loop, while later layers are still on
            # the wire: only the last one is left for the end (kvwired.checksum).
            offset, length = lease.shape.layer_span(n)
            start = lease.slot.offset + offset
            view = memory[start : start + length]
            if n < lease.shape.layers - 1:
                lease.digests.append(loop.run_in_executor(self._hasher, checksum.of_layer, view))
            else:
                # The last layer: hashed here, at once, rather than after a
                # hop to a worker and back (1 ms of the 1.3 ms measured).
                last: asyncio.Future[int] = loop.create_future()
                last.set_result(checksum.of_layer(view))
                lease.digests.append(last)
        self.metrics.bytes.labels(session.label, "received").inc(
            len(landed) * lease.shape.layer_bytes)
        if lease.landed == lease.shape.layers:
            self._lease_event(lease, LeaseEvent.ALL_LANDED)
            spawn(self._complete(lease), f"complete-{lease.req}")

    def _count_received(self, session: SenderSession) -> None:
        # Writes as the transport saw them, once per immediate rather than per
        # write: every write over TCP, only the immediates over verbs (the rest
        # never involve the receiver's CPU).
        if not session.responders:
            return
        writes = session.writes_received - session.writes_counted
        session.writes_counted += writes
        self.metrics.writes.labels(session.label, "received", "write_imm").inc()
        if writes > 1:
            self.metrics.writes.labels(session.label, "received", "write").inc(writes - 1)


    async def _complete(self, lease: Lease) -> None:
        digests = await asyncio.gather(*lease.digests)
        if self.leases.get(lease.id) is not lease or lease.state is not LeaseState.LANDED:
            return  # aborted while its last layers were being hashed
        lease.checksum = checksum.combine(digests)
        elapsed = asyncio.get_running_loop().time() - lease.opened_at
        self.metrics.requests.labels(lease.session.label, "delivered").inc()
        self.metrics.request_seconds.labels(lease.session.label).observe(elapsed)
        # Nobody consumes an experiment's request: it is freed at once.
        self._lease_event(lease, LeaseEvent.CHECKED_DISCARD if lease.discard
                          else LeaseEvent.CHECKED)
        log.info("request delivered", req=lease.req, sender=lease.session.name,
                 bytes=lease.shape.total_bytes, seconds=round(elapsed, 6))
        if lease.machine.state is not LeaseState.HELD:
            return  # discarded at once
        if lease.claimed and not lease.holders:
            # Every engine that asked for it left while it was arriving.
            self._reclaim(lease, "engine_gone", "its decode engines left before it was "
                          "delivered")
        elif not lease.claimed:
            self._reclaim_unclaimed_after(lease, self.config.unclaimed_ttl)

    @staticmethod
    def _layer_message(lease: Lease, n: int) -> Message:
        return message("layer", req=lease.req, layer=n, offset=lease.slot.offset,
                       length=lease.shape.total_bytes)

    @staticmethod
    def _complete_message(lease: Lease) -> Message:
        return message("complete", req=lease.req, offset=lease.slot.offset,
                       length=lease.shape.total_bytes, layers=lease.shape.layers,
                       checksum=lease.checksum)

    def _on_data_error(self, session: SenderSession, channel: int, responder: Responder,
                       exc: Exception) -> None:
        """A responder failed. A write under a wrong key ends the session; any
        other failure is the wire's, which the sender rides out by replacing
        the channel (``replace``): the session waits for that for the stall
        bound, the time a silent peer gets, then is dropped."""
        if not session.alive or channel >= len(session.responders) \
                or session.responders[channel] is not responder:
            return  # replaced already, or the session is gone
        status = getattr(exc, "status", "transport_error")
        log.warning("data path failed", sender=session.name, channel=channel, error=str(exc))
        self.metrics.completion_errors.labels(session.label, status).inc()
        if status == "remote_access" or channel in session.broken:
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

    # --------------------------------------------------- lease bookkeeping

    def _lease_event(self, lease: Lease, event: LeaseEvent) -> None:
        """Move ``lease``'s machine and carry out what it says."""
        before = lease.state
        undecided = lease.machine.outcome is Outcome.PENDING
        for action in lease.machine.apply(event):
            self._carry_out(lease, action)
        if undecided and lease.machine.outcome is not Outcome.PENDING:
            self._decided(lease)
        if lease.state is LeaseState.FREED and before is not LeaseState.FREED:
            outcome = lease.machine.outcome
            if outcome is Outcome.ABORTED and before is not LeaseState.ABORTING:
                self.metrics.requests.labels(lease.session.label, "failed").inc()

    def _decided(self, lease: Lease) -> None:
        """The lease's outcome is committed: kept for a sender that asks later."""
        delivered = lease.machine.outcome is Outcome.DELIVERED
        error = None if delivered else (
            lease.error or RequestAborted(f"request {lease.req} was aborted"))
        now = asyncio.get_running_loop().time()
        self.verdicts.record((lease.session.name, lease.req),
                             Verdict(lease.id, delivered, lease.checksum, error), now)
        if error is not None:
            self.missed.record(lease.req, error, now)
        waiting, lease.deciding = lease.deciding, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    async def _answer_ask(self, session: SenderSession, req: str, lease_id: int) -> None:
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

    def _withdrawn(self, session: SenderSession, req: str, error: KvwireError) -> None:
        """A request the sender gave up before leasing it: its engines hear why."""
        if req in self.by_req:
            return  # a request of that id is held here: not the one withdrawn
        log.info("sender withdrew a request before leasing it", req=req,
                 sender=session.name, reason=error.message)
        self._tell_refused(req, error)

    def _carry_out(self, lease: Lease, action: LeaseAction) -> None:
        session = lease.session
        error = lease.error or RequestAborted(f"request {lease.req} was aborted")
        if action is LeaseAction.SEND_DELIVERED:
            if session.alive:
                session.conn.send(message("delivered", req=lease.req, lease=lease.id,
                                          checksum=lease.checksum))
        elif action is LeaseAction.SEND_ABORT:
            self.metrics.requests.labels(session.label, "aborted").inc()
            if session.alive:
                session.conn.send(message("abort", req=lease.req, lease=lease.id,
                                          error=error.to_wire()))
        elif action is LeaseAction.SEND_ABORT_ACK:
            if session.alive:
                session.conn.send(message("abort_ack", req=lease.req, lease=lease.id))
        elif action is LeaseAction.NOTIFY_COMPLETE:
            self._notify(lease.req, self._complete_message(lease))
        elif action is LeaseAction.NOTIFY_FAILED:
            self._fail_subscribers(lease.req, error)
        elif action is LeaseAction.REVOKE_KEY:
            self._revoke_key(lease)
        elif action is LeaseAction.FREE:
            if lease.unclaimed_timer is not None:
                lease.unclaimed_timer.cancel()
            del self.leases[lease.id]
            self.free_lease_id(lease.id)
            if self.by_req.get(lease.req) is lease:
                del self.by_req[lease.req]
            session.leases.discard(lease.id)
            # The slot goes back once no write under its key can land in it.
            self._revoke_key(lease, lambda: self._give_back(
                session.name, lease.slot, lease.shape.total_bytes))

    def _revoke_key(self, lease: Lease, then: Callable[[], None] | None = None) -> None:
        """End the lease's key (once); ``then`` runs when no write under it can land."""
        if then is not None:
            lease.after_revoke.append(then)
        if lease.key_state == "revoked":
            self._run_after_revoke(lease)
        elif lease.key_state == "live":
            lease.key_state = "revoking"

            def revoked() -> None:
                lease.key_state = "revoked"
                self._run_after_revoke(lease)
            self._revoke_keys(lease.session.responders, lease.keys, revoked)
        # "revoking": ``then`` runs with the others when the revocation ends.

    @staticmethod
    def _revoke_keys(responders: list[Responder], keys: list[int],
                     then: Callable[[], None]) -> None:
        """End each channel's key; ``then`` runs once no write under any can land."""
        left = len(keys)
        if not left:
            then()
            return

        def one_revoked() -> None:
            nonlocal left
            left -= 1
            if left == 0:
                then()
        for responder, key in zip(responders, keys, strict=False):
            responder.revoke(key, one_revoked)

    @staticmethod
    def _run_after_revoke(lease: Lease) -> None:
        callbacks, lease.after_revoke = lease.after_revoke, []
        for callback in callbacks:
            callback()

    def _give_back(self, sender: str, slot: Slot, length: int) -> None:
        self.pool.release(slot)
        self.quotas.give_back(sender, length)
        self.update_pool_metrics()

    def _drop_session(self, session: SenderSession, error: KvwireError) -> None:
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
        for service in self.services:
            service.session_closed(session)
        # The connection is gone, so no write of it can land any more: what
        # was not delivered is aborted; what was stays for its decode engine.
        for lease_id in list(session.leases):
            lease = self.leases[lease_id]
            lease.error = lease.error or error
            self._lease_event(lease, LeaseEvent.SESSION_LOST)

    def _reclaim_unclaimed_after(self, lease: Lease, ttl: float) -> None:
        """From now, ``ttl`` for an engine to subscribe; an earlier timer is void
        (an engine subscribed and let go since)."""
        if lease.unclaimed_timer is not None:
            lease.unclaimed_timer.cancel()

        def reclaim() -> None:
            if lease.state is LeaseState.HELD and not lease.claimed:
                self._reclaim(lease, "unclaimed", f"no decode engine subscribed to it "
                              f"within unclaimed_ttl ({ttl:g} s)")
        lease.unclaimed_timer = asyncio.get_running_loop().call_later(ttl, reclaim)

    def _reclaim(self, lease: Lease, reason: str, why: str) -> None:
        """Free a delivered request nobody will release (logged and counted once)."""
        log.warning("delivered request reclaimed", req=lease.req, sender=lease.session.name,
                    reason=reason, why=why)
        self.metrics.reclaimed.labels(reason).inc()
        self._lease_event(lease, LeaseEvent.RECLAIM)
        # An engine that asks for it later learns it is gone, and why.
        self.missed.record(lease.req, RequestAborted(
            f"request {lease.req} was delivered, then reclaimed: {why}",
            hint="a decode engine must subscribe within unclaimed_ttl and release what "
                 "it subscribed to"), asyncio.get_running_loop().time())

    def update_pool_metrics(self) -> None:
        self.metrics.set_pool("receive", self.pool.size, self.pool.used_bytes)

    # ----------------------------------------------------------- consumers

    def _notify(self, req: str, msg: Message) -> None:
        for consumer in self.subscribers.get(req, ()):
            consumer.send(msg)

    def _tell_refused(self, req: str, error: KvwireError) -> None:
        """A decode engine waiting for a request this receiver refused learns it
        now, with the sender's reason: the same outcome at both ends, and no
        engine left waiting for a request that will not come."""
        self._fail_subscribers(req, error)
        self.missed.record(req, error, asyncio.get_running_loop().time())

    def _fail_subscribers(self, req: str, error: KvwireError) -> None:
        """``failed`` is a subscription's last word: an engine that wants the id
        again (a request pushed anew) subscribes anew."""
        self._notify(req, message("failed", req=req, error=error.to_wire()))
        for consumer in self.subscribers.pop(req, ()):
            consumer.subscribed.discard(req)

    async def _serve_consumer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        consumer = Consumer(writer)

        def dispatch(msg: Message) -> None:
            if msg["t"] == "subscribe":
                self._subscribe(consumer, msg["req"])
            elif msg["t"] == "release":
                self._release(consumer, msg["req"])
            elif msg["t"] == "unsubscribe":
                self._unsubscribe(consumer, msg["req"])
            else:
                raise ProtocolError(f"a decode engine may not send {msg['t']!r}")

        welcome = message("welcome", name=self.config.name, pool_size=self.pool.size)
        fd = self.pool.memory.readonly_fd()  # decode engines only read the pool
        try:
            await self.serve_engine(reader, writer, RECEIVER_LOCAL, welcome, fd, dispatch,
                                    "decode engine")
        finally:
            os.close(fd)
            self._consumer_gone(consumer)

    def _forget_subscriber(self, consumer: Consumer, req: str) -> None:
        subs = self.subscribers.get(req)
        if subs is not None:
            subs.discard(consumer)
            if not subs:
                del self.subscribers[req]

    def _consumer_gone(self, consumer: Consumer) -> None:
        """A decode engine left (or died): what only it held goes back to the pool."""
        for req in consumer.subscribed:
            self._forget_subscriber(consumer, req)
            lease = self.by_req.get(req)
            if lease is None:
                continue
            lease.holders.discard(consumer)
            if lease.state is LeaseState.HELD and not lease.holders:
                self._reclaim(lease, "engine_gone", "its decode engine left without "
                              "releasing it")

    def _subscribe(self, consumer: Consumer, req: str) -> None:
        lease = self.by_req.get(req)
        missed = self.missed.lookup(req, asyncio.get_running_loop().time())
        if lease is None and missed is not None:
            # It ended, undelivered, before this engine asked: say so now.
            consumer.send(message("failed", req=req, error=missed.to_wire()))
            return
        consumer.subscribed.add(req)
        self.subscribers.setdefault(req, set()).add(consumer)
        if lease is None:
            return  # not opened yet: events follow when it is
        lease.holders.add(consumer)
        lease.claimed = True
        for n in range(lease.landed):
            consumer.send(self._layer_message(lease, n))
        if lease.state is LeaseState.HELD:
            consumer.send(self._complete_message(lease))

    def _unsubscribe(self, consumer: Consumer, req: str) -> None:
        """The engine lets go without releasing: a delivered request is kept for
        another engine, and reclaimed if none subscribes within unclaimed_ttl."""
        consumer.subscribed.discard(req)
        self._forget_subscriber(consumer, req)
        lease = self.by_req.get(req)
        if lease is not None and consumer in lease.holders:
            lease.holders.discard(consumer)
            if not lease.holders:
                lease.claimed = False
                if lease.state is LeaseState.HELD:
                    self._reclaim_unclaimed_after(lease, self.config.unclaimed_ttl)
        consumer.send(message("unsubscribed", req=req))

    def _release(self, consumer: Consumer, req: str) -> None:
        lease = self.by_req.get(req)
        if lease is None:
            consumer.send(message("failed", req=req, error=UsageError(
                f"request {req} is not held by this receiver",
                hint="release only requests you subscribed to and saw complete").to_wire()))
            return
        # The releasing engine is told "released", not that its request failed.
        self.subscribers.get(req, set()).discard(consumer)
        consumer.subscribed.discard(req)
        if lease.machine.arriving:
            lease.error = RequestAborted(
                f"the decode engine released request {req} before it was delivered",
                hint="release a request once it is delivered, or let the sender finish it")
        self._lease_event(lease, LeaseEvent.ENGINE_RELEASE)
        self.subscribers.pop(req, None)
        consumer.send(message("released", req=req))
