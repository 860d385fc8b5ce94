"""One-sided write semantics over a TCP stream: the baseline and the fallback.

The frames (a 32-byte header, the payload after a WRITE) and their one
decoder are in ``tcp_frames``, with no I/O; this module is the sockets.
The responder checks every write against what its key grants (a lease's
range on the receiver, the whole region on a sender answering an echo), as
an RDMA NIC checks an rkey against a memory window, and lands the payload in
the pool; a write outside is answered with a NAK (the initiator's remote
access error) and ends the connection. Until a connection presents its
session's token it holds a 16-byte buffer and nothing else, and the door
(``TransportOptions.door``) times it out, caps how many there are and counts
each refusal.
Large payloads are received straight into the pool with ``recv_into``; small
ones arrive through a bounce buffer and are copied, because for a 512 B
chunk a syscall costs far more than the copy. A signalled write is
acknowledged once placed, which is the initiator's completion.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import structlog

from ..errors import PeerLost, RemoteAccessError, TransportError
from ..pool import SharedMemory
from .base import (
    DataChannel,
    Door,
    ErrorHandler,
    ImmediateHandler,
    Initiator,
    RemoteRegion,
    Responder,
    Transport,
    Write,
)
from .tcp_frames import (
    FLAG_IMM,
    FLAG_SIGNALED,
    HEADER,
    TO_RESPONDER,
    TOKEN_BYTES,
    WRITE,
    AnswerDecoder,
    Op,
    decode_header,
    encode_answer,
    pack_header,
)

log = structlog.get_logger("kvwired.transport.tcp")

# Payloads at least this large are received directly into the pool.
DIRECT_THRESHOLD = 64 * 1024
BOUNCE_BYTES = 1 << 20
SEND_HIGH_WATER = 8 << 20


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class _ResponderProtocol(asyncio.BufferedProtocol):
    """Receives WRITE frames into the registered memory, once bound to a session."""

    def __init__(self, transport: TcpTransport) -> None:
        self._owner = transport
        # Before the token: room for the token alone, whatever the peer sends.
        self._token = bytearray(TOKEN_BYTES)
        self._token_got = 0
        self._bounce_view = memoryview(bytearray(0))
        self._start = 0
        self._end = 0
        self._responder: TcpResponder | None = None
        self._transport: asyncio.Transport | None = None
        # A large payload being received in place: (pool offset, bytes left).
        self._direct: tuple[int, int] | None = None
        self._direct_done: tuple[int, int, int] = (0, 0, 0)  # flags, imm, wr_id
        self._address = "?"
        self._admitted = False  # counted by the door until bound or gone
        self._refused = False  # refused and counted already
        self._expiry: asyncio.TimerHandle | None = None
        self._discarding = False  # a write was refused: the rest is dropped
        # The key of the write being received in place, and what waits for it
        # to end (a revocation: its bytes must not land after the slot is reused).
        self._direct_key: int | None = None
        self._after_direct: list[Callable[[], None]] = []
        # The last write was large: expect the next to be too (see get_buffer).
        self._large_writes = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        _tune(transport.get_extra_info("socket"))
        peer = transport.get_extra_info("peername")
        self._address = f"{peer[0]}:{peer[1]}" if peer else "?"
        door = self._owner.door
        if door is None:
            return
        if not door.admit(self._address):
            self._refused = True
            self._transport.abort()
            return
        self._admitted = True
        self._expiry = asyncio.get_running_loop().call_later(door.timeout, self._expire)

    def _settle(self) -> None:
        if self._admitted:
            self._admitted = False
            assert self._owner.door is not None
            self._owner.door.settled()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _refuse(self, reason: str, detail: str) -> None:
        self._settle()
        self._refused = True
        if self._owner.door is not None:
            self._owner.door.refuse(self._address, reason, detail)
        else:
            log.warning("data connection refused", address=self._address, reason=reason,
                        detail=detail)
        if self._transport is not None:
            self._transport.abort()

    def _expire(self) -> None:
        self._expiry = None
        if self._responder is None and not self._refused:
            door = self._owner.door
            self._refuse("timeout", f"no session token within {door.timeout if door else 0:g} s")

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._responder is None:
            return memoryview(self._token)[self._token_got:]
        if self._direct is not None:
            offset, left = self._direct
            return self._owner.memory_view[offset : offset + left]
        if self._discarding:
            return self._bounce_view
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end > BOUNCE_BYTES - DIRECT_THRESHOLD:
            # Keep the unparsed tail at the front so a header always fits.
            tail = self._end - self._start
            self._bounce_view[:tail] = self._bounce_view[self._start : self._end]
            self._start, self._end = 0, tail
        if self._large_writes and self._end - self._start < HEADER.size:
            # Large writes are coming: read the next header alone, so that
            # its payload is received in place rather than through the
            # bounce buffer and copied (half of each 2 MiB layer was, before).
            return self._bounce_view[self._end : self._start + HEADER.size]
        return self._bounce_view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._responder is None:
            self._token_got += nbytes
            if self._token_got == TOKEN_BYTES:
                self._bind(bytes(self._token))
            return
        if self._discarding:
            return
        try:
            if self._direct is not None:
                offset, left = self._direct
                left -= nbytes
                if left:
                    self._direct = (offset + nbytes, left)
                    return
                self._direct = None
                self._direct_key = None
                self._run_after_direct()
                self._finish_write(*self._direct_done)
                return
            self._end += nbytes
            self._parse()
        except TransportError as exc:
            self._fail(exc)

    def _parse(self) -> None:
        view = self._bounce_view
        memory = self._owner.memory_view
        assert self._responder is not None
        while self._end - self._start >= HEADER.size:
            _op, flags, rkey, imm, length, offset, wr_id = decode_header(
                view, self._start, TO_RESPONDER)
            try:
                self._responder.check_access(rkey, offset, length)
            except RemoteAccessError as exc:
                self._refuse_write(exc, wr_id)
                return
            body = self._start + HEADER.size
            available = self._end - body
            self._large_writes = length >= DIRECT_THRESHOLD
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
            self._direct_key = rkey
            return

    def when_write_under(self, key: int, then: Callable[[], None]) -> bool:
        """If a write under ``key`` is still landing, run ``then`` once it has."""
        if self._direct is None or self._direct_key != key:
            return False
        self._after_direct.append(then)
        return True

    def _run_after_direct(self) -> None:
        waiting, self._after_direct = self._after_direct, []
        for then in waiting:
            then()

    def _bind(self, token: bytes) -> None:
        responder = self._owner.claim(token)
        if responder is None:
            self._refuse("bad_token", "a data connection presented no live session's token")
            return
        self._settle()
        self._responder = responder
        self._bounce_view = memoryview(bytearray(BOUNCE_BYTES))
        responder.attached(self)

    def _refuse_write(self, error: RemoteAccessError, wr_id: int) -> None:
        """NAK the write (the initiator's remote access error), drop the rest, end."""
        log.warning("write refused", address=self._address, error=error.message)
        self._discarding = True
        self._bounce_view = memoryview(bytearray(64 * 1024))  # a sink
        if self._transport is not None:
            self._transport.write(encode_answer(Op.NAK, wr_id))
            self._transport.close()  # after the NAK is out
        if self._responder is not None:
            self._responder.on_error(error)

    def _finish_write(self, flags: int, imm: int, wr_id: int) -> None:
        assert self._responder is not None and self._transport is not None
        self._responder.writes_received += 1
        if flags & FLAG_SIGNALED:
            self._transport.write(encode_answer(Op.ACK, wr_id))
        if flags & FLAG_IMM:
            self._responder.on_immediate(imm)

    def _fail(self, exc: TransportError) -> None:
        log.warning("data connection failed", error=str(exc))
        if self._responder is not None:
            self._responder.on_error(exc)
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._direct = None
        self._run_after_direct()
        if self._responder is None and not self._refused and self._admitted:
            self._refuse("incomplete", f"closed before its token ({exc or 'end of stream'})")
        self._settle()
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
        # Every data connection that presented this session's token.
        self._protocols: list[_ResponderProtocol] = []
        self._token = b""
        self._closed = False
        self._grants: dict[int, tuple[int, int]] = {}  # key -> [start, end)
        # Recently revoked keys, to tell a late write from a forged one.
        self._revoked: dict[int, float] = {}

    async def grant(self, offset: int, length: int) -> int:
        while True:
            key = secrets.randbits(32)
            if key and key not in self._grants and key != self._owner.region.key:
                break
        self._grants[key] = (offset, offset + length)
        return key

    def revoke(self, key: int, then: Callable[[], None]) -> None:
        # Writes are checked as their headers are parsed, in this loop: once
        # the key is gone, no new write under it can land.
        if self._grants.pop(key, None) is not None:
            self._revoked[key] = time.monotonic()
            if len(self._revoked) > 1024:
                del self._revoked[next(iter(self._revoked))]
        # A large write checked against the key before it was revoked may
        # still be landing in place: the slot is free once it has.
        if any(protocol.when_write_under(key, then) for protocol in self._protocols):
            return
        then()

    def check_access(self, key: int, offset: int, length: int) -> None:
        if not self._owner.per_lease_keys:
            self._owner.check_access(key, offset, length)
            return
        span = self._grants.get(key)
        if span is None:
            revoked = self._revoked.get(key)
            raise RemoteAccessError(
                f"remote access error: a write of {length} B at {offset} under key {key:#x}, "
                + (f"revoked {(time.monotonic() - revoked) * 1e3:.1f} ms ago when its lease "
                   "ended" if revoked is not None else "never granted to this sender"))
        if offset < span[0] or length < 0 or offset + length > span[1]:
            raise RemoteAccessError(
                f"remote access error: a write of {length} B at {offset} is outside the "
                f"{span[1] - span[0]} B at {span[0]} its key grants")

    async def accept(self, offer: dict[str, Any]) -> dict[str, Any]:
        if not self._owner.listening:
            await self._owner.listen()  # a sender answering an echo channel
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._owner.expect(self._token, self)
        return {"host": self._host, "port": self._owner.port, "token": self._token,
                "region": self._owner.region.to_wire()}

    def attached(self, protocol: _ResponderProtocol) -> None:
        self._protocols.append(protocol)

    def on_error(self, exc: Exception) -> None:
        if not self._closed:
            self._closed = True
            self._on_error(exc)

    def close(self) -> None:
        self._closed = True
        self._grants.clear()
        self._owner.forget(self._token)
        for protocol in self._protocols:
            protocol.close()


class _InitiatorProtocol(asyncio.Protocol):
    """Sends WRITE frames, resolves completions from ACKs."""

    def __init__(self, channel: TcpDataChannel) -> None:
        self._channel = channel
        self._answers = AnswerDecoder()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _tune(transport.get_extra_info("socket"))

    def data_received(self, data: bytes) -> None:
        self._answers.feed(data)
        try:
            while (answer := self._answers.next_answer()) is not None:
                if answer.op == Op.NAK:
                    self._channel.fail(RemoteAccessError(
                        "remote access error: the receiver refused a write outside every "
                        "range it granted this sender"))
                    return
                self._channel.completed(answer.wr_id)
        except TransportError as exc:
            self._channel.fail(exc)

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
        self._queue: deque[tuple[Sequence[Write], int | None, int | None,
                                 asyncio.Future[None]]] = deque()
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

    def post(self, writes: Sequence[Write], imm: int | None = None,
             key: int | None = None) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._error is not None:
            future.set_exception(self._error)
        else:
            self._posting()
            self._queue.append((writes, imm, key, future))
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
            writes, imm, key, future = self._queue.popleft()
            self._transport.writelines(self._frames(writes, imm, key, future))

    def _frames(
        self, writes: Sequence[Write], imm: int | None, key: int | None,
        future: asyncio.Future[None],
    ) -> list[bytes | memoryview]:
        key = self._remote.key if key is None else key
        memory = self._memory
        pack = pack_header
        frames: list[bytes | memoryview] = []
        last = len(writes) - 1
        wr_id = self._next_wr_id
        self._next_wr_id += 1
        self._inflight[wr_id] = future
        self._writes_of[wr_id] = len(writes)
        for i, w in enumerate(writes):
            if i == last:
                flags = FLAG_SIGNALED | (FLAG_IMM if imm is not None else 0)
                frames.append(pack(WRITE, flags, key, imm or 0, w.length, w.remote_offset,
                                   wr_id))
            else:
                frames.append(pack(WRITE, 0, key, 0, w.length, w.remote_offset, 0))
            frames.append(memory[w.local_offset : w.local_offset + w.length])
        return frames

    def completed(self, wr_id: int) -> None:
        self._progressed()
        self._pending -= self._writes_of.pop(wr_id, 0)
        future = self._inflight.pop(wr_id, None)
        if future is not None and not future.done():
            future.set_result(None)

    def _take_outstanding(self) -> list[asyncio.Future[None]]:
        self._pending = 0
        # The pump waits on these; it sees the error and ends.
        self.writable.set()
        self._wakeup.set()
        pending = list(self._inflight.values()) + [f for *_, f in self._queue]
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
