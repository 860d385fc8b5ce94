"""``PostLedger``: posts lost with a failed channel are posted again, in order,
and every post ends once, whatever the channel does."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwired.errors import PeerLost, TransportError
from kvwired.sender.ledger import PostLedger
from kvwired.transport.base import DataChannel, Write


class FakeChannel(DataChannel):
    """Keeps its posts; the test completes or fails them."""

    kind = "fake"

    def __init__(self) -> None:
        self.posted: list[tuple[int | None, int, asyncio.Future[None]]] = []

    def post(self, writes: Sequence[Write], imm: int | None = None,
             key: int | None = None) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._error is not None:
            future.set_exception(self._error)
        else:
            assert key is not None
            self.posted.append((imm, key, future))
        return future

    @property
    def pending_writes(self) -> int:
        return sum(not f.done() for _, _, f in self.posted)

    def complete_next(self) -> bool:
        for _, _, future in self.posted:
            if not future.done():
                future.set_result(None)
                return True
        return False

    def _take_outstanding(self) -> list[asyncio.Future[None]]:
        return [f for _, _, f in self.posted if not f.done()]

    def _tear_down(self) -> None:
        pass

    @property
    def alive(self) -> bool:
        return self._error is None


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_lost_posts_go_again_in_order_under_the_new_keys() -> None:
    ledger = PostLedger()
    ledger.reset(1)
    old = FakeChannel()
    outers = [ledger.post(0, old, [Write(n, n, 1)], n, lease=7, key=100) for n in range(4)]
    old.complete_next()
    ledger.replacing.add(0)
    old.fail(TransportError("retry exceeded"))
    await _settle()
    assert outers[0].done() and not any(o.done() for o in outers[1:])
    new = FakeChannel()
    assert ledger.repost(0, new, {7: 200}) == 3
    assert [(imm, key) for imm, key, _ in new.posted] == [(1, 200), (2, 200), (3, 200)]
    while new.complete_next():
        pass
    await _settle()
    assert all(o.done() and o.exception() is None for o in outers)


async def test_a_lease_without_a_new_key_takes_no_writes_and_its_posts_are_done() -> None:
    ledger = PostLedger()
    ledger.reset(1)
    old = FakeChannel()
    outer = ledger.post(0, old, [Write(0, 0, 1)], 1, lease=7, key=100)
    ledger.replacing.add(0)
    old.fail(TransportError("retry exceeded"))
    await _settle()
    assert ledger.repost(0, FakeChannel(), {}) == 0
    assert outer.done() and outer.exception() is None


async def test_a_holder_that_stopped_posting_gets_its_lost_posts_failed_not_resent() -> None:
    """An abort drains: its writes lost with the channel are never placed, and
    the drain must not wait for a replacement to send them again."""
    ledger = PostLedger()
    ledger.reset(1)
    old = FakeChannel()
    aborting = ledger.post(0, old, [Write(0, 0, 1)], 1, lease=7, key=100)
    posting = ledger.post(0, old, [Write(1, 1, 1)], 2, lease=8, key=101)
    ledger.replacing.add(0)
    lost = TransportError("retry exceeded")
    old.fail(lost)
    await _settle()
    new = FakeChannel()
    assert ledger.repost(0, new, {7: 200, 8: 201}, wanted=lambda lease: lease == 8,
                         dropped=lost) == 1
    assert aborting.exception() is lost
    assert [(imm, key) for imm, key, _ in new.posted] == [(2, 201)]
    new.complete_next()
    await _settle()
    assert posting.done() and posting.exception() is None


async def test_without_a_replacement_a_failed_post_fails() -> None:
    ledger = PostLedger()
    ledger.reset(1)
    old = FakeChannel()
    outer = ledger.post(0, old, [Write(0, 0, 1)], 1, lease=7, key=100)
    old.fail(TransportError("remote access"))
    await _settle()
    assert isinstance(outer.exception(), TransportError)


# A channel's life: post, complete the oldest, fail (then replace or not).
STEPS = st.lists(st.sampled_from(["post", "complete", "fail-replace", "fail-give-up"]),
                 max_size=40)


@settings(max_examples=150, deadline=None)
@given(STEPS, st.booleans())
def test_every_post_ends_once_and_reposts_keep_the_order(steps: list[str],
                                                         keyed: bool) -> None:
    async def run() -> None:
        ledger = PostLedger()
        ledger.reset(1)
        channel = FakeChannel()
        outers: list[asyncio.Future[None]] = []
        gone = False
        for step in steps:
            if gone:
                break
            if step == "post":
                outers.append(ledger.post(0, channel, [Write(0, 0, 1)], len(outers),
                                          lease=1, key=1))
            elif step == "complete":
                channel.complete_next()
            else:
                if step == "fail-replace":
                    ledger.replacing.add(0)
                channel.fail(TransportError("wire"))
                await _settle()
                if step == "fail-replace":
                    waiting = [n for n, o in enumerate(outers) if not o.done()]
                    channel = FakeChannel()
                    ledger.repost(0, channel, {1: 2} if keyed else {})
                    if keyed:
                        # Posted again in the order they were first posted.
                        assert [imm for imm, _, _ in channel.posted] == waiting
                else:
                    ledger.fail_all(PeerLost("link down"))
                    gone = True
            await _settle()
        while channel.complete_next():
            await _settle()
        await _settle()
        # Nothing is left hanging: each post ended, placed or failed.
        assert all(o.done() for o in outers)
        if not gone and not any(s == "fail-give-up" for s in steps):
            assert all(o.exception() is None for o in outers)
    asyncio.run(run())


async def test_a_channel_failing_after_the_link_ended_its_posts_leaves_nothing_unread() -> None:
    # The link gives up first (its control connection saw the stall), then the
    # stalled channel fails what it still held: the inner futures' errors
    # are nobody's to await, and none may surface as "exception was never
    # retrieved" when collected.
    loop = asyncio.get_running_loop()
    unread: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    try:
        ledger = PostLedger()
        ledger.reset(1)
        channel = FakeChannel()
        outers = [ledger.post(0, channel, [Write(n, n, 1)], n, lease=7, key=100)
                  for n in range(3)]
        ledger.fail_all(PeerLost("link lost"))
        channel.fail(TransportError("placed nothing for 6.2 s"), quiet=True)
        await _settle()
        assert all(isinstance(o.exception(), PeerLost) for o in outers)
        del outers, channel, ledger
        gc.collect()
        await _settle()
        assert unread == []
    finally:
        loop.set_exception_handler(None)
