"""A data stream whose packets vanish without a reset, between two namespaces.

nftables drops one data stream's packets in the decode namespace after some
layers have landed: TCP retransmits quietly, the control connection beside
it stays healthy, and nothing raises. The sender's progress check must end
the push with a typed error within its stall bound (four heartbeats), at
both ends, and the next push must go through once the path is clear.
"""

from __future__ import annotations

import asyncio
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
    scrape_in,
    sender_config,
)
from kvwired.client import PushResult, ReceiverClient, SenderClient
from kvwired.errors import DeadlineExceeded, KvwireError, PeerLost
from kvwired.layout import RequestShape

_why_not = check_can_run()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]

LAYERS, LAYER_BYTES = 12, 1 << 20
DATA_PORT = 7472


@pytest.fixture(scope="module")
def pair() -> Iterator[NetnsPair]:
    with NetnsPair(f"s{uuid.uuid4().hex[:6]}") as hosts:
        yield hosts


def _drop_stream(pair: NetnsPair, sender_port: int) -> None:
    """Silently drop (no reset) every packet of one stream as it reaches decode."""
    drop_inbound(pair.runner(pair.decode), [f"tcp sport {sender_port} tcp dport {DATA_PORT}"])


def _clear(pair: NetnsPair) -> None:
    undo_drop_inbound(pair.runner(pair.decode))


async def _leases_held(pair: NetnsPair) -> float:
    status = await asyncio.to_thread(scrape_in, pair, pair.decode, 9471)
    return status.total("kvwire_pool_bytes", pool="receive", state="used")


@pytest.mark.parametrize(("qps", "deadline"), [(1, None), (2, 2.0)],
                         ids=["one-stream-no-deadline", "two-streams-deadline"])
async def test_a_stream_dropped_without_a_reset_ends_the_push_within_the_stall_bound(
        pair: NetnsPair, tmp_path: Path, qps: int, deadline: float | None) -> None:
    heartbeat = 1.0  # the stall bound is four of them
    rx = DaemonProcess(pair, pair.decode, "receiver", receiver_config(
        pair, tmp_path, heartbeat=heartbeat), tmp_path)
    tx = DaemonProcess(pair, pair.prefill, "sender", sender_config(
        pair, tmp_path, heartbeat=heartbeat, qps_per_peer=qps), tmp_path)
    rx.start()
    tx.start()
    prefill = await SenderClient.connect(tx.socket)
    decode = await ReceiverClient.connect(rx.socket)
    try:
        req = f"stall-{qps}"
        decode.subscribe(req)
        push = await prefill.open(req, "decode", RequestShape(LAYERS, LAYER_BYTES),
                                  chunk="per-layer", deadline=deadline)
        for n in range(4):
            push.layer(n)[:] = bytes([n + 1]) * LAYER_BYTES
            push.commit(n)
        for n in range(4):
            await asyncio.wait_for(push.wait_sent(n), 30)
        ports = pair.established_ports(pair.prefill, DATA_PORT)
        assert len(ports) == qps
        _drop_stream(pair, ports[-1])
        cut = time.monotonic()
        for n in range(4, LAYERS):
            push.layer(n)[:] = bytes([n + 1]) * LAYER_BYTES
            push.commit(n)

        # 60 s is a guard against a hang, not a timing: the bound is 4 s here.
        with pytest.raises(KvwireError) as failure:
            await asyncio.wait_for(push.finish(), 60)
        took = time.monotonic() - cut
        print(f"\nstalled stream ({qps} streams, deadline {deadline}): "
              f"{type(failure.value).__name__} {took:.2f} s after the cut: {failure.value}")
        if deadline is None:
            assert isinstance(failure.value, PeerLost)
            assert failure.value.status == "stalled"
            assert "placed nothing" in failure.value.message
        else:
            assert isinstance(failure.value, DeadlineExceeded)

        # The decode engine hears the same outcome, and the receiver holds nothing.
        with pytest.raises(KvwireError):
            await asyncio.wait_for(decode.wait_delivered(req), 30)
        await _until_pool_empty(pair, 30)

        # The path clears: the link comes back and the next push is delivered.
        _clear(pair)
        data = bytes(range(256)) * (LAYER_BYTES // 256)
        result = await asyncio.wait_for(
            _push_when_up(prefill, f"after-{qps}", data), 60)
        assert result.bytes == len(data)
    finally:
        _clear(pair)
        await prefill.close()
        await decode.close()
        tx.stop()
        rx.stop()


async def _until_pool_empty(pair: NetnsPair, timeout: float) -> None:
    """Poll the receiver's metrics (a deadline, not a fixed wait) until it holds nothing."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while await _leases_held(pair):
        assert loop.time() - started < timeout, "the receive pool was not emptied"
        await asyncio.sleep(0.1)


async def _push_when_up(prefill: SenderClient, req: str, data: bytes) -> PushResult:
    """Push once the sender has its link back: a push before that fails at once
    with PeerLost, so try again, a bounded number of times."""
    for attempt in range(100):
        try:
            return await prefill.push_bytes(f"{req}-{attempt}", "decode", data)
        except PeerLost:
            await asyncio.sleep(0.2)
    raise AssertionError("the link did not come back after the path cleared")
