"""Per-lease keys on the data path (TCP here; the lab runs the same attacks
over verbs memory windows): an authenticated sender can write only into its
own live leases. Every attack is checked against the victim's bytes, which
must be what its prefill engine wrote, and its push, which must deliver."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from kvwired import checksum, immediate
from kvwired.client import ReceiverClient, SenderClient
from kvwired.layout import RequestShape
from kvwired.protocol import CONTROL, FrameDecoder, RawMessage, encode, message
from kvwired.transport.tcp.frames import FLAG_IMM, FLAG_SIGNALED, HEADER, Op, encode_write

from ..conftest import LocalDaemons, until

VICTIM = os.urandom(4 << 20)


@dataclass
class Rogue:
    """An authenticated sender that speaks the protocol by hand."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    decoder: FrameDecoder
    ready: RawMessage
    data: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def next(self) -> RawMessage:
        """The next frame's map, as the adversary sees it."""
        while (msg := self.decoder.next_message()) is None:
            data = await asyncio.wait_for(self.reader.read(65536), 10)
            assert data, "the receiver hung up"
            self.decoder.feed(data)
        return msg.to_wire()

    async def answer(self, kind: str) -> RawMessage:
        while (msg := await self.next())["t"] in ("credits", "ping", "pong"):
            pass
        assert msg["t"] == kind, msg
        return msg

    async def lease(self, req: str, size: int) -> RawMessage:
        self.writer.write(encode(message("open", req=req, shape={"layers": 1,
                                                                  "layer_bytes": size})))
        return await self.answer("lease")

    async def write(self, key: int, offset: int, payload: bytes, imm: int | None = None) -> int:
        """One signalled write on the session's data connection; the reply's opcode."""
        if self.data is None:
            params = self.ready["params"]
            self.data = await asyncio.open_connection(params["host"], params["port"])
            self.data[1].write(bytes(params["token"]))
        reader, writer = self.data
        flags = FLAG_SIGNALED | (FLAG_IMM if imm is not None else 0)
        writer.write(encode_write(flags, key, imm or 0, len(payload), offset, 7))
        writer.write(payload)
        reply = await asyncio.wait_for(reader.readexactly(HEADER.size), 10)
        return int(HEADER.unpack(reply)[0])


@pytest.fixture
async def rogue(local: LocalDaemons) -> AsyncIterator[Rogue]:
    reader, writer = await local.control("rogue")
    writer.write(encode(message("hello", role="sender", name="rogue", transports=["tcp"])))
    decoder = FrameDecoder(CONTROL)
    intruder = Rogue(reader, writer, decoder, {})
    await intruder.answer("welcome")
    writer.write(encode(message("connect", params={})))
    intruder.ready = await intruder.answer("ready")
    yield intruder
    writer.close()
    if intruder.data is not None:
        intruder.data[1].close()


async def _victim_held(local: LocalDaemons) -> tuple[ReceiverClient, memoryview, int]:
    """A delivered request, held by its decode engine: (engine, its bytes, offset)."""
    consumer = await ReceiverClient.connect(local.receiver_socket)
    consumer.subscribe("victim")
    async with await SenderClient.connect(local.sender_socket) as client:
        result = await client.push_bytes("victim", "decode", VICTIM, chunk=65536)
    assert result.checksum == checksum.of_buffer(VICTIM)
    delivered = await consumer.wait_delivered("victim", 10)
    return consumer, consumer.view(delivered), delivered.offset


def _refused_writes(local: LocalDaemons) -> float:
    return float(local.receiver.metrics.completion_errors.labels(
        "rogue", "remote_access")._value.get())


async def test_a_write_outside_its_own_lease_is_refused(local: LocalDaemons,
                                                        rogue: Rogue) -> None:
    consumer, victim, victim_offset = await _victim_held(local)
    lease = await rogue.lease("mine", 4096)
    # Its own key, aimed at the victim's bytes.
    assert await rogue.write(lease["keys"][0], victim_offset, b"\xff" * 4096) == Op.NAK
    assert bytes(victim) == VICTIM
    await consumer.release("victim")
    await until(lambda: _refused_writes(local) == 1, what="the refusal counted")


