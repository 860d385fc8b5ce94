"""The request lifecycles, driven directly: no sockets, no tasks, no clocks.

Each machine gets a stateful hypothesis test over random event sequences.
Then the two run together, joined by two FIFO message queues as the control
connection joins them, under every interleaving hypothesis finds of
deadlines, engine aborts and releases, posts completing and messages
arriving: both ends always settle on the same outcome, and the pool and
the staging get every byte back exactly once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, cast

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvwired.lifecycle import IllegalTransition
from kvwired.lifecycle.claim import CLAIM_TABLE, ClaimAction, ClaimEvent, ClaimMachine, ClaimState
from kvwired.lifecycle.key import KEY_TABLE, KeyState
from kvwired.lifecycle.lease import (
    LEASE_TABLE,
    LeaseAction,
    LeaseEvent,
    LeaseMachine,
    LeaseState,
    Outcome,
)
from kvwired.lifecycle.link import LINK_TABLE, LinkAction, LinkEvent, LinkMachine, LinkState
from kvwired.lifecycle.push import PUSH_TABLE, PushAction, PushEvent, PushMachine, PushState
from kvwired.lifecycle.staging import (
    STAGING_TABLE,
    StagingAction,
    StagingEvent,
    StagingMachine,
    StagingState,
)
from kvwired.receiver.keys import LeaseKeys
from kvwired.receiver.session import SenderSession
from kvwired.transport.base import Responder

# ------------------------------------------------------------ each on its own


class LeaseAlone(RuleBasedStateMachine):
    """Any event in any order: the table decides, bytes are freed once."""

    def __init__(self) -> None:
        super().__init__()
        self.lease = LeaseMachine("r")
        self.freed = 0
        self.outcomes: list[Outcome] = []

    @rule(event=st.sampled_from(LeaseEvent))
    def apply(self, event: LeaseEvent) -> None:
        before = self.lease.state
        if not self.lease.can(event):
            with pytest.raises(IllegalTransition):
                self.lease.apply(event)
            assert self.lease.state is before  # an illegal event changes nothing
            return
        actions = self.lease.apply(event)
        self.freed += actions.count(LeaseAction.FREE)
        if self.lease.outcome is not Outcome.PENDING:
            self.outcomes.append(self.lease.outcome)

    @invariant()
    def bytes_are_held_until_freed_once(self) -> None:
        assert self.freed == (0 if self.lease.holds_bytes else 1)

    @invariant()
    def the_outcome_never_changes(self) -> None:
        assert len(set(self.outcomes)) <= 1

    @invariant()
    def nothing_moves_a_freed_lease(self) -> None:
        if self.lease.state is LeaseState.FREED:
            assert not any(self.lease.can(event) for event in LeaseEvent)


class PushAlone(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.push = PushMachine("r")
        self.released = 0
        self.reports: list[PushAction] = []

    @rule(event=st.sampled_from(PushEvent))
    def apply(self, event: PushEvent) -> None:
        if not self.push.can(event):
            with pytest.raises(IllegalTransition):
                self.push.apply(event)
            return
        actions = self.push.apply(event)
        self.released += actions.count(PushAction.RELEASE_STAGING)
        self.reports += [a for a in actions
                         if a in (PushAction.REPORT_FINISHED, PushAction.REPORT_FAILED)]

    @invariant()
    def one_report_and_staging_back_once(self) -> None:
        assert len(self.reports) <= 1
        assert self.released == (0 if self.push.holds_staging else 1)
        if self.push.ended:
            assert len(self.reports) == 1

    @invariant()
    def nothing_moves_a_retired_push(self) -> None:
        if self.push.state is PushState.RETIRED:
            assert not any(self.push.can(event) for event in PushEvent)


class LinkAlone(RuleBasedStateMachine):
    """Holders fail whenever the connection goes; a retired link stays retired."""

    def __init__(self) -> None:
        super().__init__()
        self.link = LinkMachine("decode")
        self.retired = False
        self.connection_open = False
        self.bye = 0

    @rule(event=st.sampled_from(LinkEvent))
    def apply(self, event: LinkEvent) -> None:
        if not self.link.can(event):
            with pytest.raises(IllegalTransition):
                self.link.apply(event)
            return
        actions = self.link.apply(event)
        if LinkAction.START_READING in actions:
            self.connection_open = True
        if LinkAction.CLOSE_CONNECTION in actions:
            self.connection_open = False
        self.bye += actions.count(LinkAction.SEND_BYE)
        self.retired = self.retired or event is LinkEvent.RETIRE

    @invariant()
    def a_retired_link_is_never_used_again(self) -> None:
        if self.retired:
            assert not self.link.usable
            assert not self.link.can(LinkEvent.CONNECT)

    @invariant()
    def a_link_that_is_down_holds_no_connection(self) -> None:
        if self.link.state in (LinkState.DOWN, LinkState.RETIRED):
            assert not self.connection_open
        assert self.bye <= 1


TestLeaseAlone = LeaseAlone.TestCase
TestPushAlone = PushAlone.TestCase
TestLinkAlone = LinkAlone.TestCase


class SlowRevoker:
    """A responder whose revocations end when the test says (as rxe's do: a
    key is dead only once the queue pair has no write under it in flight)."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.pending: list[Callable[[], None]] = []

    def revoke(self, key: int, then: Callable[[], None]) -> None:
        self.asked.append(key)
        self.pending.append(then)


