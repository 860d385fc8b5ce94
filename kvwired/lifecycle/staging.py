"""A push's staging at the sender: back in the pool only when nobody can touch it.

The engine that opened a push writes its layers through views of the staging
(a mapping of the sender's pool). The staging may go back to the pool, and to
another push, only when both hold: the push's outcome is known (no posted
write still reads it; ``push``), and the engine has let go of its views
(``dropped``, or its connection gone), so a write through a stale view can
never reach a later push. The two happen in either order: an engine may drop
its views while the push is still streaming (it committed every layer and
has nothing more to write), or long after the outcome.
"""

from __future__ import annotations

from enum import Enum, auto

from . import StateMachine, Transition


class StagingState(Enum):
    VIEWED = auto()  # the engine may hold views; the outcome is not known
    UNVIEWED = auto()  # views dropped; the outcome is not known
    SETTLED = auto()  # the outcome is known; the engine may still hold views
    RETURNED = auto()  # back in the pool


class StagingEvent(Enum):
    VIEWS_DROPPED = auto()  # the engine let go (said so, or left)
    OUTCOME_KNOWN = auto()  # delivered or failed: no posted write reads it any more


# RETURN: the push retires (its machine's VIEWS_DROPPED) and the staging goes back.
StagingAction = Enum("StagingAction", "RETURN")

S, E, A = StagingState, StagingEvent, StagingAction

STAGING_TABLE: dict[tuple[StagingState, StagingEvent],
                    Transition[StagingState, StagingAction]] = {
    (S.VIEWED, E.VIEWS_DROPPED): Transition(S.UNVIEWED),
    (S.VIEWED, E.OUTCOME_KNOWN): Transition(S.SETTLED),
    (S.UNVIEWED, E.OUTCOME_KNOWN): Transition(S.RETURNED, (A.RETURN,)),
    (S.SETTLED, E.VIEWS_DROPPED): Transition(S.RETURNED, (A.RETURN,)),
    # An engine may say it dropped its views more than once (and then leave).
    (S.UNVIEWED, E.VIEWS_DROPPED): Transition(S.UNVIEWED),
    (S.RETURNED, E.VIEWS_DROPPED): Transition(S.RETURNED),
}


class StagingMachine(StateMachine[StagingState, StagingEvent, StagingAction]):
    TABLE = STAGING_TABLE  # type: ignore[assignment]
    INITIAL = StagingState.VIEWED
    what = "push staging"
