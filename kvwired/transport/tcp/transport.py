"""``TcpTransport``: the region, the data listener, and the sessions' tokens."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from ...errors import RemoteAccessError, TransportError
from ...pool import SharedMemory
from ..base import (
    Door,
    ErrorHandler,
    ImmediateHandler,
    Initiator,
    RemoteRegion,
    Responder,
    Transport,
)
from .channel import TcpInitiator
from .responder import ResponderProtocol, TcpResponder


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, listen_host: str = "0.0.0.0", data_port: int = 0,
                 listen: bool = False, per_lease_keys: bool = False,
                 door: Door | None = None) -> None:
        self.per_lease_keys = per_lease_keys
        self.door = door
        self._listen_host = listen_host
        self._data_port = data_port
        self._listen = listen
        self._memory: SharedMemory | None = None
        self._key = 0
        self._server: asyncio.Server | None = None
        self._expected: dict[bytes, TcpResponder] = {}

    @property
    def memory_view(self) -> memoryview:
        assert self._memory is not None, "transport not started"
        return self._memory.view

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def port(self) -> int:
        assert self._server is not None, "responder side not listening"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, memory: SharedMemory) -> None:
        self._memory = memory
        self._key = secrets.randbits(32)
        if self._listen:
            await self.listen()

    def describe(self) -> dict[str, Any]:
        if self._server is None:
            return {"transport": self.name}
        return {"transport": self.name, "data_port": self.port}

    @property
    def region(self) -> RemoteRegion:
        assert self._memory is not None, "transport not started"
        return RemoteRegion(self._key, self._memory.size)

    async def listen(self) -> None:
        """Bind the data listener (responder side only)."""
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: ResponderProtocol(self),
                self._listen_host,
                self._data_port,
                reuse_address=True,
            )
        except OSError as exc:
            raise TransportError(
                f"cannot listen for TCP data on {self._listen_host}:{self._data_port}: {exc}",
                hint="pick a free data_port in the receiver config",
            ) from exc

    def check_access(self, key: int, offset: int, length: int) -> None:
        # RemoteAccessError, as the per-lease check raises: the parser answers
        # exactly that with a NAK, so the initiator hears what an RNIC says.
        if key != self._key:
            raise RemoteAccessError(
                f"remote access error: write with unknown region key {key:#x}")
        if offset < 0 or length < 0 or offset + length > self.memory_view.nbytes:
            raise RemoteAccessError(
                f"remote access error: write of {length} B at {offset} is outside the "
                f"{self.memory_view.nbytes} B region"
            )

    def expect(self, token: bytes, responder: TcpResponder) -> None:
        self._expected[token] = responder

    def claim(self, token: bytes) -> TcpResponder | None:
        return self._expected.get(token)

    def forget(self, token: bytes) -> None:
        self._expected.pop(token, None)

    def initiator(self, local_host: str, rail: str = "") -> Initiator:
        return TcpInitiator(self)  # a stream follows the routes; rails are verbs devices

    def responder(
        self, local_host: str, on_immediate: ImmediateHandler, on_error: ErrorHandler
    ) -> Responder:
        return TcpResponder(self, local_host, on_immediate, on_error)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
