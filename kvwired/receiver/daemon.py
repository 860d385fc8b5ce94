"""The receiver daemon (decode node): its parts, wired.

It owns the receive pool, leases slots of it to senders' requests, learns
from immediates which layers have landed, tells subscribed decode engines,
and takes slots back when engines release them. A lease is live from the
``lease`` message until release or abort; an immediate naming a lease that
is not live is dropped, so an aborted request is never announced as data.

Each part has one job and is handed what it needs here:

- ``Senders`` (senders.py): sender sessions, from the gate to their end;
- ``DataChannels`` (channels.py): each session's responders, replaced in place;
- ``LeaseBook`` (leases.py): leases, their keys (keys.py) and outcomes;
- ``Landing`` (landing.py): immediates, layers announced, checksums;
- ``Engines`` (engines.py): decode engines, subscriptions, reclaim.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Iterator
from typing import Protocol

import structlog

from .. import gate, immediate
from ..addresses import control_address
from ..config import CommonConfig, ReceiverConfig
from ..daemon import Daemon
from ..discovery.membership import Member
from ..errors import ConfigError, PeerLost, from_wire
from ..gate import Gate
from ..lifecycle.lease import LeaseState
from ..metrics import LiveSample
from ..pool import Pool
from ..protocol import PROTOCOL_VERSION, RECEIVER_LOCAL, Error, Handlers, Message
from ..protocol import control as ctl
from ..protocol import receiver_local as local
from ..quota import SenderQuotas
from ..transport import Transport, TransportOptions, make_transport
from ..units import format_size
from .channels import DataChannels
from .engines import Consumer, Engines
from .landing import Landing, count_received
from .leases import Lease, LeaseBook
from .senders import Senders
from .session import SenderSession

log = structlog.get_logger("kvwired.receiver")

HOLDING_STATES = tuple(state for state in LeaseState if state is not LeaseState.FREED)


class ReceiverService(Protocol):
    """Control messages beyond the request path, handed in at wiring time.

    The experiments' echo leases and perftest servers are services: the
    receiver routes their message types and the immediates naming their
    lease ids to them, and tells them when a sender's session ends.
    """

    messages: tuple[type[Message], ...]

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
            receive_depth=config.credits, listen_host=control_address(config.listen)[0],
            data_port=config.data_port, listen_at_start=True, per_lease_keys=True,
            door=Gate("data", self.metrics.auth_failures, config.handshake_timeout)))
        self._sealed: tuple[Member, Member] | None = None  # (as described, as signed)
        self.control_port = 0
        self._control_server: gate.Listener | None = None
        self._gate = Gate("control", self.metrics.auth_failures, config.handshake_timeout)
        self.quotas = SenderQuotas(self._quota_limit(config))
        self.services = list(services)

        self.engines = Engines(config, self.metrics)
        self.book = LeaseBook(config, self.metrics, lambda: self.pool, self.quotas,
                              self.engines, lambda: not self.draining, self.work_ended)
        self.engines.attach(self.book)
        self.landing = Landing(self.book, self.engines, self.metrics, lambda: self.pool)
        self.channels = DataChannels(config, self.metrics, self.transport, self.book,
                                     self._on_immediate)
        self.senders = Senders(config, self.metrics, self.trust, self._gate,
                               self.transport.name, self.channels, self.book,
                               self._dispatch, [s.session_closed for s in self.services])
        handlers = self._handlers = Handlers[SenderSession]("a sender")
        # Work a message starts belongs to its session (cancelled when it ends).
        handlers.on(ctl.Open, lambda s, m: s.tasks.spawn(self.book.open(s, m),
                                                         f"open-{m.req}"))
        handlers.on(ctl.Connect, lambda s, m: s.tasks.spawn(self.channels.add_more(s, m),
                                                            "connect"))
        handlers.on(ctl.Replace, lambda s, m: s.tasks.spawn(self.channels.replace(s, m),
                                                            f"replace-{m.channel}"))
        handlers.on(ctl.Abort, self.book.sender_abort)
        handlers.on(ctl.AbortAck, self.book.sender_ack)
        handlers.on(ctl.Ask, lambda s, m: s.tasks.spawn(
            self.book.answer_ask(s, m.req, m.lease), f"ask-{m.req}"))
        handlers.on(ctl.Withdrawn,
                    lambda s, m: self.book.withdrawn(s, m.req, from_wire(m.error)))
        handlers.on(ctl.Bye, self._said_goodbye)
        handlers.on(Error, self._reported_error)
        for service in self.services:
            service.bind(self)
            for kind in service.messages:
                handlers.on(kind, service.handle)

    @property
    def pool(self) -> Pool:
        assert self._pool is not None, "receiver not started"
        return self._pool

    # What tests and services read: the parts' own state, by its old names.
    @property
    def leases(self) -> dict[int, Lease]:
        return self.book.leases

    @property
    def by_req(self) -> dict[str, Lease]:
        return self.book.by_req

    @property
    def sessions(self) -> set[SenderSession]:
        return self.senders.sessions

    def allocate_lease_id(self) -> int:
        return self.book.allocate_lease_id()

    def free_lease_id(self, lease_id: int) -> None:
        self.book.free_lease_id(lease_id)

    def update_pool_metrics(self) -> None:
        self.book.update_pool_metrics()

    # ----------------------------------------------------------- life cycle

    async def start(self) -> None:
        cfg = self.config
        self._pool = self.own(Pool(cfg.pool_size, "receive", full_hint=(
            "decode engines must release delivered requests; or raise pool_size")))
        await self.transport.start(self.pool.memory)
        host, port = control_address(cfg.listen)
        try:
            control = await gate.serve(host, port, self.senders.serve, self._gate,
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
            from ..discovery.presence import Announcement

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
            from ..discovery.seal import seal

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
        return self.book.arriving

    def status_line(self) -> str:
        filling = self.book.arriving
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
        self.senders.cut_off_unlisted()

    @staticmethod
    def _quota_limit(config: ReceiverConfig) -> int | None:
        """Bytes per sender; None when the quota is the whole pool (nothing to check)."""
        quota = config.quota_bytes()
        return quota if quota < config.pool_size else None

    async def say_goodbye(self) -> None:
        self.senders.say_goodbye("the receiver is shutting down")
        await self.transport.stop()
        await self.landing.close()

    # ------------------------------------------------------ what senders say

    def _dispatch(self, session: SenderSession, msg: Message) -> None:
        self._handlers(session, msg)

    @staticmethod
    def _said_goodbye(session: SenderSession, msg: ctl.Bye) -> None:
        raise PeerLost(f"sender {session.name} said goodbye: {msg.reason}")

    @staticmethod
    def _reported_error(session: SenderSession, msg: Error) -> None:
        raise PeerLost(f"sender {session.name} reported: {msg.error.get('message')}")

    def _on_immediate(self, session: SenderSession, channel: int, imm: int) -> None:
        count_received(session, self.metrics)
        lease_id, layer = immediate.unpack(imm)
        if lease_id not in self.leases and channel == 0:
            # Services (echo leases) use the first channel.
            for service in self.services:
                taken = service.on_immediate(session, lease_id, layer)
                if taken is not immediate.Taken.NOT_OURS:
                    if taken is immediate.Taken.TAKEN:
                        session.return_credits(1)
                    return
        self.landing.on_immediate(session, channel, lease_id, layer)

    # ----------------------------------------------------------- engines

    async def _serve_consumer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        consumer = Consumer(writer)
        welcome = local.Welcome(name=self.config.name, pool_size=self.pool.size)
        fd = self.pool.memory.readonly_fd()  # decode engines only read the pool
        try:
            await self.serve_engine(reader, writer, RECEIVER_LOCAL, welcome, fd,
                                    lambda msg: self.engines.handle(consumer, msg),
                                    "decode engine")
        finally:
            os.close(fd)
            self.engines.gone(consumer)
