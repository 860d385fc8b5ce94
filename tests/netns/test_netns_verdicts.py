"""A verdict lost with the connection, between two namespaces.

nftables drops the control connection's packets from the receiver to the
sender just before the last layer is committed: every byte lands, the
receiver delivers, and its ``delivered`` never arrives. The sender's
heartbeat then drops the connection. Before verdicts, the prefill engine
heard ``PeerLost`` while its decode engine held the delivered request: a
split outcome. Now the sender reconnects, asks the receiver how the request
ended, and both engines hear ``delivered``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.faults.wire import drop_inbound, undo_drop_inbound
from kvctl.netns import (
    DaemonProcess,
    NetnsPair,
    check_can_run,
    receiver_config,
    sender_config,
)
from kvwired.client import Delivered, OutgoingPush, ReceiverClient, SenderClient
from kvwired.errors import DaemonUnavailable, PeerLost
from kvwired.layout import RequestShape

_why_not = check_can_run()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]

SHAPE = RequestShape(4, 256 << 10)
CONTROL_PORT = 7471


@pytest.fixture(scope="module")
def pair() -> Iterator[NetnsPair]:
    with NetnsPair(f"v{uuid.uuid4().hex[:6]}") as hosts:
        yield hosts


def _deafen_control_connection(pair: NetnsPair) -> None:
    """Drop everything the receiver says on the sender's one control
    connection (no reset); a new connection is not touched."""
    ports = pair.established_ports(pair.prefill, CONTROL_PORT)
    assert len(ports) == 1, ports
    drop_inbound(pair.runner(pair.prefill), [f"tcp sport {CONTROL_PORT} tcp dport {ports[0]}"])


def _clear(pair: NetnsPair) -> None:
    undo_drop_inbound(pair.runner(pair.prefill))


async def _deliver_unheard(pair: NetnsPair, prefill: SenderClient, decode: ReceiverClient,
                           req: str) -> tuple[OutgoingPush, Delivered, float]:
    """Push ``req`` so that the receiver delivers it (checked byte for byte at
    decode) while the sender never hears ``delivered``: its control
    connection is deafened before the last layer is committed."""
    decode.subscribe(req)
    push = await prefill.open(req, "decode", SHAPE, chunk="per-layer")
    last = SHAPE.layers - 1
    for n in range(last):
        push.layer(n)[:] = bytes([n + 1]) * SHAPE.layer_bytes
        push.commit(n)
    await asyncio.wait_for(push.wait_sent(last - 1), 30)
    _deafen_control_connection(pair)
    cut = time.monotonic()
    push.layer(last)[:] = bytes([last + 1]) * SHAPE.layer_bytes
    push.commit(last)
    delivered = await asyncio.wait_for(decode.wait_delivered(req), 30)
    view = decode.view(delivered)
    try:
        for n in range(SHAPE.layers):
            start, length = SHAPE.layer_span(n)
            assert view[start : start + length] == bytes([n + 1]) * length
    finally:
        view.release()
    return push, delivered, cut


@pytest.fixture
def daemons(pair: NetnsPair, tmp_path: Path) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    rx = DaemonProcess(pair, pair.decode, "receiver", receiver_config(
        pair, tmp_path, heartbeat=1.0), tmp_path)
    tx = DaemonProcess(pair, pair.prefill, "sender", sender_config(
        pair, tmp_path, heartbeat=1.0), tmp_path)
    rx.start()
    tx.start()
    try:
        yield rx, tx
    finally:
        _clear(pair)
        tx.stop()
        rx.stop()


async def test_a_delivered_verdict_lost_with_the_connection_is_asked_for_not_guessed(
        pair: NetnsPair, daemons: tuple[DaemonProcess, DaemonProcess]) -> None:
    rx, tx = daemons
    async with await SenderClient.connect(tx.socket) as prefill, \
            await ReceiverClient.connect(rx.socket) as decode:
        push, delivered, cut = await _deliver_unheard(pair, prefill, decode, "verdict-lost")
        # The prefill engine hears what the decode engine holds, not PeerLost
        # (60 s guards against a hang: the heartbeat's bound is 4 s here).
        result = await asyncio.wait_for(push.finish(), 60)
        print(f"\nverdict asked for after a deaf connection: delivered "
              f"{time.monotonic() - cut:.2f} s after the cut")
        assert result.checksum == delivered.checksum
        assert "verdict after a lost link" in tx.log_path.read_text()
        await decode.release("verdict-lost")


async def test_an_engine_whose_sender_daemon_died_learns_the_verdict_from_its_successor(
        pair: NetnsPair, daemons: tuple[DaemonProcess, DaemonProcess]) -> None:
    """SIGKILL of the sender daemon after the receiver delivered and before the
    sender heard it: the prefill engine used to get DaemonUnavailable for a
    delivered request. It now asks the restarted daemon, which asks the
    receiver; a push not fully committed still fails at once."""
    rx, tx = daemons
    async with await SenderClient.connect(tx.socket) as prefill, \
            await ReceiverClient.connect(rx.socket) as decode:
        unfinished = await prefill.open("half-done", "decode", SHAPE, chunk="per-layer")
        unfinished.commit(0)
        push, delivered, _ = await _deliver_unheard(pair, prefill, decode, "daemon-died")
        os.kill(tx.pid, signal.SIGKILL)
        assert tx.process is not None
        await asyncio.to_thread(tx.process.wait)
        # The push the daemon could not have sent fails at once, typed.
        with pytest.raises(DaemonUnavailable):
            await asyncio.wait_for(unfinished.finish(), 30)
        killed = time.monotonic()
        await asyncio.to_thread(tx.start)  # as systemd would
        result = await asyncio.wait_for(push.finish(), 60)
        print(f"\nverdict from the restarted daemon: delivered "
              f"{time.monotonic() - killed:.2f} s after the kill")
        assert result.checksum == delivered.checksum
        assert result.timings["asked_after_restart"] == 1.0
        await decode.release("daemon-died")


async def test_a_receiver_that_died_is_not_asked_for_the_heartbeats_bound(
        pair: NetnsPair, daemons: tuple[DaemonProcess, DaemonProcess]) -> None:
    """A refused connection means no receiver listens there, and one started
    again keeps no verdicts: the sender stops asking at once rather than for
    four heartbeats (the lab's watchdog scenario took 12.4 s to its error)."""
    rx, tx = daemons
    async with await SenderClient.connect(tx.socket) as prefill, \
            await ReceiverClient.connect(rx.socket) as decode:
        push, _, _ = await _deliver_unheard(pair, prefill, decode, "asked-too-late")
        assert rx.process is not None
        os.kill(rx.pid, signal.SIGKILL)
        await asyncio.to_thread(rx.process.wait)
        with pytest.raises(PeerLost):
            await asyncio.wait_for(push.finish(), 60)
    asked = [line for line in tx.log_path.read_text().splitlines()
             if "no verdict from the receiver" in line]
    assert asked and "Connection refused" in asked[-1], asked
