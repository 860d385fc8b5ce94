"""A push at the sender: from ``open`` to its one outcome and its staging back.

The receiver commits the outcome (see ``lease``); the sender reports what
the receiver decided:

- a deadline, an engine's abort or the engine leaving is a *request* to
  abort: the sender stops posting, waits until none of its writes can still
  read staging, sends ``abort`` and waits for the verdict. ``abort_ack``
  means aborted; ``delivered`` (the receiver had every byte first) means
  delivered, and the engine hears ``finished`` marked late.
- the receiver's own ``abort`` (its engine released the request early) is
  final: the sender drains its writes, answers ``abort_ack`` and fails.
- a lost connection fails the push; the receiver frees every lease of a
  lost sender that it had not delivered. But once the last layer was
  posted, the receiver may have had every byte and delivered, its
  ``delivered`` lost with the connection: the sender then asks it on a new
  connection (``ASKING``) and reports what it says, so both engines hear
  the same outcome (kvwired.verdicts).

Staging bytes are held until the outcome is known *and* the engine has let
go of its views of them (``VIEWS_DROPPED``): a write through a stale view
can then never reach a later push that reuses the slot.
"""

from __future__ import annotations

from enum import Enum, auto

from . import StateMachine, Transition


class PushState(Enum):
    OPENING = auto()  # staging reserved, lease asked for
    STREAMING = auto()  # leased: commits become posts
    CONFIRMING = auto()  # every write placed; waiting for the receiver's delivered
    DRAINING = auto()  # abort requested: waiting until no posted write is left
    AWAITING_VERDICT = auto()  # our abort sent: delivered or abort_ack decides
    DRAINING_FOR_ACK = auto()  # the receiver aborted: our abort_ack after the drain
    DELIVERED_DRAINING = auto()  # delivered, a post's completion still on its way
    ASKING = auto()  # the link went down after the last post: asking the receiver's verdict
    DELIVERED = auto()  # outcome: delivered; staging held until the views are dropped
    FAILED = auto()  # outcome: failed; staging held until the views are dropped
    RETIRED = auto()  # staging back in the pool


class PushEvent(Enum):
    GRANTED = auto()  # the receiver's lease
    REFUSED = auto()  # no lease (refused, deadline before the grant, link down)
    ALL_POSTED = auto()  # the last layer is posted and every post has completed
    DELIVERED = auto()  # the receiver's delivered
    ABORT_REQUESTED = auto()  # deadline, the engine's abort, the engine gone
    RECEIVER_ABORT = auto()  # the receiver's abort
    POSTS_DONE = auto()  # no posted write of this push is outstanding any more
    ABORT_ACKED = auto()  # the receiver's abort_ack
    LINK_LOST = auto()  # the control or data connection is gone
    # The same, after the last layer was posted: the receiver may have delivered.
    LINK_LOST_UNDECIDED = auto()
    VERDICT_UNKNOWN = auto()  # asked, and no verdict could be had within the bound
    VIEWS_DROPPED = auto()  # the engine let go of its staging views


PushAction = Enum("PushAction", "STOP_POSTING SEND_ABORT SEND_ABORT_ACK REPORT_FINISHED "
                  "REPORT_FAILED RELEASE_STAGING ASK_VERDICT")


S, E, A = PushState, PushEvent, PushAction

_DRAIN = Transition(S.DRAINING, (A.STOP_POSTING,))
_RECEIVER_ABORTED = Transition(S.DRAINING_FOR_ACK, (A.STOP_POSTING,))
_LOST = Transition(S.FAILED, (A.STOP_POSTING, A.REPORT_FAILED))
_FINISHED = Transition(S.DELIVERED, (A.REPORT_FINISHED,))
_RETIRE = Transition(S.RETIRED, (A.RELEASE_STAGING,))
_ASK = Transition(S.ASKING, (A.STOP_POSTING, A.ASK_VERDICT))

