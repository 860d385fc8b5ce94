"""The sender daemon (prefill node).

Prefill engines open pushes on the unix socket, write layers into the
shared staging pool and commit them; for each commit the daemon posts the
layer's chunks as one-sided writes into the slot the receiver leased, the
last write carrying the immediate that announces the layer. One ``Push``
follows one request; one ``PeerLink`` holds the control connection and data
channel to one receiver and is rebuilt on the next request after a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from . import immediate
from .config import SenderConfig, parse_address
from .control import ControlConnection
from .errors import (
    DeadlineExceeded,
    DuplicateRequest,
    KvwireError,
    PeerLost,
    ProtocolError,
    RequestAborted,
    RequestRefused,
    TransportError,
    UnknownPeer,
    UsageError,
    from_wire,
)
from .layout import ChunkCursor, RequestShape
from .localsock import close_quietly, local_session, reject, serve_unix
from .metrics import Metrics
from .pool import Pool, Slot
from .protocol import SENDER_LOCAL, Message, encode, message
from .tasks import spawn
from .transport import make_transport
from .transport.base import DataChannel, Write
from .units import format_size

if TYPE_CHECKING:
    from .echo import EchoInitiator

log = structlog.get_logger("kvwired.sender")

# Control messages that answer a request of ours (``PeerLink.request``).
ANSWERS = frozenset({"lease", "refused", "echo_offer", "echo_ready", "baseline_ready"})



class Engine:
    """Whoever opens pushes: a prefill engine on the unix socket, or one of the
    daemon's own experiments (``inbox`` then takes what the daemon answers)."""

    def __init__(self, writer: asyncio.StreamWriter | None = None,
                 inbox: Callable[[Message], None] | None = None) -> None:
        self.writer = writer
        self.inbox = inbox
        self.pushes: dict[str, Push] = {}
        self.runs: dict[str, asyncio.Task[None]] = {}

    @property
    def gone(self) -> bool:
        return self.writer is not None and self.writer.is_closing()

    def send(self, msg: Message) -> None:
        if self.inbox is not None:
            self.inbox(msg)
        elif self.writer is not None and not self.writer.is_closing():
            self.writer.write(encode(msg))


@dataclass(eq=False)
class Push:
    req: str
    engine: Engine
    link: PeerLink
    shape: RequestShape
    chunk_bytes: int
    staging: Slot
    lease: int
    remote_offset: int
    deadline: float | None
    opened_at: float
    granted_at: float
    commits: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    posts: list[asyncio.Future[None]] = field(default_factory=list)
    delivered: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    error: KvwireError | None = None
    aborted_by_receiver: bool = False
    post_seconds: float = 0.0
    first_commit_at: float = 0.0
    last_commit_at: float = 0.0
    writes: int = 0
    driver: asyncio.Task[None] | None = None


