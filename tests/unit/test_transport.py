"""One suite for every data path: the contract of ``kvwired.transport.base``.

Each test runs over ``tcp`` (anywhere) and ``verbs`` (where an RDMA device
with a RoCE v2 address exists: in the lab, ``test_lab.py`` runs this module
inside a node over real rdma_rxe). A transport passes when its initiator and
responder, connected through the same offer/answer exchange the daemons use,
keep the one-sided write semantics the daemons rely on.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvwired.errors import RemoteAccessError, TransportError
from kvwired.pool import SharedMemory
from kvwired.rdma import ROCE_V2, gid_table, rdma_available
from kvwired.transport import TransportOptions, make_transport
from kvwired.transport.base import DataChannel, Responder, Transport, Write

from ..conftest import until

SIZE = 8 << 20


def roce_address() -> str | None:
    """An IPv4 address this host holds a RoCE v2 GID for, if any."""
    if not rdma_available():
        return None
    for entry in gid_table():
        if entry.type == ROCE_V2 and entry.ipv4:
            return entry.ipv4
    return None


def _wrong_key(name: str) -> Callable[[dict[str, Any]], None]:
    def tcp(answer: dict[str, Any]) -> None:
        answer["region"] = {**answer["region"], "key": answer["region"]["key"] ^ 0x5A5A}

    def verbs(answer: dict[str, Any]) -> None:
        answer["rkey"] = answer["rkey"] ^ 0x5A5A

    return tcp if name == "tcp" else verbs


@dataclass
class Pair:
    """An initiator's and a responder's transport, each with its own memory."""

    name: str
    host: str
    src_memory: SharedMemory = field(default_factory=lambda: SharedMemory(SIZE, "src"))
    dst_memory: SharedMemory = field(default_factory=lambda: SharedMemory(SIZE, "dst"))
    immediates: list[int] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)
    transports: list[Transport] = field(default_factory=list)

    responder: Responder | None = None

    async def start(self, per_lease_keys: bool = False) -> tuple[Transport, Transport]:
        """An initiator's and a responder's transport, started on their memories."""
        src = make_transport(TransportOptions(name=self.name))
        dst = make_transport(TransportOptions(name=self.name, listen_host=self.host,
                                              listen_at_start=True, receive_depth=256,
                                              per_lease_keys=per_lease_keys))
        self.transports += [src, dst]
        await src.start(self.src_memory)
        await dst.start(self.dst_memory)
        return src, dst

    async def session(self, src: Transport, dst: Transport,
                      tamper: Callable[[dict[str, Any]], None] | None = None
                      ) -> tuple[DataChannel, Responder]:
        """One connection between them, through the daemons' offer/answer exchange."""
        responder = dst.responder(self.host, self.immediates.append, self.errors.append)
        initiator = src.initiator(self.host)
        answer = await responder.accept(await initiator.offer())
        if tamper is not None:
            tamper(answer)
        return await initiator.complete(answer), responder

    async def connect(self, tamper: Callable[[dict[str, Any]], None] | None = None,
                      per_lease_keys: bool = False) -> DataChannel:
        channel, self.responder = await self.session(*await self.start(per_lease_keys),
                                                     tamper)
        return channel

    async def revoke(self, key: int) -> None:
        assert self.responder is not None
        revoked = asyncio.Event()
        self.responder.revoke(key, revoked.set)
        await asyncio.wait_for(revoked.wait(), 10)

    async def close(self) -> None:
        for transport in self.transports:
            await transport.stop()
        self.src_memory.close()
        self.dst_memory.close()


def _params() -> list[Any]:
    verbs_host = roce_address()
    return ["tcp", pytest.param("verbs", marks=pytest.mark.skipif(
        verbs_host is None, reason="no RDMA device with a RoCE v2 address here "
        "(test_lab.py runs this suite over rdma_rxe inside a lab node)"))]