class KeysAlone(RuleBasedStateMachine):
    """A lease's keys on two channels, revoked when all land and again when
    freed, in any order against the responders' confirmations: each key is
    revoked once, and what waits (the slot's return) runs once, after every
    responder confirmed, never before."""

    def __init__(self) -> None:
        super().__init__()
        self.revokers = [SlowRevoker(), SlowRevoker()]
        session = SenderSession(conn=cast(Any, None),
                                responders=cast(list[Responder], self.revokers))
        self.keys = LeaseKeys("r", session, [11, 22])
        self.waiters = 0
        self.ran = 0

    @rule(wait=st.booleans())
    def revoke(self, wait: bool) -> None:
        if wait:
            self.waiters += 1
        self.keys.revoke(self._ran if wait else None)

    def _ran(self) -> None:
        assert all(not r.pending for r in self.revokers), "ran before every confirmation"
        self.ran += 1

    @rule(channel=st.sampled_from([0, 1]))
    def responder_confirms(self, channel: int) -> None:
        revoker = self.revokers[channel]
        if revoker.pending:
            revoker.pending.pop(0)()

    @invariant()
    def each_key_is_revoked_once_on_its_own_channel(self) -> None:
        asked = [r.asked for r in self.revokers]
        assert asked in ([[], []], [[11], [22]])
        assert self.keys.takes_writes == (asked == [[], []])

    @invariant()
    def waiters_run_once_when_revoked(self) -> None:
        revoked = self.keys.machine.state is KeyState.REVOKED
        assert self.ran == (self.waiters if revoked else 0)


TestKeysAlone = KeysAlone.TestCase