class PeerLink:
    """Control connection + data channel to one named receiver."""

    def __init__(self, daemon: SenderDaemon, name: str, address: str) -> None:
        self.daemon = daemon
        self.name = name
        self.address = address
        self.conn: ControlConnection | None = None
        self.channel: DataChannel | None = None
        self.credits = 0
        self._credit_freed = asyncio.Event()
        self._lock = asyncio.Lock()
        # Requests to the receiver awaiting their answer, by request id.
        self._waiting: dict[str, asyncio.Future[Message]] = {}
        self.pushes: dict[int, Push] = {}
        self.echoes: dict[int, EchoInitiator] = {}
        self.ever_connected = False
        self.retired = False
        self.failure: KvwireError | None = None  # what broke the last data channel
        # Series that exist from the start, so rates and alerts see zeros.
        metrics = daemon.metrics
        metrics.reconnects.labels(name)
        metrics.peer_seen(name)
        for status in ("connection_lost", "retry_exceeded", "rnr_retry_exceeded",
                       "remote_access"):
            metrics.completion_errors.labels(name, status)
        self._reader: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return (self.conn is not None and not self.conn.closed
                and self.channel is not None and self.channel.alive)

    async def keep_connected(self) -> None:
        """Hold the connection up between requests, so a receiver that is down
        shows (``kvwire_peer_up`` 0) before a request needs it, and the first
        request pays no connection setup. Retries back off to 30 s."""
        backoff = 1.0
        while not self.retired:
            if self.connected:
                backoff = 1.0
            else:
                try:
                    await self.ensure()
                    continue
                except KvwireError as exc:
                    log.debug("receiver not reachable yet", peer=self.name, error=str(exc))
                    backoff = min(backoff * 2, 30.0)
            await asyncio.sleep(1.0 if self.connected else backoff)

    async def ensure(self) -> None:
        async with self._lock:
            if self.connected:
                return
            # Whatever still hangs on the old connection fails with what broke
            # it (a completion error, say), not with "being rebuilt".
            self.lost(self.failure or PeerLost(
                f"connection to receiver {self.name} is being rebuilt"))
            self.failure = None
            await self._connect()

    async def _connect(self) -> None:
        cfg = self.daemon.config
        host, port = parse_address(self.address, 7471)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), cfg.connect_timeout)
        except (OSError, TimeoutError) as exc:
            raise PeerLost(
                f"cannot reach receiver {self.name} at {host}:{port}: "
                f"{getattr(exc, 'strerror', None) or exc or 'timed out'}",
                hint="is kvwired receiver running there, and is the port reachable?",
            ) from exc
        conn = ControlConnection(reader, writer, cfg.heartbeat, f"receiver {self.name}")
        try:
            transport = self.daemon.transport
            conn.send(message("hello", role="sender", name=cfg.name,
                              transports=[transport.name]))
            welcome = await self._expect(conn, "welcome")
            initiator = transport.initiator(conn.local_host)
            try:
                conn.send(message("connect", params=await initiator.offer()))
                ready = await self._expect(conn, "ready")
                self.channel = await initiator.complete(ready["params"])
                self.channel.on_failure = self._count_failure
            except BaseException:
                initiator.abandon()
                raise
        except BaseException:
            conn.close()
            raise
        self.conn = conn
        self.credits = int(welcome["credits"])
        if self.ever_connected:
            self.daemon.metrics.reconnects.labels(self.name).inc()
        self.ever_connected = True
        conn.start_pinging()
        self._reader = spawn(self._read(conn), f"link-{self.name}")
        self.daemon.metrics.peers.inc()
        log.info("connected to receiver", peer=self.name, address=self.address,
                 transport=transport.name, credits=self.credits)

    def _count_failure(self, error: Exception) -> None:
        status = getattr(error, "status", "transport_error")
        self.daemon.metrics.completion_errors.labels(self.name, status).inc()
        if isinstance(error, TransportError):
            # Named after the receiver: "outgoing data connection closed" alone
            # does not say which of several peers went away.
            named = type(error)(f"receiver {self.name}: {error.message}", hint=error.hint)
            named.status = status
            self.failure = named

    async def _expect(self, conn: ControlConnection, kind: str) -> Message:
        msg = await conn.recv(self.daemon.config.connect_timeout)
        if msg["t"] == "error":
            raise from_wire(msg["error"])
        if msg["t"] != kind:
            raise ProtocolError(f"receiver {self.name} sent {msg['t']!r}, expected {kind!r}")
        return msg

    async def _read(self, conn: ControlConnection) -> None:
        try:
            async for msg in conn.messages():
                self._dispatch(msg)
        except KvwireError as exc:
            if self.conn is conn:
                log.warning("receiver connection lost", peer=self.name, error=str(exc))
                conn.fail(exc)
                self.lost(exc if isinstance(exc, PeerLost) else PeerLost(
                    f"receiver {self.name}: {exc}"))

    def _dispatch(self, msg: Message) -> None:
        kind = msg["t"]
        if kind in ANSWERS:
            future = self._waiting.pop(msg["req"], None)
            if future is None or future.done():
                self._unwanted(msg)
            elif kind == "refused":
                future.set_exception(from_wire(msg["error"]))
            else:
                future.set_result(msg)
        elif kind == "delivered":
            push = self.pushes.get(msg["lease"])
            if push is not None and not push.delivered.done():
                push.delivered.set_result(msg["checksum"])
        elif kind == "abort":
            push = self.pushes.get(msg["lease"])
            if push is not None:
                push.aborted_by_receiver = True
                self.daemon.fail_push(push, from_wire(msg["error"]))
            echo = self.echoes.get(msg["lease"])
            if echo is not None:
                echo.fail(from_wire(msg["error"]))
        elif kind == "credits":
            self.credits += msg["n"]
            self._credit_freed.set()
        elif kind == "bye":
            raise PeerLost(f"receiver {self.name} is shutting down: {msg['reason']}",
                           hint="the next request reconnects once it is back")
        elif kind == "error":
            raise PeerLost(f"receiver {self.name} reported: {msg['error'].get('message')}")
        else:
            raise ProtocolError(f"a receiver may not send {kind!r}")

    def _unwanted(self, msg: Message) -> None:
        # Nobody waits for this answer any more (deadline, engine gone): give
        # back what it holds at once; no write of ours can reach it.
        if msg["t"] == "lease":
            self.send(message("abort", req=msg["req"], lease=msg["lease"],
                              error=RequestAborted(f"the sender stopped waiting for request "
                                                   f"{msg['req']}").to_wire()))
        elif msg["t"] in ("echo_offer", "echo_ready"):
            self.send(message("echo_close", req=msg["req"], lease=msg["lease"]))
        elif msg["t"] == "baseline_ready":
            self.send(message("baseline_stop", req=msg["req"]))

    async def request(self, msg: Message) -> Message:
        """Send ``msg`` and wait for the receiver's answer to its ``req``."""
        if self.conn is None:
            raise PeerLost(f"receiver {self.name} went away")
        req = msg["req"]
        if req in self._waiting:
            raise DuplicateRequest(f"request {req} is already being opened")
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[req] = future
        self.conn.send(msg)
        try:
            return await future
        finally:
            self._waiting.pop(req, None)

    async def open(self, req: str, shape: RequestShape, discard: bool = False) -> tuple[int, int]:
        fields = {"discard": 1} if discard else {}
        lease = await self.request(message("open", req=req, shape=shape.to_wire(), **fields))
        return lease["lease"], lease["offset"]

    async def take_credit(self) -> None:
        # One credit per immediate in flight: the receiver never sees more
        # immediates than it has receives posted for.
        while self.credits <= 0:
            if not self.connected:
                raise PeerLost(f"receiver {self.name} went away")
            event = self._credit_freed
            await event.wait()
            if event is self._credit_freed:
                self._credit_freed = asyncio.Event()
        self.credits -= 1

    def lost(self, error: KvwireError) -> None:
        """Fail everything in flight on this link and forget the connection."""
        conn, channel = self.conn, self.channel
        self.conn = self.channel = None
        if conn is not None:
            conn.close()
            self.daemon.metrics.peers.dec()
        if channel is not None:
            channel.close()
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)
        self._waiting.clear()
        for push in list(self.pushes.values()):
            self.daemon.fail_push(push, error)
        for echo in list(self.echoes.values()):
            echo.fail(error)
        self._credit_freed.set()

    def send(self, msg: Message) -> None:
        if self.conn is not None:
            self.conn.send(msg)

    def say_goodbye(self, reason: str) -> None:
        """Tell the receiver this connection ends on purpose, then drop it."""
        self.retired = True
        self.send(message("bye", reason=reason))
        self.lost(PeerLost(f"connection to receiver {self.name} closed: {reason}"))


