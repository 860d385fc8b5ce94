"""Several data channels per receiver (qps_per_peer): the cut, the fence, and
pushes striped over four TCP streams, byte for byte; a sender that announces
a layer on some channels only never gets it announced."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwired import checksum, immediate, stripes
from kvwired.client import ReceiverClient, SenderClient
from kvwired.errors import KvwireError
from kvwired.layout import RequestShape
from kvwired.protocol import CONTROL, FrameDecoder, RawMessage, encode, message
from kvwired.transport.tcp.frames import FLAG_IMM, FLAG_SIGNALED, HEADER, Op, encode_write

from ..conftest import LocalDaemons, start_local, until

# ------------------------------------------------------------------ the cut


@given(chunks=st.integers(0, 300), channels=st.integers(1, stripes.MAX_CHANNELS),
       first=st.integers(0, 1000))
def test_every_chunk_goes_out_once_in_order_on_one_channel(chunks: int, channels: int,
                                                           first: int) -> None:
    groups = stripes.stripe(list(range(chunks)), channels, first)
    assert len(groups) == channels
    # Read in the order the groups were cut (from channel `first` on), the
    # chunks are the batch, in order: each group is a contiguous run.
    order = [(first + position) % channels for position in range(channels)]
    assert [c for channel in order for c in groups[channel]] == list(range(chunks))
    sizes = [len(group) for group in groups]
    assert max(sizes) - min(sizes) <= 1


def test_one_chunk_batches_rotate_over_the_channels() -> None:
    # A layer in one write: layer n goes on channel n % 4, the others announce it.
    used = [next(c for c, group in enumerate(stripes.stripe(["w"], 4, layer)) if group)
            for layer in range(8)]
    assert used == [0, 1, 2, 3, 0, 1, 2, 3]


def test_no_channels_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        stripes.stripe([1], 0)
    with pytest.raises(ValueError):
        stripes.LandingFence(0, 4)


# ---------------------------------------------------------------- the fence


@st.composite
def announcements(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int]]]:
    """Channels, layers, and each channel's in-order announcements interleaved
    at random, with stale ones (repeats, out of range, unknown channels) mixed in."""
    channels = draw(st.integers(1, 6))
    layers = draw(st.integers(1, 12))
    queues = []
    for _ in range(channels):
        # A channel announces an increasing subset of layers ending at the last.
        marks = draw(st.sets(st.integers(0, layers - 2), max_size=layers)) if layers > 1 else set()
        queues.append([*sorted(marks), layers - 1])
    events: list[tuple[int, int]] = []
    while any(queues):
        channel = draw(st.sampled_from([c for c, q in enumerate(queues) if q]))
        events.append((channel, queues[channel].pop(0)))
        if draw(st.booleans()):
            events.append(draw(st.tuples(st.integers(-1, channels + 1),
                                         st.integers(-1, layers + 1))))
    return channels, layers, events


@given(announcements())
def test_a_layer_lands_once_every_channel_has_announced_it(
        case: tuple[int, int, list[tuple[int, int]]]) -> None:
    channels, layers, events = case
    fence = stripes.LandingFence(channels, layers)
    reported = [0] * channels  # the model: what each channel has placed
    announced: list[int] = []
    for channel, layer in events:
        landed = fence.report(channel, layer)
        valid = 0 <= channel < channels and reported[channel] <= layer < layers
        if not valid:
            assert landed is None  # stale: refused, nothing moves
        else:
            reported[channel] = layer + 1
            assert landed is not None
            announced.extend(landed)
        assert fence.landed == min(reported)
        assert announced == list(range(fence.landed))
    assert fence.landed == layers  # every channel announced the last layer


def test_a_layer_waits_for_the_slowest_channel() -> None:
    fence = stripes.LandingFence(3, 4)
    assert fence.report(0, 3) == range(0, 0)
    assert fence.report(2, 1) == range(0, 0)
    assert fence.report(1, 0) == range(0, 1)
    assert fence.report(1, 2) == range(1, 2)
    assert fence.report(2, 1) is None  # again: stale
    assert fence.report(2, 3) == range(2, 3)
    assert fence.report(1, 3) == range(3, 4)
    assert fence.report(5, 3) is None and fence.landed == 4


# ------------------------------------------------------- four TCP streams


@pytest.fixture
async def striped(tmp_path: os.PathLike[str]) -> AsyncIterator[LocalDaemons]:
    from pathlib import Path

    daemons = await start_local(Path(tmp_path), receiver={"pool_size": "128MiB"},
                                sender={"staging_size": "128MiB", "qps_per_peer": 4})
    yield daemons
    await daemons.sender.stop()
    await daemons.receiver.stop()


CACHE = RequestShape(24, 256 << 10)  # 6 MiB: 24 layers of 256 KiB


async def _push(daemons: LocalDaemons, req: str, data: bytes, chunk: int) -> int:
    """``data`` pushed as CACHE, a layer at a time; the checksum the receiver reported."""
    async with await SenderClient.connect(daemons.sender_socket) as client:
        push = await client.open(req, "decode", CACHE, chunk=chunk)
        for layer in range(CACHE.layers):
            offset, length = CACHE.layer_span(layer)
            push.layer(layer)[:] = data[offset : offset + length]
            push.commit(layer)
        return (await push.finish()).checksum


@pytest.mark.parametrize("chunk", [512, 12 << 10, 256 << 10, CACHE.total_bytes])
async def test_a_push_striped_over_four_streams_arrives_byte_exact(
        striped: LocalDaemons, chunk: int) -> None:
    data = os.urandom(CACHE.total_bytes)
    req = f"striped-{chunk}"
    consumer = await ReceiverClient.connect(striped.receiver_socket)
    consumer.subscribe(req)
    reported = await _push(striped, req, data, chunk)
    delivered = await consumer.wait_delivered(req, 20)
    assert bytes(consumer.view(delivered)) == data
    assert reported == delivered.checksum == checksum.of_buffer(data, CACHE)
    await consumer.release(req)
    await consumer.close()
    (session,) = striped.receiver.sessions
    assert len(session.responders) == 4
    link = striped.sender.links["decode"]
    assert len(link.channels) == 4
    # Every channel carried writes (and its immediates): the push was striped.
    assert all(responder.writes_received > 0 for responder in session.responders)
    # No rails configured: every channel is on the "default" rail, and its
    # counters add up to the push (a zero-length announcement is a write).
    metrics = striped.sender.metrics
    assert metrics.rail_bytes.labels("decode", "default")._value.get() == CACHE.total_bytes
    writes = metrics.rail_writes.labels("decode", "default")._value.get()
    chunks = -(-CACHE.total_bytes // chunk)
    assert chunks <= writes <= chunks + 4 * CACHE.layers
    # Every channel's credits came back.
    await until(lambda: link.credits == [striped.receiver.config.credits] * 4,
                what="every channel's credits back")


async def test_engines_see_layers_in_order_as_they_land(striped: LocalDaemons) -> None:
    consumer = await ReceiverClient.connect(striped.receiver_socket)
    events = asyncio.ensure_future(_events(consumer, "ordered"))
    await _push(striped, "ordered", os.urandom(CACHE.total_bytes), 64 << 10)
    seen = await asyncio.wait_for(events, 20)
    assert [type(event).__name__ for event in seen] == ["LayerLanded"] * CACHE.layers + [
        "Delivered"]
    assert [getattr(event, "layer", None) for event in seen[:-1]] == list(range(CACHE.layers))
    await consumer.close()


async def _events(consumer: ReceiverClient, req: str) -> list[object]:
    return [event async for event in consumer.events(req)]


# --------------------------------------------- a sender that breaks the rule


class TwoChannelRogue:
    """An authenticated sender with two data channels, speaking by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder(CONTROL)
        self.channels: list[RawMessage] = []
        self.data: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def answer(self, kind: str) -> RawMessage:
        """The next frame's map that is not credits or a ping, as the adversary sees it."""
        while True:
            while (msg := self.decoder.next_message()) is None:
                chunk = await asyncio.wait_for(self.reader.read(65536), 10)
                assert chunk, "the receiver hung up"
                self.decoder.feed(chunk)
            if msg.kind not in ("credits", "ping", "pong"):
                assert msg.kind == kind, msg
                return msg.to_wire()

    async def connect(self, channels: int) -> None:
        self.writer.write(encode(message("hello", role="sender", name="rogue",
                                         transports=["tcp"])))
        await self.answer("welcome")
        for _ in range(channels):
            self.writer.write(encode(message("connect", params={})))
            self.channels.append((await self.answer("ready"))["params"])

    async def write(self, channel: int, key: int, offset: int, payload: bytes,
                    imm: int | None = None) -> int:
        if channel not in self.data:
            params = self.channels[channel]
            self.data[channel] = await asyncio.open_connection(params["host"], params["port"])
            self.data[channel][1].write(bytes(params["token"]))
        reader, writer = self.data[channel]
        flags = FLAG_SIGNALED | (FLAG_IMM if imm is not None else 0)
        writer.write(encode_write(flags, key, imm or 0, len(payload), offset, 7))
        writer.write(payload)
        reply = await asyncio.wait_for(reader.readexactly(HEADER.size), 10)
        return int(HEADER.unpack(reply)[0])

    def close(self) -> None:
        self.writer.close()
        for _, writer in self.data.values():
            writer.close()


