"""The sender daemon (prefill node): wiring, life cycle, metrics.

Prefill engines open pushes on the unix socket, write layers into the
shared staging pool and commit them; the push driver posts each layer's
chunks as one-sided writes into the slot the receiver leased. One
``PeerLink`` holds the control connection and data channel to one receiver.

Experiments are handed in at wiring time (``kvwired.cli``) as named
coroutines; the daemon offers them its public surface (``push``,
``link``, staging and transport) and knows nothing else of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import structlog

from ..config import SenderConfig
from ..daemon import Daemon
from ..discovery.membership import Changes, merged_peers
from ..discovery.presence import Subscription
from ..errors import (
    KvwireError,
    ProtocolError,
    RequestRefused,
    UnknownPeer,
    UsageError,
    internal_error,
)
from ..layout import RequestShape
from ..metrics import LiveSample
from ..pool import Pool, Slot
from ..protocol import AUTO_PEER, PROTOCOL_VERSION, SENDER_LOCAL, Failed, Message, encode
from ..protocol import control as ctl
from ..protocol import sender_local as local
from ..rdma import gid_table, rail_gid
from ..transport import Transport, TransportOptions, make_transport
from ..units import format_size
from .engines import EngineSession
from .link import PeerLink
from .push import Push, PushDriver, Timings

log = structlog.get_logger("kvwired.sender")

Report = Callable[[Message], None]
# An experiment the daemon runs for ``kvctl run``: (daemon, request id,
# parameters, report) -> result. It reports progress and rows as it goes.
Experiment = Callable[["SenderDaemon", str, dict[str, Any], Report],
                      Awaitable[dict[str, Any]]]

# A sender responds only to the echo channel of an experiment (kvctl run),
# which has one ping in flight at a time.
SENDER_RECEIVE_DEPTH = 16


class SenderDaemon(Daemon):
    role = "sender"

    def __init__(self, config: SenderConfig,
                 experiments: Mapping[str, Experiment] | None = None) -> None:
        super().__init__(config, config.socket)
        self.config: SenderConfig = config
        self.experiments = dict(experiments or {})
        self.transport: Transport = make_transport(TransportOptions(
            name=config.transport, rdma_device=config.rdma_device,
            gid_index=config.gid_index, poll_spin_us=config.poll_spin_us,
            ack_timeout=config.ack_timeout,
            receive_depth=SENDER_RECEIVE_DEPTH))
        self.links = {name: self._new_link(name, addr) for name, addr in config.peers.items()}
        # [peers] as configured; with discovery, config.peers is these and the registry's.
        self.static_peers = dict(config.peers)
        self._peers_changed = asyncio.Event()  # set each time the peer list changes
        self.subscription: Subscription | None = None
        self._staging: Pool | None = None
        self._driver: PushDriver | None = None

    def _new_link(self, name: str, address: str) -> PeerLink:
        return PeerLink(name, address, self.config, self.transport, self.metrics, self.trust)

    @property
    def staging(self) -> Pool:
        assert self._staging is not None, "sender not started"
        return self._staging

    @property
    def driver(self) -> PushDriver:
        assert self._driver is not None, "sender not started"
        return self._driver

    @property
    def pushes(self) -> dict[str, Push]:
        return self.driver.pushes

    # ----------------------------------------------------------- life cycle

    async def start(self) -> None:
        cfg = self.config
        self._staging = self.own(Pool(cfg.staging_size, "staging", "staging_size", full_hint=(
            "each push holds staging memory until delivered; raise staging_size")))
        self._driver = PushDriver(cfg, self._staging, self.metrics, self.work_ended)
        await self.transport.start(self._staging.memory)
        if self.transport.name == "verbs" and (rails := cfg.rail_devices()):
            table = gid_table()  # one sysfs scan for all of them (seconds on a lab node)
            for rail in rails:
                rail_gid(rail, table=table)  # a rail without RoCE v2 stops the daemon now
        self.serve_metrics()
        await self.serve_local(self._serve_engine)
        for link in self.links.values():
            self.tasks.spawn(link.keep_connected(), f"link-{link.name}")
        self.driver.update_pool_metrics()
        if cfg.discovery:
            from ..discovery.seal import checker

            self.subscription = Subscription(
                cfg.discovery, PROTOCOL_VERSION, self._membership_changed,
                checker(self.trust) if self.trust is not None else None)
            self.join_registry(self.subscription)
        log.info("sender ready", name=cfg.name, socket=cfg.socket, **self.transport.describe(),
                 staging_bytes=cfg.staging_size, peers=dict(cfg.peers),
                 chunk_bytes=cfg.chunk_bytes, metrics_port=self.metrics_port)

    def live_metrics(self) -> Iterator[LiveSample]:
        for name, link in list(self.links.items()):
            yield ("kvwire_peer_up", "1 while the control and data connections to the "
                   "receiver are up", ["peer"], [name], float(link.connected))
            yield ("kvwire_credits", "immediates the receiver will still take (its free "
                   "receives, on all data channels)", ["peer"], [name],
                   float(link.data.credits.total if link.connected else 0))
            yield ("kvwire_writes_in_flight", "writes posted and not yet placed remotely",
                   ["peer"], [name], float(link.data.pending_writes))

    def in_flight(self) -> int:
        return len(self.pushes)

    def status_line(self) -> str:
        connected = sum(link.connected for link in self.links.values())
        return (f"{'draining' if self.draining else 'ready'}: {connected}/{len(self.links)} "
                f"receivers connected, {len(self.pushes)} pushes in flight, staging "
                f"{format_size(self.staging.used_bytes)} of {format_size(self.staging.size)} used")

    def stop_accepting(self) -> None:
        # No new engines; connected ones may finish their pushes.
        for server in self._servers:
            server.close()

    async def say_goodbye(self) -> None:
        for link in self.links.values():
            link.say_goodbye("the sender is shutting down")
        # The links' queue pairs are gone: now the devices, with the staging's
        # registrations (the pools are closed after this, as the receiver's).
        await self.transport.stop()

    def reload(self, fresh: Any) -> None:
        assert isinstance(fresh, SenderConfig)
        self.static_peers = dict(fresh.peers)
        self.reload_peers(self._wanted_peers())

    def _wanted_peers(self) -> dict[str, str]:
        if self.subscription is None:
            return dict(self.static_peers)
        return merged_peers(self.static_peers, self.subscription.membership.peers())

    def _membership_changed(self, changes: Changes) -> None:
        for _ in changes.rejected:
            self.metrics.registry_refused.labels("undecodable").inc()
        for _, reason, _ in changes.refused:
            self.metrics.registry_refused.labels(reason).inc()
        if changes:
            self.reload_peers(self._wanted_peers(), why="it left the registry")

    def reload_peers(self, peers: dict[str, str],
                     why: str = "the peer was removed from the sender's configuration",
                     ) -> dict[str, list[str]]:
        """Apply a new peer list; links that stay untouched keep their connections."""
        changes: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
        for name, link in list(self.links.items()):
            if peers.get(name) == link.address:
                continue
            changes["changed" if name in peers else "removed"].append(name)
            if name in peers and self.trust is not None and link.connected:
                # The receiver on this link proved its name by certificate, and
                # is still there: a record (or config) naming another address
                # for it cannot make it less so. Keep the link; the new address
                # is where it reconnects if it drops. A forged record then costs
                # nothing, and a receiver restores its own within a second.
                log.info("receiver's address changed; its authenticated link is kept",
                         peer=name, address=link.address, new_address=peers[name])
                link.address = peers[name]
                continue
            del self.links[name]
            link.retire(why)
            self.tasks.spawn(self._retire(link), f"retire-{name}")
        for name, address in peers.items():
            if name not in self.links:
                if name not in changes["changed"]:
                    changes["added"].append(name)
                self.links[name] = self._new_link(name, address)
                self.tasks.spawn(self.links[name].keep_connected(), f"link-{name}")
        self.config.peers = dict(peers)
        log.info("peer list reloaded", **changes, peers=sorted(self.links))
        self._peers_changed.set()
        self._peers_changed = asyncio.Event()
        return changes

    async def _retire(self, link: PeerLink) -> None:
        # Whatever already holds a lease on this link finishes; nothing new can reach it.
        await link.unheld()
        link.finish_retiring()
        if link.name not in self.links:  # removed, not re-added under its name
            self.metrics.forget_peer(link.name)

    # ------------------------------------------- the surface others build on

    def link(self, peer: str) -> PeerLink:
        """The link to receiver ``peer`` ("" names the only one, if there is one;
        ``auto`` the connected one with the most free pool, by the registry)."""
        if not peer and len(self.links) == 1:
            return next(iter(self.links.values()))
        if peer == AUTO_PEER:
            return self._auto_link()
        link = self.links.get(peer)
        if link is None:
            raise UnknownPeer(
                f"no receiver named {peer!r} is configured",
                hint=f"known peers: {', '.join(sorted(self.links)) or 'none'}; add it to "
                "[peers] in the sender config",
            )
        return link

    def _auto_link(self) -> PeerLink:
        if self.subscription is None:
            raise UnknownPeer(
                "peer \"auto\" chooses by the registry's pool figures, and this sender has "
                "no registry", hint="set discovery = \"etcd://HOST:PORT/CLUSTER\", or name "
                f"a receiver: {', '.join(sorted(self.links)) or 'none configured'}")
        connected = [name for name, link in self.links.items() if link.connected]
        chosen = self.subscription.membership.choose(connected, self.config.name)
        if chosen is None:
            members = sorted(self.subscription.membership.members)
            raise UnknownPeer(
                "peer \"auto\": no receiver of the registry is connected to this sender",
                hint=f"registry members: {', '.join(members) or 'none'}; connected: "
                f"{', '.join(sorted(connected)) or 'none'} (is kvwire_registry_up 1?)")
        return self.links[chosen]

    async def open_push(self, req: str, peer: str, shape: RequestShape, chunk_bytes: int,
                        deadline: float | None = None, discard: bool = False,
                        note: dict[str, Any] | None = None) -> Push:
        """Open a push; commit its layers, then await ``outcome``. ``note``: for
        the decode engine, passed on with the open (kvwired.protocol.fields.NOTE)."""
        if self.draining:
            raise RequestRefused(f"the sender is shutting down; request {req} was not opened",
                                 hint="open it on another sender, or once this one is back")
        return await self.driver.open(req, self.link(peer), shape, chunk_bytes, deadline,
                                      discard, note)

    async def push(self, req: str, peer: str, shape: RequestShape, chunk_bytes: int,
                   discard: bool = True) -> Timings:
        """Push ``shape``'s bytes as they are in staging, every layer at once; its timings.

        Experiments measure the request path with it, exactly as an engine
        that commits as fast as it can would drive it.
        """
        push = await self.open_push(req, peer, shape, chunk_bytes, discard=discard)
        push.drop_views()  # nothing but this daemon ever sees its staging
        for layer in range(shape.layers):
            push.commit(layer)
        return (await push.outcome).timings

    async def ask_verdict(self, req: str, peer: str, lease: int) -> ctl.Verdict | None:
        """Receiver ``peer``'s verdict on a lease of ours, within delivery_timeout:
        a daemon just restarted may not know the peer yet (the registry's), so
        an unknown one is looked for again until then."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.config.delivery_timeout
        while True:
            try:
                link = self.link(peer)
                break
            except UnknownPeer:
                if loop.time() >= until:
                    raise
                changed = self._peers_changed
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(until - loop.time()):
                        await changed.wait()
        return await link.verdict(req, lease, max(0.0, until - loop.time()))

    def reserve_staging(self, length: int) -> Awaitable[Slot]:
        return self.staging.reserve(length, self.config.staging_wait)

    def release_staging(self, slot: Slot) -> None:
        self.staging.release(slot)

    # ------------------------------------------------------------- engines

    async def _serve_engine(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        def send(msg: Message) -> None:
            if not writer.is_closing():
                writer.write(encode(msg))

        session = EngineSession(send, self._open_for_engine, self._run_experiment,
                                self.ask_verdict)
        welcome = local.Welcome(name=self.config.name, pool_size=self.staging.size,
                                peers=sorted(self.links))
        try:
            await self.serve_engine(reader, writer, SENDER_LOCAL, welcome,
                                    self.staging.memory.fd, session.handle, "prefill engine")
        finally:
            session.closed()

    async def _open_for_engine(self, msg: local.Open) -> Push:
        req = msg.req
        try:
            shape = RequestShape.from_wire(msg.shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad shape for request {req}: {exc}") from exc
        # The decoder has checked every value's type and range (SENDER_LOCAL).
        chunk_bytes = msg.chunk_bytes or self.config.chunk_bytes
        try:
            return await self.open_push(req, msg.peer, shape, chunk_bytes,
                                        None if msg.deadline is None else float(msg.deadline),
                                        bool(msg.discard), msg.note)
        except KvwireError:
            raise
        except Exception as exc:
            log.exception("internal error opening a push", req=req)
            raise internal_error(exc, "sender daemon") from exc

    async def _run_experiment(self, req: str, name: str, params: dict[str, Any],
                              report: Report) -> None:
        """Run one experiment for a local client; it hears rows, then result or failed."""
        try:
            experiment = self.experiments.get(name)
            if experiment is None:
                raise UsageError(f"unknown experiment {name!r}",
                                 hint=f"this daemon runs: "
                                 f"{', '.join(sorted(self.experiments)) or 'none'}")
            result = await experiment(self, req, params, report)
        except KvwireError as exc:
            log.warning("experiment failed", req=req, experiment=name, error=str(exc))
            report(Failed(req=req, error=exc.to_wire()))
            return
        except Exception as exc:
            log.exception("internal error in an experiment", req=req)
            report(Failed(req=req, error=internal_error(exc, "sender daemon").to_wire()))
            return
        report(local.Result(req=req, result=result))
