"""One-sided write semantics over a TCP stream: the baseline and the fallback.

Wire format (little-endian, 32-byte header, payload follows a WRITE):

    op u8 | flags u8 | pad u16 | rkey u32 | imm u32 | length u32 | offset u64 | wr_id u64

The responder checks every write against its registered region (key and
bounds, like an RDMA NIC checks an rkey) and lands the payload in the pool.
Large payloads are received straight into the pool with ``recv_into``; small
ones arrive through a bounce buffer and are copied, because for a 512 B
chunk a syscall costs far more than the copy. A signalled write is
acknowledged once placed, which is the initiator's completion.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import structlog

from ..errors import PeerLost, TransportError
from ..pool import SharedMemory
from .base import (
    DataChannel,
    ErrorHandler,
    ImmediateHandler,
    Initiator,
    RemoteRegion,
    Responder,
    Transport,
    Write,
)

log = structlog.get_logger("kvwired.transport.tcp")

HEADER = struct.Struct("<BBxxIIIQQ")
OP_WRITE = 1
OP_ACK = 2
FLAG_SIGNALED = 1
FLAG_IMM = 2
TOKEN_BYTES = 16
# Payloads at least this large are received directly into the pool.
DIRECT_THRESHOLD = 64 * 1024
BOUNCE_BYTES = 1 << 20
SEND_HIGH_WATER = 8 << 20


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class _ResponderProtocol(asyncio.BufferedProtocol):
    """Receives WRITE frames into the registered memory."""

    def __init__(self, transport: TcpTransport) -> None:
        self._owner = transport
        self._bounce = bytearray(BOUNCE_BYTES)
        self._bounce_view = memoryview(self._bounce)
        self._start = 0
        self._end = 0
        self._responder: TcpResponder | None = None
        self._transport: asyncio.Transport | None = None
        # A large payload being received in place: (pool offset, bytes left).
        self._direct: tuple[int, int] | None = None
        self._direct_done: tuple[int, int, int] = (0, 0, 0)  # flags, imm, wr_id

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        _tune(transport.get_extra_info("socket"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None:
            offset, left = self._direct
            return self._owner.memory_view[offset : offset + left]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end > BOUNCE_BYTES - DIRECT_THRESHOLD:
            # Keep the unparsed tail at the front so a header always fits.
            tail = self._end - self._start
            self._bounce_view[:tail] = self._bounce_view[self._start : self._end]
            self._start, self._end = 0, tail
        return self._bounce_view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._direct is not None:
                offset, left = self._direct
                left -= nbytes
                if left:
                    self._direct = (offset + nbytes, left)
                    return
                self._direct = None
                self._finish_write(*self._direct_done)
                return
            self._end += nbytes
            self._parse()
        except TransportError as exc:
            self._fail(exc)

    def _parse(self) -> None:
        view = self._bounce_view
        memory = self._owner.memory_view
        if self._responder is None:
            if self._end - self._start < TOKEN_BYTES:
                return
            self._bind(bytes(view[self._start : self._start + TOKEN_BYTES]))
            self._start += TOKEN_BYTES
        while self._end - self._start >= HEADER.size:
            op, flags, rkey, imm, length, offset, wr_id = HEADER.unpack_from(view, self._start)
            if op != OP_WRITE:
                raise TransportError(f"unexpected data-path opcode {op}")
            self._owner.check_access(rkey, offset, length)
            body = self._start + HEADER.size
            available = self._end - body
            if available >= length:
                memory[offset : offset + length] = view[body : body + length]
                self._start = body + length
                self._finish_write(flags, imm, wr_id)
                continue
            if length < DIRECT_THRESHOLD:
                return  # wait for the rest of a small frame in the bounce buffer
            memory[offset : offset + available] = view[body : self._end]
            self._start = self._end
            self._direct = (offset + available, length - available)
            self._direct_done = (flags, imm, wr_id)
            return

    def _bind(self, token: bytes) -> None:
        responder = self._owner.claim(token)
        if responder is None:
            raise TransportError("data connection presented an unknown token")
        self._responder = responder
        responder.attached(self)

    def _finish_write(self, flags: int, imm: int, wr_id: int) -> None:
        assert self._responder is not None and self._transport is not None
        self._responder.writes_received += 1
        if flags & FLAG_SIGNALED:
            self._transport.write(HEADER.pack(OP_ACK, 0, 0, 0, 0, 0, wr_id))
        if flags & FLAG_IMM:
            self._responder.on_immediate(imm)

    def _fail(self, exc: TransportError) -> None:
        log.warning("data connection failed", error=str(exc))
        if self._responder is not None:
            self._responder.on_error(exc)
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._responder is not None:
            self._responder.on_error(
                PeerLost(f"incoming data connection closed ({exc or 'end of stream'})")
            )

    def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()


class TcpResponder(Responder):
    def __init__(
        self,
        owner: TcpTransport,
        advertise_host: str,
        on_immediate: ImmediateHandler,
        on_error: ErrorHandler,
    ) -> None:
        self._owner = owner
        self._host = advertise_host
        self.on_immediate = on_immediate
        self._on_error = on_error
        self._protocol: _ResponderProtocol | None = None
        self._token = b""
        self._closed = False

    async def accept(self, offer: dict[str, Any]) -> dict[str, Any]:
        if not self._owner.listening:
            await self._owner.listen()  # a sender answering an echo channel
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._owner.expect(self._token, self)
        return {"host": self._host, "port": self._owner.port, "token": self._token,
                "region": self._owner.region.to_wire()}

    def attached(self, protocol: _ResponderProtocol) -> None:
        self._protocol = protocol

    def on_error(self, exc: Exception) -> None:
        if not self._closed:
            self._closed = True
            self._on_error(exc)

    def close(self) -> None:
        self._closed = True
        self._owner.forget(self._token)
        if self._protocol is not None:
            self._protocol.close()


class _InitiatorProtocol(asyncio.Protocol):
    """Sends WRITE frames, resolves completions from ACKs."""

    def __init__(self, channel: TcpDataChannel) -> None:
        self._channel = channel
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _tune(transport.get_extra_info("socket"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        usable = len(self._buffer) - len(self._buffer) % HEADER.size
        for start in range(0, usable, HEADER.size):
            op, *_, wr_id = HEADER.unpack_from(self._buffer, start)
            if op != OP_ACK:
                self._channel.fail(TransportError(f"unexpected data-path opcode {op}"))
                return
            self._channel.completed(wr_id)
        del self._buffer[:usable]

    def pause_writing(self) -> None:
        self._channel.writable.clear()

    def resume_writing(self) -> None:
        self._channel.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._channel.fail(
            PeerLost(f"outgoing data connection closed ({exc or 'end of stream'})")
        )


class TcpDataChannel(DataChannel):
    kind = "tcp"

    def __init__(self, memory: memoryview, remote: RemoteRegion) -> None:
        self._memory = memory
        self._remote = remote
        self._transport: asyncio.Transport | None = None
        self._queue: deque[tuple[Sequence[Write], int | None, asyncio.Future[None]]] = deque()
        self._inflight: dict[int, asyncio.Future[None]] = {}
        self._pending = 0  # writes posted and not yet acknowledged
        self._writes_of: dict[int, int] = {}
        self._next_wr_id = 1
        self._error: TransportError | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self._wakeup = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None

    async def connect(self, host: str, port: int, token: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: _InitiatorProtocol(self), host, port), 10
            )
        except (OSError, TimeoutError) as exc:
            raise PeerLost(f"cannot open the data connection to {host}:{port}: {exc}") from exc
        self._transport = transport  # uvloop's transports do not subclass asyncio's
        self._transport.set_write_buffer_limits(high=SEND_HIGH_WATER)
        self._transport.write(token)
        self._pump = asyncio.create_task(self._run_pump(), name="tcp-data-pump")

    @property
    def alive(self) -> bool:
        return self._error is None and self._transport is not None

    def post(self, writes: Sequence[Write], imm: int | None = None) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._error is not None:
            future.set_exception(self._error)
        else:
            self._queue.append((writes, imm, future))
            self._pending += len(writes)
            self._wakeup.set()
        return future

    @property
    def pending_writes(self) -> int:
        return self._pending

    async def _run_pump(self) -> None:
        # One pump keeps posts in order on the wire even while the socket
        # buffer is full, the way a send queue would.
        while self._error is None:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self.writable.wait()
            if self._error is not None or self._transport is None:
                return
            writes, imm, future = self._queue.popleft()
            self._transport.writelines(self._frames(writes, imm, future))

    def _frames(
        self, writes: Sequence[Write], imm: int | None, future: asyncio.Future[None]
    ) -> list[bytes | memoryview]:
        key = self._remote.key
        memory = self._memory
        pack = HEADER.pack
        frames: list[bytes | memoryview] = []
        last = len(writes) - 1
        wr_id = self._next_wr_id
        self._next_wr_id += 1
        self._inflight[wr_id] = future
        self._writes_of[wr_id] = len(writes)
        for i, w in enumerate(writes):
            if i == last:
                flags = FLAG_SIGNALED | (FLAG_IMM if imm is not None else 0)
                frames.append(
                    pack(OP_WRITE, flags, key, imm or 0, w.length, w.remote_offset, wr_id)
                )
            else:
                frames.append(pack(OP_WRITE, 0, key, 0, w.length, w.remote_offset, 0))
            frames.append(memory[w.local_offset : w.local_offset + w.length])
        return frames

    def completed(self, wr_id: int) -> None:
        self._pending -= self._writes_of.pop(wr_id, 0)
        future = self._inflight.pop(wr_id, None)
        if future is not None and not future.done():
            future.set_result(None)

    def _take_outstanding(self) -> list[asyncio.Future[None]]:
        self._pending = 0
        # The pump waits on these; it sees the error and ends.
        self.writable.set()
        self._wakeup.set()
        pending = list(self._inflight.values()) + [f for _, _, f in self._queue]
        self._inflight.clear()
        self._queue.clear()
        return pending

    def _tear_down(self) -> None:
        if self._transport is not None:
            self._transport.abort()


class TcpInitiator(Initiator):
    def __init__(self, owner: TcpTransport) -> None:
        self._owner = owner

    async def offer(self) -> dict[str, Any]:
        return {}

    def abandon(self) -> None:
        pass  # the TCP data connection is only made in complete()

    async def complete(self, answer: dict[str, Any]) -> DataChannel:
        try:
            host, port, token = str(answer["host"]), int(answer["port"]), bytes(answer["token"])
            remote = RemoteRegion.from_wire(answer["region"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"receiver sent unusable TCP parameters: {answer!r}") from exc
        channel = TcpDataChannel(self._owner.memory_view, remote)
        await channel.connect(host, port, token)
        return channel


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, listen_host: str = "0.0.0.0", data_port: int = 0,
                 listen: bool = False) -> None:
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
                lambda: _ResponderProtocol(self),
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
        if key != self._key:
            raise TransportError(f"remote access error: write with unknown region key {key:#x}")
        if offset < 0 or length < 0 or offset + length > self.memory_view.nbytes:
            raise TransportError(
                f"remote access error: write of {length} B at {offset} is outside the "
                f"{self.memory_view.nbytes} B region"
            )

    def expect(self, token: bytes, responder: TcpResponder) -> None:
        self._expected[token] = responder

    def claim(self, token: bytes) -> TcpResponder | None:
        return self._expected.get(token)

    def forget(self, token: bytes) -> None:
        self._expected.pop(token, None)

    def initiator(self, local_host: str) -> Initiator:
        return TcpInitiator(self)

    def responder(
        self, local_host: str, on_immediate: ImmediateHandler, on_error: ErrorHandler
    ) -> Responder:
        return TcpResponder(self, local_host, on_immediate, on_error)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
