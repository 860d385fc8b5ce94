"""An engine that gives up waiting, in any order, still gets one typed outcome.

``asyncio.wait_for(push.finish(), t)``, a cancelled task awaiting
``finish()``, ``abort()`` and ``layer()`` in any order (hypothesis draws
them) against the real daemons: the push stays usable for ``abort()`` and
``finish()``, every error the client raises is a ``KvwireError``, the
receiver ends the request the way the sender reported, and the same client
pushes again afterwards. A bad open fails that open alone.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwired.client import Delivered, OutgoingPush, PushResult, ReceiverClient, SenderClient
from kvwired.errors import InvalidRequest, KvwireError, UsageError
from kvwired.layout import RequestShape
from kvwired.protocol import Failed, Message, message

from ..conftest import LocalDaemons, start_local, until

SHAPE = RequestShape(8, 512 << 10)  # 4 MiB: long enough for a wait to be cut short
OPS = ("wait_for_zero", "wait_for_short", "cancel_waiter", "abort", "layer", "yield")


async def _apply(push: OutgoingPush, op: str) -> None:
    """One thing an impatient engine does; only typed errors may come out."""
    try:
        if op == "wait_for_zero":
            await asyncio.wait_for(push.finish(), 0)
        elif op == "wait_for_short":
            await asyncio.wait_for(push.finish(), 0.005)
        elif op == "cancel_waiter":
            waiter = asyncio.ensure_future(push.finish())
            await asyncio.sleep(0)
            waiter.cancel()
            outcome = (await asyncio.gather(waiter, return_exceptions=True))[0]
            assert isinstance(outcome, asyncio.CancelledError | KvwireError | PushResult), \
                f"a cancelled finish() gave {outcome!r}"
        elif op == "abort":
            push.abort()
        elif op == "layer":
            push.layer(0)
        else:
            await asyncio.sleep(0)
    except (TimeoutError, KvwireError):
        pass  # a wait cut short, or the push's own typed outcome


async def _one_order(local: LocalDaemons, before: list[str], after: list[str]) -> None:
    async with await SenderClient.connect(local.sender_socket) as engine, \
            await ReceiverClient.connect(local.receiver_socket) as consumer:
        consumer.subscribe("r")
        push = await engine.open("r", "decode", SHAPE, chunk="per-layer")
        for op in before:
            await _apply(push, op)
        try:
            for layer in range(SHAPE.layers):
                push.layer(layer)[:] = bytes([layer + 1]) * SHAPE.layer_bytes
                push.commit(layer)
        except KvwireError:
            pass  # aborted before every layer went: the push has ended, typed
        for op in after:
            await _apply(push, op)
        # The guard is against a hang, not a timing.
        try:
            result: PushResult | KvwireError = await asyncio.wait_for(push.finish(), 30)
        except KvwireError as exc:
            result = exc
        # Asked twice, the same answer: the outcome is not consumed by a wait.
        try:
            again: PushResult | KvwireError = await asyncio.wait_for(push.finish(), 30)
        except KvwireError as exc:
            again = exc
        assert type(again) is type(result)

        if isinstance(result, PushResult):
            delivered = await consumer.wait_delivered("r", timeout=30)
            assert delivered.checksum == result.checksum
            await consumer.release("r")
        else:
            await until(lambda: "r" not in local.receiver.by_req, timeout=30,
                        what="the aborted request gone at the receiver")
            queue = consumer._events.get("r")
            while queue is not None and not queue.empty():
                assert not isinstance(queue.get_nowait(), Delivered), "split outcome"

        # The same client pushes again.
        await engine.push_bytes("next", "decode", b"x" * 4096)
        await consumer.wait_delivered("next", timeout=30)
        await consumer.release("next")
    await until(lambda: local.receiver.pool.used_bytes == 0 and not local.receiver.leases
                and local.sender.staging.used_bytes == 0, timeout=30, what="pools empty")


@settings(max_examples=25)
@given(before=st.lists(st.sampled_from(OPS), max_size=3),
       after=st.lists(st.sampled_from(OPS), max_size=6))
def test_any_order_of_waits_cancels_and_aborts_ends_in_one_typed_outcome(
        before: list[str], after: list[str]) -> None:
    async def scenario() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            local = await start_local(Path(tmp))
            try:
                await _one_order(local, before, after)
            finally:
                await local.sender.stop()
                await local.receiver.stop()
    asyncio.run(scenario())


async def test_wait_for_cut_short_then_abort_is_heard_by_the_daemon(
        local: LocalDaemons) -> None:
    """The reported case: a wait that times out, then abort(), then finish()."""
    async with await SenderClient.connect(local.sender_socket) as engine:
        push = await engine.open("cut", "decode", SHAPE, chunk="per-layer")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(push.finish(), 0)  # before any commit: still waiting
        push.abort()
        with pytest.raises(KvwireError) as failure:
            await asyncio.wait_for(push.finish(), 30)
        assert failure.value.code == "aborted"
        with pytest.raises(KvwireError):
            push.layer(0)


async def test_a_shape_the_daemon_would_refuse_is_refused_by_the_client(
        local: LocalDaemons) -> None:
    async with await SenderClient.connect(local.sender_socket) as engine:
        with pytest.raises(UsageError, match="layers"):
            await engine.open("huge", "decode", RequestShape(2000, 1024))
        result = await engine.push_bytes("fine", "decode", b"y" * 1024)
        assert result.bytes == 1024


async def test_a_bad_open_past_the_client_fails_that_open_only(local: LocalDaemons) -> None:
    """An engine built on another client (or an old one) sends a bad shape: the
    daemon answers ``failed`` for that request and keeps the connection."""
    async with await SenderClient.connect(local.sender_socket) as engine:
        opening = asyncio.ensure_future(engine.open("ok", "decode", RequestShape(1, 1024)))
        bad = message("open", req="bad", peer="decode",
                      shape={"layers": 2000, "layer_bytes": 1024})
        failed: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        route = engine._route

        def watch(msg: Message) -> None:
            if getattr(msg, "req", None) == "bad" and not failed.done():
                failed.set_result(msg)
            route(msg)
        engine.conn._route = watch
        engine.conn._stream.send(bad)  # type: ignore[union-attr]  # past the client's checks
        answer = await asyncio.wait_for(failed, 30)
        assert isinstance(answer, Failed)
        assert answer.error["code"] == InvalidRequest.code
        push = await asyncio.wait_for(opening, 30)
        push.layer(0)[:] = b"z" * 1024
        push.commit(0)
        assert (await push.finish()).bytes == 1024