class SenderDaemon:
    def __init__(self, config: SenderConfig) -> None:
        self.config = config
        self.metrics = Metrics("sender")
        self.metrics.live.sources.append(self._live_metrics)
        self.staging: Pool | None = None
        self.transport = make_transport(config)
        self.links = {name: PeerLink(self, name, addr) for name, addr in config.peers.items()}
        self.pushes: dict[str, Push] = {}
        self._servers: list[asyncio.AbstractServer] = []
        self.metrics_port = 0
        self.draining = False

    async def start(self) -> None:
        cfg = self.config
        self.staging = Pool(cfg.staging_size, "staging", "staging_size", full_hint=(
            "each push holds staging memory until delivered; raise staging_size"))
        await self.transport.start(self.staging.memory)
        self.metrics_port = self.metrics.serve(*parse_address(cfg.metrics, 0))
        # The unix socket comes last: once it accepts, the daemon is ready.
        self._servers.append(await serve_unix(cfg.socket, self._serve_engine))
        for link in self.links.values():
            spawn(link.keep_connected(), f"link-{link.name}")
        self._update_pool_metrics()
        log.info("sender ready", name=cfg.name, socket=cfg.socket, **self.transport.describe(),
                 staging_bytes=cfg.staging_size, peers=dict(cfg.peers),
                 chunk_bytes=cfg.chunk_bytes, metrics_port=self.metrics_port)

    def _live_metrics(self) -> Iterator[tuple[str, str, list[str], list[str], float]]:
        for name, link in list(self.links.items()):
            channel = link.channel
            yield ("kvwire_peer_up", "1 while the control and data connections to the "
                   "receiver are up", ["peer"], [name], float(link.connected))
            yield ("kvwire_credits", "immediates the receiver will still take (its free "
                   "receives)", ["peer"], [name], float(link.credits if link.connected else 0))
            yield ("kvwire_writes_in_flight", "writes posted and not yet placed remotely",
                   ["peer"], [name], float(channel.pending_writes if channel else 0))

    def status_line(self) -> str:
        assert self.staging is not None
        connected = sum(link.connected for link in self.links.values())
        return (f"{'draining' if self.draining else 'ready'}: {connected}/{len(self.links)} "
                f"receivers connected, {len(self.pushes)} pushes in flight, staging "
                f"{format_size(self.staging.used_bytes)} of {format_size(self.staging.size)} used")

    async def drain(self, timeout: float) -> int:
        """Stop taking pushes; let those in flight finish within ``timeout``.

        Returns how many were still in flight when the time ran out (they
        fail when the daemon stops).
        """
        self.draining = True
        for server in self._servers:
            server.close()  # no new engines; connected ones may finish their pushes
        deadline = asyncio.get_running_loop().time() + timeout
        while self.pushes and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self.pushes:
            log.warning("drain timed out", in_flight=len(self.pushes), timeout=timeout)
        return len(self.pushes)

    def reload_peers(self, peers: dict[str, str]) -> dict[str, list[str]]:
        """Apply a new peer list; links that stay untouched keep their connections."""
        changes: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
        for name, link in list(self.links.items()):
            if peers.get(name) == link.address:
                continue
            changes["changed" if name in peers else "removed"].append(name)
            del self.links[name]
            link.retired = True
            spawn(self._retire(link), f"retire-{name}")
        for name, address in peers.items():
            if name not in self.links:
                if name not in changes["changed"]:
                    changes["added"].append(name)
                self.links[name] = PeerLink(self, name, address)
                spawn(self.links[name].keep_connected(), f"link-{name}")
        self.config.peers = dict(peers)
        log.info("peer list reloaded", **changes, peers=sorted(self.links))
        return changes

    async def _retire(self, link: PeerLink) -> None:
        # Pushes already on this link finish; no new ones can reach it.
        while link.pushes:
            await asyncio.sleep(0.05)
        link.say_goodbye("the peer was removed from the sender's configuration")

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for link in self.links.values():
            link.say_goodbye("the sender is shutting down")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.config.socket)

    def _update_pool_metrics(self) -> None:
        assert self.staging is not None
        self.metrics.set_pool("staging", self.staging.size, self.staging.used_bytes)
        self.metrics.inflight.set(len(self.pushes))

    # ------------------------------------------------------------- engines

    async def _serve_engine(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        engine = Engine(writer)
        assert self.staging is not None
        welcome = message("welcome", name=self.config.name, pool_size=self.staging.size,
                          peers=sorted(self.links))
        self.metrics.clients.inc()
        try:
            await local_session(reader, writer, SENDER_LOCAL, welcome, self.staging.memory.fd,
                                lambda msg: self.engine_message(engine, msg))
        except KvwireError as exc:
            self.metrics.protocol_errors.labels("sender_local").inc()
            log.warning("prefill engine connection rejected", error=str(exc))
            reject(writer, exc)
        except (ConnectionError, OSError):
            pass
        finally:
            for run in engine.runs.values():
                run.cancel()
            for push in list(engine.pushes.values()):
                self.fail_push(push, RequestAborted(
                    f"the prefill engine disconnected before request {push.req} was delivered"))
            self.metrics.clients.dec()
            close_quietly(writer)

    def engine_message(self, engine: Engine, msg: Message) -> None:
        """Take one message from a prefill engine (or from an experiment)."""
        kind, req = msg["t"], msg.get("req", "")
        if kind == "open":
            spawn(self._open(engine, msg), f"open-{req}")
            return
        if kind == "run":
            self._run(engine, msg)
            return
        push = engine.pushes.get(req)
        if push is None:
            engine.send(message("failed", req=req, error=UsageError(
                f"no open request {req!r} on this connection",
                hint="open it first; a failed request must be opened again").to_wire()))
        elif kind == "commit":
            if push.first_commit_at == 0.0:
                push.first_commit_at = time.monotonic()
            push.commits.put_nowait(msg["layer"])
        elif kind == "abort":
            self.fail_push(push, RequestAborted(f"the prefill engine aborted request {req}"))
        else:
            raise ProtocolError(f"a prefill engine may not send {kind!r}")

    def _run(self, engine: Engine, msg: Message) -> None:
        from .sweep import run_experiment

        req = msg["req"]
        if req in engine.runs:
            engine.send(message("failed", req=req, error=DuplicateRequest(
                f"experiment {req} is already running").to_wire()))
            return
        task = spawn(run_experiment(self, req, msg["experiment"], msg["params"], engine.send),
                     f"run-{req}")
        engine.runs[req] = task
        task.add_done_callback(lambda _: engine.runs.pop(req, None))

    async def _open(self, engine: Engine, msg: Message) -> None:
        req = msg["req"]
        opened_at = time.monotonic()
        deadline = msg.get("deadline")
        try:
            async with asyncio.timeout(deadline):
                push = await self._reserve(engine, msg, opened_at)
        except TimeoutError:
            engine.send(message("failed", req=req, error=DeadlineExceeded(
                f"request {req} could not be opened within its {deadline:g} s deadline").to_wire()))
            return
        except KvwireError as exc:
            log.info("push refused", req=req, peer=msg["peer"], reason=str(exc))
            engine.send(message("failed", req=req, error=exc.to_wire()))
            return
        except Exception as exc:
            log.exception("internal error opening a push", req=req)
            engine.send(message("failed", req=req, error=KvwireError(
                f"internal error in the sender daemon: {exc!r}",
                hint="this is a bug in kvwire; the daemon log has the traceback").to_wire()))
            return
        if deadline is not None:
            push.deadline = opened_at + float(deadline)
        engine.pushes[req] = push
        push.link.pushes[push.lease] = push
        self.pushes[req] = push
        self._update_pool_metrics()
        push.driver = spawn(self._drive(push), f"push-{req}")
        if engine.gone:
            self.fail_push(push, RequestAborted(
                f"the prefill engine disconnected while request {req} was being opened"))
            return
        engine.send(message("opened", req=req, offset=push.staging.offset,
                            chunk_bytes=push.chunk_bytes))

    async def _reserve(self, engine: Engine, msg: Message, opened_at: float) -> Push:
        req, peer = msg["req"], msg["peer"]
        if self.draining:
            raise RequestRefused(f"the sender is shutting down; request {req} was not opened",
                                 hint="open it on another sender, or once this one is back")
        link = self.links.get(peer)
        if link is None:
            raise UnknownPeer(
                f"no receiver named {peer!r} is configured",
                hint=f"known peers: {', '.join(sorted(self.links)) or 'none'}; add it to "
                "[peers] in the sender config",
            )
        if req in self.pushes:
            raise DuplicateRequest(f"request {req} is already being pushed")
        try:
            shape = RequestShape.from_wire(msg["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad shape for request {req}: {exc}") from exc
        if shape.layers > immediate.MAX_LAYERS:
            raise UsageError(f"request {req} has {shape.layers} layers; at most "
                             f"{immediate.MAX_LAYERS} are supported")
        chunk_bytes = int(msg.get("chunk_bytes") or self.config.chunk_bytes)
        if chunk_bytes < 1:
            raise UsageError(f"chunk size {chunk_bytes} B is not positive")
        assert self.staging is not None
        staging = await self.staging.reserve(shape.total_bytes, self.config.staging_wait)
        self._update_pool_metrics()
        try:
            await link.ensure()
            lease, remote_offset = await link.open(req, shape, bool(msg.get("discard")))
        except BaseException:
            self.staging.release(staging)
            self._update_pool_metrics()
            raise
        return Push(req, engine, link, shape, chunk_bytes, staging, lease, remote_offset,
                    None, opened_at, time.monotonic())

    # ----------------------------------------------------------- data path

    async def _drive(self, push: Push) -> None:
        link = push.link
        cursor = ChunkCursor(push.shape, push.chunk_bytes)
        peer_bytes = self.metrics.bytes.labels(link.name, "sent")
        plain_writes = self.metrics.writes.labels(link.name, "sent", "write")
        imm_writes = self.metrics.writes.labels(link.name, "sent", "write_imm")
        sizes = self.metrics.write_sizes
        try:
            async with asyncio.timeout_at(self._loop_deadline(push)):
                while not cursor.done:
                    layer = await push.commits.get()
                    batch = cursor.commit(layer)
                    if batch is None:
                        continue
                    await link.take_credit()
                    channel = link.channel
                    if channel is None:
                        raise PeerLost(f"receiver {link.name} went away")
                    started = time.perf_counter()
                    base_local, base_remote = push.staging.offset, push.remote_offset
                    writes = [Write(base_local + c.offset, base_remote + c.offset, c.length)
                              for c in batch.chunks]
                    posted = channel.post(
                        writes, immediate.pack(push.lease, batch.completes_layer))
                    posted.add_done_callback(self._sent_callback(push, batch.completes_layer))
                    push.posts.append(posted)
                    push.post_seconds += time.perf_counter() - started
                    push.writes += len(writes)
                    plain_writes.inc(len(writes) - 1)
                    imm_writes.inc()
                    peer_bytes.inc(sum(c.length for c in batch.chunks))
                    # Chunks of a batch are one size but for a layer's tail.
                    first, last = batch.chunks[0].length, batch.chunks[-1].length
                    sizes.observe(link.name, first, len(batch.chunks) - 1)
                    sizes.observe(link.name, last)
                    # Let the data path start on this layer before the next
                    # committed one is cut into writes.
                    await asyncio.sleep(0)
                push.last_commit_at = time.monotonic()
                await asyncio.gather(*push.posts)
                checksum = await self._confirmation(push)
        except TimeoutError:
            self.fail_push(push, DeadlineExceeded(
                f"request {push.req} missed its deadline"))
            return
        except TransportError as exc:
            # The channel's failure, named after its receiver.
            self.fail_push(push, link.failure or exc)
            return
        except KvwireError as exc:
            self.fail_push(push, exc)
            return
        except Exception as exc:
            log.exception("internal error driving a push", req=push.req)
            self.fail_push(push, KvwireError(f"internal error in the sender daemon: {exc!r}"))
            return
        self._finish_push(push, checksum)

    @staticmethod
    def _sent_callback(push: Push, layer: int) -> Callable[[asyncio.Future[None]], None]:
        # The engine may reuse a layer's staging once its writes are placed.
        def sent(posted: asyncio.Future[None]) -> None:
            if not posted.cancelled() and posted.exception() is None and push.error is None:
                push.engine.send(message("sent", req=push.req, layer=layer))
        return sent

    async def _confirmation(self, push: Push) -> int:
        """The receiver's checksum, once every write has been placed.

        It follows the last immediate at once; a receiver that stays silent
        after that has lost track of the request (a bug, or a stale lease),
        and the caller hears so rather than waiting forever.
        """
        wait = self.config.delivery_timeout
        try:
            return await asyncio.wait_for(asyncio.shield(push.delivered), wait)
        except TimeoutError:
            raise PeerLost(
                f"receiver {push.link.name} has every byte of request {push.req} but did "
                f"not confirm delivery within {wait:g} s",
                hint="the receiver's log says why; the request was not delivered") from None

    def _loop_deadline(self, push: Push) -> float | None:
        if push.deadline is None:
            return None
        loop = asyncio.get_running_loop()
        return loop.time() + (push.deadline - time.monotonic())

    def _finish_push(self, push: Push, checksum: int) -> None:
        now = time.monotonic()
        timings = {
            "open_seconds": push.granted_at - push.opened_at,
            "transfer_seconds": now - (push.first_commit_at or push.granted_at),
            "total_seconds": now - push.opened_at,
            "post_seconds": push.post_seconds,
            "drain_seconds": now - (push.last_commit_at or now),
            "bytes": push.shape.total_bytes,
            "writes": push.writes,
        }
        self._forget(push)
        peer = push.link.name
        self.metrics.requests.labels(peer, "delivered").inc()
        self.metrics.request_seconds.labels(peer).observe(timings["total_seconds"])
        self.metrics.post_seconds.labels(peer).observe(timings["post_seconds"])
        self.metrics.wait_seconds.labels(peer).observe(timings["drain_seconds"])
        push.engine.send(message("finished", req=push.req, checksum=checksum, timings=timings))

    def fail_push(self, push: Push, error: KvwireError) -> None:
        """End a push that will not be delivered; cleanup runs in the background."""
        if push.error is not None or self.pushes.get(push.req) is not push:
            return
        push.error = error
        if push.driver is not None and asyncio.current_task() is not push.driver:
            push.driver.cancel()
        spawn(self._cleanup_failed(push), f"abort-{push.req}")

    async def _cleanup_failed(self, push: Push) -> None:
        assert push.error is not None
        # The staging slot may only be reused once no write still reads it,
        # and the receiver may only reuse its slot once none can still land.
        await asyncio.gather(*push.posts, return_exceptions=True)
        link = push.link
        if link.connected:
            if push.aborted_by_receiver:
                link.send(message("abort_ack", req=push.req, lease=push.lease))
            else:
                link.send(message("abort", req=push.req, lease=push.lease,
                                  error=push.error.to_wire()))
        elif link.conn is not None:
            # The data channel died under a live control connection: drop both,
            # so the receiver voids every lease of this link.
            link.lost(PeerLost(f"the data channel to receiver {link.name} failed"))
        self._forget(push)
        self.metrics.requests.labels(link.name, "failed").inc()
        log.warning("push failed", req=push.req, peer=link.name, error=str(push.error))
        push.engine.send(message("failed", req=push.req, error=push.error.to_wire()))

    def _forget(self, push: Push) -> None:
        if self.pushes.get(push.req) is push:
            del self.pushes[push.req]
        push.engine.pushes.pop(push.req, None)
        push.link.pushes.pop(push.lease, None)
        assert self.staging is not None
        self.staging.release(push.staging)
        self._update_pool_metrics()
