"""What engines import: ``SenderClient`` (prefill) and ``ReceiverClient`` (decode).

Both map their daemon's pool: the prefill engine writes each layer straight
into registered staging memory and commits it (the daemon sends that layer
while the engine computes the next); the decode engine reads delivered KV in
place and releases it. ``SyncSenderClient`` and ``SyncReceiverClient`` wrap
them for callers without an event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import mmap
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, Self, TypeVar, overload

from .errors import DaemonUnavailable, KvwireError, UsageError, from_wire
from .layout import KVLayout, RequestShape, resolve_chunk_bytes
from .localsock import connect_local
from .pool import map_shared_fd
from .protocol import MAX_SECONDS, RECEIVER_LOCAL, SENDER_LOCAL, Channel, Error, Failed, Message
from .protocol import receiver_local as decode_api
from .protocol import sender_local as prefill_api
from .protocol.fields import NOTE, NOTE_CHECK, REQ, SHAPE
from .slot_maps import SlotMaps
from .stream import MessageStream

DEFAULT_SENDER_SOCKET = "/run/kvwire/sender.sock"
DEFAULT_RECEIVER_SOCKET = "/run/kvwire/receiver.sock"
# Where an engine finds its daemon when it names no socket: these variables,
# then the paths the shipped units use.
SENDER_SOCKET_VARIABLE = "KVWIRE_SENDER_SOCKET"
# How long a push whose every layer was committed waits for its sender daemon
# to come back (systemd restarts it) and say how the request ended, when it
# has no deadline; with one, until the deadline and VERDICT_GRACE past it.
DAEMON_RETURN_WAIT = 30.0
VERDICT_GRACE = 2.0
RECONNECT_EVERY = 0.2  # seconds between attempts to reach a restarted daemon
RECEIVER_SOCKET_VARIABLE = "KVWIRE_RECEIVER_SOCKET"
T = TypeVar("T")
C = TypeVar("C", bound="_LocalClient")


@dataclass(frozen=True)
class PushResult:
    req: str
    bytes: int
    checksum: int
    seconds: float  # open() to delivered, as the engine saw it
    timings: dict[str, float]

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds else 0.0


@dataclass(frozen=True)
class LayerLanded:
    """Layer ``layer`` of ``req`` is in the pool, at ``offset`` within the
    request's ``length`` bytes there (``view`` reads it before the rest lands;
    only ``Delivered`` says every byte is in and checked)."""

    req: str
    layer: int
    offset: int | None = None
    length: int | None = None


@dataclass(frozen=True)
class PushOpened:
    """``req`` has a slot at the receiver and its bytes are on the way; ``note``
    is what the prefill engine said about it with its open (its KV layout)."""

    req: str
    note: dict[str, Any] | None = None


@dataclass(frozen=True)
class Delivered:
    req: str
    offset: int
    length: int
    layers: int
    checksum: int  # kvwired.checksum of the request, as the receiver hashed it

    @property
    def shape(self) -> RequestShape:
        return RequestShape(self.layers, self.length // self.layers)


def _check_request(req: str, shape: RequestShape) -> None:
    """What the daemon would refuse, said before anything is sent."""
    for name, field, value in (("req", REQ, req), ("shape", SHAPE, shape.to_wire())):
        if field.check is not None and (wrong := field.check(value)) is not None:
            raise UsageError(f"request {req[:64]!r} cannot be opened: {name} {wrong}",
                             hint="at most 1,024 layers of at most 1 TiB each, and a "
                                  "request id of 1 to 256 characters")


class _Connection:
    """A local daemon connection: frames out, a reader task routing frames in."""

    def __init__(self, path: str, role: str, channel: Channel,
                 route: Callable[[Message], None],
                 fail_all: Callable[[KvwireError], None]) -> None:
        self.path, self.role, self.channel = path, role, channel
        self._route, self._fail_all = route, fail_all
        self.map: mmap.mmap | None = None  # the whole pool (decode engines, read-only)
        self.fd: int | None = None  # the pool's fd (prefill engines map per push)
        self.slot_maps: SlotMaps | None = None  # those maps, kept warm between pushes
        self.welcome: prefill_api.Welcome | decode_api.Welcome | None = None
        self._stream: MessageStream | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self.broken: KvwireError | None = None

    async def open(self, map_pool: bool) -> None:
        stream, welcome, fd = await connect_local(self.path, self.role, self.channel)
        if map_pool:
            self.map = map_shared_fd(fd, welcome.pool_size, writable=False)
        else:
            self.fd = fd
            self.slot_maps = SlotMaps(fd)
        self.welcome, self._stream = welcome, stream
        self._reader_task = asyncio.create_task(self._read(stream))

    async def _read(self, stream: MessageStream) -> None:
        error: KvwireError
        try:
            while (msg := await stream.receive()) is not None:
                if isinstance(msg, Error):
                    error = from_wire(msg.error)
                    break
                self._route(msg)
            else:
                error = DaemonUnavailable(f"the daemon at {self.path} closed the connection",
                                          hint="check its logs; it may have been stopped")
        except KvwireError as exc:
            error = exc
        except (ConnectionError, OSError) as exc:
            error = DaemonUnavailable(f"connection to the daemon at {self.path} broke: {exc}")
        self.broken = error
        self._fail_all(error)

    def send(self, msg: Message) -> None:
        if self.broken is not None:
            raise self.broken
        assert self._stream is not None
        self._stream.send(msg)

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        if self._stream is not None:
            self._stream.close()
        if self.slot_maps is not None:
            self.slot_maps.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class OutgoingPush:
    """One request being pushed: fill layers in staging memory, commit each."""

    def __init__(self, client: SenderClient, req: str, shape: RequestShape, offset: int,
                 chunk_bytes: int, started: float, peer: str = "", lease: int = 0,
                 deadline: float | None = None) -> None:
        self.client = client
        self.req = req
        self.peer = peer  # the receiver it goes to (the sender's choice, for "auto")
        self.lease = lease  # the receiver's lease: what to ask about if the daemon dies
        self.deadline = deadline  # seconds from ``started``, as given to open()
        self.shape = shape
        self.chunk_bytes = chunk_bytes
        maps = client.conn.slot_maps
        assert maps is not None, "a sender connection maps its staging per push"
        # This push's own mapping of its staging: when it ends, the mapping is
        # taken from every view, so a view kept past the end can never write
        # into a later push that reuses the slot (see kvwired.slot_maps).
        self._maps = maps
        self._slot, self.buffer = maps.take(offset, shape.total_bytes)
        self._committed = 0
        self._aborted = False
        self._started = started
        self._result: asyncio.Future[PushResult] = asyncio.get_running_loop().create_future()
        self.sent_layers = 0  # layers placed at the receiver so far
        self._sent_changed = asyncio.Event()

    def layer(self, n: int) -> memoryview:
        """Writable staging memory of layer ``n`` (registered: no copy on the way out)."""
        self._check_open()  # an ended push's staging is gone: say why, typed
        offset, length = self.shape.layer_span(n)
        return self.buffer[offset : offset + length]

    def _check_open(self) -> None:
        if self._result.done():
            self._result.result()  # raises the failure, if that is what ended it
            raise UsageError(f"request {self.req} is already finished")

    def commit(self, n: int) -> None:
        """Hand layer ``n`` to the daemon; returns at once."""
        self._check_open()
        if n != self._committed:
            raise UsageError(f"layer {n} committed out of order",
                             hint=f"commit layers in order; layer {self._committed} is next")
        self.client.conn.send(prefill_api.Commit(req=self.req, layer=n))
        self._committed += 1

    async def wait_sent(self, n: int) -> None:
        """Wait until layer ``n`` is placed in the receiver's memory.

        Its staging memory may then be reused: an engine that double-buffers
        waits for layer n before computing layer n + 2 into the same buffer.
        """
        while self.sent_layers <= n:
            if self._result.done():
                self._result.result()  # a failure ends the wait
                return
            await self._sent_changed.wait()
            self._sent_changed.clear()

    def _sent(self, layer: int) -> None:
        self.sent_layers = max(self.sent_layers, layer + 1)
        self._sent_changed.set()

    async def finish(self) -> PushResult:
        """Wait until the receiver has every byte; the request's timings."""
        if (self._committed < self.shape.layers and not self._aborted
                and not self._result.done()):
            raise UsageError(
                f"finish() before every layer was committed ({self._committed} of "
                f"{self.shape.layers})", hint="commit all layers, or abort()")
        # Shielded: a caller that stops waiting (asyncio.wait_for, a cancelled
        # task) must not cancel the outcome itself, or the push could neither
        # be aborted nor learn what the receiver decided.
        return await asyncio.shield(self._result)

    def abort(self) -> None:
        """Ask the daemon to abort; ``finish()`` then says how the request ended
        (aborted, or delivered first: the receiver decides)."""
        if not self._result.done() and not self._aborted:
            self._aborted = True
            # A broken connection fails the push with its own error.
            with contextlib.suppress(KvwireError):
                self.client.conn.send(prefill_api.Abort(req=self.req))

    def _finished(self, msg: prefill_api.Finished) -> None:
        if not self._result.done():
            self._result.set_result(PushResult(
                self.req, self.shape.total_bytes, msg.checksum,
                time.perf_counter() - self._started, dict(msg.timings)))
        self._sent(self.shape.layers - 1)
        self._retire()

    def _failed(self, error: KvwireError) -> None:
        if not self._result.done():
            self._result.set_exception(error)
            self._result.exception()  # mark retrieved: the caller may never finish()
        self._sent_changed.set()
        self._retire()

    @property
    def fully_committed(self) -> bool:
        """Every layer is in the daemon's hands: the receiver may have it all."""
        return self._committed == self.shape.layers

    def verdict_wait(self) -> float:
        """Seconds to wait for a lost daemon's successor to say how this ended."""
        if self.deadline is None:
            return DAEMON_RETURN_WAIT
        left = self._started + self.deadline - time.perf_counter()
        return max(0.0, left) + VERDICT_GRACE

    def _retire(self, tell_daemon: bool = True) -> None:
        """The push ended: take its staging away from every view, then let the
        daemon reuse it."""
        if self._slot.mapping.closed:
            return
        self.buffer.release()
        self._maps.retire(self._slot)
        if tell_daemon and self.client.conn.broken is None:
            self.client.conn.send(prefill_api.Dropped(req=self.req))