class Claims(RuleBasedStateMachine):
    """Engines subscribing, letting go and dying around a lease's delivery, its
    TTL and its end, in any order: a delivered lease that some engine holds
    is never reclaimed; one nobody will release always is (at once when its
    holders died, when the TTL fires when they let go); the TTL runs exactly
    while it is delivered and unheld; and it is reclaimed at most once."""

    def __init__(self) -> None:
        super().__init__()
        self.claim = ClaimMachine("r")
        self.holders = 0
        self.delivered = False
        self.lease_ended = False
        self.ttl_running = False
        self.reclaimed: list[ClaimAction] = []
        self.died_since_held = False  # every holder since the last subscribe died

    def _apply(self, event: ClaimEvent) -> None:
        for action in self.claim.apply(event):
            if action is ClaimAction.START_TTL:
                self.ttl_running = True
            elif action is ClaimAction.STOP_TTL:
                self.ttl_running = False
            else:
                self.reclaimed.append(action)
                self.ttl_running = False
                self._apply(ClaimEvent.LEASE_ENDED)  # the reclaim frees the lease
                self.lease_ended = True

    @precondition(lambda self: not self.lease_ended)
    @rule()
    def an_engine_subscribes(self) -> None:
        self.holders += 1
        self.died_since_held = False
        self._apply(ClaimEvent.SUBSCRIBED)

    @precondition(lambda self: not self.lease_ended and self.holders > 0)
    @rule(dies=st.booleans())
    def an_engine_leaves(self, dies: bool) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.died_since_held = dies
            self._apply(ClaimEvent.LAST_DIED if dies else ClaimEvent.LAST_LET_GO)

    @precondition(lambda self: not self.lease_ended and not self.delivered)
    @rule()
    def it_is_delivered(self) -> None:
        self.delivered = True
        self._apply(ClaimEvent.DELIVERED)

    @precondition(lambda self: self.ttl_running)
    @rule()
    def the_ttl_fires(self) -> None:
        self._apply(ClaimEvent.TTL_EXPIRED)

    @precondition(lambda self: not self.lease_ended)
    @rule()
    def it_is_released_or_aborted(self) -> None:
        self.lease_ended = True
        self._apply(ClaimEvent.LEASE_ENDED)

    @rule()
    def time_passes(self) -> None:
        # Always possible, also once the lease has ended: its claim is over.
        assert self.claim.over == self.lease_ended

    @invariant()
    def reclaimed_at_most_once_and_only_when_nobody_holds_it(self) -> None:
        assert len(self.reclaimed) <= 1
        if self.reclaimed:
            assert self.holders == 0 and self.delivered
            assert self.claim.state is ClaimState.RECLAIMED

    @invariant()
    def the_ttl_runs_exactly_while_delivered_and_unheld(self) -> None:
        if not self.lease_ended:
            assert self.ttl_running == (self.delivered and self.holders == 0
                                        and not self.died_since_held)

    @invariant()
    def nobody_left_to_release_it_means_reclaimed(self) -> None:
        if self.delivered and self.holders == 0 and self.died_since_held:
            assert self.lease_ended and self.reclaimed


TestClaims = Claims.TestCase


class Staging(RuleBasedStateMachine):
    """The engine dropping its views and the outcome becoming known, in either
    order and with drops repeated: the staging goes back once, after both."""

    def __init__(self) -> None:
        super().__init__()
        self.staging = StagingMachine("r")
        self.dropped = False
        self.outcome = False
        self.returned = 0

    @rule()
    def the_engine_drops_its_views(self) -> None:
        self.dropped = True
        self.returned += self.staging.apply(StagingEvent.VIEWS_DROPPED).count(
            StagingAction.RETURN)

    @precondition(lambda self: not self.outcome)
    @rule()
    def the_outcome_is_known(self) -> None:
        self.outcome = True
        self.returned += self.staging.apply(StagingEvent.OUTCOME_KNOWN).count(
            StagingAction.RETURN)

    @invariant()
    def back_once_after_both(self) -> None:
        assert self.returned == (1 if self.dropped and self.outcome else 0)
        assert (self.staging.state is StagingState.RETURNED) == (self.returned == 1)


TestStaging = Staging.TestCase


def test_every_state_is_reachable_and_every_row_names_real_states() -> None:
    assert {s for s, _ in LEASE_TABLE} | {t.target for t in LEASE_TABLE.values()} == set(
        LeaseState)
    assert {s for s, _ in PUSH_TABLE} | {t.target for t in PUSH_TABLE.values()} == set(
        PushState)
    assert {s for s, _ in LINK_TABLE} | {t.target for t in LINK_TABLE.values()} == set(
        LinkState)
    assert {s for s, _ in KEY_TABLE} | {t.target for t in KEY_TABLE.values()} == set(KeyState)
    assert {s for s, _ in CLAIM_TABLE} | {t.target for t in CLAIM_TABLE.values()} == set(
        ClaimState)
    assert {s for s, _ in STAGING_TABLE} | {t.target for t in STAGING_TABLE.values()} == set(
        StagingState)


