"""One outcome per request at both ends, no slot leaked, no stale write delivered.

Both daemons in this event loop (TCP on loopback), driven the way careless
or unlucky engines drive them: deadlines that race delivery, engines that
vanish holding requests, views of staging kept past the end of a push.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvwired import checksum
from kvwired.client import Delivered, ReceiverClient, SenderClient
from kvwired.errors import DeadlineExceeded, RequestAborted
from kvwired.layout import RequestShape

from ..conftest import LocalDaemons, start_local, until

SHAPE = RequestShape(4, 256 << 10)  # 1 MiB


def _pattern(seed: int) -> bytes:
    return bytes(np.random.default_rng(seed).integers(0, 256, SHAPE.total_bytes,
                                                      dtype=np.uint8))


async def _receiver_agrees(local: LocalDaemons, consumer: ReceiverClient, req: str,
                           sender_said: str) -> None:
    """The receiver's outcome for ``req`` is the one the sender reported."""
    if sender_said == "delivered":
        await consumer.wait_delivered(req, timeout=10)
        await consumer.release(req)
        return
    # Aborted at the sender: the receiver holds nothing of it (a request it
    # had delivered would stay held for its decode engine) and never said
    # it was delivered.
    lease = local.receiver.by_req.get(req)
    await until(lambda: req not in local.receiver.by_req,
                what=f"{req} gone at the receiver (it is {lease and lease.state})")
    queue = consumer._events.get(req)
    while queue is not None and not queue.empty():
        assert not isinstance(queue.get_nowait(), Delivered), f"{req}: split outcome"


async def _pools_empty(local: LocalDaemons) -> None:
    await until(lambda: local.receiver.pool.used_bytes == 0 and not local.receiver.leases
                and local.sender.staging.used_bytes == 0, what="both pools empty")


async def test_deadlines_racing_delivery_give_one_outcome_at_both_ends(
        local: LocalDaemons) -> None:
    async with await SenderClient.connect(local.sender_socket) as engine, \
            await ReceiverClient.connect(local.receiver_socket) as consumer:
        # What one push takes here, so the deadlines land around it.
        started = asyncio.get_running_loop().time()
        await engine.push_bytes("warm-up", "decode", _pattern(0)[: 1 << 20])
        await consumer.release("warm-up")
        transfer = asyncio.get_running_loop().time() - started
        rng = random.Random(11)
        sender_said: dict[str, str] = {}
        late: list[str] = []

        async def push(n: int) -> None:
            req = f"race-{n}"
            deadline = max(1e-4, rng.uniform(0.2, 1.5) * transfer)
            try:
                push = await engine.open(req, "decode", SHAPE, chunk="per-layer",
                                         deadline=deadline)
                for layer in range(SHAPE.layers):
                    push.layer(layer)[:] = bytes([n % 251]) * SHAPE.layer_bytes
                    push.commit(layer)
                result = await push.finish()
                sender_said[req] = "delivered"
                if result.timings["late"]:
                    late.append(req)  # its abort lost the race to delivery
            except DeadlineExceeded:
                sender_said[req] = "aborted"

        for n in range(0, 120, 6):
            batch = range(n, n + 6)
            for i in batch:
                consumer.subscribe(f"race-{i}")
            await asyncio.gather(*(push(i) for i in batch))
            for i in batch:
                await _receiver_agrees(local, consumer, f"race-{i}", sender_said[f"race-{i}"])
        outcomes = list(sender_said.values())
        print(f"{len(outcomes)} pushes, deadlines {0.2 * transfer * 1e3:.1f}-"
              f"{1.5 * transfer * 1e3:.1f} ms: {outcomes.count('delivered')} delivered "
              f"({len(late)} of them after their deadline: the abort lost to delivery), "
              f"{outcomes.count('aborted')} aborted at both ends, 0 disagreements")
        assert 0 < outcomes.count("aborted") < len(outcomes), "the deadlines raced nothing"
    await _pools_empty(local)


@pytest.mark.parametrize("keep", ["memoryview", "numpy"])
async def test_a_view_kept_after_finish_cannot_reach_a_later_push(
        local: LocalDaemons, keep: str) -> None:
    async with await SenderClient.connect(local.sender_socket) as engine, \
            await ReceiverClient.connect(local.receiver_socket) as consumer:
        first = await engine.open("first", "decode", SHAPE)
        stale: Any = first.layer(0) if keep == "memoryview" else np.frombuffer(
            first.layer(0), dtype=np.uint8)
        for layer in range(SHAPE.layers):
            first.layer(layer)[:] = b"\x01" * SHAPE.layer_bytes
            first.commit(layer)
        await first.finish()
        await consumer.release("first")
        await until(lambda: local.sender.staging.used_bytes == 0, what="staging back")
        expected = _pattern(2)
        second = await engine.open("second", "decode", SHAPE)
        assert second._slot.mapping is not first._slot.mapping
        # The first push's pages were parked and carried the second (kvwired.slot_maps).
        assert engine.conn.slot_maps is not None and engine.conn.slot_maps.reused == 1
        for layer in range(SHAPE.layers):
            offset, length = SHAPE.layer_span(layer)
            second.layer(layer)[:] = expected[offset : offset + length]
            # The careless engine writes through its old view meanwhile.
            if keep == "memoryview":
                stale[:4096] = b"\xee" * 4096
            else:
                stale[:4096] = 0xEE
            second.commit(layer)
        result = await second.finish()
        delivered: Delivered = await consumer.wait_delivered("second", timeout=10)
        assert bytes(consumer.view(delivered)) == expected
        assert result.checksum == checksum.of_buffer(expected, SHAPE)
        await consumer.release("second")
    await _pools_empty(local)


