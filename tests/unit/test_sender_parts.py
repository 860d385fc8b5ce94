"""The sender link's I/O-free parts, driven without a socket: credits,
requests and their undo, lease holders."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwired.errors import DuplicateRequest, KvwireError, PeerLost, PoolFull, ProtocolError
from kvwired.protocol import Message
from kvwired.protocol import control as ctl
from kvwired.sender.credits import Credits
from kvwired.sender.holders import Holders
from kvwired.sender.requests import Requests

from ..conftest import until

# ------------------------------------------------------------------ credits

CHANNELS = 3
WELCOME = 4

credit_steps = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, CHANNELS), st.integers(1, 5)),
    st.tuples(st.just("take"), st.integers(0, CHANNELS - 1), st.just(0)),
    st.tuples(st.just("freeze"), st.integers(0, CHANNELS - 1), st.just(0)),
    st.tuples(st.just("thaw"), st.integers(0, CHANNELS - 1), st.integers(-3, 6)),
), max_size=60)


@given(credit_steps)
def test_credits_never_go_negative_and_a_frozen_channel_counts_nothing_returned(
        steps: list[tuple[str, int, int]]) -> None:
    """Against a model: returns for a channel being replaced are void, and its
    replacement starts with what ``thaw`` says (never below zero)."""

    async def run() -> None:
        credits = Credits()
        credits.reset(CHANNELS, WELCOME)
        model, frozen = [WELCOME] * CHANNELS, set[int]()
        for op, channel, n in steps:
            if op == "add":
                credits.add(n, channel)
                if channel < CHANNELS and channel not in frozen:
                    model[channel] += n
            elif op == "take" and model[channel] > 0:
                await credits.take(channel, lambda: True, lambda: PeerLost("gone"))
                model[channel] -= 1
            elif op == "freeze":
                credits.freeze(channel)
                frozen.add(channel)
                model[channel] = 0
            elif op == "thaw":
                credits.thaw(channel, n)
                frozen.discard(channel)
                model[channel] = max(0, n)
            assert credits.counts == model
            assert min(credits.counts) >= 0
        assert credits.total == sum(model)
    asyncio.run(run())


async def test_a_poster_waits_for_a_credit_and_wakes_when_one_comes_back() -> None:
    credits = Credits()
    credits.reset(1, 0)
    taking = asyncio.create_task(credits.take(0, lambda: True, lambda: PeerLost("gone")))
    await asyncio.sleep(0)
    assert not taking.done()
    credits.add(1, 0)
    await asyncio.wait_for(taking, 5)
    assert credits.counts == [0]


async def test_a_poster_waiting_for_a_credit_fails_when_the_link_goes() -> None:
    credits = Credits()
    credits.reset(1, 0)
    up = True
    taking = asyncio.create_task(credits.take(0, lambda: up, lambda: PeerLost("link gone")))
    await asyncio.sleep(0)
    up = False
    credits.clear()
    with pytest.raises(PeerLost, match="link gone"):
        await asyncio.wait_for(taking, 5)


# ----------------------------------------------------------------- requests


SHAPE = {"layers": 1, "layer_bytes": 1}


def _lease(req: str, lease: int = 7) -> ctl.Lease:
    return ctl.Lease(req=req, lease=lease, offset=0, keys=[1])


def _abort_of(lease: ctl.Lease) -> Message:
    return ctl.Abort(req=lease.req, lease=lease.lease, error=PeerLost("gone").to_wire())


async def test_an_answer_goes_to_the_request_that_asked_for_it() -> None:
    sent: list[Message] = []
    requests = Requests("decode", sent.append)
    asking = asyncio.create_task(requests.ask(ctl.Ask(req="r1", lease=7), ctl.Verdict))
    await asyncio.sleep(0)
    assert sent == [ctl.Ask(req="r1", lease=7)] and requests.pending
    requests.answered(ctl.Verdict(req="r1", lease=7, outcome="delivered", checksum=5))
    verdict = await asyncio.wait_for(asking, 5)
    assert verdict.checksum == 5 and not requests.pending


async def test_a_refusal_raises_its_error_and_a_wrong_answer_is_a_protocol_error() -> None:
    requests = Requests("decode", lambda msg: None)
    refused = asyncio.create_task(requests.ask(ctl.Ask(req="r1", lease=1), ctl.Verdict))
    wrong = asyncio.create_task(requests.ask(ctl.Ask(req="r2", lease=2), ctl.Verdict))
    await asyncio.sleep(0)
    requests.answered(ctl.Refused(req="r1", error=PoolFull("full").to_wire()))
    requests.answered(_lease("r2"))
    with pytest.raises(PoolFull, match="full"):
        await refused
    with pytest.raises(ProtocolError, match="answered r2 with 'lease'"):
        await wrong


async def test_the_same_request_twice_in_flight_is_refused() -> None:
    requests = Requests("decode", lambda msg: None)
    first = asyncio.create_task(requests.ask(ctl.Ask(req="r1", lease=1), ctl.Verdict))
    await asyncio.sleep(0)
    with pytest.raises(DuplicateRequest):
        await requests.ask(ctl.Ask(req="r1", lease=1), ctl.Verdict)
    first.cancel()


async def test_a_grant_that_comes_after_its_caller_left_is_undone() -> None:
    """No lease outlives the request that asked for it."""
    sent: list[Message] = []
    requests = Requests("decode", sent.append)
    opening = asyncio.create_task(requests.ask(
        ctl.Open(req="r1", shape=SHAPE), ctl.Lease, _abort_of))
    await asyncio.sleep(0)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    requests.answered(_lease("r1"))
    assert sent[-1] == _abort_of(_lease("r1"))
    requests.answered(_lease("r1"))  # a second answer names nothing
    assert len(sent) == 2


async def test_a_grant_and_its_cancellation_in_the_same_turn_is_undone() -> None:
    sent: list[Message] = []
    requests = Requests("decode", sent.append)
    opening = asyncio.create_task(requests.ask(
        ctl.Open(req="r1", shape=SHAPE), ctl.Lease, _abort_of))
    await asyncio.sleep(0)
    requests.answered(_lease("r1"))
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert sent[-1] == _abort_of(_lease("r1"))


async def test_a_refusal_after_the_caller_left_needs_no_undo() -> None:
    sent: list[Message] = []
    requests = Requests("decode", sent.append)
    opening = asyncio.create_task(requests.ask(
        ctl.Open(req="r1", shape=SHAPE), ctl.Lease, _abort_of))
    await asyncio.sleep(0)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    requests.answered(ctl.Refused(req="r1", error=PoolFull("full").to_wire()))
    assert len(sent) == 1


async def test_every_waiter_fails_with_the_links_end_and_abandoned_grants_are_forgotten() -> None:
    sent: list[Message] = []
    requests = Requests("decode", sent.append)
    waiting = asyncio.create_task(requests.ask(ctl.Ask(req="r1", lease=1), ctl.Verdict))
    left = asyncio.create_task(requests.ask(ctl.Open(req="r2", shape=SHAPE), ctl.Lease,
                                            _abort_of))
    await asyncio.sleep(0)
    left.cancel()
    with pytest.raises(asyncio.CancelledError):
        await left
    requests.fail_all(PeerLost("receiver decode went away"))
    with pytest.raises(PeerLost, match="went away"):
        await waiting
    # The receiver freed r2's lease with the connection: nothing to undo.
    requests.answered(_lease("r2"))
    assert len(sent) == 2 and not requests.pending


# ------------------------------------------------------------------ holders


class Holder:
    def __init__(self, takes_writes: bool = True) -> None:
        self.events: list[str] = []
        self._takes_writes = takes_writes

    def delivered(self, checksum: int) -> None:
        self.events.append(f"delivered {checksum}")

    def abort_acked(self) -> None:
        self.events.append("acked")

    def fail(self, error: KvwireError, *, by_receiver: bool = False) -> None:
        self.events.append(f"failed {'by receiver' if by_receiver else 'link'}: {error.message}")

    @property
    def takes_writes(self) -> bool:
        return self._takes_writes


async def test_a_leases_news_goes_to_its_holder_and_none_to_a_lease_not_held() -> None:
    holders = Holders(lambda error: None)
    one, two = Holder(), Holder(takes_writes=False)
    holders.attach(1, one, [10, 11])
    holders.attach(2, two, [20, 21])
    holders.delivered(1, 99)
    holders.aborted(2, PeerLost("refused"))
    holders.abort_acked(2)
    holders.delivered(3, 1)  # ended here already: dropped
    assert one.events == ["delivered 99"]
    assert two.events == ["failed by receiver: refused", "acked"]
    assert holders.takes_writes(1) and not holders.takes_writes(2)
    assert not holders.takes_writes(3)


async def test_a_replaced_channel_rekeys_the_leases_in_place() -> None:
    holders = Holders(lambda error: None)
    keys = [10, 11]
    holders.attach(1, Holder(), keys)
    holders.rekey(1, {1: 111, 5: 555})
    assert keys == [10, 111] and holders.keys(5) is None


async def test_unheld_waits_for_the_last_holder_and_the_links_end_fails_them_all() -> None:
    holders = Holders(lambda error: None)
    one, two = Holder(), Holder()
    holders.attach(1, one)
    holders.attach(2, two)
    waiting = asyncio.create_task(holders.unheld())
    holders.fail_all(PeerLost("receiver decode went away"))
    assert one.events == two.events == ["failed link: receiver decode went away"]
    holders.detach(1)
    await asyncio.sleep(0)
    assert not waiting.done() and holders
    holders.detach(2)
    await asyncio.wait_for(waiting, 5)
    assert not holders


async def test_an_abort_left_unanswered_loses_the_link_and_an_answer_stops_the_clock() -> None:
    lost: list[str] = []
    holders = Holders(lambda error: lost.append(error.message))
    answered, ignored, detached = Holder(), Holder(), Holder()
    for lease, holder in ((1, answered), (2, ignored), (3, detached)):
        holders.attach(lease, holder)
        holders.owe_answer(lease, 0.05, PeerLost(f"no answer on {lease}"))
    holders.abort_acked(1)
    holders.detach(3)
    # Equal bounds end in the same turn of the loop: once lease 2's silence
    # is heard, 1's and 3's bounds are past too.
    await until(lambda: bool(lost), what="the silence noticed")
    assert lost == ["no answer on 2"]


async def test_a_lost_link_owes_no_answers_any_more() -> None:
    lost: list[str] = []
    holders = Holders(lambda error: lost.append(error.message))
    holders.attach(1, Holder())
    holders.owe_answer(1, 0.05, PeerLost("no answer"))
    holders.fail_all(PeerLost("receiver decode went away"))
    # A second link's bound, set after the first's, ends after it.
    later = Holders(lambda error: lost.append("the second link's bound"))
    later.attach(1, Holder())
    later.owe_answer(1, 0.05, PeerLost("no answer"))
    await until(lambda: bool(lost), what="the second bound past")
    assert lost == ["the second link's bound"]
