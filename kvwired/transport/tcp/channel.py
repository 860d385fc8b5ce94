"""The initiator's end: a stream whose pump sends WRITE frames in post order,
and whose ACKs are the completions."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from ...errors import PeerLost, RemoteAccessError, TransportError
from ..base import DataChannel, Initiator, RemoteRegion, Write
from .frames import FLAG_IMM, FLAG_SIGNALED, WRITE, AnswerDecoder, Op, pack_header
from .socket_options import tune

SEND_HIGH_WATER = 8 << 20


class Memory(Protocol):
    """The transport, as an initiator sees it: the memory its writes come from."""

    @property
    def memory_view(self) -> memoryview: ...


class InitiatorProtocol(asyncio.Protocol):
    """Sends WRITE frames, resolves completions from ACKs."""

    def __init__(self, channel: TcpDataChannel) -> None:
        self._channel = channel
        self._answers = AnswerDecoder()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tune(transport.get_extra_info("socket"))

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
                loop.create_connection(lambda: InitiatorProtocol(self), host, port), 10
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
    def __init__(self, owner: Memory) -> None:
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

