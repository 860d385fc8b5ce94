"""``SenderClient``: a prefill engine's connection to its local sender daemon."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import KvwireError, UsageError, from_wire
from ..layout import KVLayout, RequestShape, resolve_chunk_bytes
from ..protocol import MAX_SECONDS, SENDER_LOCAL, Failed, Message
from ..protocol import sender_local as prefill_api
from ..protocol.fields import NOTE, NOTE_CHECK, REQ, SHAPE
from .connection import DEFAULT_SENDER_SOCKET, SENDER_SOCKET_VARIABLE, Connection, LocalClient
from .push import OutgoingPush
from .recovery import ask_successor
from .results import PushResult


def check_request(req: str, shape: RequestShape) -> None:
    """What the daemon would refuse, said before anything is sent."""
    for name, field, value in (("req", REQ, req), ("shape", SHAPE, shape.to_wire())):
        if field.check is not None and (wrong := field.check(value)) is not None:
            raise UsageError(f"request {req[:64]!r} cannot be opened: {name} {wrong}",
                             hint="at most 1,024 layers of at most 1 TiB each, and a "
                                  "request id of 1 to 256 characters")


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



class SenderClient(LocalClient):
    """A prefill engine's connection to its local sender daemon."""

    def __init__(self, path: str) -> None:
        self.conn = Connection(path, "prefill", SENDER_LOCAL, self._route, self._fail_all)
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
        check_request(req, request_shape)
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
                    push.on_sent(layer)
            case prefill_api.Opened():
                self._opened(msg)
            case Failed(req=req, error=wire_error):
                error = from_wire(wire_error)
                opening = self._opening.get(req)
                if opening is not None and not opening.future.done():
                    opening.future.set_exception(error)
                if (push := self._pushes.pop(req, None)) is not None:
                    push.on_failed(error)
            case prefill_api.Finished(req=req):
                if (push := self._pushes.pop(req, None)) is not None:
                    push.on_finished(msg)

    def _opened(self, msg: prefill_api.Opened) -> None:
        # The push exists from this message on, so a ``failed`` right behind
        # it (in the same read) finds it.
        opening = self._opening.get(msg.req)
        if opening is None or opening.future.done():
            self.conn.send(prefill_api.Abort(req=msg.req))  # nobody waits for it
            return
        push = OutgoingPush(self.conn, msg.req, opening.shape, msg.offset, msg.chunk_bytes,
                            opening.started, msg.peer, msg.lease, opening.deadline)
        self._pushes[msg.req] = push
        opening.future.set_result(push)

    async def close(self) -> None:
        # Views of pushes still open lose their staging too: the daemon frees
        # it once this connection is gone.
        for push in self._pushes.values():
            push.retire(tell_daemon=False)
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
                push.on_failed(error)
        self._pushes.clear()
        for run in self._runs.values():
            run.fail(error)
        if asking:
            self._asking = asyncio.ensure_future(ask_successor(self.conn.path, asking, error))

