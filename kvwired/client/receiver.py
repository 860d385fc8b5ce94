"""``ReceiverClient``: a decode engine's connection to its local receiver daemon."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Literal, overload

from ..errors import KvwireError, UsageError, from_wire
from ..protocol import RECEIVER_LOCAL, Failed, Message
from ..protocol import receiver_local as decode_api
from .connection import DEFAULT_RECEIVER_SOCKET, RECEIVER_SOCKET_VARIABLE, Connection, LocalClient
from .results import Delivered, LayerLanded, PushOpened


class ReceiverClient(LocalClient):
    """A decode engine's connection to its local receiver daemon."""

    def __init__(self, path: str) -> None:
        self.conn = Connection(path, "decode", RECEIVER_LOCAL, self._route, self._fail_all)
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

