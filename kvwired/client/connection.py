"""An engine's connection to its local daemon: frames out, a reader task
routing frames in, the daemon's pool mapped; and what both clients share."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
from collections.abc import Callable
from typing import Self

from ..errors import DaemonUnavailable, KvwireError, from_wire
from ..localsock import connect_local
from ..pool import map_shared_fd
from ..protocol import Channel, Error, Message
from ..protocol import receiver_local as decode_api
from ..protocol import sender_local as prefill_api
from ..slot_maps import SlotMaps
from ..stream import MessageStream

DEFAULT_SENDER_SOCKET = "/run/kvwire/sender.sock"
DEFAULT_RECEIVER_SOCKET = "/run/kvwire/receiver.sock"
# Where an engine finds its daemon when it names no socket: these variables,
# then the paths the shipped units use.
SENDER_SOCKET_VARIABLE = "KVWIRE_SENDER_SOCKET"
RECEIVER_SOCKET_VARIABLE = "KVWIRE_RECEIVER_SOCKET"


class Connection:
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



class LocalClient:
    """What both engine clients share: their connection, ``close`` and ``async with``."""

    conn: Connection

    @property
    def broken(self) -> KvwireError | None:
        """Why the connection to the daemon ended; None while it is up."""
        return self.conn.broken

    async def close(self) -> None:
        await self.conn.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