@pytest.fixture(params=_params())
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    name = request.param
    host = "127.0.0.1" if name == "tcp" else roce_address()
    assert host is not None
    p = Pair(name, host)
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
    await asyncio.wait_for(channel.post(writes, imm=42), 30)
    # The completion means placed: the bytes are there now, not eventually.
    assert pair.dst_memory.view[remote_base : remote_base + len(payload)] == payload
    await until(lambda: pair.immediates == [42])
    channel.close()


async def test_large_and_small_writes_mixed_land_byte_exact(pair: Pair) -> None:
    # Sizes around the TCP responder's switch between its bounce buffer and
    # receiving in place (64 KiB), and its header-alone read after a large write.
    sizes = [100_000, 512, 70_000, 32, 2 << 20, 1, 65536, 65535, 65537, 12288, 1 << 20, 7]
    channel = await pair.connect()
    payload = os.urandom(sum(sizes))
    pair.src_memory.view[: len(payload)] = payload
    offsets = [sum(sizes[:n]) for n in range(len(sizes))]
    posts = [channel.post([Write(o, o, size)], imm=n)
             for n, (o, size) in enumerate(zip(offsets, sizes, strict=True))]
    # Two writes per post too: a large one behind a small one.
    posts.append(channel.post([Write(0, SIZE // 2, 16), Write(16, SIZE // 2 + 16, 300_000)],
                              imm=99))
    await asyncio.wait_for(asyncio.gather(*posts), 30)
    assert pair.dst_memory.view[: len(payload)] == payload
    assert pair.dst_memory.view[SIZE // 2 : SIZE // 2 + 300_016] == payload[:300_016]
    await until(lambda: len(pair.immediates) == len(sizes) + 1)
    channel.close()


async def test_posts_complete_in_order_with_their_immediates(pair: Pair) -> None:
    channel = await pair.connect()
    futures = [channel.post([Write(i * 1024, i * 1024, 1024)], imm=i) for i in range(200)]
    await asyncio.wait_for(asyncio.gather(*futures), 30)
    await until(lambda: len(pair.immediates) == 200)
    assert pair.immediates == list(range(200))
    channel.close()


async def test_a_write_larger_than_one_message_lands_whole(pair: Pair) -> None:
    # verbs splits writes above the port's max_msg_sz (8 MiB on rxe); the
    # region is 8 MiB, so the whole of it goes in one write.
    channel = await pair.connect()
    payload = os.urandom(SIZE)
    pair.src_memory.view[:] = payload
    await asyncio.wait_for(channel.post([Write(0, 0, SIZE)], imm=7), 60)
    assert pair.dst_memory.view[:] == payload
    channel.close()


async def test_write_outside_the_region_fails_and_lands_nothing(pair: Pair) -> None:
    channel = await pair.connect()
    pair.src_memory.view[:4096] = b"x" * 4096
    before = bytes(pair.dst_memory.view[SIZE - 4096 :])
    with pytest.raises(TransportError) as refused:
        await asyncio.wait_for(channel.post([Write(0, SIZE - 100, 4096)]), 10)
    assert bytes(pair.dst_memory.view[SIZE - 4096 :]) == before
    if pair.name == "tcp":
        assert isinstance(refused.value, RemoteAccessError)  # the NAK, as an RNIC answers
        # The responder checks bounds itself (an RNIC does it in hardware, and
        # verbs refuses the post before it reaches the wire): it fails its end
        # too, and the initiator's channel dies with it.
        await until(lambda: bool(pair.errors))
        assert "outside" in str(pair.errors[0])
        assert not channel.alive


async def test_write_with_a_wrong_region_key_is_a_remote_access_error(pair: Pair) -> None:
    channel = await pair.connect(_wrong_key(pair.name))
    pair.src_memory.view[:64] = b"k" * 64
    with pytest.raises(RemoteAccessError):
        await asyncio.wait_for(channel.post([Write(0, 0, 64)]), 30)
    assert bytes(pair.dst_memory.view[:64]) == b"\0" * 64
    assert not channel.alive


async def test_a_closed_channel_fails_new_posts_at_once(pair: Pair) -> None:
    channel = await pair.connect()
    await asyncio.wait_for(channel.post([Write(0, 0, 64)], imm=1), 10)
    channel.close()
    assert not channel.alive
    with pytest.raises(TransportError, match="closed"):
        await asyncio.wait_for(channel.post([Write(0, 0, 1)]), 1)
    assert pair.errors == []  # a close on purpose is not a failure


# Per-lease keys (the receiver's pool): memory windows over verbs, granted
# ranges over TCP. A key grants its range, nothing else, until revoked.

async def test_a_lease_key_grants_its_range_until_revoked(pair: Pair) -> None:
    channel = await pair.connect(per_lease_keys=True)
    assert pair.responder is not None
    key = await pair.responder.grant(8192, 16384)
    payload = os.urandom(16384)
    pair.src_memory.view[:16384] = payload
    await asyncio.wait_for(channel.post([Write(0, 8192, 16384)], imm=3, key=key), 10)
    assert bytes(pair.dst_memory.view[8192:24576]) == payload
    await pair.revoke(key)
    pair.src_memory.view[:64] = b"L" * 64
    with pytest.raises(RemoteAccessError):
        await asyncio.wait_for(channel.post([Write(0, 8192, 64)], key=key), 30)
    assert bytes(pair.dst_memory.view[8192:24576]) == payload  # the late write landed nowhere
    assert not channel.alive


async def test_a_lease_key_refuses_a_write_past_its_range(pair: Pair) -> None:
    channel = await pair.connect(per_lease_keys=True)
    assert pair.responder is not None
    key = await pair.responder.grant(8192, 4096)
    pair.src_memory.view[:8192] = b"P" * 8192
    with pytest.raises(RemoteAccessError):
        await asyncio.wait_for(channel.post([Write(0, 8192, 8192)], key=key), 30)
    assert bytes(pair.dst_memory.view[12288:16384]) == b"\0" * 4096


async def test_with_lease_keys_the_region_key_writes_nothing(pair: Pair) -> None:
    channel = await pair.connect(per_lease_keys=True)
    assert pair.responder is not None
    await pair.responder.grant(0, 4096)  # a live lease does not open the region
    pair.src_memory.view[:64] = b"R" * 64
    with pytest.raises(RemoteAccessError):
        await asyncio.wait_for(channel.post([Write(0, 0, 64)]), 30)
    assert bytes(pair.dst_memory.view[:64]) == b"\0" * 64


async def test_lease_keys_are_fresh_across_grants_of_one_range(pair: Pair) -> None:
    channel = await pair.connect(per_lease_keys=True)
    assert pair.responder is not None
    keys = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(100):
        key = await pair.responder.grant(0, 2 << 20)
        keys.append(key)
        await pair.revoke(key)
    per_lease = (loop.time() - started) / 100
    print(f"{pair.name}: grant + revoke {per_lease * 1e6:.0f} us per lease")
    assert len(set(keys)) == 100  # a revoked key never comes back soon
    current = await pair.responder.grant(0, 2 << 20)
    pair.src_memory.view[:64] = b"F" * 64
    await asyncio.wait_for(channel.post([Write(0, 0, 64)], key=current), 10)
    assert bytes(pair.dst_memory.view[:64]) == b"F" * 64


async def test_a_lease_key_answers_only_to_its_own_connection(pair: Pair) -> None:
    """Two initiators of one responder transport (two sessions): a key granted
    to one is refused on the other's connection, as a leaked key would be."""
    src, dst = await pair.start(per_lease_keys=True)
    channels, responders = [], []
    for _ in range(2):
        channel, responder = await pair.session(src, dst)
        channels.append(channel)
        responders.append(responder)
    mine = await responders[0].grant(0, 4096)
    pair.src_memory.view[:64] = b"O" * 64
    await asyncio.wait_for(channels[0].post([Write(0, 0, 64)], key=mine), 10)
    pair.src_memory.view[:64] = b"X" * 64
    with pytest.raises(RemoteAccessError):
        await asyncio.wait_for(channels[1].post([Write(0, 0, 64)], key=mine), 30)
    assert bytes(pair.dst_memory.view[:64]) == b"O" * 64
    for channel, responder in zip(channels, responders, strict=True):
        channel.close()
        responder.close()
