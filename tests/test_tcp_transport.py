from __future__ import annotations

import asyncio
import os

import pytest

from kvwired.errors import TransportError
from kvwired.pool import SharedMemory
from kvwired.transport.base import RemoteRegion, Write
from kvwired.transport.tcp import TcpTransport

SIZE = 8 << 20


class Pair:
    def __init__(self) -> None:
        self.src_memory = SharedMemory(SIZE, "src")
        self.dst_memory = SharedMemory(SIZE, "dst")
        self.src = TcpTransport()
        self.dst = TcpTransport("127.0.0.1", 0)
        self.immediates: list[int] = []
        self.errors: list[Exception] = []

    async def connect(self, region: RemoteRegion | None = None):  # type: ignore[no-untyped-def]
        await self.src.start(self.src_memory)
        await self.dst.start(self.dst_memory)
        await self.dst.listen()
        responder = self.dst.responder("127.0.0.1", self.immediates.append, self.errors.append)
        initiator = self.src.initiator("127.0.0.1")
        answer = await responder.accept(await initiator.offer())
        if region is not None:
            answer["region"] = region.to_wire()
        return await initiator.complete(answer)

    async def close(self) -> None:
        await self.dst.stop()
        self.src_memory.close()
        self.dst_memory.close()


@pytest.fixture
async def pair():  # type: ignore[no-untyped-def]
    p = Pair()
    yield p
    await p.close()


@pytest.mark.parametrize("chunk", [512, 12288, 100_000, 2 << 20])
async def test_writes_land_byte_exact_at_remote_offsets(pair: Pair, chunk: int) -> None:
    channel = await pair.connect()
    payload = os.urandom(3 << 20)
    pair.src_memory.view[: len(payload)] = payload
    remote_base = 4096 * 3
    writes = [Write(o, remote_base + o, min(chunk, len(payload) - o))
              for o in range(0, len(payload), chunk)]
    await asyncio.wait_for(channel.post(writes, imm=42), 10)
    # The completion means placed: the bytes are there now, not eventually.
    assert pair.dst_memory.view[remote_base : remote_base + len(payload)] == payload
    assert pair.immediates == [42]
    channel.close()


async def test_posts_complete_in_order_with_their_immediates(pair: Pair) -> None:
    channel = await pair.connect()
    futures = [channel.post([Write(i * 1024, i * 1024, 1024)], imm=i) for i in range(200)]
    await asyncio.wait_for(asyncio.gather(*futures), 10)
    assert pair.immediates == list(range(200))
    channel.close()


async def test_write_outside_the_region_fails_both_ends(pair: Pair) -> None:
    channel = await pair.connect()
    with pytest.raises(TransportError):
        await asyncio.wait_for(channel.post([Write(0, SIZE - 100, 4096)]), 10)
    for _ in range(50):
        if pair.errors:
            break
        await asyncio.sleep(0.02)
    assert "outside" in str(pair.errors[0])
    assert not channel.alive
    # A dead channel fails new posts at once instead of hanging.
    with pytest.raises(TransportError):
        await asyncio.wait_for(channel.post([Write(0, 0, 1)]), 1)


async def test_write_with_wrong_region_key_is_a_remote_access_error(pair: Pair) -> None:
    channel = await pair.connect(RemoteRegion(key=1234, size=SIZE))
    with pytest.raises(TransportError):
        await asyncio.wait_for(channel.post([Write(0, 0, 64)]), 10)
    for _ in range(50):
        if pair.errors:
            break
        await asyncio.sleep(0.02)
    assert "unknown region key" in str(pair.errors[0])