async def _rogue(local: LocalDaemons, channels: int) -> TwoChannelRogue:
    reader, writer = await local.control("rogue")
    rogue = TwoChannelRogue(reader, writer)
    await rogue.connect(channels)
    return rogue


async def test_a_layer_announced_on_one_channel_of_two_is_not_announced(
        local: LocalDaemons) -> None:
    rogue = await _rogue(local, 2)
    consumer = await ReceiverClient.connect(local.receiver_socket)
    try:
        consumer.subscribe("half")
        rogue.writer.write(encode(message("open", req="half",
                                          shape={"layers": 2, "layer_bytes": 4096})))
        lease = await rogue.answer("lease")
        keys, offset = lease["keys"], lease["offset"]
        assert len(keys) == 2 and keys[0] != keys[1]  # a key per channel
        imm = immediate.pack(lease["lease"], 1)
        # Both layers written and announced on channel 0 only.
        assert await rogue.write(0, keys[0], offset, b"\x01" * 8192, imm) == Op.ACK
        stale = local.receiver.metrics.stale_immediates._value.get()
        # Announced again on channel 0: stale (not after its last), dropped.
        assert await rogue.write(0, keys[0], offset, b"", imm) == Op.ACK
        await until(lambda: local.receiver.metrics.stale_immediates._value.get() > stale,
                    what="the repeated announcement counted as stale")
        (held,) = [x for x in local.receiver.leases.values() if x.req == "half"]
        assert held.landed == 0 and held.fence.reported == [2, 0]
        # Channel 1 announces layer 0: layer 0 lands, layer 1 still waits for it.
        assert await rogue.write(1, keys[1], offset, b"",
                                 immediate.pack(lease["lease"], 0)) == Op.ACK
        await until(lambda: held.landed == 1, what="layer 0 landed")
        assert held.fence.reported == [2, 1]
        # A channel's key is its own: channel 1 writing under channel 0's key
        # is a remote access error, and the session (and its lease) ends.
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            assert await rogue.write(1, keys[0], offset, b"\x02" * 16) != Op.ACK
        await until(lambda: "half" not in local.receiver.by_req,
                    what="the rogue's lease voided with its session")
        # Its decode engine saw layer 0 land, never layer 1, then the failure.
        seen: list[int] = []

        async def follow() -> None:
            async for event in consumer.events("half"):
                seen.append(getattr(event, "layer", -1))
        with pytest.raises(KvwireError):
            await asyncio.wait_for(follow(), 10)
        assert seen == [0]
    finally:
        await consumer.close()
        rogue.close()


async def test_more_channels_than_a_receiver_serves_end_the_session(
        local: LocalDaemons) -> None:
    rogue = await _rogue(local, stripes.MAX_CHANNELS)
    try:
        (session,) = [s for s in local.receiver.sessions if s.name == "rogue"]
        assert len(session.responders) == stripes.MAX_CHANNELS
        rogue.writer.write(encode(message("connect", params={})))
        refusal = await rogue.answer("error")
        assert f"at most {stripes.MAX_CHANNELS} are served" in refusal["error"]["message"]
        assert "qps_per_peer" in refusal["error"]["hint"]
        await until(lambda: session not in local.receiver.sessions,
                    what="the session dropped")
    finally:
        rogue.close()
