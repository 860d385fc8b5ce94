"""A data channel that fails under a live control connection is replaced in place.

Both daemons in one event loop over TCP: a data stream is torn down under a
push while its writes are on the wire (as a queue pair out of retries is, in
the lab's loss and blackout scenarios). The link keeps its control
connection, the receiver its session and leases; the lost writes are posted
again on the new channel under new keys, and the request is delivered byte
for byte. What cannot be ridden out still fails the link, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvwired import checksum, immediate
from kvwired.client import ReceiverClient, SenderClient
from kvwired.errors import PeerLost, RemoteAccessError, TransportError
from kvwired.layout import RequestShape
from kvwired.sender.link import PeerLink
from kvwired.transport.base import DataChannel, Write

from ..conftest import LocalDaemons, start_local, until

LAYERS, LAYER_BYTES = 12, 256 << 10


def _cut(channel: DataChannel) -> None:
    """Reset one data stream from the sender's end, as a dying path does."""
    transport = getattr(channel, "_transport", None)
    assert transport is not None, "a connected TCP data channel"
    transport.abort()


def _replaced(link: PeerLink, result: str = "replaced") -> float:
    value: float = link.metrics.channel_replacements.labels(link.name, result)._value.get()
    return value


async def _push_cutting(daemons: LocalDaemons, req: str, cut: list[int]) -> tuple[int, int]:
    """Push LAYERS layers, resetting the data channels numbered in ``cut`` just
    after the middle layer's writes were posted on them (still pending); the
    receiver's checksum and ours."""
    link = daemons.sender.links["decode"]
    await until(lambda: link.connected, what="connected")
    post = link.data.ledger.post
    to_cut = set(cut)

    def post_then_cut(number: int, channel: DataChannel, writes: Sequence[Write],
                      imm: int | None, lease: int, key: int) -> asyncio.Future[None]:
        posted = post(number, channel, writes, imm, lease, key)
        if (imm is not None and immediate.unpack(imm)[1] == LAYERS // 2
                and number in to_cut):
            to_cut.discard(number)
            assert channel.pending_writes > 0
            _cut(channel)
        return posted
    link.data.ledger.post = post_then_cut  # type: ignore[method-assign]
    payload = bytes(range(256)) * (LAYERS * LAYER_BYTES // 256)
    try:
        async with await SenderClient.connect(daemons.sender_socket) as prefill, \
                await ReceiverClient.connect(daemons.receiver_socket) as decode:
            decode.subscribe(req)
            push = await prefill.open(req, "decode", RequestShape(LAYERS, LAYER_BYTES),
                                      chunk="per-layer", deadline=30)
            for n in range(LAYERS):
                push.layer(n)[:] = payload[n * LAYER_BYTES:(n + 1) * LAYER_BYTES]
                push.commit(n)
            result = await asyncio.wait_for(push.finish(), 30)
            delivered = await decode.wait_delivered(req, 10)
            assert delivered.checksum == result.checksum
    finally:
        link.data.ledger.post = post  # type: ignore[method-assign]
    assert not to_cut, "every channel named was cut"
    return result.checksum, checksum.of_buffer(payload, RequestShape(LAYERS, LAYER_BYTES))


@pytest.mark.parametrize("qps", [1, 2])
async def test_a_data_stream_reset_under_a_push_is_replaced_and_the_request_delivered(
        tmp_path: Path, qps: int) -> None:
    daemons = await start_local(tmp_path, sender={"qps_per_peer": qps})
    try:
        link = daemons.sender.links["decode"]
        reconnects = daemons.sender.metrics.reconnects.labels("decode")._value.get()
        theirs, ours = await _push_cutting(daemons, "cut", [qps - 1])
        assert theirs == ours, "delivered byte for byte"
        assert _replaced(link) == 1
        # Same control connection, same session: nothing was rebuilt.
        assert daemons.sender.metrics.reconnects.labels("decode")._value.get() == reconnects
        assert len(daemons.receiver.sessions) == 1
        (session,) = daemons.receiver.sessions
        assert not session.broken, "the receiver stopped waiting for the replacement"
        # Both pools come back, and the link carries the next request.
        await until(lambda: daemons.sender.staging.used_bytes == 0, what="staging freed")
        theirs, ours = await _push_cutting(daemons, "after", [])
        assert theirs == ours
    finally:
        await daemons.sender.stop()
        await daemons.receiver.stop()


async def test_every_channel_cut_at_once_is_ridden_out(tmp_path: Path) -> None:
    daemons = await start_local(tmp_path, sender={"qps_per_peer": 2})
    try:
        theirs, ours = await _push_cutting(daemons, "both", [0, 1])
        assert theirs == ours
        assert _replaced(daemons.sender.links["decode"]) == 2
    finally:
        await daemons.sender.stop()
        await daemons.receiver.stop()


async def test_a_channel_silent_past_the_stall_bound_is_given_up_not_replaced(
        local: LocalDaemons) -> None:
    """A path that carried nothing for the stall bound is a gone peer, however
    the channel then fails: no replacement is tried, and the link is rebuilt
    whole (the stalled-stream rule)."""
    link = local.sender.links["decode"]
    await until(lambda: link.connected, what="connected")
    reconnects = local.sender.metrics.reconnects.labels("decode")
    before = reconnects._value.get()
    channel = link.channels[0]
    silence = 2 * link.data.stall_bound
    channel.silent_for = lambda now: silence  # type: ignore[method-assign]
    channel.fail(PeerLost("outgoing data connection closed"))
    await until(lambda: reconnects._value.get() == before + 1 and link.connected,
                what="the link rebuilt")
    assert _replaced(link) == 0


async def test_a_remote_access_error_is_never_ridden_out(local: LocalDaemons) -> None:
    """A write under a wrong key is a bug or an attack, not the wire's doing."""
    link = local.sender.links["decode"]
    await until(lambda: link.connected, what="connected")
    assert not link.data.replaceable(0, link.channels[0], RemoteAccessError("wrong key"))
    assert link.data.replaceable(0, link.channels[0], PeerLost("outgoing data connection closed"))
    # rdma_rxe's responder refusing a resent message's sequence: a new queue
    # pair starts it clean.
    assert link.data.replaceable(0, link.channels[0], TransportError(
        "remote invalid request", status="remote_invalid_request"))


async def test_a_receiver_whose_channel_is_not_replaced_drops_the_session_after_the_bound(
        tmp_path: Path) -> None:
    """The receiver waits the stall bound (four heartbeats) for the sender to
    replace a failed responder; a sender that never does loses its session."""
    daemons = await start_local(tmp_path, receiver={"heartbeat": 0.2},
                                sender={"heartbeat": 0.2})
    try:
        link = daemons.sender.links["decode"]
        await until(lambda: link.connected, what="connected")
        (session,) = daemons.receiver.sessions
        failed = daemons.receiver.metrics.channel_replacements.labels(session.label, "failed")
        daemons.receiver.channels.failed(session, 0, session.responders[0],
                                         PeerLost("incoming data connection closed"))
        assert 0 in session.broken
        waited = await until(lambda: not session.alive, what="the session dropped")
        assert waited >= 4 * 0.2 * 0.9
        assert failed._value.get() == 1
        # The sender reconnects: a new session, nothing left waiting.
        await until(lambda: len(daemons.receiver.sessions) == 1 and link.connected,
                    what="reconnected")
    finally:
        await daemons.sender.stop()
        await daemons.receiver.stop()