@dataclass
class _Opening:
    """A push asked for and not yet answered."""

    future: asyncio.Future[OutgoingPush]
    shape: RequestShape
    started: float
    deadline: float | None


@dataclass
class _Run:
    """An experiment the daemon runs for this client."""

    on_message: Callable[[Message], None]
    result: asyncio.Future[dict[str, Any]]

    def route(self, msg: Message) -> None:
        if isinstance(msg, prefill_api.Result):
            if not self.result.done():
                self.result.set_result(dict(msg.result))
        elif isinstance(msg, Failed):
            self.fail(from_wire(msg.error))
        else:
            self.on_message(msg)

    def fail(self, error: KvwireError) -> None:
        if not self.result.done():
            self.result.set_exception(error)


class _LocalClient:
    """What both engine clients share: their connection, ``close`` and ``async with``."""

    conn: _Connection

    async def close(self) -> None:
        await self.conn.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SenderClient(_LocalClient):
    """A prefill engine's connection to its local sender daemon."""

    def __init__(self, path: str) -> None:
        self.conn = _Connection(path, "prefill", SENDER_LOCAL, self._route, self._fail_all)
        self._opening: dict[str, _Opening] = {}
        self._pushes: dict[str, OutgoingPush] = {}
        self._runs: dict[str, _Run] = {}
        self._asking: asyncio.Future[None] | None = None  # pushes outliving the daemon

    @classmethod
    async def connect(cls, path: str | None = None) -> SenderClient:
        """Connect to the sender daemon at ``path``; by default the socket named
        by ``$KVWIRE_SENDER_SOCKET``, else ``/run/kvwire/sender.sock``."""
        client = cls(path or os.environ.get(SENDER_SOCKET_VARIABLE) or DEFAULT_SENDER_SOCKET)
        await client.conn.open(map_pool=False)
        return client

    async def open(self, req: str, peer: str | None, shape: RequestShape | KVLayout, *,
                   chunk: str | int | None = None,
                   deadline: float | None = None,
                   discard: bool = False,
                   note: Mapping[str, Any] | None = None) -> OutgoingPush:
        """Open a push of request ``req`` to receiver ``peer`` (None: the
        sender's only receiver; an error names them when it has several;
        ``"auto"``: the sender chooses, by the registry, and the push's
        ``peer`` says which).

        ``discard``: the receiver frees the request as soon as it is delivered
        instead of holding it for a decode engine (benchmarks, warm-up).
        ``note``: for the decode engine, which gets it as the push opens
        (``PushOpened``), before any layer lands: a flat map of at most 32
        named strings, numbers, booleans or nils.
        """
        layout = shape if isinstance(shape, KVLayout) else None
        request_shape = shape.shape() if isinstance(shape, KVLayout) else shape
        if req in self._opening or req in self._pushes:
            raise UsageError(f"request {req} is already open on this client")
        _check_request(req, request_shape)
        if deadline is not None and not (isinstance(deadline, int | float)
                                         and math.isfinite(deadline)
                                         and 0 < deadline <= MAX_SECONDS):
            raise UsageError(f"deadline {deadline!r} is not a number of seconds",
                             hint=f"pass seconds in (0, {MAX_SECONDS:g}], or no deadline")
        wrong = None if note is None else (
            "not a mapping" if not isinstance(note, Mapping) else NOTE_CHECK(dict(note)))
        if wrong:
            raise UsageError(f"the note of request {req}: {wrong}",
                             hint=NOTE.expected)
        opening_msg = prefill_api.Open(
            req=req, peer=peer or self.only_peer(), shape=request_shape.to_wire(),
            chunk_bytes=None if chunk is None else resolve_chunk_bytes(
                chunk, layout or request_shape),
            deadline=None if deadline is None else float(deadline),
            discard=1 if discard else None, note=dict(note) if note else None)
        opening = _Opening(asyncio.get_running_loop().create_future(), request_shape,
                           time.perf_counter(), opening_msg.deadline)
        self._opening[req] = opening
        try:
            self.conn.send(opening_msg)
            return await opening.future
        except asyncio.CancelledError:
            # The caller stopped waiting: a push opened meanwhile goes back.
            if (opening.future.done() and not opening.future.cancelled()
                    and opening.future.exception() is None):
                opening.future.result().abort()
            raise
        finally:
            self._opening.pop(req, None)

    async def push_bytes(self, req: str, peer: str | None, data: bytes | memoryview, *,
                         chunk: str | int | None = None,
                         deadline: float | None = None) -> PushResult:
        """Push a byte string as a one-layer request (one copy, into staging)."""
        push = await self.open(req, peer, RequestShape(1, len(data)), chunk=chunk,
                               deadline=deadline)
        push.layer(0)[:] = data
        push.commit(0)
        return await push.finish()

    @property
    def peers(self) -> list[str]:
        """The receivers the daemon is configured for."""
        welcome = self.conn.welcome
        if not isinstance(welcome, prefill_api.Welcome):
            return []
        return list(welcome.peers or [])

    def only_peer(self) -> str:
        """The one configured receiver; an error naming them when there are several."""
        if len(self.peers) != 1:
            raise UsageError(
                f"the sender daemon has {len(self.peers)} receivers configured, so a push "
                "must name one",
                hint=f"name one of: {', '.join(self.peers) or 'none (add one under [peers])'}")
        return self.peers[0]

    async def run(self, experiment: str, params: dict[str, Any],
                  on_message: Callable[[Message], None]) -> dict[str, Any]:
        """Run an experiment in the daemon; ``on_message`` sees its progress and rows."""
        req = f"run-{uuid.uuid4().hex[:12]}"
        run = _Run(on_message, asyncio.get_running_loop().create_future())
        self._runs[req] = run
        try:
            self.conn.send(prefill_api.Run(req=req, experiment=experiment, params=params))
            return await run.result
        finally:
            self._runs.pop(req, None)

    def _route(self, msg: Message) -> None:
        run = self._runs.get(getattr(msg, "req", ""))
        if run is not None:
            run.route(msg)
            return
        match msg:
            case prefill_api.Sent(req=req, layer=layer):
                if (push := self._pushes.get(req)) is not None:
                    push._sent(layer)
            case prefill_api.Opened():
                self._opened(msg)
            case Failed(req=req, error=wire_error):
                error = from_wire(wire_error)
                opening = self._opening.get(req)
                if opening is not None and not opening.future.done():
                    opening.future.set_exception(error)
                if (push := self._pushes.pop(req, None)) is not None:
                    push._failed(error)
            case prefill_api.Finished(req=req):
                if (push := self._pushes.pop(req, None)) is not None:
                    push._finished(msg)

    def _opened(self, msg: prefill_api.Opened) -> None:
        # The push exists from this message on, so a ``failed`` right behind
        # it (in the same read) finds it.
        opening = self._opening.get(msg.req)
        if opening is None or opening.future.done():
            self.conn.send(prefill_api.Abort(req=msg.req))  # nobody waits for it
            return
        push = OutgoingPush(self, msg.req, opening.shape, msg.offset, msg.chunk_bytes,
                            opening.started, msg.peer, msg.lease, opening.deadline)
        self._pushes[msg.req] = push
        opening.future.set_result(push)

    async def close(self) -> None:
        # Views of pushes still open lose their staging too: the daemon frees
        # it once this connection is gone.
        for push in self._pushes.values():
            push._retire(tell_daemon=False)
        if self._asking is not None:
            self._asking.cancel()  # their own waits still end them, typed
            with contextlib.suppress(asyncio.CancelledError):
                await self._asking
        await super().close()

    def _fail_all(self, error: KvwireError) -> None:
        for opening in self._opening.values():
            if not opening.future.done():
                opening.future.set_exception(error)
        # A push with every layer committed may have been delivered before the
        # daemon went: its successor asks the receiver, rather than this client
        # guessing and splitting the outcome with the decode engine.
        asking = [push for push in self._pushes.values() if push.fully_committed]
        for push in self._pushes.values():
            if not push.fully_committed:
                push._failed(error)
        self._pushes.clear()
        for run in self._runs.values():
            run.fail(error)
        if asking:
            self._asking = asyncio.ensure_future(self._ask_successor(asking, error))

    async def _ask_successor(self, pushes: list[OutgoingPush], error: KvwireError) -> None:
        """Reach the restarted daemon at the same socket and ask how each push
        ended; one not answered within its ``verdict_wait`` fails with ``error``."""
        loop = asyncio.get_running_loop()
        waiting = {push.req: push for push in pushes}
        answered = asyncio.Event()

        def give_up(push: OutgoingPush) -> None:
            if waiting.pop(push.req, None) is not None:
                push._failed(error)
            if not waiting:
                answered.set()

        def route(msg: Message) -> None:
            push = waiting.pop(getattr(msg, "req", ""), None)
            if push is None:
                return
            if isinstance(msg, prefill_api.Finished):
                push._finished(msg)
            elif isinstance(msg, Failed):
                push._failed(from_wire(msg.error))
            if not waiting:
                answered.set()

        for push in pushes:
            push._retire(tell_daemon=False)  # the daemon that shared that staging is gone
            loop.call_later(push.verdict_wait(), give_up, push)
        while waiting:
            conn = _Connection(self.conn.path, "prefill", SENDER_LOCAL, route,
                               lambda _: answered.set())
            try:
                await conn.open(map_pool=False)
            except (KvwireError, OSError):
                # Not back yet: systemd restarts it; try again shortly.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(answered.wait(), RECONNECT_EVERY)
                continue
            try:
                for push in waiting.values():
                    conn.send(prefill_api.Ask(req=push.req, peer=push.peer, lease=push.lease))
                await answered.wait()
            except KvwireError:
                pass  # it went away again: the loop reconnects
            finally:
                answered.clear()
                await conn.close()