async def test_a_decode_engine_that_dies_holding_requests_gives_them_back(
        local: LocalDaemons) -> None:
    async with await SenderClient.connect(local.sender_socket) as engine:
        doomed = await ReceiverClient.connect(local.receiver_socket)
        for n in range(3):
            doomed.subscribe(f"held-{n}")
            await engine.push_bytes(f"held-{n}", "decode", b"h" * (1 << 20))
            await doomed.wait_delivered(f"held-{n}", timeout=10)
        assert local.receiver.pool.used_bytes == 3 << 20
        await doomed.close()  # as a crash would: no release
        seconds = await until(lambda: local.receiver.pool.used_bytes == 0,
                              what="reclaim of a dead engine's requests")
        print(f"a dead decode engine's 3 requests reclaimed {seconds * 1e3:.1f} ms after "
              "its connection closed")
    registry = local.receiver.metrics.registry
    assert registry.get_sample_value("kvwire_reclaimed_total", {"reason": "engine_gone"}) == 3
    assert not local.receiver.by_req


async def test_a_delivered_request_nobody_claims_is_reclaimed_after_the_ttl(
        tmp_path: Path) -> None:
    daemons = await start_local(tmp_path, receiver={"unclaimed_ttl": 0.3})
    try:
        async with await SenderClient.connect(daemons.sender_socket) as engine:
            await engine.push_bytes("orphan", "decode", b"o" * (1 << 20))
        await until(lambda: daemons.receiver.pool.used_bytes == 0, what="unclaimed reclaim")
        registry = daemons.receiver.metrics.registry
        assert registry.get_sample_value("kvwire_reclaimed_total", {"reason": "unclaimed"}) == 1
    finally:
        await daemons.sender.stop()
        await daemons.receiver.stop()


async def test_an_engine_that_disconnects_mid_push_leaves_nothing_behind(
        local: LocalDaemons) -> None:
    engine = await SenderClient.connect(local.sender_socket)
    push = await engine.open("half", "decode", SHAPE)
    push.commit(0)
    await engine.close()
    await _pools_empty(local)


def _resolves(future: asyncio.Future[None]) -> Any:
    def done(_: asyncio.Future[None]) -> None:
        future.set_result(None)
    return done


async def test_an_abort_waits_for_the_writes_still_on_the_wire(local: LocalDaemons) -> None:
    """The sender tells the receiver "abort" only once none of the push's writes
    can still land: the receiver then frees the slot (and revokes its key),
    and a write arriving after that would land in whatever reuses it."""
    async with await SenderClient.connect(local.sender_socket) as client:
        warm = await client.push_bytes("warm", "decode", b"w" * 4096)
        assert warm.checksum
        link = local.sender.links["decode"]
        channel = link.channel
        assert channel is not None
        real_post = channel.post
        held: list[tuple[Any, asyncio.Future[None]]] = []

        def hold(writes: Any, imm: int | None = None, key: int | None = None
                 ) -> asyncio.Future[None]:
            # Posted, not yet placed: the write is "on the wire" until released.
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            held.append(((writes, imm, key), future))
            return future
        channel.post = hold  # type: ignore[method-assign]
        shape = RequestShape(2, 4096)
        push = await client.open("slow", "decode", shape, chunk=4096)
        for n in range(shape.layers):
            push.layer(n)[:] = b"s" * 4096
            push.commit(n)
        await until(lambda: len(held) == shape.layers, what="both layers posted")
        push.abort()
        lease = local.receiver.by_req["slow"]
        for _ in range(50):  # the abort must wait for the held writes
            await asyncio.sleep(0.01)
            assert lease.state.name == "FILLING"
        channel.post = real_post  # type: ignore[method-assign]
        for (writes, imm, key), future in held:
            real_post(writes, imm, key).add_done_callback(_resolves(future))
        try:  # aborted, or delivered after all (late): one outcome at both ends
            result = await push.finish()
        except RequestAborted:
            assert "slow" not in local.receiver.by_req
        else:
            assert result.timings["late"] == 1
            async with await ReceiverClient.connect(local.receiver_socket) as consumer:
                await consumer.release("slow")
    async with await ReceiverClient.connect(local.receiver_socket) as consumer:
        await consumer.release("warm")
    await until(lambda: local.receiver.pool.used_bytes == 0, what="the pool empty")
    assert local.receiver.metrics.completion_errors.labels("prefill", "remote_access"
                                                           )._value.get() == 0