PUSH_TABLE: dict[tuple[PushState, PushEvent], Transition[PushState, PushAction]] = {
    (S.OPENING, E.GRANTED): Transition(S.STREAMING),
    (S.OPENING, E.REFUSED): Transition(S.FAILED, (A.REPORT_FAILED,)),
    (S.STREAMING, E.ALL_POSTED): Transition(S.CONFIRMING),
    (S.STREAMING, E.DELIVERED): Transition(S.DELIVERED_DRAINING),
    (S.DELIVERED_DRAINING, E.ALL_POSTED): _FINISHED,
    (S.DELIVERED_DRAINING, E.POSTS_DONE): _FINISHED,
    (S.CONFIRMING, E.DELIVERED): _FINISHED,
    (S.STREAMING, E.ABORT_REQUESTED): _DRAIN,
    (S.CONFIRMING, E.ABORT_REQUESTED): _DRAIN,
    (S.DRAINING, E.POSTS_DONE): Transition(S.AWAITING_VERDICT, (A.SEND_ABORT,)),
    # Delivered while we drained: it wins; the drain still has to finish.
    (S.DRAINING, E.DELIVERED): Transition(S.DELIVERED_DRAINING),
    (S.AWAITING_VERDICT, E.DELIVERED): _FINISHED,
    (S.AWAITING_VERDICT, E.ABORT_ACKED): Transition(S.FAILED, (A.REPORT_FAILED,)),
    # Aborts crossing: ours is the receiver's ack, and theirs answers ours.
    (S.AWAITING_VERDICT, E.RECEIVER_ABORT): Transition(S.FAILED, (A.REPORT_FAILED,)),
    (S.DRAINING, E.RECEIVER_ABORT): Transition(S.DRAINING_FOR_ACK),
    (S.STREAMING, E.RECEIVER_ABORT): _RECEIVER_ABORTED,
    (S.CONFIRMING, E.RECEIVER_ABORT): _RECEIVER_ABORTED,
    (S.DRAINING_FOR_ACK, E.POSTS_DONE): Transition(
        S.FAILED, (A.SEND_ABORT_ACK, A.REPORT_FAILED)),
    (S.DRAINING_FOR_ACK, E.ABORT_REQUESTED): Transition(S.DRAINING_FOR_ACK),
    (S.DRAINING, E.ABORT_REQUESTED): Transition(S.DRAINING),
    (S.AWAITING_VERDICT, E.ABORT_REQUESTED): Transition(S.AWAITING_VERDICT),
    (S.DELIVERED_DRAINING, E.ABORT_REQUESTED): Transition(S.DELIVERED_DRAINING),
    (S.OPENING, E.LINK_LOST): Transition(S.FAILED, (A.REPORT_FAILED,)),
    (S.STREAMING, E.LINK_LOST): _LOST,
    (S.CONFIRMING, E.LINK_LOST): _LOST,
    (S.DRAINING, E.LINK_LOST): _LOST,
    (S.AWAITING_VERDICT, E.LINK_LOST): _LOST,
    (S.DRAINING_FOR_ACK, E.LINK_LOST): _LOST,
    # Every byte was placed and the receiver said so: the link going down
    # after that changes nothing.
    (S.DELIVERED_DRAINING, E.LINK_LOST): _FINISHED,
    (S.OPENING, E.LINK_LOST_UNDECIDED): Transition(S.FAILED, (A.REPORT_FAILED,)),
    (S.STREAMING, E.LINK_LOST_UNDECIDED): _ASK,
    (S.CONFIRMING, E.LINK_LOST_UNDECIDED): _ASK,
    (S.DRAINING, E.LINK_LOST_UNDECIDED): _ASK,
    (S.AWAITING_VERDICT, E.LINK_LOST_UNDECIDED): _ASK,
    # The receiver aborted, or delivered: nothing is left to ask.
    (S.DRAINING_FOR_ACK, E.LINK_LOST_UNDECIDED): _LOST,
    (S.DELIVERED_DRAINING, E.LINK_LOST_UNDECIDED): _FINISHED,
    # The receiver's verdict, on a new connection; a deadline cannot change
    # what it decided, so an abort asked for meanwhile waits for it too.
    (S.ASKING, E.DELIVERED): _FINISHED,
    (S.ASKING, E.RECEIVER_ABORT): Transition(S.FAILED, (A.REPORT_FAILED,)),
    (S.ASKING, E.VERDICT_UNKNOWN): Transition(S.FAILED, (A.REPORT_FAILED,)),
    (S.ASKING, E.ABORT_REQUESTED): Transition(S.ASKING),
    (S.DELIVERED, E.VIEWS_DROPPED): _RETIRE,
    (S.FAILED, E.VIEWS_DROPPED): _RETIRE,
}


class PushMachine(StateMachine[PushState, PushEvent, PushAction]):
    """One push from its grant until its staging is back in the pool."""

    TABLE = PUSH_TABLE  # type: ignore[assignment]
    INITIAL = PushState.OPENING
    what = "push"

    @property
    def ended(self) -> bool:
        """The outcome is known (the staging may still be held)."""
        return self.state in (PushState.DELIVERED, PushState.FAILED, PushState.RETIRED)

    @property
    def holds_staging(self) -> bool:
        return self.state is not PushState.RETIRED

    @property
    def posting(self) -> bool:
        return self.state is PushState.STREAMING