class ReceiverClient(_LocalClient):
    """A decode engine's connection to its local receiver daemon."""

    def __init__(self, path: str) -> None:
        self.conn = _Connection(path, "decode", RECEIVER_LOCAL, self._route, self._fail_all)
        self._events: dict[str, asyncio.Queue[PushOpened | LayerLanded | Delivered
                                              | KvwireError]] = {}
        self._released: dict[str, asyncio.Future[None]] = {}

    @classmethod
    async def connect(cls, path: str | None = None) -> ReceiverClient:
        """Connect to the receiver daemon at ``path``; by default the socket named
        by ``$KVWIRE_RECEIVER_SOCKET``, else ``/run/kvwire/receiver.sock``."""
        client = cls(path or os.environ.get(RECEIVER_SOCKET_VARIABLE)
                     or DEFAULT_RECEIVER_SOCKET)
        await client.conn.open(map_pool=True)
        return client

    def subscribe(self, req: str, readers: int = 1) -> None:
        """Ask for the events of ``req`` (it need not be opened yet). ``readers``:
        the engines that read it, this one included (the ranks of a parallel
        engine sharing one push); the receiver frees it at the last release."""
        if req not in self._events:
            self._events[req] = asyncio.Queue()
            self.conn.send(decode_api.Subscribe(req=req,
                                                readers=readers if readers > 1 else None))

    @overload
    def events(self, req: str, readers: int = 1, *, opened: Literal[False] = False
               ) -> AsyncIterator[LayerLanded | Delivered]: ...

    @overload
    def events(self, req: str, readers: int = 1, *, opened: bool
               ) -> AsyncIterator[PushOpened | LayerLanded | Delivered]: ...

    async def events(self, req: str, readers: int = 1, *, opened: bool = False
                     ) -> AsyncIterator[PushOpened | LayerLanded | Delivered]:
        """Layer events of ``req`` in order, then its ``Delivered``; raises if it
        fails. ``opened``: first a ``PushOpened`` with the prefill engine's note."""
        self.subscribe(req, readers)
        queue = self._events[req]
        while True:
            event = await queue.get()
            if isinstance(event, PushOpened) and not opened:
                continue
            if isinstance(event, KvwireError):
                # The subscription ended with it (the daemon's rule too): asking
                # for the id again subscribes anew.
                if self._events.get(req) is queue:
                    del self._events[req]
                raise event
            yield event
            if isinstance(event, Delivered):
                return

    async def wait_delivered(self, req: str, timeout: float | None = None) -> Delivered:
        async with asyncio.timeout(timeout):
            async for event in self.events(req):
                if isinstance(event, Delivered):
                    return event
        raise AssertionError("unreachable: events() ends with Delivered")

    def view(self, event: Delivered | LayerLanded) -> memoryview:
        """The request's bytes in place in the receive pool (read-only): all of
        them once delivered; after a ``LayerLanded``, its landed layers."""
        assert self.conn.map is not None
        if event.offset is None or event.length is None:
            raise UsageError(f"the receiver did not say where request {event.req} lies",
                             hint="wait for Delivered (a daemon of an older release)")
        return memoryview(self.conn.map)[event.offset : event.offset + event.length]

    async def release(self, req: str) -> None:
        """Give the slot back; the data in it may be overwritten from now on."""
        await self._let_go(decode_api.Release(req=req))

    async def unsubscribe(self, req: str) -> None:
        """Stop holding ``req`` without releasing it: the receiver keeps it for
        another decode engine (reclaimed if none subscribes within its
        ``unclaimed_ttl``). Leaving without either frees it at once."""
        await self._let_go(decode_api.Unsubscribe(req=req))

    async def _let_go(self, msg: decode_api.Release | decode_api.Unsubscribe) -> None:
        req = msg.req
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._released[req] = future
        self.conn.send(msg)
        try:
            await future
        finally:
            self._released.pop(req, None)
            self._events.pop(req, None)

    def _route(self, msg: Message) -> None:
        match msg:
            case decode_api.Released(req=req) | decode_api.Unsubscribed(req=req):
                future = self._released.get(req)
                if future is not None and not future.done():
                    future.set_result(None)
            case Failed(req=req, error=error) if req in self._released:
                self._released[req].set_exception(from_wire(error))
            case decode_api.Opened(req=req, note=note):
                self._event(req, PushOpened(req, note))
            case decode_api.Layer(req=req, layer=layer, offset=offset, length=length):
                self._event(req, LayerLanded(req, layer, offset, length))
            case decode_api.Complete(req=req, offset=offset, length=length, layers=layers,
                                     checksum=checksum):
                self._event(req, Delivered(req, offset, length, layers, checksum))
            case Failed(req=req, error=error):
                self._event(req, from_wire(error))

    def _event(self, req: str, event: PushOpened | LayerLanded | Delivered | KvwireError
               ) -> None:
        if (queue := self._events.get(req)) is not None:
            queue.put_nowait(event)

    def _fail_all(self, error: KvwireError) -> None:
        for queue in self._events.values():
            queue.put_nowait(error)
        for future in self._released.values():
            if not future.done():
                future.set_exception(error)