# -------------------------------------------------------- both ends together


class BothEnds(RuleBasedStateMachine):
    """A granted push and its lease, the control connection between them.

    Every rule is something that can happen in a real run; each end reacts
    only to what it has received. Messages for a lease or push the other
    end has already forgotten are dropped, as the daemons drop them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.push = PushMachine("r")
        self.push.apply(PushEvent.GRANTED)
        self.lease = LeaseMachine("r")
        self.to_receiver: deque[str] = deque()
        self.to_sender: deque[str] = deque()
        self.posted = False  # every layer posted (the writes are on their way)
        self.outstanding = False  # a post whose completion has not come back
        self.landed = False  # the receiver saw the last immediate
        self.lost = False
        self.unanswered = False  # the sender asked for the verdict and had none
        self.engine_released = False
        self.freed = 0
        self.released = 0
        self.sender_reports: list[PushAction] = []

    # -- sender
    def _push(self, event: PushEvent) -> None:
        for action in self.push.apply(event):
            if action is PushAction.SEND_ABORT:
                self.to_receiver.append("abort")
            elif action is PushAction.SEND_ABORT_ACK:
                self.to_receiver.append("abort_ack")
            elif action is PushAction.RELEASE_STAGING:
                self.released += 1
            elif action in (PushAction.REPORT_FINISHED, PushAction.REPORT_FAILED):
                self.sender_reports.append(action)
        # No write outstanding: a drain is over at once.
        if not self.outstanding and self.push.can(PushEvent.POSTS_DONE) and self.push.state in (
                PushState.DRAINING, PushState.DRAINING_FOR_ACK):
            self._push(PushEvent.POSTS_DONE)

    @precondition(lambda self: self.push.posting and not self.posted)
    @rule()
    def post_every_layer(self) -> None:
        self.posted = self.outstanding = True

    @precondition(lambda self: self.outstanding and not self.lost)
    @rule()
    def posts_complete(self) -> None:
        self.outstanding = False
        if self.push.state in (PushState.STREAMING, PushState.DELIVERED_DRAINING):
            self._push(PushEvent.ALL_POSTED)
        elif self.push.can(PushEvent.POSTS_DONE):
            self._push(PushEvent.POSTS_DONE)

    @precondition(lambda self: not self.push.ended and not self.lost)
    @rule()
    def deadline_or_engine_abort(self) -> None:
        self._push(PushEvent.ABORT_REQUESTED)

    @precondition(lambda self: bool(self.to_sender) and not self.lost)
    @rule()
    def sender_reads(self) -> None:
        kind = self.to_sender.popleft()
        if self.push.ended:
            return  # the sender has forgotten the lease
        event = {"delivered": PushEvent.DELIVERED, "abort": PushEvent.RECEIVER_ABORT,
                 "abort_ack": PushEvent.ABORT_ACKED}[kind]
        self._push(event)

    # -- receiver
    def _lease(self, event: LeaseEvent) -> None:
        for action in self.lease.apply(event):
            if action is LeaseAction.SEND_DELIVERED:
                self.to_sender.append("delivered")
            elif action is LeaseAction.SEND_ABORT:
                self.to_sender.append("abort")
            elif action is LeaseAction.SEND_ABORT_ACK:
                self.to_sender.append("abort_ack")
            elif action is LeaseAction.FREE:
                self.freed += 1

    @precondition(lambda self: self.posted and not self.landed
                  and self.lease.state is LeaseState.FILLING)
    @rule()
    def last_immediate_lands(self) -> None:
        self.landed = True
        self._lease(LeaseEvent.ALL_LANDED)

    @precondition(lambda self: self.lease.state is LeaseState.LANDED)
    @rule()
    def checksum_done(self) -> None:
        self._lease(LeaseEvent.CHECKED)

    @precondition(lambda self: self.lease.state is not LeaseState.FREED)
    @rule()
    def decode_engine_releases(self) -> None:
        self.engine_released = True
        self._lease(LeaseEvent.ENGINE_RELEASE)

    @precondition(lambda self: bool(self.to_receiver) and not self.lost)
    @rule()
    def receiver_reads(self) -> None:
        kind = self.to_receiver.popleft()
        if self.lease.state is LeaseState.FREED:
            return  # the receiver has forgotten the lease
        self._lease(LeaseEvent.SENDER_ABORT if kind == "abort" else LeaseEvent.SENDER_ACK)

    @precondition(lambda self: not self.lost)
    @rule()
    def connection_lost(self) -> None:
        self.lost = True
        self.to_receiver.clear()
        self.to_sender.clear()
        self.outstanding = False  # the channel is torn down: no write is left
        if not self.push.ended:
            # Once the last layer is posted the receiver may have it all.
            self._push(PushEvent.LINK_LOST_UNDECIDED if self.posted else PushEvent.LINK_LOST)
        if self.lease.state is not LeaseState.FREED:
            self._lease(LeaseEvent.SESSION_LOST)

    @precondition(lambda self: self.push.state is PushState.ASKING
                  and self.lease.outcome is not Outcome.PENDING)
    @rule()
    def sender_reconnects_and_hears_the_verdict(self) -> None:
        self._push(PushEvent.DELIVERED if self.lease.outcome is Outcome.DELIVERED
                   else PushEvent.RECEIVER_ABORT)

    @precondition(lambda self: self.push.state is PushState.ASKING)
    @rule()
    def the_receiver_stays_out_of_reach(self) -> None:
        self.unanswered = True
        self._push(PushEvent.VERDICT_UNKNOWN)

    @precondition(lambda self: self.push.ended)
    @rule()
    def time_passes(self) -> None:
        """Nothing happens: the run may go on after both ends settled."""

    # -- what must hold
    @invariant()
    def the_ends_never_disagree_unless_the_verdict_was_out_of_reach(self) -> None:
        if self.unanswered or not self.push.ended or self.lease.outcome is Outcome.PENDING:
            return
        delivered_here = self.push.state is PushState.DELIVERED or (
            self.sender_reports == [PushAction.REPORT_FINISHED])
        assert delivered_here == (self.lease.outcome is Outcome.DELIVERED)

    @invariant()
    def a_delivered_request_stays_until_its_engine_releases_it(self) -> None:
        if self.lease.outcome is Outcome.DELIVERED and not self.engine_released:
            assert self.lease.holds_bytes

    @invariant()
    def each_end_reports_once_and_frees_once(self) -> None:
        assert len(self.sender_reports) <= 1 and self.freed <= 1

    def teardown(self) -> None:
        """Let everything in flight happen; then both ends agree, nothing is held."""
        for _ in range(50):
            if self.outstanding and not self.lost:
                self.posts_complete()
            elif self.to_receiver and not self.lost:
                self.receiver_reads()
            elif self.to_sender and not self.lost:
                self.sender_reads()
            elif self.push.posting and not self.posted:
                self.post_every_layer()
            elif self.posted and not self.landed and self.lease.state is LeaseState.FILLING \
                    and not self.lost:
                self.last_immediate_lands()
            elif self.lease.state is LeaseState.LANDED:
                self.checksum_done()
            elif self.push.state is PushState.ASKING:
                self.sender_reconnects_and_hears_the_verdict()
            else:
                break
        assert self.push.ended, self.push.state
        if not self.unanswered:
            assert self.lease.outcome is not Outcome.PENDING
            finished = self.sender_reports == [PushAction.REPORT_FINISHED]
            assert finished == (self.lease.outcome is Outcome.DELIVERED)
        # The engines let go: decode releases what it holds, prefill its views.
        if self.lease.state is LeaseState.HELD:
            self.decode_engine_releases()
        self._push(PushEvent.VIEWS_DROPPED)
        assert (self.freed, self.released) == (1, 1)
        assert self.lease.state is LeaseState.FREED and self.push.state is PushState.RETIRED


BothEnds.TestCase.settings = settings(max_examples=1000, stateful_step_count=30,
                                      deadline=None)
TestBothEnds = BothEnds.TestCase