async def test_a_write_just_past_its_lease_is_refused(rogue: Rogue) -> None:
    lease = await rogue.lease("mine", 4096)
    assert await rogue.write(lease["keys"][0], lease["offset"], b"\x01" * 4096) == Op.ACK
    assert await rogue.write(lease["keys"][0], lease["offset"] + 1, b"\x01" * 4096) == Op.NAK


async def test_the_region_key_grants_nothing(local: LocalDaemons, rogue: Rogue) -> None:
    consumer, victim, victim_offset = await _victim_held(local)
    region_key = rogue.ready["params"]["region"]["key"]
    assert await rogue.write(region_key, victim_offset, b"\xee" * 512) == Op.NAK
    assert bytes(victim) == VICTIM
    await consumer.release("victim")


async def test_another_sessions_key_grants_nothing(local: LocalDaemons, rogue: Rogue) -> None:
    # The victim's key, as if it leaked: keys are granted per session.
    consumer = await ReceiverClient.connect(local.receiver_socket)
    consumer.subscribe("victim")
    async with await SenderClient.connect(local.sender_socket) as client:
        push = await client.open("victim", "decode", RequestShape(1, len(VICTIM)))
        leaked = local.receiver.by_req["victim"]
        assert leaked.keys.takes_writes
        assert await rogue.write(leaked.keys.keys[0], leaked.slot.offset, b"\xee" * 512) == Op.NAK
        push.layer(0)[:] = VICTIM
        push.commit(0)
        result = await push.finish()
    assert result.checksum == checksum.of_buffer(VICTIM)
    delivered = await consumer.wait_delivered("victim", 10)
    assert bytes(consumer.view(delivered)) == VICTIM
    await consumer.release("victim")


async def test_an_old_key_after_its_lease_ended_is_refused(local: LocalDaemons,
                                                           rogue: Rogue) -> None:
    lease = await rogue.lease("short-lived", 1 << 20)
    rogue.writer.write(encode(message("abort", req="short-lived", lease=lease["lease"],
                                      error={"code": "aborted", "message": "done"})))
    await rogue.answer("abort_ack")
    await until(lambda: local.receiver.pool.used_bytes == 0, what="the slot back")
    consumer, victim, _ = await _victim_held(local)  # may reuse the slot
    assert await rogue.write(lease["keys"][0], lease["offset"], b"\xdd" * 4096) == Op.NAK
    assert bytes(victim) == VICTIM
    await consumer.release("victim")


async def test_a_delivered_request_no_longer_takes_writes_from_its_own_sender(
        rogue: Rogue) -> None:
    lease = await rogue.lease("own", 4096)
    # Its one layer, with the immediate that announces it: delivered.
    assert await rogue.write(lease["keys"][0], lease["offset"], b"\x01" * 4096,
                             imm=immediate.pack(lease["lease"], 0)) == Op.ACK
    assert (await rogue.answer("delivered"))["checksum"] == checksum.of_buffer(b"\x01" * 4096)
    assert await rogue.write(lease["keys"][0], lease["offset"], b"\x02" * 4096) == Op.NAK


async def test_after_an_attack_the_victim_still_pushes(local: LocalDaemons,
                                                       rogue: Rogue) -> None:
    lease = await rogue.lease("mine", 4096)
    assert await rogue.write(lease["keys"][0], lease["offset"] + 8192, b"x" * 16) == Op.NAK
    await until(lambda: not any(s.name == "rogue" for s in local.receiver.sessions),
                what="the rogue's session dropped")
    assert local.receiver.pool.used_bytes == 0  # its lease went with it
    consumer, victim, _ = await _victim_held(local)
    assert bytes(victim) == VICTIM
    await consumer.release("victim")