# ------------------------------------------------------------ sync wrappers


class LoopThread:
    """An event loop on a daemon thread: the synchronous wrappers' and any
    caller's that drives clients from threads of its own (an engine's hooks)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="kvwire-client")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; its future, to wait for or cancel."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Any, *args: Any) -> Any:
        async def invoke() -> Any:
            return fn(*args)
        return self.run(invoke())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class SyncPush:
    def __init__(self, runner: LoopThread, push: OutgoingPush) -> None:
        self._runner, self._push = runner, push
        self.req, self.shape = push.req, push.shape

    def layer(self, n: int) -> memoryview:
        return self._push.layer(n)

    def commit(self, n: int) -> None:
        self._runner.call(self._push.commit, n)

    def wait_sent(self, n: int) -> None:
        self._runner.run(self._push.wait_sent(n))

    def finish(self) -> PushResult:
        return self._runner.run(self._push.finish())

    def abort(self) -> None:
        self._runner.call(self._push.abort)


class _SyncClient(Generic[C]):
    """A client driven from a thread of its own, for callers without an event loop."""

    def __init__(self, connect: Callable[[], Coroutine[Any, Any, C]]) -> None:
        self._runner = LoopThread()
        try:
            self._client: C = self._runner.run(connect())
        except BaseException:
            self._runner.stop()
            raise

    def close(self) -> None:
        self._runner.run(self._client.close())
        self._runner.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncSenderClient(_SyncClient[SenderClient]):
    def __init__(self, path: str | None = None) -> None:
        super().__init__(lambda: SenderClient.connect(path))

    def open(self, req: str, peer: str | None, shape: RequestShape | KVLayout, *,
             chunk: str | int | None = None, deadline: float | None = None,
             discard: bool = False, note: Mapping[str, Any] | None = None) -> SyncPush:
        push = self._runner.run(self._client.open(req, peer, shape, chunk=chunk,
                                                  deadline=deadline, discard=discard,
                                                  note=note))
        return SyncPush(self._runner, push)

    def push_bytes(self, req: str, peer: str | None, data: bytes, **kwargs: Any) -> PushResult:
        return self._runner.run(self._client.push_bytes(req, peer, data, **kwargs))

    @property
    def peers(self) -> list[str]:
        return self._client.peers


class SyncReceiverClient(_SyncClient[ReceiverClient]):
    def __init__(self, path: str | None = None) -> None:
        super().__init__(lambda: ReceiverClient.connect(path))

    def subscribe(self, req: str) -> None:
        self._runner.call(self._client.subscribe, req)

    def events(self, req: str) -> Iterator[LayerLanded | Delivered]:
        """Layer events of ``req`` in order, then its ``Delivered`` (blocking)."""
        stream = self._client.events(req)

        async def following() -> LayerLanded | Delivered | None:
            return await anext(stream, None)
        while True:
            event = self._runner.run(following())
            if event is None:
                return
            yield event
            if isinstance(event, Delivered):
                return

    def wait_delivered(self, req: str, timeout: float | None = None) -> Delivered:
        return self._runner.run(self._client.wait_delivered(req, timeout))

    def view(self, event: Delivered | LayerLanded) -> memoryview:
        return self._client.view(event)

    def release(self, req: str) -> None:
        self._runner.run(self._client.release(req))

    def unsubscribe(self, req: str) -> None:
        """Let go of ``req`` without releasing it: kept for another engine."""
        self._runner.run(self._client.unsubscribe(req))
