"""A lease at the receiver: from ``open`` to the slot back in the pool.

The receiver commits every request's outcome, and commits it once:

- **delivered** when every layer has landed and its checksum is computed
  (``checked``). From then on the sender's ``abort`` loses: ``delivered``
  has already gone out on the control connection ahead of any answer, and
  the sender reports the request delivered (late, if its deadline passed).
- **aborted** when the sender's ``abort`` arrives first (answered with
  ``abort_ack``), when the decode engine releases it early (the sender is
  told ``abort`` and its ``abort_ack`` frees the slot), or when the sender's
  connection is lost before delivery.

Pool bytes are held in every state but ``FREED``, and only the ``FREE``
action gives them back: exactly once per lease.
"""

from __future__ import annotations

from enum import Enum, auto

from . import StateMachine, Transition


class LeaseState(Enum):
    FILLING = auto()  # leased; the sender's writes are landing
    LANDED = auto()  # every layer announced; the checksum is being combined
    HELD = auto()  # delivered; held for the decode engine
    ABORTING = auto()  # aborted by this side; the sender's writes may still land
    FREED = auto()  # the slot is back in the pool


class LeaseEvent(Enum):
    ALL_LANDED = auto()  # the last layer's immediate
    CHECKED = auto()  # the checksum is computed: delivered
    CHECKED_DISCARD = auto()  # the same, for a request nobody consumes (experiments)
    SENDER_ABORT = auto()  # the sender's abort (its own writes have completed)
    SENDER_ACK = auto()  # the sender's abort_ack: none of its writes can land any more
    ENGINE_RELEASE = auto()  # a decode engine released it
    SESSION_LOST = auto()  # the sender's connection is gone: no write can land any more
    RECLAIM = auto()  # its engine died, or nobody claimed it within the TTL


# REVOKE_KEY: the sender's key for the slot ends (every byte has landed, so
# no legitimate write is left). FREE returns the slot, after revoking the
# key if that has not happened yet.
LeaseAction = Enum("LeaseAction", "SEND_DELIVERED SEND_ABORT SEND_ABORT_ACK NOTIFY_COMPLETE "
                   "NOTIFY_FAILED REVOKE_KEY FREE")


class Outcome(Enum):
    PENDING = auto()
    DELIVERED = auto()
    ABORTED = auto()


S, E, A = LeaseState, LeaseEvent, LeaseAction

_ABORT_NOW = Transition(S.FREED, (A.SEND_ABORT_ACK, A.NOTIFY_FAILED, A.FREE))
_RELEASE_EARLY = Transition(S.ABORTING, (A.SEND_ABORT, A.NOTIFY_FAILED))
_LOST_EARLY = Transition(S.FREED, (A.NOTIFY_FAILED, A.FREE))

LEASE_TABLE: dict[tuple[LeaseState, LeaseEvent], Transition[LeaseState, LeaseAction]] = {
    (S.FILLING, E.ALL_LANDED): Transition(S.LANDED, (A.REVOKE_KEY,)),
    (S.LANDED, E.CHECKED): Transition(S.HELD, (A.SEND_DELIVERED, A.NOTIFY_COMPLETE)),
    (S.LANDED, E.CHECKED_DISCARD): Transition(S.FREED, (A.SEND_DELIVERED, A.FREE)),
    (S.FILLING, E.SENDER_ABORT): _ABORT_NOW,
    (S.LANDED, E.SENDER_ABORT): _ABORT_NOW,
    # Delivered stands: the sender hears ``delivered``, sent before this arrived.
    (S.HELD, E.SENDER_ABORT): Transition(S.HELD),
    # Both sides aborted at once: the sender's abort is the ack ours waits for.
    (S.ABORTING, E.SENDER_ABORT): Transition(S.FREED, (A.FREE,)),
    (S.ABORTING, E.SENDER_ACK): Transition(S.FREED, (A.FREE,)),
    (S.FILLING, E.ENGINE_RELEASE): _RELEASE_EARLY,
    (S.LANDED, E.ENGINE_RELEASE): _RELEASE_EARLY,
    (S.HELD, E.ENGINE_RELEASE): Transition(S.FREED, (A.FREE,)),
    (S.ABORTING, E.ENGINE_RELEASE): Transition(S.ABORTING),
    (S.FILLING, E.SESSION_LOST): _LOST_EARLY,
    (S.LANDED, E.SESSION_LOST): _LOST_EARLY,
    (S.ABORTING, E.SESSION_LOST): Transition(S.FREED, (A.FREE,)),
    (S.HELD, E.SESSION_LOST): Transition(S.HELD),
    (S.HELD, E.RECLAIM): Transition(S.FREED, (A.FREE,)),
}

_DELIVERING = {E.CHECKED, E.CHECKED_DISCARD}


class LeaseMachine(StateMachine[LeaseState, LeaseEvent, LeaseAction]):
    TABLE = LEASE_TABLE  # type: ignore[assignment]
    INITIAL = LeaseState.FILLING
    what = "lease"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.outcome = Outcome.PENDING

    @property
    def holds_bytes(self) -> bool:
        return self.state is not LeaseState.FREED

    @property
    def arriving(self) -> bool:
        return self.state in (LeaseState.FILLING, LeaseState.LANDED)

    def entered(self, before: LeaseState, event: LeaseEvent) -> None:
        if self.outcome is not Outcome.PENDING:
            return
        if event in _DELIVERING:
            self.outcome = Outcome.DELIVERED
        elif self.state in (LeaseState.ABORTING, LeaseState.FREED):
            self.outcome = Outcome.ABORTED
